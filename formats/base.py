"""The interface every on-disk weight format implements.

Letters used in shapes: N = output features (rows), K = input features (columns),
E = experts, g = group size.

A *linear* in a checkpoint is a base name (``model.layers.0.mlp.experts.3.down_proj``) plus
the tensors the format stores for it, keyed by suffix (``weight``, ``weight_scale_inv``...).
Format objects work on those ``{suffix: tensor}`` dicts and never touch files.
"""
from __future__ import annotations

from typing import ClassVar, TypeVar

import torch

Tensors = dict[str, torch.Tensor]

#: every format class by name, filled by ``@register``; re-exported as ``moetool.formats.FORMATS``
FORMATS: dict[str, type[WeightFormat]] = {}

_FormatClass = TypeVar("_FormatClass", bound="type[WeightFormat]")


def register(cls: _FormatClass) -> _FormatClass:
    """Class decorator: add a format to ``FORMATS`` under its ``name``."""
    if cls.name in FORMATS:
        raise ValueError(f"format {cls.name!r} is registered twice")
    FORMATS[cls.name] = cls
    return cls


class WeightFormat:
    """One weight format. Subclasses are registered in ``moetool.formats.FORMATS``."""

    #: registry key and CLI name: "dense", "fp8-block", "fp8-channel", "int4-group"
    name: ClassVar[str]
    #: tensor suffixes of one linear; the first is the main (quantized) weight
    suffixes: ClassVar[tuple[str, ...]]
    #: logical rows per stored row of each tensor cut along N (1 for a weight, 128 for fp8
    #: block scales): what the default ``cat_rows`` / ``split_rows`` need
    row_blocks: ClassVar[dict[str, int]] = {}

    def quantize(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors:
        """w [N, K] (any float dtype, already fp32 or not) -> the format's tensors.

        ``orig_dtype`` is the model's unquantized dtype (bf16 usually): formats that store
        scales "in the original dtype" use it. Raises MoetoolError on NaN/Inf (the caller
        adds the tensor name)."""
        raise NotImplementedError

    def dequantize(self, t: Tensors) -> torch.Tensor:
        """The format's tensors for one linear -> float32 [N, K]."""
        raise NotImplementedError

    def quantize_measured(self, w: torch.Tensor, orig_dtype: torch.dtype) -> tuple[Tensors, float, float]:
        """``quantize(w, orig_dtype)`` and the error of its dequantization, exactly:
        (tensors, sum w32^2, sum (dequantize(tensors) - w32)^2), w32 = w.float(), each term in
        float32 as ``dequantize`` computes it. Formats override this with a fused CPU version
        (same tensors bit for bit, same per-element terms) that never makes [N, K] temporaries."""
        from moetool.formats.common import error_sums

        t = self.quantize(w, orig_dtype)
        return (t, *error_sums(w, self.dequantize(t)))

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        """[N, K] of the unquantized weight."""
        raise NotImplementedError

    def cat_rows(self, parts: list[Tensors]) -> Tensors:
        """Concatenate linears along N (w13 = gate rows then up rows); exact inverse of split_rows."""
        from moetool.formats.common import cat_row_blocked

        rows = [self.logical_shape(part)[0] for part in parts]
        return cat_row_blocked(self.name, parts, rows, self.row_blocks)

    def split_rows(self, t: Tensors, sizes: list[int]) -> list[Tensors]:
        """Split one linear along N into parts of ``sizes`` rows each."""
        from moetool.formats.common import split_row_blocked

        n, _ = self.logical_shape(t)
        return split_row_blocked(self.name, t, n, sizes, self.row_blocks)

    def quantization_config(self, ignore: list[str]) -> dict | None:
        """The config.json ``quantization_config`` for a checkpoint whose quantized linears are
        in this format and whose other linears are listed in ``ignore`` (None for dense)."""
        raise NotImplementedError
