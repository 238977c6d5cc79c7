"""bench/disk_timeline.py: the rates from /proc/diskstats-shaped counters, and a real run."""
import shlex
import sys
from pathlib import Path

import pytest
from moeutil import bench_module

ROOT = Path(__file__).resolve().parents[2]
dt = bench_module("disk_timeline")


def test_stats_are_read_for_the_named_disk_only(tmp_path):
    stats = tmp_path / "diskstats"
    # major minor name reads merged sectors-read ms writes merged sectors-written ms in-flight io-ms ...
    stats.write_text(" 252 0 vda 10 0 2048 5 20 0 4096 7 3 900 0 0 0 0\n"
                     " 252 1 vda1 1 0 8 1 1 0 8 1 0 1 0 0 0 0\n")
    assert dt.read_stats("vda", str(stats)) == (2048 * 512, 4096 * 512, 3, 900)
    assert dt.read_stats("vda1", str(stats)) == (8 * 512, 8 * 512, 0, 1)
    with pytest.raises(SystemExit, match="vdb: not in"):
        dt.read_stats("vdb", str(stats))
    assert dt.read_stats(["vda", "vda1"], str(stats)) == (2056 * 512, 4104 * 512, 3, 901)  # summed
    assert dt.read_stats([], str(stats)) == (0, 0, 0, 0)
    with pytest.raises(SystemExit, match="vdb: not in"):
        dt.read_stats(["vda", "vdb"], str(stats))
    assert dt.whole_disks(str(tmp_path / "missing")) == []


def test_rates_per_interval():
    samples = [(10.0, 0, 0, 0, 0), (10.5, 10**9, 0, 4, 250), (11.0, 10**9, 2 * 10**9, 31, 750)]
    rows = dt.intervals(samples)
    assert [(r["t"], r["read_gbs"], r["write_gbs"], r["queue"], r["busy"]) for r in rows] == [
        (0.5, 2.0, 0.0, 4, 50.0), (1.0, 0.0, 4.0, 31, 100.0)]
    assert dt.render(rows).count("|") == 1 and "r 2.00 w 0.00 q  4 u  50%" in dt.render(rows)


def test_a_command_s_writes_are_counted(tmp_path, capsys):
    try:
        dt.disk_of(tmp_path)
    except OSError:
        pytest.skip("no block device behind the temporary folder (overlay, tmpfs)")
    out = tmp_path / "written"
    script = f"import os; f = os.open({str(out)!r}, os.O_WRONLY | os.O_CREAT); os.write(f, bytes(8 << 20)); os.fsync(f)"
    code = dt.main(["--folder", str(tmp_path), "--every", "0.05", "--", sys.executable, "-c", shlex.quote(script)])
    text = capsys.readouterr().out
    assert code == 0 and out.stat().st_size == 8 << 20
    written = float(text.split("written ")[1].split(" GB")[0])
    assert written >= 0.008, text  # at least the 8 MiB fsynced (other writers may add)
    assert dt.main(["--folder", str(tmp_path), "--", "exit 3"]) == 3
