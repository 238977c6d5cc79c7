"""The torch executor's facts of a ``shard`` plan, against which a byte copy of a quantized
checkpoint is checked before any of its files is committed (``moetool.convert.byte_executor``).

The byte copy takes each format's tensors on trust (``moetool.convert.byte_plan``); this module
builds the torch executor's plan of the same shard and reports what must agree: the header of
every file, the manifest's entries (the format and its parameters come from here: the byte copy
never imports the format registry), the JSON files, and the bytes of one expert slice per
sampled group (``Executor`` converting as it would). It imports torch, so a byte copy started
without torch runs it in a child process while it copies (``python -m moetool.convert.byte_check
ARGS_JSON``, printing the facts as JSON): on an H100 host its 4 s of import overlap the copy
instead of preceding it; ``shard_facts`` runs in the calling process where torch is loaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import sys
from pathlib import Path

from moetool.convert.conversion import build_shard_plan
from moetool.convert.plan import ExpertLinear, Stacked
from moetool.convert.planning import plan_placements
from moetool.convert.torch_executor import ErrorStats, Executor, Source
from moetool.model.families import describe
from moetool.read.checkpoint import open_checkpoint
from moetool.read.safetensors import tensor_bytes

_PR_SET_PDEATHSIG = 1


def shard_facts(source: str, *, ep: int, placement: str, redundant: int, expert_load: str | None, layout: str,
                max_shard_size: int | None, samples: list[list]) -> dict:
    """The torch plan of ``shard`` with these options: {"headers": {file: sha256 of its header},
    "manifest_extra", "json_files", "samples": [[sha256 of each tensor of expert slice 0] for
    each (file, group index) of ``samples``]}."""
    with open_checkpoint(source) as ckpt:
        spec = describe(ckpt.config, ckpt.tensors)
        placements = plan_placements(spec, ep, placement, redundant, Path(expert_load) if expert_load else None)
        src = Source(ckpt, spec, None, ErrorStats())
        plan = build_shard_plan(src, ep, placements, layout, max_shard_size, placement, redundant)
        files = {pf.name: pf for pf in plan.files}
        executor = Executor([src], workers=1)
        shas = []
        for name, index in samples:
            g = files[name].groups[index]
            if isinstance(g, Stacked):
                tensors = list(executor._stacked_slice(g, 0, g.experts[0]).values())
            elif isinstance(g, ExpertLinear):
                tensors = executor._produce(g)
            else:
                tensors = []
            shas.append([hashlib.sha256(tensor_bytes(t)).hexdigest() for t in tensors])
        return {"headers": {pf.name: hashlib.sha256(pf.header()).hexdigest() for pf in plan.files if not pf.same_as},
                "manifest_extra": plan.manifest_extra, "json_files": plan.json_files, "samples": shas}


def main() -> None:
    """The child process: ends with its parent (a byte copy stopped by SIGKILL leaves no
    importing process behind); its facts as one JSON line, or exit status 1 and the error."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        pass
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
