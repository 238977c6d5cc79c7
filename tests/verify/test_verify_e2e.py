"""`moetool verify` end to end on CPU (gloo): real shards of a tiny DeepSeek-V3-style model.

Unmodified shards must pass for every format and both dispatch backends, for --dp 1 --ep 2,
--dp 2 --ep 4 and an uneven placement with redundant experts; corrupted shards (swapped
experts, a doubled scale, swapped gate/up halves, a missing, truncated or modified file) must
fail and say where. Several verifications share one set of rank processes (``verify_many``)
to keep the start-up cost down.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeutil import rewrite_file
from moetool.convert.quantize import quantize
from moetool.convert.shard import shard
from moetool.demo.tiny import make_tiny_checkpoint
from moetool.verify.driver import VerifyOptions, verify_many
from moetool.convert.output import sha256_file

FORMATS = ("dense", "fp8-block", "fp8-channel", "int4-group")
BACKENDS = ("allgather", "all2all")
TOKENS = 96


@pytest.fixture(scope="session")
def chain(tmp_path_factory):
    """(model, {format: quantized checkpoint}) — N = 192 exercises partial fp8 blocks and
    per-half w13 scales; int4 uses groups of 64 (192 is not a multiple of 128)."""
    root = tmp_path_factory.mktemp("verify-chain")
    model = make_tiny_checkpoint(root / "model", "deepseek_v3", hidden=256, intermediate=192, experts=8, top_k=2,
                                 layers=3, shards=2)
    out = {"dense": model}
    for fmt in FORMATS[1:]:
        out[fmt] = root / fmt
        quantize(model, out[fmt], fmt, group_size=64, progress=False)
    return model, out


def _shards(chain, tmp_path_factory, fmt, ep, **kw) -> Path:
    name = f"{fmt}-ep{ep}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
    dst = tmp_path_factory.mktemp("shards") / name
    shard(chain[1][fmt], dst, ep, progress=False, **kw)
    return dst


def _opts(**kw) -> VerifyOptions:
    return VerifyOptions(tokens=TOKENS, timeout_s=300, **kw)


@pytest.mark.parametrize("ep,dp", [(2, 1), (4, 2)])
def test_unmodified_shards_pass_every_format_and_backend(chain, tmp_path_factory, ep, dp):
    model = chain[0]
    jobs = []
    for fmt in FORMATS:
        layout = "per-expert" if fmt == "fp8-channel" else "stacked"  # both layouts load
        sh = _shards(chain, tmp_path_factory, fmt, ep, layout=layout)
        for backend in BACKENDS:
            jobs.append((sh, model, _opts(ep=ep, dp=dp, dispatch=backend)))
    reports = verify_many(jobs)
    for (sh, _, opts), rep in zip(jobs, reports):
        assert rep.passed, f"{sh.name} {opts.dispatch}:\n{rep.render()}"
        assert [l.layer for l in rep.layers] == [1, 2]
        for l in rep.layers:
            assert sum(l.tokens_per_rank) > 0 and len(l.tokens_per_rank) == ep
    # both backends compute the same numbers, up to summation order and the bf16 wire of the
    # all2all combine (about 1e-3 relative)
    for a, b in zip(reports[::2], reports[1::2]):
        for la, lb in zip(a.layers, b.layers):
            assert la.rel_err == pytest.approx(lb.rel_err, rel=0.05, abs=1.5e-3)


def test_uneven_placement_with_redundant_experts_passes(chain, tmp_path_factory):
    load = tmp_path_factory.mktemp("load") / "load.json"
    load.write_text(json.dumps({"layers": {"1": [90, 1, 1, 1, 1, 1, 1, 40], "2": [1, 1, 70, 1, 1, 1, 1, 1]}}))
    model = chain[0]
    sh = _shards(chain, tmp_path_factory, "fp8-block", 3, placement="round-robin", redundant=2, expert_load=load)
    man = json.loads((sh / "manifest.json").read_text())
    assert sum(len(s) for s in man["layers"][0]["slots"]) == 10  # 8 experts + 2 replicas on 3 ranks
    # the hottest expert of each layer got the extra copies (layer 1: expert 0 at 90 beats 7 at 40 even halved)
    assert len(man["layers"][0]["replicas"]["0"]) == 3 and len(man["layers"][1]["replicas"]["2"]) == 3
    reports = verify_many([(sh, model, _opts(ep=3, dp=1, dispatch=b)) for b in BACKENDS])
    for rep in reports:
        assert rep.passed, rep.render()


# ---------------------------------------------------------------------------------- faults


def _rank_file(sh: Path, rank: int, ep: int, tensor: str) -> Path:
    d = sh / f"rank-{rank:05d}-of-{ep:05d}"
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return d / json.loads(index.read_text())["weight_map"][tensor]
    return d / "model.safetensors"


def _corrupt(sh: Path, rank: int, ep: int, tensor: str, mutate) -> None:
    """Change tensors of one rank file and re-sign the manifest: a consistent-looking shard
    with wrong numbers, as a buggy converter would write it."""
    path = _rank_file(sh, rank, ep, tensor)
    rewrite_file(path, mutate)
    man_path = sh / "manifest.json"
    man = json.loads(man_path.read_text())
    for name in man["files"]:
        p = sh / name
        man["files"][name] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    man_path.write_text(json.dumps(man))


def _swap_slots(t: dict, base: str, a: int, b: int) -> None:
    for name in [n for n in t if n.startswith(base + "_")]:
        v = t[name].clone()
        v[[a, b]] = v[[b, a]]
        t[name] = v


def _swap_halves(t: dict, base: str, slot: int) -> None:
    for name in [n for n in t if n.startswith(base + "_")]:
        if name.endswith("weight_shape"):
            continue
        v = t[name].clone()
        h = v.shape[1] // 2
        v[slot] = torch.cat([v[slot, h:], v[slot, :h]])
        t[name] = v


def test_faults_fail_and_name_layer_and_expert(chain, tmp_path_factory):
    model = chain[0]
    prefix = "model.layers.2.mlp.experts"
    cases = {}
    # two experts swapped (rank 0 holds experts 0..3 of 8 at ep 2)
    sh = _shards(chain, tmp_path_factory, "fp8-block", 2, layout="stacked")
    _corrupt(sh, 0, 2, f"{prefix}.w13_weight", lambda t: (_swap_slots(t, f"{prefix}.w13", 1, 2),
                                                          _swap_slots(t, f"{prefix}.w2", 1, 2)))
    cases["swapped experts"] = (sh, {1, 2}, 0)
    # one expert's scale doubled (rank 1, slot 0 = expert 4)
    sh = _shards(chain, tmp_path_factory, "fp8-block", 2, layout="stacked")

    def double(t):
        v = t[f"{prefix}.w2_weight_scale_inv"].clone()
        v[0] *= 2
        t[f"{prefix}.w2_weight_scale_inv"] = v
    _corrupt(sh, 1, 2, f"{prefix}.w2_weight_scale_inv", double)
    cases["doubled scale"] = (sh, {4}, 1)
    # gate and up halves swapped (int4, rank 1 slot 3 = expert 7)
    sh = _shards(chain, tmp_path_factory, "int4-group", 2, layout="stacked")
    _corrupt(sh, 1, 2, f"{prefix}.w13_weight_packed", lambda t: _swap_halves(t, f"{prefix}.w13", 3))
    cases["gate/up swapped"] = (sh, {7}, 1)

    jobs = [(sh, model, _opts(ep=2, dp=1, dispatch=BACKENDS[i % 2])) for i, (sh, _, _) in enumerate(cases.values())]
    reports = verify_many(jobs)
    for (what, (sh, experts, rank)), rep in zip(cases.items(), reports):
        assert not rep.passed, f"{what} was not caught:\n{rep.render()}"
        layer2 = next(l for l in rep.layers if l.layer == 2)
        assert not layer2.passed and layer2.worst_expert in experts and layer2.worst_expert_rank == rank, (
            what, rep.render())
        assert next(l for l in rep.layers if l.layer == 1).passed  # only layer 2 was touched
        assert f"expert {layer2.worst_expert} on rank {rank}" in layer2.reason


def test_missing_truncated_and_modified_files_are_named(chain, tmp_path_factory, cli):
    model = chain[0]
    base = _shards(chain, tmp_path_factory, "fp8-block", 2, layout="stacked")
    target = "rank-00001-of-00002/model-00002-of-00002.safetensors"
    if not (base / target).exists():
        target = sorted(p.relative_to(base).as_posix() for p in (base / "rank-00001-of-00002").glob("*.safetensors"))[-1]

    missing = tmp_path_factory.mktemp("f") / "missing"
    shutil.copytree(base, missing)
    (missing / target).unlink()
    r = cli("verify", missing, "--ref", model, "--ep", "2", "--tokens", TOKENS)
    assert r.code == 2 and r.error_line == f"{missing / target}: missing (listed in {missing}/manifest.json)"

    truncated = tmp_path_factory.mktemp("f") / "truncated"
    shutil.copytree(base, truncated)
    size = (truncated / target).stat().st_size
    with open(truncated / target, "r+b") as f:
        f.truncate(size - 100)
    r = cli("verify", truncated, "--ref", model, "--ep", "2", "--tokens", TOKENS)
    assert r.code == 2 and "truncated or modified" in r.error_line and str(truncated / target) in r.error_line

    modified = tmp_path_factory.mktemp("f") / "modified"  # same size, other bytes: the rank's sha256 check
    shutil.copytree(base, modified)
    with open(modified / target, "r+b") as f:
        f.seek(size - 10)
        f.write(b"\x01" * 10)
    r = cli("verify", modified, "--ref", model, "--ep", "2", "--tokens", TOKENS)
    assert r.code == 2
    assert r.error_line.startswith("rank 1 failed:") and "sha256 does not match" in r.error_line

    r = cli("verify", base, "--ref", model, "--ep", "4")
    assert r.code == 2 and r.error_line == f"--ep 4: the shards in {base} were made for ep 2"


def test_cli_report_json_and_exit_status(chain, tmp_path_factory, cli):
    model = chain[0]
    sh = _shards(chain, tmp_path_factory, "int4-group", 2, layout="stacked")
    r = cli("verify", sh, "--ref", model, "--ep", "2", "--tokens", TOKENS, "--layers", "2", "--json",
            "--warmup", "1", "--repeat", "2")
    assert r.code == 0, r.err
    rep = json.loads(r.out)
    assert rep["passed"] and [l["layer"] for l in rep["layers"]] == [2] and rep["format"] == "int4-group"
    assert rep["options"]["repeat"] == 2 and all(v > 0 for v in rep["layers"][0]["timings_ms"].values())
    r = cli("verify", sh, "--ref", model, "--ep", "2", "--repeat", "0")
    assert r.code == 2 and r.error_line == "--warmup 0 / --repeat 0: need warmup >= 0 and repeat >= 1"
    # a threshold tighter than int4's error: exit 1 and a one-line verdict naming the layer
    r = cli("verify", sh, "--ref", model, "--ep", "2", "--tokens", TOKENS, "--layers", "2", "--max-rel-err", "0.001")
    assert r.code == 1 and "FAIL" in r.out and "FAILED: 0/1 layers" in r.out
    assert r.error_line.startswith("verification failed: layer 2: layer rel err")


def test_cli_all2all_transports(chain, tmp_path_factory, cli):
    """--transport mapped on CPU ranks (shared-memory files) passes and says so; auto is
    collectives off CUDA; a bad name is one error line."""
    model = chain[0]
    sh = _shards(chain, tmp_path_factory, "fp8-block", 2, layout="stacked")
    base = ["verify", sh, "--ref", model, "--ep", "2", "--tokens", TOKENS, "--layers", "2", "--all2all", "all2all"]
    r = cli(*base, "--transport", "mapped")
    assert r.code == 0, r.err
    assert "dispatch all2all (mapped)" in r.out and "PASSED: 1/1 layers" in r.out
    r = cli(*base, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["options"]["transport"] == "collectives"
    r = cli(*base, "--transport", "nvlink")
    assert r.code == 2 and r.error_line == "--transport 'nvlink': expected auto, collectives or mapped"
    r = cli(*base[:-1], "allgather", "--transport", "mapped")
    assert r.code == 2 and r.error_line == "--transport mapped is a transport of --all2all all2all, not allgather"


def test_torchrun_launch(chain, tmp_path_factory):
    """The multi-node entry: the same command under torchrun (here 2 local processes)."""
    model = chain[0]
    sh = _shards(chain, tmp_path_factory, "fp8-block", 2, layout="stacked")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), "-m",
           "moetool", "verify", str(sh), "--ref", str(model), "--ep", "2", "--tokens", str(TOKENS),
           "--all2all", "all2all"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "PASSED: 2/2 layers" in p.stdout and p.stdout.count("verify ") == 1  # rank 0 reports once


def test_fp8_block_w13_halves_that_look_like_one_linear(tmp_path):
    """N = 96: the stacked w13 scale rows (2 x ceil(96/128) = 2) equal those of one 192-row
    linear, so only the known sizes tell gate and up apart; both experts backends on CPU
    must read it right (a guess would scale the up rows with the gate's scales)."""
    model = make_tiny_checkpoint(tmp_path / "m", "deepseek_v3", hidden=256, intermediate=96, experts=8, top_k=2,
                                 layers=2, shards=1)

    def louder_up(t):  # up rows 8x the gate rows, so borrowing the gate's scale shows
        for name in [n for n in t if ".experts." in n and n.endswith("up_proj.weight")]:
            t[name] = (t[name].float() * 8).to(t[name].dtype)
    rewrite_file(model / "model.safetensors", louder_up)
    quantize(model, tmp_path / "q", "fp8-block", progress=False)
    shard(tmp_path / "q", tmp_path / "s", 2, layout="stacked", progress=False)
    (rep,) = verify_many([(tmp_path / "s", model, _opts(ep=2, dp=1, dispatch="all2all"))])
    assert rep.passed, rep.render()
