"""The single-process MoE forward the distributed run is compared against.

Deliberately the plainest code path: one loop over experts, 2-D per-expert weights, no
stacking, no placement, no dispatch, no quantized formats. Letters: T = tokens,
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
    if spec.apply_weight_on_input and spec.top_k != 1:
        raise MoetoolError(f"apply_weight_on_input needs top_k 1, not {spec.top_k}")
    x = x.float()
    topk_ids, topk_weights = route(x, gate_weight, spec, correction_bias, router_bias)  # [T, k] x2
    out = torch.zeros_like(x)  # [T, H]
    for e, (gate, up, down) in enumerate(experts):
        tok, j = torch.nonzero(topk_ids == e, as_tuple=True)  # [n], [n]
        if tok.numel() == 0:
            continue
        w = topk_weights[tok, j][:, None]  # [n, 1]
        xin = x[tok]  # [n, H]
        b = None if biases is None else biases[e]
        if spec.apply_weight_on_input:
            y = swiglu(xin * w, gate.float(), up.float(), down.float(), biases=b, act=act)
        else:
            y = swiglu(xin, gate.float(), up.float(), down.float(), biases=b, act=act) * w
        out.index_add_(0, tok, y)
    if shared is not None:
        out = out + shared_forward(x, shared, act=act)
    return out
