"""Tile tuner of the fused-MoE GEMMs on one CUDA GPU: writes kernels/tiles/<GPU>.json, the table
``moetool.kernels.moe_tiles.select_config`` reads (not a test: pytest never collects it).

    python bench/tune.py                       # the issue-17 shapes, T 1 16 128 512 4096
    python bench/tune.py --layers mixtral --schemes dense --tokens 1 128
    python bench/tune.py --list                # the candidates per cell, no GPU needed

Per cell (layer, scheme, T) every candidate MoeConfig runs through the real
``fused_experts(..., config=cfg)``, first checked against the old default's output on the same
inputs (SQNR >= MIN_AGREE_DB) and against itself (a second run must give the same bits): a tile
the compiler gets wrong, or one that races, is reported and skipped; the align step is computed once outside the timed region
(``fixed_align``), the rest is captured in a CUDA graph and replayed with L2 flushed before
each replay (``time_graph``: median of --reps). The fastest candidate per cell goes to the
table (its time as the note "us"); the old ``default_config`` and ``rule_config`` are always
among the candidates, so a table entry is never slower than either (on that run).
Candidates are compiled first by --jobs worker processes (Triton's cache on disk is shared), so
the sweep itself only times.

Layers (one EP rank, linear placement: rank 0 owns experts [0, E/ep)); the T tokens rank 0
receives from the all2all dispatcher: each picked k distinct experts uniformly among E_global,
at least one on rank 0; ids of other ranks' experts are -1 (``routing``):
  dsv3-ep8   DeepSeek-V3 experts over 8 ranks: 32 local of 256, H 7168, N 2048, top-8
  dsv3-256   all 256 DeepSeek-V3 experts on one GPU
  mixtral    Mixtral 8x7B: 8 experts, H 4096, N 14336, top-2
Letters: T tokens, H hidden, N intermediate, E local experts, k top-k, P = T*k pairs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Layer:
    E_global: int
    ep: int
    H: int
    N: int
    k: int

    @property
    def E(self) -> int:  # experts on rank 0
        return self.E_global // self.ep


LAYERS = {
    "dsv3-ep8": Layer(256, 8, 7168, 2048, 8),
    "dsv3-256": Layer(256, 1, 7168, 2048, 8),
    "mixtral": Layer(8, 1, 4096, 14336, 2),
}
#: the cells of issue 17's table: (layer, scheme) -> token counts
CELLS = {
    ("dsv3-ep8", "dense"): (1, 16, 128, 512, 4096),
    ("dsv3-ep8", "fp8-block"): (1, 16, 128, 512, 4096),
    ("dsv3-256", "fp8-block"): (1, 128, 4096),
    ("mixtral", "dense"): (1, 128, 4096),
    ("mixtral", "fp8-block"): (1, 128, 4096),
    ("dsv3-ep8", "int4-group"): (1, 128, 4096),
    ("dsv3-ep8", "fp8-channel"): (1, 128, 4096),  # not in the table: W8A8 per token x channel
    ("dsv3-ep8", "nvfp4"): (1, 16, 128, 4096),  # W4A16 fp4 (issue 16): weights dequantized in registers
    ("dsv3-ep8", "mxfp4"): (1, 16, 128, 4096),
}
TUNE_TOKENS = (1, 16, 128, 512, 4096)
SCHEMES_TUNED = ("dense", "fp8-block", "int4-group", "fp8-channel", "nvfp4", "mxfp4")
FP4 = ("nvfp4", "mxfp4")
INT4_GROUP = 128


def make_weights(scheme: str, E: int, H: int, N: int, device, group: int = INT4_GROUP, seed: int = 0,
                 chunk: int = 32, dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """Random experts (dtype * 0.02, made chunk experts at a time) stacked in ``scheme``:
    (w13 logical [E, 2N, H], w2 [E, H, N]). fp8-block: 128 x 128 blocks (gate and up rows apart,
    as N % 128 == 0 here); fp8-channel: one scale per row, in dtype; int4: symmetric groups of
    ``group``, scales in dtype; nvfp4: each expert's gate, up and down with their own global
    scale (w13's [E, 2]); mxfp4: e8m0 scales per 32."""
    from moetool.kernels.fp4_quant import mxfp4_quant, nvfp4_quant
    from moetool.kernels.int4_quant import int4_group_quant_pack
    from moetool.kernels.quant import fp8_block_quant

    gen = torch.Generator(device=device).manual_seed(seed)

    def one(R, C, halves):
        parts = []
        for e0 in range(0, E, chunk):
            n = min(chunk, E - e0)
            w = torch.randn(n * R, C, device=device, dtype=dtype, generator=gen) * 0.02  # [n*R, C]
            if scheme == "dense":
                parts.append({"weight": w.view(n, R, C)})
            elif scheme == "fp8-block":
                q, s = fp8_block_quant(w)  # R % 128 == 0: no block straddles two experts
                parts.append({"weight": q.view(n, R, C), "weight_scale_inv": s.view(n, R // 128, -1)})
            elif scheme == "fp8-channel":
                s = (w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448).to(dtype)  # [n*R, 1]
                q = (w.float() / s.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
                parts.append({"weight": q.view(n, R, C), "weight_scale": s.view(n, R, 1)})
            elif scheme == "int4-group":
                p = int4_group_quant_pack(w, group, True, dtype)
                parts.append({"weight_packed": p["weight_packed"].view(n, R, -1),
                              "weight_scale": p["weight_scale"].view(n, R, -1)})
            elif scheme in FP4:  # per expert and, for nvfp4, per half of a w13 (gate, up)
                quant = nvfp4_quant if scheme == "nvfp4" else mxfp4_quant
                q = [quant(part.contiguous()) for part in w.view(n * halves, R // halves, C)]
                one_part = {key: torch.stack([t[key] for t in q]) for key in q[0]}  # [n*halves, R/halves, ...]
                part = {"weight_packed": one_part["weight_packed"].view(n, R, -1),
                        "weight_scale": one_part["weight_scale"].view(n, R, -1)}
                if scheme == "nvfp4":
                    part["weight_global_scale"] = one_part["weight_global_scale"].view(n, halves)
                parts.append(part)
            else:
                raise SystemExit(f"tune.py: no weights for scheme {scheme!r}")
            del w
        return {key: torch.cat([p[key] for p in parts]).contiguous() for key in parts[0]}

    return one(2 * N, H, 2), one(H, N, 1)


def weight_bytes_per_expert(w13: dict, w2: dict) -> int:
    return sum(v[0].numel() * v.element_size() for v in (*w13.values(), *w2.values()))


def routing(T: int, layer: Layer, device, seed: int = 0):
    """T tokens as rank 0 receives them: each picked k distinct experts of E_global uniformly,
    and at least one of them is on rank 0 (the all2all dispatcher sends no other token; with
    ep == 1 every token qualifies) -> (global ids int32 [T, k], local ids int32 [T, k] with -1
    for other ranks' experts, weights fp32 [T, k] summing to 1 per token)."""
    gen = torch.Generator(device=device).manual_seed(1000 + seed)
    ids = torch.empty(T, layer.k, dtype=torch.int64, device=device)
    todo = torch.arange(T, device=device)
    while todo.numel():
        ids[todo] = torch.rand(todo.numel(), layer.E_global, device=device, generator=gen).topk(layer.k, dim=1).indices
        todo = todo[(ids[todo] >= layer.E).all(dim=1)]  # no local expert: draw again
    ids = ids.to(torch.int32).contiguous()
    local = torch.where(ids < layer.E, ids, -1).to(torch.int32).contiguous()
    w = torch.rand(T, layer.k, device=device, generator=gen)
    return ids, local, (w / w.sum(1, keepdim=True)).float().contiguous()


@contextlib.contextmanager
def fixed_align():
    """Within: fused_experts' align step runs once per (ids, block_m) and is reused after, so
    a captured graph holds only the GEMM pipeline (both sides of bench/vs_vllm.py keep theirs
    outside the timed region)."""
    from moetool.kernels import fused_moe as fm

    real = fm.moe_align_block_size
    done: dict = {}

    def aligned(topk_ids, block_m, num_experts):
        key = (topk_ids.data_ptr(), tuple(topk_ids.shape), block_m, num_experts)
        if key not in done:
            done[key] = real(topk_ids, block_m, num_experts)
        return done[key]

    fm.moe_align_block_size = aligned
    try:
        yield
    finally:
        fm.moe_align_block_size = real


_FLUSH: list = []
#: flush the L2 by overwriting the buffer, as the earlier tables did: it leaves the L2 full of
#: dirty lines, whose write-back the timed kernels then pay as they read (DSV3 EP8 fp8-block T=1
#: on an H100: 85.0 us, 76.1 us after a reading flush); for comparisons (``--flush-by-writing``)
FLUSH_BY_WRITING = False


def flush_l2() -> None:
    """Read a buffer of twice the GPU's L2, so no weight or input stays cached and the L2
    holds only clean lines (``FLUSH_BY_WRITING``: overwrite it instead)."""
    if not _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 64 << 20
        _FLUSH.append(torch.ones(2 * l2 // 4, dtype=torch.int32, device="cuda"))
    if FLUSH_BY_WRITING:
        _FLUSH[0].zero_()
    else:
        _FLUSH[0].amax()


def _captured(fn, warmup: int) -> torch.cuda.CUDAGraph:
    """``fn`` run ``warmup`` times and once on a side stream (allocations and compilation out
    of the way), then captured as a CUDA graph."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn, reps: int = 50, warmup: int = 2) -> dict:
    """Median microseconds of ``fn`` (no host synchronisation inside) as one CUDA graph replay,
    L2 flushed before each; also the 10th / 90th percentiles."""
    graph = _captured(fn, warmup)
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    graph.replay()
    for start, end in ev:
        flush_l2()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in ev)
    del graph
    return {"us": statistics.median(us), "p10": us[len(us) // 10], "p90": us[(9 * len(us)) // 10]}


def time_graphs(fns: dict, reps: int = 50, warmup: int = 2) -> dict:
    """Median microseconds of each of ``fns`` ({name: fn}, as :func:`time_graph` takes them),
    each captured in its own CUDA graph and replayed in turns, one replay of each per round (L2
    flushed before each): a drift of the GPU's clocks or temperature during the run falls on all
    of them alike, not on whichever runs last -> {name: us}."""
    graphs = {name: _captured(fn, warmup) for name, fn in fns.items()}
    for graph in graphs.values():
        graph.replay()
    ev = {name: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
          for name in graphs}
    for r in range(reps):
        for name, graph in graphs.items():
            start, end = ev[name][r]
            flush_l2()
            start.record()
            graph.replay()
            end.record()
    torch.cuda.synchronize()
    out = {name: statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs) for name, pairs in ev.items()}
    graphs.clear()
    return out


def _smem_ok(scheme: str, bm: int, bn: int, bk: int, stages: int) -> bool:
    """Shared memory of the pipelined A and B tiles under ~200 KB (H100: 227 KB a block)."""
    fp8 = scheme in ("fp8-block", "fp8-channel")
    a = bm * bk * (1 if fp8 else 2)
    b = bk * bn // 2 if scheme in ("int4-group", *FP4) else bk * bn * (1 if fp8 else 2)
    return (a + b) * stages <= 200 * 1024


#: a candidate's bf16 output must agree this well with the old default's on the same inputs (SQNR,
#: dB) to be timed: the weight-only schemes differ by summation order and the rounding it flips, the
#: W8A8 ones also by the e4m3 codes those flips change
MIN_AGREE_DB = {"dense": 40.0, "int4-group": 40.0, "nvfp4": 40.0, "mxfp4": 40.0, "fp8-block": 30.0, "fp8-channel": 30.0}


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |x - ref|^2) in dB (inf when equal)."""
    x, ref = x.float(), ref.float()
    err = (x - ref).pow(2).sum().item()
    sig = ref.pow(2).sum().item()
    return float("inf") if err == 0 else 10 * math.log10(sig / err) if sig > 0 else float("-inf")


#: split-K factors (split_w13, split_w2) swept at decode
DECODE_SPLITS = ((2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4))


def candidates(scheme: str, layer: Layer, T: int) -> list:
    """The tile configs swept for one cell: decode (T <= 16) varies BLOCK_N, BLOCK_K, warps and
    the pipeline depth at BLOCK_M 16, and split-K of both GEMMs (DECODE_SPLITS, at the first
    BLOCK_K, the dequantizing schemes' both, 4 warps, 3 or 4 stages); more tokens vary BLOCK_M
    around the expected pairs per expert (T*k/E_global), BLOCK_N, warps, stages and the M grouping; the old default and the
    rules' choice and the shipped table's entry always included. Where the activations stay 16-bit (not W8A8), each unsplit
    candidate also runs with silu in GEMM1's epilogue (``fuse_silu``; at decode those with 4
    warps, also BLOCK_N 256: 128 gate and 128 up rows), and the dequantizing schemes (int4,
    fp4) also try BLOCK_M 256 at many pairs per expert (one M tile an expert: each weight tile
    dequantized once). The dequantizing schemes also run every shape of tile with swapped
    operands (``swap_ab``: the weight tile the dot's register operand; at decode BLOCK_N 64 / 128
    and split-K, at many pairs per expert BLOCK_M 128 / 256 pairs against 64-256 weight rows),
    swept first. fp8-block also tries 6 and 8 stages at decode (its 128-wide K tiles carry few
    bytes a stage), at <= 8 pairs per expert (memory-bound like decode: every weight tile read for
    a few rows) 16-row tiles of BLOCK_N 32-256 at 4-8 stages, and at many pairs per expert 32-row
    tiles, 5 stages and group 16 / 64."""
    from dataclasses import replace

    from moetool.kernels.moe_tiles import DECODE_T, MoeConfig, config_problem, default_config, rule_config

    bks = (128,) if scheme in ("fp8-block", "fp8-channel") else (64, 128)
    dequant = scheme in ("int4-group", *FP4)
    ppe = T * layer.k / layer.E_global
    out = []
    if T <= DECODE_T:  # bytes in flight: deep K tiles and pipelines; BLOCK_K 64 ran 4-24 % slower here
        dbks = {"fp8-block": (128,), "int4-group": (64, 128), "nvfp4": (64, 128), "mxfp4": (64, 128)}.get(
            scheme, (128, 256))
        for bn in (32, 64, 128):
            for bk in dbks:
                for warps in (4, 8):
                    for stages in (3, 4, 5):
                        if warps == 4 or bk >= 128:
                            out.append(MoeConfig(16, bn, bk, 1, warps, stages))
            for s13, s2 in DECODE_SPLITS:
                for bk in dbks if dequant else dbks[:1]:  # int4's quads dequantize cheaply: wide K tiles too
                    for stages in (3, 4):
                        out.append(MoeConfig(16, bn, bk, 1, 4, stages, s13, s2))
        if scheme not in ("fp8-block", "fp8-channel"):
            out += [MoeConfig(16, bn, bk, 1, 4, stages, fuse_silu=True)
                    for bn in (64, 128, 256) for bk in dbks for stages in (3, 4, 5)]
    elif ppe <= 48:
        for bm in (16, 32, 64):
            for bn in (64, 128):
                for bk in bks:
                    for warps, stages in ((4, 3), (4, 4), (8, 3)):
                        if warps == 8 and bm == 16:
                            continue  # 8 warps on a 16-row tile: half of them idle in the dot
                        out.append(MoeConfig(bm, bn, bk, 1 if bm == 16 else 8, warps, stages))
    else:
        for bm in (64, 128):
            for bn in (128, 256):
                for bk in bks:
                    for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
                        for gm in (8, 32):
                            if bm * bn >= 128 * 256 and warps == 4:
                                continue  # the accumulator alone would need 256 registers a thread
                            out.append(MoeConfig(bm, bn, bk, gm, warps, stages))
        if dequant:
            out += [MoeConfig(256, bn, bk, 8, 8, stages) for bn in (64, 128) for bk in (64, 128) for stages in (2, 3)]
    if scheme == "fp8-block" and T <= DECODE_T:
        out += [MoeConfig(16, bn, 128, 1, 4, stages) for bn in (32, 64) for stages in (6, 8)]
    elif scheme == "fp8-block" and ppe <= 8:  # past decode, yet every weight tile read for a few rows
        out += [MoeConfig(16, bn, 128, 1, 4, stages) for bn in (32, 64, 128, 256) for stages in (4, 5, 6, 8)]
    elif scheme == "fp8-block" and ppe > 48:
        out += [MoeConfig(bm, 128, 128, gm, 4, stages) for bm in (32, 64) for gm in (16, 32, 64) for stages in (3, 4, 5)]
    if T > DECODE_T and scheme not in ("fp8-block", "fp8-channel"):
        out += [replace(c, fuse_silu=True) for c in out]
    if dequant:
        out = _swapped(T, ppe) + out
    if dequant and ppe > 48:  # BLOCK_M 256 first: what a --budget-s cut should reach (best for nvfp4 T=4096)
        out.sort(key=lambda c: (not c.swap_ab, c.block_m != 256))
    E, P = layer.E, T * layer.k
    out += [default_config(scheme, P / E, torch.bfloat16, False, INT4_GROUP),
            rule_config(scheme, E, layer.N, layer.H, layer.k, T, torch.bfloat16, INT4_GROUP,
                        global_experts=layer.E_global)]
    table = _table_config(scheme, layer, T)
    if table is not None:
        out.append(table)
    seen, keep = set(), []
    for c in out:
        if c not in seen and config_problem(scheme, c, INT4_GROUP) is None \
                and _smem_ok(scheme, c.block_m, c.block_n, c.block_k, c.num_stages):
            seen.add(c)
            keep.append(c)
    return keep


def _swapped(T: int, ppe: float) -> list:
    """Candidates with swapped operands (``swap_ab``) for the dequantizing schemes: BLOCK_M is the
    MMA's N (pairs), BLOCK_N its M (weight rows: 64 a warpgroup)."""
    from moetool.kernels.moe_tiles import DECODE_T, MoeConfig

    out = []
    if T <= DECODE_T:
        for bn in (64, 128):
            for bk in (64, 128):
                for stages in (3, 4):
                    out.append(MoeConfig(16, bn, bk, 1, 4, stages, fuse_silu=True, swap_ab=True))
                    out += [MoeConfig(16, bn, bk, 1, 4, stages, s13, s2, swap_ab=True) for s13, s2 in ((2, 2), (4, 4), (8, 4))]
    elif ppe <= 48:
        for bm in (16, 32):
            for bn in (64, 128):
                for bk in (64, 128):
                    for stages in (3, 4):
                        out += [MoeConfig(bm, bn, bk, 1 if bm == 16 else 8, 4, stages, fuse_silu=fuse, swap_ab=True)
                                for fuse in (False, True)]
    else:  # (block_m, block_n, num_warps, block_k, stages): 64 or 128 accumulator registers a thread
        for bm, bn, warps, bk, stages in ((256, 128, 8, 64, 2), (256, 128, 8, 64, 3), (256, 128, 8, 64, 4),
                                          (256, 128, 8, 128, 2), (256, 64, 4, 64, 3), (256, 64, 4, 64, 4),
                                          (128, 128, 4, 64, 3), (128, 128, 4, 64, 4), (128, 128, 4, 128, 2),
                                          (128, 128, 4, 128, 3), (128, 128, 8, 64, 3), (128, 128, 8, 64, 4),
                                          (128, 256, 8, 64, 3)):
            out += [MoeConfig(bm, bn, bk, 8, warps, stages, fuse_silu=fuse, swap_ab=True) for fuse in (False, True)]
    return out


def _table_config(scheme: str, layer: Layer, T: int):
    """The shipped table's tiles for this cell on the current GPU (None without one, or CUDA)."""
    from moetool.kernels.moe_tiles import table_config

    if not torch.cuda.is_available():
        return None
    return table_config(torch.cuda.get_device_name(), scheme, layer.E, layer.N, layer.H, layer.k, T, INT4_GROUP)


def only_filter(specs: list[str] | None):
    """--only FIELD=V[,V...] (each a MoeConfig field) -> a predicate on candidates: every FIELD
    must hold one of its values (true / false for the flags)."""
    from moetool.kernels.moe_tiles import MoeConfig

    want = {}
    for spec in specs or ():
        field, _, values = spec.partition("=")
        if field not in MoeConfig.__dataclass_fields__ or not values:
            raise SystemExit(f"tune.py: --only {spec!r} is not FIELD=V[,V] with a MoeConfig field")
        want[field] = {v == "true" if v in ("true", "false") else int(v) for v in values.split(",")}
    return lambda cfg: all(getattr(cfg, f) in vs for f, vs in want.items())


def cells(args) -> list[tuple[str, str, int]]:
    if args.cells:  # LAYER/SCHEME/T each
        out = []
        for c in args.cells:
            layer, scheme, T = c.split("/")
            if layer not in LAYERS or scheme not in SCHEMES_TUNED or not T.isdigit():
                raise SystemExit(f"tune.py: --cells {c!r} is not LAYER/SCHEME/T with a known layer and scheme")
            out.append((layer, scheme, int(T)))
        return out
    out = []
    for (layer, scheme), tokens in CELLS.items():
        if layer in args.layers and scheme in args.schemes:
            out += [(layer, scheme, T) for T in (args.tokens or TUNE_TOKENS)]
    return out


def _problem(scheme, layer: Layer, T, E, device, group=INT4_GROUP):
    """Inputs of one fused_experts call on E local experts (ids -1 where not local)."""
    torch.manual_seed(T)
    _, local, tw = routing(T, layer, device)
    if E != layer.E:  # a small stand-in for compiling: the same shapes but E
        local = torch.where(local >= 0, local % E, -1).to(torch.int32).contiguous()
    hidden = torch.randn(T, layer.H, device=device, dtype=torch.bfloat16)
    return hidden, local, tw


def run_ours(hidden, w13, w2, scheme, ids, tw, cfg, out, cache3_dtype=None):
    from moetool.kernels.fused_moe import fused_experts

    return fused_experts(hidden, w13, w2, scheme, ids, tw, group_size=INT4_GROUP, config=cfg, check_ids=False,
                         out_dtype=torch.bfloat16, out=out, cache3_dtype=cache3_dtype)


def _compile_worker(jobs):
    """One worker: run each (layer, scheme, T, config) once on 2 experts, so Triton compiles
    (into its cache on disk, shared with the parent) what the sweep will launch."""
    torch.cuda.set_device(0)
    made = {}
    failed = 0
    for layer_name, scheme, T, cfg in jobs:
        layer = LAYERS[layer_name]
        if (layer_name, scheme) not in made:
            made.clear()
            made[(layer_name, scheme)] = make_weights(scheme, 2, layer.H, layer.N, "cuda")
        w13, w2 = made[(layer_name, scheme)]
        hidden, ids, tw = _problem(scheme, layer, T, 2, "cuda")
        out = torch.empty(T, layer.H, dtype=torch.bfloat16, device="cuda")
        try:
            run_ours(hidden, w13, w2, scheme, ids, tw, cfg, out)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - e.g. out of shared memory: the sweep skips it too
            failed += 1
    return failed


def precompile(todo, jobs: int) -> None:
    import multiprocessing as mp

    todo = sorted(todo, key=lambda j: (j[0], j[1], j[2], str(j[3])))
    n = max(1, min(jobs, len(todo)))
    per = math.ceil(len(todo) / n)
    chunks = [todo[i:i + per] for i in range(0, len(todo), per)]
    t0 = time.time()
    with mp.get_context("spawn").Pool(len(chunks)) as pool:
        failed = sum(pool.map(_compile_worker, chunks))
    print(f"compiled {len(todo)} (cell, config) runs on {len(chunks)} workers in {time.time() - t0:.0f} s"
          f" ({failed} failed)", flush=True)


def _chosen(args, scheme: str, layer: Layer, T: int) -> list:
    """The cell's candidates that pass --only; the old default, the rules' and the table's tiles
    always (what a new entry must beat)."""
    from moetool.kernels.moe_tiles import default_config, rule_config

    keep = only_filter(args.only)
    always = {default_config(scheme, T * layer.k / layer.E, torch.bfloat16, False, INT4_GROUP),
              rule_config(scheme, layer.E, layer.N, layer.H, layer.k, T, torch.bfloat16, INT4_GROUP,
                          global_experts=layer.E_global),
              _table_config(scheme, layer, T)}
    return [c for c in candidates(scheme, layer, T) if keep(c) or c in always]


def sweep(args) -> list[dict]:
    from moetool.kernels.moe_tiles import default_config, rule_config

    t_start = time.time()
    deadline = t_start + args.budget_s
    todo = [(layer, scheme, T, c) for layer, scheme, T in cells(args) for c in _chosen(args, scheme, LAYERS[layer], T)]
    if args.jobs > 1:
        precompile(todo, args.jobs)
    if args.compile_only:
        return []
    rows = []
    made_for = None
    for layer_name, scheme, T in cells(args):
        layer = LAYERS[layer_name]
        if made_for != (layer_name, scheme):
            w13 = w2 = None
            torch.cuda.empty_cache()
            w13, w2 = make_weights(scheme, layer.E, layer.H, layer.N, "cuda")
            made_for = (layer_name, scheme)
        hidden, ids, tw = _problem(scheme, layer, T, layer.E, "cuda")
        out = torch.empty(T, layer.H, dtype=torch.bfloat16, device="cuda")
        old = default_config(scheme, T * layer.k / layer.E, torch.bfloat16, False, INT4_GROUP)
        rule = rule_config(scheme, layer.E, layer.N, layer.H, layer.k, T, torch.bfloat16, INT4_GROUP,
                           global_experts=layer.E_global)
        times, wrong = {}, {}
        with fixed_align():
            ref = run_ours(hidden, w13, w2, scheme, ids, tw, old, out).float().clone()
            for cfg in _chosen(args, scheme, layer, T):
                if time.time() > deadline:
                    break
                try:
                    first = run_ours(hidden, w13, w2, scheme, ids, tw, cfg, out).clone()
                    agree = sqnr_db(first, ref)
                    if agree >= MIN_AGREE_DB[scheme] and not torch.equal(
                            run_ours(hidden, w13, w2, scheme, ids, tw, cfg, out), first):
                        agree = float("nan")  # a race: the same inputs gave another output
                    if not agree >= MIN_AGREE_DB[scheme]:  # e.g. a miscompiled tile: never into the table
                        wrong[cfg] = agree
                        print(f"  {layer_name} {scheme} T={T} {cfg}: output disagrees with the old default's "
                              f"(SQNR {agree:.1f} dB; nan: changes from run to run): skipped", flush=True)
                        continue
                    times[cfg] = time_graph(lambda c=cfg: run_ours(hidden, w13, w2, scheme, ids, tw, c, out),
                                            args.reps)["us"]
                except Exception as e:  # noqa: BLE001 - a config the GPU cannot run
                    print(f"  {layer_name} {scheme} T={T} {cfg}: {type(e).__name__}: {str(e)[:100]}")
                    torch.cuda.synchronize()
        if not times:
            print(f"{layer_name:9} {scheme:10} T={T:5d}: out of time budget, not tuned", flush=True)
            continue
        best = min(times, key=times.get)
        row = {"layer": layer_name, "scheme": scheme, "T": T, "E": layer.E, "N": layer.N, "H": layer.H,
               "top_k": layer.k, "best": asdict(best), "best_us": times[best],
               "default_us": times.get(old), "rules_us": times.get(rule), "candidates": len(times),
               "disagree_db": [[*asdict(c).values(), round(db, 1)] for c, db in wrong.items()],
               "times": [[*asdict(c).values(), round(us, 2)] for c, us in sorted(times.items(), key=lambda kv: kv[1])]}
        rows.append(row)
        print(f"[{time.time() - t_start:5.0f} s] {layer_name:9} {scheme:10} T={T:5d} best {tuple(asdict(best).values())} {times[best]:8.1f} us | "
              f"default {_us(times.get(old))} rules {_us(times.get(rule))} ({len(times)} configs)", flush=True)
    return rows


def _us(v) -> str:
    return f"{v:8.1f}" if v is not None else "       -"


def write_table(rows: list[dict], device_name: str, table_dir: Path) -> Path:
    """Merge the best tiles into table_dir/<device>.json (entries of other shapes kept; a
    re-tuned (shape, T) replaced). Written to a temporary name, then renamed."""
    from moetool.kernels import moe_tiles

    path = table_dir / moe_tiles.table_path(device_name).name
    data = json.loads(path.read_text()) if path.is_file() else {"device": device_name, "entries": []}
    entries = {}
    for e in data["entries"]:
        entries[moe_tiles.entry_key(e["scheme"], e["E"], e["N"], e["H"], e["top_k"], e.get("group_size", 128))] = e
    for r in rows:
        key = moe_tiles.entry_key(r["scheme"], r["E"], r["N"], r["H"], r["top_k"], INT4_GROUP)
        e = entries.setdefault(key, {"scheme": r["scheme"], "E": r["E"], "N": r["N"], "H": r["H"],
                                     "top_k": r["top_k"], "tiles": {}})
        if key[-1] is not None:
            e["group_size"] = key[-1]
        e["tiles"][str(r["T"])] = {**moe_tiles.config_dict(moe_tiles.MoeConfig(**r["best"])), "us": round(r["best_us"], 1)}
    for e in entries.values():
        e["tiles"] = dict(sorted(e["tiles"].items(), key=lambda kv: int(kv[0])))
    data = {"device": device_name, "made_by": "bench/tune.py", "torch": torch.__version__,
            "triton": _triton_version(), "entries": sorted(entries.values(), key=lambda e: (
                e["scheme"], e["E"], e["N"], e["H"], e["top_k"]))}
    moe_tiles.parse_table(data, str(path))  # what select_config will read back
    table_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".incomplete")
    tmp.write_text(_dump(data))
    os.replace(tmp, path)
    return path


def _dump(data: dict) -> str:
    """JSON with one line per tile, so a diff of a re-tune shows which tiles moved."""
    lines = ["{", f'  "device": {json.dumps(data["device"])},', f'  "made_by": {json.dumps(data["made_by"])},',
             f'  "torch": {json.dumps(data["torch"])},', f'  "triton": {json.dumps(data["triton"])},',
             '  "entries": [']
    for i, e in enumerate(data["entries"]):
        head = {k: v for k, v in e.items() if k != "tiles"}
        lines.append("    {" + json.dumps(head)[1:-1] + ', "tiles": {')
        tiles = list(e["tiles"].items())
        for j, (t, tile) in enumerate(tiles):
            lines.append(f'      "{t}": {json.dumps(tile)}' + ("," if j < len(tiles) - 1 else ""))
        lines.append("    }}" + ("," if i < len(data["entries"]) - 1 else ""))
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES_TUNED), choices=list(SCHEMES_TUNED))
    ap.add_argument("--tokens", nargs="+", type=int, default=None, help=f"default {' '.join(map(str, TUNE_TOKENS))}")
    ap.add_argument("--cells", nargs="+", default=None, help="LAYER/SCHEME/T each, instead of layers x schemes x tokens")
    ap.add_argument("--reps", type=int, default=30, help="timed graph replays per candidate (median)")
    ap.add_argument("--flush-by-writing", action="store_true",
                    help="flush the L2 by overwriting a buffer, as the earlier tables did (FLUSH_BY_WRITING)")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compiling worker processes")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stop sweeping this many seconds after the start (cells not reached keep their entry)")
    ap.add_argument("--table-dir", type=Path, default=ROOT / "kernels" / "tiles")
    ap.add_argument("--json", type=Path, default=None, help="also write every cell's times here")
    ap.add_argument("--only", nargs="+", default=None, metavar="FIELD=V[,V]",
                    help="sweep only candidates with these MoeConfig fields (e.g. swap_ab=true num_stages=6,8); "
                         "the old default, the rules' and the table's tiles always")
    ap.add_argument("--list", action="store_true", help="print the candidates per cell and exit (no GPU)")
    ap.add_argument("--compile-only", action="store_true",
                    help="only fill Triton's cache with every candidate (--jobs workers), e.g. while tests run; "
                         "a later run with --jobs 1 then only times")
    args = ap.parse_args(argv)
    global FLUSH_BY_WRITING
    FLUSH_BY_WRITING = args.flush_by_writing
    if args.list:
        total = 0
        for layer, scheme, T in cells(args):
            cands = _chosen(args, scheme, LAYERS[layer], T)
            total += len(cands)
            print(f"{layer:9} {scheme:10} T={T:5d}: {len(cands)} candidates")
        print(f"total {total}")
        return
    if not torch.cuda.is_available():
        sys.exit("bench/tune.py needs a CUDA GPU (--list does not)")
    name = torch.cuda.get_device_name()
    print(f"device: {name}; torch {torch.__version__}, triton {_triton_version()}", flush=True)
    rows = sweep(args)
    if args.compile_only:
        return
    path = write_table(rows, name, args.table_dir)
    print(f"wrote {path} ({len(rows)} cells)")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
