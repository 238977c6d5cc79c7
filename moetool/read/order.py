"""The order a verify run takes a checkpoint's bytes in, for reading them ahead: the embeddings,
each decoder layer in turn, then the rest (final norm, lm_head). Torch-free.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import threading
from bisect import bisect_left
from itertools import accumulate
from pathlib import Path

from moetool.errors import MoetoolError
from moetool.read.checkpoint import Checkpoint, open_checkpoint
from moetool.read.prefetch import PREFETCH_SHARE, CacheFiller, available_memory

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


#: the stage of the rank files read whole at the end (for their sha256 check)
WHOLE_FILES_STAGE = LAST_STAGE + 1


def layer_steps(layers: list[int]) -> dict[int, int]:
    """{layer: its step} of a MoE-only run: its place in the run's list of layers (a layer
    asked for twice keeps its first place, as the run checks it once)."""
    return {layer: k for k, layer in enumerate(dict.fromkeys(layers))}


def _step_of(layers: list[int] | None):
    """stage -> step (None: a stage the run does not take): ``layer_steps`` of a MoE-only run's
    layers, or the stage itself for --whole-model (``layers`` None)."""
    return (lambda s: s) if layers is None else layer_steps(layers).get


def verify_order(shard_roots: list[Path], ref: Checkpoint, layers: list[int] | None) -> list[tuple[int, Range]]:
    """What a verify run reads, in the order it reads it, each with its step: step by step,
    the reference's tensors then every rank's (``shard_roots``: the rank folders) for MoE-only
    verify, whose parent reads the reference while the ranks load; every rank's then the
    reference's for --whole-model, whose ranks run each row's converted side (a collective:
    every rank's experts) before its reference side; then the rank folders' ``*.safetensors``
    files whole (their sha256 check reads every byte), step WHOLE_FILES_STAGE.

    ``layers``: the layers the run takes, in its order (MoE-only verify; a layer's step is its
    place in the list), or None for every stage in stage order (--whole-model; the step is
    the stage). A file hard-linked into several rank folders is read once."""
    step = _step_of(layers)
    ref_side, rank_side = (0, 1) if layers is not None else (1, 0)
    staged: list[tuple[int, int, Range]] = []
    whole: list[Path] = []
    staged += [(step(s), ref_side, r) for s, r in staged_ranges(ref) if step(s) is not None]
    for root in shard_roots:
        with open_checkpoint(root, ep_rank=True) as ckpt:
            staged += [(step(s), rank_side, r) for s, r in staged_ranges(ckpt) if step(s) is not None]
            whole += [Path(ckpt.root) / f for f in ckpt.files]
    staged.sort(key=lambda x: (x[0], x[1]))
    out: list[tuple[int, Range]] = [(s, r) for s, _, r in staged]
    seen: set[tuple[int, int]] = set()
    for path in whole:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append((WHOLE_FILES_STAGE, (path, 0, st.st_size)))
    return out


class PacedReadAhead:
    """Reads ranges into the page cache in their order on a daemon thread, at most ``window``
    bytes past what the run still needs: a model larger than memory is read once, just ahead
    of its use (unpaced, the reads would run ahead, evict pages not used yet, and the run
    would read them again).

    ``keyed``: [(key, range)], keys ascending (a run's (job, stage)). ``reached(key)``: the run
    is done with every range before the first one of ``key``. A hint: a read that fails
    ends it quietly."""

    def __init__(self, keyed: list[tuple[tuple, Range]], window: int, stop: threading.Event | None = None):
        self.window = window
        keyed = _merged(keyed)
        self._keys = [k for k, _ in keyed]
        self._ranges = [r for _, r in keyed]
        self._starts = list(accumulate((r[2] for r in self._ranges), initial=0))
        self._consumed = 0
        self._cond = threading.Condition()
        self._stop = stop if stop is not None else threading.Event()
        #: bytes handed to the reader so far (tests watch it stay within the window)
        self.issued = 0
        self.thread = threading.Thread(target=self._run, name="moetool-read-ahead", daemon=True)
        self.thread.start()

    def reached(self, key: tuple) -> None:
        with self._cond:
            self._consumed = max(self._consumed, self._starts[bisect_left(self._keys, key)])
            self._cond.notify_all()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            filler = CacheFiller()
        except OSError:
            return
        try:
            for i, (path, offset, length) in enumerate(self._ranges):
                with self._cond:
                    # a range larger than the window alone is read once it is the next one needed
                    while (self._starts[i + 1] - self._consumed > self.window and self._starts[i] > self._consumed
                           and not self._stop.is_set()):
                        self._cond.wait(0.5)
                if self._stop.is_set():
                    return
                self.issued = self._starts[i + 1]
                if self._starts[i + 1] <= self._consumed:
                    continue  # the run is past it
                try:
                    filler.fill(path, offset, length, self._stop)
                except OSError:
                    continue
        finally:
            filler.close()


def _merged(keyed: list[tuple[tuple, Range]]) -> list[tuple[tuple, Range]]:
    """Ranges of one key that follow each other in a file, as one (a tensor each: 100k of
    them in a DeepSeek-V3 checkpoint stored per expert)."""
    out: list[tuple[tuple, Range]] = []
    for key, (path, offset, length) in keyed:
        if out and out[-1][0] == key and out[-1][1][0] == path and sum(out[-1][1][1:]) == offset:
            last = out[-1][1]
            out[-1] = (key, (path, last[1], last[2] + length))
        else:
            out.append((key, (path, offset, length)))
    return out


class Progress:
    """How far a run has come (its step: ``verify_order``'s), for work paced by it: the sha256
    of a rank's files, each hashed as the run comes to it (read once, with the run's reads,
    instead of from the start: beyond memory, hashed bytes would be evicted before the run
    reads them, and read twice)."""

    #: steps a file may be hashed ahead of the run
    AHEAD = 1

    def __init__(self):
        self.step = float("-inf")
        self._cond = threading.Condition()

    def reached(self, step: float) -> None:
        with self._cond:
            self.step = max(self.step, step)
            self._cond.notify_all()

    def finish(self) -> None:
        """The run is over, or left: nothing waits any more."""
        self.reached(float("inf"))

    def wait_for(self, step: float) -> None:
        with self._cond:
            while self.step < step - self.AHEAD:
                self._cond.wait()


def file_steps(ckpt: Checkpoint, layers: list[int] | None) -> dict[str, float]:
    """{file of ``ckpt``: the first step that reads it} (steps as ``verify_order``'s); -inf for
    a file no step reads (the sha256 check alone reads it)."""
    step = _step_of(layers)
    first: dict[str, float] = {f: float("-inf") for f in ckpt.files}
    taken: dict[str, float] = {}
    for t in ckpt.tensors.values():
        k = step(stage(t.name))
        if k is not None:
            taken[t.file] = min(taken.get(t.file, float("inf")), k)
    first.update(taken)
    return first


def read_ahead_window() -> int:
    """Bytes a verify run may read ahead of its use: ``PREFETCH_SHARE`` of the memory
    available, or MOETOOL_READ_AHEAD_MB."""
    forced = os.environ.get("MOETOOL_READ_AHEAD_MB")
    if forced:
        try:
            mib = float(forced)
        except ValueError:
            mib = math.nan
        if not (math.isfinite(mib) and mib > 0):
            raise MoetoolError(f"MOETOOL_READ_AHEAD_MB={forced!r}: expected a positive number of MiB")
        return int(mib * 2**20)
    return int(available_memory() * PREFETCH_SHARE)


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


def read_verify_inputs_ahead(jobs: list[tuple[Path, Path, list[int] | None]],
                             stop: threading.Event | None = None, *, gpu: bool = False) -> PacedReadAhead | None:
    """Start reading what verify runs will read, in their order, into the page cache (keys
    (job, step): see ``verify_order``; paced by ``reached`` within ``read_ahead_window()``),
    until ``stop`` is set. ``jobs``: [(shard root, reference folder, the MoE-only run's layers
    in its order, or None for --whole-model)]. A hint: what cannot be opened here is left for the run to report.

    ``gpu``: the ranks run on GPUs, where Triton's files come first (the ranks load and compile
    with it, this process never does; they read it in small pieces, which a disk busy with
    the checkpoints serves seconds late)."""
    keyed: list[tuple[tuple, Range]] = [((-1, EMBED_STAGE), r) for r in package_files("triton")] if gpu else []
    try:
        for j, (shards, ref, layers) in enumerate(jobs):
            rank_roots = sorted(p for p in Path(shards).iterdir() if p.is_dir() and p.name.startswith("rank-"))
            with open_checkpoint(Path(ref)) as ref_ckpt:
                keyed += [((j, s), r) for s, r in verify_order(rank_roots, ref_ckpt, layers)]
    except Exception:  # noqa: BLE001 - a hint only: the run itself names what is wrong
        return None
    if getattr(os, "sendfile", None) is None:
        return None
    return PacedReadAhead(keyed, read_ahead_window(), stop)
