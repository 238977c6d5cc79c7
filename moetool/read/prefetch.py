"""Ask the kernel to read parts of a checkpoint into the page cache while this process does
something else (imports torch: 4-5 s on a GPU host, time the disk would otherwise idle).

``POSIX_FADV_WILLNEED`` queues the reads in the kernel, so the thread that asks holds no
GIL while they run and no process memory fills. A hint only: every failure is ignored, and
the reads that follow find the bytes in memory or read them as they would have. Torch-free.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterable

from moetool.errors import MoetoolError
from moetool.model.families import describe
from moetool.read.checkpoint import expert_tensor_names, open_checkpoint

#: at most this share of the memory available, and at most ``PREFETCH_MAX`` bytes, are asked
#: for: enough to cover a start-up, little enough that nothing asked for is evicted unread
PREFETCH_SHARE = 0.25
PREFETCH_MAX = 8 << 30


def available_memory() -> int:
    """MemAvailable (Linux), or 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def advise_ranges(ranges: Iterable[tuple[Path, int, int]], budget: int | None = None) -> threading.Thread | None:
    """On a daemon thread, ``POSIX_FADV_WILLNEED`` each (file, offset, length) in order until
    ``budget`` bytes (default: ``PREFETCH_SHARE`` of the memory available, at most
    ``PREFETCH_MAX``) have been asked for. Returns the thread, or None where there is no fadvise."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return None
    ranges = list(ranges)
    left = budget if budget is not None else min(int(available_memory() * PREFETCH_SHARE), PREFETCH_MAX)

    def run() -> None:
        nonlocal left
        fds: dict[Path, int] = {}
        try:
            for path, offset, length in ranges:
                if left <= 0:
                    return
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                length = min(length, left)
                advise(fds[path], offset, length, os.POSIX_FADV_WILLNEED)
                left -= length
        except OSError:
            return
        finally:
            for fd in fds.values():
                os.close(fd)

    thread = threading.Thread(target=run, name="moetool-prefetch", daemon=True)
    thread.start()
    return thread


def expert_ranges(source: str | os.PathLike, layers: Iterable[int] | None = None) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of the routed experts' tensors of the MoE layers ``layers`` (all
    when None) of a local checkpoint, in the order a pass over them reads: layer by layer, each
    layer's in file order, adjacent tensors merged. [] for anything that is not a readable local
    checkpoint (a Hub id, a bad folder: the command itself says what is wrong)."""
    if not Path(source).is_dir():
        return []
    try:
        with open_checkpoint(source) as ckpt:
            spec = describe(ckpt.config, ckpt.tensors)
            wanted = set(layers) if layers is not None else None
            out: list[tuple[Path, int, int]] = []
            for layer in spec.moe_layers:
                if wanted is not None and layer.index not in wanted:
                    continue
                infos = sorted((ckpt.info(n) for n in expert_tensor_names(ckpt, layer)), key=lambda i: (i.file, i.begin))
                for info in infos:
                    path = ckpt.root / info.file
                    if out and out[-1][0] == path and out[-1][1] + out[-1][2] == info.begin:
                        out[-1] = (path, out[-1][1], out[-1][2] + info.nbytes)
                    else:
                        out.append((path, info.begin, info.nbytes))
            return out
    except (MoetoolError, OSError, ValueError, KeyError):
        return []
