"""Per-token fp8 activation quantization (group = TOKEN_GROUP, FP8_DYNAMIC): kernel against
reference, compared as bytes.

Letters: T tokens, H hidden."""
import pytest
import torch
from moetool.kernels import quant as kq
from moetool.kernels.common import TOKEN_GROUP

from moetool.errors import MoetoolError

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _rows(T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different magnitudes, an all-zero row and a row that is zero but for one value."""
    x = torch.randn(T, H) * torch.exp(torch.randn(T, 1) * 3)
    if T > 2:
        x[1] = 0.0
        x[2] = 0.0
        x[2, H // 2] = -3.5
    return x.to(dtype)


# H: not a power of two, below 16, one pass (<= 4096 columns) and several chunks (7168, 4097)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T,H", [(5, 7168), (33, 200), (3, 7), (1, 1), (0, 64), (4, 4097), (20, 1000)])
def test_token_quant_bit_exact(T, H, dtype, device):
    x = _rows(T, H, dtype)
    q, s = kq.fp8_act_quant(x.to(device), TOKEN_GROUP)
    q_ref, s_ref = kq.fp8_act_quant_ref(x, TOKEN_GROUP)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == (T, H) and s.shape == (T, 1) == s_ref.shape
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(_bytes(q).cpu(), _bytes(q_ref))


def test_token_quant_formula(device):
    """s = amax / 448 per row (an all-zero row gets the clamped, finite scale), the row's amax
    maps to +-448, and the dequantized row is within half an e4m3 step of x."""
    x = _rows(9, 300, torch.float32)
    q, s = kq.fp8_act_quant_ref(x, TOKEN_GROUP)
    amax = x.abs().amax(1, keepdim=True)
    assert torch.equal(s, amax.clamp(min=1e-12) / 448.0)
    assert s[1].item() == pytest.approx(1e-12 / 448) and (q[1].float() == 0).all()
    assert (q.float().abs().amax(1)[amax[:, 0] > 0] == 448).all()
    deq = kq.fp8_dequant_act_ref(q, s, TOKEN_GROUP)
    assert deq.shape == x.shape
    assert ((deq - x).abs() <= x.abs() / 16 + s * 2.0**-9 / 2 + 1e-30).all()  # 3 mantissa bits, subnormals
    # the whole row is one group: the same as a group as wide as the row
    q_g, s_g = kq.fp8_act_quant_ref(x, 512)
    assert torch.equal(s_g, s) and torch.equal(_bytes(q_g), _bytes(q))


def test_token_quant_strided_rows(device):
    """Rows viewed inside a wider buffer (a received all2all row) quantize as the contiguous copy."""
    T, H = 11, 300
    wide = torch.randn(T, H + 40, dtype=torch.bfloat16)
    x = wide[:, 24:24 + H]
    assert not x.is_contiguous()
    q, s = kq.fp8_act_quant(wide.to(device)[:, 24:24 + H], TOKEN_GROUP)
    q_ref, s_ref = kq.fp8_act_quant_ref(x.contiguous(), TOKEN_GROUP)
    assert torch.equal(s.cpu(), s_ref) and torch.equal(_bytes(q).cpu(), _bytes(q_ref))
    # the 1x128 groups take strided rows as well
    q, s = kq.fp8_act_quant(wide.to(device)[:, 24:24 + H], 128)
    q_ref, s_ref = kq.fp8_act_quant_ref(x.contiguous(), 128)
    assert torch.equal(s.cpu(), s_ref) and torch.equal(_bytes(q).cpu(), _bytes(q_ref))


def test_token_quant_rounding_ties_and_subnormals(device):
    """Every e4m3 value, every midpoint and its neighbours, with the row scale forced to 1
    (amax = 448): q = e4m3(x) exercises the cast itself on the per-token path."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[~vals.isnan()].sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    x = torch.cat([vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down), torch.tensor([-0.0])])
    x = torch.cat([x, torch.zeros(-x.numel() % 300)]).view(-1, 300)  # rows of 300: no power of two
    x[:, 0] = 448.0
    q, s = kq.fp8_act_quant(x.to(device), TOKEN_GROUP)
    assert torch.equal(s.cpu(), torch.ones_like(s.cpu()))
    assert torch.equal(_bytes(q).cpu(), _bytes(x.to(torch.float8_e4m3fn)))


def test_token_quant_soft_and_hardware_paths_agree_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the hardware e4m3 cast is wrong under the interpreter)")
    x = torch.randn(300, 7168, device="cuda", dtype=torch.bfloat16)
    q_hw, s_hw = kq.fp8_act_quant(x, TOKEN_GROUP, soft_fp8=False)
    q_sw, s_sw = kq.fp8_act_quant(x, TOKEN_GROUP, soft_fp8=True)
    assert torch.equal(s_hw, s_sw) and torch.equal(_bytes(q_hw), _bytes(q_sw))
    q_ref, s_ref = kq.fp8_act_quant_ref(x.cpu(), TOKEN_GROUP)
    assert torch.equal(s_hw.cpu(), s_ref) and torch.equal(_bytes(q_hw).cpu(), _bytes(q_ref))


def test_token_quant_bad_inputs(device):
    with pytest.raises(MoetoolError, match="contiguous rows"):
        kq.fp8_act_quant(torch.randn(8, 8, device=device).t(), TOKEN_GROUP)
    with pytest.raises(MoetoolError, match="fp32/fp16/bf16"):
        kq.fp8_act_quant(torch.randn(8, 8, device=device).to(torch.float8_e4m3fn), TOKEN_GROUP)
    with pytest.raises(MoetoolError, match="group size"):
        kq.fp8_act_quant(torch.randn(8, 8, device=device), 24)
