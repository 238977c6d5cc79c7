"""route() against the routers transformers ships, one family per test, plus its own rules."""
from __future__ import annotations

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.model.spec import RouterSpec
from moetool.verify.router import route

transformers = pytest.importorskip("transformers")

T, H, E = 64, 40, 8
#: route() rounds float64 logits, transformers accumulates in float32: weights differ by
#: float32 rounding of the logits, amplified a little by softmax
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else 1.0))


def _by_id(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order each row's choices by expert id (transformers' sorted=False order is arbitrary)."""
    ids_sorted, order = ids.sort(dim=-1)
    return ids_sorted, w.gather(1, order)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_matches_qwen3_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    ref = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2,
                                            norm_topk_prob=norm))
    _randomize(ref, 0)
    x = _x()
    _, ref_w, ref_ids = ref(x)
    ids, w = route(x, ref.weight, RouterSpec(top_k=2, renormalize=norm))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, **TOL)


def test_softmax_topk_matches_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    ref = MixtralTopKRouter(MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=2))
    _randomize(ref, 1)
    x = _x(2)
    _, ref_w, ref_ids = ref(x)
    ids, w = route(x, ref.weight, RouterSpec(top_k=2))
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, **TOL)


def test_grouped_max_matches_deepseek_v2():
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=E, num_experts_per_tok=3, n_group=4, topk_group=2,
                           routed_scaling_factor=1.5, topk_method="group_limited_greedy")
    ref = DeepseekV2TopkRouter(cfg)
    _randomize(ref, 2)
    x = _x(3)
    _, ref_w, ref_ids = ref(x)
    spec = RouterSpec(top_k=3, n_group=4, topk_group=2, group_score="max", renormalize=False,
                      routed_scaling_factor=1.5)
    ids, w = route(x, ref.weight, spec)
    ids, w = _by_id(ids, w)
    ref_ids, ref_w = _by_id(ref_ids, ref_w)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, **TOL)
    # the group limit matters: plain top-3 picks differently for some tokens
    plain_ids, _ = route(x, ref.weight, RouterSpec(top_k=3, renormalize=False))
    assert not torch.equal(plain_ids.sort(dim=-1).values, ids)


def test_grouped_top2sum_with_bias_matches_deepseek_v3():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, norm_topk_prob=True)
    ref = DeepseekV3TopkRouter(cfg)
    _randomize(ref, 3)
    with torch.no_grad():
        ref.e_score_correction_bias.mul_(5.0)  # big enough to change choices
    x = _x(4)
    _, ref_w, ref_ids = ref(x)
    spec = RouterSpec(top_k=3, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2-sum",
                      routed_scaling_factor=2.5, has_correction_bias=True)
    ids, w = route(x, ref.weight, spec, ref.e_score_correction_bias)
    ids, w = _by_id(ids, w)
    ref_ids, ref_w = _by_id(ref_ids, ref_w)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, **TOL)
    # the bias steers selection only: weights are unbiased scores
    no_bias_ids, _ = route(x, ref.weight, RouterSpec(**{**spec.__dict__, "has_correction_bias": False}))
    assert not torch.equal(no_bias_ids.sort(dim=-1).values, ids)
    chosen = torch.sigmoid(x.double() @ ref.weight.double().t()).float().gather(1, ids)
    torch.testing.assert_close(w, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_sigmoid_top1_matches_llama4():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    ref = Llama4Router(Llama4TextConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=1))
    _randomize(ref, 4)
    x = _x(5)
    ref_scores, _ = ref(x)  # [T, E]: sigmoid at the chosen expert, 0 elsewhere
    ids, w = route(x, ref.weight, RouterSpec(top_k=1, scoring="sigmoid", renormalize=False,
                                             apply_weight_on_input=True))
    assert torch.equal(ids[:, 0], ref_scores.argmax(dim=-1))
    torch.testing.assert_close(w[:, 0], ref_scores.max(dim=-1).values, **TOL)


def test_saturated_sigmoid_ranks_the_logits_as_llama4_does():
    """Logits 18 and 25 both give sigmoid 1.0 in float32: ranking the scores would pick the
    first index (expert 1); transformers' Llama-4 router and vLLM rank the logits (expert 3)."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    ref = Llama4Router(Llama4TextConfig(hidden_size=4, num_local_experts=4, num_experts_per_tok=1))
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 18.0, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, 25.0]]))
    x = torch.ones(1, 4)
    assert torch.sigmoid(torch.tensor([18.0, 25.0])).tolist() == [1.0, 1.0]
    ref_scores, _ = ref(x)
    ids, w = route(x, ref.weight, RouterSpec(top_k=1, scoring="sigmoid", renormalize=False,
                                             apply_weight_on_input=True))
    assert ids.tolist() == [[3]] and int(ref_scores.argmax(dim=-1)) == 3
    # two of four: logits order 25 > 18 > 2 > 1
    ids2, _ = route(x, ref.weight, RouterSpec(top_k=2, scoring="sigmoid", renormalize=False))
    assert ids2.tolist() == [[3, 1]]


def test_routing_of_a_token_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(7)
    x, gate = torch.randn(300, 96, generator=gen), torch.randn(64, 96, generator=gen)
    spec = RouterSpec(top_k=4)
    ids, w = route(x, gate, spec)
    for lo, hi in [(0, 1), (3, 10), (17, 81), (100, 300)]:
        ids_p, w_p = route(x[lo:hi], gate, spec)
        assert torch.equal(ids_p, ids[lo:hi]) and torch.equal(w_p, w[lo:hi])


def test_inconsistent_specs_raise():
    x, gate = torch.randn(4, H), torch.randn(E, H)
    with pytest.raises(MoetoolError, match="correction_bias"):
        route(x, gate, RouterSpec(top_k=2, has_correction_bias=True))
    with pytest.raises(MoetoolError, match="correction_bias"):
        route(x, gate, RouterSpec(top_k=2), torch.zeros(E))
    with pytest.raises(MoetoolError, match="inconsistent"):
        route(x, gate, RouterSpec(top_k=5, n_group=4, topk_group=2))
    with pytest.raises(MoetoolError, match="top_k"):
        route(x, gate, RouterSpec(top_k=9))
    with pytest.raises(MoetoolError, match="do not match"):
        route(x, torch.randn(E, H + 1), RouterSpec(top_k=2))
