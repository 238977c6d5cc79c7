"""quantize_measured: the fused CPU quantizers give the reference formulas' tensors bit for bit
and the error sums of dequantize(quantize(w)) against w."""
from __future__ import annotations

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.formats import Fp8Block, Fp8Channel, Int4Group
from moetool.formats import common, fp8_block, int4_group
from moetool.formats.common import error_sums
from moetool.memory import scratch

FORMATS = {
    "fp8-block": Fp8Block(),
    "fp8-channel": Fp8Channel(),
    "int4-sym-g128": Int4Group(128, True),
    "int4-asym-g128": Int4Group(128, False),
    "int4-sym-g32": Int4Group(32, True),
    "int4-asym-g64": Int4Group(64, False),
}
SHAPES = [(256, 384), (384, 256), (128, 1024), (640, 128), (1024, 2048)]


def random_weight(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.02
    w[0, :64] = 0  # an all-zero block / group takes the amax floor
    w[-1, -9:] *= 50  # outliers
    return w.to(dtype)


def same_tensors(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        if a[key].dtype == torch.float8_e4m3fn:
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key
        else:
            assert torch.equal(a[key], b[key]), key


@pytest.fixture(params=[1 << 14, 1 << 18], ids=["small-bands", "default-bands"])
def band(request, monkeypatch):
    """Several bands or tiles per weight (a remainder included; fp8-block: blocks of columns
    too) and the default size."""
    monkeypatch.setattr(common, "BAND_ELEMENTS", request.param)
    monkeypatch.setattr(common, "TILE_ELEMENTS", request.param)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_measured_matches_reference(name, shape, dtype, band):
    fmt = FORMATS[name]
    w = random_weight(shape, dtype)
    got, sig, noise = fmt.quantize_measured(w, dtype)
    want = fmt.quantize(w.float(), dtype)
    same_tensors(got, want)
    # the same per-element terms as dequantize(want) - w32: float32 dot products per band,
    # added up in float64, against a float64 sum of them
    w64 = w.double()
    assert sig == pytest.approx(float((w64 * w64).sum()), rel=1e-4)
    diff = fmt.dequantize(want).double() - w64
    assert noise == pytest.approx(float((diff * diff).sum()), rel=1e-4)


@pytest.mark.parametrize("fmt, shape", [(Fp8Block(), (200, 136)), (Int4Group(12, True), (24, 36)),
                                        (Int4Group(12, False), (24, 36))],
                         ids=["fp8-block-partial-blocks", "int4-sym-g12", "int4-asym-g12"])
def test_measured_falls_back_where_not_fused(fmt, shape):
    """Shapes the fused code does not take (partial fp8 blocks, int4 K not a multiple of 8)
    go through quantize + dequantize."""
    w = random_weight(shape)
    got, sig, noise = fmt.quantize_measured(w, torch.bfloat16)
    same_tensors(got, fmt.quantize(w.float(), torch.bfloat16))
    assert (sig, noise) == error_sums(w.float(), fmt.dequantize(got))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_measured_refuses_non_finite(name, bad):
    w = random_weight((256, 256))
    w[200, 3] = bad
    with pytest.raises(MoetoolError, match="NaN/Inf"):
        FORMATS[name].quantize_measured(w, torch.bfloat16)


@pytest.mark.parametrize("name", ["fp8-block", "int4-sym-g128", "int4-asym-g64"])
def test_tile_loops_compile_and_run_eagerly_alike(name, monkeypatch):
    """The tile loops run as TorchScript (``common.scripted``: one call without the GIL) where
    torch has it; run eagerly instead (the fallback) they give the same tensors and sums."""
    loop = fp8_block._fp8_block_tiles if name == "fp8-block" else int4_group._int4_group_tiles
    fmt = FORMATS[name]
    w = random_weight((384, 1024))
    compiled = fmt.quantize_measured(w, torch.bfloat16)
    if hasattr(torch.jit, "script"):
        assert isinstance(loop._compiled, torch.jit.ScriptFunction)
    monkeypatch.setattr(loop, "_compiled", loop.fn)
    eager = fmt.quantize_measured(w, torch.bfloat16)
    same_tensors(compiled[0], eager[0])
    assert compiled[1:] == eager[1:]


def test_scratch_is_reused_per_thread():
    a = scratch("test", 100, torch.float32)
    b = scratch("test", 50, torch.float32)
    assert a.data_ptr() == b.data_ptr() and b.numel() == 50
    c = scratch("test", 1000, torch.float32)  # grows
    assert c.numel() == 1000


def test_abs_max_bits_is_abs_max():
    """The integer max of the sign-cleared bits is the same number as max |x|, over zeros of
    both signs, subnormals, the largest floats and infinities; a NaN gives a NaN."""
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.2e-38, -3.4e38, 3.4e38, float("inf"), -float("inf"), -2.5, 7.0])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, 32, generator=g) * torch.logspace(-40, 30, 32)
    x[0, 0, :11] = special
    x[1, 3].zero_()
    x[2, 5] = -0.0
    x[3, 1, :] = -torch.rand(32, generator=g) * 1e-42  # subnormals only
    for dim in (-1, (0, 2)):
        want = common.abs_max(x, dim)
        out = torch.empty(want.shape)
        got = common.abs_max_bits(x, dim, out, torch.empty(x.numel()))
        assert got is out and torch.equal(got, want) and not torch.signbit(got).any()
    x[4, 2, 7] = float("nan")
    got = common.abs_max_bits(x, -1, torch.empty(6, 8), torch.empty(x.numel()))
    assert got[4, 2].isnan() and torch.equal(got[:4], common.abs_max(x, -1)[:4])


@pytest.mark.parametrize("scale", [1e-14, 3e-4, 1.0, 200.0, 1e30, 3.4e38 / 448], ids=lambda s: f"s={s:g}")
def test_e4m3_dequantize_band_is_exact(scale):
    """Every finite e4m3 code times a scale, as q.float() * s, bit for bit, signed zeros
    included, up to the largest scale a finite weight gets (float32 max / 448)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn).reshape(2, -1)
    s = torch.tensor([[scale], [scale / 1.37]], dtype=torch.float32)
    got = common.e4m3_dequantize_band(q, s, torch.empty(q.shape), torch.empty(q.numel(), dtype=torch.int32))
    want = q.float() * s
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


class _MisStoredScale(torch.Tensor):
    """A scale tensor that stores twice what is written into it: a bug in where or how the
    tile loop stores a scale, made on purpose."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(args[0], cls):
            args = (args[0], args[1] * 2)
        elif func is torch.Tensor.__setitem__ and isinstance(args[0], cls):
            args = (args[0], args[1], args[2] * 2)
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("shape", [(256, 384), (128, 2048), (384, 1152)])
def test_fp8_block_measured_error_is_of_the_stored_scale(shape, band):
    """The tile loop's error is that of q and the scale as stored: a scale stored wrong on
    purpose (``_MisStoredScale``, eager loop) shows in the measured error at least as in an
    independent dequantize of the stored tensors (K chunked in columns with a remainder where
    the tiles are small)."""
    w = random_weight(shape)
    n, k = shape
    rows, cols = common.block_tile(n, k, fp8_block.BLOCK)
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scale = torch.empty((n // 128, k // 128)).as_subclass(_MisStoredScale)
    ref, work, bits = common.fp8_band_buffers(rows * cols)
    half = bits.view(torch.int16)[: rows * cols]
    amax = scratch("amax", rows * cols // (128 * 128), torch.float32)
    sig, noise = fp8_block._fp8_block_tiles.fn(
        w, q, q.view(torch.int8), scale, ref, ref.view(torch.int32), work, work.view(torch.int32), half,
        half.view(torch.float16), amax, amax.view(torch.int32), rows, cols, 128, fp8_block.AMAX_FLOOR,
        fp8_block.FP8_E4M3_MAX)
    scale = scale.as_subclass(torch.Tensor)
    _, want_scale = fp8_block.fp8_block_quant_ref(w.float())
    assert torch.equal(scale, want_scale * 2)  # the bug took
    w64 = w.double()
    diff = fp8_block.dequantize_blocks(q, scale).double() - w64
    # at least the true error of the stored tensors (inf: the stored scales do not add up to
    # the computed ones, the loop's last check)
    assert noise >= float((diff * diff).sum()) * (1 - 1e-4)
    assert noise / sig > 0.1  # the true error of a scale twice too large


def test_fp8_block_scale_stored_over_another_tile_fails_the_measured_error():
    """The review's mutation: the tile loop stores each tile's scales at column 0 (a slice that
    forgets c0), so later tiles overwrite earlier ones. Each tile's own error cannot see it;
    the stored scales no longer add up to the computed ones, and the measured error is inf."""
    import inspect
    import textwrap

    src = textwrap.dedent(inspect.getsource(fp8_block._fp8_block_tiles.fn))
    wrong = src.replace("c0 // block:(c0 + c) // block]", "0:c // block]").replace("@scripted\n", "")
    assert wrong != src
    space = dict(vars(fp8_block))
    exec(compile(wrong, "<mutated>", "exec"), space)
    for tiles in (space["_fp8_block_tiles"], fp8_block._fp8_block_tiles.fn):
        w = random_weight((128, 2048))
        q = torch.empty((128, 2048), dtype=torch.float8_e4m3fn)
        scale = torch.empty((1, 16))
        rows, cols = 128, 512  # four tiles across K
        ref, work, bits = common.fp8_band_buffers(rows * cols)
        half = bits.view(torch.int16)[: rows * cols]
        amax = scratch("amax", rows * cols // (128 * 128), torch.float32)
        sig, noise = tiles(w, q, q.view(torch.int8), scale, ref, ref.view(torch.int32), work, work.view(torch.int32),
                           half, half.view(torch.float16), amax, amax.view(torch.int32), rows, cols, 128,
                           fp8_block.AMAX_FLOOR, fp8_block.FP8_E4M3_MAX)
        if tiles is fp8_block._fp8_block_tiles.fn:  # the real loop: measured as stored
            assert noise / sig < 0.01
        else:
            assert noise == float("inf")
