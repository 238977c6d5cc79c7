"""On-disk weight formats: one module per format, all registered in ``FORMATS``.

``detect_format`` reads a checkpoint's config.json (and the tensor suffixes it holds) and
returns the format object; ``get_format`` builds one from a CLI name and parameters.
"""
from __future__ import annotations

from enum import Enum

import torch

from moetool.errors import MoetoolError
from moetool.formats.base import FORMATS, Tensors, WeightFormat, register
from moetool.formats.dense import Dense
from moetool.formats.fp8_block import Fp8Block, fp8_block_quant_ref
from moetool.formats.fp8_channel import Fp8Channel, fp8_channel_quant_ref
from moetool.formats.int4_group import Int4Group, int4_group_quant_ref, pack_int4, unpack_int4

__all__ = [
    "FORMATS",
    "TOLERANCES",
    "Dense",
    "FormatName",
    "Fp8Block",
    "Fp8Channel",
    "Int4Group",
    "Tensors",
    "WeightFormat",
    "detect_format",
    "fp8_block_quant_ref",
    "fp8_channel_quant_ref",
    "get_format",
    "int4_group_quant_ref",
    "linear_format",
    "pack_int4",
    "read_format_params",
    "register",
    "unpack_int4",
]


class FormatName(str, Enum):
    DENSE = "dense"
    FP8_BLOCK = "fp8-block"
    FP8_CHANNEL = "fp8-channel"
    INT4_GROUP = "int4-group"


_FP8_FORMATS = {FormatName.FP8_BLOCK.value, FormatName.FP8_CHANNEL.value}

#: Expected error of dequantize(quantize(w)) against w, per format: ``rel_err`` is the largest
#: relative Frobenius error ||w' - w|| / ||w|| allowed and ``sqnr_db`` = -20 log10(rel_err) the
#: smallest SQNR. Measured on torch.randn weights, shapes 256x256 .. 2048x512 (and 300x384),
#: seeds 0-9, orig_dtype bf16; fp16 / fp32 scales measure the same:
#:   dense (bf16 rounding)   rel_err 0.00165 - 0.00168
#:   fp8-block               rel_err 0.0263  - 0.0266
#:   fp8-channel             rel_err 0.0260  - 0.0265
#:   int4-group g128 sym     rel_err 0.116   - 0.119   (asym 0.100 - 0.102; g32 0.097; g64 0.108;
#:                                                      g256 0.127; g512 0.135)
#: The limits are the worst case plus about 30 % (int4: enough for groups up to 512), so a real
#: fault (a wrong scale, a swapped block) fails while seed-to-seed noise does not. Heavy-tailed
#: real weights or fp8 activations on top add error: callers checking whole layers may widen.
TOLERANCES: dict[str, dict[str, float]] = {
    "dense": {"rel_err": 0.0025, "sqnr_db": 52.0},
    "fp8-block": {"rel_err": 0.035, "sqnr_db": 29.1},
    "fp8-channel": {"rel_err": 0.035, "sqnr_db": 29.1},
    "int4-group": {"rel_err": 0.16, "sqnr_db": 15.9},
}


def get_format(name: str, **params) -> WeightFormat:
    """A format object from its registry name and parameters (int4-group: group_size, symmetric)."""
    cls = FORMATS.get(name)
    if cls is None:
        raise MoetoolError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    try:
        return cls(**params)
    except TypeError:
        raise MoetoolError(
            f"format {cls.name} does not take parameters {sorted(params)}"
        ) from None


def read_format_params(quantization_config: dict | None) -> tuple[str, dict]:
    """config.json ``quantization_config`` -> (format name, parameters for ``get_format``).

    None means dense. Anything moetool cannot read exactly raises MoetoolError."""
    if quantization_config is None:
        return FormatName.DENSE.value, {}
    if not isinstance(quantization_config, dict):
        raise MoetoolError(f"quantization_config is not a JSON object: {quantization_config!r}")
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "fp8":
        return _read_fp8(quantization_config)
    if method == "compressed-tensors":
        return _read_compressed_tensors(quantization_config)
    raise MoetoolError(
        f"unsupported quantization_config quant_method {method or None!r} "
        "(moetool reads fp8 with 128x128 blocks and compressed-tensors fp8-channel / int4-group)"
    )


def detect_format(
    config: dict, suffixes: set[str], weight_dtype: torch.dtype | None = None
) -> WeightFormat:
    """The format of a checkpoint's quantized linears.

    ``config``: the checkpoint's config.json; ``suffixes``: the tensor name suffixes it holds
    (``weight``, ``weight_scale_inv``, ...; the last dotted component of every tensor name);
    ``weight_dtype``: the dtype of a quantized linear's main ``weight`` when known.
    Without a ``quantization_config`` the checkpoint is dense, unless it holds
    ``weight_scale_inv`` next to float8_e4m3fn weights (fp8-block whose config was dropped).
    The suffixes must agree with the config: all of the format's present, none of another's.
    """
    quantization_config = config.get("quantization_config")
    name, params = read_format_params(quantization_config)
    if (
        quantization_config is None
        and "weight_scale_inv" in suffixes
        and weight_dtype == torch.float8_e4m3fn
    ):
        name = FormatName.FP8_BLOCK.value
    fmt = get_format(name, **params)
    if fmt.name in _FP8_FORMATS and weight_dtype not in (None, torch.float8_e4m3fn):
        raise MoetoolError(
            f"config.json declares {fmt.name} but the quantized weights are {weight_dtype}, "
            "not float8_e4m3fn"
        )
    declared = (
        f"config.json declares {fmt.name}"
        if quantization_config is not None
        else "config.json has no quantization_config (dense)"
    )
    missing = [s for s in fmt.suffixes if s not in suffixes]
    if missing:
        raise MoetoolError(f"{declared} but no tensor ends in {', '.join(missing)}")
    foreign = sorted((_quantized_suffixes() & suffixes) - set(fmt.suffixes))
    if foreign:
        raise MoetoolError(
            f"{declared} but tensors ending in {', '.join(foreign)} do not belong to {fmt.name}"
        )
    return fmt


def linear_format(
    checkpoint_format: WeightFormat, suffixes: set[str], weight_dtype: torch.dtype | None
) -> WeightFormat:
    """The format of one linear of a checkpoint in ``checkpoint_format``.

    ``suffixes``: the suffixes of the linear's tensors; ``weight_dtype``: the dtype of its
    ``weight`` tensor, if it has one. A linear with the format's tensors is in the checkpoint's
    format (fp8 only with float8_e4m3fn weights: recognised by dtype, never by element size);
    one with a plain float ``weight`` and no scales is dense (a linear in the ignore list)."""
    quantized = _quantized_suffixes() & suffixes
    if quantized:
        stores = ", ".join(checkpoint_format.suffixes)
        if not set(checkpoint_format.suffixes) <= suffixes or quantized - set(
            checkpoint_format.suffixes
        ):
            raise MoetoolError(
                f"has {', '.join(sorted(suffixes))}, which is no {checkpoint_format.name} linear "
                f"({checkpoint_format.name} stores {stores})"
            )
        if checkpoint_format.name in _FP8_FORMATS and weight_dtype != torch.float8_e4m3fn:
            raise MoetoolError(
                f"has {checkpoint_format.name} scales but its weight is {weight_dtype}, "
                "not float8_e4m3fn"
            )
        return checkpoint_format
    if "weight" not in suffixes:
        raise MoetoolError(f"has no weight tensor (found {', '.join(sorted(suffixes)) or 'none'})")
    if weight_dtype is not None and not weight_dtype.is_floating_point:
        raise MoetoolError(f"has an unscaled weight of dtype {weight_dtype}")
    if weight_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise MoetoolError(f"has a {weight_dtype} weight without scales")
    return Dense()


def _quantized_suffixes() -> set[str]:
    """Suffixes that only quantized formats store (everything but the plain ``weight``)."""
    names = {s for cls in FORMATS.values() for s in cls.suffixes}
    return (names | set(Int4Group(symmetric=False).suffixes)) - {"weight"}


def _read_fp8(config: dict) -> tuple[str, dict]:
    block = config.get("weight_block_size")
    if block is None:
        raise MoetoolError(
            "unsupported quantization_config: fp8 without weight_block_size (per-tensor fp8); "
            "moetool reads 128x128 block fp8 only"
        )
    if list(block) != [128, 128]:
        raise MoetoolError(
            f"unsupported quantization_config: fp8 weight_block_size {list(block)}; "
            "moetool reads [128, 128]"
        )
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise MoetoolError(f"unsupported quantization_config: fp8 fmt {fmt!r}; moetool reads e4m3")
    activation = config.get("activation_scheme", "dynamic")
    if activation != "dynamic":
        raise MoetoolError(
            f"unsupported quantization_config: fp8 activation_scheme {activation!r} with block "
            "scales; only 'dynamic' exists for block fp8"
        )
    return FormatName.FP8_BLOCK.value, {}


def _read_compressed_tensors(config: dict) -> tuple[str, dict]:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise MoetoolError(
            f"unsupported compressed-tensors quantization_config with {len(groups)} "
            "config_groups; moetool reads exactly one"
        )
    group_name, scheme = next(iter(groups.items()))
    if not isinstance(scheme, dict):
        raise MoetoolError(
            f"unsupported compressed-tensors config group {group_name!r} given as a preset name; "
            "moetool reads groups with explicit weights arguments"
        )
    weights = scheme.get("weights") or {}
    storage = scheme.get("format") or config.get("format")
    kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
    if kind == ("float", 8, "channel") and storage in ("float-quantized", "naive-quantized"):
        if weights.get("symmetric", True) is not True:
            raise MoetoolError("unsupported compressed-tensors fp8 weights with zero points")
        return FormatName.FP8_CHANNEL.value, {}
    if kind == ("int", 4, "group") and storage == "pack-quantized":
        if weights.get("actorder") == "group":
            raise MoetoolError(
                "unsupported compressed-tensors int4 with actorder 'group' (weight_g_idx)"
            )
        return FormatName.INT4_GROUP.value, {
            "group_size": weights.get("group_size"),
            "symmetric": weights.get("symmetric", True),
        }
    described = ", ".join(f"{key} {weights.get(key)}" for key in ("type", "num_bits", "strategy"))
    raise MoetoolError(
        f"unsupported compressed-tensors quantization_config: format {storage}, weights "
        f"{described} (moetool reads float-quantized fp8 channel and pack-quantized int4 group)"
    )
