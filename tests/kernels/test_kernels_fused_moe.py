"""fused_experts (Triton) against fused_experts_ref (torch, fp32, weights dequantized through
moetool.formats), plus the align / silu / sum steps on their own.

Letters: T tokens, H hidden, N intermediate, E local experts, k top-k.
"""
from typing import Callable, NamedTuple

import pytest
import torch
from moetool.formats import format_params, get_format
from moetool.kernels import fused_moe as fm
from moetool.kernels import int4_quant as k4
from moetool.kernels import quant as kq
from moetool.kernels.moe_align import moe_align_block_size, moe_align_block_size_ref
from moetool.kernels.moe_gemm import moe_gemm, moe_gemm_ref
from moetool.kernels.moe_silu import silu_and_mul, silu_and_mul_ref
from moetool.kernels.moe_sum import moe_sum, moe_sum_ref
from moetool.kernels.moe_tiles import MoeConfig, default_config
from moetool.kernels.moe_weights import SCHEMES, dequantize_stacked, parse_weights

from moetool.errors import MoetoolError

# Largest allowed ||out - ref|| / ||ref|| per case. What the kernels round that the reference
# does not: dense/W*A16: the intermediate [P, 2N] and silu output in the activation dtype
# (fp16: ~5e-4; bf16 ~4e-3, ~1e-2 under the interpreter, whose bf16 cast truncates) and, for
# int4, the dequantized tile in the activation dtype; fp8-block: the silu output quantized to
# e4m3 per 1x128 group (~2-3 %), plus float hidden quantized the same way; fp8-channel (W8A8
# per token): the same with one scale per row, coarser on these random rows (~3-5.6 %).
# (format, hidden dtype, int4 symmetric, rel_err limit)
CASES = {
    "dense-fp32": ("dense", torch.float32, None, 2e-6),
    "dense-fp16": ("dense", torch.float16, None, 1.5e-3),
    "dense-bf16": ("dense", torch.bfloat16, None, 2e-2),
    "fp8-block-w8a8": ("fp8-block", torch.float8_e4m3fn, None, 0.035),
    "fp8-block-fp16-hidden": ("fp8-block", torch.float16, None, 0.06),
    "fp8-channel-w8a8": ("fp8-channel", torch.float8_e4m3fn, None, 0.04),
    "fp8-channel-fp16": ("fp8-channel", torch.float16, None, 0.08),
    "int4-sym-fp16": ("int4-group", torch.float16, True, 1.5e-3),
    "int4-asym-fp16": ("int4-group", torch.float16, False, 1.5e-3),
    "int4-asym-fp32": ("int4-group", torch.float32, False, 2e-6),
    # fp4 (W4A16): the dequantized tile is exact in fp32 (the format's own e2m1 * s / gs); in fp16
    # it is rounded, as int4's (third field: for nvfp4, gate and up quantized apart, so the w13
    # has two different global scales)
    "nvfp4-fp16": ("nvfp4", torch.float16, True, 1.5e-3),
    "nvfp4-fp32": ("nvfp4", torch.float32, True, 2e-6),
    "nvfp4-joint-fp16": ("nvfp4", torch.float16, False, 1.5e-3),
    "mxfp4-fp16": ("mxfp4", torch.float16, None, 1.5e-3),
    "mxfp4-fp32": ("mxfp4", torch.float32, None, 2e-6),
}
FP4_CASES = [c for c, (fmt, *_) in CASES.items() if fmt in ("nvfp4", "mxfp4")]
# measured under the interpreter (3 shapes, seed 0): fp32 <= 4e-7, fp16 <= 5.5e-4,
# bf16 <= 9.7e-3, fp8-block w8a8 <= 2.3e-2, fp8-block with fp16 hidden <= 4.4e-2,
# fp8-channel w8a8 <= 2.6e-2, fp8-channel with fp16 / fp32 hidden <= 5.6e-2; fp4 (FP4_SHAPES):
# fp32 <= 4.4e-7, fp16 <= 6.2e-4
# (T, E, H, N, k, int4 group): N not a multiple of 128 (fp8-block gate/up scale split), H and N
# not multiples of the tiles, partial int4 groups (200 % 40, 96 % 40); g = 32 / 64 take the
# one-scale-per-K-tile path (g % BLOCK_K == 0), g = 40 / 8 the per-element one (fewer shapes
# and no fp8-channel fp32 case than before: the suite's time on 2 cores; fp32 hidden is the
# fp16 case's path, quantized per token inside)
SHAPES = [(33, 4, 200, 96, 2, 40), (1, 4, 64, 32, 2, 32), (9, 3, 136, 160, 3, 8)]
# fp4 needs whole groups (16 / 32) along H and N: H, N multiples of 32 but not of the K tile (64
# and 96 % 128, 160 % 64), one shape whose K is whole tiles
FP4_SHAPES = [(33, 4, 160, 96, 2, None), (1, 4, 64, 32, 2, None), (9, 3, 96, 64, 3, None)]
# the tests of one option each (router weight off, strided rows and bf16 output): the matrix
# above covers the formats' math, so a smaller problem, the interpreter's time being per program
# instance: H = 136 two fp8 activation groups (the second partial), int4 g32 one scale per K tile
SMALL_SHAPE = (12, 2, 136, 32, 2, 32)
# Which case runs on which shape. The third shape (k = 3; N = 160: two fp8 scale blocks per half;
# int4 g = 8 < BLOCK_K) lays out the scales of int4 and fp8-block differently from the first two;
# dense and fp8-channel (no scales / one per row) meet there nothing new: not re-run. fp4's fp32
# hidden and joint global scale change the dot's dtype and which global scale a row takes, not
# the tiling: on FP4_SHAPES[2] only, while fp4's fp16 cases run every shape (the suite's time)
MATRIX = [(c, s) for c, (fmt, *_) in CASES.items() if c not in FP4_CASES
          for s in SHAPES if s is not SHAPES[2] or fmt in ("int4-group", "fp8-block")]
FP4_MATRIX = [(c, s) for c in FP4_CASES for s in FP4_SHAPES if c.endswith("-fp16") and "joint" not in c
              or s is FP4_SHAPES[2]]


def _stack(per_expert: list[dict]) -> dict:
    return {key: torch.stack([t[key] for t in per_expert]) for key in per_expert[0]}


def make_weights(fmt, E, H, N, group=128, symmetric=True, dtype=torch.bfloat16, scale=0.2):
    """Random experts -> (w13, w2) stacked in ``fmt`` (module docstring of fused_moe)."""
    per13, per2 = [], []
    for _ in range(E):
        w13 = (torch.randn(2 * N, H) * scale).to(dtype)
        w2 = (torch.randn(H, N) * scale).to(dtype)
        if fmt == "dense":
            per13.append({"weight": w13})
            per2.append({"weight": w2})
        elif fmt == "fp8-block":  # gate and up blocks scaled separately
            (qg, sg), (qu, su) = kq.fp8_block_quant_ref(w13[:N]), kq.fp8_block_quant_ref(w13[N:])
            q2, s2 = kq.fp8_block_quant_ref(w2)
            per13.append({"weight": torch.cat([qg, qu]), "weight_scale_inv": torch.cat([sg, su])})
            per2.append({"weight": q2, "weight_scale_inv": s2})
        elif fmt in ("nvfp4", "mxfp4"):
            f = get_format(fmt)
            if fmt == "nvfp4" and symmetric:  # gate and up with their own global scales: [2]
                per13.append(f.cat_rows([f.quantize(w13[:N], dtype), f.quantize(w13[N:], dtype)]))
            else:  # one global scale for the w13 (nvfp4 [1])
                per13.append(f.quantize(w13, dtype))
            per2.append(f.quantize(w2, dtype))
        elif fmt == "fp8-channel":
            for w, lst in ((w13, per13), (w2, per2)):
                s = (w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448).to(dtype)
                q = (w.float() / s.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
                lst.append({"weight": q, "weight_scale": s})
        else:
            per13.append(k4.int4_group_quant_pack_ref(w13, group, symmetric, dtype))
            per2.append(k4.int4_group_quant_pack_ref(w2, group, symmetric, dtype))
    return _stack(per13), _stack(per2)


def weight_format(fmt, group=128, symmetric=True):
    """The weight format ``fmt`` names, with int4's group size and symmetry where it takes them."""
    if fmt in ("nvfp4", "mxfp4"):
        return get_format(fmt)
    params, _ = format_params(fmt, {"group_size": group, "symmetric": symmetric})
    return get_format(fmt, **params)


def fused_ref(x, w13, w2, fmt, ids, tw, group=128, symmetric=True, **kwargs):
    """fused_experts_ref with the weights read by the format's own dequantize / split_rows."""
    f = weight_format(fmt, group, symmetric)
    assert f.kernel_scheme == fmt
    return fm.fused_experts_ref(x, w13, w2, fmt, ids, tw, dequantize=f.dequantize,
                                split_rows=f.split_rows, **kwargs)


def make_routing(T, E, k, E_global=None, seed=0):
    """topk over E_global experts of which the first E are local; others map to -1."""
    g = torch.Generator().manual_seed(seed)
    E_global = E_global or 2 * E
    ids = torch.stack([torch.randperm(E_global, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    ids = ids.to(torch.int64)
    ids = torch.where(ids < E, ids, -1)
    w = torch.rand(T, k, generator=g).float()
    return ids, w / w.sum(-1, keepdim=True).clamp(min=1e-6)


def make_hidden(T, H, dtype, group=128):
    """x [T, H] in dtype; e4m3 with its scales per ``group`` (TOKEN_GROUP: per token)."""
    x = torch.randn(T, H)
    if dtype == torch.float8_e4m3fn:
        q, s = kq.fp8_act_quant_ref(x, group)
        return q, s
    return x.to(dtype), None


def _to(d, device):
    return {k: v.to(device) for k, v in d.items()}


def rel_err(out, ref):
    return ((out.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm().clamp(min=1e-30)).item()


class Problem(NamedTuple):
    """One case's inputs, made on the CPU, and what checks them."""
    run: Callable  # run(config=None, **fused_experts options) -> fused_experts' output on CPU
    ref: torch.Tensor  # fused_experts_ref's output [T, H]
    tol: float  # the case's relative error bound against ref
    hdtype: torch.dtype  # the activations' dtype
    ids: torch.Tensor  # topk_ids [T, k], -1 for experts on other ranks
    w13: dict  # the stacked w13 tensors


def make_problem(case, shape, device, hdtype=None, weight_dtype=torch.bfloat16, apply_router_weight=True) -> Problem:
    """A case of CASES at shape (T, E, H, N, k, g; g None: 128): random weights in
    ``weight_dtype`` (int4's scales take it) quantized to the case's format, routing with half
    of the experts on other ranks, activations in ``hdtype`` (default: the case's; e4m3 with
    their scales for W8A8), and the reference's output."""
    fmt, case_dtype, symmetric, tol = CASES[case]
    hdtype = hdtype or case_dtype
    T, E, H, N, k, group = shape
    group = group or 128
    w13, w2 = make_weights(fmt, E, H, N, group, bool(symmetric), dtype=weight_dtype)
    ids, tw = make_routing(T, E, k)
    x, xs = make_hidden(T, H, hdtype, SCHEMES[fmt].act_group)
    ref = fused_ref(x, w13, w2, fmt, ids, tw, group, bool(symmetric), hidden_scale=xs,
                    apply_router_weight=apply_router_weight)
    args = (x.to(device), _to(w13, device), _to(w2, device), fmt, ids.to(device), tw.to(device))
    hidden_scale = xs.to(device) if xs is not None else None

    def run(config=None, **options):
        return fm.fused_experts(*args, hidden_scale=hidden_scale, group_size=group, config=config,
                                apply_router_weight=apply_router_weight, **options).cpu()

    return Problem(run, ref, tol, hdtype, ids, w13)


def run_case(case, shape, device, apply_router_weight=True):
    p = make_problem(case, shape, device, apply_router_weight=apply_router_weight)
    out = p.run()
    assert out.dtype == torch.float32 and out.shape == shape[:1] + shape[2:3]
    return out, p.ref, p.tol, p.ids


@pytest.mark.parametrize("case,shape", [pytest.param(c, s, id="{}-T{}-E{}-H{}-N{}-k{}-g{}".format(c, *s))
                                        for c, s in MATRIX])
def test_fused_experts_matches_ref(case, shape, device):
    out, ref, tol, ids = run_case(case, shape, device)
    assert rel_err(out, ref) < tol, (case, rel_err(out, ref))
    # tokens whose experts are all on other ranks get exactly 0
    remote = (ids < 0).all(dim=1)
    assert (out[remote] == 0).all()


@pytest.mark.parametrize("case,shape", [pytest.param(c, s, id="{}-T{}-E{}-H{}-N{}-k{}".format(c, *s[:5]))
                                        for c, s in FP4_MATRIX])
def test_fp4_fused_experts_matches_ref(case, shape, device):
    out, ref, tol, ids = run_case(case, shape, device)
    assert rel_err(out, ref) < tol, (case, rel_err(out, ref))
    assert (out[(ids < 0).all(dim=1)] == 0).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_broken_scale_fails(fmt, device):
    """A wrong scale changes the kernels' output as much as the reference's: the up half's global
    scale doubled (nvfp4; a kernel reading gate's for every row misses it), or one e8m0 group
    exponent raised by one (mxfp4). Against the reference on the intact weights that is far
    outside the tolerance, against the reference on the broken ones within it."""
    T, E, H, N, k, _ = FP4_SHAPES[2]
    tol = CASES[f"{fmt}-fp16"][3]
    w13, w2 = make_weights(fmt, E, H, N, symmetric=True)
    ids, tw = make_routing(T, E, k)
    ids[:, 0] = torch.arange(T) % E  # every expert has tokens
    x = torch.randn(T, H).half()
    bad13 = dict(w13)
    if fmt == "nvfp4":
        assert tuple(w13["weight_global_scale"].shape) == (E, 2)
        bad13["weight_global_scale"] = w13["weight_global_scale"] * torch.tensor([1.0, 0.5])
    else:
        bad13["weight_scale"] = w13["weight_scale"].clone()
        bad13["weight_scale"][:, :, 1] += 1
    good = fused_ref(x, w13, w2, fmt, ids, tw)
    broken = fused_ref(x, bad13, w2, fmt, ids, tw)
    out = fm.fused_experts(x.to(device), _to(bad13, device), _to(w2, device), fmt, ids.to(device), tw.to(device))
    assert rel_err(out, broken) < tol
    assert rel_err(out, good) > 20 * tol, rel_err(out, good)


def test_fp4_bad_tensors_raise(device):
    E, H, N = 2, 64, 32
    w13, w2 = (_to(w, device) for w in make_weights("nvfp4", E, H, N))
    x = torch.randn(3, H, dtype=torch.float16, device=device)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]], device=device)
    tw = torch.ones(3, 2, device=device)
    for bad, match in (({"weight_global_scale": w13["weight_global_scale"][:, :1].double()}, "float32"),
                       ({"weight_global_scale": w13["weight_global_scale"][:1].contiguous()}, r"\[2, P\]"),
                       ({"weight_scale": w13["weight_scale"].view(torch.uint8)}, "weight_scale"),
                       ({"weight_packed": w13["weight_packed"][:, :, :-1].contiguous()}, "weight_packed")):
        with pytest.raises(MoetoolError, match=match):
            fm.fused_experts(x, dict(w13, **bad), w2, "nvfp4", ids, tw)
    m13, m2 = (_to(w, device) for w in make_weights("mxfp4", E, H, N))
    with pytest.raises(MoetoolError, match="weight_scale"):
        fm.fused_experts(x, dict(m13, weight_scale=m13["weight_scale"].float()), m2, "mxfp4", ids, tw)
    with pytest.raises(MoetoolError, match="mxfp4 needs block_k of whole groups of 32"):
        fm.fused_experts(x, m13, m2, "mxfp4", ids, tw, config=MoeConfig(16, 32, 16, 1, 4, 1))


@pytest.mark.parametrize("case", ["dense-fp16", "fp8-block-w8a8", "fp8-channel-fp16", "int4-asym-fp16"])
def test_without_router_weight(case, device):
    out, ref, tol, _ = run_case(case, SMALL_SHAPE, device, apply_router_weight=False)
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("case", ["fp8-block-w8a8", "fp8-channel-w8a8", "fp8-channel-fp16", "dense-fp16"])
def test_row_strided_hidden_and_bf16_output(case, device):
    """Hidden rows (and fp8 scales) viewed inside wider received buffers give the contiguous result, and
    out_dtype=bfloat16 is the fp32 result but each pair's row rounded to bf16 before the sum and the
    sum once more (nearest even): within a few bf16 steps of it, the same bytes strided or not."""
    fmt, hdtype, symmetric, _ = CASES[case]
    T, E, H, N, k, group = SMALL_SHAPE
    w13, w2 = make_weights(fmt, E, H, N, group, bool(symmetric))
    w13, w2 = _to(w13, device), _to(w2, device)
    ids, tw = make_routing(T, E, k)
    x, xs = make_hidden(T, H, hdtype, SCHEMES[fmt].act_group)
    ids, tw, x = ids.to(device), tw.to(device), x.to(device)
    xs = xs.to(device) if xs is not None else None
    wide = torch.zeros(T, H + 48, dtype=x.dtype, device=device)
    wide[:, 16:16 + H] = x
    strided = wide[:, 16:16 + H]
    assert not strided.is_contiguous()
    strided_scale = None
    if xs is not None:
        wide_scale = torch.zeros(T, xs.shape[1] + 5, dtype=xs.dtype, device=device)
        wide_scale[:, 3:3 + xs.shape[1]] = xs
        strided_scale = wide_scale[:, 3:3 + xs.shape[1]]
    want = fm.fused_experts(x, w13, w2, fmt, ids, tw, hidden_scale=xs, group_size=group)
    want16 = fm.fused_experts(x, w13, w2, fmt, ids, tw, hidden_scale=xs, group_size=group, out_dtype=torch.bfloat16)
    got = fm.fused_experts(strided, w13, w2, fmt, ids, tw, hidden_scale=strided_scale, group_size=group,
                           out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), want16.cpu())
    # k = 2 rows rounded, then their sum: measured <= 2.3e-3 (the fp32 result rounded once: 1.8e-3)
    assert rel_err(got, want) < 4e-3, rel_err(got, want)
    once = fm.fused_experts(x, w13, w2, fmt, ids, tw, hidden_scale=xs, group_size=group, out_dtype=torch.bfloat16,
                            cache3_dtype=torch.float32)
    assert torch.equal(once.cpu(), want.cpu().to(torch.bfloat16))  # the fp32 result rounded once
    # into a given buffer (e.g. one the other ranks read): the same bytes, written there
    buf = torch.full((T, H), 7.0, dtype=torch.bfloat16, device=device)
    into = fm.fused_experts(strided, w13, w2, fmt, ids, tw, hidden_scale=strided_scale, group_size=group,
                            out_dtype=torch.bfloat16, out=buf)
    assert into.data_ptr() == buf.data_ptr() and torch.equal(buf.cpu(), got.cpu())
    with pytest.raises(MoetoolError, match=r"out must be torch.bfloat16 \["):
        fm.fused_experts(x, w13, w2, fmt, ids, tw, hidden_scale=xs, group_size=group, out_dtype=torch.bfloat16,
                         out=buf[:1])


def test_dropped_and_idle_experts_are_never_computed(device):
    """Expert 3 holds NaN weights. Tokens routed there with id -1 (another rank's copy) and no
    token routed to it at all: a kernel that touches it (a padding block, a -1 pair) leaks NaN."""
    T, E, H, N = 17, 4, 64, 32
    w13, w2 = make_weights("dense", E, H, N, dtype=torch.float16)
    w13["weight"][3] = float("nan")
    w2["weight"][3] = float("nan")
    ids = torch.randint(0, 3, (T, 2))
    ids[::2, 1] = -1
    ids[5] = -1
    tw = torch.rand(T, 2)
    x = torch.randn(T, H, dtype=torch.float16)
    out = fm.fused_experts(x.to(device), _to(w13, device), _to(w2, device), "dense", ids.to(device), tw.to(device))
    ref = fused_ref(x, w13, w2, "dense", ids, tw)
    assert torch.isfinite(out).all()
    assert (out[5].cpu() == 0).all()
    assert rel_err(out, ref) < 3e-3


def test_structured_expert_identity(device):
    """Expert e scales by (e+1) (w13 gate = up = I on the first H rows, w2 = (e+1)/silu(1) I):
    with x = ones, each token's output is sum_j weight_j (e_j + 1): a swapped expert shows."""
    T, E, H = 6, 4, 32
    N = H
    eye = torch.eye(N, H)
    w13 = torch.stack([torch.cat([eye, eye]) for _ in range(E)]).float()
    silu1 = torch.nn.functional.silu(torch.tensor(1.0)).item()
    w2 = torch.stack([torch.eye(H, N) * (e + 1) / silu1 for e in range(E)]).float()
    ids = torch.tensor([[0, 1], [2, 3], [3, -1], [-1, -1], [1, 1], [0, 2]])
    tw = torch.tensor([[1.0, 0.5]] * T)
    x = torch.ones(T, H)
    out = fm.fused_experts(x.to(device), {"weight": w13.to(device)}, {"weight": w2.to(device)}, "dense",
                           ids.to(device), tw.to(device)).cpu()
    expect = ((ids + 1) * (ids >= 0) * tw).sum(1)
    torch.testing.assert_close(out, expect[:, None].expand(T, H), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["dense", "fp8-block", "fp8-channel", "int4-group"])
def test_zero_tokens_and_no_local_experts(fmt, device):
    E, H, N = 4, 64, 32
    w13, w2 = make_weights(fmt, E, H, N, 32)
    hd = torch.float16
    x = torch.zeros(0, H, dtype=hd, device=device)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=device)
    out = fm.fused_experts(x, _to(w13, device), _to(w2, device), fmt, ids, torch.zeros(0, 2, device=device),
                           group_size=32)
    assert out.shape == (0, H)
    x = torch.randn(5, H, dtype=hd, device=device)
    ids = torch.full((5, 2), -1, device=device)
    out = fm.fused_experts(x, _to(w13, device), _to(w2, device), fmt, ids, torch.ones(5, 2, device=device),
                           group_size=32)
    assert (out == 0).all()


def test_int32_ids_and_explicit_config(device):
    T, E, H, N = 20, 4, 96, 64
    w13, w2 = make_weights("dense", E, H, N, dtype=torch.float16)
    ids, tw = make_routing(T, E, 2)
    x = torch.randn(T, H, dtype=torch.float16)
    ref = fused_ref(x, w13, w2, "dense", ids, tw)
    cfg = MoeConfig(block_m=16, block_n=32, block_k=32, group_m=2)  # not the rules' tiles; few programs
    out = fm.fused_experts(x.to(device), _to(w13, device), _to(w2, device), "dense",
                           ids.to(torch.int32).to(device), tw.to(device), config=cfg)
    assert rel_err(out, ref) < 3e-3


def test_bad_arguments_raise(device):
    E, H, N = 2, 64, 32
    w13, w2 = (_to(w, device) for w in make_weights("dense", E, H, N, dtype=torch.float16))
    x = torch.randn(3, H, dtype=torch.float16, device=device)
    ids = torch.tensor([[0, 1], [1, 0], [0, 2]], device=device)
    tw = torch.ones(3, 2, device=device)
    with pytest.raises(MoetoolError, match="local expert 2"):
        fm.fused_experts(x, w13, w2, "dense", ids, tw)
    ids = ids.clamp(max=1)
    with pytest.raises(MoetoolError, match="unknown weight format"):
        fm.fused_experts(x, w13, w2, "nf4", ids, tw)
    with pytest.raises(MoetoolError, match="activation"):
        fm.fused_experts(x, w13, w2, "dense", ids, tw, activation="gelu")
    with pytest.raises(MoetoolError, match="shape"):
        fm.fused_experts(x[:, :32].contiguous(), w13, w2, "dense", ids, tw)
    q13, q2 = (_to(w, device) for w in make_weights("fp8-block", E, H, N))
    with pytest.raises(MoetoolError, match="hidden_scale"):
        fm.fused_experts(x.to(torch.float8_e4m3fn), q13, q2, "fp8-block", ids, tw)
    bad = dict(q13, weight_scale_inv=q13["weight_scale_inv"][:, :1].contiguous())
    with pytest.raises(MoetoolError, match="weight_scale_inv"):
        fm.fused_experts(x, bad, q2, "fp8-block", ids, tw)
    # fp8-channel takes one scale per token, fp8-block one per 1x128 group: neither takes the other's
    H2 = 192
    c13, c2 = (_to(w, device) for w in make_weights("fp8-channel", E, H2, N))
    b13, b2 = (_to(w, device) for w in make_weights("fp8-block", E, H2, N))
    q, s_group = (t.to(device) for t in kq.fp8_act_quant_ref(torch.randn(3, H2), 128))  # [3, 2] scales
    s_token = s_group[:, :1].contiguous()
    with pytest.raises(MoetoolError, match=r"hidden_scale float32 \[3, 1\] \(fp8-channel: one scale per token\)"):
        fm.fused_experts(q, c13, c2, "fp8-channel", ids, tw, hidden_scale=s_group)
    with pytest.raises(MoetoolError, match=r"hidden_scale float32 \[3, 1\]"):
        fm.fused_experts(q, c13, c2, "fp8-channel", ids, tw)
    with pytest.raises(MoetoolError, match=r"hidden_scale float32 \[3, 2\] \(fp8-block: one scale per 1x128"):
        fm.fused_experts(q, b13, b2, "fp8-block", ids, tw, hidden_scale=s_token)
    with pytest.raises(MoetoolError, match="fp8 hidden states need the fp8-block / fp8-channel format"):
        fm.fused_experts(q[:, :H], w13, w2, "dense", ids, tw, hidden_scale=s_token)


# ---- the steps on their own ---------------------------------------------------------------


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("T,k,E", [(0, 2, 4), (1, 1, 1), (33, 2, 4), (50, 4, 7), (8, 2, 64),
                                   (300, 8, 256), (700, 8, 3)])  # last two: several chunks of pairs
def test_align_matches_loop_reference(T, k, E, block_m, device):
    ids, _ = make_routing(T, E, k, E_global=max(E + 3, k), seed=T)
    if T == 700:
        ids = ids.to(torch.int32)
    got = [t.cpu() for t in moe_align_block_size(ids.to(device), block_m, E)]
    ref = moe_align_block_size_ref(ids, block_m, E)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    sorted_ids, _, num_post = got
    P = T * k
    valid = sorted_ids[sorted_ids < P]
    assert sorted(valid.tolist()) == [p for p in range(P) if ids.view(-1)[p] >= 0]
    assert int(num_post) % block_m == 0


def test_align_drops_ids_outside_the_experts(device):
    """An id past the local experts (documented as impossible, never checked: a check would cost
    a host sync) was placed past sorted_ids' end: it is dropped as -1 is, as in the reference."""
    ids = torch.tensor([[0, 1, 2], [5, 40, -1], [3, 0, -7]], dtype=torch.int32)
    for E in (1, 4):
        got = [t.cpu() for t in moe_align_block_size(ids.to(device), 16, E)]
        ref = moe_align_block_size_ref(ids, 16, E)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, ref)), (E, got, ref)
    with pytest.raises(MoetoolError, match="num_experts must be >= 0, got -1"):
        moe_align_block_size(ids.to(device), 16, -1)
    with pytest.raises(MoetoolError, match="topk_ids must be int32 or int64, got torch.float32"):
        moe_align_block_size(ids.float().to(device), 16, 4)


def test_silu_refuses_no_partials_and_a_non_float_output(device):
    with pytest.raises(MoetoolError, match=r"need S >= 1"):  # a segfault before
        silu_and_mul(torch.empty(0, 5, 64, device=device))
    with pytest.raises(MoetoolError, match="out_dtype must be a float dtype, got torch.int32"):
        silu_and_mul(torch.randn(5, 64, device=device), out_dtype=torch.int32)


def test_moe_sum_of_no_partials_is_refused_and_empty_sums_match(device):
    with pytest.raises(MoetoolError, match=r"need S >= 1"):
        moe_sum(torch.empty(0, 6, 5, device=device), torch.zeros((3, 2), dtype=torch.int32, device=device))
    for T, k in ((0, 2), (2, 0)):
        c, ids = torch.randn(T * k, 8), torch.zeros((T, k), dtype=torch.int32)
        assert torch.equal(moe_sum(c.to(device), ids.to(device)).cpu(), moe_sum_ref(c, ids))


@pytest.mark.parametrize("fmt, act_dtype, symmetric", [
    ("dense", torch.float32, None), ("fp8-block", torch.float8_e4m3fn, None),
    ("fp8-channel", torch.float8_e4m3fn, None), ("int4-group", torch.float32, False),
])
def test_moe_gemm_matches_ref(fmt, act_dtype, symmetric, device):
    """Both grouped GEMMs alone (w13 on token rows with fp8-block's separately scaled gate/up
    halves, w2 on pair rows with the router weight) against the torch reference on the
    format's dequantized weights; rows of pairs on other ranks are never written."""
    T, E, H, N, k, group = SHAPES[0]
    f = weight_format(fmt, group, bool(symmetric))
    w13, w2 = make_weights(fmt, E, H, N, group, bool(symmetric))
    ids, tw = make_routing(T, E, k)
    P = T * k
    cfg = default_config(f.kernel_scheme, P / E, torch.float32, device == "cpu", group)
    sorted_ids, expert_ids, num_post_pad = (t.cpu() for t in moe_align_block_size(ids.to(device), cfg.block_m, E))
    x, xs = make_hidden(T, H, act_dtype, SCHEMES[fmt].act_group)
    h, hs = make_hidden(P, N, act_dtype, SCHEMES[fmt].act_group)
    for a, a_scale, w, R, C, a_row_div, split, mul in ((x, xs, w13, 2 * N, H, k, N, False),
                                                       (h, hs, w2, H, N, 1, None, True)):
        wts = parse_weights(f.kernel_scheme, _to(w, device), "w", E, R, C, group, split)
        c = torch.full((P, R), float("nan"), device=device)
        moe_gemm(a.to(device), a_scale.to(device) if a_scale is not None else None, wts, c, tw.view(-1).to(device),
                 sorted_ids.to(device), expert_ids.to(device), num_post_pad.to(device), P, a_row_div,
                 split or R, mul, group, cfg)
        dense = torch.stack([dequantize_stacked(f.kernel_scheme, w, e, R, C, f.dequantize,
                                                f.split_rows if split else None) for e in range(E)])
        ref = moe_gemm_ref(a, a_scale, dense, tw, sorted_ids, expert_ids, P, a_row_div, mul, cfg.block_m)
        local = ids.view(-1) >= 0
        assert torch.isnan(c.cpu()[~local]).all()
        assert rel_err(c.cpu()[local], ref[local]) < 1e-5, (fmt, R)


def test_moe_gemm_refuses_sizes_it_would_read_or_write_past(device):
    """The GEMM trusts its size arguments: each of these was accepted and read past a, the
    weights or topk_weights, wrote past c, or (an alignment of another block_m) was wrong."""
    T, E, H, N, k, group = SHAPES[0]
    f = weight_format("dense", group, True)
    w13, _ = make_weights("dense", E, H, N, group, True)
    ids, tw = make_routing(T, E, k)
    P = T * k
    cfg = default_config(f.kernel_scheme, P / E, torch.float32, device == "cpu", group)
    aligned = [t.to(device) for t in moe_align_block_size(ids.to(device), cfg.block_m, E)]
    other = [t.to(device) for t in moe_align_block_size(ids.to(device), cfg.block_m * 2, E)]
    wts = parse_weights(f.kernel_scheme, _to(w13, device), "w13", E, 2 * N, H, group, None)
    x = torch.randn(T, H, device=device)
    c = torch.zeros(P, 2 * N, device=device)
    twf = tw.view(-1).to(device)

    def gemm(a=x, c=c, weights=twf, align=aligned, mul=False):
        moe_gemm(a, None, wts, c, weights, *align, P, k, 2 * N, mul, group, cfg)

    gemm()  # the arguments as they should be
    for case, match in ((dict(a=x[:, :H // 2].contiguous()), rf"a has {H // 2} columns, the weights {H}"),
                        (dict(c=c[:P - 1]), rf"{P} pairs need c of as many rows \(has {P - 1}\)"),
                        (dict(a=x[:1]), rf"and a of ceil\({P} / {k}\) \(has 1\)"),
                        (dict(weights=twf[:2], mul=True), rf"{P} pairs need as many topk_weights, got 2"),
                        (dict(c=c.to(torch.int32)), r"c must be fp16/bf16/fp32, got torch.int32"),
                        (dict(align=other), rf"are not aligned to block_m {cfg.block_m}")):
        with pytest.raises(MoetoolError, match=match):
            gemm(**case)
    with pytest.raises(MoetoolError, match=r"group_size must be positive, got 0"):
        parse_weights("int4-group", {}, "w13", E, 2 * N, H, 0, None)


@pytest.mark.parametrize("block_n", [32, 64, 256])
def test_fp8_block_gemm_scale_per_tile_or_per_row(block_n, device):
    """fp8-block's w13 GEMM with N = 96 gate rows (the up half's scale blocks start mid-block):
    BLOCK_N 32 divides 96 and 128, so each tile's rows share one scale row (the kernel's
    BS_TILE: one weight scale a K block); 64 (a tile across the gate / up border) and 256 (wider
    than a block) scale row by row. Each against the torch reference on dequantized weights."""
    T, E, H, N, k, _ = SHAPES[0]
    f = weight_format("fp8-block")
    w13, _ = make_weights("fp8-block", E, H, N)
    ids, tw = make_routing(T, E, k)
    P = T * k
    cfg = MoeConfig(16, block_n, 128, 1, 4, 1)
    sorted_ids, expert_ids, num_post_pad = (t.cpu() for t in moe_align_block_size(ids.to(device), 16, E))
    x, xs = make_hidden(T, H, torch.float8_e4m3fn, SCHEMES["fp8-block"].act_group)
    wts = parse_weights("fp8-block", _to(w13, device), "w13", E, 2 * N, H, 128, N)
    c = torch.full((P, 2 * N), float("nan"), device=device)
    moe_gemm(x.to(device), xs.to(device), wts, c, tw.view(-1).to(device), sorted_ids.to(device),
             expert_ids.to(device), num_post_pad.to(device), P, k, N, False, 128, cfg)
    dense = torch.stack([dequantize_stacked("fp8-block", w13, e, 2 * N, H, f.dequantize, f.split_rows)
                         for e in range(E)])
    ref = moe_gemm_ref(x, xs, dense, tw, sorted_ids, expert_ids, P, k, False, 16)
    local = ids.view(-1) >= 0
    assert rel_err(c.cpu()[local], ref[local]) < 1e-5, rel_err(c.cpu()[local], ref[local])


def test_silu_and_mul(device):
    x = torch.randn(37, 2 * 200) * 4
    ref = silu_and_mul_ref(x)
    y = silu_and_mul(x.to(device)).cpu()
    torch.testing.assert_close(y, ref, rtol=2e-6, atol=1e-6)
    ids = torch.randint(-1, 3, (37,))
    q, s = silu_and_mul(x.to(device), ids.to(device), quant_fp8=True)
    keep = ids >= 0
    q_ref, s_ref = kq.fp8_act_quant_ref(ref[keep])
    torch.testing.assert_close(s.cpu()[keep], s_ref, rtol=2e-6, atol=0)
    same = (q.cpu()[keep].view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.99  # exp() may differ from torch's by an ulp: rare 1-step e4m3 flips
    half = silu_and_mul(x.to(device), out_dtype=torch.float16).cpu()
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), ref, rtol=1e-3, atol=1e-3)


def test_silu_blocks_give_decode_every_sm_and_keep_the_values(device, monkeypatch):
    """Few rows: smaller blocks until the call has MIN_PROGRAMS programs (DeepSeek-V3 EP8 T=1,
    8 pairs of N = 2048: 128 programs, was 4), never narrower than a quantization group; the
    values do not depend on the blocks (forced here onto the interpreter)."""
    from moetool.kernels import moe_silu as ms
    assert ms.silu_blocks(8, 2048, 1024, False, False) == (1, 128)
    assert ms.silu_blocks(8, 2048, 128, True, False) == (1, 128)  # fp8-block: 1 x 128 groups
    assert ms.silu_blocks(8, 2048, 2048, True, True) == (1, 2048)  # per token: a program a row
    assert ms.silu_blocks(4096, 2048, 1024, False, False) == (4, 1024)  # many rows: as before
    x = torch.randn(5, 2 * 256) * 4
    ids = torch.tensor([0, -1, 2, 1, 0])
    want = silu_and_mul(x.to(device)).cpu(), silu_and_mul(x.to(device), ids.to(device), quant_fp8=True)
    monkeypatch.setattr(ms, "is_interpreted", lambda fn: False)  # the GPU's blocks: [1, 128], 10 programs
    monkeypatch.setattr(ms, "check_device", lambda fn, t: None)
    monkeypatch.setattr(ms, "MIN_PROGRAMS", 8)
    assert ms.silu_blocks(5, 256, 256, False, False, 8) == (1, 128)
    got = silu_and_mul(x.to(device)), silu_and_mul(x.to(device), ids.to(device), quant_fp8=True, soft_fp8=device == "cpu")
    assert torch.equal(got[0].cpu(), want[0])
    keep = ids >= 0
    assert torch.equal(got[1][0].cpu()[keep].view(torch.uint8), want[1][0].cpu()[keep].view(torch.uint8))
    assert torch.equal(got[1][1].cpu()[keep], want[1][1].cpu()[keep])


def test_moe_sum_bit_exact_and_ignores_dropped_rows(device):
    T, k, H = 9, 3, 70
    ids = torch.randint(-1, 4, (T, k))
    c = torch.randn(T * k, H)
    c[ids.view(-1) < 0] = float("nan")  # rows of dropped pairs are never written
    out = moe_sum(c.to(device), ids.to(device)).cpu()
    assert torch.equal(out, moe_sum_ref(c, ids))
    half = moe_sum(c.to(device), ids.to(device), torch.bfloat16).cpu()
    assert half.dtype == torch.bfloat16 and torch.equal(half, moe_sum_ref(c, ids, torch.bfloat16))
    assert torch.equal(half, out.to(torch.bfloat16))


# ---- GPU only: bf16 dots, realistic tiles, hardware fp8 cast --------------------------------

GPU_SHAPES = [(256, 8, 1024, 384, 4, 128), (3, 8, 512, 256, 8, 64)]
# measured on an H100 (triton 3.6): nvfp4-bf16 <= 4.4e-3, mxfp4-bf16 <= 2.9e-3, int4-sym-bf16 <= 3.9e-3,
# dense-bf16 <= 2.9e-3
GPU_CASES = {
    "dense-bf16": ("dense", torch.bfloat16, None, 8e-3),
    "fp8-block-w8a8": ("fp8-block", torch.float8_e4m3fn, None, 0.05),
    "fp8-block-bf16-hidden": ("fp8-block", torch.bfloat16, None, 0.06),
    "fp8-channel-w8a8": ("fp8-channel", torch.float8_e4m3fn, None, 0.05),
    "fp8-channel-bf16": ("fp8-channel", torch.bfloat16, None, 0.06),
    "int4-sym-bf16": ("int4-group", torch.bfloat16, True, 1e-2),
    "int4-asym-bf16": ("int4-group", torch.bfloat16, False, 1e-2),
    "nvfp4-bf16": ("nvfp4", torch.bfloat16, True, 1e-2),
    "nvfp4-joint-bf16": ("nvfp4", torch.bfloat16, False, 1e-2),
    "mxfp4-bf16": ("mxfp4", torch.bfloat16, None, 1e-2),
    "dense-fp32": ("dense", torch.float32, None, 1e-5),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "T{}-E{}-H{}-N{}-k{}-g{}".format(*s))
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_fused_experts_gpu(case, shape, monkeypatch):
    monkeypatch.setitem(CASES, case, GPU_CASES[case])
    out, ref, tol, _ = run_case(case, shape, "cuda")
    assert rel_err(out, ref) < tol, (case, rel_err(out, ref))
