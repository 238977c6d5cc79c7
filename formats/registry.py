"""The registry of on-disk weight formats, and what the rest of moetool asks it.

Loading this module imports every module in formats/, so each ``@register`` class is in
``FORMATS`` (in module name order: dense, fp8-block, fp8-channel, int4-group). Nothing here
names a format: a format says everything about itself in its own module (formats/base.py).

* ``get_format(name, **params)``: a format object; ``format_params`` splits options into a
  format's parameters and the rest;
* ``detect_format`` / ``read_format_params``: a checkpoint's config.json ``quantization_config``
  (and tensor suffixes) -> its format; ``linear_format``: the format of one linear;
* ``FormatName`` (str Enum of the names), ``TOLERANCES`` (name -> round-trip tolerance, a view
  of the classes), ``quantized_suffixes``, ``quantize_targets``, ``unquantized``.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from enum import Enum
from types import ModuleType

import moetool.formats as _package
import torch
from moetool.formats.base import FORMATS, FP8_DTYPES, CliParam, Tensors, WeightFormat, register

from moetool.errors import MoetoolError

__all__ = [
    "FORMATS",
    "TOLERANCES",
    "CliParam",
    "FormatName",
    "Tensors",
    "WeightFormat",
    "detect_format",
    "format_params",
    "get_format",
    "linear_format",
    "name_enum",
    "quantize_targets",
    "quantized_suffixes",
    "read_format_params",
    "register",
    "unquantized",
]


def _import_format_modules() -> list[ModuleType]:
    """Every module of formats/, imported (each registers its formats), in name order; FORMATS
    is then ordered by module, whatever was imported first."""
    found = pkgutil.iter_modules(_package.__path__, prefix=_package.__name__ + ".")  # every file: no name table
    modules = [importlib.import_module(info.name) for info in sorted(found, key=lambda info: info.name)]
    order = {module.__name__: i for i, module in enumerate(modules)}
    ordered = sorted(FORMATS.values(), key=lambda cls: order.get(cls.__module__, len(order)))
    FORMATS.clear()
    FORMATS.update((cls.name, cls) for cls in ordered)
    return modules


_MODULES = _import_format_modules()


def name_enum(names: list[str] | None = None) -> type[Enum]:
    """A str Enum ``FormatName`` of ``names`` (default: every registered format), members named
    like FP8_BLOCK = "fp8-block"."""
    names = list(FORMATS) if names is None else names
    return Enum("FormatName", [(n.upper().replace("-", "_"), n) for n in names], type=str, module=__name__)


#: the registered format names as a str Enum (FormatName.FP8_BLOCK == "fp8-block")
FormatName = name_enum()


class _ByFormat(Mapping):
    """name -> one class attribute of each registered format: a view, not a second table."""

    def __init__(self, attribute: str) -> None:
        self._attribute = attribute

    def __getitem__(self, name: str):
        return getattr(FORMATS[name], self._attribute)

    def __iter__(self) -> Iterator[str]:
        return iter(FORMATS)

    def __len__(self) -> int:
        return len(FORMATS)


#: name -> {"rel_err", "sqnr_db"}: each format's ``tolerance`` for dequantize(quantize(w))
TOLERANCES: Mapping[str, dict[str, float]] = _ByFormat("tolerance")


def _format_class(name: str) -> type[WeightFormat]:
    cls = FORMATS.get(name)
    if cls is None:
        raise MoetoolError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    return cls


def _parameters(cls: type[WeightFormat]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def get_format(name: str, **params) -> WeightFormat:
    """A format object from its registry name and parameters (int4-group: group_size, symmetric)."""
    cls = _format_class(name)
    try:
        return cls(**params)
    except TypeError:
        raise MoetoolError(
            f"format {cls.name} does not take parameters {sorted(params)}"
        ) from None


def format_params(name: str, options: dict) -> tuple[dict, dict]:
    """Keyword ``options`` -> (those that are parameters of format ``name``, those that are no
    format's parameter). Parameters of other formats are dropped, so one call can pass
    ``group_size=64`` whatever the format."""
    own = _parameters(_format_class(name))
    anyone = set().union(*(_parameters(cls) for cls in FORMATS.values()))
    return ({k: v for k, v in options.items() if k in own},
            {k: v for k, v in options.items() if k not in anyone})


def unquantized() -> type[WeightFormat]:
    """The format of plain float weights (dense): what a quantized linear dequantizes to."""
    return next(cls for cls in FORMATS.values() if not cls.quantized)


def quantize_targets() -> list[type[WeightFormat]]:
    """The formats ``moetool quantize`` can write, in registry order."""
    return [cls for cls in FORMATS.values() if cls.quantized]


def quantized_suffixes() -> set[str]:
    """Suffixes that only quantized formats store (everything but the plain ``weight``)."""
    stored = {s for cls in FORMATS.values() for s in (*cls.suffixes, *cls.optional_suffixes)}
    return stored - {s for cls in FORMATS.values() if not cls.quantized for s in cls.suffixes}


def read_format_params(quantization_config: dict | None) -> tuple[str, dict]:
    """config.json ``quantization_config`` -> (format name, parameters for ``get_format``).

    None means dense. Anything moetool cannot read exactly raises MoetoolError."""
    if quantization_config is None:
        return unquantized().name, {}
    if not isinstance(quantization_config, dict):
        raise MoetoolError(f"quantization_config is not a JSON object: {quantization_config!r}")
    method = str(quantization_config.get("quant_method", "")).lower()
    readers = [cls for cls in FORMATS.values() if cls.config_method == method]
    if not readers:
        raise MoetoolError(
            f"unsupported quantization_config quant_method {method or None!r} (moetool reads {_readable()})"
        )
    for cls in readers:
        params = cls.params_from_config(quantization_config)
        if params is not None:
            return cls.name, params
    raise MoetoolError(readers[0].config_mismatch(quantization_config, readers))


def _readable() -> str:
    """"fp8 with 128x128 blocks and compressed-tensors fp8-channel / int4-group"."""
    by_method: dict[str, list[str]] = {}
    for cls in FORMATS.values():
        if cls.config_method is not None:
            by_method.setdefault(cls.config_method, []).append(cls.config_label)
    return " and ".join(" ".join([method, " / ".join(label for label in labels if label)]).strip()
                        for method, labels in by_method.items())


def detect_format(
    config: dict, suffixes: set[str], weight_dtype: torch.dtype | None = None
) -> WeightFormat:
    """The format of a checkpoint's quantized linears.

    ``config``: the checkpoint's config.json; ``suffixes``: the tensor name suffixes it holds
    (``weight``, ``weight_scale_inv``, ...; the last dotted component of every tensor name);
    ``weight_dtype``: the dtype of a quantized linear's main ``weight`` when known.
    Without a ``quantization_config`` the checkpoint is dense, unless a format recognizes its
    tensors (``recognized_without_config``: fp8-block whose config was dropped).
    The suffixes must agree with the config: all of the format's present, none of another's.
    """
    quantization_config = config.get("quantization_config")
    name, params = read_format_params(quantization_config)
    if quantization_config is None:
        name = next((cls.name for cls in FORMATS.values()
                     if cls.recognized_without_config(suffixes, weight_dtype)), name)
    fmt = get_format(name, **params)
    if fmt.weight_dtype is not None and weight_dtype not in (None, fmt.weight_dtype):
        raise MoetoolError(
            f"config.json declares {fmt.name} but the quantized weights are {weight_dtype}, "
            f"not {_dtype_name(fmt.weight_dtype)}"
        )
    declared = (
        f"config.json declares {fmt.name}"
        if quantization_config is not None
        else "config.json has no quantization_config (dense)"
    )
    if not fmt.quantized and weight_dtype in FP8_DTYPES:  # no format keeps fp8 with an implied scale of 1
        raise MoetoolError(f"{declared} but the weights are {_dtype_name(weight_dtype)} with no scale tensors "
                           "(weight_scale_inv, weight_scale...): their values cannot be read")
    missing = [s for s in fmt.suffixes if s not in suffixes]
    if missing:
        raise MoetoolError(f"{declared} but no tensor ends in {', '.join(missing)}")
    foreign = sorted((quantized_suffixes() & suffixes) - set(fmt.suffixes))
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
    quantized = quantized_suffixes() & suffixes
    if quantized:
        stores = ", ".join(checkpoint_format.suffixes)
        if not set(checkpoint_format.suffixes) <= suffixes or quantized - set(
            checkpoint_format.suffixes
        ):
            raise MoetoolError(
                f"has {', '.join(sorted(suffixes))}, which is no {checkpoint_format.name} linear "
                f"({checkpoint_format.name} stores {stores})"
            )
        if checkpoint_format.weight_dtype is not None and weight_dtype != checkpoint_format.weight_dtype:
            raise MoetoolError(
                f"has {checkpoint_format.name} scales but its weight is {weight_dtype}, "
                f"not {_dtype_name(checkpoint_format.weight_dtype)}"
            )
        return checkpoint_format
    if "weight" not in suffixes:
        raise MoetoolError(f"has no weight tensor (found {', '.join(sorted(suffixes)) or 'none'})")
    if weight_dtype is not None and not weight_dtype.is_floating_point:
        raise MoetoolError(f"has an unscaled weight of dtype {weight_dtype}")
    if weight_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise MoetoolError(f"has a {weight_dtype} weight without scales")
    return unquantized()()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def exported(name: str):
    """``moetool.formats.<name>``: a name of ``__all__`` here, or a public class or function
    defined in a format module (``Fp8Block``, ``pack_int4``, ``fp8_block_quant_ref``)."""
    if name in __all__:
        return globals()[name]
    if not name.startswith("_"):
        for module in _MODULES:
            value = getattr(module, name, None)
            if value is not None and getattr(value, "__module__", None) == module.__name__:
                return value
    raise AttributeError(f"module 'moetool.formats' has no attribute {name!r}")
