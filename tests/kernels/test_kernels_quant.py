"""fp8 quantize kernels: bit-exact against their torch references (compared as bytes). int4:
test_kernels_int4_quant.py."""
import pytest
import torch
from moeutil import wide_range_weights
from moetool.kernels import quant as kq

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (200, 72), (33, 257)])
def test_fp8_block_quant_bit_exact(shape, dtype, device):
    w = wide_range_weights(shape, dtype, device)
    q, s = kq.fp8_block_quant(w)
    q_ref, s_ref = kq.fp8_block_quant_ref(w.cpu())
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(_bytes(q).cpu(), _bytes(q_ref))


def test_fp8_block_quant_zero_block_is_finite(device):
    w = torch.zeros(130, 130, device=device)
    q, s = kq.fp8_block_quant(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (q.float() == 0).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape,group", [((1, 128), 128), ((33, 200), 128), ((7, 96), 32), ((0, 64), 128)])
def test_fp8_act_quant_bit_exact(shape, group, dtype, device):
    x = wide_range_weights(shape, dtype, device)
    q, s = kq.fp8_act_quant(x, group)
    q_ref, s_ref = kq.fp8_act_quant_ref(x.cpu(), group)
    assert s.shape == (shape[0], -(-shape[1] // group))
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(_bytes(q).cpu(), _bytes(q_ref))


def test_fp8_rounding_ties_and_subnormals(device):
    """Every e4m3 value, every midpoint between neighbours and the floats next to them: the
    block scale is forced to 1 (amax = 448), so q = e4m3(x) exercises the cast itself."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[~vals.isnan()].sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    x = torch.cat([vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), torch.tensor([-0.0])])
    x = torch.cat([x, torch.zeros(-x.numel() % 128)]).view(-1, 128)
    x[:, 0] = 448.0  # every row's amax is 448 -> s = 1
    q, s = kq.fp8_act_quant(x.to(device))
    assert torch.equal(s.cpu(), torch.ones_like(s.cpu()))
    assert torch.equal(_bytes(q).cpu(), _bytes(x.to(torch.float8_e4m3fn)))
    q_ref, _ = kq.fp8_act_quant_ref(x)
    assert torch.equal(_bytes(q).cpu(), _bytes(q_ref))


def test_fp8_soft_and_hardware_paths_agree_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the hardware e4m3 cast is wrong under the interpreter)")
    w = torch.randn(300, 520, device="cuda", dtype=torch.bfloat16)
    q_hw, s_hw = kq.fp8_block_quant(w, soft_fp8=False)
    q_sw, s_sw = kq.fp8_block_quant(w, soft_fp8=True)
    assert torch.equal(s_hw, s_sw) and torch.equal(_bytes(q_hw), _bytes(q_sw))


def test_bad_inputs_raise(device):
    from moetool.errors import MoetoolError

    with pytest.raises(MoetoolError):
        kq.fp8_block_quant(torch.randn(4, 4, 4, device=device))
    with pytest.raises(MoetoolError):
        kq.fp8_act_quant(torch.randn(8, 8, device=device).t())
    with pytest.raises(MoetoolError):
        kq.fp8_block_quant(torch.randint(0, 3, (4, 4), device=device))


def _get_format(name, **params):
    formats = pytest.importorskip("moetool.formats")
    if not hasattr(formats, "get_format"):
        pytest.skip("moetool.formats.get_format not available yet")
    return formats.get_format(name, **params)


@pytest.mark.parametrize("shape", [(136, 200), (256, 128), (1, 300)])
def test_fp8_block_matches_formats_package(shape, device):
    """One source of truth: the kernel equals moetool.formats' fp8-block quantize."""
    fmt = _get_format("fp8-block")
    w = torch.randn(*shape, dtype=torch.bfloat16)
    t = fmt.quantize(w, torch.bfloat16)
    q, s = kq.fp8_block_quant(w.to(device))
    assert torch.equal(_bytes(q).cpu(), _bytes(t["weight"]))
    assert torch.equal(s.cpu(), t["weight_scale_inv"])
    assert torch.equal(fmt.dequantize({"weight": q.cpu(), "weight_scale_inv": s.cpu()}),
                       kq.fp8_dequant_block_ref(q.cpu(), s.cpu()))
