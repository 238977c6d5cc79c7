"""The order a verify run takes a checkpoint's bytes in, for reading them ahead: the embeddings,
each decoder layer in turn, then the rest (final norm, lm_head). Torch-free.
"""
from __future__ import annotations

import importlib.util
import os
import re
import threading
from pathlib import Path
from typing import Iterable

from moetool.read.checkpoint import Checkpoint, open_checkpoint
from moetool.read.prefetch import PREFETCH_SHARE, available_memory, read_ahead_ranges

#: (file, offset, length) of bytes to read
Range = tuple[Path, int, int]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: stage of the tensors before the first layer, and of those after the last
EMBED_STAGE, LAST_STAGE = -1, 1 << 30


def stage(name: str) -> int:
    """When a whole-model run takes the tensor ``name``: EMBED_STAGE for the embeddings, the
    decoder layer's index, LAST_STAGE for the rest (final norm, lm_head)."""
    if "embed_tokens" in name:
        return EMBED_STAGE
    m = _LAYER.search(name)
    return int(m.group(1)) if m else LAST_STAGE


def staged_ranges(ckpt: Checkpoint) -> list[tuple[int, Range]]:
    """(stage, (file, offset, length)) of every tensor of ``ckpt``, in stage order, file order
    within a stage."""
    infos = sorted(ckpt.tensors.values(), key=lambda t: (stage(t.name), t.file, t.begin))
    return [(stage(t.name), (Path(ckpt.root) / t.file, t.begin, t.end - t.begin)) for t in infos]


def read_order(ckpt: Checkpoint) -> list[Range]:
    """(file, offset, length) of every tensor of ``ckpt`` in the order a whole-model run takes them."""
    return [r for _, r in staged_ranges(ckpt)]


def verify_order(shard_roots: list[Path], ref: Checkpoint, layers: Iterable[int] | None) -> list[Range]:
    """What a verify run reads, in the order it reads it: stage by stage, the reference's
    tensors then every rank's (``shard_roots``: the rank folders); then the rest of the rank
    folders' ``*.safetensors`` files whole (their sha256 check reads every byte).

    ``layers``: the stages taken (MoE-only verify: its MoE layers), or None for every stage
    (--whole-model). A file hard-linked into several rank folders is read once."""
    keep = None if layers is None else set(layers)
    staged: list[tuple[int, int, Range]] = []
    whole: list[Path] = []
    staged += [(s, 0, r) for s, r in staged_ranges(ref) if keep is None or s in keep]
    for root in shard_roots:
        with open_checkpoint(root, ep_rank=True) as ckpt:
            staged += [(s, 1, r) for s, r in staged_ranges(ckpt) if keep is None or s in keep]
            whole += [Path(ckpt.root) / f for f in ckpt.files]
    staged.sort(key=lambda x: (x[0], x[1]))
    out: list[Range] = [r for _, _, r in staged]
    seen: set[tuple[int, int]] = set()
    for path in whole:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append((path, 0, st.st_size))
    return out


def package_files(name: str) -> list[Range]:
    """The code files of the installed package ``name`` (found, not imported): its ``*.py``,
    shared libraries and the programs in its ``bin`` folders; [] where it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    out: list[Range] = []
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        for root, _, files in sorted(os.walk(folder)):
            for f in sorted(files):
                if f.endswith(".py") or ".so" in f or os.path.basename(root) == "bin":
                    path = Path(root) / f
                    try:
                        out.append((path, 0, path.stat().st_size))
                    except OSError:
                        pass
    return out


def read_verify_inputs_ahead(jobs: list[tuple[Path, Path, Iterable[int] | None]],
                             stop: threading.Event | None = None, *, gpu: bool = False) -> threading.Thread | None:
    """Start reading what verify runs will read, in their order, into the page cache on a daemon
    thread (up to ``PREFETCH_SHARE`` of the memory available), until ``stop`` is set.
    ``jobs``: [(shard root, reference folder, the MoE-only run's layers or None for
    --whole-model)]. A hint: what cannot be opened here is left for the run to report.

    ``gpu``: the ranks run on GPUs, where Triton's files come first (the ranks load and compile
    with it, this process never does; they read it in small pieces, which a disk busy with
    the checkpoints serves seconds late)."""
    ranges: list[Range] = package_files("triton") if gpu else []
    try:
        for shards, ref, layers in jobs:
            rank_roots = sorted(p for p in Path(shards).iterdir() if p.is_dir() and p.name.startswith("rank-"))
            with open_checkpoint(Path(ref)) as ref_ckpt:
                ranges += verify_order(rank_roots, ref_ckpt, layers)
    except Exception:  # noqa: BLE001 - a hint only: the run itself names what is wrong
        return None
    return read_ahead_ranges(ranges, int(available_memory() * PREFETCH_SHARE), stop=stop)
