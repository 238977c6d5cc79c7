"""Grouped expert computation (vLLM ``fused_moe`` style) for one rank's local experts: the
pipeline of kernels, :func:`fused_experts`, and its pure-torch reference, :func:`fused_experts_ref`.

Letters: T = tokens, H = hidden size, N = expert intermediate size, E = local experts,
k = experts chosen per token, P = T*k token-slot pairs (pair p = token p // k, slot p % k),
BM = BLOCK_M, EM = padded pair capacity (a multiple of BM).

Each step is a kernel module with its torch reference beside it:

1. :mod:`moe_align`   topk_ids [T, k] -> pairs sorted by expert, each expert's segment padded
   to BM: sorted_ids int32 [EM], expert_ids int32 [EM/BM], num_post_pad int32 [1].
2. :mod:`moe_gemm`    cache1[p] = w13[e] @ x[p // k]                              [P, 2N]
   (split-K, ``MoeConfig.split_w13`` S > 1: S fp32 partials [S, P, 2N] over slices of H, which
   step 3 sums and rounds to the act dtype first: more programs for the dequantizing int4 / fp4
   GEMMs when few experts have tokens)
3. :mod:`moe_silu`    cache2[p] = silu(gate) * up                                [P, N]
   (``MoeConfig.fuse_silu`` with 16/32-bit activations: in step 2's epilogue instead)
   (W8A8: rounded to the act dtype, then quantized to e4m3 + fp32 scales per the scheme's
   ``act_group``: fp8-block per 1x128 group, DeepSeek style; fp8-channel per token)
4. :mod:`moe_gemm`    cache3[p] = w2[e] @ cache2[p] (* topk_weight[p])          [P, H] fp32
   (bf16 when the output is: each pair's row rounded once, as vLLM's cache3 and the served
   numerics of ``verify`` have it, and half the bytes written and read back)
   (split-K, ``split_w2``: fp32 partials [S, P, H] over slices of N, summed per pair in step 5)
5. :mod:`moe_sum`     out[t] = sum over slots j with id >= 0 of cache3[t*k + j]  [T, H] fp32
   (then rounded once to bf16 for a bf16 output)

The weights' layout per scheme is in :mod:`moe_weights`, the tile sizes in :mod:`moe_tiles`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from .common import FLOAT_ACTS, FP8_BLOCK, TOKEN_GROUP, act_scale_cols, check, check_device, is_interpreted
from .moe_align import moe_align_block_size
from .moe_gemm import _moe_gemm_kernel, moe_gemm
from .moe_silu import silu_and_mul, silu_and_mul_ref
from .moe_sum import OUT_DTYPES, check_out, moe_sum
from .moe_tiles import MoeConfig, select_config
from .moe_weights import SCHEMES, dequantize_stacked, parse_weights
from .quant import fp8_act_quant, fp8_act_quant_ref, fp8_dequant_act_ref


#: the experts' activations: SwiGLU, and gpt-oss's clamped SwiGLU (with ``swiglu`` = (alpha, limit))
ACTIVATIONS = ("silu", "clamped-swiglu")


def _check_biases(w13_bias, w2_bias, E, N, H, device):
    for name, b, cols in (("w13_bias", w13_bias, 2 * N), ("w2_bias", w2_bias, H)):
        if b is not None:
            check(b.dim() == 2 and tuple(b.shape) == (E, cols) and b.is_floating_point() and b.stride(1) == 1
                  and b.device == device, f"{name} must be float [{E}, {cols}] on {device}, rows contiguous, "
                                          f"got {b.dtype} {list(b.shape)} on {b.device}")


def _check_common(hidden, w13, w2, scheme, topk_ids, topk_weights, hidden_scale, activation, apply_router_weight):
    check(scheme in SCHEMES, f"unknown weight format {scheme!r} (known: {', '.join(SCHEMES)})")
    check(activation in ACTIVATIONS, f"unsupported expert activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    check(hidden.dim() == 2, f"hidden must be [T, H], got shape {list(hidden.shape)}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == hidden.shape[0],
          f"topk_ids must be [T, k] with T = {hidden.shape[0]}, got {list(topk_ids.shape)}")
    check(topk_ids.dtype in (torch.int32, torch.int64), f"topk_ids must be int32/int64, got {topk_ids.dtype}")
    if apply_router_weight:
        check(topk_weights is not None and tuple(topk_weights.shape) == tuple(topk_ids.shape),
              "topk_weights must have the shape of topk_ids")
        check(topk_weights.dtype == torch.float32, f"topk_weights must be float32, got {topk_weights.dtype}")
    main = SCHEMES[scheme].main
    for name, t in (("w13", w13), ("w2", w2)):
        check(isinstance(t, dict) and main in t, f"{name} ({scheme}) must be a dict holding {main!r}")
        check(t[main].dim() == 3, f"{name}[{main!r}] must be 3-D [E, rows, cols]")
    if hidden.dtype == torch.float8_e4m3fn:
        w8a8 = [name for name, s in SCHEMES.items() if s.fp8_acts]
        check(SCHEMES[scheme].fp8_acts, f"fp8 hidden states need the {' / '.join(w8a8)} format, not {scheme}")
        T, H = hidden.shape
        act_group = SCHEMES[scheme].act_group
        G = act_scale_cols(H, act_group)
        per = "per token" if act_group == TOKEN_GROUP else f"per 1x{act_group} group"
        check(hidden_scale is not None and tuple(hidden_scale.shape) == (T, G) and hidden_scale.dtype == torch.float32,
              f"fp8 hidden needs hidden_scale float32 [{T}, {G}] ({scheme}: one scale {per})")
    else:
        check(hidden.dtype in FLOAT_ACTS, f"hidden has dtype {hidden.dtype}, expected fp16/bf16/fp32/e4m3")
        check(hidden_scale is None, "hidden_scale is only for float8_e4m3fn hidden states")
    E = w13[main].shape[0]
    two_n = w13[main].shape[1]
    check(two_n % 2 == 0, f"w13 has an odd number of rows {two_n} (gate rows then up rows)")
    return E, two_n // 2


def fused_experts(
    hidden: torch.Tensor,
    w13: dict[str, torch.Tensor],
    w2: dict[str, torch.Tensor],
    scheme: str,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    hidden_scale: torch.Tensor | None = None,
    apply_router_weight: bool = True,
    group_size: int = 128,
    activation: str = "silu",
    config: MoeConfig | None = None,
    check_ids: bool = True,
    soft_fp8: bool | None = None,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    cache3_dtype: torch.dtype | None = None,
    swiglu: tuple[float, float] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    global_experts: int | None = None,
) -> torch.Tensor:
    """One rank's routed experts with Triton kernels -> out [T, H] out_dtype (float32, or
    bfloat16, e.g. for a bf16 combine: each pair's weighted row rounded to bf16, the k of a
    token summed in fp32 and rounded once more); written into ``out`` when given (out_dtype
    [T, H], rows may be strided), e.g. a buffer other ranks read.

    hidden [T, H] fp16/bf16/fp32, or float8_e4m3fn with hidden_scale fp32 [T, G] (rows of
    hidden and hidden_scale may be strided, e.g. views into a received buffer) for the W8A8
    schemes: G = ceil(H/128) for fp8-block, 1 for fp8-channel (per token), the scheme's
    ``act_group``. They quantize float hidden that way here, and the intermediate after silu,
    so both GEMMs are e4m3 x e4m3 with fp32 accumulation.
    scheme: the weights' kernel scheme (``moetool.kernels.moe_weights.SCHEMES``; a weight
    format names its own as ``kernel_scheme``).
    w13 / w2: stacked tensors of ``scheme`` (moe_weights), logical [E, 2N, H] / [E, H, N].
    topk_ids [T, k] int local expert slots, -1 = not on this rank (never computed, adds 0);
    topk_weights [T, k] fp32.
        out[t] = sum_{j: id >= 0} (topk_weights[t, j] if apply_router_weight else 1)
                 * w2[e] @ (silu(g) * u),  [g; u] = w13[e] @ hidden[t],  e = topk_ids[t, j]
    group_size: the int4 group g. config: tile sizes (default: :func:`moetool.kernels.moe_tiles.select_config`:
    the GPU's tuned table for this shape, else rules). global_experts: under expert parallelism,
    the experts the router picks from on all ranks (E of them here), for the rules' pairs per expert.
    check_ids: raise if an id >= E (one host synchronisation). Without it the caller vouches for
    the ids: a pair whose id is >= E is dropped from the GEMMs, but its token's output is then
    undefined (the activation and sum steps read the pair's unwritten rows).
    cache3_dtype: the per-pair rows before the sum (default out_dtype); float32 with a bf16
    output rounds only the sum.
    activation "clamped-swiglu" with swiglu = (alpha, limit): gpt-oss's experts, h =
    min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + 1); w13_bias
    [E, 2N] (gate then up) / w2_bias [E, H]: each expert's biases, added to its GEMM's fp32
    result (the down bias before the top-k weight), as vLLM's fused MoE does.
    """
    E, N = _check_common(hidden, w13, w2, scheme, topk_ids, topk_weights, hidden_scale, activation,
                         apply_router_weight)
    check((activation == "clamped-swiglu") == (swiglu is not None),
          "swiglu = (alpha, limit) goes with activation 'clamped-swiglu', and only with it")
    _check_biases(w13_bias, w2_bias, E, N, hidden.shape[1], hidden.device)
    T, H = hidden.shape
    k = topk_ids.shape[1]
    w13p = parse_weights(scheme, w13, "w13", E, 2 * N, H, group_size, N)  # gate rows, then up rows
    w2p = parse_weights(scheme, w2, "w2", E, H, N, group_size, None)
    check(hidden.stride(1) == 1 and topk_ids.is_contiguous(), "hidden needs contiguous rows and topk_ids must be contiguous")
    check(out_dtype in OUT_DTYPES, f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    check(cache3_dtype in (None, *OUT_DTYPES), f"cache3_dtype must be float32 or bfloat16, got {cache3_dtype}")
    if out is not None:
        check_out(out, T, H, out_dtype, hidden.device)
    tensors = [hidden, topk_ids, w13p.main, w2p.main]
    if apply_router_weight:
        check(topk_weights.is_contiguous(), "topk_weights must be contiguous")
        tensors.append(topk_weights)
    check_device(_moe_gemm_kernel, *tensors)
    dev = hidden.device
    if T == 0 or k == 0 or E == 0 or N == 0 or H == 0:
        return check_out(out, T, H, out_dtype, dev).zero_()
    if check_ids:
        top = int(topk_ids.max())
        check(top < E, f"topk_ids holds local expert {top} but only {E} experts are on this rank")

    P = T * k
    interpreted = is_interpreted(_moe_gemm_kernel)
    act_dtype = hidden.dtype if hidden.dtype in FLOAT_ACTS else torch.bfloat16
    cfg = config or select_config(scheme, E, N, H, k, T, act_dtype, interpreted, group_size,
                                  global_experts=global_experts)
    check(all(b >= 16 and b & (b - 1) == 0 for b in (cfg.block_m, cfg.block_n, cfg.block_k)),
          f"tile sizes must be powers of two >= 16: {cfg}")
    act_group = SCHEMES[scheme].act_group
    fp8 = act_group is not None
    check(act_group != FP8_BLOCK or FP8_BLOCK % cfg.block_k == 0, f"fp8-block needs block_k dividing 128: {cfg}")
    fp4_group = SCHEMES[scheme].fp4_group
    check(fp4_group is None or cfg.block_k % fp4_group == 0,
          f"{scheme} needs block_k of whole groups of {fp4_group}: {cfg}")
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(topk_ids, cfg.block_m, E)
    weights = topk_weights if apply_router_weight else hidden

    a1, a1_scale = hidden, hidden_scale
    if fp8 and hidden.dtype != torch.float8_e4m3fn:
        a1, a1_scale = fp8_act_quant(hidden, act_group, soft_fp8=soft_fp8)
    # split-K: fp32 partials [S, P, R], summed by the next step; never more slices than K tiles
    split13 = min(cfg.split_w13, triton.cdiv(H, cfg.block_k))
    split2 = min(cfg.split_w2, triton.cdiv(N, cfg.block_k))
    if cfg.fuse_silu and not fp8 and split13 == 1:  # steps 2 and 3 in one kernel
        a2, a2_scale = torch.empty((P, N), dtype=act_dtype, device=dev), None
        moe_gemm(a1, a1_scale, w13p, a2, weights, sorted_ids, expert_ids, num_post_pad,
                 P, k, N, False, group_size, cfg, bias=w13_bias, silu=True, clamp=swiglu)
    else:
        if split13 > 1:
            cache1 = torch.empty((split13, P, 2 * N), dtype=torch.float32, device=dev)
        else:
            cache1 = torch.empty((P, 2 * N), dtype=act_dtype, device=dev)
        moe_gemm(a1, a1_scale, w13p, cache1, weights, sorted_ids, expert_ids, num_post_pad,
                 P, k, N, False, group_size, cfg, bias=w13_bias)
        row_ids = topk_ids.view(-1)
        if fp8:
            a2, a2_scale = silu_and_mul(cache1, row_ids, quant_fp8=True, group=act_group, soft_fp8=soft_fp8,
                                        clamp=swiglu, act_dtype=act_dtype)
        else:
            a2, a2_scale = silu_and_mul(cache1, row_ids, clamp=swiglu, act_dtype=act_dtype), None
    pair_dtype = cache3_dtype or out_dtype
    if split2 > 1:
        cache3 = torch.empty((split2, P, H), dtype=torch.float32, device=dev)
    else:
        cache3 = torch.empty((P, H), dtype=pair_dtype, device=dev)
    moe_gemm(a2, a2_scale, w2p, cache3, weights, sorted_ids, expert_ids, num_post_pad,
                 P, 1, H, apply_router_weight, group_size, cfg, bias=w2_bias)
    return moe_sum(cache3, topk_ids, out_dtype, out, pair_dtype=pair_dtype)


def fused_experts_ref(
    hidden: torch.Tensor,
    w13: dict[str, torch.Tensor],
    w2: dict[str, torch.Tensor],
    scheme: str,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    dequantize: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    split_rows: Callable[[dict[str, torch.Tensor], list[int]], list[dict]],
    hidden_scale: torch.Tensor | None = None,
    apply_router_weight: bool = True,
    activation: str = "silu",
    emulate: torch.dtype | None = None,
    swiglu: tuple[float, float] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference of :func:`fused_experts` (same arguments but the kernel options)
    -> fp32 [T, H].

    Per local expert: gather its tokens, dequantize its weights to fp32 with the weight
    format's own ``dequantize`` and ``split_rows`` (the caller passes them, e.g.
    ``get_format(name, group_size=g).dequantize``: :func:`dequantize_stacked`), y =
    (silu(x w_gate^T) * (x w_up^T)) w2^T, all in fp32; fp8 hidden is dequantized with its
    scales (the scheme's ``act_group``). Unlike the kernels, float hidden is not quantized for
    the W8A8 schemes and the intermediate activation is not rounded (to act dtype / fp8): that
    difference is the kernels' error.

    ``emulate`` (an act dtype, fp16/bf16/fp32): take the kernels' activation steps instead, in
    that dtype: W8A8 float hidden quantized per ``act_group`` (``fp8_act_quant_ref``); x w13^T
    rounded to the act dtype; silu(gate) * up in fp32, rounded to the act dtype and, for W8A8,
    quantized per ``act_group``; products in fp32 on the dequantized codes (e4m3 x e4m3 is exact
    in fp32, so what is left against the kernels is fp32 summation order and the rare rounding
    step that order or exp() flips; int4 also rounds its dequantized weight tiles to the act
    dtype, which is not emulated).
    """
    E, N = _check_common(hidden, w13, w2, scheme, topk_ids, topk_weights, hidden_scale, activation,
                         apply_router_weight)
    check(emulate is None or emulate in FLOAT_ACTS, f"emulate must be an activation dtype, got {emulate}")
    check((activation == "clamped-swiglu") == (swiglu is not None),
          "swiglu = (alpha, limit) goes with activation 'clamped-swiglu', and only with it")
    T, H = hidden.shape
    act_group = SCHEMES[scheme].act_group
    if hidden.dtype == torch.float8_e4m3fn:
        x = fp8_dequant_act_ref(hidden, hidden_scale, act_group)
    elif emulate is not None and act_group is not None:
        x = fp8_dequant_act_ref(*fp8_act_quant_ref(hidden, act_group), act_group)
    else:
        x = hidden.float()

    def act(y: torch.Tensor) -> torch.Tensor:  # what the kernels keep of an intermediate
        return y if emulate is None else y.to(emulate).float()

    out = torch.zeros((T, H), dtype=torch.float32, device=hidden.device)
    for e in range(E):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w13e = dequantize_stacked(scheme, w13, e, 2 * N, H, dequantize, split_rows)  # [2N, H]
        w2e = dequantize_stacked(scheme, w2, e, H, N, dequantize)  # [H, N]
        gu = x[tok] @ w13e.t()  # [t_e, 2N]
        if w13_bias is not None:
            gu = gu + w13_bias[e].float()
        gu = act(gu)
        h = silu_and_mul_ref(gu, swiglu)  # [t_e, N]
        if emulate is not None:
            h = act(h)
            if act_group is not None:
                h = fp8_dequant_act_ref(*fp8_act_quant_ref(h, act_group), act_group)
        y = h @ w2e.t()  # [t_e, H]
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        if apply_router_weight:
            y = y * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    return out
