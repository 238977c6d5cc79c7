"""w13 of two halves whose N is not a multiple of 128: vLLM's stacked scale layout."""
import pytest
import torch

from moetool.errors import MoetoolError
from moetool.formats import get_format


def test_w13_halves_round_trip_and_dequantize():
    fmt = get_format("fp8-block")
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(192, 300, generator=g), torch.randn(192, 300, generator=g)
    qg, qu = fmt.quantize(gate, torch.bfloat16), fmt.quantize(up, torch.bfloat16)
    w13 = fmt.cat_rows([qg, qu])
    assert w13["weight"].shape == (384, 300)
    assert w13["weight_scale_inv"].shape == (4, 3)  # 2 * ceil(192/128) rows, not ceil(384/128)
    assert fmt.logical_shape(w13) == (384, 300)
    with pytest.raises(MoetoolError, match="per-half scale rows; split it"):
        fmt.dequantize(w13)  # never read as one linear
    back = fmt.split_rows(w13, [192, 192])
    for got, want in zip(back, (qg, qu)):
        assert torch.equal(got["weight"].view(torch.uint8), want["weight"].view(torch.uint8))
        assert torch.equal(got["weight_scale_inv"], want["weight_scale_inv"])


def test_aligned_w13_is_one_linear():
    fmt = get_format("fp8-block")
    gate, up = torch.randn(256, 128), torch.randn(256, 128)
    w13 = fmt.cat_rows([fmt.quantize(gate, torch.bfloat16), fmt.quantize(up, torch.bfloat16)])
    assert w13["weight_scale_inv"].shape == (4, 1)
    assert torch.equal(fmt.dequantize(w13), fmt.dequantize(fmt.quantize(torch.cat([gate, up]), torch.bfloat16)))


def test_w13_halves_whose_scale_rows_look_like_one_linear():
    """N = 96: 2 * ceil(96/128) == ceil(192/128), so only the sizes tell the halves apart."""
    fmt = get_format("fp8-block")
    gate, up = torch.randn(96, 256), torch.randn(96, 256) * 50  # very different scales
    qg, qu = fmt.quantize(gate, torch.bfloat16), fmt.quantize(up, torch.bfloat16)
    w13 = fmt.cat_rows([qg, qu])
    assert w13["weight_scale_inv"].shape == (2, 2)
    g2, u2 = fmt.split_rows(w13, [96, 96])
    assert torch.equal(fmt.dequantize(g2), fmt.dequantize(qg))
    assert torch.equal(fmt.dequantize(u2), fmt.dequantize(qu))
