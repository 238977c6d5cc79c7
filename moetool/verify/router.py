"""The router: gate logits -> (topk_ids, topk_weights), for every router family of RouterSpec.

Letters: T = tokens, H = hidden size, E = experts, k = top-k, G = expert groups.
"""
from __future__ import annotations

import torch

from moetool.errors import MoetoolError
from moetool.model.spec import RouterSpec


def gate_logits(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], gate_weight [E, H], bias [E] or None -> logits float32 [T, E].

    Accumulated in float64 and rounded to float32: a float32 GEMM's rounding depends on
    the batch it runs in (BLAS blocking, split-K), so the same token could pick another
    expert in a distributed chunk than in the single-process reference at a near tie.
    Rounding a float64 result makes a token's logits independent of its batch.
    """
    logits = x.double() @ gate_weight.double().t()  # [T, E]
    return (logits if bias is None else logits + bias.double()[None, :]).float()


def route(x: torch.Tensor, gate_weight: torch.Tensor, spec: RouterSpec,
          correction_bias: torch.Tensor | None = None,
          router_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (any float dtype), gate_weight [E, H], correction_bias float [E] or None,
    router_bias [E] or None (added to the logits: gpt-oss)
    -> (topk_ids int64 [T, k], topk_weights float32 [T, k]), ordered by selection score.

    Scores are softmax or sigmoid of the logits. Selection ranks the logits themselves (both
    scorings are monotonic, and in float32 sigmoid saturates: logits 18 and 25 both give 1.0,
    so ranking scores would break that tie by index; transformers and vLLM rank the logits),
    or ``scores + bias`` with a correction bias (DeepSeek-V3 ``e_score_correction_bias``,
    added to the sigmoid scores); with ``n_group`` it first keeps the
    ``topk_group`` best groups by group score ("max" of the group, DeepSeek-V2; "top2-sum"
    of the two best biased scores, DeepSeek-V3). Weights are the *unbiased* scores of the
    chosen experts, renormalized to sum 1 if ``renormalize``, times ``routed_scaling_factor``.
    Ties go to torch.topk (sorted), the same on every rank.
    """
    if x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1]:
        raise MoetoolError(f"router: x {tuple(x.shape)} and gate weight {tuple(gate_weight.shape)} "
                           "do not match ([T, H] and [E, H])")
    E = gate_weight.shape[0]
    if not 0 < spec.top_k <= E:
        raise MoetoolError(f"router: top_k {spec.top_k} not in 1..{E}")
    if spec.has_correction_bias != (correction_bias is not None):
        raise MoetoolError("router: the spec says has_correction_bias="
                           f"{spec.has_correction_bias} but correction_bias is "
                           f"{'missing' if correction_bias is None else 'given'}")
    if spec.has_router_bias != (router_bias is not None):
        raise MoetoolError("router: the spec says has_router_bias="
                           f"{spec.has_router_bias} but router_bias is "
                           f"{'missing' if router_bias is None else 'given'}")
    logits = gate_logits(x, gate_weight, router_bias)  # [T, E]
    if spec.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)  # [T, E]
    elif spec.scoring == "sigmoid":
        scores = torch.sigmoid(logits)  # [T, E]
    else:
        raise MoetoolError(f"router: unknown scoring {spec.scoring!r}")
    choice = logits if correction_bias is None else scores + correction_bias.float()[None, :]  # [T, E]
    if spec.n_group:
        choice = _mask_groups(choice, spec)
    topk_ids = torch.topk(choice, spec.top_k, dim=-1, sorted=True).indices  # [T, k]
    topk_weights = scores.gather(1, topk_ids)  # [T, k]
    if spec.renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if spec.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * spec.routed_scaling_factor
    return topk_ids.to(torch.int64), topk_weights.float()


def _mask_groups(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """choice [T, E] -> choice with the experts of all but the best ``topk_group`` groups
    set to -inf."""
    T, E = choice.shape
    G = spec.n_group
    topk_group = spec.topk_group or G
    if E % G or not 0 < topk_group <= G or spec.top_k > topk_group * (E // G):
        raise MoetoolError(f"router: {E} experts, n_group {G}, topk_group {topk_group}, "
                           f"top_k {spec.top_k} are inconsistent")
    grouped = choice.view(T, G, E // G)  # [T, G, E/G]
    if spec.group_score == "max":
        group_scores = grouped.max(dim=-1).values  # [T, G]
    elif spec.group_score == "top2-sum":
        group_scores = grouped.topk(min(2, E // G), dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        raise MoetoolError(f"router: unknown group_score {spec.group_score!r}")
    group_idx = torch.topk(group_scores, topk_group, dim=-1, sorted=True).indices  # [T, topk_group]
    keep = torch.zeros(T, G, dtype=torch.bool, device=choice.device).scatter_(1, group_idx, True)
    keep = keep[:, :, None].expand(T, G, E // G).reshape(T, E)  # [T, E]
    return choice.masked_fill(~keep, float("-inf"))
