"""`moetool verify` end to end on CPU (gloo): real shards of a tiny DeepSeek-V3-style model.

Unmodified shards must pass for every format and both dispatch backends, for --dp 1 --ep 2,
--dp 2 --ep 4 and an uneven placement with redundant experts; corrupted shards (swapped
experts, a doubled scale, swapped gate/up halves) must fail and say where. Several
verifications share one set of rank processes (``verify_many``) to keep the start-up cost
down: every ep 2 verification of this module runs in one world (``ep2_world``). The model and
its shards are the session's (``verify_chain``, ``verify_shards`` in tests/conftest.py); the
command-line side (missing, truncated or modified files, exit status, torchrun) is in
tests/cli/test_cli_verify.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeutil import rewrite_file
from moetool.convert.quantize import quantize
from moetool.convert.shard import shard
from moetool.demo.tiny import make_tiny_checkpoint
from moetool.verify.driver import VerifyOptions, verify_many
from moetool.read.manifest import sha256_file

pytestmark = pytest.mark.slow  # process worlds of 2 to 4 ranks

FORMATS = ("dense", "fp8-block", "fp8-channel", "int4-group")
BACKENDS = ("allgather", "all2all")
#: tokens per dp group: every rank still gets tokens at --dp 2 --ep 4 (8 per rank), and the
#: all2all dispatcher's kernels, interpreted on CPU, cost time per token. From 32 tokens the
#: layer errors moved < 3 % and each fault failed by the same margin (its expert is found on
#: the per-expert probe batch)
TOKENS = 16


def _opts(**kw) -> VerifyOptions:
    return VerifyOptions(tokens=TOKENS, timeout_s=300, **kw)


def _unmodified_jobs(chain, verify_shards, ep: int, dp: int, pairs=None) -> list[tuple]:
    """Each (format, backend) of ``pairs``, by default every format x both backends, the two
    backends of a format next to each other (fp8-channel per-expert, the others stacked: both
    layouts load)."""
    jobs = []
    for fmt, backend in pairs or [(f, b) for f in FORMATS for b in BACKENDS]:
        layout = "per-expert" if fmt == "fp8-channel" else "stacked"
        jobs.append((verify_shards(fmt, ep, layout=layout), chain[0], _opts(ep=ep, dp=dp, dispatch=backend)))
    return jobs


# ---------------------------------------------------------------------------------- faults


def _fresh_shards(chain, root: Path, fmt: str, ep: int, **kw) -> Path:
    """Shards of the test's own, to damage (the session's are shared)."""
    dst = root / f"{fmt}-ep{ep}-{len(list(root.iterdir()))}"
    shard(chain[1][fmt], dst, ep, progress=False, **kw)
    return dst


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


PREFIX = "model.layers.2.mlp.experts"


def _fault_cases(chain, root: Path) -> dict[str, tuple[Path, set[int], int]]:
    """{what: (damaged shards, the experts that may be named, their rank)}: only layer 2 touched."""
    cases = {}
    # two experts swapped (rank 0 holds experts 0..3 of 8 at ep 2)
    sh = _fresh_shards(chain, root, "fp8-block", 2, layout="stacked")
    _corrupt(sh, 0, 2, f"{PREFIX}.w13_weight", lambda t: (_swap_slots(t, f"{PREFIX}.w13", 1, 2),
                                                          _swap_slots(t, f"{PREFIX}.w2", 1, 2)))
    cases["swapped experts"] = (sh, {1, 2}, 0)
    # one expert's scale doubled (rank 1, slot 0 = expert 4)
    sh = _fresh_shards(chain, root, "fp8-block", 2, layout="stacked")

    def double(t):
        v = t[f"{PREFIX}.w2_weight_scale_inv"].clone()
        v[0] *= 2
        t[f"{PREFIX}.w2_weight_scale_inv"] = v
    _corrupt(sh, 1, 2, f"{PREFIX}.w2_weight_scale_inv", double)
    cases["doubled scale"] = (sh, {4}, 1)
    # gate and up halves swapped (int4, rank 1 slot 3 = expert 7)
    sh = _fresh_shards(chain, root, "int4-group", 2, layout="stacked")
    _corrupt(sh, 1, 2, f"{PREFIX}.w13_weight_packed", lambda t: _swap_halves(t, f"{PREFIX}.w13", 3))
    cases["gate/up swapped"] = (sh, {7}, 1)
    return cases


def _w13_halves_job(root: Path) -> tuple:
    """N = 96: the stacked w13 scale rows (2 x ceil(96/128) = 2) equal those of one 192-row
    linear, so only the known sizes tell gate and up apart; the up rows 8x the gate rows, so a
    reader that borrows the gate's scale for the up rows shows."""
    model = make_tiny_checkpoint(root / "m", "deepseek_v3", hidden=256, intermediate=96, experts=8, top_k=2,
                                 layers=2, shards=1)

    def louder_up(t):  # up rows 8x the gate rows, so borrowing the gate's scale shows
        for name in [n for n in t if ".experts." in n and n.endswith("up_proj.weight")]:
            t[name] = (t[name].float() * 8).to(t[name].dtype)
    rewrite_file(model / "model.safetensors", louder_up)
    quantize(model, root / "q", "fp8-block", progress=False)
    shard(root / "q", root / "s", 2, layout="stacked", progress=False)
    return root / "s", model, _opts(ep=2, dp=1, dispatch="all2all")


#: DeepSeek-V3's multi-token-prediction layer: after decoder layers 0 (dense) and 1, layer 2
MTP = 2


def _mtp_jobs(root: Path) -> list[tuple]:
    """A DeepSeek-V3 with its MTP layer stored, as DeepSeek's releases store layer 61:
    quantized and sharded, then the same shards with two of the MTP layer's experts swapped."""
    model = make_tiny_checkpoint(root / "m", "deepseek_v3", hidden=64, intermediate=32, experts=8, top_k=2,
                                 layers=2, shards=1, mtp=1)
    quantize(model, root / "q", "fp8-block", progress=False)
    shard(root / "q", root / "s", 2, layout="stacked", progress=False)
    shard(root / "q", root / "bad", 2, layout="stacked", progress=False)
    prefix = f"model.layers.{MTP}.mlp.experts"
    _corrupt(root / "bad", 0, 2, f"{prefix}.w13_weight", lambda t: (_swap_slots(t, f"{prefix}.w13", 0, 3),
                                                                    _swap_slots(t, f"{prefix}.w2", 0, 3)))
    # an output of a moetool before MTP layers were MoE layers: their experts left in bf16, listed
    # in the ignore list, and copied whole into every rank's common files
    from unittest import mock

    with mock.patch("moetool.model.families._mtp_layers", return_value=([], [])):
        quantize(model, root / "old-q", "fp8-block", progress=False)
        shard(root / "old-q", root / "old-s", 2, layout="stacked", progress=False)
    return [(root / "s", model, _opts(ep=2, dp=1, dispatch="all2all")),
            (root / "bad", model, _opts(ep=2, dp=1, dispatch="allgather")),
            (root / "old-s", model, _opts(ep=2, dp=1, dispatch="all2all"))]


@pytest.fixture(scope="module")
def ep2_world(verify_chain, verify_shards, tmp_path_factory) -> dict:
    """Every ep 2 verification of this module, run by one set of rank processes:
    {"unmodified" | "faults" | "w13": [(job, report)], "cases": the fault cases}."""
    model = verify_chain[0]
    cases = _fault_cases(verify_chain, tmp_path_factory.mktemp("faults"))
    groups = {
        "unmodified": _unmodified_jobs(verify_chain, verify_shards, 2, 1),
        "faults": [(sh, model, _opts(ep=2, dp=1, dispatch=BACKENDS[i % 2])) for i, (sh, _, _) in enumerate(cases.values())],
        "w13": [_w13_halves_job(tmp_path_factory.mktemp("w13"))],
        "mtp": _mtp_jobs(tmp_path_factory.mktemp("mtp")),
    }
    reports = iter(verify_many([job for jobs in groups.values() for job in jobs]))
    return {name: [(job, next(reports)) for job in jobs] for name, jobs in groups.items()} | {"cases": cases}


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("ep,dp", [(2, 1), (4, 2)])
def test_unmodified_shards_pass_every_format_and_backend(request, verify_chain, verify_shards, ep, dp):
    if ep == 2:  # every format with each backend
        results = request.getfixturevalue("ep2_world")["unmodified"]
    else:  # dp 2 over tp 2: a W8A8 format (its scales travel with the tokens) with all2all, a
        # weight-only one with allgather (the suite's time on 2 cores; ep 2 runs every pairing)
        jobs = _unmodified_jobs(verify_chain, verify_shards, ep, dp, [("fp8-channel", "all2all"),
                                                                     ("int4-group", "allgather")])
        results = list(zip(jobs, verify_many(jobs)))
    for (sh, _, opts), rep in results:
        assert rep.passed, f"{sh.name} {opts.dispatch}:\n{rep.render()}"
        assert [l.layer for l in rep.layers] == [1, 2]
        for l in rep.layers:
            assert sum(l.tokens_per_rank) > 0 and len(l.tokens_per_rank) == ep
    if ep == 2:  # both backends compute the same numbers, up to summation order and the bf16
        # wire of the all2all combine (about 1e-3 relative)
        reports = [rep for _, rep in results]
        for a, b in zip(reports[::2], reports[1::2]):
            for la, lb in zip(a.layers, b.layers):
                assert la.rel_err == pytest.approx(lb.rel_err, rel=0.05, abs=1.5e-3)


def test_uneven_placement_with_redundant_experts_passes(verify_chain, verify_shards, tmp_path_factory):
    load = tmp_path_factory.mktemp("load") / "load.json"
    load.write_text(json.dumps({"layers": {"1": [90, 1, 1, 1, 1, 1, 1, 40], "2": [1, 1, 70, 1, 1, 1, 1, 1]}}))
    model = verify_chain[0]
    sh = verify_shards("fp8-block", 3, placement="round-robin", redundant=2, expert_load=load)
    man = json.loads((sh / "manifest.json").read_text())
    assert sum(len(s) for s in man["layers"][0]["slots"]) == 10  # 8 experts + 2 replicas on 3 ranks
    # the hottest expert of each layer got the extra copies (layer 1: expert 0 at 90 beats 7 at 40 even halved)
    assert len(man["layers"][0]["replicas"]["0"]) == 3 and len(man["layers"][1]["replicas"]["2"]) == 3
    reports = verify_many([(sh, model, _opts(ep=3, dp=1, dispatch=b)) for b in BACKENDS])
    for rep in reports:
        assert rep.passed, rep.render()


def test_faults_fail_and_name_layer_and_expert(ep2_world):
    cases = ep2_world["cases"]
    for (what, (sh, experts, rank)), (_, rep) in zip(cases.items(), ep2_world["faults"]):
        assert not rep.passed, f"{what} was not caught:\n{rep.render()}"
        layer2 = next(l for l in rep.layers if l.layer == 2)
        assert not layer2.passed and layer2.worst_expert in experts and layer2.worst_expert_rank == rank, (
            what, rep.render())
        assert next(l for l in rep.layers if l.layer == 1).passed  # only layer 2 was touched
        assert f"expert {layer2.worst_expert} on rank {rank}" in layer2.reason


def test_fp8_block_w13_halves_that_look_like_one_linear(ep2_world):
    """N = 96: the stacked w13 scale rows (2 x ceil(96/128) = 2) equal those of one 192-row
    linear, so only the known sizes tell gate and up apart; both experts backends on CPU
    must read it right (a guess would scale the up rows with the gate's scales)."""
    ((_, rep),) = ep2_world["w13"]
    assert rep.passed, rep.render()


def test_the_mtp_layer_is_quantized_sharded_and_verified(ep2_world):
    """DeepSeek-V3's MTP layer (61 of 61) is a MoE block that transformers does not run and
    vLLM's drafter loads with the model's quantization: its experts are converted (not left in
    the ignore list, nor copied whole into every rank's common files) and verified; two of
    its experts swapped fail naming the layer."""
    (shards, model, _), good = ep2_world["mtp"][0]
    (_, _, _), bad = ep2_world["mtp"][1]
    assert good.passed and [l.layer for l in good.layers] == [1, MTP], good.render()
    config = json.loads((shards.parent / "q" / "config.json").read_text())
    ignored = config["quantization_config"]["ignored_layers"]
    assert f"model.layers.{MTP}.eh_proj" in ignored and not any(f"layers.{MTP}.mlp.experts" in n for n in ignored)
    for rank in range(2):
        rank_dir = shards / f"rank-{rank:05d}-of-00002"
        weight_map = json.loads((rank_dir / "model.safetensors.index.json").read_text())["weight_map"]
        assert not weight_map[f"model.layers.{MTP}.mlp.experts.w13_weight"].startswith("model-common")
    layer = next(l for l in bad.layers if l.layer == MTP)
    assert not bad.passed and not layer.passed and layer.worst_expert in {0, 3}, bad.render()
    assert next(l for l in bad.layers if l.layer == 1).passed


def test_shards_made_before_mtp_layers_were_moe_layers_still_verify(ep2_world):
    """Their MTP experts are plain tensors of every rank (unchecked then as now): the decoder's
    layers are verified against the same reference, which now holds an MTP MoE layer."""
    (shards, model, _), report = ep2_world["mtp"][2]
    assert report.passed and [l.layer for l in report.layers] == [1], report.render()
    from moetool.model.families import describe
    from moetool.read.checkpoint import open_checkpoint

    with open_checkpoint(shards.parent / "old-q") as ck:  # its bf16 MTP experts: plain tensors, as written
        assert [m.index for m in describe(ck.config, ck.tensors).moe_layers] == [1]
