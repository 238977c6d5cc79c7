"""End to end: a tiny Llama whose MLP linears are written in each format loads in transformers
with the weights our dequantize gives, and the linears in the ignore list untouched.

transformers is asked to dequantize on load, so the test runs the same with or without a GPU
(how transformers applies the fp8 skip list is tested in test_format_fp8_block.py).
Known upstream gap: without ``dequantize``, transformers 5.23 + compressed-tensors 0.20 build
the compressed model on the meta device with an unpacked ``weight_zero_point`` [N, G] and so
refuse asymmetric int4 checkpoints, whose zero points compressed-tensors' own compressor and
vLLM store packed, [ceil(N/8), G], as we do.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from moetool.formats import Fp8Block, Fp8Channel, Int4Group, Mxfp4, Nvfp4

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
# transformers imports compressed-tensors when it loads these checkpoints; importing it here
# would cost every pytest-xdist worker over a second of collection
pytestmark = pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None,
                                reason="needs compressed-tensors")

FORMATS = [
    pytest.param(Fp8Block(), id="fp8-block"),
    pytest.param(Fp8Channel(), id="fp8-channel"),
    pytest.param(Int4Group(), id="int4-sym"),
    pytest.param(Int4Group(group_size=64, symmetric=False), id="int4-asym"),
    pytest.param(Int4Group(clip="mse"), id="int4-sym-mse"),
    pytest.param(Mxfp4(), id="mxfp4"),
    pytest.param(Nvfp4(), id="nvfp4"),
]


def write_tiny_llama(path, fmt) -> dict[str, torch.Tensor]:
    """Save a 1-layer Llama with MLP linears in ``fmt``; return the weights expected on load."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    tensors, expected, ignore = {}, {}, []
    for name, weight in model.state_dict().items():
        linear = name.removesuffix(".weight")
        if ".mlp." in name:
            stored = fmt.quantize(weight, torch.bfloat16)
            tensors.update({f"{linear}.{suffix}": t for suffix, t in stored.items()})
            expected[name] = fmt.dequantize(stored)
        else:
            tensors[name] = weight.contiguous()
            expected[name] = weight.float()
            if name.endswith("_proj.weight") or name == "lm_head.weight":
                ignore.append(linear)
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["architectures"] = ["LlamaForCausalLM"]
    config_dict["torch_dtype"] = "bfloat16"
    config_dict["quantization_config"] = fmt.quantization_config(ignore)
    (path / "config.json").write_text(json.dumps(config_dict))
    return expected


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize("fmt", FORMATS)
def test_transformers_loads_the_checkpoint(tmp_path, fmt):
    expected = write_tiny_llama(tmp_path, fmt)
    if isinstance(fmt, Fp8Block):
        dequantize_on_load = transformers.FineGrainedFP8Config(dequantize=True)
    else:
        dequantize_on_load = transformers.CompressedTensorsConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, quantization_config=dequantize_on_load
    )
    loaded = model.state_dict()
    for name, weight in expected.items():
        assert loaded[name].shape == weight.shape, name
        # transformers dequantizes in bf16: one rounding of our float32 values
        assert torch.equal(loaded[name], weight.to(torch.bfloat16)), name
