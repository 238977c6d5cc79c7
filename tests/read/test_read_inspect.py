"""``moetool inspect`` on transformers-made models of every family and on our writer's."""
from __future__ import annotations

import json

import pytest

from moeutil import HF_CONFIGS, N

H = 32
ROUTERS = {
    "mixtral": "softmax, top-2, renormalize",
    "qwen2_moe": "softmax, top-2, no renormalize",
    "qwen3_moe": "softmax, top-2, renormalize",
    "deepseek_v2": "softmax, top-2, grouped 1/2 (max), no renormalize",
    "deepseek_v3": "sigmoid, top-2, grouped 1/2 (top2-sum), correction bias, renormalize, scale 2.5",
    "olmoe": "softmax, top-2, no renormalize",
    "llama4": "sigmoid, top-1, no renormalize, weight on input",
    "gpt_oss": "softmax, top-2, renormalize, logit bias",
}
EXPECTED = {  # architecture, layers, moe layers, dense layers, experts, top-k, shared, storage
    "mixtral": ("mixtral", 2, [0, 1], [], 4, 2, None, "per-expert"),
    "qwen2_moe": ("qwen2-moe", 2, [0, 1], [], 4, 2, {"intermediate_size": 40, "gated": True}, "per-expert"),
    "qwen3_moe": ("qwen3-moe", 2, [0, 1], [], 4, 2, None, "per-expert"),
    "deepseek_v2": ("deepseek-v2", 2, [1], [0], 8, 2, {"intermediate_size": N, "gated": False}, "per-expert"),
    "deepseek_v3": ("deepseek-v3", 3, [1, 2], [0], 8, 2, {"intermediate_size": N, "gated": False}, "per-expert"),
    "olmoe": ("olmoe", 2, [0, 1], [], 4, 2, None, "per-expert"),
    "llama4": ("llama4", 2, [0, 1], [], 4, 1, {"intermediate_size": N, "gated": False}, "fused (input-first)"),
    "gpt_oss": ("gpt-oss", 2, [0, 1], [], 4, 2, None, "fused (interleaved gate/up) (input-first) (biases)"),
}


@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_inspect_transformers_model(hf_model, cli, family):
    model = hf_model(family)
    r = cli("inspect", model.path, "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    arch, layers, moe, dense, experts, top_k, shared, storage = EXPECTED[family]
    assert info["architecture"] == arch
    assert info["model_type"] == model.config["model_type"]
    assert info["layers"] == layers and info["moe_layers"] == moe and info["dense_layers"] == dense
    assert info["experts"] == experts and info["top_k"] == top_k
    assert info["hidden_size"] == H and info["expert_intermediate_size"] == N
    assert info["router"] == ROUTERS[family]
    assert info["activation"] == ("clamped SwiGLU (alpha 1.702, limit 7, up + 1)" if family == "gpt_oss"
                                  else "silu (SwiGLU)")
    assert info["shared_experts"] == shared
    assert info["expert_storage"] == storage
    assert info["weight_format"] == "dense" and info["format_params"] == {}
    assert info["dtypes"] == {"float32": info["tensors"]}
    # bytes: every routed expert's gate, up, down in float32 (+ gpt-oss expert biases)
    expert_bytes = len(moe) * experts * 3 * N * H * 4
    if family == "gpt_oss":
        expert_bytes += len(moe) * experts * (2 * N + H) * 4
    assert info["expert_bytes"] == expert_bytes
    total = sum(v.numel() * v.element_size() for v in model.state.values())
    assert info["expert_bytes"] + info["other_bytes"] == total

    table = cli("inspect", model.path)
    assert table.code == 0
    lines = dict(line.split(None, 1) if not line.startswith(("expert storage", "weight format", "shared experts"))
                 else line.split("  ", 1) for line in table.out.strip().splitlines())
    assert lines["architecture"].startswith(arch)
    assert lines["experts"] == f"{experts} per layer, top-{top_k}"
    assert lines["dims"] == f"hidden {H}, expert intermediate {N}"
    assert lines["router"] == ROUTERS[family]
    assert lines["activation"] == info["activation"]
    assert lines["expert storage"].strip() == storage


def test_inspect_gpt_oss_notes(hf_model, cli):
    r = cli("inspect", hf_model("gpt_oss").path)
    assert "notes" in r.out and "--experts torch only" in r.out


@pytest.mark.parametrize("family, storage", [("deepseek_v3", "per-expert"), ("llama4", "fused (input-first)"),
                                             ("gpt_oss", "fused (interleaved gate/up) (input-first) (biases)")])
def test_inspect_our_writer(tiny, cli, family, storage):
    r = cli("inspect", tiny(family), "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    assert info["expert_storage"] == storage
    assert info["hidden_size"] == 256 and info["expert_intermediate_size"] == 128
    assert info["files"] == 2 and info["dtypes"].get("bfloat16")


def test_inspect_v5_fused(tiny, cli):
    r = cli("inspect", tiny("qwen3_moe", layout="v5", hidden=64, intermediate=48), "--json")
    info = json.loads(r.out)
    assert info["expert_storage"] == "fused" and info["expert_intermediate_size"] == 48


@pytest.mark.parametrize("args, fmt, params, dtypes", [
    (["--fp8-block"], "fp8-block", {}, {"float8_e4m3fn", "float32", "bfloat16"}),
    (["--fp8-channel"], "fp8-channel", {}, {"float8_e4m3fn", "bfloat16"}),
    (["--int4"], "int4-group", {"group_size": 128, "symmetric": True, "clip": "none"}, {"int32", "bfloat16"}),
    (["--int4", "--asymmetric", "--group-size", "64"], "int4-group",
     {"group_size": 64, "symmetric": False, "clip": "none"}, {"int32", "bfloat16"}),
    (["--int4", "--int4-clip", "mse"], "int4-group", {"group_size": 128, "symmetric": True, "clip": "mse"},
     {"int32", "bfloat16"}),
])
def test_inspect_reports_quantized_formats(tiny, cli, tmp_path, args, fmt, params, dtypes):
    src = tiny("mixtral")
    out = tmp_path / "q"
    assert cli("quantize", src, out, *args, "--quiet").code == 0
    info = json.loads(cli("inspect", out, "--json").out)
    assert info["weight_format"] == fmt and info["format_params"] == params
    assert set(info["dtypes"]) == dtypes
    before = json.loads(cli("inspect", src, "--json").out)
    assert info["other_bytes"] == before["other_bytes"]  # only experts change
    assert info["expert_bytes"] < before["expert_bytes"]
    stacked = tmp_path / "s"
    assert cli("repack", out, stacked, "--quiet").code == 0
    info2 = json.loads(cli("inspect", stacked, "--json").out)
    assert info2["expert_storage"] == "stacked" and info2["weight_format"] == fmt
    # same bytes, except int4's weight_shape: 3 per expert per-expert, 2 (w13, w2) stacked
    shape_bytes = 2 * 4 * 2 * 4 if fmt == "int4-group" else 0  # layers * experts * one [2] int32
    assert info2["expert_bytes"] == info["expert_bytes"] - shape_bytes


def test_inspect_ep_rank_folder(tiny, cli, tmp_path):
    """A rank folder of `moetool shard` says which rank it is and how many experts it stores."""
    src = tiny("mixtral", experts=8)
    assert cli("shard", src, tmp_path / "s", "--ep", "3", "--quiet").code == 0
    r = cli("inspect", tmp_path / "s" / "rank-00002-of-00003", "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    assert info["experts"] == 8  # the model's
    assert info["ep_rank"] == {"rank": 2, "ep": 3, "layout": "stacked", "stored_experts": {"0": 4, "1": 4}}
    r = cli("inspect", tmp_path / "s" / "rank-00000-of-00003")
    assert "EP rank         0 of 3 (stacked): stores 2 of the 8 experts per layer" in r.out
    assert json.loads(cli("inspect", src, "--json").out)["ep_rank"] is None
