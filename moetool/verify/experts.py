"""Experts backends: run one rank's local experts on dispatched tokens.

As vLLM's ``FusedMoEPermuteExpertsUnpermute``: an experts backend sees only LOCAL expert
ids (slot numbers of this rank's ``LocalExperts``; -1 = the expert is on another rank, never
computed), declares its input format, and declares whether it applies the top-k weights
and sums over k itself ("weight-and-reduce"), or returns one row per (token, k) and leaves
that to the dispatcher's finalize (``weight_and_reduce`` below).

Letters: M = token rows on this rank, H = hidden, N = expert intermediate,
L = local expert slots, k = top-k, G = ceil(H / 128) activation scale groups.
"""
from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from moetool.errors import MoetoolError
from moetool.kernels.fused_moe import fused_experts
from moetool.kernels.quant import fp8_act_quant_ref, fp8_dequant_act_ref
from moetool.model.spec import LocalExperts
from moetool.verify.numerics import ACT_GROUPS, Numerics

#: fp8 activation quantization groups along H of the wire's default (DeepSeek-V3 block size)
ACT_GROUP = ACT_GROUPS["fp8-1x128"]
#: the numerics of a backend built without any: float32, unquantized activations
EXACT = Numerics("exact")


def dequant_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q float8_e4m3fn [M, H], scale float32 [M, G] (per 128-column group) or [M, 1] (per
    token) -> float32 [M, H]."""
    if q.dtype != torch.float8_e4m3fn:
        raise MoetoolError(f"quantized activations must be float8_e4m3fn, got {q.dtype}")
    return fp8_dequant_act_ref(q, scale, 0 if scale.shape[1] == 1 else ACT_GROUP)  # one column: the whole row


def fp8_round_trip(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, C] float -> float32 dequantize(quantize(x)) with fp8 e4m3 per ``group`` columns
    (0: per row): what an engine's W8A8 GEMM sees of its input."""
    if x.shape[0] == 0:
        return x.float()
    return fp8_dequant_act_ref(*fp8_act_quant_ref(x.float().contiguous(), group), group)


def weight_and_reduce(out: torch.Tensor, local_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """out float32 [M, k, H] (unweighted expert outputs, one per (token, k)), local_ids [M, k],
    topk_weights [M, k] -> sum_j w[m, j] * out[m, j] over the slots on this rank: [M, H]."""
    w = torch.where(local_ids >= 0, topk_weights.float(), torch.zeros_like(topk_weights, dtype=torch.float32))
    return (out * w[:, :, None]).sum(dim=1)


class ExpertsBackend:
    """One compute backend for a rank's local experts."""

    name: ClassVar[str]
    #: how the backend computes (and so what the dispatcher sends it): ``moetool.verify.numerics``
    numerics: Numerics = EXACT
    #: "standard": hidden [M, H] with local ids [M, k]; ("batched" [L, max_M, H] is not built)
    input_format: ClassVar[Literal["standard", "batched"]] = "standard"

    @property
    def applies_weights_and_reduces(self) -> bool:
        """True: ``apply`` returns [M, H] = sum over local slots of w * expert(x).
        False: ``apply`` returns unweighted [M, k, H] (zero where id is -1) and the
        dispatcher applies ``weight_and_reduce``."""
        raise NotImplementedError

    def bind(self, local: LocalExperts, device: torch.device) -> None:
        """Take this rank's experts of the layer about to run (once per layer, not per chunk)."""
        raise NotImplementedError

    def apply(self, hidden: torch.Tensor, hidden_scale: torch.Tensor | None, local_ids: torch.Tensor,
              topk_weights: torch.Tensor, expert_num_tokens: torch.Tensor,
              out_dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [M, H] (float, or float8_e4m3fn with hidden_scale float32 [M, G]; rows may be
        strided views), local_ids int64 [M, k] (-1: not here), topk_weights float32 [M, k],
        expert_num_tokens int64 [L] (rows per local slot) -> see applies_weights_and_reduces.
        out_dtype: dtype of the reduced [M, H] result (float32, or bfloat16 rounded once from
        the fp32 sum, what a bf16 combine sends); unreduced outputs are always float32.
        out: where to write the reduced result (out_dtype [M, H], e.g. a buffer the other ranks
        read); ignored by backends that do not reduce."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop what bind cached."""


def _check_ids(local_ids: torch.Tensor, num_slots: int) -> None:
    if not local_ids.numel():
        return
    lo, hi = torch.stack([local_ids.min(), local_ids.max()]).tolist()  # one host sync
    if hi >= num_slots or lo < -1:
        raise MoetoolError(f"local expert id out of range: ids span [{lo}, {hi}] with {num_slots} local slots")


class TorchExperts(ExpertsBackend):
    """Reference compute: a loop over local slots, weights dequantized to float32 once per
    layer by the format's own ``dequantize``.

    Exact numerics: float32 throughout (fp8 activations from the wire are dequantized, q * s).
    Served numerics emulate the engine's fused MoE step by step: the input in the served dtype
    (quantized to fp8 and back where the format declares fp8 activations and the dispatcher
    did not already), gate and up outputs rounded to the served dtype, silu(gate) * up rounded
    and, W8A8, quantized and dequantized again for the down GEMM, each pair's weighted output
    rounded, the sum over k in float32. Weight-only formats run their dequantized weights
    rounded to the served dtype (as vLLM's W4A16 and the bf16 kernels feed the tensor cores;
    moetool's int4 tiles under 64 rows keep theirs exact: docs/guide.md). Expert biases
    (gpt-oss) are held in the served dtype and added to each GEMM's float32 result
    before it is rounded (as vLLM's fused MoE adds them in its epilogue), the down bias before
    the top-k weight; the activation is the experts' own (``LocalExperts.activation``)."""

    name = "torch"

    def __init__(self, reduce: bool = True, numerics: Numerics = EXACT):
        self._reduce = reduce
        self.numerics = numerics
        self._bound: LocalExperts | None = None
        self._gate: list[torch.Tensor] = []  # L x [N, H]
        self._up: list[torch.Tensor] = []  # L x [N, H]
        self._down: list[torch.Tensor] = []  # L x [H, N]
        self._biases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []  # L x ([N], [N], [H])

    @property
    def applies_weights_and_reduces(self) -> bool:
        return self._reduce

    def bind(self, local: LocalExperts, device: torch.device) -> None:
        if self._bound is local:
            return
        self.release()
        fmt, N, H = local.fmt, local.intermediate, local.hidden
        # weight-only formats: the engine's GEMM reads the dequantized weight in the served dtype
        weights = self.numerics.round if self.numerics.act_group is None else (lambda w: w)
        for i in range(len(local.slot_to_global)):
            b = local.slot_biases(i)
            self._biases.append(None if b is None else tuple(self.numerics.round(t.to(device)) for t in b))
        for i, e in enumerate(local.slot_to_global):
            t13, t2 = local.slot(i)
            try:
                # split first: a w13 may carry per-half scales (fp8-block, N % 128 != 0)
                w13 = torch.cat([fmt.dequantize(part) for part in fmt.split_rows(t13, [N, N])])  # [2N, H]
                w2 = fmt.dequantize(t2)  # [H, N]
            except MoetoolError as err:
                raise MoetoolError(f"local slot {i} (expert {e}): {err}") from err
            if tuple(w13.shape) != (2 * N, H) or tuple(w2.shape) != (H, N):
                raise MoetoolError(f"local slot {i} (expert {e}): w13 {list(w13.shape)}, w2 "
                                   f"{list(w2.shape)}; expected [{2 * N}, {H}] and [{H}, {N}]")
            w13 = weights(w13.to(device=device, dtype=torch.float32))
            self._gate.append(w13[:N].contiguous())
            self._up.append(w13[N:].contiguous())
            self._down.append(weights(w2.to(device=device, dtype=torch.float32)).contiguous())
        self._bound = local

    def release(self) -> None:
        self._bound = None
        self._gate, self._up, self._down, self._biases = [], [], [], []

    def _input(self, hidden: torch.Tensor, hidden_scale: torch.Tensor | None) -> torch.Tensor:
        """The GEMM input [M, H] float32: fp8 rows dequantized; float rows in the served dtype,
        quantized to fp8 and back where the format's activations are fp8."""
        if hidden_scale is not None:
            return dequant_activations(hidden, hidden_scale)
        nm = self.numerics
        x = nm.round(hidden)
        return x if nm.act_group is None else fp8_round_trip(x, nm.act_group)

    def apply(self, hidden, hidden_scale, local_ids, topk_weights, expert_num_tokens, out_dtype=torch.float32,
              out=None):
        if self._bound is None:
            raise MoetoolError("TorchExperts.apply before bind")
        L = len(self._gate)
        _check_ids(local_ids, L)
        nm = self.numerics
        kind = self._bound.activation
        act = (lambda g, u: F.silu(g) * u) if kind.kind == "silu" else kind.apply
        x = self._input(hidden, hidden_scale)  # [M, H]
        M, k = local_ids.shape
        H = x.shape[1]
        acc = x.new_zeros((M, H) if self._reduce else (M, k, H))
        for s in range(L):
            if int(expert_num_tokens[s]) == 0:
                continue
            tok, j = torch.nonzero(local_ids == s, as_tuple=True)  # [n], [n]
            xs = x[tok]
            b = self._biases[s]
            g, u = xs @ self._gate[s].t(), xs @ self._up[s].t()  # [n, N] x2
            if b is not None:
                g, u = g + b[0], u + b[1]
            h = nm.round(act(nm.round(g), nm.round(u)))  # [n, N]
            if nm.act_group is not None:
                h = fp8_round_trip(h, nm.act_group)
            y = h @ self._down[s].t()  # [n, H]
            if b is not None:
                y = y + b[2]
            if self._reduce:
                acc.index_add_(0, tok, nm.round(y * topk_weights[tok, j].float()[:, None]))
            else:
                acc[tok, j] = nm.round(y)
        if not self._reduce:
            return acc
        if out is None:
            return acc.to(out_dtype)
        return out.copy_(acc)  # rounds to nearest even, as .to(out_dtype)


class TritonExperts(ExpertsBackend):
    """The fused Triton kernels (``moetool.kernels.fused_moe.fused_experts``) reading the
    format's stacked tensors directly; they apply the top-k weights and reduce over k.

    Served numerics are the kernels' own: float input in the served dtype, fp8 activations
    quantized inside for the W8A8 schemes. Exact numerics need float32 math with unquantized
    activations, which the W8A8 kernels do not compute: those formats are refused. gpt-oss's
    clamped SwiGLU and expert biases run in the kernels (silu step, GEMM epilogues)."""

    name = "triton"

    def __init__(self, numerics: Numerics = EXACT):
        self.numerics = numerics
        self._bound: LocalExperts | None = None
        self._w13: dict[str, torch.Tensor] = {}
        self._w2: dict[str, torch.Tensor] = {}

    @property
    def applies_weights_and_reduces(self) -> bool:
        return True

    def bind(self, local: LocalExperts, device: torch.device) -> None:
        if self._bound is local:
            return
        if local.fmt.kernel_scheme is None:
            raise MoetoolError(f"--experts triton: no fused kernel reads {local.fmt.name}; use --experts torch")
        if self.numerics.exact and local.fmt.activation_quant is not None:
            raise MoetoolError(f"--numerics exact with --experts triton: the {local.fmt.name} kernels compute W8A8 "
                               "(fp8 activations); use --experts torch for float32 activations")
        self._w13 = {k: v.to(device) for k, v in local.w13.items()}
        self._w2 = {k: v.to(device) for k, v in local.w2.items()}
        self._fmt_name = local.fmt.kernel_scheme
        self._group_size = getattr(local.fmt, "group_size", 128)  # int4-group's g
        act = local.activation  # gpt-oss: clamped SwiGLU and expert biases, in the kernels' epilogues
        self._act = {"activation": "clamped-swiglu", "swiglu": (act.alpha, act.limit)} if act.kind != "silu" else {}
        # biases in the served dtype, as the torch experts hold them
        self._bias = {name: None if b is None else self.numerics.round(b.to(device)).contiguous()
                      for name, b in (("w13_bias", local.bias13), ("w2_bias", local.bias2))}
        self._num_slots = len(local.slot_to_global)
        # the kernels' tile rules count pairs per expert over the experts routed to on all ranks
        self._global_experts = local.num_experts or None
        self._bound = local

    def release(self) -> None:
        self._bound, self._w13, self._w2 = None, {}, {}

    def apply(self, hidden, hidden_scale, local_ids, topk_weights, expert_num_tokens, out_dtype=torch.float32,
              out=None):
        if self._bound is None:
            raise MoetoolError("TritonExperts.apply before bind")
        _check_ids(local_ids, self._num_slots)
        if local_ids.shape[0] == 0:
            return torch.zeros(0, hidden.shape[1], dtype=out_dtype, device=hidden.device) if out is None else out
        if hidden_scale is None and not self.numerics.exact:
            hidden = hidden.to(self.numerics.act_dtype)  # e.g. the probe batch, made in float32
        return fused_experts(hidden, self._w13, self._w2, self._fmt_name, local_ids, topk_weights,
                             hidden_scale=hidden_scale, apply_router_weight=True, check_ids=False,
                             group_size=self._group_size, out_dtype=out_dtype, out=out,
                             global_experts=self._global_experts, **self._act, **self._bias)


EXPERTS: dict[str, type[ExpertsBackend]] = {"torch": TorchExperts, "triton": TritonExperts}


def get_experts(name: str, numerics: Numerics = EXACT) -> ExpertsBackend:
    """An experts backend by CLI name ("torch" or "triton") computing in ``numerics``."""
    if name not in EXPERTS:
        raise MoetoolError(f"unknown experts backend {name!r} (known: {', '.join(EXPERTS)})")
    return EXPERTS[name](numerics=numerics)
