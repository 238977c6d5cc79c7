"""reference_moe_forward against transformers' own MoE blocks with random weights copied in."""
from __future__ import annotations

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.model.spec import RouterSpec
from moetool.verify.reference import reference_moe_forward

transformers = pytest.importorskip("transformers")

T, H, N, E = 24, 40, 16, 8
#: float32 block vs float32 loop; the router's float64 logits move weights by ~1e-7 relative
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            scale = 0.1 if p.dim() == 1 else p.shape[-1] ** -0.5
            if "gate.weight" in name or "router" in name:
                scale = 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def _stacked(experts) -> list:
    """transformers [E, 2N, H] gate_up / [E, H, N] down -> [(gate, up, down)]."""
    n = experts.gate_up_proj.shape[1] // 2
    return [(experts.gate_up_proj[e, :n].detach(), experts.gate_up_proj[e, n:].detach(),
             experts.down_proj[e].detach()) for e in range(experts.gate_up_proj.shape[0])]


def _mlp(mlp, gate=None):
    return (mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach(),
            None if gate is None else gate.weight.detach())


def _x(seed=11):
    return torch.randn(1, T, H, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_matches_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=N, num_local_experts=E,
                                                num_experts_per_tok=2)).eval()
    _randomize(block, 0)
    x = _x()
    ref = block(x)[0]
    y = reference_moe_forward(x[0], block.gate.weight, None, RouterSpec(top_k=2), _stacked(block.experts))
    torch.testing.assert_close(y, ref, **TOL)


@torch.no_grad()
def test_matches_qwen3_moe_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=N, num_experts=E, num_experts_per_tok=3,
                         norm_topk_prob=False)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    _randomize(block, 1)
    x = _x(12)
    ref = block(x)[0]
    y = reference_moe_forward(x[0], block.gate.weight, None, RouterSpec(top_k=3, renormalize=False),
                              _stacked(block.experts))
    torch.testing.assert_close(y, ref, **TOL)


@torch.no_grad()
def test_matches_qwen2_moe_block_with_gated_shared_expert():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=N, shared_expert_intermediate_size=24,
                         num_experts=E, num_experts_per_tok=2, norm_topk_prob=True)
    block = Qwen2MoeSparseMoeBlock(cfg).eval()
    _randomize(block, 2)
    x = _x(13)
    ref = block(x)[0]
    y = reference_moe_forward(x[0], block.gate.weight, None, RouterSpec(top_k=2), _stacked(block.experts),
                              _mlp(block.shared_expert, block.shared_expert_gate))
    torch.testing.assert_close(y, ref, **TOL)


@torch.no_grad()
def test_matches_deepseek_v3_moe():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=N, n_routed_experts=E, num_experts_per_tok=3,
                           n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    block = DeepseekV3MoE(cfg).eval()
    _randomize(block, 3)
    x = _x(14)
    ref = block(x)[0]
    spec = RouterSpec(top_k=3, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2-sum",
                      routed_scaling_factor=2.5, has_correction_bias=True)
    y = reference_moe_forward(x[0], block.gate.weight, block.gate.e_score_correction_bias, spec,
                              _stacked(block.experts), _mlp(block.shared_experts))
    torch.testing.assert_close(y, ref, **TOL)


@torch.no_grad()
def test_matches_llama4_moe_weight_on_input():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    block = Llama4TextMoe(Llama4TextConfig(hidden_size=H, intermediate_size=N, num_local_experts=E,
                                           num_experts_per_tok=1)).eval()
    _randomize(block, 4)
    x = _x(15)
    ref = block(x)[0]
    gu, down = block.experts.gate_up_proj, block.experts.down_proj  # [E, H, 2N], [E, N, H]
    experts = [(gu[e, :, :N].t(), gu[e, :, N:].t(), down[e].t()) for e in range(E)]
    spec = RouterSpec(top_k=1, scoring="sigmoid", renormalize=False, apply_weight_on_input=True)
    y = reference_moe_forward(x[0], block.router.weight, None, spec, experts, _mlp(block.shared_expert))
    torch.testing.assert_close(y, ref, **TOL)
    # weighting the output instead is a different function: the test would catch the mix-up
    out_w = reference_moe_forward(x[0], block.router.weight, None,
                                  RouterSpec(top_k=1, scoring="sigmoid", renormalize=False), experts,
                                  _mlp(block.shared_expert))
    assert (out_w - ref).norm() > 1e-3 * ref.norm()


def test_rejects_wrong_expert_count_and_weight_on_input_with_top2():
    x, gate = torch.randn(3, H), torch.randn(E, H)
    experts = [(torch.randn(N, H), torch.randn(N, H), torch.randn(H, N))] * (E - 1)
    with pytest.raises(MoetoolError, match="experts"):
        reference_moe_forward(x, gate, None, RouterSpec(top_k=2), experts)
    with pytest.raises(MoetoolError, match="top_k 1"):
        reference_moe_forward(x, gate, None, RouterSpec(top_k=2, apply_weight_on_input=True), experts + experts[:1])
