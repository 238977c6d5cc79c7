"""FP4 quantize / dequantize kernels: bit-exact against their torch references, and the
references against the rounding rules they state (nearest e2m1, ties to even, the sign kept)."""
import pytest
import torch
from moeutil import assert_same_tensors

from moetool.errors import MoetoolError
from moetool.kernels import fp4_quant as k4

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
QUANT = {"nvfp4": (k4.nvfp4_quant, k4.nvfp4_quant_ref), "mxfp4": (k4.mxfp4_quant, k4.mxfp4_quant_ref)}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.cpu()


def _weights(shape, dtype, device, seed=0):
    """Normal data with a wide dynamic range per row, an all-zero group and an exact zero row."""
    g = torch.Generator().manual_seed(seed)
    N, K = shape
    w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g) * 3)
    w[0, :32] = 0.0
    if N > 2:
        w[2] = 0.0
    return w.to(dtype).to(device)


def _tie_values() -> torch.Tensor:
    """Every e2m1 value, every midpoint between neighbours and the floats next to them, in
    [-6, 6] (and -0.0)."""
    vals = torch.tensor(k4.E2M1_VALUES)
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, torch.nextafter(mids, vals[1:]), torch.nextafter(mids, vals[:-1]),
                   torch.rand(200) * 6])
    return torch.cat([x, -x])


def test_e2m1_encode_is_nearest_ties_to_even_and_keeps_the_sign():
    y = torch.cat([_tie_values(), torch.arange(0, 0x40C00001, 4099, dtype=torch.int32).view(torch.float32)])
    codes = k4.e2m1_encode_ref(y.clone())
    values = k4.e2m1_decode_ref(codes)
    grid = torch.tensor(k4.E2M1_VALUES)
    dist = (y.abs()[:, None] - grid).abs()
    nearest = dist.min(dim=1).values
    assert torch.equal((values.abs() - y.abs()).abs(), nearest)
    ties = (dist == nearest[:, None]).sum(dim=1) > 1
    assert ties.sum() >= 14 and ((codes[ties] & 1) == 0).all()  # the even code: mantissa bit 0
    assert torch.equal(torch.signbit(values), torch.signbit(y))  # -0.0 and small negatives: code 8
    assert k4.e2m1_encode_ref(torch.tensor([-0.1, 0.1, -6.0, 6.0])).tolist() == [8, 0, 15, 7]


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.arange(16, dtype=torch.uint8)[None, :]
    packed = k4.pack_fp4_ref(codes)
    assert packed.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    assert torch.equal(k4.unpack_fp4_ref(packed), codes)


def test_e8m0_decodes_every_code_exactly():
    e = torch.arange(255)
    assert torch.equal(k4.e8m0_to_float_ref(e).double(), torch.pow(2.0, e.double() - 127))


@pytest.mark.parametrize("amax, code", [(0.0, 0), (4.0, 127), (6.99, 127), (7.0, 128), (3.5, 127), (3.49, 126),
                                        (1.5e-45, 0), (3.0e38, 253)])
def test_mxfp4_exponent_rounds_up_from_a_mantissa_of_1_75(amax, code):
    """amax / 2^(e - 127) lies in [3.5, 7): 7 = 1.75 * 4 takes the next exponent."""
    assert k4.mxfp4_exponent_ref(torch.tensor([amax])).item() == code


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 32), (64, 256), (33, 160), (130, 96)])
def test_quant_kernel_is_bit_exact(name, shape, dtype, device):
    kernel, ref = QUANT[name]
    if shape[1] % (k4.NVFP4_GROUP if name == "nvfp4" else k4.MXFP4_GROUP):
        pytest.skip("K is not whole groups")
    w = _weights(shape, dtype, device, seed=shape[0])
    got = kernel(w)
    assert_same_tensors(got, ref(w.cpu()))
    assert torch.equal(k4.fp4_dequant(got).cpu(), k4.fp4_dequant_ref({s: t.cpu() for s, t in got.items()}))


@pytest.mark.parametrize("name", QUANT)
def test_ties_round_to_even_in_the_kernel(name, device):
    """Every tie and its neighbours in groups whose amax lies in [4, 6]: MXFP4's scale is then
    2^0, so its codes are e2m1 of the values themselves; NVFP4 against its reference."""
    kernel, ref = QUANT[name]
    x = _tie_values()
    group = 32
    x = torch.cat([x, torch.zeros(-x.numel() % (group - 1))]).view(-1, group - 1)
    w = torch.cat([torch.full((x.shape[0], 1), 4.0), x], dim=1)  # [R, 32], every group's amax 4
    got = kernel(w.to(device))
    assert_same_tensors(got, ref(w))
    if name == "mxfp4":
        assert (got["weight_scale"] == 127).all()
        assert torch.equal(k4.unpack_fp4_ref(got["weight_packed"].cpu()), k4.e2m1_encode_ref(w))


@pytest.mark.parametrize("name", QUANT)
def test_all_zero_weight_gives_finite_scales_and_zero_codes(name, device):
    kernel, ref = QUANT[name]
    w = torch.zeros(8, 64, device=device)
    got = kernel(w)
    assert_same_tensors(got, ref(w.cpu()))
    assert (got["weight_packed"] == 0).all()
    assert (k4.fp4_dequant(got) == 0).all()
    if name == "nvfp4":
        assert torch.isfinite(got["weight_global_scale"]).all()
        assert (got["weight_scale"].float() == k4.E4M3_MIN).all()


def test_nvfp4_global_scale_is_the_divisor(device):
    w = _weights((16, 64), torch.float32, device)
    got = k4.nvfp4_quant(w)
    assert got["weight_global_scale"].item() == pytest.approx(2688.0 / w.abs().max().item(), rel=1e-6)
    # the largest group's scale is 448 in the global scale's units: s / gs = amax / 6
    assert got["weight_scale"].float().max().item() == 448.0
    deq = k4.fp4_dequant(got)
    assert ((deq - w).norm() / w.norm()).item() < 0.12


@pytest.mark.parametrize("name", QUANT)
def test_wrapper_checks(name, device):
    kernel, _ = QUANT[name]
    with pytest.raises(MoetoolError, match="K divisible by"):
        kernel(torch.zeros(4, 40, device=device))
    with pytest.raises(MoetoolError, match="contiguous"):
        kernel(torch.zeros(64, 64, device=device).t())
    with pytest.raises(MoetoolError, match="fp32/fp16/bf16"):
        kernel(torch.zeros(4, 64, dtype=torch.int32, device=device))


@pytest.mark.parametrize("name", QUANT)
def test_dequant_refuses_a_scale_of_another_dtype(name, device):
    """The scales' bytes are read as e4m3 (nvfp4) or e8m0 (mxfp4): a float32 mxfp4 scale was
    viewed as bytes under its own stride, garbage up to 2.6e38 without an error."""
    kernel, _ = QUANT[name]
    got = kernel(_weights((16, 64), torch.float32, device))
    for wrong in (torch.float32, torch.bfloat16, torch.int16):
        bad = dict(got, weight_scale=got["weight_scale"].to(torch.float32).to(wrong))
        with pytest.raises(MoetoolError, match=rf"weight_scale {wrong} \[16, "):
            k4.fp4_dequant(bad)
