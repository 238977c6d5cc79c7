"""The single-process MoE forward the distributed run is compared against.

Deliberately the plainest code path: one loop over experts (each expert's tokens found by
sorting the routing once), 2-D per-expert float32 weights, no stacking, no placement, no
dispatch, no quantized formats. Letters: T = tokens,
H = hidden, N = expert intermediate, E = experts, k = top-k.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from moetool.errors import MoetoolError
from moetool.model.spec import ExpertActivation, RouterSpec
from moetool.verify.router import route

#: one expert in fp32: (gate [N, H], up [N, H], down [H, N])
ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: one expert's biases (gpt-oss): (gate [N], up [N], down [H])
ExpertBiases = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: shared expert: (gate [Ns, H], up [Ns, H], down [H, Ns], shared_expert_gate [1, H] or None)
SharedWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]
SILU = ExpertActivation()


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           rnd: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
           biases: ExpertBiases | None = None, act: ExpertActivation = SILU) -> torch.Tensor:
    """x [T, H] -> down(act(gate x + b_gate, up x + b_up)) + b_down [T, H], float32 math
    (``act``: silu(gate) * up, or gpt-oss's clamped SwiGLU; ``biases``: gpt-oss's, else none).
    ``rnd``: rounds each intermediate (gate x, up x, the activation, the output) as an engine
    storing them in its activation dtype does (``Numerics.round``); None: no rounding."""
    rnd = rnd or (lambda t: t)
    g, u = x @ gate.t(), x @ up.t()  # [T, N] x2
    if biases is not None:
        g, u = g + biases[0].float(), u + biases[1].float()
    y = rnd(_act(act, rnd(g), rnd(u))) @ down.t()  # [T, H]
    return rnd(y if biases is None else y + biases[2].float())


def _act(act: ExpertActivation, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up if act.kind == "silu" else act.apply(gate, up)


def shared_forward(x: torch.Tensor, shared: SharedWeights,
                   rnd: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   act: ExpertActivation = SILU) -> torch.Tensor:
    """x [T, H] float32 -> the shared expert's output [T, H], scaled by
    sigmoid(shared_expert_gate x) when that gate exists (Qwen2-MoE). ``rnd`` as in ``swiglu``."""
    gate, up, down, sgate = shared
    y = swiglu(x, gate.float(), up.float(), down.float(), rnd, act=act)  # [T, H]
    if sgate is not None:
        y = torch.sigmoid(x @ sgate.float().t()) * y  # [T, 1] * [T, H]
        y = y if rnd is None else rnd(y)
    return y


class StreamingReference:
    """The reference forward of one MoE layer over several token batches at once, fed one
    expert at a time, so each expert is read once for all of them (and for the probe batch).

    ``xs``: [T_b, H] per batch (each dp group's tokens), routed once here; ``probe``: [P, H] run
    through every expert alone (weight 1, no routing), or None. ``add(e, ...)`` takes global
    expert e's float32 weights; ``finish(shared)`` returns each batch's output [T_b, H]."""

    def __init__(self, xs: Sequence[torch.Tensor], gate_weight: torch.Tensor,
                 correction_bias: torch.Tensor | None, spec: RouterSpec, *,
                 router_bias: torch.Tensor | None = None, act: ExpertActivation = SILU,
                 probe: torch.Tensor | None = None):
        if spec.apply_weight_on_input and spec.top_k != 1:
            raise MoetoolError(f"apply_weight_on_input needs top_k 1, not {spec.top_k}")
        self.spec, self.act, self.num_experts = spec, act, gate_weight.shape[0]
        self.xs = [x.float() for x in xs]
        self.outs = [torch.zeros_like(x) for x in self.xs]  # [T_b, H] each
        #: per batch: (order [T_b*k] of the (token, slot) pairs sorted by expert, weights [T_b, k],
        #: start of each expert's run in ``order`` [E + 1]) -- one host sync per batch, not per expert
        self.routes = []
        for x in self.xs:
            ids, w = route(x, gate_weight, spec, correction_bias, router_bias)  # [T_b, k] x2
            order = torch.argsort(ids.flatten(), stable=True)
            counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
            starts = [0, *torch.cumsum(counts, 0).tolist()]
            self.routes.append((order, w, starts))
        self.probe = None if probe is None else probe.float()
        #: global expert -> its output on the probe batch [P, H]
        self.probe_out: dict[int, torch.Tensor] = {}
        self.seen: set[int] = set()

    def add(self, e: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            biases: ExpertBiases | None = None) -> None:
        """Expert e's (gate [N, H], up [N, H], down [H, N]) float32: ``w[t, j] * expert_e(x[t])``
        for each (token t, slot j) that chose it (``expert_e(w x)`` with apply_weight_on_input)."""
        if not 0 <= e < self.num_experts or e in self.seen:
            raise MoetoolError(f"reference: expert {e} given twice or out of range (the gate has {self.num_experts})")
        self.seen.add(e)
        k = self.spec.top_k
        for x, out, (order, weights, starts) in zip(self.xs, self.outs, self.routes):
            if starts[e + 1] == starts[e]:
                continue
            pairs = order[starts[e]:starts[e + 1]]  # [n] flat (token, slot) indices
            tok = pairs // k
            w = weights.flatten()[pairs][:, None]  # [n, 1]
            if self.spec.apply_weight_on_input:
                y = swiglu(x[tok] * w, gate, up, down, biases=biases, act=self.act)
            else:
                y = swiglu(x[tok], gate, up, down, biases=biases, act=self.act) * w
            out.index_add_(0, tok, y)
        if self.probe is not None:
            self.probe_out[e] = swiglu(self.probe, gate, up, down, biases=biases, act=self.act)

    def finish(self, shared: SharedWeights | None = None) -> list[torch.Tensor]:
        """Each batch's output [T_b, H] float32, the shared expert's added once per token."""
        if len(self.seen) != self.num_experts:
            missing = sorted(set(range(self.num_experts)) - self.seen)[:5]
            raise MoetoolError(f"reference: {self.num_experts - len(self.seen)} experts never given (first {missing})")
        if shared is None:
            return self.outs
        return [out + shared_forward(x, shared, act=self.act) for x, out in zip(self.xs, self.outs)]


def reference_moe_forward(x: torch.Tensor, gate_weight: torch.Tensor,
                          correction_bias: torch.Tensor | None, spec: RouterSpec,
                          experts: Sequence[ExpertWeights],
                          shared: SharedWeights | None = None, *,
                          router_bias: torch.Tensor | None = None,
                          biases: Sequence[ExpertBiases] | None = None,
                          act: ExpertActivation = SILU) -> torch.Tensor:
    """x [T, H] float32 -> MoE layer output [T, H] float32.

    ``experts[e]`` = (gate [N, H], up [N, H], down [H, N]) of global expert e, fp32
    (dequantized from the original checkpoint), with ``biases[e]`` (gpt-oss) and the
    activation ``act``. For each expert e and each (token t, slot j) that chose it:
    ``w[t, j] * expert_e(x[t])`` (the down bias inside the expert, so weighted too), or
    ``expert_e(w[t, j] * x[t])`` with ``apply_weight_on_input`` (Llama-4, top-1 only). Shared
    expert output is added once. ``router_bias``: added to the router's logits (gpt-oss).
    """
    if len(experts) != gate_weight.shape[0]:
        raise MoetoolError(f"reference: {len(experts)} experts but the gate has {gate_weight.shape[0]} rows")
    ref = StreamingReference([x], gate_weight, correction_bias, spec, router_bias=router_bias, act=act)
    for e, (gate, up, down) in enumerate(experts):
        ref.add(e, gate.float(), up.float(), down.float(), None if biases is None else biases[e])
    return ref.finish(shared)[0]
