"""Tile sizes of the grouped GEMMs (:mod:`moetool.kernels.moe_gemm`): the config type, the tuned
tables and the rules for shapes no table holds.

Letters: T = tokens, k = experts chosen per token, E = local experts, N = expert intermediate
size, H = hidden size, g = int4 group size, P = T*k token-slot pairs, SMs = the GPU's
multiprocessors.

:func:`select_config` picks the tiles of one call of ``fused_experts``:

1. a table: ``tiles/<GPU name>.json`` beside this module, written by ``bench/tune.py`` (which
   times every candidate on that GPU), holds per (scheme, E, N, H, k[, g]) the best tiles at a
   few token counts; a call takes the entry of the nearest token count (log scale);
2. otherwise the rules of :func:`rule_config`, which follow from how the kernel spends its time:
   at T <= 16 the weights' bytes are the whole cost, so deep K pipelines, and BLOCK_N shrinks
   until the call's expert blocks give every SM a program (the dequantizing schemes split K);
   BLOCK_M follows the pairs per expert, so an expert's rows fit one M tile and its weight tiles
   are read once; at many pairs per expert the tiles grow to what the tensor cores need.

:func:`default_config` is the older choice by pairs per expert alone.
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton

from moetool.errors import JSON_ERRORS, MoetoolError

from .common import FP8_BLOCK, check
from .moe_weights import SCHEMES


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes of the grouped GEMMs (powers of two >= 16; fp8-block: 128 % block_k == 0),
    how many slices of K each GEMM splits into (split-K: each slice's program writes an fp32
    partial [P, R], the next step sums them; 1 = no split): ``split_w13`` for x @ w13^T (K = H),
    ``split_w2`` for h @ w2^T (K = N), and ``fuse_silu``: GEMM1 computes silu(gate) * up in its
    epilogue (a tile of block_n w13 rows is block_n / 2 gate and up rows; taken where the
    activations stay 16/32-bit and GEMM1 is not split, ignored elsewhere). ``swap_ab`` (the
    weight-only int4 / fp4 schemes): both GEMMs compute C^T = W @ A^T, the dequantized weight
    tile [block_n, block_k] the dot's first operand, which the tensor cores read from registers,
    so it never goes through shared memory and the next tile is dequantized while the last one
    multiplies; block_m is then the MMA's N (pairs) and block_n its M (weight rows)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_w13: int = 1
    split_w2: int = 1
    fuse_silu: bool = False
    swap_ab: bool = False


#: the fields every table tile names; the others (split factors, fuse_silu, swap_ab) may be left out
TILE_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
OPTIONAL_FIELDS = ("split_w13", "split_w2", "fuse_silu", "swap_ab")
#: most K slices a GEMM may split into
MAX_SPLIT = 32


#: where the tuned tables live, one JSON file per GPU name (:func:`table_path`)
TILES_DIR = Path(__file__).parent / "tiles"
#: token counts up to this are decode-like: weight bytes are the cost, so fill every SM
DECODE_T = 16
#: multiprocessors assumed when the GPU cannot be asked (an H100 SXM has 132)
DEFAULT_SMS = 132

# Tiles per scheme for (pairs per expert <= 32, <= 256, more): the best of bench/kernels.py
# --sweep on an H100 (DeepSeek-V3 expert shapes H 7168, N 2048, 32 local experts, bf16
# activations, T 64 / 512 / 4096). (block_m, block_n, block_k, group_m, num_warps, num_stages)
_TILES = {
    "dense": ((16, 128, 128, 1, 4, 3), (128, 128, 64, 16, 8, 3), (128, 128, 64, 16, 8, 3)),
    "fp8-block": ((16, 64, 128, 1, 4, 3), (64, 128, 128, 8, 8, 3), (64, 128, 128, 8, 8, 3)),
    "fp8-channel": ((16, 64, 128, 1, 4, 4), (64, 64, 64, 8, 4, 4), (128, 128, 64, 16, 8, 3)),
    "int4-group": ((16, 64, 64, 1, 4, 3), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3)),
    # fp4 weights are as many bytes a K tile as int4's: int4's tiles until tuned
    "nvfp4": ((16, 64, 64, 1, 4, 3), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3)),
    "mxfp4": ((16, 64, 64, 1, 4, 3), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 3)),
}


def _fit(sch, cfg: MoeConfig, act_dtype: torch.dtype, group_size: int) -> MoeConfig:
    """fp32 activations: 2 stages and M/N tiles <= 64 (shared memory). int4: block_k <= g when
    g is a power of two, so a K tile never straddles two groups. fp4: block_k whole groups, and
    >= 32 (the kernel dots two half tiles of K >= 16)."""
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages
    if act_dtype == torch.float32:
        stages = 2
        bm, bn = min(bm, 64), min(bn, 64)
    if sch.groups and group_size >= 16 and group_size & (group_size - 1) == 0:
        bk = min(bk, group_size)
    if sch.fp4_group is not None:
        bk = max(bk, sch.fp4_group, 32)
    return replace(cfg, block_m=bm, block_n=bn, block_k=bk, num_stages=stages)


def _interpreted_config(sch) -> MoeConfig:
    return MoeConfig(16, 64, FP8_BLOCK if sch.fp8_acts else 32, 1, 4, 1)  # the interpreter pays per program: fewer, wider tiles


def default_config(scheme: str, pairs_per_expert: float, act_dtype: torch.dtype, interpreted: bool,
                   group_size: int = 128) -> MoeConfig:
    """Tiles from ``_TILES`` by pairs per expert (T*k/E: an upper bound, -1 pairs included, as
    counting the real ones would need a host sync), fitted by :func:`_fit`."""
    sch = SCHEMES[scheme]
    if interpreted:
        return _interpreted_config(sch)
    small, mid, large = _TILES[scheme]
    tiles = small if pairs_per_expert <= 32 else mid if pairs_per_expert <= 256 else large
    return _fit(sch, MoeConfig(*tiles), act_dtype, group_size)


def config_problem(scheme: str, cfg: MoeConfig, group_size: int = 128) -> str | None:
    """Why ``cfg`` cannot run ``scheme`` (None when it can): what the kernel and its wrapper
    require of the tiles."""
    for f in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, f)
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            return f"{f} = {v!r} is not a power of two >= 16"
    if not isinstance(cfg.group_m, int) or cfg.group_m < 1:
        return f"group_m = {cfg.group_m!r} is not a positive integer"
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps = {cfg.num_warps!r} is not a power of two <= 16"
    if not isinstance(cfg.num_stages, int) or not 1 <= cfg.num_stages <= 8:
        return f"num_stages = {cfg.num_stages!r} is not in 1..8"
    for f in ("split_w13", "split_w2"):
        v = getattr(cfg, f)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SPLIT:
            return f"{f} = {v!r} is not in 1..{MAX_SPLIT}"
    if not isinstance(cfg.fuse_silu, bool):
        return f"fuse_silu = {cfg.fuse_silu!r} is not true or false"
    if not isinstance(cfg.swap_ab, bool):
        return f"swap_ab = {cfg.swap_ab!r} is not true or false"
    if cfg.swap_ab and not (SCHEMES[scheme].groups or SCHEMES[scheme].fp4_group):
        return f"swap_ab is for the weight-only int4 / fp4 schemes, not {scheme}"
    if SCHEMES[scheme].act_group == FP8_BLOCK and FP8_BLOCK % cfg.block_k:
        return f"block_k = {cfg.block_k} does not divide the fp8 block of {FP8_BLOCK}"
    if SCHEMES[scheme].groups and group_size & (group_size - 1) == 0 and cfg.block_k > max(group_size, 16):
        return f"block_k = {cfg.block_k} straddles int4 groups of {group_size}"
    fp4_group = SCHEMES[scheme].fp4_group
    if fp4_group is not None and (cfg.block_k % fp4_group or cfg.block_k < 32):
        return f"block_k = {cfg.block_k} is not whole {scheme} groups of {fp4_group} (and >= 32)"
    return None


#: pairs per expert above which the GEMMs are compute-bound enough for the large tiles
LARGE_PPE = 96
#: programs per SM that dequantizing GEMMs (int4, fp4) want at decode before they split K
DEQUANT_PROGRAMS = 4


def rule_config(scheme: str, E: int, N: int, H: int, top_k: int, T: int, act_dtype: torch.dtype,
                group_size: int = 128, num_sms: int = DEFAULT_SMS, global_experts: int | None = None) -> MoeConfig:
    """Tiles for a shape no table holds (module docstring), from what the kernel is bound by and
    what ``bench/tune.py`` measured on an H100 (issue-17 shapes; ratios are to each cell's best).

    T <= 16 (weight bytes are the cost): BLOCK_M 16, BLOCK_K 128 and 4 stages keep weight loads
    in flight (BLOCK_K 64: 4-24 % slower, 3 stages up to 17 %); BLOCK_N the largest of 128 / 64
    / 32 with which min(E, T*k) expert blocks times the narrower GEMM's column tiles (min(2N, H)
    / BLOCK_N) give every SM a program. Under expert parallelism fewer experts are local:
    DeepSeek-V3 EP8 at T=1 (~1.5 local experts) ran BLOCK_N 128 within 1.2 % of its best, while
    BLOCK_N 32 on all 256 experts ran 15 % slower. Split-K does not help the bf16 / fp8 GEMMs
    there (DeepSeek-V3 EP8 T=1, 3 active experts: GEMM1 at 2.3 TB/s bf16 with 1 to 8 slices, as
    many programs as 384 or 3072), so they keep one slice. int4 and fp4 take 3 stages and want
    more programs than SMs: with fewer than DEQUANT_PROGRAMS per SM (min(E, T*k) blocks of the
    narrower GEMM's 128-wide tiles) they split K. fp4 (BLOCK_K 64, dequantization-bound):
    DeepSeek-V3 EP8 T=1 on an H100, 64-wide tiles in 4 + 4 slices (nvfp4 165 -> 107 us, mxfp4
    147 -> 96). int4, whose tiles dequantize without conversions (moe_gemm's int16 quads and
    codes), takes 128 x 128 tiles in 4 + 2 slices there (56.0 us; 4 + 1 58.7, the earlier 64 x
    64 in 4 + 4 99.1), unsplit with more programs (T=16: 253.1 us, 64 wide 270.9).
    Where the activations stay 16/32-bit (not W8A8) and GEMM1 is not split, silu(gate) * up is
    GEMM1's epilogue (``fuse_silu``): one kernel and one [P, 2N] round trip less.

    More tokens: BLOCK_M the power of two >= 1.5x the pairs per expert (T*k/E, an upper bound:
    -1 pairs included; the margin covers routing imbalance), 16 to 64, so an expert's rows fit
    one M tile (Mixtral T=128, ~32 pairs per expert: BLOCK_M 16 took 2.0x the time of 64).
    ``global_experts`` (expert parallelism: the experts the router picks from on all ranks)
    makes that T*k/global_experts, what a local expert expects, for the 16-bit-activation
    kinds: DeepSeek-V3 EP8 (32 of 256) at T=128 has ~4 pairs an expert, not 32; with it the
    rules ran int4 392.4 us (BLOCK_M 64: 622.2), nvfp4 658.0 (806.2), mxfp4 665.3 (817.1),
    bf16 at T=512 992.3 (1034.6). W8A8 keeps T*k/E: its tuned tiles there are 64 rows, and
    16 / 32 rows ran 2-8 % slower (fp8-block T=512 581.2 vs 553.8 us). T is the rows a rank
    computes: where the dispatcher sends it only rows with a local expert (all2all), each row
    holds at least one local pair, so the count runs low by 1 / P(a row has a local expert)
    (1.5x at EP8, k=8: within the margin; more at higher EP).
    Past LARGE_PPE pairs per expert the compute-bound tiles: dense 128 x 256 x 64 with 8
    warps (128 x 128: 7-21 % slower); fp8-block 64 x 128 x 128 with 4 warps and group 32
    (8 warps / group 8, the older default: 35-56 % slower); fp8-channel BLOCK_M 128; int4 128 x
    256 x 128 with 8 warps (DeepSeek-V3 EP8 T=4096: 1741 us, 128 x 128 x 64 1956 us), its mid
    tiles 128 x 128 (T=128: 397.3 us, 64 wide 429.3; T=512 at BLOCK_M 32: 522.9, K tile 64 542.3);
    fp4 BLOCK_M 256 with 8 warps and 3 stages, so each weight tile is dequantized once per 256
    pairs (DeepSeek-V3 EP8 T=4096, ~190 pairs an expert: mxfp4 2460 -> 2028 us, nvfp4 2825 ->
    2352; 2 stages 31 % slower), with swapped operands (``swap_ab``: mxfp4 2018 -> 1640 us,
    nvfp4 2354 -> 1693).
    fp4 at decode with few programs swaps operands too, 64 weight rows by 128-wide K tiles in 4 +
    4 slices (DeepSeek-V3 EP8 T=1: nvfp4 107 -> 97 us, mxfp4 96 -> 89). int4 keeps its unswapped
    tiles (swapped, with the quads too: 8-16 % slower at T = 1 to 4096).
    """
    sch = SCHEMES[scheme]
    ppe = T * top_k / max(E, 1 if sch.fp8_acts else global_experts or 0, 1)
    kind = "int4" if sch.groups else "fp4" if sch.fp4_group else scheme if sch.fp8_acts else "dense"
    fuse = not sch.fp8_acts
    narrow = min(2 * N, H)
    blocks = max(1, min(E, T * top_k))
    if T <= DECODE_T:
        if kind in ("int4", "fp4"):
            few = blocks * triton.cdiv(narrow, 128) < DEQUANT_PROGRAMS * num_sms
            if few and kind == "fp4":
                cfg = MoeConfig(16, 64, 128, 1, 4, 3, 4, 4, swap_ab=True)
            elif few:
                cfg = MoeConfig(16, 128, 128, 1, 4, 3, 4, 2)
            elif kind == "int4":
                cfg = MoeConfig(16, 128, 128, 1, 4, 3, fuse_silu=fuse)
            else:
                cfg = MoeConfig(16, 128, 64, 1, 4, 3, fuse_silu=fuse)
        else:
            bn = next((b for b in (128, 64, 32) if blocks * triton.cdiv(narrow, b) >= num_sms), 32)
            cfg = MoeConfig(16, bn, 128, 1, 4, 4, fuse_silu=fuse)
    elif ppe > LARGE_PPE and kind == "fp4":
        cfg = MoeConfig(256, 128, 64, 8, 8, 3, swap_ab=True)
    elif ppe > LARGE_PPE:
        cfg = MoeConfig(*{"dense": (128, 256, 64, 8, 8, 4), "fp8-block": (64, 128, 128, 32, 4, 3),
                          "fp8-channel": (128, 128, 128, 8, 4, 3), "int4": (128, 256, 128, 8, 8, 3)}[kind])
    else:
        bm = min(64, max(16, triton.next_power_of_2(math.ceil(1.5 * ppe))))
        gm = 1 if bm == 16 else 8
        cfg = {"dense": MoeConfig(bm, 128, 128, gm, 4, 3), "fp8-block": MoeConfig(bm, 128, 128, gm, 4, 3),
               "fp8-channel": MoeConfig(bm, 64, 128, gm, 4, 3),
               "int4": MoeConfig(bm, 128, 128, gm, 4, 3),
               "fp4": MoeConfig(bm, 128, 64, gm, 4, 3)}[kind]
        cfg = replace(cfg, fuse_silu=fuse)
    return _fit(sch, cfg, act_dtype, group_size)


def table_path(device_name: str) -> Path:
    """tiles/<name>.json, the name with every run of other characters than letters and digits
    made one '_' ('NVIDIA H100 80GB HBM3' -> NVIDIA_H100_80GB_HBM3.json)."""
    return TILES_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def entry_key(scheme: str, E: int, N: int, H: int, top_k: int, group_size: int = 128) -> tuple:
    """The key of one table entry; the group size counts only for grouped schemes (int4)."""
    return (scheme, E, N, H, top_k, group_size if SCHEMES[scheme].groups else None)


def parse_table(data: dict, where: str) -> dict[tuple, dict[int, MoeConfig]]:
    """A table's JSON (``bench/tune.py`` writes it) -> {entry_key: {T: MoeConfig}}, every entry
    checked by :func:`config_problem`. Format::

        {"device": "NVIDIA H100 80GB HBM3", "entries": [
          {"scheme": "fp8-block", "E": 32, "N": 2048, "H": 7168, "top_k": 8,
           "tiles": {"1": {"block_m": 16, ..., "num_stages": 4, "split_w13": 4, "us": 41.2}, "16": {...}}}]}

    (int4 entries add "group_size"; split_w13 / split_w2 are 1 and fuse_silu false when left
    out; keys other than MoeConfig's in a tile, such as the measured "us", are notes.)
    """
    check(isinstance(data, dict) and isinstance(data.get("entries"), list), f"{where}: no 'entries' list")
    out: dict[tuple, dict[int, MoeConfig]] = {}
    for i, e in enumerate(data["entries"]):
        here = f"{where}: entry {i}"
        check(isinstance(e, dict) and e.get("scheme") in SCHEMES, f"{here}: unknown scheme {e.get('scheme')!r}")
        for dim in ("E", "N", "H", "top_k"):
            check(isinstance(e.get(dim), int) and e[dim] > 0, f"{here}: {dim} must be a positive integer")
        key = entry_key(e["scheme"], e["E"], e["N"], e["H"], e["top_k"], e.get("group_size", 128))
        check(key not in out, f"{here}: a second entry for {key}")
        tiles = e.get("tiles")
        check(isinstance(tiles, dict) and tiles, f"{here}: no tiles")
        per_t = {}
        for t, tile in tiles.items():
            check(t.isdigit() and int(t) > 0 and isinstance(tile, dict) and all(n in tile for n in TILE_FIELDS),
                  f"{here}: tiles[{t!r}] must map a token count to {', '.join(TILE_FIELDS)}")
            cfg = MoeConfig(**{n: tile[n] for n in (*TILE_FIELDS, *OPTIONAL_FIELDS) if n in tile})
            problem = config_problem(e["scheme"], cfg, e.get("group_size", 128))
            check(problem is None, f"{here}: tiles[{t!r}]: {problem}")
            per_t[int(t)] = cfg
        out[key] = per_t
    return out


@functools.lru_cache(maxsize=None)
def load_table(device_name: str) -> dict[tuple, dict[int, MoeConfig]]:
    """The tuned table of ``device_name`` ({} when none ships), read once per process."""
    path = table_path(device_name)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except JSON_ERRORS as e:
        raise MoetoolError(f"{path}: not JSON ({e})") from None
    return parse_table(data, str(path))


def nearest_tokens(measured, T: int) -> int:
    """The measured token count nearest T on a log scale (ties to the smaller)."""
    return min(sorted(measured), key=lambda m: abs(math.log2(m) - math.log2(max(T, 1))))


def table_config(device_name: str, scheme: str, E: int, N: int, H: int, top_k: int, T: int,
                 group_size: int = 128) -> MoeConfig | None:
    """The table's tiles for this shape at the nearest measured T, or None."""
    per_t = load_table(device_name).get(entry_key(scheme, E, N, H, top_k, group_size))
    return per_t[nearest_tokens(per_t, T)] if per_t else None


@functools.lru_cache(maxsize=16)
def _device(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def select_config(scheme: str, E: int, N: int, H: int, top_k: int, T: int, act_dtype: torch.dtype,
                  interpreted: bool, group_size: int = 128, device_name: str | None = None,
                  num_sms: int | None = None, global_experts: int | None = None) -> MoeConfig:
    """Tiles for one ``fused_experts`` call on the current CUDA device: the tuned table's entry
    (16-bit activations) or :func:`rule_config`. Interpreted: the small test tiles.
    device_name / num_sms: a GPU other than the current one (tests; None = ask CUDA).
    global_experts: the rules' expert count under expert parallelism (:func:`rule_config`).
    Host cost: a cached lookup (no device query after the first)."""
    if interpreted:
        return _interpreted_config(SCHEMES[scheme])
    if device_name is None or num_sms is None:
        if torch.cuda.is_available():
            name, sms = _device(torch.cuda.current_device())
        else:
            name, sms = "", DEFAULT_SMS
        device_name = name if device_name is None else device_name
        num_sms = sms if num_sms is None else num_sms
    return _select(device_name, num_sms, scheme, E, N, H, top_k, T, act_dtype, group_size, global_experts)


@functools.lru_cache(maxsize=4096)
def _select(device_name: str, num_sms: int, scheme: str, E: int, N: int, H: int, top_k: int, T: int,
            act_dtype: torch.dtype, group_size: int, global_experts: int | None = None) -> MoeConfig:
    check(scheme in SCHEMES, f"unknown weight format {scheme!r} (known: {', '.join(SCHEMES)})")
    if act_dtype != torch.float32:
        cfg = table_config(device_name, scheme, E, N, H, top_k, T, group_size)
        if cfg is not None:
            return cfg
    return rule_config(scheme, E, N, H, top_k, T, act_dtype, group_size, num_sms, global_experts)


def config_dict(cfg: MoeConfig) -> dict:
    """MoeConfig -> the dict a table's tile holds (without notes; the optional fields only when
    they differ from their defaults)."""
    default = MoeConfig()
    return {key: v for key, v in asdict(cfg).items() if key in TILE_FIELDS or v != getattr(default, key)}
