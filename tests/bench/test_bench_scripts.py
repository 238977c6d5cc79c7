"""The benchmark scripts still run (tiny sizes, CPU): a newcomer's one command must not rot."""
import json
import os
import sys
from pathlib import Path

import pytest
import warm_python
from moeutil import bench_module

pytestmark = pytest.mark.slow  # each runs a script and its process worlds

ROOT = Path(__file__).resolve().parents[2]


def test_convert_bench_runs_and_reports_every_step(tmp_path):
    p = warm_python.run([sys.executable, str(ROOT / "bench" / "convert.py"), "--workdir", str(tmp_path), "--size-gib",
                         "0.004", "--shard-gib", "0.002", "--hidden", "128", "--intermediate", "128", "--repeat", "1",
                         "--only", "cp,start-up,fp8-block,int4-group,shard,repack", "--json",
                         "--idle-wait", "0", "--retries", "0", "--cold-input"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["step"]: r for r in json.loads(p.stdout)["rows"]}
    assert set(rows) == {"cp", "start-up", "fp8-block", "int4-group", "shard", "repack"}
    assert all(r["seconds"] > 0 and r["peak_rss_mb"] > 0 for r in rows.values())
    assert rows["fp8-block"]["after_startup_s"] is not None and rows["cp"]["after_startup_s"] is None


def test_cold_input_evicts_the_files_and_says_what_stayed(tmp_path):
    """--cold-input drops just the checkpoint's pages (no root needed): a file written and read
    is cached before and not after; --cold with it is refused."""
    convert = bench_module("convert")
    f = tmp_path / "model.safetensors"
    f.write_bytes(os.urandom(4 << 20))
    f.read_bytes()
    before = convert.cached_share([f])
    if before is None:
        pytest.skip("no mincore here: cached pages cannot be counted")
    if before < 0.9:
        pytest.skip(f"the page cache kept only {before:.0%} of a file just read")
    after = convert.evict([f])
    if after == 1.0:
        pytest.skip("this file system keeps its pages (tmpfs: the pages are the file)")
    assert after == 0.0
    p = warm_python.run([sys.executable, str(ROOT / "bench" / "convert.py"), "--cold", "--cold-input"], timeout=60)
    assert p.returncode == 2 and "give one" in p.stderr


def test_dispatch_bench_runs_on_gloo(tmp_path):
    p = warm_python.run([sys.executable, str(ROOT / "bench" / "dispatch_gpu.py"), "--backend", "gloo", "--ep", "2",
                         "--dp", "2", "--tokens", "8", "--hidden", "128", "--experts", "4", "--top-k", "2",
                         "--warmup", "0", "--iters", "1", "--out", str(tmp_path)], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads((tmp_path / "dispatch_gpu.json").read_text())
    for name in ("all2all", "allgather"):
        row = result["max_over_ranks"][name]
        assert row["dispatch_bytes"] > 0 and row["ratio"] > 0
    assert result["max_over_ranks"]["all2all"]["ratio_exact"] > 0
    if os.environ.get("TRITON_INTERPRET") == "1":  # a CUDA host's gloo ranks cannot run the kernels on CPU
        assert "host time per call" in p.stdout  # the launch-cost loop runs the kernels (interpreted here)
    assert "all2all" in p.stdout and "ratio" in p.stdout


def test_verify_bench_runs_on_gloo(tmp_path):
    out = tmp_path / "verify_gpu.json"
    p = warm_python.run([sys.executable, str(ROOT / "bench" / "verify_gpu.py"), "--backend", "gloo", "--ep", "2",
                         "--dp", "1", "--experts", "8", "--hidden", "128", "--intermediate", "128", "--top-k", "2",
                         "--tokens", "16", "--warmup", "0", "--repeat", "1", "--backends",
                         "all2all:torch,allgather:torch", "--workdir", str(tmp_path / "w"), "--json", str(out)],
                        timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [v["options"]["dispatch"] for v in result["verify"]] == ["all2all", "allgather"]
    assert "PASS" in p.stdout and "FAIL" not in p.stdout
    assert result["raw"]["a2a_exact_us"]["0/1/dispatch_split_bytes"] > 0  # all2all's own splits, replayed
