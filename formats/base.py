"""The interface every on-disk weight format implements: what a format module must define.

Letters used in shapes: N = output features (rows), K = input features (columns),
E = experts, g = group size.

A *linear* in a checkpoint is a base name (``model.layers.0.mlp.experts.3.down_proj``) plus
the tensors the format stores for it, keyed by suffix (``weight``, ``weight_scale_inv``...).
Format objects work on those ``{suffix: tensor}`` dicts and never touch files.

Adding a format is one new module in ``formats/`` (plus a kernel module in ``kernels/`` where
it needs its own GEMM): a frozen dataclass subclassing :class:`WeightFormat`, decorated with
``@register``. The package imports every module in ``formats/`` (``moetool.formats.registry``)
and everything else asks the registry: the CLI (``moetool quantize --format NAME`` and the
format's alias flags and parameters), the config reader (``detect_format``), the planner
(suffixes), the torch executor (``quantize_cuda``), verify (tolerances, activation
quantization, kernel scheme). Nothing outside ``formats/`` names a format.

What a format defines (class attributes first, as literals, before any method: ``name``,
``suffixes``, ``optional_suffixes`` and ``quantized`` are also read from the source without
importing torch, by ``moetool.formats.cards``):

==========================  ==========================================================
``name``                    registry key, ``--format`` value, the name in messages
``suffixes``                tensors of one linear, main weight first
``optional_suffixes``       tensors only some instances store (int4 asymmetric zero points)
``quantized``               False only for the unquantized format (dense)
``row_blocks``              logical rows per stored row of each tensor cut along N
``weight_dtype``            the dtype its ``weight`` tensor must have (fp8: float8_e4m3fn)
``tolerance``               round-trip error limits (``rel_err``, ``sqnr_db``)
``verify_tolerances``       verify pass limits (``rel_err`` per layer, ``expert_rel_err``)
``activation_quant``        how the serving engine quantizes activations ("fp8-1x128",
                            "fp8-token" / None): verify's served numerics
``kernel_scheme``           the fused-MoE kernel scheme that reads it (``moetool.kernels``)
``config_method``           the ``quant_method`` of its ``quantization_config``
``config_label``            how "moetool reads ..." messages name it after that method
``cli_flags``, ``cli_help`` ``moetool quantize`` alias flag(s) and their help
``cli_params``              its dataclass fields as ``moetool quantize`` options
==========================  ==========================================================

and the methods ``quantize``, ``dequantize``, ``logical_shape``, ``quantization_config``,
``params_from_config`` (the inverse: a checkpoint's config -> parameters), and where it
differs from the defaults: ``quantize_measured``, ``quantize_cuda``, ``cat_rows`` /
``split_rows``, ``recognized_without_config``. Parameters (int4-group's ``group_size``,
``symmetric``) are the dataclass fields; ``get_format(name, **params)`` builds one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from moetool.formats.common import Tensors, cat_row_blocked, error_sums, split_row_blocked


#: every format class by name, filled by ``@register``; re-exported as ``moetool.formats.FORMATS``
FORMATS: dict[str, type[WeightFormat]] = {}

_FormatClass = TypeVar("_FormatClass", bound="type[WeightFormat]")


def register(cls: _FormatClass) -> _FormatClass:
    """Class decorator: add a format to ``FORMATS`` under its ``name``."""
    if cls.name in FORMATS:
        raise ValueError(f"format {cls.name!r} is registered twice")
    FORMATS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class CliParam:
    """One format parameter (a dataclass field) as a ``moetool quantize`` option; its type
    and default are the field's.

    ``flag``: "--group-size", or "--symmetric/--asymmetric" for a bool; ``positive``: an int
    that must be >= 1, refused as "--group-size 0 must be positive"."""

    flag: str
    help: str
    positive: bool = False


#: the float8 dtypes safetensors stores (detected by dtype, never by element size)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class WeightFormat:
    """One weight format. Subclasses are registered in ``moetool.formats.FORMATS``."""

    #: registry key and CLI name: "dense", "fp8-block", "fp8-channel", "int4-group"
    name: ClassVar[str]
    #: tensor suffixes of one linear; the first is the main (quantized) weight. An instance
    #: may store more (``optional_suffixes``): then its ``suffixes`` is an instance attribute
    suffixes: ClassVar[tuple[str, ...]]
    #: suffixes that only some instances store (int4-group asymmetric: ``weight_zero_point``)
    optional_suffixes: ClassVar[tuple[str, ...]] = ()
    #: False for the unquantized format: its ``weight`` is a plain tensor, its linears carry
    #: no quantization_config, and it is what quantized linears are dequantized to
    quantized: ClassVar[bool] = True
    #: logical rows per stored row of each tensor cut along N (1 for a weight, 128 for fp8
    #: block scales): what the default ``cat_rows`` / ``split_rows`` need
    row_blocks: ClassVar[dict[str, int]] = {}
    #: the dtype of the linear's ``weight`` tensor where the format fixes it (fp8 formats:
    #: float8_e4m3fn, recognised by dtype, never by element size); None: no ``weight`` tensor,
    #: or any float dtype
    weight_dtype: ClassVar[torch.dtype | None] = None

    #: expected error of dequantize(quantize(w)) against w: ``rel_err`` the largest relative
    #: Frobenius error ||w' - w|| / ||w|| allowed, ``sqnr_db`` = -20 log10(rel_err) the
    #: smallest SQNR. Measured on torch.randn weights, shapes 256x256 .. 2048x512 (and
    #: 300x384), seeds 0-9, orig_dtype bf16 (fp16 / fp32 scales measure the same; each format
    #: gives its numbers); the limit is the worst case plus about 30 %, so a real fault (a
    #: wrong scale, a swapped block) fails while seed-to-seed noise does not. Heavy-tailed real
    #: weights or fp8 activations on top add error: callers checking whole layers may widen.
    tolerance: ClassVar[dict[str, float]]
    #: ``moetool verify`` pass thresholds for shards in this format: ``rel_err`` for the whole
    #: layer (relative error of the distributed output against the fp32 reference from the
    #: unquantized checkpoint) and ``expert_rel_err`` for a single expert alone on the probe
    #: batch (its gate, up and down errors compound, so it is looser). Measured with
    #: `moetool demo --format F` (each format gives its numbers); the limits are those plus
    #: margin: an injected fault (swapped experts, a doubled scale, swapped gate/up halves)
    #: gives 0.5 - 1.5 on the expert and fails
    verify_tolerances: ClassVar[dict[str, float]]
    #: how the serving engine (vLLM) treats the activations of a linear in this format, the
    #: policy verify's served numerics follow (``moetool.verify.numerics``): "fp8-1x128" =
    #: quantized to float8_e4m3fn per token and 128-column group with float32 scales;
    #: "fp8-token" = one float32 scale per token (per-token dynamic, W8A8 per channel); both
    #: from the bf16 activations, before each expert GEMM (what verify's dispatchers send and
    #: the kernels compute with); None = they stay in the served dtype (weight-only formats)
    activation_quant: ClassVar[str | None] = None
    #: True when an expert's gate and up must be quantized together, as one w13 [2N, K] cut in
    #: two with ``split_rows`` (nvfp4: vLLM reads one global scale for the fused w13)
    joint_gate_up: ClassVar[bool] = False
    #: the scheme of the fused-MoE kernels (``moetool.kernels.moe_gemm.SCHEMES``) that reads
    #: the stacked tensors of this format; None: no kernel (verify uses the torch experts)
    kernel_scheme: ClassVar[str | None] = None

    #: the ``quant_method`` of this format's config.json ``quantization_config`` (None: the
    #: unquantized format, which has none)
    config_method: ClassVar[str | None] = None
    #: what of ``config_method`` this format reads, as "moetool reads ..." messages list it
    #: after the method ("fp8" + "with 128x128 blocks"; "compressed-tensors" + "fp8-channel")
    config_label: ClassVar[str] = ""

    #: ``moetool quantize`` flags that choose this format, besides ``--format NAME``
    cli_flags: ClassVar[tuple[str, ...]] = ()
    #: one line on the format for ``moetool quantize --help``
    cli_help: ClassVar[str] = ""
    #: the format's parameters (dataclass fields) as ``moetool quantize`` options, by field
    cli_params: ClassVar[dict[str, CliParam]] = {}

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
        t = self.quantize(w, orig_dtype)
        return (t, *error_sums(w, self.dequantize(t)))

    def stores_like(self, other: WeightFormat) -> bool:
        """True when a linear stored in this format is stored the same way in ``other``, so a
        conversion from one to the other copies its tensors (requantizing would only add error).
        Default: the same format with the same parameters; a format whose parameter only says
        how scales were chosen (int4's clip) compares without it."""
        return type(self) is type(other) and vars(self) == vars(other)

    def quantize_cuda(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors | None:
        """``quantize(w, orig_dtype)`` bit for bit for a CUDA weight w [N, K], with the
        format's Triton kernel; None where no kernel applies (this default) or the result is
        not finite: the caller then runs ``quantize``, which raises naming the problem."""
        return None

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        """[N, K] of the unquantized weight."""
        raise NotImplementedError

    def cat_rows(self, parts: list[Tensors]) -> Tensors:
        """Concatenate linears along N (w13 = gate rows then up rows); exact inverse of split_rows."""
        rows = [self.logical_shape(part)[0] for part in parts]
        return cat_row_blocked(self.name, parts, rows, self.row_blocks)

    def split_rows(self, t: Tensors, sizes: list[int]) -> list[Tensors]:
        """Split one linear along N into parts of ``sizes`` rows each. How a stacked w13
        splits into its gate and up halves (the kernels' torch reference takes this method)."""
        n, _ = self.logical_shape(t)
        return split_row_blocked(self.name, t, n, sizes, self.row_blocks)

    def quantization_config(self, ignore: list[str]) -> dict | None:
        """The config.json ``quantization_config`` for a checkpoint whose quantized linears are
        in this format and whose other linears are listed in ``ignore`` (None for dense)."""
        raise NotImplementedError

    @classmethod
    def params_from_config(cls, config: dict) -> dict | None:
        """A ``quantization_config`` whose ``quant_method`` is ``config_method`` -> this
        format's parameters (for ``get_format``), or None when it declares another format of
        that method. Raises MoetoolError for a variant of this format moetool cannot read."""
        return None

    @classmethod
    def config_mismatch(cls, config: dict, readers: list[type[WeightFormat]]) -> str:
        """The message when no format of ``config_method`` (``readers``, this one first) reads
        ``config``."""
        labels = " / ".join(r.config_label for r in readers if r.config_label)
        return f"unsupported {cls.config_method} quantization_config (moetool reads {labels})"

    @classmethod
    def recognized_without_config(cls, suffixes: set[str], weight_dtype: torch.dtype | None) -> bool:
        """True when a checkpoint with no ``quantization_config`` but these tensor suffixes
        (and this dtype of its quantized ``weight``) is in this format, its config dropped."""
        return False
