"""config.json -> describe -> the reference block, against transformers' own MoE block.

MoE-only verify compares the shards with moetool's reference of each block, built from the
config as ``describe`` reads it: a config read differently from the engine's (a default, a key
one implementation ignores) would be checked against the wrong model on both sides and pass.
Each row saves a tiny random model with transformers, edits its config.json as a hand-written
or released one may be, and either asks the reference to equal transformers' block, loaded from
that folder, on every MoE layer (and the MoE layers to be transformers' own), or asks for the
one-line refusal. (vLLM reads config.json through transformers' config classes: their defaults
are the served ones.)
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeutil import HF_CONFIGS, H, save_hf_model
from moetool.errors import MoetoolError
from moetool.model.families import describe
from moetool.read.checkpoint import open_checkpoint
from moetool.read.experts import ExpertReader
from moetool.verify.reference import reference_moe_forward

#: relative error of the fp32 reference to transformers' fp32 block (seen: 3e-8 to 2e-7)
MATCH = 1e-5
_DROP = object()
#: 16 experts in 8 groups, top-4: DeepSeek-V3's grouped selection at its config-class defaults
V3_GROUPS = dict(n_routed_experts=16, num_experts_per_tok=4)


def _drop(*keys):
    return {k: _DROP for k in keys}


#: id -> (family, transformers config overrides, config.json edits)
MATCHES = {
    **{family: (family, {}, {}) for family in HF_CONFIGS},
    # transformers' DeepseekV3Config defaults: routed_scaling_factor 2.5, n_group 8, topk_group 4
    "deepseek_v3-defaults": ("deepseek_v3", dict(V3_GROUPS, n_group=8, topk_group=4, routed_scaling_factor=2.5),
                             _drop("routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
                                   "scoring_func", "topk_method")),
    "deepseek_v2-greedy-default": ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=1.5),
                                   _drop("topk_method", "n_group", "topk_group")),
    "qwen2_moe-sparse-step": ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]), {}),
    "qwen3_moe-mlp-only": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1]), {}),
    "llama4-interleave": ("llama4", dict(num_hidden_layers=4, interleave_moe_layer_step=2), {}),
}

#: id -> (family, transformers config overrides, config.json edits, the refusal's pattern)
REFUSALS = {
    # transformers' DeepSeek builds experts from first_k_dense_replace on whatever the frequency
    "deepseek_v3-moe_layer_freq": ("deepseek_v3", dict(num_hidden_layers=4, moe_layer_freq=2), {},
                                   r"layer 1 holds MoE tensors, but config.json makes it a dense layer"),
    "deepseek_v2-norm_topk_prob": ("deepseek_v2", dict(norm_topk_prob=True), {},
                                   r"norm_topk_prob true is not supported for deepseek_v2"),
    "deepseek_v2-mlp_bias": ("deepseek_v2", dict(mlp_bias=True), {},
                             r"shared_experts\.gate_proj\.bias: shared experts with biases are not supported"),
    "deepseek_v2-noaux_tc": ("deepseek_v2", {}, dict(topk_method="noaux_tc"),
                             r'topk_method must be "greedy" or "group_limited_greedy", got "noaux_tc"'),
    "deepseek_v3-softmax": ("deepseek_v3", {}, dict(scoring_func="softmax"),
                            r'scoring_func "softmax" is not supported for deepseek_v3'),
    "deepseek_v3-greedy": ("deepseek_v3", {}, dict(topk_method="greedy"),
                           r'topk_method "greedy" is not supported for deepseek_v3'),
    "deepseek_v3-no-scaling": ("deepseek_v3", {}, dict(routed_scaling_factor=0),
                               r"routed_scaling_factor must be a number above 0, got 0"),
    "deepseek_v3-nan-scaling": ("deepseek_v3", {}, dict(routed_scaling_factor=float("nan")),
                                r"routed_scaling_factor must be a finite number, got NaN \(not a finite number\)"),
    "deepseek_v3-scaling-past-float": ("deepseek_v3", {}, dict(routed_scaling_factor=10 ** 400),
                                       r"routed_scaling_factor must be a finite number, got 1000000"),
    "deepseek_v3-groups": ("deepseek_v3", {}, dict(n_group=3),
                           r"n_group 3 must divide the expert count 8"),
    "llama4-top2": ("llama4", {}, dict(num_experts_per_tok=2),
                    r"num_experts_per_tok 2 with the router weight applied to the input \(Llama-4\) is not supported"),
}


def _saved(tmp_path, family, overrides, edits):
    path = tmp_path / "m"
    save_hf_model(family, path, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in edits.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _moe_blocks(model) -> dict[int, torch.nn.Module]:
    """{layer: transformers' MoE module} of a loaded causal LM."""
    base = model.model
    return {i: mlp for i, layer in enumerate(base.layers)
            for mlp in [next(getattr(layer, a) for a in ("mlp", "feed_forward", "block_sparse_moe") if hasattr(layer, a))]
            if hasattr(mlp, "experts")}


@pytest.mark.parametrize("case", MATCHES)
def test_the_reference_is_transformers_block(tmp_path, case):
    import transformers

    family, overrides, edits = MATCHES[case]
    path = _saved(tmp_path, family, overrides, edits)
    loader = transformers.Llama4ForCausalLM if family == "llama4" else transformers.AutoModelForCausalLM
    model = loader.from_pretrained(str(path), dtype=torch.float32).eval()
    blocks = _moe_blocks(model)
    with open_checkpoint(path) as ck:
        spec = describe(ck.config, ck.tensors)
        assert [m.index for m in spec.moe_layers] == sorted(blocks), case
        reader = ExpertReader(ck, spec)
        gen = torch.Generator().manual_seed(1)
        for m in spec.moe_layers:
            x = torch.randn(48, H, generator=gen)
            with torch.no_grad():
                out = blocks[m.index](x[None])
                want = (out[0] if isinstance(out, tuple) else out).reshape(48, H)
                gate, bias, router_bias = reader.router_fp32(m)
                experts = [reader.expert_fp32(m, e) for e in range(m.num_experts)]
                biases = [reader.biases(m, e) for e in range(m.num_experts)] if m.storage.biased else None
                got = reference_moe_forward(x, gate, bias, m.router, experts, reader.shared_fp32(m),
                                            router_bias=router_bias, biases=biases, act=m.activation)
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < MATCH, f"{case} layer {m.index}: rel err {rel:.3e} ({m.router})"


@pytest.mark.parametrize("case", REFUSALS)
def test_a_config_no_engine_serves_as_read_is_refused(tmp_path, case):
    family, overrides, edits, pattern = REFUSALS[case]
    path = _saved(tmp_path, family, overrides, edits)
    with open_checkpoint(path) as ck, pytest.raises(MoetoolError, match=pattern) as e:
        describe(ck.config, ck.tensors)
    assert "\n" not in str(e.value)


def test_a_qwen2_moe_shared_expert_without_its_gate_is_refused(tmp_path):
    """transformers and vLLM always gate Qwen2-MoE's shared expert: one whose gate is missing
    from the files was run ungated."""
    path = _saved(tmp_path, "qwen2_moe", {}, {})
    (f,) = path.glob("*.safetensors")
    tensors = {k: v for k, v in load_file(f).items() if "layers.1.mlp.shared_expert_gate" not in k}
    save_file(tensors, f, metadata={"format": "pt"})
    with open_checkpoint(path) as ck, pytest.raises(
            MoetoolError, match=r"^layer 1: shared expert gate model\.layers\.1\.mlp\.shared_expert_gate\.weight not found$"):
        describe(ck.config, ck.tensors)
