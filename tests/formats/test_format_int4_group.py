"""int4-group: bit layout, packing round trips and the exact quantization formula."""
from __future__ import annotations

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.formats import Int4Group, int4_group_quant_ref, pack_int4, unpack_int4

SHAPES_AND_GROUPS = [
    ((300, 200), 8),
    ((1, 8), 8),
    ((128, 128), 64),
    ((129, 256), 64),
    ((7, 384), 128),
]


def random_weight(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.02).to(dtype)


def naive_group_quant(w: torch.Tensor, g: int, symmetric: bool, orig_dtype: torch.dtype):
    """One group of columns at a time, exactly as the format's docstring words it."""
    w32 = w.float()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    s = torch.empty(n, k // g, dtype=orig_dtype)
    z = torch.zeros(n, k // g, dtype=torch.int8)
    for j in range(k // g):
        block = w32[:, j * g : (j + 1) * g]
        if symmetric:
            scale = (block.abs().amax(dim=1).clamp(min=1e-12) / 7).to(orig_dtype).float()
            codes = torch.round(block / scale[:, None]).clamp(-8, 7)
        else:
            mn = torch.minimum(block.amin(dim=1), torch.zeros(n))
            mx = torch.maximum(block.amax(dim=1), torch.zeros(n))
            scale = ((mx - mn).clamp(min=1e-12) / 15).to(orig_dtype).float()
            zero = (torch.round(-mn / scale) - 8).clamp(-8, 7)
            codes = (torch.round(block / scale[:, None]) + zero[:, None]).clamp(-8, 7)
            z[:, j] = zero.to(torch.int8)
        q[:, j * g : (j + 1) * g] = codes.to(torch.int8)
        s[:, j] = scale.to(orig_dtype)
    return q, s, z


def test_bit_layout_of_a_hand_made_row():
    q = torch.arange(-8, 8, dtype=torch.int8)[None, :]  # codes 0, 1, ..., 15
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 0x76543210
    assert packed[0, 1].item() == 0xFEDCBA98 - 2**32  # code 15 in the top nibble: sign bit set
    assert torch.equal(unpack_int4(packed, 16), q)


def test_padding_nibbles_are_zero_and_cropped_on_unpack():
    q = torch.tensor([[7, -8, 0, 1, 2, 3, 4, 5, -1, 6]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (1, 2)
    assert packed[0, 1].item() == (-1 + 8) | ((6 + 8) << 4)
    assert torch.equal(unpack_int4(packed, 10), q)


def test_packing_along_n_puts_eight_rows_in_a_word():
    z = torch.arange(-8, 2, dtype=torch.int8)[:, None].repeat(1, 3)  # [10, 3]
    packed = pack_int4(z, packed_dim=0)
    assert packed.shape == (2, 3)
    assert packed[0, 0].item() == 0x76543210
    assert packed[1, 2].item() == 0x98
    assert torch.equal(unpack_int4(packed, 10, packed_dim=0), z)


@pytest.mark.parametrize("shape", [(3, 1), (5, 7), (4, 8), (2, 9), (33, 100)])
def test_random_pack_round_trip(shape):
    g = torch.Generator().manual_seed(shape[1])
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q), shape[1]), q)
    assert torch.equal(unpack_int4(pack_int4(q, packed_dim=0), shape[0], packed_dim=0), q)


def test_pack_rejects_values_outside_int4():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8]], dtype=torch.int8))


@pytest.mark.parametrize(("shape", "group_size"), SHAPES_AND_GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_is_bit_exact_to_the_group_formula(shape, group_size, symmetric):
    w = random_weight(shape, torch.bfloat16, seed=sum(shape))
    q_ref, s_ref, z_ref = naive_group_quant(w, group_size, symmetric, torch.bfloat16)
    fmt = Int4Group(group_size=group_size, symmetric=symmetric)
    t = fmt.quantize(w, torch.bfloat16)
    assert set(t) == set(fmt.suffixes)
    assert torch.equal(t["weight_packed"], pack_int4(q_ref))
    assert torch.equal(t["weight_scale"], s_ref)
    assert t["weight_shape"].dtype == torch.int32 and t["weight_shape"].tolist() == list(shape)
    if symmetric:
        assert "weight_zero_point" not in t
    else:
        assert torch.equal(t["weight_zero_point"], pack_int4(z_ref, packed_dim=0))
    q, s, z = int4_group_quant_ref(w, group_size, symmetric, torch.bfloat16)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert (z is None) == symmetric


@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_is_codes_minus_zero_times_scale(symmetric):
    w = random_weight((129, 256), torch.float32)
    fmt = Int4Group(group_size=64, symmetric=symmetric)
    t = fmt.quantize(w, torch.bfloat16)
    q, s, z = naive_group_quant(w, 64, symmetric, torch.bfloat16)
    expected = (q.float() - z.float().repeat_interleave(64, 1)) * s.float().repeat_interleave(64, 1)
    assert torch.equal(fmt.dequantize(t), expected)


def test_symmetric_codes_stay_in_minus_7_to_7():
    q, _, _ = int4_group_quant_ref(random_weight((64, 256)), 128, True, torch.bfloat16)
    assert q.min() >= -7 and q.max() == 7


def test_asymmetric_keeps_zero_exact_and_uses_all_16_levels():
    w = random_weight((64, 256), torch.float32).abs() + 0.01  # all positive: min is clamped to 0
    fmt = Int4Group(group_size=128, symmetric=False)
    q, _, z = int4_group_quant_ref(w, 128, False, torch.bfloat16)
    assert (z == -8).all()
    assert q.min() >= -8 and q.max() == 7
    w[:, :3] = 0
    assert (fmt.dequantize(fmt.quantize(w, torch.bfloat16))[:, :3] == 0).all()


def test_all_zero_group_is_finite():
    for symmetric in (True, False):
        w = random_weight((16, 256), torch.float32)
        w[:, 128:] = 0
        fmt = Int4Group(group_size=128, symmetric=symmetric)
        t = fmt.quantize(w, torch.float16)
        assert torch.isfinite(t["weight_scale"].float()).all() and (t["weight_scale"] > 0).all()
        d = fmt.dequantize(t)
        assert torch.isfinite(d).all() and (d[:, 128:] == 0).all()


def test_quantize_refuses_a_group_size_that_does_not_divide_k():
    with pytest.raises(MoetoolError, match="K=100 columns, which group size 128 does not divide"):
        Int4Group().quantize(random_weight((8, 100)), torch.bfloat16)


def test_dequantize_accepts_a_partial_last_group():
    """Checkpoints written elsewhere may have K % g != 0: the last scale covers the tail."""
    n, k, g = 3, 100, 64
    q = torch.randint(-8, 8, (n, k), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    z = torch.randint(-8, 8, (n, 2), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    s = torch.rand(n, 2, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    t = {
        "weight_packed": pack_int4(q),
        "weight_scale": s,
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        "weight_zero_point": pack_int4(z, packed_dim=0),
    }
    got = Int4Group(group_size=g, symmetric=False).dequantize(t)
    assert got[1, 70] == (q[1, 70] - z[1, 1]).float() * s[1, 1].float()
    assert got[2, 63] == (q[2, 63] - z[2, 0]).float() * s[2, 0].float()
    assert got.shape == (n, k)


def test_asymmetric_parts_must_fill_whole_zero_point_words():
    fmt = Int4Group(group_size=64, symmetric=False)
    a = fmt.quantize(random_weight((12, 128), seed=1), torch.bfloat16)
    b = fmt.quantize(random_weight((16, 128), seed=2), torch.bfloat16)
    joined = fmt.cat_rows([b, a])  # a partial word at the very end is fine
    assert joined["weight_shape"].tolist() == [28, 128]
    assert joined["weight_zero_point"].shape == (4, 2)
    with pytest.raises(MoetoolError, match="not a multiple of 8"):
        fmt.cat_rows([a, b])
    with pytest.raises(MoetoolError, match="not a multiple of 8"):
        fmt.split_rows(joined, [12, 16])


def test_parts_of_different_k_do_not_concatenate():
    fmt = Int4Group(group_size=8)
    a = fmt.quantize(random_weight((8, 96)), torch.bfloat16)
    b = fmt.quantize(random_weight((8, 88)), torch.bfloat16)
    with pytest.raises(MoetoolError, match="different K"):
        fmt.cat_rows([a, b])


def test_weight_shape_must_agree_with_the_packed_weight():
    fmt = Int4Group()
    t = fmt.quantize(random_weight((8, 256)), torch.bfloat16)
    t["weight_shape"] = torch.tensor([8, 512], dtype=torch.int32)
    expected = r"weight_packed has shape \[8, 32\], expected \[8, 64\]"
    with pytest.raises(MoetoolError, match=expected):
        fmt.dequantize(t)


@pytest.mark.parametrize("bad", [0, -8, 12.5, None, True])
def test_group_size_must_be_a_positive_integer(bad):
    with pytest.raises(MoetoolError, match="group_size"):
        Int4Group(group_size=bad)


def test_config_is_compressed_tensors_w4a16():
    config = Int4Group(group_size=32, symmetric=False).quantization_config(["lm_head"])
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "pack-quantized"
    assert config["ignore"] == ["lm_head"]
    group = config["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert group["weights"] == {
        "num_bits": 4,
        "type": "int",
        "strategy": "group",
        "group_size": 32,
        "symmetric": False,
        "dynamic": False,
    }
