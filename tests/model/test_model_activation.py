"""The experts' activation read from config.json (issue 16, point 2).

Every family's transformers config names it ``hidden_act`` ("silu" by default; "swish" is the
same function in transformers' ACT2FN); gpt-oss runs its own clamped SwiGLU (``swiglu_alpha``,
``swiglu_limit``, up + 1) whatever ``hidden_act`` says. Anything else is refused, by every
command that reads the model, with one line naming config.json, the key and the value: SiLU is
never assumed for a model that says otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetool.convert.shard import shard
from moetool.errors import MoetoolError
from moetool.model.families import describe
from moetool.model.spec import ExpertActivation
from moetool.read.checkpoint import open_checkpoint
from moetool.read.manifest import MANIFEST_NAME, sha256_file
from moeutil import HF_CONFIGS, transformers_gpt_oss_reads_its_limit

GELU_ERROR = 'config.json: hidden_act "gelu" (a string) is not supported (moetool runs SwiGLU experts: "silu" or "swish")'


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of checkpoint ``src`` (tensor files linked) whose config.json has ``changes``."""
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).symlink_to(p) if p.name != "config.json" else None
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _spec(path: Path):
    with open_checkpoint(path) as ck:
        return describe(ck.config, ck.tensors)


@pytest.mark.parametrize("family", [f for f in HF_CONFIGS if f != "gpt_oss"])
def test_transformers_models_are_silu(hf_model, family):
    model = hf_model(family)
    assert model.config["hidden_act"] == "silu"
    spec = _spec(model.path)
    assert spec.activation == ExpertActivation("silu")
    assert {m.activation for m in spec.moe_layers} == {ExpertActivation("silu")}


@pytest.mark.parametrize("value", ["silu", "swish", None])
def test_silu_and_its_alias_are_accepted(hf_model, tmp_path, value):
    path = _with_config(hf_model("mixtral").path, tmp_path / "m", hidden_act=value)
    assert _spec(path).activation.kind == "silu"


@pytest.mark.parametrize("value, shown", [("gelu", '"gelu" (a string)'), ("relu", '"relu" (a string)'),
                                          ("gelu_pytorch_tanh", '"gelu_pytorch_tanh" (a string)'),
                                          (1, "1 (a number)")])
def test_other_activations_are_refused(hf_model, tmp_path, value, shown):
    path = _with_config(hf_model("deepseek_v3").path, tmp_path / "m", hidden_act=value)
    with pytest.raises(MoetoolError) as e:
        _spec(path)
    assert str(e.value) == (f'config.json: hidden_act {shown} is not supported (moetool runs SwiGLU experts: '
                            '"silu" or "swish")')


def test_llama4_wrapper_reads_the_text_config():
    """A multimodal Llama-4 config: the text model's hidden_act counts (its vision tower's
    "gelu" is not the experts')."""
    text = dict(model_type="llama4_text", hidden_size=16, num_local_experts=4, intermediate_size=8,
                num_experts_per_tok=1, num_hidden_layers=1, hidden_act="silu")
    tensors = {"language_model.model.layers.0.feed_forward.router.weight": (4, 16),
               "language_model.model.layers.0.feed_forward.experts.gate_up_proj": (4, 16, 16),
               "language_model.model.layers.0.feed_forward.experts.down_proj": (4, 8, 16)}
    tensors = {k: type("T", (), {"shape": v})() for k, v in tensors.items()}
    cfg = dict(model_type="llama4", text_config=text, vision_config={"hidden_act": "gelu"})
    assert describe(cfg, tensors).activation.kind == "silu"
    with pytest.raises(MoetoolError, match=r'^config.json: text_config.hidden_act "gelu" \(a string\) is not'):
        describe(dict(cfg, text_config=dict(text, hidden_act="gelu")), tensors)


def test_gpt_oss_clamped_swiglu(hf_model, tmp_path):
    model = hf_model("gpt_oss")
    act = _spec(model.path).activation
    assert act == ExpertActivation("clamped-swiglu", alpha=1.702, limit=7.0)
    assert act.describe() == "clamped SwiGLU (alpha 1.702, limit 7, up + 1)"
    # its own keys; hidden_act is not what its experts run (transformers ignores it too)
    path = _with_config(model.path, tmp_path / "m", swiglu_limit=5.5, swiglu_alpha=1.5, hidden_act="gelu")
    assert _spec(path).activation == ExpertActivation("clamped-swiglu", alpha=1.5, limit=5.5)


@pytest.mark.skipif(not transformers_gpt_oss_reads_its_limit(),
                    reason="this transformers' GptOssExperts clamps at 7 whatever swiglu_limit says (up to 5.18; 5.19 and later read it)")
def test_gpt_oss_activation_is_transformers_own():
    """ExpertActivation.apply against GptOssExperts._apply_gate (interleaved gate/up columns,
    as the module holds them) on values past the clamp, and against SiLU for the others."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=3.0)
    experts = GptOssExperts(cfg)
    gate_up = torch.randn(5, 12, generator=torch.Generator().manual_seed(0)) * 4  # [T, 2N], beyond the limit
    want = experts._apply_gate(gate_up)
    act = ExpertActivation("clamped-swiglu", alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    assert torch.equal(act.apply(gate_up[:, 0::2], gate_up[:, 1::2]), want)
    silu = transformers.activations.ACT2FN["silu"]
    g, u = gate_up[:, :6], gate_up[:, 6:]
    assert torch.equal(ExpertActivation("silu").apply(g, u), silu(g) * u)
    assert torch.equal(ExpertActivation("silu").apply(g, u), transformers.activations.ACT2FN["swish"](g) * u)


# ------------------------------------------------------------------------------ every command


@pytest.fixture(scope="module")
def gelu(tmp_path_factory):
    """(a model whose config says gelu, good shards of it re-signed with gelu configs, the good model)."""
    from moeutil import save_hf_model

    root = tmp_path_factory.mktemp("gelu")
    good = save_hf_model("qwen3_moe", root / "good").path
    bad = _with_config(good, root / "bad", hidden_act="gelu")
    shards = root / "shards"
    shard(good, shards, 2, progress=False)
    man = json.loads((shards / MANIFEST_NAME).read_text())
    for name in man["files"]:
        if name.endswith("config.json"):
            cfg = json.loads((shards / name).read_text())
            (shards / name).write_text(json.dumps(dict(cfg, hidden_act="gelu")))
            man["files"][name] = {"sha256": sha256_file(shards / name), "size": (shards / name).stat().st_size}
    (shards / MANIFEST_NAME).write_text(json.dumps(man))
    return bad, shards, good


@pytest.mark.parametrize("command", ["inspect", "quantize", "repack", "shard", "merge", "verify-ref", "verify-shards",
                                     "verify-whole-model"])
def test_every_command_refuses_gelu(gelu, cli, tmp_path, command):
    bad, shards, good = gelu
    out = tmp_path / "out"
    args = {
        "inspect": ["inspect", bad],
        "quantize": ["quantize", bad, out, "--fp8-block", "--quiet"],
        "repack": ["repack", bad, out, "--layout", "stacked", "--quiet"],
        "shard": ["shard", bad, out, "--ep", 2, "--quiet"],
        "merge": ["shard", "--merge", shards, out, "--quiet"],
        "verify-ref": ["verify", shards, "--ref", bad, "--ep", 2, "--tokens", 8],
        "verify-shards": ["verify", shards, "--ref", good, "--ep", 2, "--tokens", 8],
        "verify-whole-model": ["verify", shards, "--ref", good, "--ep", 2, "--whole-model", "--tokens", 8,
                               "--seq-len", 8],
    }[command]
    r = cli(*args)
    assert r.code == 2, (r.out, r.err)
    # every command, verify included, reads the config before any work (no rank is started)
    assert r.error_line.endswith(GELU_ERROR) and "rank" not in r.error_line, r.error_line
    assert not out.exists()
