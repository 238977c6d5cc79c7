"""What every format promises: errors on bad input, accuracy, exact row concatenation."""
from __future__ import annotations

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.formats import FORMATS, TOLERANCES, FormatName, get_format

ALL = [
    pytest.param(("dense", {}), id="dense"),
    pytest.param(("fp8-block", {}), id="fp8-block"),
    pytest.param(("fp8-channel", {}), id="fp8-channel"),
    pytest.param(("int4-group", {}), id="int4-sym-g128"),
    pytest.param(("int4-group", {"group_size": 32, "symmetric": False}), id="int4-asym-g32"),
]


def make(spec):
    name, params = spec
    return get_format(name, **params)


def random_weight(shape, seed=0, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.02).to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes, so fp8 compares bit for bit (and -0 differs from 0)."""
    return t.contiguous().view(torch.uint8)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for suffix in a:
        assert a[suffix].dtype == b[suffix].dtype, suffix
        assert a[suffix].shape == b[suffix].shape, suffix
        assert torch.equal(raw(a[suffix]), raw(b[suffix])), suffix


def test_registry_holds_every_format_name():
    assert set(FORMATS) == {name.value for name in FormatName} == set(TOLERANCES)
    assert get_format(FormatName.FP8_BLOCK).name == "fp8-block"


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("shape", [(512, 384), (384, 1024)])
def test_round_trip_error_is_within_the_format_tolerance(spec, shape):
    fmt = make(spec)
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
    w_hat = fmt.dequantize(fmt.quantize(w, torch.bfloat16))
    assert w_hat.dtype == torch.float32 and w_hat.shape == shape
    rel_err = ((w_hat - w).norm() / w.norm()).item()
    sqnr_db = -20 * torch.log10(torch.tensor(rel_err)).item()
    assert rel_err < TOLERANCES[fmt.name]["rel_err"]
    assert sqnr_db > TOLERANCES[fmt.name]["sqnr_db"]


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_input_is_refused(spec, bad):
    w = random_weight((16, 256), dtype=torch.float32)
    w[3, 5] = bad
    with pytest.raises(MoetoolError, match=r"^contains NaN/Inf \(1 of 4096 values\)$"):
        make(spec).quantize(w, torch.bfloat16)


@pytest.mark.parametrize("spec", ALL)
def test_quantize_refuses_a_non_matrix(spec):
    with pytest.raises(MoetoolError, match="2-D"):
        make(spec).quantize(torch.zeros(4, 4, 4), torch.bfloat16)


@pytest.mark.parametrize("spec", ALL)
def test_logical_shape_is_n_by_k(spec):
    fmt = make(spec)
    assert fmt.logical_shape(fmt.quantize(random_weight((136, 256)), torch.bfloat16)) == (136, 256)


@pytest.mark.parametrize("spec", ALL)
def test_split_then_cat_gives_back_the_same_bytes(spec):
    fmt = make(spec)
    t = fmt.quantize(random_weight((456, 256)), torch.bfloat16)
    sizes = [256, 128, 72]  # whole fp8 blocks and int4 zero-point words except at the end
    parts = fmt.split_rows(t, sizes)
    assert [fmt.logical_shape(part) for part in parts] == [(s, 256) for s in sizes]
    assert_same_tensors(fmt.cat_rows(parts), t)


@pytest.mark.parametrize("spec", ALL)
def test_cat_then_split_gives_back_the_parts(spec):
    """w13 = gate rows then up rows, quantized separately, split again."""
    fmt = make(spec)
    gate = fmt.quantize(random_weight((128, 256), seed=1), torch.bfloat16)
    up = fmt.quantize(random_weight((104, 256), seed=2), torch.bfloat16)
    w13 = fmt.cat_rows([gate, up])
    assert fmt.logical_shape(w13) == (232, 256)
    assert torch.equal(fmt.dequantize(w13), torch.cat([fmt.dequantize(gate), fmt.dequantize(up)]))
    got_gate, got_up = fmt.split_rows(w13, [128, 104])
    assert_same_tensors(got_gate, gate)
    assert_same_tensors(got_up, up)


@pytest.mark.parametrize("spec", ALL)
def test_split_sizes_must_add_up(spec):
    fmt = make(spec)
    t = fmt.quantize(random_weight((256, 256)), torch.bfloat16)
    with pytest.raises(MoetoolError, match=r"cannot split N=256 rows into parts of \[128, 64\]"):
        fmt.split_rows(t, [128, 64])


@pytest.mark.parametrize("spec", ALL)
def test_each_missing_partner_is_named(spec):
    fmt = make(spec)
    t = fmt.quantize(random_weight((16, 256)), torch.bfloat16)
    for suffix in fmt.suffixes:
        incomplete = {k: v for k, v in t.items() if k != suffix}
        with pytest.raises(MoetoolError, match=f"^is missing {suffix} \\({fmt.name} stores"):
            fmt.dequantize(incomplete)


@pytest.mark.parametrize("spec", ALL)
def test_a_tensor_of_another_format_is_refused(spec):
    fmt = make(spec)
    t = fmt.quantize(random_weight((16, 256)), torch.bfloat16)
    t["weight_g_idx"] = torch.zeros(256, dtype=torch.int32)
    with pytest.raises(MoetoolError, match="unexpected weight_g_idx"):
        fmt.dequantize(t)


def test_missing_block_scale_message_reads_well_after_a_name():
    fmt = get_format("fp8-block")
    t = fmt.quantize(random_weight((16, 256)), torch.bfloat16)
    del t["weight_scale_inv"]
    with pytest.raises(MoetoolError) as err:
        fmt.dequantize(t)
    assert f"model.layers.3.mlp.experts.7.down_proj {err.value}" == (
        "model.layers.3.mlp.experts.7.down_proj is missing weight_scale_inv "
        "(fp8-block stores weight, weight_scale_inv)"
    )


@pytest.mark.parametrize(
    ("name", "suffix", "wrong", "message"),
    [
        ("fp8-block", "weight", torch.zeros(16, 256, dtype=torch.bfloat16), "weight has dtype"),
        ("fp8-channel", "weight", torch.zeros(16, 256, dtype=torch.int8), "weight has dtype"),
        ("fp8-channel", "weight_scale", torch.ones(16), r"weight_scale has shape \[16\]"),
        ("fp8-block", "weight_scale_inv", torch.ones(1, 2, dtype=torch.bfloat16), "dtype"),
        ("int4-group", "weight_scale", torch.ones(16, 2, dtype=torch.int32), "float dtype"),
        ("int4-group", "weight_packed", torch.ones(16, 32, dtype=torch.int64), "dtype"),
        ("dense", "weight", torch.ones(16, dtype=torch.bfloat16), "2-D"),
    ],
)
def test_partner_of_the_wrong_shape_or_dtype_is_refused(name, suffix, wrong, message):
    fmt = get_format(name)
    t = fmt.quantize(random_weight((16, 256)), torch.bfloat16)
    t[suffix] = wrong
    with pytest.raises(MoetoolError, match=message):
        fmt.dequantize(t)


def test_dense_stores_the_original_dtype():
    w = random_weight((8, 8), dtype=torch.float32)
    t = get_format("dense").quantize(w, torch.bfloat16)
    assert t["weight"].dtype == torch.bfloat16
    assert torch.equal(t["weight"], w.to(torch.bfloat16))
    assert get_format("dense").quantization_config(["lm_head"]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_quantize_measured_keeps_the_weight(dtype):
    """Dense of a weight already in the target dtype is that weight; measuring its error must not
    overwrite it (dequantize returned the stored float32 tensor itself, which error_sums zeroed:
    float32 models requantized to dense came out with all-zero experts)."""
    w = torch.randn(8, 16).to(dtype)
    keep = w.clone()
    t, sig, noise = get_format("dense").quantize_measured(w, dtype)
    assert torch.equal(t["weight"], keep) and torch.equal(w, keep)
    assert noise == 0.0 and sig > 0
