"""``moetool verify`` from the command line, on CPU (gloo): missing, truncated and modified files
named on one error line, the JSON report and the exit status, the all2all transports, and the
same command under torchrun. The model and its shards are the session's (``verify_chain``,
``verify_shards`` in tests/conftest.py); a test that damages shards copies them first.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each command starts rank processes

#: tokens per dp group (the all2all dispatcher's kernels, interpreted on CPU, cost time per token)
TOKENS = 16


def test_missing_truncated_and_modified_files_are_named(verify_chain, verify_shards, tmp_path, cli):
    model = verify_chain[0]
    base = verify_shards("fp8-block", 2, layout="stacked")
    target = "rank-00001-of-00002/model-00002-of-00002.safetensors"
    if not (base / target).exists():
        target = sorted(p.relative_to(base).as_posix() for p in (base / "rank-00001-of-00002").glob("*.safetensors"))[-1]

    missing = tmp_path / "missing"
    shutil.copytree(base, missing)
    (missing / target).unlink()
    r = cli("verify", missing, "--ref", model, "--ep", "2", "--tokens", TOKENS)
    assert r.code == 2 and r.error_line == f"{missing / target}: missing (listed in {missing}/manifest.json)"

    truncated = tmp_path / "truncated"
    shutil.copytree(base, truncated)
    size = (truncated / target).stat().st_size
    with open(truncated / target, "r+b") as f:
        f.truncate(size - 100)
    r = cli("verify", truncated, "--ref", model, "--ep", "2", "--tokens", TOKENS)
    assert r.code == 2 and "truncated or modified" in r.error_line and str(truncated / target) in r.error_line

    modified = tmp_path / "modified"  # same size, other bytes: the rank's sha256 check
    shutil.copytree(base, modified)
    with open(modified / target, "r+b") as f:
        f.seek(size - 10)
        f.write(b"\x01" * 10)
    r = cli("verify", modified, "--ref", model, "--ep", "2", "--tokens", TOKENS)
    assert r.code == 2
    assert r.error_line.startswith("rank 1 failed:") and "sha256 does not match" in r.error_line

    r = cli("verify", base, "--ref", model, "--ep", "4")
    assert r.code == 2 and r.error_line == f"--ep 4: the shards in {base} were made for ep 2"


def test_cli_report_json_and_exit_status(verify_chain, verify_shards, cli, monkeypatch):
    import moetool.verify.driver as driver

    model = verify_chain[0]
    sh = verify_shards("int4-group", 2, layout="stacked")
    asked, reached = [], []  # the run reads ahead what it takes, in its order, paced by the layers
    real = driver.read_verify_inputs_ahead                  # compared, and stops reading when it ends

    def read_ahead(jobs, stop, gpu):
        asked.append((jobs, stop))
        ahead = real(jobs, stop, gpu=gpu)
        move = ahead.reached
        ahead.reached = lambda key: reached.append(key) or move(key)
        return ahead

    monkeypatch.setattr(driver, "read_verify_inputs_ahead", read_ahead)
    r = cli("verify", sh, "--ref", model, "--ep", "2", "--tokens", TOKENS, "--layers", "2", "--json",
            "--warmup", "1", "--repeat", "2", "--all2all", "all2all")
    assert r.code == 0, r.err
    assert [jobs for jobs, _ in asked] == [[(sh, model, [2])]] and asked[0][1].is_set()
    assert reached == [(0, 1)]  # done with step 0, the run's first layer (2)
    rep = json.loads(r.out)
    assert rep["passed"] and [l["layer"] for l in rep["layers"]] == [2] and rep["format"] == "int4-group"
    assert rep["options"]["repeat"] == 2 and all(v > 0 for v in rep["layers"][0]["timings_ms"].values())
    assert rep["options"]["transport"] == "collectives"  # --transport auto, off CUDA
    # the option as given, and what it meant for this format
    assert rep["options"]["numerics"] == "served" and rep["options"]["numerics_detail"].startswith("served: ")
    r = cli("verify", sh, "--ref", model, "--ep", "2", "--repeat", "0")
    assert r.code == 2 and r.error_line == "--warmup 0 / --repeat 0: need warmup >= 0 and repeat >= 1"
    # a threshold tighter than int4's error: exit 1 and a one-line verdict naming the layer
    r = cli("verify", sh, "--ref", model, "--ep", "2", "--tokens", TOKENS, "--layers", "2", "--max-rel-err", "0.001")
    assert r.code == 1 and "FAIL" in r.out and "FAILED: 0/1 layers" in r.out
    assert r.error_line.startswith("verification failed: layer 2: layer rel err")


def test_cli_all2all_transports(verify_chain, verify_shards, cli):
    """--transport mapped on CPU ranks (shared-memory files) passes and says so (auto, collectives
    off CUDA: the JSON report above); a bad name is one error line."""
    model = verify_chain[0]
    sh = verify_shards("fp8-block", 2, layout="stacked")
    base = ["verify", sh, "--ref", model, "--ep", "2", "--tokens", TOKENS, "--layers", "2", "--all2all", "all2all"]
    r = cli(*base, "--transport", "mapped")
    assert r.code == 0, r.err
    assert "dispatch all2all (mapped)" in r.out and "PASSED: 1/1 layers" in r.out
    r = cli(*base, "--transport", "nvlink")
    assert r.code == 2 and r.error_line == "--transport 'nvlink': expected auto, collectives or mapped"
    r = cli(*base[:-1], "allgather", "--transport", "mapped")
    assert r.code == 2 and r.error_line == "--transport mapped is a transport of --all2all all2all, not allgather"


def test_torchrun_launch(verify_chain, verify_shards):
    """The multi-node entry: the same command under torchrun (here 2 local processes)."""
    model = verify_chain[0]
    sh = verify_shards("fp8-block", 2, layout="stacked")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), "-m",
           "moetool", "verify", str(sh), "--ref", str(model), "--ep", "2", "--tokens", str(TOKENS),
           "--all2all", "all2all", "--backend", "gloo"]  # gloo: a GPU host may have fewer GPUs than ranks
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "PASSED: 2/2 layers" in p.stdout and p.stdout.count("verify ") == 1  # rank 0 reports once
