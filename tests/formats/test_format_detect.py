"""Reading a checkpoint's format back from its config.json and tensor suffixes."""
from __future__ import annotations

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.formats import (
    Dense,
    Fp8Block,
    Fp8Channel,
    Int4Group,
    detect_format,
    get_format,
    linear_format,
    read_format_params,
)

WRITTEN = [
    pytest.param(Dense(), id="dense"),
    pytest.param(Fp8Block(), id="fp8-block"),
    pytest.param(Fp8Channel(), id="fp8-channel"),
    pytest.param(Int4Group(), id="int4-sym-g128"),
    pytest.param(Int4Group(group_size=32, symmetric=False), id="int4-asym-g32"),
]


def checkpoint_config(fmt) -> dict:
    config = {"model_type": "qwen3_moe", "hidden_size": 256}
    quantization_config = fmt.quantization_config(["lm_head", "model.layers.0.self_attn.q_proj"])
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return config


def main_dtype(fmt) -> torch.dtype:
    return fmt.quantize(torch.ones(8, 128), torch.bfloat16)[fmt.suffixes[0]].dtype


@pytest.mark.parametrize("fmt", WRITTEN)
def test_detects_what_each_format_writes(fmt):
    suffixes = set(fmt.suffixes) | {"weight", "bias"}  # ignored linears keep a plain weight
    assert detect_format(checkpoint_config(fmt), suffixes, main_dtype(fmt)) == fmt
    assert detect_format(checkpoint_config(fmt), suffixes) == fmt


@pytest.mark.parametrize("fmt", WRITTEN)
def test_read_format_params_feeds_get_format(fmt):
    name, params = read_format_params(fmt.quantization_config([]))
    assert get_format(name, **params) == fmt


def test_fp8_block_without_its_config_is_recognised_by_dtype_and_scale():
    suffixes = {"weight", "weight_scale_inv"}
    assert detect_format({}, suffixes, torch.float8_e4m3fn) == Fp8Block()
    with pytest.raises(MoetoolError, match="do not belong to dense"):
        detect_format({}, suffixes, torch.bfloat16)
    with pytest.raises(MoetoolError, match="do not belong to dense"):
        detect_format({}, suffixes)


def test_fp8_config_with_non_fp8_weights_is_refused():
    config = checkpoint_config(Fp8Block())
    with pytest.raises(MoetoolError, match=r"quantized weights are torch\.float8_e5m2"):
        detect_format(config, {"weight", "weight_scale_inv"}, torch.float8_e5m2)


def test_config_and_tensors_must_agree():
    with pytest.raises(MoetoolError, match="no tensor ends in weight_scale_inv"):
        detect_format(checkpoint_config(Fp8Block()), {"weight"})
    with pytest.raises(MoetoolError, match="weight_zero_point do not belong to int4-group"):
        detect_format(checkpoint_config(Int4Group()), set(Int4Group(symmetric=False).suffixes))
    with pytest.raises(MoetoolError, match="weight_packed"):
        detect_format({}, {"weight", "weight_packed", "weight_scale", "weight_shape"})


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "without weight_block_size"),
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]},
            r"weight_block_size \[64, 64\]",
        ),
        (
            {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
            "fmt 'e5m2'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                    }
                },
            },
            "format int-quantized, weights type int, num_bits 8, strategy channel",
        ),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"W4A16": ["Linear"]}},
            "preset name",
        ),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"a": {}, "b": {}}},
            "with 2 config_groups",
        ),
        ("fp8", "not a JSON object"),
    ],
)
def test_unsupported_configs_give_one_line_errors(quantization_config, message):
    with pytest.raises(MoetoolError, match=message) as err:
        detect_format({"quantization_config": quantization_config}, {"weight"})
    assert "\n" not in str(err.value)


def test_int4_activation_ordered_groups_are_refused():
    config = Int4Group().quantization_config([])
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(MoetoolError, match="actorder 'group'"):
        read_format_params(config)


def test_get_format_errors():
    with pytest.raises(MoetoolError, match="unknown weight format 'nf4'"):
        get_format("nf4")
    with pytest.raises(MoetoolError, match=r"fp8-block does not take parameters \['group_size'\]"):
        get_format("fp8-block", group_size=64)


def test_linear_format_tells_ignored_linears_from_quantized_ones():
    fmt = Fp8Block()
    assert linear_format(fmt, {"weight", "weight_scale_inv"}, torch.float8_e4m3fn) == fmt
    assert linear_format(fmt, {"weight", "bias"}, torch.bfloat16) == Dense()
    with pytest.raises(MoetoolError, match=r"weight is torch\.bfloat16, not float8_e4m3fn"):
        linear_format(fmt, {"weight", "weight_scale_inv"}, torch.bfloat16)
    with pytest.raises(MoetoolError, match="float8_e4m3fn weight without scales"):
        linear_format(fmt, {"weight"}, torch.float8_e4m3fn)
    int4 = Int4Group(symmetric=False)
    with pytest.raises(MoetoolError, match="which is no int4-group linear"):
        linear_format(int4, {"weight_packed", "weight_scale", "weight_shape"}, None)
    assert linear_format(int4, set(int4.suffixes), None) == int4
    with pytest.raises(MoetoolError, match="which is no fp8-block linear"):
        linear_format(fmt, {"weight", "weight_scale"}, torch.float8_e4m3fn)


def test_linear_format_in_a_dense_checkpoint():
    assert linear_format(Dense(), {"weight", "bias"}, torch.bfloat16) == Dense()
    with pytest.raises(MoetoolError, match="which is no dense linear"):
        linear_format(Dense(), {"weight", "weight_scale_inv"}, torch.float8_e4m3fn)
    with pytest.raises(MoetoolError, match="has no weight tensor"):
        linear_format(Dense(), {"bias"}, None)
