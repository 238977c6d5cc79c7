"""The disk's reads and writes while a command runs: /proc/diskstats sampled every --every
seconds, printed as GB/s read and written, requests in flight and % busy per interval.

    python bench/disk_timeline.py --cold --folder SRC -- cp -r SRC /tmp/out '&&' sync
    python bench/disk_timeline.py --cold --folder SRC -- python -m moetool quantize SRC OUT --fp8-block --device cuda

The disk is the one holding --folder (its whole-disk entry in /proc/diskstats). ``--cold``
drops the page cache first (root only). Clean up outputs before, not inside, the command: on a
disk mounted with ``discard`` removing GBs keeps it busy for seconds. Linux only.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

SECTOR = 512


def disk_of(folder: Path) -> str:
    """The /proc/diskstats name of the whole disk holding ``folder`` (vda, nvme0n1...)."""
    dev = os.stat(folder).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve(strict=True)
    if (node / "partition").exists():
        node = node.parent
    return node.name


def whole_disks(path: str = "/proc/diskstats") -> list[str]:
    """The names of the host's whole disks in ``path`` (those /sys/block lists; no loop or ram
    devices), or none where it cannot be read."""
    try:
        with open(path) as f:
            names = [line.split()[2] for line in f if len(line.split()) > 5]
    except OSError:
        return []
    return [n for n in names if Path(f"/sys/block/{n}").exists() and not n.startswith(("loop", "ram"))]


def read_stats(disks: str | list[str], path: str = "/proc/diskstats") -> tuple[int, int, int, int]:
    """(bytes read, bytes written, requests in flight, ms busy) so far of ``disks`` (one name or
    a list, summed; an empty list reads nothing)."""
    wanted = {disks} if isinstance(disks, str) else set(disks)
    if not wanted:
        return 0, 0, 0, 0
    total, seen = [0, 0, 0, 0], set()
    with open(path) as f:
        for line in f:
            fields = line.split()
            if fields[2] in wanted:
                seen.add(fields[2])
                for i, (col, unit) in enumerate(((5, SECTOR), (9, SECTOR), (11, 1), (12, 1))):
                    total[i] += int(fields[col]) * unit
    missing = wanted - seen
    if missing:
        raise SystemExit(f"{', '.join(sorted(missing))}: not in {path}")
    return tuple(total)


class DiskSampler:
    """(time, *read_stats(disks)) every ``every`` seconds on a thread, from its start until
    :meth:`stop` (which takes one more and returns them all)."""

    def __init__(self, disks: str | list[str], every: float):
        self.disks, self.samples = disks, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self.samples.append((time.perf_counter(), *read_stats(self.disks)))

    def _run(self, every: float) -> None:
        self._sample()
        while not self._stop.wait(every):
            self._sample()
        self._sample()

    def stop(self) -> list[tuple[float, int, int, int, int]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def intervals(samples: list[tuple[float, int, int, int, int]]) -> list[dict]:
    """Per pair of samples (time, read, written, in flight, busy ms): the end time and the rates."""
    rows = []
    for (ta, ra, wa, _, ba), (tb, rb, wb, queue, bb) in zip(samples, samples[1:]):
        dt = max(tb - ta, 1e-9)
        rows.append({"t": tb - samples[0][0], "read_gbs": (rb - ra) / dt / 1e9, "write_gbs": (wb - wa) / dt / 1e9,
                     "queue": queue, "busy": (bb - ba) / dt / 10})
    return rows


def render(rows: list[dict], per_line: int = 4) -> str:
    cells = [f"{r['t']:6.2f}s r{r['read_gbs']:5.2f} w{r['write_gbs']:5.2f} q{r['queue']:3d} u{r['busy']:4.0f}%"
             for r in rows]
    return "\n".join(" | ".join(cells[i:i + per_line]) for i in range(0, len(cells), per_line))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", type=Path, default=Path("."), help="a folder on the disk to watch")
    ap.add_argument("--every", type=float, default=0.25, help="seconds between samples")
    ap.add_argument("--cold", action="store_true", help="drop the page cache first (root only)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command (after --), run by the shell")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given")
    disk = disk_of(args.folder)
    if args.cold:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    sampler = DiskSampler(disk, args.every)
    code = subprocess.run(" ".join(command), shell=True).returncode
    samples = sampler.stop()
    first, last = samples[0], samples[-1]
    print(f"{disk}: {last[0] - first[0]:.2f} s, exit {code}, read {(last[1] - first[1]) / 1e9:.2f} GB, "
          f"written {(last[2] - first[2]) / 1e9:.2f} GB")
    print(render(intervals(samples)))
    return code


if __name__ == "__main__":
    sys.exit(main())
