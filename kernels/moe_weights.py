"""The stacked expert weights the fused-MoE kernels read, per weight scheme: the scheme table,
the host-side checks (:func:`parse_weights`) and the torch reference's reading
(:func:`dequantize_stacked`).

Letters: E = local experts, N = expert intermediate size, H = hidden size, g = int4 group
size, P = global scales of one nvfp4 linear (rows R / P each). Stacked tensors have a leading dim E; "logical" [R, C] is [2N, H] for w13 (gate rows,
then up rows), [H, N] for w2. The schemes (a weight format names its scheme as
``kernel_scheme``; the kernels never import the formats):

  dense        weight [E, R, C] float
  fp8-block    weight e4m3 [E, R, C]; weight_scale_inv fp32 [E, ceil(R/128), ceil(C/128)], for w13
               gate and up blocks stacked separately: [E, 2*ceil(N/128), ceil(H/128)]  (W8A8)
  fp8-channel  weight e4m3 [E, R, C]; weight_scale [E, R, 1]        (W8A8, per-token activations)
  int4-group   weight_packed int32 [E, R, ceil(C/8)]; weight_scale [E, R, ceil(C/g)];
               weight_shape [E, 2] (not read); optional weight_zero_point int32
               [E, ceil(R/8), ceil(C/g)] packed along R (w13: over all 2N rows)       (W4A16)
  nvfp4        weight_packed uint8 [E, R, C/2] (e2m1 codes, element 2j of a row in the low
               nibble of byte j); weight_scale float8_e4m3fn [E, R, C/16]; weight_global_scale
               fp32 [E, P], the divisor of the group scales of rows [p*R/P, (p+1)*R/P) (a w13
               stacked from gate and up: P = 2, gate then up; w2: P = 1)             (W4A16)
  mxfp4        weight_packed uint8 [E, R, C/2] (as nvfp4); weight_scale uint8 [E, R, C/32], e8m0
               exponents: w = e2m1 * 2^(scale - 127)                                 (W4A16)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from .common import FLOAT_ACTS, FP8_BLOCK, TOKEN_GROUP, check


@dataclass(frozen=True)
class Scheme:
    """How the kernels read one scheme's stacked tensors."""

    code: int  # the FMT constexpr of moetool.kernels.moe_gemm._moe_gemm_kernel
    main: str  # the tensor holding the weights, [E, R, C] (int4: packed words [E, R, C/8])
    #: W8A8: the activation group the GEMMs consume, e4m3 codes with one fp32 scale per token
    #: and ``act_group`` columns (TOKEN_GROUP: per token, the whole row); None: weight-only
    #: (activations stay in their float dtype)
    act_group: int | None = None
    groups: bool = False  # weights scaled per group of g columns along K (g a parameter: int4)
    #: fp4: the scheme's own group of columns per scale (fixed); BLOCK_K must be a multiple of it
    fp4_group: int | None = None
    shape_key: str | None = None  # a tensor of logical shapes [E, 2], never read by the GEMM

    @property
    def fp8_acts(self) -> bool:
        """W8A8: activations are quantized to e4m3 (per ``act_group``) before each GEMM."""
        return self.act_group is not None


SCHEMES = {
    "dense": Scheme(0, "weight"),
    "fp8-block": Scheme(1, "weight", act_group=FP8_BLOCK),
    "fp8-channel": Scheme(2, "weight", act_group=TOKEN_GROUP),
    "int4-group": Scheme(3, "weight_packed", groups=True, shape_key="weight_shape"),
    "nvfp4": Scheme(4, "weight_packed", fp4_group=16),
    "mxfp4": Scheme(4, "weight_packed", fp4_group=32),
}


@dataclass
class StackedWeights:
    """One stacked linear, checked: logical [E, R, C] in the scheme of kernel code ``fmt``."""

    fmt: int
    main: torch.Tensor  # weight / weight_packed
    scale: torch.Tensor | None
    zp: torch.Tensor | None
    act_group: int | None = None  # the scheme's ``Scheme.act_group``: what the GEMM's A must be
    #: fp4: the scheme's group (``Scheme.fp4_group``); nvfp4 also its global scales fp32 [E, P]
    fp4_group: int | None = None
    global_scale: torch.Tensor | None = None
    #: C, the logical columns (the GEMM's K), which the activations' width must equal
    cols: int | None = None


def parse_weights(scheme: str, t: dict, name: str, E: int, R: int, C: int, group_size: int,
                  split_rows: int | None) -> StackedWeights:
    """Validate the stacked tensors of ``name`` (w13 / w2), logical [E, R, C], in ``scheme``
    (module docstring). split_rows: N of a w13 whose gate and up halves of N rows each carry
    their own fp8 block scale rows."""
    for key, v in t.items():
        check(isinstance(v, torch.Tensor), f"{name}[{key!r}] is not a tensor")
        check(key == "weight_shape" or v.is_contiguous(), f"{name}[{key!r}] must be contiguous")

    def need(key, shape, dtypes=None, floating=False):
        check(key in t, f"{name} ({scheme}) is missing {key!r}")
        v = t[key]
        check(tuple(v.shape) == tuple(shape), f"{name}[{key!r}] has shape {list(v.shape)}, expected {list(shape)}")
        if dtypes is not None:
            check(v.dtype in dtypes, f"{name}[{key!r}] has dtype {v.dtype}, expected {dtypes}")
        if floating:
            check(v.dtype in FLOAT_ACTS, f"{name}[{key!r}] has dtype {v.dtype}, expected a float dtype")
        return v

    code, act_group = SCHEMES[scheme].code, SCHEMES[scheme].act_group
    if scheme == "dense":
        return StackedWeights(code, need("weight", (E, R, C), floating=True), None, None, cols=C)
    if scheme == "fp8-block":
        nb = triton.cdiv(C, FP8_BLOCK)
        rb = triton.cdiv(R, FP8_BLOCK) if split_rows is None else 2 * triton.cdiv(split_rows, FP8_BLOCK)
        w = need("weight", (E, R, C), [torch.float8_e4m3fn])
        return StackedWeights(code, w, need("weight_scale_inv", (E, rb, nb), [torch.float32]), None, act_group, cols=C)
    if scheme == "fp8-channel":
        w = need("weight", (E, R, C), [torch.float8_e4m3fn])
        return StackedWeights(code, w, need("weight_scale", (E, R, 1), floating=True), None, act_group, cols=C)
    if SCHEMES[scheme].fp4_group is not None:
        g = SCHEMES[scheme].fp4_group
        check(C % g == 0, f"{name} ({scheme}) has {C} columns, not whole groups of {g}")
        w = need("weight_packed", (E, R, C // 2), [torch.uint8])
        if scheme == "mxfp4":
            return StackedWeights(code, w, need("weight_scale", (E, R, C // g), [torch.uint8]), None, fp4_group=g,
                                  cols=C)
        s = need("weight_scale", (E, R, C // g), [torch.float8_e4m3fn])
        check("weight_global_scale" in t, f"{name} ({scheme}) is missing 'weight_global_scale'")
        gs = t["weight_global_scale"]
        P = gs.shape[1] if gs.dim() == 2 and gs.shape[0] == E else 0
        check(P > 0 and R % P == 0 and gs.dtype == torch.float32,
              f"{name}['weight_global_scale'] has {gs.dtype} {list(gs.shape)}, expected float32 [{E}, P] "
              f"with P dividing its {R} rows")
        return StackedWeights(code, w, s, None, fp4_group=g, global_scale=gs, cols=C)
    # int4-group
    check(group_size > 0, f"{name} (int4-group): group_size must be positive, got {group_size}")
    G = triton.cdiv(C, group_size)
    w = need("weight_packed", (E, R, triton.cdiv(C, 8)), [torch.int32])
    s = need("weight_scale", (E, R, G), floating=True)
    if "weight_shape" in t:
        check(tuple(t["weight_shape"].shape) in ((E, 2), (2,)), f"{name}['weight_shape'] must be [E, 2]")
    zp = need("weight_zero_point", (E, triton.cdiv(R, 8), G), [torch.int32]) if "weight_zero_point" in t else None
    return StackedWeights(code, w, s, zp, cols=C)


def dequantize_stacked(scheme: str, t: dict[str, torch.Tensor], e: int, rows: int, cols: int,
                       dequantize: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                       split_rows: Callable[[dict[str, torch.Tensor], list[int]], list[dict]] | None = None,
                       ) -> torch.Tensor:
    """Expert e of stacked tensors ``t`` in ``scheme`` (logical [E, rows, cols]) -> fp32
    [rows, cols], through the weight format's own functions (the one definition of its
    dequantization), which the caller passes:

    dequantize: one expert's 2-D tensors -> fp32 (``WeightFormat.dequantize``);
    split_rows: for a w13, (tensors, [N, N]) -> [gate, up] (``WeightFormat.split_rows``): each
    half is dequantized on its own, as the format stacked them (fp8-block scales the gate and
    up blocks apart when N % 128 != 0).
    """
    check(scheme in SCHEMES, f"unknown weight format {scheme!r} (known: {', '.join(SCHEMES)})")
    shape_key = SCHEMES[scheme].shape_key
    one = {key: v[e] for key, v in t.items() if key != shape_key}
    if shape_key is not None:
        one[shape_key] = torch.tensor([rows, cols], dtype=torch.int32)
    parts = split_rows(one, [rows // 2] * 2) if split_rows is not None else [one]
    return torch.cat([dequantize(part) for part in parts])
