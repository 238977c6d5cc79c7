"""Plain values shared by the planner, the converters and the verify runtime.

Letters: T = tokens, H = hidden size (K of w13, N of w2), N = expert intermediate size,
E = experts in a layer, k = experts chosen per token (top-k), R = EP ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch is imported where a tensor is made: planning and copying run without it
    import torch


@dataclass(frozen=True)
class RouterSpec:
    """How a layer's router turns gate logits [T, E] into (topk_ids, topk_weights) [T, k].

    softmax (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2, gpt-oss) or sigmoid (DeepSeek-V3, Llama-4)
    scores; with ``n_group`` set, selection first keeps ``topk_group`` of the ``n_group`` expert
    groups, ranked by ``group_score`` ("max": DeepSeek-V2; "top2-sum": DeepSeek-V3). The
    correction bias (DeepSeek-V3 ``e_score_correction_bias``) is added for selection only;
    weights are taken from the unbiased scores, renormalized to sum 1 when ``renormalize``,
    then multiplied by ``routed_scaling_factor``. ``apply_weight_on_input`` (Llama-4) scales
    the token before the expert instead of the expert's output. ``has_router_bias`` (gpt-oss
    ``router.bias`` [E]): a bias added to the logits themselves, so it counts for both the
    selection and the weights (gpt-oss: softmax over the k largest biased logits).
    """

    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    n_group: int | None = None
    topk_group: int | None = None
    group_score: Literal["max", "top2-sum"] = "max"
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False
    apply_weight_on_input: bool = False
    has_router_bias: bool = False


#: config.json ``hidden_act`` values naming the SiLU of a SwiGLU expert (transformers' ACT2FN
#: maps both to SiLU)
SILU_NAMES = ("silu", "swish")


@dataclass(frozen=True)
class ExpertActivation:
    """How an expert MLP (routed or shared) combines its projections before ``down``:
    h [T, N] = act(gate [T, N], up [T, N]).

    ``silu``: silu(gate) * up, the SwiGLU of every family but gpt-oss (config.json ``hidden_act``
    "silu" or its alias "swish"). ``clamped-swiglu`` (gpt-oss, config ``swiglu_alpha`` and
    ``swiglu_limit``): gate clamped to at most ``limit``, up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1). (gpt-oss also interleaves gate and up rows on disk:
    that is storage, ``ExpertStorage.interleaved``.)
    """

    kind: Literal["silu", "clamped-swiglu"] = "silu"
    alpha: float = 1.0
    limit: float = float("inf")

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The reference: act(gate, up) in the inputs' dtype."""
        import torch

        if self.kind == "silu":
            return torch.nn.functional.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)

    def describe(self) -> str:
        if self.kind == "silu":
            return "silu (SwiGLU)"
        return f"clamped SwiGLU (alpha {self.alpha:g}, limit {self.limit:g}, up + 1)"


@dataclass(frozen=True)
class SharedExpertSpec:
    """Shared expert(s) added after combine: dense SwiGLU MLP of ``intermediate`` rows, optionally
    scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""

    intermediate: int
    has_gate: bool = False


@dataclass
class ExpertPlacement:
    """Where each global expert of one layer lives: global id -> [(rank, local slot), ...].

    The first entry is the primary copy; further entries are redundant replicas (EPLB).
    ``slots[r]`` is the inverse: rank r's local slot -> global expert id.
    """

    num_experts: int
    num_ranks: int
    replicas: dict[int, list[tuple[int, int]]]

    @property
    def slots(self) -> list[list[int]]:
        per_rank: list[dict[int, int]] = [dict() for _ in range(self.num_ranks)]
        for e, places in self.replicas.items():
            for rank, slot in places:
                per_rank[rank][slot] = e
        return [[d[s] for s in sorted(d)] for d in per_rank]

    def expert_map(self, rank: int) -> torch.Tensor:
        """int64 [E]: global id -> local slot on ``rank`` (first replica there), -1 elsewhere
        (vLLM ``determine_expert_map`` convention)."""
        import torch

        m = torch.full((self.num_experts,), -1, dtype=torch.int64)
        for e, places in self.replicas.items():
            for r, slot in places:
                if r == rank and m[e] < 0:
                    m[e] = slot
        return m


@dataclass
class LocalExperts:
    """One rank's experts of one MoE layer, in the stacked layout of the shard's format.

    ``w13``: {suffix: tensor} with leading dim E_local; the logical weight is [E_local, 2N, H]
    (gate rows first, then up). ``w2``: logical [E_local, H, N]. ``fmt`` is a
    ``moetool.formats.base.WeightFormat``. ``slot_to_global[i]`` is the global id of slot i.
    ``bias13`` [E_local, 2N] (gate then up) and ``bias2`` [E_local, H]: the experts' biases
    (gpt-oss), never quantized, or None; ``activation``: act(gate, up) of every expert;
    ``num_experts``: the layer's routed experts on all ranks (0: not known).
    """

    fmt: object
    w13: dict[str, torch.Tensor]
    w2: dict[str, torch.Tensor]
    slot_to_global: list[int]
    intermediate: int
    hidden: int
    extra: dict = field(default_factory=dict)
    bias13: torch.Tensor | None = None
    bias2: torch.Tensor | None = None
    activation: ExpertActivation = field(default_factory=ExpertActivation)
    num_experts: int = 0

    def slot(self, i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(w13 tensors, w2 tensors) of local slot i, each 2-D as the format stores one linear."""
        return ({k: v[i] for k, v in self.w13.items()}, {k: v[i] for k, v in self.w2.items()})

    def slot_biases(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(gate [N], up [N], down [H]) biases of local slot i, or None."""
        if self.bias13 is None or self.bias2 is None:
            return None
        n = self.intermediate
        return self.bias13[i, :n], self.bias13[i, n:], self.bias2[i]
