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
from moetool.model.spec import RouterSpec
from moetool.verify.router import route

#: one expert in fp32: (gate [N, H], up [N, H], down [H, N])
ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: shared expert: (gate [Ns, H], up [Ns, H], down [H, Ns], shared_expert_gate [1, H] or None)
SharedWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           rnd: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] -> down(silu(gate x) * up x) [T, H], float32 math. ``rnd``: rounds each
    intermediate (gate x, up x, their product, the output) as an engine storing them in its
    activation dtype does (``Numerics.round``); None: no rounding."""
    if rnd is None:
        return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    return rnd(rnd(F.silu(rnd(x @ gate.t())) * rnd(x @ up.t())) @ down.t())


def shared_forward(x: torch.Tensor, shared: SharedWeights,
                   rnd: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] float32 -> the shared expert's output [T, H], scaled by
    sigmoid(shared_expert_gate x) when that gate exists (Qwen2-MoE). ``rnd`` as in ``swiglu``."""
    gate, up, down, sgate = shared
    y = swiglu(x, gate.float(), up.float(), down.float(), rnd)  # [T, H]
    if sgate is not None:
        y = torch.sigmoid(x @ sgate.float().t()) * y  # [T, 1] * [T, H]
        y = y if rnd is None else rnd(y)
    return y


def reference_moe_forward(x: torch.Tensor, gate_weight: torch.Tensor,
                          correction_bias: torch.Tensor | None, spec: RouterSpec,
                          experts: Sequence[ExpertWeights],
                          shared: SharedWeights | None = None) -> torch.Tensor:
    """x [T, H] float32 -> MoE layer output [T, H] float32.

    ``experts[e]`` = (gate [N, H], up [N, H], down [H, N]) of global expert e, fp32
    (dequantized from the original checkpoint). For each expert e and each (token t, slot j)
    that chose it: ``w[t, j] * expert_e(x[t])``, or ``expert_e(w[t, j] * x[t])`` with
    ``apply_weight_on_input`` (Llama-4, top-1 only). Shared expert output is added once.
    """
    if len(experts) != gate_weight.shape[0]:
        raise MoetoolError(f"reference: {len(experts)} experts but the gate has {gate_weight.shape[0]} rows")
    if spec.apply_weight_on_input and spec.top_k != 1:
        raise MoetoolError(f"apply_weight_on_input needs top_k 1, not {spec.top_k}")
    x = x.float()
    topk_ids, topk_weights = route(x, gate_weight, spec, correction_bias)  # [T, k] x2
    out = torch.zeros_like(x)  # [T, H]
    for e, (gate, up, down) in enumerate(experts):
        tok, j = torch.nonzero(topk_ids == e, as_tuple=True)  # [n], [n]
        if tok.numel() == 0:
            continue
        w = topk_weights[tok, j][:, None]  # [n, 1]
        xin = x[tok]  # [n, H]
        if spec.apply_weight_on_input:
            y = swiglu(xin * w, gate.float(), up.float(), down.float())
        else:
            y = swiglu(xin, gate.float(), up.float(), down.float()) * w
        out.index_add_(0, tok, y)
    if shared is not None:
        out = out + shared_forward(x, shared)
    return out
