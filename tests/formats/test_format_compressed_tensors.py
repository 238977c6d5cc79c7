"""Cross-checks against compressed-tensors itself: its config parser, packer, unpacker and
dequantization read our bytes the way we do."""
from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from moetool.formats import Fp8Channel, Int4Group, pack_int4

IGNORE = ["lm_head", "model.layers.0.self_attn.q_proj"]


@functools.cache
def ct() -> SimpleNamespace:
    """compressed-tensors' config, compressor registry and int4 packers, imported when a test here
    runs (skipped without the package): the import (transformers, torch._dynamo) takes over a
    second, which every pytest-xdist worker would pay while collecting."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig

    return SimpleNamespace(BaseCompressor=BaseCompressor, QuantizationConfig=QuantizationConfig,
                           pack_to_int32=pack_to_int32, unpack_from_int32=unpack_from_int32)


def parse(fmt):
    """fmt's quantization_config as compressed-tensors' QuantizationConfig."""
    return ct().QuantizationConfig.model_validate(fmt.quantization_config(IGNORE))


def compressor(config):
    return ct().BaseCompressor.get_value_from_registry(config.format)


def random_weight(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)


def test_fp8_channel_config_parses():
    config = parse(Fp8Channel())
    scheme = config.config_groups["group_0"]
    assert config.format == "float-quantized"
    assert config.quantization_status == "compressed"
    assert config.ignore == IGNORE
    assert (scheme.weights.type, scheme.weights.num_bits, scheme.weights.strategy) == (
        "float", 8, "channel"
    )
    assert scheme.input_activations.dynamic is True
    assert scheme.input_activations.strategy == "token"


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_config_parses(symmetric):
    config = parse(Int4Group(group_size=64, symmetric=symmetric))
    weights = config.config_groups["group_0"].weights
    assert config.format == "pack-quantized"
    assert (weights.type, weights.num_bits, weights.strategy) == ("int", 4, "group")
    assert weights.group_size == 64 and weights.symmetric is symmetric
    assert config.config_groups["group_0"].input_activations is None


@pytest.mark.parametrize("shape", [(5, 16), (3, 13), (17, 100), (8, 1)])
def test_our_packing_is_byte_identical_to_compressed_tensors(shape):
    q = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(shape[1]),
                      dtype=torch.int8)
    assert torch.equal(pack_int4(q), ct().pack_to_int32(q, 4))
    assert torch.equal(pack_int4(q, packed_dim=0), ct().pack_to_int32(q, 4, packed_dim=0))
    assert torch.equal(ct().unpack_from_int32(pack_int4(q), 4, torch.Size(shape)), q)
    assert torch.equal(
        ct().unpack_from_int32(pack_int4(q, packed_dim=0), 4, torch.Size(shape), packed_dim=0), q
    )


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape", [(64, 256), (20, 128)])
def test_compressed_tensors_decompresses_our_int4_to_our_values(symmetric, shape):
    fmt = Int4Group(group_size=64, symmetric=symmetric)
    t = fmt.quantize(random_weight(shape), torch.bfloat16)
    config = parse(fmt)
    theirs = compressor(config).decompress(dict(t), config.config_groups["group_0"])["weight"]
    # they dequantize in the scale dtype (bf16): one rounding of our exact fp32 product
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(theirs, fmt.dequantize(t).to(torch.bfloat16))


def test_compressed_tensors_quantizes_to_our_symmetric_int4_bytes():
    """Given our scales, their quantize + pack writes exactly our weight_packed."""
    fmt = Int4Group(group_size=64)
    w = random_weight((32, 256)).float()
    t = fmt.quantize(w, torch.bfloat16)
    config = parse(fmt)
    scale = t["weight_scale"].float()  # they divide in the scale's dtype; ours is float32
    theirs = compressor(config).compress(
        {"weight": w, "weight_scale": scale}, config.config_groups["group_0"]
    )
    assert torch.equal(theirs["weight_packed"], t["weight_packed"])
    assert theirs["weight_shape"].tolist() == t["weight_shape"].tolist()


def test_compressed_tensors_decompresses_our_fp8_channel_to_our_values():
    fmt = Fp8Channel()
    t = fmt.quantize(random_weight((48, 256)), torch.bfloat16)
    config = parse(fmt)
    theirs = compressor(config).decompress(dict(t), config.config_groups["group_0"])["weight"]
    assert torch.equal(theirs, fmt.dequantize(t).to(torch.bfloat16))
