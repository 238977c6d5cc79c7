"""The torch executor's facts of a ``shard`` plan, against which a byte copy of a quantized
checkpoint is checked before any of its files is committed (``moetool.convert.byte_executor``).

The byte copy takes each format's tensors on trust (``moetool.convert.byte_plan``); this module
says what the torch executor would write instead. The torch part is the checkpoint's *profile*
(:func:`format_profile`: the format and its parameters from the registry, and what the torch
executor writes for one expert of each layer shape, the bytes of expert 0 sampled); the plan of
the shard with its options is then built from it without torch (``moetool.convert.profile``):
every file's header, the manifest's entries, the JSON files and the sampled slices' sha256.
``quantize`` stores its output's profile in its manifest (:func:`checkpoint_profile`), so a
shard of it needs no torch; otherwise a byte copy started without torch runs this module in a
child process while it copies (``python -m moetool.convert.byte_check ARGS_JSON``, printing the
facts as JSON): on an H100 host its 4-10 s of import overlap the copy instead of preceding it;
``shard_facts`` runs in the calling process where torch is loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moetool.convert.byte_plan import why_not_byte_copy
from moetool.convert.profile import (SAMPLED_EXPERT, WHICH, code_digest, inputs_digest, plan_facts, probe_key,
                                     sampled_layers, sealed)
from moetool.convert.torch_executor import ErrorStats, Planner, Source
from moetool.errors import MoetoolError
from moetool.model.families import ModelSpec, describe
from moetool.read.checkpoint import Checkpoint, open_checkpoint
from moetool.read.prefetch import end_with_parent
from moetool.read.safetensors import DTYPE_NAMES, tensor_bytes


def format_profile(ckpt: Checkpoint, spec: ModelSpec) -> dict:
    """The profile of a quantized checkpoint (``moetool.convert.profile``): {"code", "inputs"
    (the digests it is keyed on), "format", "format_params", "layers" (the layer sampled for
    each shape), "linears" and "samples" by ``probe_key``: what the torch executor's shard
    writes for expert 0 of that layer (per-expert gate / up / down, stacked w13 / w2) as
    [[suffix, dtype name, shape], ...] and the sha256 of each tensor's bytes; "digest"}."""
    src = Source(ckpt, spec, None, ErrorStats())
    Planner([src]).validate_experts(src)
    layers = {m.index: m for m in spec.moe_layers}
    sampled = sampled_layers(spec)

    def probe(item: tuple[int, str]) -> tuple[list, list]:
        layer, which = layers[item[0]], item[1]
        if which == "w13":
            lin = src.expert_w13(layer, SAMPLED_EXPERT)
        else:  # w2 is the down linear (``Executor._stacked_slice``)
            lin = src.expert_role(layer, SAMPLED_EXPERT, "down" if which == "w2" else which)
        return ([[s, DTYPE_NAMES[t.dtype], list(t.shape)] for s, t in lin.items()],
                [hashlib.sha256(tensor_bytes(t)).hexdigest() for t in lin.values()])

    # reads and hashes on threads (both release the GIL): after quantize's O_DIRECT writes the
    # output is not in the page cache, and one thread took 0.2-0.26 s of an H100 host's quantize
    items = [(index, which) for index in sampled.values() for which in WHICH]
    with ThreadPoolExecutor(min(4, len(items)), thread_name_prefix="moetool-profile") as pool:
        found = dict(zip(items, pool.map(probe, items)))
    linears = {probe_key(layers[i], w): found[(i, w)][0] for i, w in items}
    samples = {probe_key(layers[i], w): found[(i, w)][1] for i, w in items}
    return sealed({"code": code_digest(), "inputs": inputs_digest(ckpt), "format": src.out_fmt.name,
                   "format_params": {k: v for k, v in vars(src.out_fmt).items() if k != "suffixes"},
                   "layers": sampled, "linears": linears, "samples": samples})


def checkpoint_profile(root: Path) -> dict | None:
    """The profile of the quantized checkpoint just written at ``root`` (its files, config and
    index in place), for its manifest; None where a shard of it would not be a byte copy, or
    the folder does not open as a checkpoint (other files beside ours)."""
    try:
        with open_checkpoint(root) as ckpt:
            spec = describe(ckpt.config, ckpt.tensors)
            if all(why_not_byte_copy(ckpt, spec, quantized=True, layout=layout) is not None
                   for layout in ("stacked", "per-expert")):
                return None
            return format_profile(ckpt, spec)
    except MoetoolError:  # the shard's torch path says why, when it runs
        return None


def shard_facts(source: str, **options) -> dict | None:
    """The torch plan of ``shard`` with these options (``moetool.convert.profile.plan_facts``)."""
    with open_checkpoint(source) as ckpt:
        spec = describe(ckpt.config, ckpt.tensors)
        return plan_facts(ckpt, spec, format_profile(ckpt, spec), **options)


def main() -> None:
    """The child process: ends with its parent (a byte copy stopped by SIGKILL leaves no
    importing process behind); its facts as one JSON line, or exit status 1 and the error."""
    end_with_parent()
    try:
        facts = shard_facts(**json.loads(sys.argv[1]))
    except Exception as e:  # the torch path will raise it again, in the parent, as its error
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        exit_now(1)
    print(json.dumps(facts, default=str))
    exit_now(0)


def exit_now(status: int) -> None:
    """Leave once the answer is flushed, without interpreter shutdown: the parent waits for
    this process to end, and tearing torch down took 0.2 s here and 1.5 s on an H100 host with
    a cold page cache (its libraries' exit code read back from the disk)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
