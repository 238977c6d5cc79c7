"""fp8-channel: bit-exact against a row-by-row transcription of the formula."""
from __future__ import annotations

import pytest
import torch

from moetool.formats import Fp8Channel, fp8_channel_quant_ref

SHAPES = [(300, 200), (1, 7), (128, 128), (129, 257)]


def naive_channel_quant(w: torch.Tensor, orig_dtype: torch.dtype):
    w32 = w.float()
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(w.shape[0], 1, dtype=orig_dtype)
    for row in range(w.shape[0]):
        scale = (torch.clamp(w32[row].abs().max(), min=1e-12) / 448.0).to(orig_dtype)
        s[row, 0] = scale
        q[row] = (w32[row] / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def random_weight(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("orig_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_is_bit_exact_to_the_row_formula(shape, orig_dtype):
    w = random_weight(shape, torch.float32, seed=sum(shape))
    q_ref, s_ref = naive_channel_quant(w, orig_dtype)
    t = Fp8Channel().quantize(w, orig_dtype)
    assert set(t) == {"weight", "weight_scale"}
    assert t["weight_scale"].dtype == orig_dtype and t["weight_scale"].shape == (shape[0], 1)
    assert torch.equal(t["weight"].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(t["weight_scale"], s_ref)
    q, s = fp8_channel_quant_ref(w, orig_dtype)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_scale_is_rounded_to_the_original_dtype_before_dividing():
    # a row whose exact scale is not a bf16 number: dividing by the exact scale would differ
    w = torch.tensor([[1.0, 0.3, -0.77]], dtype=torch.float32) * 3.3
    exact = w.abs().max() / 448.0
    rounded = exact.to(torch.bfloat16).float()
    assert exact != rounded
    t = Fp8Channel().quantize(w, torch.bfloat16)
    assert t["weight_scale"].float() == rounded
    expected = (w / rounded).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(t["weight"].view(torch.uint8), expected.view(torch.uint8))


def test_dequantize_is_codes_times_row_scale():
    w = random_weight((129, 257))
    t = Fp8Channel().quantize(w, torch.bfloat16)
    expected = t["weight"].float() * t["weight_scale"].float()
    assert torch.equal(Fp8Channel().dequantize(t), expected)


@pytest.mark.parametrize("orig_dtype", [torch.bfloat16, torch.float16])
def test_all_zero_and_tiny_rows_get_finite_nonzero_scales(orig_dtype):
    w = random_weight((4, 64), torch.float32)
    w[1] = 0
    w[2] = 1e-9  # its scale would underflow to zero in fp16 without the floor
    t = Fp8Channel().quantize(w, orig_dtype)
    scale = t["weight_scale"].float()
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (t["weight"][1].float() == 0).all()
    d = Fp8Channel().dequantize(t)
    assert torch.isfinite(d).all() and (d[1] == 0).all()


def test_config_is_compressed_tensors_fp8_dynamic():
    config = Fp8Channel().quantization_config(["lm_head"])
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "float-quantized"
    assert config["quantization_status"] == "compressed"
    assert config["ignore"] == ["lm_head"]
    group = config["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False
    }
    assert group["input_activations"] == {
        "num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True
    }


def test_static_activation_scales_are_refused():
    """A W8A8 checkpoint with static per-tensor activation scales (``input_scale``): moetool
    serves dynamic per-token activations and does not keep those scales, so it is refused
    rather than written with a config still declaring them."""
    from moetool.errors import MoetoolError
    from moetool.formats import read_format_params

    config = Fp8Channel().quantization_config([])
    assert read_format_params(config) == ("fp8-channel", {})
    config["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", dynamic=False)
    with pytest.raises(MoetoolError, match=r"^unsupported compressed-tensors fp8 with static activation scales"):
        read_format_params(config)
