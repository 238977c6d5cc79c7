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


def read_stats(disk: str, path: str = "/proc/diskstats") -> tuple[int, int, int, int]:
    """(bytes read, bytes written, requests in flight, ms busy) of ``disk`` so far."""
    with open(path) as f:
        for line in f:
            fields = line.split()
            if fields[2] == disk:
                return (int(fields[5]) * SECTOR, int(fields[9]) * SECTOR, int(fields[11]), int(fields[12]))
    raise SystemExit(f"{disk}: not in {path}")


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
    samples, stop = [], threading.Event()

    def sample() -> None:
        while True:
            samples.append((time.perf_counter(), *read_stats(disk)))
            if stop.wait(args.every):
                samples.append((time.perf_counter(), *read_stats(disk)))
                return

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = subprocess.run(" ".join(command), shell=True).returncode
    stop.set()
    sampler.join()
    first, last = samples[0], samples[-1]
    print(f"{disk}: {last[0] - first[0]:.2f} s, exit {code}, read {(last[1] - first[1]) / 1e9:.2f} GB, "
          f"written {(last[2] - first[2]) / 1e9:.2f} GB")
    print(render(intervals(samples)))
    return code


if __name__ == "__main__":
    sys.exit(main())
