"""int4 weights read as int16 quads (K tiles >= 64, unswapped): the kernel dequantizes four
nibbles a 16-bit element and dots four K/4-column slices (:func:`moetool.kernels.moe_gemm._int4_quads`).
On CPU (interpreter) the quads' Triton-op form against the reference and against the plain
int4 tile (K tile 32); on GPU the packed-PTX form bit for bit against the Triton-op form.

Letters: T tokens, H hidden, N intermediate, E local experts, k top-k, g int4 group.
"""
import pytest
import torch
from moetool.kernels import moe_gemm as mg
from moetool.kernels.moe_tiles import MoeConfig

from test_kernels_fused_moe import CASES, make_problem, rel_err

QUADS = MoeConfig(16, 32, 64, 1, 4, 1)  # K tile 64: four dots of 16 columns
PLAIN = MoeConfig(16, 32, 32, 1, 4, 1)  # K tile 32: the int32-word tile
# (case, (T, E, H, N, k, g)): g = 64 one scale (and zero point) per K tile: the codes are dotted
# and the fp32 product scaled; g = 8 and 32 a scale per quad (the dequantized quads), with zero
# points; H = 136 and N = 40 leave a ragged last K tile (and H a half-padded last word)
QUAD_CASES = [
    ("int4-sym-fp16", (9, 3, 128, 64, 2, 64)),
    ("int4-asym-fp16", (9, 3, 136, 40, 2, 64)),
    ("int4-asym-fp16", (9, 3, 136, 40, 2, 8)),
    ("int4-asym-fp32", (5, 2, 136, 64, 2, 32)),
]


def _problem(case, shape, device, hdtype=None, scale_dtype=None):
    """make_problem with int4 scales in the activations' 16-bit dtype (bf16 under fp32) unless given."""
    hdtype = hdtype or CASES[case][1]
    return make_problem(case, shape, device, hdtype, scale_dtype or (hdtype if hdtype != torch.float32 else torch.bfloat16))


@pytest.mark.parametrize("case,shape", QUAD_CASES, ids=[f"{c[0]}-g{c[1][-1]}" for c in QUAD_CASES])
def test_quads_match_ref_and_plain_tile(case, shape, device):
    run, ref, tol = _problem(case, shape, device)[:3]
    quads, plain = run(QUADS), run(PLAIN)
    assert rel_err(quads, ref) < tol, rel_err(quads, ref)
    if shape[-1] % QUADS.block_k == 0:
        # codes dotted, the fp32 product scaled: the weights are never rounded to the dot's dtype,
        # closer to the reference than the plain tile (fp16: 3.3e-4 against 5.0e-4)
        assert rel_err(quads, ref) < rel_err(plain, ref), (rel_err(quads, ref), rel_err(plain, ref))
    else:  # the same dequantized values, summed in another order
        assert rel_err(quads, plain) < tol / 4, rel_err(quads, plain)


def test_quads_only_for_k_tiles_of_64(device, monkeypatch):
    """A K tile of 64 is quads only where each int16's four columns share a scale (g % 4 == 0)
    and the words lie contiguous along K; a broken quad order would fail the reference."""
    taken = []
    real = mg._moe_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                taken.append(kw["QUADS"])
                return real[grid](*args, **kw)
            return launch

    interpreted = mg.is_interpreted(real)
    monkeypatch.setattr(mg, "_moe_gemm_kernel", Spy())
    monkeypatch.setattr(mg, "is_interpreted", lambda fn: interpreted)
    run, ref, tol = _problem("int4-sym-fp16", (3, 2, 128, 64, 2, 64), device)[:3]
    assert rel_err(run(QUADS), ref) < tol
    assert taken == [True, True]
    taken.clear()
    assert rel_err(run(PLAIN), ref) < tol
    assert taken == [False, False]


# ---- GPU only: the packed PTX against the same values by Triton's scalar ops ----------------------

GPU_TILES = [MoeConfig(16, 64, 64, 1, 4, 3, 4, 4), MoeConfig(16, 128, 128, 1, 4, 4, fuse_silu=True),
             MoeConfig(64, 128, 64, 8, 4, 3), MoeConfig(128, 128, 128, 8, 8, 3)]
# (case, activations, g, scales): fp32 scales take the PTX only in the codes tiles (under 64 rows;
# the dequantized quads multiply the scale in the dot's dtype)
GPU_CASES = [("int4-sym-fp16", torch.bfloat16, 128, None), ("int4-sym-fp16", torch.float16, 128, None),
             ("int4-asym-fp16", torch.bfloat16, 32, None), ("int4-asym-fp16", torch.float16, 64, None),
             ("int4-sym-fp16", torch.bfloat16, 128, torch.float32)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case,hdtype,group,scale_dtype", GPU_CASES,
                         ids=[f"{c}-{str(d)[6:]}-g{g}" + ("-fp32-scales" if sd else "") for c, d, g, sd in GPU_CASES])
def test_quads_ptx_bit_exact_gpu(case, hdtype, group, scale_dtype, monkeypatch):
    p = _problem(case, (300, 8, 1024, 512, 8, group), "cuda", hdtype, scale_dtype)
    run, ref, w13 = p.run, p.ref, p.w13
    assert w13["weight_scale"].dtype == (scale_dtype or hdtype)
    for cfg in GPU_TILES:
        monkeypatch.setattr(mg, "INT4_ASM", True)
        asm = run(cfg)
        monkeypatch.setattr(mg, "INT4_ASM", False)
        ops = run(cfg)
        assert torch.equal(asm, ops), (cfg, rel_err(asm, ops))
        assert rel_err(asm, ref) < 1e-2, (cfg, rel_err(asm, ref))
