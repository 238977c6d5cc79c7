"""int4 group quantize + pack kernel: bit-exact against its torch reference and against
``moetool.formats``' int4-group, plain and with the clip ratio search (``--int4-clip mse``)."""
import pytest
import torch
from moeutil import assert_same_tensors, wide_range_weights

from moetool.errors import MoetoolError
from moetool.kernels import int4_quant as k4

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
#: moetool.formats' MSE_SEARCH, as the format passes it (test_format_int4_group checks its value)
MSE = (1 / 16, 6, 2)


@pytest.mark.parametrize("scale_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape,group", [((1, 8), 8), ((16, 64), 32), ((37, 200), 64), ((24, 100), 32), ((9, 96), 96)])
def test_int4_quant_pack_bit_exact(shape, group, symmetric, scale_dtype, device):
    w = wide_range_weights(shape, torch.bfloat16, device)
    out = k4.int4_group_quant_pack(w, group, symmetric, scale_dtype)
    ref = k4.int4_group_quant_pack_ref(w.cpu(), group, symmetric, scale_dtype)
    assert_same_tensors(out, ref)
    N, K = shape
    assert out["weight_packed"].shape == (N, -(-K // 8))
    assert out["weight_scale"].shape == (N, -(-K // group))
    if not symmetric:
        assert out["weight_zero_point"].shape == (-(-N // 8), -(-K // group))


@pytest.mark.parametrize("scale_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape,group", [((1, 8), 8), ((16, 128), 128), ((37, 200), 64), ((24, 100), 24), ((9, 96), 96)])
def test_int4_mse_search_bit_exact(shape, group, symmetric, scale_dtype, device):
    """Partial last groups (K % g), groups of no power of two (24, 96: the kernel's block
    pads them with zero lanes, the reference with zeros), every scale dtype."""
    w = wide_range_weights(shape, torch.bfloat16, device)
    out = k4.int4_group_quant_pack(w, group, symmetric, scale_dtype, MSE)
    ref = k4.int4_group_quant_pack_ref(w.cpu(), group, symmetric, scale_dtype, MSE)
    assert_same_tensors(out, ref)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_mse_search_clips_and_lowers_the_error(symmetric, device):
    w = torch.randn(64, 512)
    plain = k4.int4_group_quant_pack(w.to(device), 128, symmetric, torch.float32)
    mse = k4.int4_group_quant_pack(w.to(device), 128, symmetric, torch.float32, MSE)
    err = {name: float((k4.int4_dequant_ref({k: v.cpu() for k, v in t.items()}, (64, 512), 128) - w).norm())
           for name, t in (("plain", plain), ("mse", mse))}
    assert err["mse"] < 0.97 * err["plain"]
    smaller = (mse["weight_scale"] < plain["weight_scale"]).float().mean()
    assert smaller > 0.5  # most groups clip


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_mse_ties_keep_the_earlier_ratio(symmetric, device):
    """A zero group has error 0 at every ratio: ratio 1, the first, stays, so its scale is the
    plain one (the floored amax / 7.5 or / 15), not that of a later candidate."""
    w = torch.zeros(8, 32)
    w[:, 16:] = torch.randn(8, 16)
    plain = k4.int4_group_quant_pack(w.to(device), 16, symmetric, torch.float32)
    mse = k4.int4_group_quant_pack(w.to(device), 16, symmetric, torch.float32, MSE)
    assert_same_tensors(mse, k4.int4_group_quant_pack_ref(w, 16, symmetric, torch.float32, MSE))
    assert torch.equal(mse["weight_scale"][:, 0], plain["weight_scale"][:, 0])


def test_pairwise_sum_ref_adds_halves():
    x = torch.tensor([[2.0**30, 1.0, -(2.0**30), 1.0]])
    # float32: (2^30 - 2^30) + (1 + 1) = 2; adjacent pairs give 0, left to right 1
    assert k4.pairwise_sum_ref(x).item() == 2.0
    from moetool.formats.int4_group import pairwise_sum

    y = torch.randn(40, 96) ** 2  # 96: zeros pad it to 128 in the reference
    padded = torch.cat([y, torch.zeros(40, 32)], dim=1)
    assert torch.equal(pairwise_sum(y.clone()), k4.pairwise_sum_ref(padded))


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_round_half_even_ties(symmetric, device):
    """Rows whose scale is exactly 1 (fp32): w = j + 0.5 must round to even like torch.round."""
    ties = torch.tensor([-6.5, -5.5, -4.5, -3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5])
    # max |w| 7.5 -> s = 1 symmetric; max - min = 15 -> s = 1, z = round(7.5) - 8 = 0 asymmetric
    row = torch.cat([ties, torch.tensor([7.5, -7.5])])
    w = row.repeat(8, 1).contiguous()
    out = k4.int4_group_quant_pack(w.to(device), 16, symmetric, torch.float32)
    ref = k4.int4_group_quant_pack_ref(w, 16, symmetric, torch.float32)
    assert_same_tensors(out, ref)
    assert (out["weight_scale"].cpu() == 1).all()
    if not symmetric:
        # -mn/s = 7.5 -> round half even 8 -> z = 0 -> stored 8 in every nibble
        assert (out["weight_zero_point"].cpu() == int("88888888", 16) - 2**32).all()
    q = k4.unpack_int4_ref(out["weight_packed"].cpu(), 16) - 8
    expect = torch.round(row).clamp(-8, 7).to(torch.int32)  # 7.5 -> 8 -> 7, -7.5 -> -8
    assert torch.equal(q[0], expect)


@pytest.mark.parametrize("search", [None, MSE])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_zero_group_fp16_scale(symmetric, search, device):
    """fp16 scales are floored at 2^-24 (fp16's smallest subnormal), so an all-zero or ~1e-9 group
    gets a finite, non-zero scale and q = 0 instead of 0/0."""
    w = torch.randn(16, 64)
    w[:, :32] = 0.0
    w[:8, 32:] = 1e-9
    out = k4.int4_group_quant_pack(w.to(device), 32, symmetric, torch.float16, search)
    ref = k4.int4_group_quant_pack_ref(w, 32, symmetric, torch.float16, search)
    assert_same_tensors(out, ref)
    assert (out["weight_scale"][:, 0].cpu() == 2.0**-24).all()
    deq = k4.int4_dequant_ref({k: v.cpu() for k, v in out.items()}, (16, 64), 32)
    assert torch.isfinite(deq).all() and (deq[:, :32] == 0).all()


def test_int4_dequant_roundtrip(device):
    w = torch.randn(40, 128)
    for symmetric in (True, False):
        t = k4.int4_group_quant_pack(w.to(device), 32, symmetric, torch.float32)
        deq = k4.int4_dequant_ref({k: v.cpu() for k, v in t.items()}, (40, 128), 32)
        err = (deq - w).norm() / w.norm()
        assert err < 0.12, (symmetric, err)


def test_pack_unpack_ref_inverse():
    u = torch.randint(0, 16, (5, 21), dtype=torch.int32)
    assert torch.equal(k4.unpack_int4_ref(k4.pack_int4_ref(u), 21), u)


@pytest.mark.parametrize("search", [(0.0, 6, 2), (1 / 16, 0, 2), (1 / 16, 6, -1), (0.25, 6, 0)])
def test_bad_inputs_raise(search, device):
    with pytest.raises(MoetoolError, match="multiple of 8"):
        k4.int4_group_quant_pack(torch.randn(8, 32, device=device), 12)
    with pytest.raises(MoetoolError, match="mse search"):
        k4.int4_group_quant_pack(torch.randn(8, 32, device=device), 8, mse_search=search)


@pytest.mark.parametrize("clip", ["none", "mse"])
@pytest.mark.parametrize("scale_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("symmetric,group", [(True, 128), (False, 32), (True, 64)])
def test_int4_matches_formats_package(symmetric, group, scale_dtype, clip, device):
    """The kernel equals moetool.formats' int4-group quantize (whole groups: K % g == 0), and
    the format hands it the search it runs itself."""
    from moetool.formats import get_format

    fmt = get_format("int4-group", group_size=group, symmetric=symmetric, clip=clip)
    w = torch.randn(72, 256, dtype=torch.bfloat16)
    w[:, :group] = 0.0  # an all-zero group (fp16 scale floor)
    t = fmt.quantize(w, scale_dtype)
    ours = k4.int4_group_quant_pack(w.to(device), group, symmetric, scale_dtype, MSE if clip == "mse" else None)
    assert_same_tensors(ours, t)
    assert torch.equal(fmt.dequantize(t), k4.int4_dequant_ref(t, (72, 256), group))
    if device == "cuda":
        assert_same_tensors(fmt.quantize_cuda(w.to(device), scale_dtype), t)
