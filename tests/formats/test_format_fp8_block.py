"""fp8-block: bit-exact against a block-by-block transcription of the formula."""
from __future__ import annotations

import math

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.formats import Fp8Block, fp8_block_quant_ref

SHAPES = [(300, 200), (1, 7), (128, 128), (129, 257), (256, 384)]


def naive_block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One 128x128 block at a time, exactly as DESIGN.md words it."""
    n, k = w.shape
    w32 = w.float()
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(n / 128), math.ceil(k / 128), dtype=torch.float32)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            block = w32[rows, cols]
            scale = torch.clamp(block.abs().max(), min=1e-12) / 448.0
            s[bi, bj] = scale
            q[rows, cols] = (block / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def random_weight(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_is_bit_exact_to_the_block_formula(shape, dtype):
    w = random_weight(shape, dtype, seed=sum(shape))
    q_ref, s_ref = naive_block_quant(w)
    t = Fp8Block().quantize(w, torch.bfloat16)
    assert set(t) == {"weight", "weight_scale_inv"}
    assert t["weight"].dtype == torch.float8_e4m3fn and t["weight"].shape == shape
    assert t["weight_scale_inv"].dtype == torch.float32
    assert torch.equal(t["weight"].view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(t["weight_scale_inv"], s_ref)


def test_reference_function_is_what_quantize_stores():
    w = random_weight((129, 257))
    q, s = fp8_block_quant_ref(w)
    t = Fp8Block().quantize(w, torch.bfloat16)
    assert torch.equal(q.view(torch.uint8), t["weight"].view(torch.uint8))
    assert torch.equal(s, t["weight_scale_inv"])


def test_dequantize_multiplies_each_block_by_its_scale():
    w = random_weight((129, 257), torch.float32)
    t = Fp8Block().quantize(w, torch.bfloat16)
    got = Fp8Block().dequantize(t)
    q, s = t["weight"].float(), t["weight_scale_inv"]
    for i, j in [(0, 0), (127, 128), (128, 0), (128, 256), (5, 200)]:
        assert got[i, j] == q[i, j] * s[i // 128, j // 128]
    assert got.dtype == torch.float32 and got.shape == (129, 257)


def test_the_largest_element_of_a_block_maps_to_448():
    w = random_weight((256, 256), torch.float32)
    q = Fp8Block().quantize(w, torch.bfloat16)["weight"].float()
    for bi in range(2):
        for bj in range(2):
            block = q[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
            assert block.abs().max() == 448


def test_all_zero_block_gives_finite_scale_and_zero_codes():
    w = random_weight((256, 300), torch.float32)
    w[128:, 128:256] = 0
    t = Fp8Block().quantize(w, torch.bfloat16)
    scale = t["weight_scale_inv"]
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert scale[1, 1] == pytest.approx(1e-12 / 448)
    assert (t["weight"][128:, 128:256].float() == 0).all()
    assert (Fp8Block().dequantize(t)[128:, 128:256] == 0).all()
    assert torch.isfinite(Fp8Block().dequantize(t)).all()


def test_concatenating_needs_whole_scale_blocks_in_every_part_but_the_last():
    fmt = Fp8Block()
    gate = fmt.quantize(random_weight((100, 256), seed=1), torch.bfloat16)
    up = fmt.quantize(random_weight((128, 256), seed=2), torch.bfloat16)
    assert fmt.logical_shape(fmt.cat_rows([up, gate])) == (228, 256)
    with pytest.raises(MoetoolError, match="not a multiple of 128"):
        fmt.cat_rows([gate, up])
    with pytest.raises(MoetoolError, match="not a multiple of 128"):
        fmt.split_rows(fmt.cat_rows([up, gate]), [100, 128])


def test_scale_of_the_wrong_block_grid_is_rejected():
    fmt = Fp8Block()
    t = fmt.quantize(random_weight((300, 200)), torch.bfloat16)
    t["weight_scale_inv"] = torch.ones(2, 2)
    expected = r"weight_scale_inv has shape \[2, 2\], expected \[3, 2\]"
    with pytest.raises(MoetoolError, match=expected):
        fmt.dequantize(t)


def test_config_matches_deepseek_v3_and_lists_skipped_linears():
    config = Fp8Block().quantization_config(["lm_head", "model.layers.0.self_attn.q_proj"])
    assert config["quant_method"] == "fp8"
    assert config["fmt"] == "e4m3"
    assert config["activation_scheme"] == "dynamic"
    assert config["weight_block_size"] == [128, 128]
    assert config["ignored_layers"] == config["modules_to_not_convert"] == [
        "lm_head",
        "model.layers.0.self_attn.q_proj",
    ]
    assert "ignored_layers" not in Fp8Block().quantization_config([])


def test_transformers_reads_the_config_and_skips_the_listed_linears():
    transformers = pytest.importorskip("transformers")
    from transformers.quantizers.quantizers_utils import should_convert_module

    ignore = ["lm_head", "model.layers.0.self_attn.q_proj"]
    parsed = transformers.FineGrainedFP8Config.from_dict(Fp8Block().quantization_config(ignore))
    assert list(parsed.weight_block_size) == [128, 128]
    assert parsed.activation_scheme == "dynamic"
    assert parsed.modules_to_not_convert == ignore
    assert not should_convert_module("model.layers.0.self_attn.q_proj", ignore)
    assert should_convert_module("model.layers.0.mlp.experts.3.down_proj", ignore)
