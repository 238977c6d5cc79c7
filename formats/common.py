"""Checks and row operations shared by the format modules.

Messages are written to follow a tensor or linear name that the caller puts in front
("model.layers.0.mlp.experts.3.down_proj.weight contains NaN/Inf ..."), so they start in
lower case and never name the tensor themselves.
"""
from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Sequence
from typing import ClassVar

import torch

from moetool.errors import MoetoolError
from moetool.memory import scratch

#: one linear's tensors by suffix (``weight``, ``weight_scale_inv``...)
Tensors = dict[str, torch.Tensor]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_weight(w: torch.Tensor, reduced: torch.Tensor | None = None) -> None:
    """A weight about to be quantized: 2-D, floating point, every value finite.

    ``reduced``: a max/min reduction of w the caller computed anyway (they propagate NaN and
    Inf); when given and finite, the full pass over w is skipped."""
    check_weight_shape(w)
    if reduced is not None and bool(torch.isfinite(reduced).all()):
        return
    finite = torch.isfinite(w)
    if not bool(finite.all()):
        bad = w.numel() - int(finite.sum())
        raise MoetoolError(f"contains NaN/Inf ({bad} of {w.numel()} values)")


_E4M3_TABLE: dict[torch.device, torch.Tensor] = {}


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, exactly ``q.float()``; on CPU through a 256-entry table
    (5x faster than torch's element-wise fp8 conversion there)."""
    if q.device.type != "cpu":
        return q.float()
    return e4m3_table(q.device).index_select(0, q.view(torch.uint8).reshape(-1).int()).view(q.shape)


#: elements of one band of rows that the fused CPU quantizers process at a time: their
#: float32 temporaries (a few such bands per thread) are reused. Two converting threads in
#: one process hand the GIL over at every torch call, so fewer, larger bands convert faster
#: there even though 256K elements are as fast for one thread alone (2 cores, in-process
#: quantize of the bench input, interleaved runs: fp8-block 1.19-1.36 s at 256K, 1.20-1.25
#: at 512K, 1.23-1.35 at 1M; int4 1.12-1.22 -> 0.91-0.96 at 512K)
BAND_ELEMENTS = 1 << 19

def band_rows(n: int, k: int, multiple: int = 1) -> int:
    """Rows per band of an [N, K] weight: about ``BAND_ELEMENTS`` elements, a multiple of
    ``multiple`` rows (a block height), at most N rounded up to that multiple."""
    rows = max(1, BAND_ELEMENTS // max(k, 1)) // multiple * multiple
    return min(max(rows, multiple), ceil_div(n, multiple) * multiple)


#: elements of one tile of the scripted CPU quantizers (``scripted``): their float32
#: temporaries, the tile's input, codes and int16 scratch (13 bytes an element, 1.7 MB) stay in
#: a core's 2 MB L2 across a tile's dozen passes. One 3584 x 1024 fp8-block linear on one core
#: of the 2-core Xeon: 8.1 ms in 128K-element tiles, 9.1 at 256K, 10.2 at 512K (eager torch)
TILE_ELEMENTS = 1 << 17


def tile_rows(n: int, k: int) -> int:
    """Rows per tile of an [N, K] weight cut into whole rows: about ``TILE_ELEMENTS`` elements."""
    return max(1, min(n, TILE_ELEMENTS // max(k, 1)))


def block_tile(n: int, k: int, block: int) -> tuple[int, int]:
    """(rows, cols) of the tiles an [N, K] weight of ``block`` x ``block`` blocks is cut into
    (N and K multiples of ``block``): whole rows of about ``TILE_ELEMENTS`` elements, a multiple
    of ``block`` rows; where one block row is larger than that, one block row of column chunks."""
    if k * block <= TILE_ELEMENTS:
        rows = max(block, TILE_ELEMENTS // k // block * block)
        return min(rows, n), k
    return block, min(k, max(block, TILE_ELEMENTS // block // block * block))


class scripted:
    """Decorator: ``fn`` compiled by TorchScript on its first call, where it compiles (else
    ``fn`` itself: the same ops run eagerly, the same bytes). The CPU quantizers run a weight's
    tiles as one such call. Torch ops called from Python take the GIL back after each op, so
    two converting threads hand it to each other a dozen times per tile, and each hand-over
    wakes the other core (tens of µs in this VM); compiled, the loop runs with the GIL
    released: 3584 x 1024 fp8-block linears on two threads of the 2-core Xeon, 3.4 ms a linear
    against 9.4 eager in the same tiles (5.9 eager in bands of 512K elements). Compiling takes
    ~10 ms. ``torch.jit.script`` is deprecated in torch 2.x, yet present; it needs the
    function's source (a .py file)."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        compiled = self._compiled
        if compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = _script(self.fn)
                compiled = self._compiled
        if compiled is self.fn:  # eager
            return compiled(*args)
        # unoptimized: the profiling runs and graph passes of the first calls took ~25 ms of
        # start-up, and ran no faster after (6.5 ms a 3584 x 1024 linear either way)
        with torch.jit.optimized_execution(False):
            return compiled(*args)


def _script(fn):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.script(fn)
    except Exception:  # no TorchScript, or no source to compile
        return fn


def error_sums(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(sum ref^2, sum (got - ref)^2) in float32 per element, accumulated as Python floats.
    ``got`` is overwritten when it is float32 (a fresh dequantized copy)."""
    ref = ref.float().reshape(-1)
    diff = got.float().reshape(-1)
    diff = diff.sub_(ref) if diff.data_ptr() == got.data_ptr() else diff - ref
    return float(torch.dot(ref, ref)), float(torch.dot(diff, diff))


def e4m3_table(device: torch.device) -> torch.Tensor:
    """float32 [256]: the value of every float8_e4m3fn bit pattern."""
    table = _E4M3_TABLE.get(device)
    if table is None:
        table = _E4M3_TABLE[device] = torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()
    return table


def e4m3_dequantize_band(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale`` into ``out``, exactly, for a band of e4m3 codes (CPU).

    ``q`` float8_e4m3fn, any shape; ``scale`` float32, broadcastable to it, finite and below
    2**120 (the fp8 quantizers' scales are amax / 448, at most float32 max / 448 < 2**119.2);
    ``out`` float32 of q's shape (overwritten); ``bits`` a buffer of at least q's size in
    int16 (the callers pass an int32 one).

    The code read as int8 and shifted left by 7 in int16 holds its magnitude in bits 7..13
    of a float16; a negative code (sign bit set, so sign-extended) also has bits 14 and 15
    set, and clearing bit 14 (never part of a magnitude: exponents stay below 16) leaves the
    sign in bit 15. That float16 is exactly q * 2**-8 (normals and subnormals alike: the
    exponent biases of e4m3 and float16 differ by 8), its conversion to float32 is exact, and
    so is 256 * s: q * s is that float times (256 * s), rounded once as q.float() * s, signed
    zeros included. NaN codes are not handled (the caller rejects non-finite weights). Three
    int16 passes, a conversion and a multiply (a fourth int16 pass carried the sign before:
    ~25 µs more per band of 512K elements; a 256-entry table lookup is 3x slower)."""
    h = bits.view(torch.int16)[: q.numel()].view(q.shape)
    h.copy_(q.view(torch.int8))  # the code, sign-extended
    h.bitwise_left_shift_(7)
    h.bitwise_and_(~(1 << 14))
    out.copy_(h.view(torch.float16))  # q * 2**-8
    return out.mul_(scale * 256.0)


def fp8_band_buffers(elements: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This thread's reused buffers of the fp8 band quantizers, ``elements`` each:
    (ref float32, work float32, bits int32)."""
    return (scratch("ref", elements, torch.float32), scratch("work", elements, torch.float32),
            scratch("index", elements, torch.int32))


def fp8_band_error(ref: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, work: torch.Tensor,
                   bits: torch.Tensor) -> tuple[float, float]:
    """(sum ref^2, sum (q * scale - ref)^2) of one band, in float32 per element. ``ref`` float32
    flat; ``q``, ``scale``, ``work`` as :func:`e4m3_dequantize_band` (``work`` is overwritten);
    ``bits`` a flat int32 buffer of the band's size."""
    sig = float(torch.dot(ref, ref))
    e4m3_dequantize_band(q, scale, work, bits)  # q.float() * scale
    diff = work.view(-1).sub_(ref)
    return sig, float(torch.dot(diff, diff))


def check_weight_shape(w: torch.Tensor) -> None:
    """2-D and floating point (the cheap part of ``check_weight``)."""
    if w.dim() != 2:
        raise MoetoolError(f"is not a 2-D weight [N, K]: shape {list(w.shape)}")
    if not w.is_floating_point():
        raise MoetoolError(f"has dtype {w.dtype}, expected a floating point weight")


def abs_max(x: torch.Tensor, dim) -> torch.Tensor:
    """max |x| over ``dim`` without an |x| temporary (two reductions; NaN propagates)."""
    return torch.maximum(x.amax(dim=dim), x.amin(dim=dim).neg())


def abs_max_bits(x: torch.Tensor, dim, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``abs_max(x, dim)`` into ``out`` (float32), for contiguous float32 ``x``: the sign bits
    cleared into ``scratch`` (float32, at least x's size, overwritten), then one integer max. The bits of
    non-negative floats order as their values, so the result is the same number (zeros as
    +0.0; a NaN in ``x`` gives a NaN, infinities infinity). One masking pass and one
    reduction instead of two reductions: 65 against 89 µs per band of 512K elements here."""
    magnitudes = scratch.view(torch.int32)[: x.numel()].view(x.shape)
    torch.bitwise_and(x.view(torch.int32), 0x7FFFFFFF, out=magnitudes)
    torch.amax(magnitudes, dim=dim, out=out.view(torch.int32))
    return out


def scale_in_dtype(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 scales to ``dtype`` (the dtype they are stored in) and back to float32.

    Scales are first raised to the smallest positive number of ``dtype`` (its smallest
    subnormal) so none rounds to zero. That changes nothing a plain ``.to(dtype)`` would keep
    nonzero; in practice it only acts for fp16 and blocks of amax below about 1e-5."""
    info = torch.finfo(dtype)
    rounded = scale.clamp(min=info.tiny * info.eps).to(dtype)
    if not bool(torch.isfinite(rounded).all()):
        raise MoetoolError(f"has values too large for {dtype} scales")
    return rounded.float()


def check_suffixes(format_name: str, t: Tensors, suffixes: Sequence[str]) -> None:
    """``t`` holds exactly the tensors ``suffixes`` of one linear."""
    missing = [s for s in suffixes if s not in t]
    if missing:
        raise MoetoolError(
            f"is missing {', '.join(missing)} ({format_name} stores {', '.join(suffixes)})"
        )
    unexpected = sorted(set(t) - set(suffixes))
    if unexpected:
        raise MoetoolError(
            f"has unexpected {', '.join(unexpected)} for {format_name} "
            f"(which stores {', '.join(suffixes)})"
        )


def check_tensor(
    t: Tensors,
    suffix: str,
    shape: Sequence[int],
    dtypes: Sequence[torch.dtype] | None = None,
    floating: bool = False,
) -> torch.Tensor:
    """``t[suffix]`` with the given shape and one of ``dtypes`` (or any float dtype)."""
    tensor = t[suffix]
    if tuple(tensor.shape) != tuple(shape):
        raise MoetoolError(
            f"{suffix} has shape {list(tensor.shape)}, expected {list(shape)}"
        )
    if dtypes is not None and tensor.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise MoetoolError(f"{suffix} has dtype {tensor.dtype}, expected {expected}")
    if floating and not tensor.is_floating_point():
        raise MoetoolError(f"{suffix} has dtype {tensor.dtype}, expected a float dtype")
    return tensor


def cat_row_blocked(
    format_name: str, parts: list[Tensors], rows: list[int], rows_per_stored_row: dict[str, int]
) -> Tensors:
    """Concatenate along dim 0 tensors that store ``rows_per_stored_row[suffix]`` logical rows
    per row (1 for a weight, 128 for fp8 block scales, 8 for int4 zero points packed along N).

    ``rows[i]`` is the logical N of ``parts[i]``. A stored row may only straddle parts at the
    very end, so every part but the last must have N divisible by each block height."""
    if not parts:
        raise MoetoolError(f"{format_name}: nothing to concatenate")
    _check_inner_boundaries(format_name, rows, rows_per_stored_row)
    for suffix in rows_per_stored_row:
        first = parts[0][suffix]
        for part in parts[1:]:
            other = part[suffix]
            if other.shape[1:] != first.shape[1:] or other.dtype != first.dtype:
                raise MoetoolError(
                    f"{format_name}: cannot concatenate {suffix} {list(first.shape)} "
                    f"{first.dtype} with {list(other.shape)} {other.dtype}"
                )
    return {
        suffix: torch.cat([part[suffix] for part in parts], dim=0)
        for suffix in rows_per_stored_row
    }


def split_row_blocked(
    format_name: str,
    t: Tensors,
    n: int,
    sizes: list[int],
    rows_per_stored_row: dict[str, int],
) -> list[Tensors]:
    """Inverse of ``cat_row_blocked``: slice each tensor of a linear with N = ``n`` rows."""
    if any(size <= 0 for size in sizes) or sum(sizes) != n:
        raise MoetoolError(f"cannot split N={n} rows into parts of {sizes} rows")
    _check_inner_boundaries(format_name, sizes, rows_per_stored_row)
    parts: list[Tensors] = []
    start = 0
    for size in sizes:
        end = start + size
        parts.append(
            {
                suffix: t[suffix][start // block : ceil_div(end, block)].clone()
                for suffix, block in rows_per_stored_row.items()
            }
        )
        start = end
    return parts


def _check_inner_boundaries(
    format_name: str, rows: list[int], rows_per_stored_row: dict[str, int]
) -> None:
    for suffix, block in rows_per_stored_row.items():
        for n in rows[:-1]:
            if n % block:
                raise MoetoolError(
                    f"{format_name}: a part of N={n} rows is not a multiple of {block}, "
                    f"so its {suffix} rows cannot be joined exactly (parts: {rows})"
                )


# ------------------------------------------------------------------- compressed-tensors configs


class CompressedTensors:
    """Mixin of the formats that compressed-tensors stores (``quant_method``
    "compressed-tensors", one config group). A format names the weights it reads,
    ``ct_weights`` = (type, num_bits, strategy), and the ``format`` values it is stored
    under, ``ct_storage``; ``params_from_weights`` reads the rest of the group's weights."""

    config_method: ClassVar[str | None] = "compressed-tensors"
    ct_weights: ClassVar[tuple[str, int, str]]
    ct_storage: ClassVar[tuple[str, ...]]

    @classmethod
    def params_from_config(cls, config: dict) -> dict | None:
        weights, storage = compressed_tensors_group(config)
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind != cls.ct_weights or storage not in cls.ct_storage:
            return None
        return cls.params_from_weights(weights)

    @classmethod
    def params_from_weights(cls, weights: dict) -> dict:
        """The group's ``weights`` arguments -> the format's parameters."""
        return {}

    @classmethod
    def config_mismatch(cls, config: dict, readers: list) -> str:
        weights, storage = compressed_tensors_group(config)
        described = ", ".join(f"{key} {weights.get(key)}" for key in ("type", "num_bits", "strategy"))
        reads = " and ".join(f"{r.ct_storage[0]} {_weights_kind(r.ct_weights)}" for r in readers)
        return (f"unsupported compressed-tensors quantization_config: format {storage}, weights "
                f"{described} (moetool reads {reads})")


def compressed_tensors_group(config: dict) -> tuple[dict, str | None]:
    """A compressed-tensors ``quantization_config`` -> (its one group's ``weights`` arguments,
    its storage ``format``). Several groups, or a group given as a preset name, raise."""
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise MoetoolError("unsupported compressed-tensors quantization_config: config_groups is not a JSON object")
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
    return scheme.get("weights") or {}, scheme.get("format") or config.get("format")


def _weights_kind(kind: tuple[str, int, str]) -> str:
    """("float", 8, "channel") -> "fp8 channel"."""
    kind_type, bits, strategy = kind
    return f"{'fp' if kind_type == 'float' else kind_type}{bits} {strategy}"
