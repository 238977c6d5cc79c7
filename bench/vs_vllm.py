"""moetool's fused_experts side by side with vLLM's Triton fused MoE on one CUDA GPU (not a test:
pytest never collects it).

    python bench/vs_vllm.py --fetch            # here, with network: pip download the vLLM wheel
                                               # and extract its Triton fused-MoE module
    python bench/vs_vllm.py --json out.json    # on the GPU: the issue-17 table, before / after

vLLM's code is never committed: ``--fetch`` runs ``pip download --no-deps vllm==VERSION`` into
.bench/whl and extracts only ``fused_moe/fused_moe.py`` (the Triton kernels, their launchers,
vLLM's default tile choice ``get_default_config`` and ``fused_experts_impl``), the two helper
modules whose functions it names (``utils.py``, ``config.py``) and the tuned H100 / H200
config JSONs into .bench/vllm_src (git-ignored, ~0.2 MB: it travels with the device ``run``'s
``carry``). At run time that module is executed against stand-in modules for the rest of
vLLM: its CUDA-only ops are shims (``Shims``): silu_and_mul and moe_sum are one-pass Triton
kernels here, fp8 per-token-group quantization is moetool's ``fp8_act_quant``, and the align
step comes precomputed. Everything else it runs is vLLM's own: config lookup, the W8A8 swap-AB
choice, the EP expert map, buffer sizes, the zeroing of its output cache. Its int4 path is
pinned to the Triton kernel (``fused_moe_kernel_gptq_awq``): the CUDA ``moe_wna16_gemm`` it picks
for few tokens per expert is not in a Python module.

The fp4 schemes (nvfp4, mxfp4: W4A16, moetool dequantizes the weight tiles in registers) have
no Triton GEMM in vLLM: on GPUs without FP4 tensor cores vLLM runs Marlin (CUDA) or its emulation
experts, which dequantize the weights to bf16 and run the bf16 Triton MoE. vLLM's side of those
cells is that bf16 MoE on the weights dequantized beforehand (fp4_dequant, outside the timed
region): a lower bound of its emulation's time.

``--cache3`` also times the table's tiles with GEMM2 writing fp32 rows (``cache3_dtype``, the
older output path; column ``c3f32``), ``--prev-table`` another tile table's choice (column
``prev``, e.g. the table before a re-tune): before / after in one run.

Per cell (layer, scheme, T; the layers of bench/tune.py): the same bf16 hidden, weights and
routing go to both (vLLM: global ids and its expert map; moetool: local ids, -1 elsewhere).
Outputs must agree first (SQNR of moetool's bf16 output against vLLM's, >= MIN_SQNR_DB), then
each side and each tile choice is captured in a CUDA graph without its align step (precomputed
for both) and the graphs are replayed in turns, --reps rounds, L2 flushed before each replay
(``tune.time_graphs``: drift of clocks or temperature falls on all alike; the flush reads twice
the L2, ``--flush-by-writing`` overwrites it as the earlier tables did, whose dirty lines the timed
kernels then paid to write back); medians. moetool runs three tile
choices: ``before`` (``default_config``, what fused_experts picks today), ``rules``
(``rule_config`` only) and ``after`` (``select_config``: the tuned table, else the rules).
ratio = vLLM us / moetool us (> 1: moetool faster); the geometric mean is over all cells.
At T <= 16 a row also gives % of HBM bandwidth (bytes of the experts that got a token, their
scales, hidden in and out, over the peak), at T = 4096 % of the dense MMA peak (6 * pairs * N
* H FLOPs; bf16 989 TFLOP/s, fp8 1979 on an H100 SXM).

The ceiling of each cell (``ceiling``): the fewest bytes the layer must move (those weights,
scales, hidden in, output) over the copy bandwidth measured on the GPU at the start of the run,
and its FLOPs over the measured rate of a large dense matmul (fp8 for the W8A8 schemes, bf16
for the others: int4 and fp4 multiply bf16 tiles); the larger is the floor, and vLLM us / floor
us the highest ratio any kernel could reach in that cell. Their geometric mean says whether
a target mean is reachable at all (``--no-peaks``: datasheet numbers instead of measuring).
"""
from __future__ import annotations

import argparse
import ast
import enum
import functools
import hashlib
import json
import math
import re
import subprocess
import sys
import types
import zipfile
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tune  # noqa: E402  (bench/tune.py: layers, weights, routing, graph timing)

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.33.0"
SRC_DIR = ROOT / ".bench" / "vllm_src"
WHEEL_DIR = ROOT / ".bench" / "whl"
FMOE = "vllm/model_executor/layers/fused_moe/"
#: the only files taken from the wheel
MEMBERS = (FMOE + "fused_moe.py", FMOE + "utils.py", FMOE + "config.py")
CONFIGS = re.compile(re.escape(FMOE) + r"configs/[^/]*device_name=NVIDIA_H(100|200)[^/]*\.json")
#: datasheet peaks: name substring -> (bf16 FLOP/s, fp8 FLOP/s, bytes/s)
PEAKS = {"H200": (989e12, 1979e12, 4.8e12), "H100": (989e12, 1979e12, 3.35e12)}
#: the schemes of issue 17's own table (its 25 cells); the fp4 ones came later (vLLM has no fp4 Triton GEMM)
ISSUE_SCHEMES = ("dense", "fp8-block", "int4-group", "fp8-channel")
#: outputs must agree this well before anything is timed (moetool bf16 vs vLLM bf16)
MIN_SQNR_DB = {"dense": 30.0, "fp8-block": 20.0, "int4-group": 30.0, "fp8-channel": 20.0, "nvfp4": 30.0,
               "mxfp4": 30.0}


# --- getting vLLM's module -------------------------------------------------------------------

def download_wheel(version: str, dest: Path) -> Path:
    """``pip download --no-deps vllm==version`` into dest -> the wheel's path."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"vllm=={version}",
                    "-d", str(dest)], check=True)
    found = sorted(dest.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"vs_vllm.py: pip left no vllm-{version} wheel in {dest}")
    return found[-1]


def extract(wheel: Path, dest: Path) -> list[str]:
    """Only MEMBERS and the H100 / H200 config JSONs of ``wheel`` -> dest (same relative paths),
    plus dest/manifest.json naming the wheel and its sha256. Returns the names written."""
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n in MEMBERS or CONFIGS.fullmatch(n)]
        missing = [m for m in MEMBERS if m not in names]
        if missing:
            raise SystemExit(f"vs_vllm.py: {wheel.name} has no {', '.join(missing)}")
        for n in names:
            out = dest / n
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(n))
    (dest / "manifest.json").write_text(json.dumps({"wheel": wheel.name, "sha256": digest.hexdigest(),
                                                    "files": sorted(names)}, indent=1))
    return sorted(names)


def _functions_from(path: Path, names: tuple[str, ...], namespace: dict) -> None:
    """Define the top-level functions ``names`` of the Python file ``path`` in ``namespace``
    (their source only: the rest of that module, and its imports, never run)."""
    namespace.setdefault("functools", functools)  # for their decorators
    namespace.setdefault("torch", torch)
    tree = ast.parse(path.read_text(), str(path))
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    if {n.name for n in nodes} != set(names):
        raise SystemExit(f"vs_vllm.py: {path} lacks {set(names) - {n.name for n in nodes}}")
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)


# --- shims for vLLM's CUDA-only helpers ------------------------------------------------------

@triton.jit
def _silu_mul_into_kernel(x_ptr, out_ptr, N, stride_xm, stride_om, BLOCK_N: tl.constexpr):
    """out[m, :] = silu(x[m, :N]) * x[m, N:2N], in fp32, stored in out's dtype: one row block."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    g = tl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + m * stride_xm + N + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(out_ptr + m * stride_om + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_slots_into_kernel(x_ptr, out_ptr, H, stride_xm, stride_xk, stride_om, TOPK: tl.constexpr,
                           BLOCK_H: tl.constexpr):
    """out[m, :] = sum over j < TOPK of x[m, j, :], in fp32, stored in out's dtype."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(x_ptr + m * stride_xm + j * stride_xk + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_into(out: torch.Tensor, x: torch.Tensor) -> None:
    """vLLM's ``silu_and_mul(out [M, N], x [M, 2N])`` in one pass (rows contiguous)."""
    M, N = out.shape
    assert x.shape == (M, 2 * N) and x.stride(1) == 1 and out.stride(1) == 1
    if M and N:
        block = min(1024, triton.next_power_of_2(N))
        _silu_mul_into_kernel[(M, triton.cdiv(N, block))](x, out, N, x.stride(0), out.stride(0), BLOCK_N=block)


def moe_sum_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """vLLM's ``moe_sum(input [M, k, H], output [M, H])``: the sum over all k slots."""
    M, k, H = x.shape
    assert out.shape == (M, H) and x.stride(2) == 1 and out.stride(1) == 1
    if M and H:
        block = min(1024, triton.next_power_of_2(H))
        _sum_slots_into_kernel[(M, triton.cdiv(H, block))](x, out, H, x.stride(0), x.stride(1), out.stride(0),
                                                            TOPK=k, BLOCK_H=block)


def vllm_align(topk_ids: torch.Tensor, block_size: int, num_experts: int, expert_map: torch.Tensor | None,
               ignore_invalid_experts: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What vLLM's ``moe_align_block_size`` returns, from moetool's align kernel: sorted_ids
    int32 [numel + num_experts * (BM - 1)] (numel * BM when fewer pairs than experts), each
    (local) expert's pairs padded to BM with numel; expert_ids int32 [cdiv(that, BM)] (local
    ids; -1 past the used blocks); num_post_pad int32 [1]. With an expert map only
    ignore_invalid_experts=True is built (pairs of other ranks' experts take no block), what
    ``fused_experts_impl`` asks for."""
    from moetool.kernels.moe_align import moe_align_block_size

    if expert_map is not None:
        assert ignore_invalid_experts, "vllm_align: an expert map needs ignore_invalid_experts"
        local = expert_map[topk_ids.long()].to(torch.int32)
        num_local = int((expert_map >= 0).sum())
    else:
        local, num_local = topk_ids.to(torch.int32), num_experts
    numel = topk_ids.numel()
    size = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        size = min(numel * block_size, size)
    sorted_ours, experts_ours, num_post_pad = moe_align_block_size(local.contiguous(), block_size, num_local)
    sorted_ids = torch.full((size,), numel, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.full((triton.cdiv(size, block_size),), -1, dtype=torch.int32, device=topk_ids.device)
    n = min(size, sorted_ours.numel())
    sorted_ids[:n] = sorted_ours[:n]
    nb = min(expert_ids.numel(), experts_ours.numel())
    expert_ids[:nb] = experts_ours[:nb]
    return sorted_ids, expert_ids, num_post_pad


class Shims:
    """State of the stand-ins: the precomputed align results, keyed by ids and block size."""

    def __init__(self):
        self.aligned: dict = {}

    def moe_align_block_size(self, topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False,
                             ignore_invalid_experts=False, return_scatter_idx=False):
        assert not pad_sorted_ids and not return_scatter_idx, "vs_vllm.py: align options not shimmed"
        key = (topk_ids.data_ptr(), tuple(topk_ids.shape), block_size, num_experts,
               None if expert_map is None else expert_map.data_ptr())
        if key not in self.aligned:
            self.aligned[key] = vllm_align(topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts)
        return self.aligned[key]

    @staticmethod
    def quantize_input(A, A_scale, quant_dtype, per_act_token_quant, block_shape=None, **_):
        from moetool.kernels.quant import fp8_act_quant

        from moetool.kernels.common import TOKEN_GROUP

        if quant_dtype is None:
            return A, A_scale
        assert quant_dtype == torch.float8_e4m3fn and A_scale is None, \
            "vs_vllm.py: only dynamic fp8 activations are shimmed"
        if per_act_token_quant:
            assert block_shape is None
            return fp8_act_quant(A, TOKEN_GROUP)  # scales [M, 1]
        assert block_shape is not None, "vs_vllm.py: per-tensor fp8 activations are not shimmed"
        return fp8_act_quant(A, block_shape[1])


class _Activation(str, enum.Enum):
    SILU = "silu"

    @classmethod
    def from_str(cls, s: str) -> _Activation:
        return cls(s)


class _Platform:
    """vllm.platforms.current_platform for one CUDA GPU (or none)."""

    @staticmethod
    def _cap() -> int:
        if not torch.cuda.is_available():
            return -1
        major, minor = torch.cuda.get_device_capability()
        return 10 * major + minor

    def is_cuda(self):
        return torch.cuda.is_available()

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_device_capability(self, cap, device_id=0):
        return self._cap() == (cap if isinstance(cap, int) else 10 * cap[0] + cap[1])

    def has_device_capability(self, cap, device_id=0):
        return self._cap() >= (cap if isinstance(cap, int) else 10 * cap[0] + cap[1])

    def fp8_dtype(self):
        return torch.float8_e4m3fn

    def get_device_name(self, device_id=0):
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


class _Log:
    def __init__(self):
        self.messages: list[str] = []

    def _add(self, msg, *args, **_):
        text = str(msg) % args if args else str(msg)
        if text not in self.messages:
            self.messages.append(text)

    debug = info = warning = error = info_once = warning_once = debug_once = _add


def _module(name: str, package: bool = False, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    if package:
        mod.__path__ = []
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def load_vllm(src: Path = SRC_DIR) -> SimpleNamespace:
    """Execute src's fused_moe.py against stand-ins for the rest of vLLM -> (module, shims,
    log). Its int4 path is pinned to the Triton kernel."""
    path = src / FMOE / "fused_moe.py"
    if not path.is_file():
        raise SystemExit(f"vs_vllm.py: {path} is missing: run `python bench/vs_vllm.py --fetch` (with network) "
                         "and carry .bench/vllm_src to the GPU")
    shims, log, platform = Shims(), _Log(), _Platform()
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]

    class _Envs(types.ModuleType):
        VLLM_BATCH_INVARIANT = False
        VLLM_TUNED_CONFIG_FOLDER = None
        VLLM_TRITON_USE_TD = None

        def __getattr__(self, name):  # any other setting: unset
            return None

    envs = _Envs("vllm.envs")
    sys.modules["vllm.envs"] = envs

    def no_cuda_op(*_, **__):
        raise RuntimeError("vs_vllm.py: a CUDA-only vLLM op that has no shim was called")

    ops = _module("vllm._custom_ops", moe_sum=moe_sum_into, moe_wna16_gemm=no_cuda_op,
                  moe_align_block_size=no_cuda_op)
    _module("vllm", package=True, envs=envs, _custom_ops=ops)
    _module("vllm.logger", init_logger=lambda name: log)
    _module("vllm.platforms", current_platform=platform)
    _module("vllm.triton_utils", package=True, tl=tl, triton=triton)
    _module("vllm.triton_utils.allocation", set_triton_allocator=lambda *a, **k: None)
    _module("vllm.utils", package=True)
    _module("vllm.utils.math_utils", next_power_of_2=lambda n: 1 if n < 1 else 1 << (n - 1).bit_length())
    _module("vllm.utils.platform_utils",
            get_device_name_as_file_name=lambda device_id=0: re.sub(r"[\s/]+", "_", platform.get_device_name()))
    _module("vllm.utils.torch_utils", direct_register_custom_op=lambda *a, **k: None)
    for pkg in ("vllm.model_executor", "vllm.model_executor.layers"):
        _module(pkg, package=True)
    _module("vllm.model_executor.layers.fused_moe", package=True, get_config=lambda: None)
    _module("vllm.model_executor.layers.fused_moe.modular_kernel",
            FusedMoEExpertsModular=SimpleNamespace(adjust_N_for_activation=lambda N, act: N // 2))

    def apply_moe_activation(activation, output, input, **_):
        assert activation == _Activation.SILU, f"vs_vllm.py: activation {activation} not shimmed"
        silu_and_mul_into(output, input)
        return output

    _module("vllm.model_executor.layers.fused_moe.activation", MoEActivation=_Activation,
            apply_moe_activation=apply_moe_activation)
    config_ns = {"torch": torch}
    _functions_from(src / FMOE / "config.py", ("_get_config_dtype_str",), config_ns)
    unquantized = SimpleNamespace(use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                                  ocp_mx_scheme=None, per_act_token_quant=False, w1_scale=None, w2_scale=None,
                                  w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None, block_shape=None,
                                  w1_bias=None, w2_bias=None)
    _module("vllm.model_executor.layers.fused_moe.config", FUSED_MOE_UNQUANTIZED_CONFIG=unquantized,
            FusedMoEQuantConfig=object, _get_config_dtype_str=config_ns["_get_config_dtype_str"])
    _module("vllm.model_executor.layers.fused_moe.moe_align_block_size",
            moe_align_block_size=shims.moe_align_block_size)
    utils_ns = {"current_platform": platform, "envs": envs}
    _functions_from(src / FMOE / "utils.py", ("enable_swap_ab",), utils_ns)
    _module("vllm.model_executor.layers.fused_moe.utils", enable_swap_ab=utils_ns["enable_swap_ab"],
            moe_kernel_quantize_input=shims.quantize_input, resolve_moe_use_td=lambda: False,
            warn_if_moe_use_td_ineffective=lambda *a, **k: None)
    import importlib.util

    name = "vllm.model_executor.layers.fused_moe.fused_moe"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    mod.should_moe_wna16_use_cuda = lambda *a, **k: False  # its Triton int4 kernel, never the CUDA one
    return SimpleNamespace(module=mod, shims=shims, log=log)


# --- the ceilings: what this GPU can move and multiply --------------------------------------

def _median_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in ev:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in ev)[reps // 2]


def measure_peaks(reps: int = 20) -> dict:
    """What this GPU reaches on the two things a MoE layer's floor is made of -> {"hbm": bytes/s of
    a 1 GiB device-to-device copy (bytes read + written), "bf16": FLOP/s of an 8192^3 bf16
    matmul, "fp8": of the same in e4m3 (``torch._scaled_mm``, bf16 out)}; medians of ``reps``."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    hbm = 2 * n / (_median_us(lambda: dst.copy_(src), reps) * 1e-6)
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    bf16 = 2 * m ** 3 / (_median_us(lambda: a @ b, reps) * 1e-6)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    fp8 = 2 * m ** 3 / (_median_us(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16), reps) * 1e-6)
    return {"hbm": hbm, "bf16": bf16, "fp8": fp8}


def ceiling(row: dict, peaks: dict) -> dict:
    """A timed row's floor (module docstring) -> {"bytes", "flops", "floor_us", "bound" ("HBM" or
    "MMA"), "ceiling" (vLLM us / floor us), "ours_of_floor" (floor us / ours)}."""
    mma = peaks["fp8"] if row["scheme"].startswith("fp8") else peaks["bf16"]
    t_bytes, t_flops = row["bytes"] / peaks["hbm"] * 1e6, row["flops"] / mma * 1e6
    floor = max(t_bytes, t_flops)
    return {"floor_us": floor, "bound": "HBM" if t_bytes >= t_flops else "MMA",
            "ceiling": row["vllm_us"] / floor, "ours_of_floor": floor / row["after_us"]}


# --- one cell --------------------------------------------------------------------------------

def dequantized_bf16(scheme: str, w13: dict, w2: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4 stacked weights -> bf16 [E, 2N, H], [E, H, N] through the format's dequantize kernel
    (per expert and global-scale part): what vLLM's emulation experts multiply."""
    from moetool.kernels.fp4_quant import fp4_dequant

    def one(t: dict) -> torch.Tensor:
        E, R = t["weight_packed"].shape[:2]
        gs = t.get("weight_global_scale")
        P = 1 if gs is None else gs.shape[1]
        out = torch.empty((E, R, t["weight_packed"].shape[2] * 2), dtype=torch.bfloat16, device=t["weight_packed"].device)
        for e in range(E):
            for p in range(P):
                rows = slice(p * R // P, (p + 1) * R // P)
                part = {"weight_packed": t["weight_packed"][e, rows], "weight_scale": t["weight_scale"][e, rows]}
                if gs is not None:
                    part["weight_global_scale"] = gs[e, p:p + 1]
                out[e, rows] = fp4_dequant(part).to(torch.bfloat16)
        return out

    return one(w13), one(w2)


def vllm_args(scheme: str, w13: dict, w2: dict, layer: tune.Layer, group: int = tune.INT4_GROUP,
              dense: tuple | None = None) -> dict:
    """moetool's stacked tensors as vLLM's fused_experts_impl takes them (no copies: int4's
    int32 words read as bytes are vLLM's two nibbles per byte, low nibble first, stored q + 8);
    fp4: ``dense``, the weights dequantized to bf16 (:func:`dequantized_bf16`)."""
    if scheme in tune.FP4:
        kw = {"w1": dense[0], "w2": dense[1]}
    elif scheme == "dense":
        kw = {"w1": w13["weight"], "w2": w2["weight"]}
    elif scheme == "fp8-block":
        kw = {"w1": w13["weight"], "w2": w2["weight"], "use_fp8_w8a8": True, "w1_scale": w13["weight_scale_inv"],
              "w2_scale": w2["weight_scale_inv"], "block_shape": [128, 128]}
    elif scheme == "fp8-channel":
        kw = {"w1": w13["weight"], "w2": w2["weight"], "use_fp8_w8a8": True, "per_channel_quant": True,
              "w1_scale": w13["weight_scale"], "w2_scale": w2["weight_scale"]}
    elif scheme == "int4-group":
        kw = {"w1": w13["weight_packed"].view(torch.uint8), "w2": w2["weight_packed"].view(torch.uint8),
              "use_int4_w4a16": True, "w1_scale": w13["weight_scale"], "w2_scale": w2["weight_scale"],
              "block_shape": [0, group]}
    else:
        raise SystemExit(f"vs_vllm.py: scheme {scheme!r} has no vLLM counterpart here")
    if layer.ep > 1:
        emap = torch.full((layer.E_global,), -1, dtype=torch.int32, device=w13[next(iter(w13))].device)
        emap[:layer.E] = torch.arange(layer.E, dtype=torch.int32, device=emap.device)
        kw.update(global_num_experts=layer.E_global, expert_map=emap)
    return kw


def tile_choices(scheme: str, layer: tune.Layer, T: int, prev_table: dict | None = None) -> dict:
    from moetool.kernels.moe_tiles import default_config, entry_key, nearest_tokens, rule_config, select_config

    E, N, H, k = layer.E, layer.N, layer.H, layer.k
    out = {"before": default_config(scheme, T * k / E, torch.bfloat16, False, tune.INT4_GROUP),
           "rules": rule_config(scheme, E, N, H, k, T, torch.bfloat16, tune.INT4_GROUP,
                                global_experts=layer.E_global),
           "after": select_config(scheme, E, N, H, k, T, torch.bfloat16, False, tune.INT4_GROUP,
                                  global_experts=layer.E_global)}
    per_t = (prev_table or {}).get(entry_key(scheme, E, N, H, k, tune.INT4_GROUP))
    if per_t:
        out["prev"] = per_t[nearest_tokens(per_t, T)]
    return out


def problem(layer: tune.Layer, T: int, device, dtype: torch.dtype = torch.bfloat16):
    """One cell's inputs: hidden [T, H] dtype, global ids (vLLM), local ids (-1 elsewhere,
    moetool), top-k weights fp32 [T, k]."""
    ids, local, tw = tune.routing(T, layer, device)
    gen = torch.Generator(device=device).manual_seed(T)
    hidden = torch.randn(T, layer.H, device=device, dtype=dtype, generator=gen)
    return hidden, ids, local, tw


def agree(vllm, scheme: str, layer: tune.Layer, inputs, weights, configs: dict, dense=None) -> tuple[torch.Tensor, dict]:
    """vLLM's output [T, H] and the SQNR (dB) of moetool's bf16 output under each config
    against it."""
    hidden, ids, local, tw = inputs
    w13, w2 = weights
    vllm.shims.aligned.clear()  # keyed by data pointers, which a new cell's tensors may reuse
    ref = vllm.module.fused_experts_impl(hidden, topk_weights=tw, topk_ids=ids, activation="silu",
                                         **vllm_args(scheme, w13, w2, layer, dense=dense))
    out = torch.empty(hidden.shape, dtype=torch.bfloat16, device=hidden.device)
    with tune.fixed_align():
        return ref, {name: tune.sqnr_db(tune.run_ours(hidden, w13, w2, scheme, local, tw, cfg, out), ref)
                     for name, cfg in configs.items()}


def run_cell(vllm, layer_name: str, scheme: str, T: int, weights, reps: int, peak, dense=None,
             cache3: bool = False, prev_table: dict | None = None) -> dict:
    """Check, then time one cell (module docstring) -> its row."""
    layer = tune.LAYERS[layer_name]
    w13, w2 = weights
    inputs = hidden, ids, local, tw = problem(layer, T, "cuda")
    vkw = vllm_args(scheme, w13, w2, layer, dense=dense)
    out = torch.empty(T, layer.H, dtype=torch.bfloat16, device="cuda")
    choices = tile_choices(scheme, layer, T, prev_table)
    row = {"layer": layer_name, "scheme": scheme, "T": T, "E": layer.E, "E_global": layer.E_global,
           "H": layer.H, "N": layer.N, "k": layer.k,
           "vllm_config": _vllm_config(vllm, scheme, w13, w2, layer, T, dense),
           "configs": {name: asdict(cfg) for name, cfg in choices.items()}}
    _, sq = agree(vllm, scheme, layer, inputs, weights, choices, dense)
    row["sqnr_db"] = min(sq.values())
    if not row["sqnr_db"] >= MIN_SQNR_DB[scheme]:
        row["error"] = f"outputs disagree: SQNR {sq} dB, need >= {MIN_SQNR_DB[scheme]}"
        return row

    def run_vllm():
        return vllm.module.fused_experts_impl(hidden, topk_weights=tw, topk_ids=ids, activation="silu", **vkw)

    fns = {"vllm": run_vllm}
    for cfg in dict.fromkeys(choices.values()):  # each distinct config once
        fns[cfg] = lambda c=cfg: tune.run_ours(hidden, w13, w2, scheme, local, tw, c, out)
    if cache3:
        fns["c3f32"] = lambda: tune.run_ours(hidden, w13, w2, scheme, local, tw, choices["after"], out, torch.float32)
    with tune.fixed_align():
        us = tune.time_graphs(fns, reps)  # in turns: drift falls on both sides alike
    row["vllm_us"] = us["vllm"]
    for name, cfg in (*choices.items(), *((("c3f32", "c3f32"),) if cache3 else ())):
        row[f"{name}_us"] = us[cfg]
        row[f"{name}_ratio"] = row["vllm_us"] / us[cfg]
    pairs = int((local >= 0).sum())
    active = int(torch.unique(local[local >= 0]).numel())
    nbytes = active * tune.weight_bytes_per_expert(w13, w2) + 2 * T * layer.H * 2  # bf16 hidden in, bf16 out
    flops = 6.0 * pairs * layer.N * layer.H
    row.update(pairs=pairs, active_experts=active, bytes=nbytes, flops=flops)
    t = row["after_us"] * 1e-6
    row["tflops"] = flops / t / 1e12
    row["hbm_tbps"] = nbytes / t / 1e12
    if peak:
        row["hbm_pct"] = 100 * nbytes / t / peak[2]
        row["mma_pct"] = 100 * flops / t / (peak[1] if scheme.startswith("fp8") else peak[0])
    return row


def _vllm_config(vllm, scheme, w13, w2, layer, T, dense=None) -> dict:
    """The tiles vLLM picks for this call (its lookup, then its default)."""
    kw = vllm_args(scheme, w13, w2, layer, dense=dense)
    dtype = {"dense": None, "fp8-block": "fp8_w8a8", "fp8-channel": "fp8_w8a8", "int4-group": "int4_w4a16",
             "nvfp4": None, "mxfp4": None}[scheme]
    return dict(vllm.module.try_get_optimal_moe_config(kw["w1"].size(), kw["w2"].size(), layer.k, dtype, T,
                                                       kw.get("block_shape")))


def geomean(values) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def table(rows: list[dict], key: str = "after_ratio") -> str:
    """The issue's table: one line per (layer, scheme), a cell per T holding ``key``."""
    tokens = sorted({r["T"] for r in rows})
    lines = ["| shape | " + " | ".join(f"T={t}" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    shapes = list(dict.fromkeys((r["layer"], r["scheme"]) for r in rows))
    for layer, scheme in shapes:
        cells = {r["T"]: r for r in rows if (r["layer"], r["scheme"]) == (layer, scheme)}
        vals = []
        for t in tokens:
            r = cells.get(t)
            vals.append("" if r is None else "error" if "error" in r else f"{r[key]:.2f}")
        lines.append(f"| {layer} {scheme} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    issue = [r for r in ok if r["scheme"] in ISSUE_SCHEMES]
    parts = [f"geomean before {geomean(r['before_ratio'] for r in ok):.2f}",
             f"rules {geomean(r['rules_ratio'] for r in ok):.2f}",
             f"after {geomean(r['after_ratio'] for r in ok):.2f} (the issue's {len(issue)} cells "
             f"{geomean(r['after_ratio'] for r in issue):.2f})",
             f"cells < 1.0 after: {sum(r['after_ratio'] < 1.0 for r in ok)} of {len(ok)}"]
    if any("ceiling" in r for r in ok):
        parts.append(f"geomean of the ceilings {geomean(r['ceiling'] for r in ok):.2f} (the issue's cells "
                     f"{geomean(r['ceiling'] for r in issue):.2f})")
    return ", ".join(parts)


def ceiling_table(rows: list[dict], peaks: dict) -> str:
    """One line per timed cell: its bytes, FLOPs, both sides' times, the floor and the ceiling."""
    lines = [f"floors from {peaks['hbm'] / 1e12:.2f} TB/s, {peaks['bf16'] / 1e12:.0f} TFLOP/s bf16, "
             f"{peaks['fp8'] / 1e12:.0f} TFLOP/s fp8 ({peaks['source']})",
             "| cell | MB | GFLOP | ours us | vLLM us | floor us | bound | ours / floor | ratio | ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ceiling" not in r:
            continue
        lines.append(f"| {r['layer']} {r['scheme']} T={r['T']} | {r['bytes'] / 1e6:.0f} | {r['flops'] / 1e9:.1f} | "
                     f"{r['after_us']:.1f} | {r['vllm_us']:.1f} | {r['floor_us']:.1f} | {r['bound']} | "
                     f"{100 * r['ours_of_floor']:.0f} % | {r['after_ratio']:.2f} | {r['ceiling']:.2f} |")
    return "\n".join(lines)


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['layer']:9} {r['scheme']:10} T={r['T']:5d} ERROR {r['error']}", flush=True)
        return
    extra = ""
    if "hbm_pct" in r and r["T"] <= 16:
        extra = f" HBM {r['hbm_pct']:.0f}%"
    if "mma_pct" in r and r["T"] >= 4096:
        extra = f" {r['tflops']:.0f} TFLOP/s, MMA {r['mma_pct']:.0f}%"
    for name in ("prev", "c3f32"):
        if f"{name}_us" in r:
            extra += f" | {name} {r[f'{name}_us']:8.1f} ({r[f'{name}_ratio']:.2f}x)"
    print(f"{r['layer']:9} {r['scheme']:10} T={r['T']:5d} vLLM {r['vllm_us']:8.1f} us | before {r['before_us']:8.1f} "
          f"({r['before_ratio']:.2f}x) rules {r['rules_us']:8.1f} ({r['rules_ratio']:.2f}x) after "
          f"{r['after_us']:8.1f} ({r['after_ratio']:.2f}x) SQNR {r['sqnr_db']:.1f} dB{extra}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fetch", action="store_true", help="download the vLLM wheel and extract its module, then exit")
    ap.add_argument("--version", default=VLLM_VERSION)
    ap.add_argument("--wheel", type=Path, default=None, help="extract from this wheel instead of downloading")
    ap.add_argument("--src", type=Path, default=SRC_DIR, help="the extracted module's root")
    ap.add_argument("--layers", nargs="+", default=list(tune.LAYERS), choices=list(tune.LAYERS))
    ap.add_argument("--schemes", nargs="+", default=list(tune.SCHEMES_TUNED), choices=list(tune.SCHEMES_TUNED))
    ap.add_argument("--tokens", nargs="+", type=int, default=None, help="default: the issue's T per shape")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--flush-by-writing", action="store_true",
                    help="flush the L2 by overwriting a buffer, as the earlier tables did")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cache3", action="store_true", help="also time GEMM2 writing fp32 rows (column c3f32)")
    ap.add_argument("--prev-table", type=Path, default=None, help="also time this tile table's choice (column prev)")
    ap.add_argument("--no-peaks", action="store_true",
                    help="floors from the datasheet (PEAKS) instead of a copy and matmuls measured at the start")
    args = ap.parse_args(argv)
    tune.FLUSH_BY_WRITING = args.flush_by_writing
    if args.fetch or args.wheel:
        wheel = args.wheel or download_wheel(args.version, WHEEL_DIR)
        names = extract(wheel, args.src)
        size = sum((args.src / n).stat().st_size for n in names)
        print(f"extracted {len(names)} files ({size / 1e6:.2f} MB) of {wheel.name} into {args.src}")
        return
    if not torch.cuda.is_available():
        sys.exit("bench/vs_vllm.py needs a CUDA GPU (--fetch does not)")
    vllm = load_vllm(args.src)
    manifest = json.loads((args.src / "manifest.json").read_text())
    name = torch.cuda.get_device_name()
    peak = next((v for key, v in PEAKS.items() if key in name), None)
    print(f"device: {name}; vLLM module from {manifest['wheel']}; torch {torch.__version__}, triton "
          f"{triton.__version__}", flush=True)
    if args.no_peaks or peak is None:
        peaks = {"hbm": (peak or PEAKS["H100"])[2], "bf16": (peak or PEAKS["H100"])[0],
                 "fp8": (peak or PEAKS["H100"])[1], "source": "datasheet"}
    else:
        peaks = {**measure_peaks(), "source": "measured here"}
    print(f"floors: {peaks['hbm'] / 1e12:.2f} TB/s copy, {peaks['bf16'] / 1e12:.0f} TFLOP/s bf16, "
          f"{peaks['fp8'] / 1e12:.0f} TFLOP/s fp8 ({peaks['source']})", flush=True)
    prev_table = None
    if args.prev_table:
        from moetool.kernels.moe_tiles import parse_table

        prev_table = parse_table(json.loads(args.prev_table.read_text()), str(args.prev_table))
    rows = []
    for (layer_name, scheme), tokens in tune.CELLS.items():
        if layer_name not in args.layers or scheme not in args.schemes:
            continue
        layer = tune.LAYERS[layer_name]
        weights = dense = None
        torch.cuda.empty_cache()
        weights = tune.make_weights(scheme, layer.E, layer.H, layer.N, "cuda")
        if scheme in tune.FP4:
            dense = dequantized_bf16(scheme, *weights)
        for T in args.tokens or tokens:
            try:
                r = run_cell(vllm, layer_name, scheme, T, weights, args.reps, peak, dense, args.cache3, prev_table)
            except Exception as e:  # noqa: BLE001 - report the cell and go on
                r = {"layer": layer_name, "scheme": scheme, "T": T, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if "error" not in r:
                r.update(ceiling(r, peaks))
            rows.append(r)
            print_row(r)
        weights = None
    print("\nratio = vLLM us / moetool us (> 1: moetool faster), before:\n" + table(rows, "before_ratio"))
    print("\nafter (select_config: tuned table, else rules):\n" + table(rows, "after_ratio"))
    for key, what in (("prev_ratio", "--prev-table's tiles"), ("c3f32_ratio", "after's tiles, fp32 cache3")):
        if any(key in r for r in rows):
            print(f"\n{what}:\n" + table([r for r in rows if key in r], key))
    print("\nceilings (vLLM us / floor us: the most any kernel could reach in the cell):\n" + ceiling_table(rows, peaks))
    print("\n" + summary(rows))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "vllm": manifest, "torch": torch.__version__,
                                         "triton": triton.__version__, "vllm_log": vllm.log.messages,
                                         "peaks": peaks, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
