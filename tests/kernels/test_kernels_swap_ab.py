"""Swapped operands of the dequantizing GEMMs (``MoeConfig.swap_ab``: C^T = W @ A^T, the int4 /
fp4 weight tile the dot's register operand): fused_experts against fused_experts_ref and
against itself unswapped, with split-K, silu in the epilogue, partial groups and every scale
layout, and the checks that keep it to the weight-only schemes.

Letters: T tokens, H hidden, N intermediate, E local experts, k top-k, g int4 group.
"""
import pytest
import torch
from moetool.kernels import fused_moe as fm
from moetool.kernels import moe_tiles as mt
from moetool.kernels.moe_align import moe_align_block_size
from moetool.kernels.moe_gemm import moe_gemm
from moetool.kernels.moe_tiles import MoeConfig
from moetool.kernels.moe_weights import parse_weights

from moetool.errors import MoetoolError

from test_kernels_fused_moe import CASES, _to, fused_ref, make_problem, make_routing, make_weights, rel_err

# (case of test_kernels_fused_moe.CASES, (T, E, H, N, k, g), tiles): int4 with g a multiple of
# the K tile (one scale per tile: the prefetched path), g = 8 < BLOCK_K (scales per element) and
# asymmetric zero points, H not whole K tiles (masked tails); nvfp4 with gate and up scaled
# apart and jointly; mxfp4 in fp32 (exact tiles: the swapped sum against the unswapped one).
# Tiles: BLOCK_M 16 (the pairs, the MMA's N) x BLOCK_N 32 (weight rows) x BLOCK_K 32
SWAP_CASES = [
    ("int4-sym-fp16", (9, 3, 96, 64, 2, 32)),
    ("int4-asym-fp16", (9, 3, 80, 48, 2, 8)),
    ("int4-asym-fp32", (5, 2, 64, 32, 2, 32)),
    ("nvfp4-fp16", (9, 3, 96, 64, 2, None)),
    ("nvfp4-joint-fp16", (5, 2, 64, 32, 2, None)),
    ("mxfp4-fp32", (9, 3, 96, 64, 3, None)),
]
TILE = MoeConfig(16, 32, 32, 1, 4, 1)
SWAPPED = MoeConfig(16, 32, 32, 1, 4, 1, swap_ab=True)


@pytest.mark.parametrize("case,shape", SWAP_CASES, ids=[c[0] for c in SWAP_CASES])
def test_swapped_matches_ref_and_unswapped(case, shape, device):
    run, ref, tol, hdtype = make_problem(case, shape, device)[:4]
    swapped, plain = run(SWAPPED), run(TILE)
    assert rel_err(swapped, ref) < tol, rel_err(swapped, ref)
    # the same dequantized tiles and products, summed in another order (fp16: the intermediate
    # rows rounded where the unswapped pipeline rounds them, a rare last-bit flip apart)
    assert rel_err(swapped, plain) < (1e-6 if hdtype == torch.float32 else 0.2 * tol), rel_err(swapped, plain)


@pytest.mark.parametrize("case", ["int4-asym-fp16", "mxfp4-fp32", "nvfp4-fp16"])
def test_swapped_with_split_k_and_fused_silu(case, device):
    """Split-K slices (each slice's first scales prefetched at its own start) and silu in GEMM1's
    epilogue (the gate / up interleave of the tile's rows, transposed back) agree with the
    reference and with the unswapped pipeline of the same options."""
    shape = dict(SWAP_CASES)[case]
    run, ref, tol, hdtype = make_problem(case, shape, device)[:4]
    for opts in ({"split_w13": 2, "split_w2": 3}, {"fuse_silu": True}):
        swapped = run(MoeConfig(16, 32, 32, 1, 4, 1, swap_ab=True, **opts))
        plain = run(MoeConfig(16, 32, 32, 1, 4, 1, **opts))
        assert rel_err(swapped, ref) < tol, (opts, rel_err(swapped, ref))
        assert rel_err(swapped, plain) < (1e-6 if hdtype == torch.float32 else 0.2 * tol), (opts, rel_err(swapped, plain))


def test_swapped_fused_clamped_swiglu_and_biases(device):
    """gpt-oss's experts (mxfp4, clamped SwiGLU, biases) with silu in the swapped GEMM1's epilogue,
    whose tile interleaves gate and up rows by 8: BLOCK_N 32 and 128 over 2N = 64 rows (a tile
    wider than the linear), against the reference and the unswapped fused pipeline."""
    T, E, H, N, k = 9, 3, 64, 32, 2
    g = torch.Generator().manual_seed(1)
    w13, w2 = make_weights("mxfp4", E, H, N)
    b13, b2 = torch.randn(E, 2 * N, generator=g) * 0.2, torch.randn(E, H, generator=g) * 0.2
    ids, tw = make_routing(T, E, k)
    x = torch.randn(T, H, generator=g)
    kw = dict(activation="clamped-swiglu", swiglu=(1.702, 0.5))
    ref = fused_ref(x, w13, w2, "mxfp4", ids, tw, w13_bias=b13, w2_bias=b2, **kw)
    args = (x.to(device), _to(w13, device), _to(w2, device), "mxfp4", ids.to(device), tw.to(device))
    kw.update(w13_bias=b13.to(device), w2_bias=b2.to(device))
    plain = fm.fused_experts(*args, config=MoeConfig(16, 32, 32, 1, 4, 1, fuse_silu=True), **kw).cpu()
    for bn in (32, 128):
        out = fm.fused_experts(*args, config=MoeConfig(16, bn, 32, 1, 4, 1, fuse_silu=True, swap_ab=True), **kw).cpu()
        assert rel_err(out, ref) < CASES["mxfp4-fp32"][3], (bn, rel_err(out, ref))
        assert rel_err(out, plain) < 1e-6, (bn, rel_err(out, plain))


def test_swapped_wider_tiles_than_the_pairs(device):
    """BLOCK_M 32 over experts with 1-3 pairs (padding rows masked in the transposed store) and
    BLOCK_N 64 over w2's 48 rows (weight rows read modulo R, extra columns dropped)."""
    case, shape = "int4-sym-fp16", (4, 3, 48, 32, 2, 16)
    run, ref, tol = make_problem(case, shape, device)[:3]
    out = run(MoeConfig(32, 64, 16, 1, 4, 1, swap_ab=True))
    assert rel_err(out, ref) < tol, rel_err(out, ref)


def test_swapped_gemm_leaves_other_rows_untouched(device):
    """moe_gemm alone: rows of pairs in no block keep their poison, every other row is written."""
    T, E, H, N, k = 6, 2, 64, 32, 2
    w13, _ = make_weights("mxfp4", E, H, N)
    ids, tw = make_routing(T, E, k)
    P = T * k
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids.to(device), 16, E)
    wts = parse_weights("mxfp4", _to(w13, device), "w13", E, 2 * N, H, 128, N)
    c = torch.full((P, 2 * N), float("nan"), device=device)
    moe_gemm(torch.randn(T, H).to(device), None, wts, c, tw.view(-1).to(device), sorted_ids, expert_ids,
             num_post_pad, P, k, N, False, 128, SWAPPED)
    local = ids.view(-1) >= 0
    assert torch.isnan(c.cpu()[~local]).all() and not torch.isnan(c.cpu()[local]).any()


@pytest.mark.parametrize("scheme", ["dense", "fp8-block", "fp8-channel"])
def test_swap_is_only_for_the_dequantizing_schemes(scheme):
    assert "swap_ab" in mt.config_problem(scheme, SWAPPED)
    for ok in ("int4-group", "nvfp4", "mxfp4"):
        assert mt.config_problem(ok, SWAPPED) is None
    assert "swap_ab" in mt.config_problem("int4-group", MoeConfig(swap_ab=1))


def test_dense_gemm_refuses_swap(device):
    w = {"weight": torch.randn(1, 32, 32).to(device)}
    wts = parse_weights("dense", w, "w", 1, 32, 32, 128, None)
    ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
    sorted_ids, expert_ids, num_post_pad = moe_align_block_size(ids, 16, 1)
    with pytest.raises(MoetoolError, match="swap_ab"):
        moe_gemm(torch.randn(1, 32).to(device), None, wts, torch.empty(1, 32, device=device),
                 torch.ones(1, device=device), sorted_ids, expert_ids, num_post_pad, 1, 1, 32, False, 128, SWAPPED)


def test_table_tiles_carry_swap_ab():
    """A table's tile names swap_ab like the other optional fields: read back as written, left
    out when false."""
    entry = {"scheme": "mxfp4", "E": 4, "N": 64, "H": 96, "top_k": 2,
             "tiles": {"4096": {**mt.config_dict(MoeConfig(256, 128, 64, 8, 8, 3, swap_ab=True)), "us": 1.0},
                       "1": mt.config_dict(MoeConfig(16, 64, 64, 1, 4, 3))}}
    assert "swap_ab" not in entry["tiles"]["1"]
    table = mt.parse_table({"entries": [entry]}, "t.json")
    per_t = table[mt.entry_key("mxfp4", 4, 64, 96, 2)]
    assert per_t[4096].swap_ab is True and per_t[1].swap_ab is False
    bad = {"entries": [{**entry, "scheme": "dense"}]}
    with pytest.raises(MoetoolError, match="swap_ab"):
        mt.parse_table(bad, "t.json")


# ---- GPU only: bf16 dots, the real tile sizes (wgmma with the weights in registers) ----------------

GPU_SWAP = [("int4-sym-bf16", "int4-group", 1e-2), ("nvfp4-bf16", "nvfp4", 1e-2), ("mxfp4-bf16", "mxfp4", 1e-2)]
GPU_TILES = [MoeConfig(16, 64, 64, 1, 4, 3, 4, 4, swap_ab=True), MoeConfig(16, 128, 128, 1, 4, 4, fuse_silu=True, swap_ab=True),
             MoeConfig(32, 128, 64, 8, 4, 3, swap_ab=True), MoeConfig(256, 128, 64, 8, 8, 3, fuse_silu=True, swap_ab=True),
             MoeConfig(128, 128, 128, 8, 4, 2, swap_ab=True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,fmt,tol", GPU_SWAP, ids=[c[0] for c in GPU_SWAP])
def test_swapped_gpu(name, fmt, tol, monkeypatch):
    monkeypatch.setitem(CASES, name, (fmt, torch.bfloat16, True, tol))
    run, ref = make_problem(name, (300, 8, 1024, 512, 8, 128), "cuda")[:2]
    plain = run(MoeConfig(64, 128, 64, 8, 4, 3))
    for cfg in GPU_TILES:
        out = run(cfg)
        assert rel_err(out, ref) < tol, (cfg, rel_err(out, ref))
        # the same bits again: nvfp4's 256-row 8-warp tiles raced (13-22 dB, other rows each run) while
        # the kernel divided every group scale by the global scale inside the K loop
        assert torch.equal(run(cfg), out), cfg
        # the same bf16 tiles and fp32 sums in another order: cache1's bf16 rounding flips rarely
        assert rel_err(out, plain) < 2e-3, (cfg, rel_err(out, plain))
