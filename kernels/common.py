"""Small pieces shared by the kernels: exact rounding helpers (``@triton.jit``) and host checks.

Rounding must match torch bit for bit on the GPU *and* under the Triton interpreter
(``TRITON_INTERPRET=1``, how the tests run on CPU). Two interpreter facts drive the helpers:

* its fp32 -> float8e4nv cast rounds wrongly (carries into the exponent are lost, ties go up),
  and its fp32 -> bfloat16 cast truncates. :func:`e4m3_rne` and :func:`round_to_bf16` therefore
  have an integer (``SOFT``) path that is exact everywhere; on the GPU the hardware
  ``cvt.rn.satfinite.e4m3x2.f32`` path is used by default (``soft_fp8=None`` picks it).
* ``tl.dot`` on bfloat16 operands returns garbage there; the GEMM kernels upcast bf16 tiles to
  fp32 when interpreted (``DOT_F32``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetool.errors import MoetoolError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_EPS = 1e-12  # amax clamp so an all-zero block gets a finite scale
FP8_BLOCK = 128  # fp8 weight blocks are 128x128, fp8 activation groups 1x128 (DeepSeek-V3)
#: an activation group size meaning one group per token: the whole row shares one fp8 scale
#: (compressed-tensors FP8_DYNAMIC, ``strategy: token``)
TOKEN_GROUP = 0
#: the float activation dtypes the MoE kernels take
FLOAT_ACTS = (torch.float16, torch.bfloat16, torch.float32)


def act_scale_cols(H: int, group: int) -> int:
    """Columns of the fp8 activation scales of a row of H values in groups of ``group``
    (TOKEN_GROUP: one per row)."""
    return 1 if group == TOKEN_GROUP else -(-H // group)


def check(cond: bool, msg: str) -> None:
    """A host wrapper's argument check: raise MoetoolError(msg) unless ``cond``."""
    if not cond:
        raise MoetoolError(msg)


def is_interpreted(fn) -> bool:
    """True when ``fn`` (a ``@triton.jit`` object) runs in the Triton interpreter: the choice is
    made when the function is decorated, from TRITON_INTERPRET."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


def check_device(fn, *tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise MoetoolError(f"kernel inputs are on different devices: {sorted(map(str, devices))}")
    dev = devices.pop()
    if dev.type != "cuda" and not is_interpreted(fn):
        raise MoetoolError(
            f"Triton kernels need CUDA tensors (got {dev}); on CPU set TRITON_INTERPRET=1 "
            "before importing moetool.kernels"
        )


def check_2d_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise MoetoolError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise MoetoolError(f"{name} must be contiguous")


def check_float(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise MoetoolError(f"{name} must be fp32/fp16/bf16, got {t.dtype}")


@triton.jit
def e4m3_rne(x, SOFT: tl.constexpr):
    """fp32 x with |x| <= 448 (already clamped, no NaN) -> float8_e4m3fn, round to nearest even.

    SOFT: returns the e4m3 bits as uint8 from integer math (exact under the interpreter and on
    GPU); otherwise the hardware cast (exact on sm_89+, wrong under the interpreter).
    """
    if SOFT:
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        # normal range |x| >= 2^-6: drop 20 mantissa bits with RNE, rebias exponent 127 -> 7
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
        # subnormal range: multiples of 2^-9; |x|*512 < 8 is exact, +/- 2^23 rounds RNE
        sub = ((tl.abs(x) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        mag = tl.where(a < 0x3C800000, sub, normal)
        return (mag | sign).to(tl.uint8)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bfloat16 value (RNE), still as fp32. Exact on GPU and interpreter."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rint_small(x):
    """Round half to even for |x| < 2^22 (callers clamp first). The sign of a zero result is
    not kept: callers convert to int."""
    return (x + 12582912.0) - 12582912.0


def check_rank(what: str, me: int, R: int) -> None:
    """``me`` names one of ``R`` ranks (its peer buffers are indexed by it on the device)."""
    if not 0 <= me < R:
        raise MoetoolError(f"{what}: rank {me} is not in [0, {R})")


class PeerBuffers:
    """One buffer as every rank of a world sees it: ``views[r]`` aliases rank r's copy (peer
    memory mapped into this process: CUDA symmetric memory over NVLink, or shared memory
    between CPU processes in the tests) and ``addresses`` holds their data pointers, int64 [R]
    on the device the kernels run on, what a kernel storing to another rank reads."""

    def __init__(self, views: list[torch.Tensor], device: torch.device):
        if not views or any(v.dtype != views[0].dtype or v.shape != views[0].shape or not v.is_contiguous()
                            for v in views):
            raise MoetoolError("peer buffers must be contiguous views of one shape and dtype, one per rank")
        self.views = tuple(views)
        self.addresses = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return len(self.views)
