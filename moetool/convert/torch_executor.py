"""The torch executor of conversion plans, shared by quantize, repack and shard.

The plans themselves (groups, files, indexes) are pure values in ``moetool.convert.plan`` (re-exported
here); this module adds what needs torch: each :class:`Source` reads and converts linears,
the :class:`Planner` learns the output tensor specs (probing one expert per layer shape), and
the executor streams each file through :meth:`OutputDir.write_safetensors`: one expert at a
time is read, converted and handed to the writer thread, so memory holds a few experts (plus
the small scale tensors of one stacked group), never a shard. Outputs that are only byte
ranges of the input are copied by ``moetool.convert.byte_executor`` instead, without torch.
"""
from __future__ import annotations

import math
import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator

import torch

from moetool.model.families import ModelSpec, MoELayerSpec
from moetool.read.checkpoint import Checkpoint
from moetool.errors import MoetoolError
from moetool.read.experts import ExpertReader, Linear
from moetool.formats.base import WeightFormat
from moetool.formats.common import error_sums
from moetool.formats.dense import Dense
from moetool.formats.registry import FORMATS
from moetool.memory import trim_in_background
from moetool.convert.plan import (ROLES, Copy, Dequant, ExpertLinear, Fused, Group, Plan, PlannedFile, SharedLinear,
                                  Stacked, Summary)
from moetool.convert.output import OutputDir, finish_plan
from moetool.read.safetensors import SAFETENSORS_METADATA, TensorInfo, TensorSpec, pread_exactly

DTYPE_BY_NAME = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_dtype(config: dict) -> torch.dtype:
    name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if isinstance(name, str) and name.startswith("torch."):
        name = name[6:]
    return DTYPE_BY_NAME.get(name, torch.bfloat16)


def same_format(a: WeightFormat, b: WeightFormat) -> bool:
    """A linear stored in ``a`` is what ``b`` stores: converting copies it (``stores_like``)."""
    return a.stores_like(b)


# ---------------------------------------------------------------------------------- sources


class Source:
    """One input checkpoint with its reader, converting linears to the output format."""

    def __init__(self, ckpt: Checkpoint, spec: ModelSpec, out_fmt: WeightFormat | None, stats: "ErrorStats",
                 device: str = "cpu"):
        self.ckpt = ckpt
        self.device = torch.device(device)
        ckpt.pin_memory = self.device.type == "cuda"
        self.reader = ExpertReader(ckpt, spec)
        self.spec = spec
        self.in_fmt = self.reader.fmt
        self.out_fmt = out_fmt or self.in_fmt
        self.passthrough = same_format(self.in_fmt, self.out_fmt)
        if self.passthrough:  # copied as stored: the output keeps the input's parameters (int4's clip)
            self.out_fmt = self.in_fmt
        self.dtype = model_dtype(ckpt.config)
        self.stats = stats
        self._layers = {m.index: m for m in spec.moe_layers}
        self._warming: threading.Thread | None = None
        if self.device.type == "cuda":
            self._warming = threading.Thread(target=self._warm_up, args=(self.device,), name="moetool-cuda-start",
                                             daemon=True)
            self._warming.start()

    def _warm_up(self, device: torch.device) -> None:
        """Create the CUDA context and load the output format's kernel (a tiny conversion) while
        the main thread plans on the CPU: ~1.3 s of the first conversion on an H100 host, 2.9 s
        when Triton compiles. A failure here is left to the real conversion to report."""
        try:
            w = torch.randn(256, 256, device=device)
            if not self.passthrough:
                gpu_quantize(self.out_fmt, w, self.dtype)
            torch.cuda.synchronize(device)
        except Exception:
            pass

    def ready(self) -> None:
        """Wait for the GPU start-up begun with the source (nothing on the CPU)."""
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    @contextmanager
    def on_cpu(self) -> Iterator[None]:
        """Convert on the CPU meanwhile: planning's probes (the format's CPU and CUDA code give
        the same tensors, so the same output specs) need not wait for the GPU to start."""
        device, self.device = self.device, torch.device("cpu")
        pinned, self.ckpt.pin_memory = self.ckpt.pin_memory, False  # page-locking waits for the CUDA context
        try:
            yield
        finally:
            self.device, self.ckpt.pin_memory = device, pinned

    def layer(self, index: int) -> MoELayerSpec:
        return self._layers[index]

    def convert(self, lin: Linear, where: str, in_fmt: WeightFormat | None = None) -> Linear:
        fmt = in_fmt or self.in_fmt
        if same_format(fmt, self.out_fmt):
            return lin
        if self.device.type == "cuda":
            return self._convert_cuda(lin, where, fmt)
        try:
            # a dense weight goes in as stored (bf16...): the fused quantizers convert it to
            # float32 a band at a time, exactly as fmt.dequantize would
            if isinstance(fmt, Dense):
                fmt.logical_shape(lin)
                w = lin["weight"]
            else:
                w = fmt.dequantize(lin)
            q, sig, noise = self.out_fmt.quantize_measured(w, self.dtype)
        except MoetoolError as err:
            raise MoetoolError(f"{where}: {err}") from None
        self.stats.add_sums(sig, noise)
        return q

    def _convert_cuda(self, lin: Linear, where: str, fmt: WeightFormat) -> Linear:
        """The same conversion on the GPU: a stream per converting thread, pinned host
        buffers, Triton quantization kernels where the format has one (bit-identical to the
        torch formulas), the format's torch code otherwise."""
        stream = _thread_stream(self.device)
        with torch.cuda.stream(stream):
            try:
                w = fmt.dequantize({k: v.to(self.device, non_blocking=True) for k, v in lin.items()})
                q = gpu_quantize(self.out_fmt, w, self.dtype) or self.out_fmt.quantize(w, self.dtype)
            except MoetoolError as err:
                raise MoetoolError(f"{where}: {err}") from None
            self.stats.add(w, self.out_fmt.dequantize(q))
            out = {k: v.to("cpu", non_blocking=True) for k, v in q.items()}
        stream.synchronize()
        return out

    def expert_role(self, layer: MoELayerSpec, e: int, role: str) -> Linear:
        """Expert e's gate, up or down in the output format, and its ``bias`` (stored dtype,
        never quantized) where the experts have biases (gpt-oss)."""
        lin = self._expert_linear(layer, e, role)
        biases = self.reader.biases(layer, e)
        return lin if biases is None else {**lin, "bias": biases[ROLES.index(role)]}

    def _expert_linear(self, layer: MoELayerSpec, e: int, role: str) -> Linear:
        if role != "down" and self.out_fmt.joint_gate_up and not self.passthrough:
            return self._joint_gate_up(layer, e, role)
        where = f"{layer.prefix} expert {e} {role}"
        st = layer.storage
        if st.kind == "per-expert":
            base = st.per_expert_bases(e)[ROLES.index(role)]
            # read into reused buffers when the linear is converted into fresh tensors (not
            # passed through, not to dense, which may return its input): no page faults
            scratch = not self.passthrough and not isinstance(self.out_fmt, Dense)
            return self.convert(self.reader.linear(base, scratch=scratch), f"{base}.{self.in_fmt.suffixes[0]}")
        if role == "down":
            return self.convert(self.reader.down(layer, e), where)
        return self.convert(self.reader.gate_up_down(layer, e)[ROLES.index(role)], where)

    def _joint_gate_up(self, layer: MoELayerSpec, e: int, role: str) -> Linear:
        """Expert e's gate or up in a format whose gate and up share a scale (``joint_gate_up``):
        both quantized as one w13 [2N, H], cut in two, the asked half kept. Each half's request
        quantizes the pair again (deterministic: the same bytes): nothing is held between the two
        requests, which may come from two threads, or one of them never (a resumed run whose
        other file is finished)."""
        where = f"{layer.prefix} expert {e} {role} (quantized with its {'up' if role == 'gate' else 'gate'})"
        gate, up, _ = self.reader.gate_up_down(layer, e)
        try:
            w13 = torch.cat([self.in_fmt.dequantize(gate) if self.in_fmt.quantized else gate["weight"].float(),
                             self.in_fmt.dequantize(up) if self.in_fmt.quantized else up["weight"].float()])
            if self.device.type == "cuda":
                w13 = w13.to(self.device)
                q = gpu_quantize(self.out_fmt, w13, self.dtype) or self.out_fmt.quantize(w13, self.dtype)
                q = {k: v.cpu() for k, v in q.items()}
            else:
                q = self.out_fmt.quantize(w13, self.dtype)
            half = self.out_fmt.split_rows(q, [layer.intermediate, layer.intermediate])[ROLES.index(role)]
        except MoetoolError as err:
            raise MoetoolError(f"{where}: {err}") from None
        self.stats.add(w13.split(layer.intermediate)[ROLES.index(role)].cpu(), self.out_fmt.dequantize(half))
        return half

    def expert_w13(self, layer: MoELayerSpec, e: int) -> Linear:
        """Expert e's w13 [2N, H] (gate rows, then up) and its ``bias`` [2N] where it has one."""
        if self.passthrough:
            w13 = self.reader.w13(layer, e)
        else:
            w13 = self.out_fmt.cat_rows([self._expert_linear(layer, e, r) for r in ("gate", "up")])
        biases = self.reader.biases(layer, e)
        return w13 if biases is None else {**w13, "bias": torch.cat(biases[:2])}

    def plain_linear(self, base: str) -> Linear:
        fmt, lin = self.reader.plain_linear(base)
        return self.convert(lin, f"{base}.{fmt.suffixes[0]}", in_fmt=fmt)


_streams = threading.local()


def _thread_stream(device: torch.device):
    stream = getattr(_streams, "stream", None)
    if stream is None:
        stream = _streams.stream = torch.cuda.Stream(device)
    return stream


def gpu_quantize(fmt: WeightFormat, w: torch.Tensor, orig_dtype: torch.dtype) -> Linear | None:
    """Quantize a CUDA weight with the format's Triton kernel (``WeightFormat.quantize_cuda``);
    None where no kernel applies or the input is not finite (the format's torch code then
    quantizes, or raises naming the problem). The weight itself is checked here: the kernels'
    maxima skip a NaN (the GPU's max returns the other operand), so a NaN came out as an fp8
    NaN under a finite scale, and the conversion ended complete."""
    if not bool(torch.isfinite(w).all()):
        return None
    return fmt.quantize_cuda(w, orig_dtype)


class ErrorStats:
    """Relative error and SQNR of dequantize(quantize(w)) against w, over all converted linears."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.sum_rel = 0.0
        self.max_rel = 0.0
        self.min_sqnr = float("inf")
        self.sig = 0.0
        self.noise = 0.0

    def add(self, ref: torch.Tensor, got: torch.Tensor) -> None:
        """ref: the weight before quantization; got: a fresh dequantized copy (overwritten)."""
        self.add_sums(*error_sums(ref, got))

    def add_sums(self, sig: float, noise: float) -> None:
        """One linear's sum ref^2 and sum (got - ref)^2 (``WeightFormat.quantize_measured``)."""
        rel = (noise / sig) ** 0.5 if sig > 0 else (0.0 if noise == 0 else float("inf"))
        with self._lock:
            self._add(rel, sig, noise)

    def _add(self, rel: float, sig: float, noise: float) -> None:
        self.count += 1
        self.sum_rel += rel
        self.max_rel = max(self.max_rel, rel)
        self.sig += sig
        self.noise += noise
        if noise > 0 and sig > 0:
            self.min_sqnr = min(self.min_sqnr, 10 * math.log10(sig / noise))

    def summary(self) -> dict:
        if self.count == 0:
            return {}
        sqnr = 10 * math.log10(self.sig / self.noise) if self.noise > 0 and self.sig > 0 else float("inf")
        return {"linears": self.count, "mean_rel_err": self.sum_rel / self.count, "max_rel_err": self.max_rel,
                "sqnr_db": sqnr, "min_sqnr_db": self.min_sqnr}


# ---------------------------------------------------------------------------------- planning


class Planner:
    """Builds the groups of a conversion and their output tensor specs (probing one expert per
    distinct layer shape to learn the output format's dtypes and shapes)."""

    def __init__(self, sources: list[Source]):
        self.sources = sources
        self._probe_cache: dict[tuple, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}

    def validate_experts(self, src: Source) -> None:
        """Every expert of a layer must store the same tensors with the same dtypes and shapes."""
        ckpt = src.ckpt
        for layer in src.spec.moe_layers:
            st = layer.storage
            if st.kind == "stacked":  # every stacked tensor of the format, one slice per stored expert
                for base in (st.gate_up, st.down):
                    for s in src.in_fmt.suffixes:
                        info = ckpt.tensors.get(f"{base}_{s}")
                        if info is None:
                            raise MoetoolError(f"{base}_{s}: not found (layer {layer.index}; {src.in_fmt.name} "
                                               f"stores {', '.join(src.in_fmt.suffixes)})")
                        if not info.shape or info.shape[0] != layer.n_stored:
                            raise MoetoolError(f"{base}_{s}: shape {list(info.shape)}, expected {layer.n_stored} "
                                               f"experts in its first dimension")
            if st.kind != "per-expert":
                continue
            for e in range(layer.n_stored):  # every linear has all of the format's tensors
                for base in st.per_expert_bases(e):
                    missing = [s for s in src.in_fmt.suffixes if f"{base}.{s}" not in ckpt.tensors]
                    if missing:
                        raise MoetoolError(f"{base}.{missing[0]}: not found (expert {e} of layer {layer.index}; "
                                           f"{src.in_fmt.name} stores {', '.join(src.in_fmt.suffixes)})")
            for r, _ in enumerate(ROLES):
                ref_base = st.per_expert_bases(0)[r]
                want = {s: (ckpt.tensors[f"{ref_base}.{s}"].dtype, ckpt.tensors[f"{ref_base}.{s}"].shape)
                        for s in ckpt.suffixes(ref_base)}
                for e in range(1, layer.n_stored):
                    base = st.per_expert_bases(e)[r]
                    got = {s: (ckpt.tensors[f"{base}.{s}"].dtype, ckpt.tensors[f"{base}.{s}"].shape)
                           for s in ckpt.suffixes(base)}
                    if got != want:
                        raise MoetoolError(f"{base}: tensors {_fmt_sig(got)} differ from expert 0's {_fmt_sig(want)}")

    def _probe_key(self, src_index: int, layer: MoELayerSpec, what: str) -> tuple:
        return (src_index, layer.num_experts, layer.hidden, layer.intermediate, layer.storage.kind, what,
                _storage_sig(self.sources[src_index].ckpt, layer))

    @staticmethod
    def _probe_linear(src: Source, layer: MoELayerSpec, what: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        lin = src.expert_w13(layer, 0) if what == "w13" else src.expert_role(layer, 0, "down" if what == "w2" else what)
        return {s: (t.dtype, tuple(t.shape)) for s, t in lin.items()}

    def _probe(self, src_index: int, layer: MoELayerSpec, what: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        src = self.sources[src_index]
        key = self._probe_key(src_index, layer, what)
        if key not in self._probe_cache:
            stats, src.stats = src.stats, ErrorStats()  # a probe is not part of the output's statistics
            try:
                with src.on_cpu():
                    self._probe_cache[key] = self._probe_linear(src, layer, what)
            finally:
                src.stats = stats
        return self._probe_cache[key]

    def probe_ahead(self, whats: tuple[str, ...], src_index: int = 0) -> None:
        """Probe each distinct layer shape for each of ``whats`` ("gate", "up", "down", "w13",
        "w2") at once, a thread each: one after another, fp8-block's three probes of a
        DeepSeek-V3-sized layer took 1.3 s of an H100 host's CPU before the first write. A probe
        that fails is left for ``specs`` to repeat, so errors come in plan order as before."""
        src = self.sources[src_index]
        todo: dict[tuple, tuple[MoELayerSpec, str]] = {}
        for layer in src.spec.moe_layers:
            for what in whats:
                key = self._probe_key(src_index, layer, what)
                if key not in self._probe_cache:
                    todo.setdefault(key, (layer, what))
        if len(todo) < 2:
            return

        def probe(item: tuple[MoELayerSpec, str]):
            try:
                return self._probe_linear(src, *item)
            except MoetoolError:
                return None

        stats, src.stats = src.stats, ErrorStats()  # probes are not part of the output's statistics
        try:
            with src.on_cpu(), ThreadPoolExecutor(min(4, len(todo)), thread_name_prefix="moetool-probe") as pool:
                found = list(pool.map(probe, todo.values()))
        finally:
            src.stats = stats
        for key, sig in zip(todo, found):
            if sig is not None:
                self._probe_cache[key] = sig

    def specs(self, group: Group) -> list[TensorSpec]:
        by_expert = isinstance(group, (Stacked, Fused))
        src = self.sources[(group.sources[0] if group.sources else 0) if by_expert else group.source]
        if isinstance(group, Copy):
            info = src.ckpt.info(group.src)
            return [TensorSpec(group.dst, info.dtype, info.shape)]
        if isinstance(group, Dequant):  # the shape only (packed formats keep it in a tensor)
            fmt, lin = src.reader.plain_linear(group.src_base)
            return [TensorSpec(group.dst, src.dtype, fmt.logical_shape(lin))]
        if isinstance(group, SharedLinear):
            stats, src.stats = src.stats, ErrorStats()  # planning is not part of the output's statistics
            try:
                with src.on_cpu():
                    out = src.plain_linear(group.src_base)
            finally:
                src.stats = stats
            return [TensorSpec(f"{group.dst_base}.{s}", t.dtype, tuple(t.shape)) for s, t in out.items()]
        layer = src.layer(group.layer)
        if isinstance(group, ExpertLinear):
            sig = self._probe(group.source, layer, group.role)
            return [TensorSpec(f"{group.dst_base}.{s}", d, shp) for s, (d, shp) in sig.items()]
        n = len(group.experts)
        if isinstance(group, Fused):
            sig = self._probe(group.sources[0] if group.sources else 0, layer,
                              "w13" if group.which == "gate_up" else "w2")
            fmt = src.out_fmt
            return [TensorSpec(fused_name(group.dst, fmt, s), d, (n, *fused_shape(fmt, s, shp, group.input_first)))
                    for s, (d, shp) in sig.items()]
        sig = self._probe(group.sources[0] if group.sources else 0, layer, group.which)
        return [TensorSpec(f"{group.dst_base}_{s}", d, (n, *shp)) for s, (d, shp) in sig.items()]


def fused_name(base: str, fmt: WeightFormat, suffix: str) -> str:
    """The name of one tensor of a fused group (``base``: ``P.experts.gate_up_proj``): the dense
    weight is ``base`` itself, a bias ``base_bias``, a quantized tensor ``base_{fused name}``
    in the format's fused layout (mxfp4: ``_blocks``, ``_scales``)."""
    if suffix == "bias":
        return f"{base}_bias"
    if not fmt.quantized:
        return base
    names = getattr(fmt, "fused_names", None)
    if not names:
        raise MoetoolError(f"{base}: fused expert tensors are written unquantized or in a format with a fused "
                           f"layout ({', '.join(fused_formats())}), not {fmt.name}")
    return f"{base}_{names[suffix]}"


def fused_formats() -> list[str]:
    """The formats that have a fused expert layout (``fused_names``)."""
    return [name for name, cls in FORMATS.items() if getattr(cls, "fused_names", None)]


def fused_shape(fmt: WeightFormat, suffix: str, shape: tuple[int, ...], input_first: bool) -> tuple[int, ...]:
    """One expert's slice of a fused tensor, from its tensor of one linear (w13 or w2): a
    bias as it is, the dense weight transposed when ``input_first``, a quantized tensor in the
    format's fused layout (always output rows first)."""
    if suffix == "bias":
        return shape
    if not fmt.quantized:
        return (shape[1], shape[0]) if input_first else shape
    return tuple(fmt.to_fused(suffix, torch.empty(shape, device="meta")).shape)


def _fmt_sig(sig: dict) -> str:
    return "{" + ", ".join(f"{s}: {str(d).replace('torch.', '')}{list(shp)}" for s, (d, shp) in sorted(sig.items())) + "}"


def _storage_sig(ckpt: Checkpoint, layer: MoELayerSpec) -> tuple:
    """Besides the dims, what decides a layer's expert output specs: the tensors stored per
    expert and their dtypes (the same for every layer of a model, so one probe serves all)."""
    st = layer.storage
    if st.kind == "fused":
        biases = (str(ckpt.tensors[st.gate_up_bias].dtype),) if st.gate_up_bias else ()
        if st.fused_suffixes:
            return (*((s, str(ckpt.tensors[f"{st.gate_up}_{s}"].dtype)) for s in st.fused_suffixes), *biases)
        return (str(ckpt.tensors[st.gate_up].dtype), *biases)
    base, sep = (st.per_expert_bases(0)[0], ".") if st.kind == "per-expert" else (st.gate_up, "_")
    return tuple(sorted((s, str(ckpt.tensors[f"{base}{sep}{s}"].dtype)) for s in ckpt.suffixes(base, sep)))


# ---------------------------------------------------------------------------------- executing


#: a tensor copied as it is (``Copy``: attention, norms, embeddings, lm_head) is read and
#: written in pieces of this many bytes, a few in flight, never whole: memory stays flat in the
#: size of the largest tensor (a DeepSeek-V3 lm_head is 1.85 GB) and of the input; read into
#: plain memory even where the experts are read page-locked for a GPU (pinned blocks stay
#: cached for the process, rounded up to a power of two)
COPY_PIECE = 4 << 20

#: hand freed heap memory back to the OS after this many bytes of output tensors: often enough
#: to keep peak RSS flat, rarely enough that small tensors (norms, biases: shard and repack
#: copy thousands) do not pay a heap walk and a page fault storm each (every 16 tasks cost
#: shard --ep 8 half its time)
TRIM_EVERY_BYTES = 64 << 20


@dataclass
class _StackedGroup:
    """The stacked group being written: its main tensor's spec, and the slices of its other
    tensors (scales...), kept until the main tensor is complete."""

    main: TensorSpec | None = None
    rest: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: the copied tensor whose pieces are being written
    piece: TensorSpec | None = None


def converter_cpus(workers: int) -> list[int] | None:
    """The CPUs to pin the converting threads to, one each: where this process may run on
    exactly ``workers`` CPUs (a machine of up to 4 cores, all of them converting), else None.

    Unpinned, the scheduler often queued both converting threads on one core for a while
    (each wakes the other at every GIL handover) while the other core ran the writer alone;
    pinned, quantize --fp8-block of the 1.38 GiB benchmark input on 2 cores converted in
    1.19-1.30 s (median 1.26) against 1.25-1.45 s (median 1.33), 8 interleaved runs each. The
    writer threads stay unpinned and take whichever core is free."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None
    return allowed if len(allowed) == workers else None


def files_at_once(cores: int | None = None) -> int:
    """Output files written at the same time: one per 4 cores, at most 4. One file's sha256 is
    one serial stream (1.1-1.2 GB/s on an H100 host's core), so one file at a time left that
    host's disk (2 GB/s with several direct writes in flight) waiting on the hashing thread;
    on a machine of up to 7 cores the converting threads already take the CPU."""
    return max(1, min(4, (cores or usable_cores()) // 4))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def converting_threads(files: int, device: str, cores: int | None = None) -> int:
    """Converting threads per file written: up to 4 on the CPU, the cores shared between the
    files; 2 where a GPU converts (a linear's read into pinned memory takes longer than its
    transfers and kernels, and each thread holds one linear in flight)."""
    share = max(1, (cores or usable_cores()) // files)
    return min(2 if device == "cuda" else 4, share)


class _Stopped(Exception):
    """Another file failed, or Ctrl-C: this one stops at its next linear, left ``.incomplete``."""


class Executor:
    """Produces a planned file's tensor data in order, converting up to ``workers`` linears
    at once on threads (torch ops release the GIL), a bounded window ahead of the writer."""

    def __init__(self, sources: list[Source], workers: int | None = None):
        self.sources = sources
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.cpus = converter_cpus(self.workers) if self.workers > 1 else None
        #: set when the files being written must stop (another failed, or Ctrl-C)
        self.stop = threading.Event()
        self._fds: dict[tuple[int, str], int] = {}
        self._fds_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Close the input files ``Copy`` pieces were read from; a piece asked for after this
        raises ``_Stopped`` (a late one must neither read a closed fd nor open one that leaks)."""
        with self._fds_lock:
            self._closed = True
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _pin_thread(self, cpus: Iterator[int]) -> None:
        """ThreadPoolExecutor initializer: this converting thread on the next CPU of ``cpus``
        (a hint: a refusal leaves it unpinned)."""
        try:
            os.sched_setaffinity(threading.get_native_id(), {next(cpus)})
        except (OSError, StopIteration):
            pass

    def chunks(self, pf: PlannedFile) -> Iterator[tuple[str, torch.Tensor]]:
        """``pf``'s (tensor name, data) pairs in file order; raises ``_Stopped`` once ``stop`` is set.
        Closed early (``close()``, or an error while it runs), it cancels the tasks not yet
        started and returns once those running have finished."""
        specs = iter(pf.specs)
        tasks = self._tasks(pf)
        since_trim = 0
        pin = {"initializer": self._pin_thread, "initargs": (iter(self.cpus),)} if self.cpus else {}
        with ThreadPoolExecutor(self.workers, thread_name_prefix="moetool-convert", **pin) as pool:
            window: deque = deque()
            group = _StackedGroup()
            try:
                for kind, fn in tasks:
                    if self.stop.is_set():
                        raise _Stopped
                    window.append((kind, pool.submit(fn)))
                    if len(window) > self.workers:
                        for name, t in self._emit(*window.popleft(), specs, group):
                            since_trim += t.numel() * t.element_size()
                            yield name, t
                    if since_trim >= TRIM_EVERY_BYTES:
                        trim_in_background()
                        since_trim = 0
                while window:
                    yield from self._emit(*window.popleft(), specs, group)
            finally:
                # the pool's exit waits for the tasks still running; the queued ones need not run
                for _, future in window:
                    future.cancel()

    def _emit(self, kind: str, future, specs: Iterator[TensorSpec], group: "_StackedGroup") -> Iterator[tuple[str, torch.Tensor]]:
        """kind "plain": every tensor in spec order; "piece" / "first piece": a piece of a copied
        tensor (the first takes its spec); "slice": a stacked group's main weight slice now, its
        other tensors kept until "flush" writes them after the main weight."""
        result = future.result()
        if kind == "plain":
            for t in result:
                yield next(specs).name, t
        elif kind in ("first piece", "piece"):
            if kind == "first piece":
                group.piece = next(specs)
            yield group.piece.name, result
        elif kind == "slice":
            if group.main is None:
                group.main = next(specs)
            items = list(result.items())
            yield group.main.name, items[0][1]
            for s, t in items[1:]:
                group.rest.setdefault(s, []).append(t)
        else:  # flush
            for parts in group.rest.values():
                spec = next(specs)
                for t in parts:
                    yield spec.name, t
            group.main, group.rest = None, {}

    def _tasks(self, pf: PlannedFile):
        for g in pf.groups:
            if isinstance(g, Fused):
                for i, e in enumerate(g.experts):
                    yield "slice", partial(self._fused_slice, g, i, e)
                yield "flush", lambda: None
            elif isinstance(g, Stacked):
                for i, e in enumerate(g.experts):
                    yield "slice", partial(self._stacked_slice, g, i, e)
                yield "flush", lambda: None
            elif isinstance(g, Copy):
                info = self.sources[g.source].ckpt.info(g.src)
                step = max(1, COPY_PIECE // info.dtype.itemsize) * info.dtype.itemsize
                for start in range(0, max(info.nbytes, 1), step):
                    yield ("piece" if start else "first piece",
                           partial(self._copy_piece, g.source, info, start, min(step, info.nbytes - start)))
            else:
                yield "plain", partial(self._produce, g)

    def _copy_piece(self, source: int, info: TensorInfo, start: int, nbytes: int) -> torch.Tensor:
        """Bytes [start, start + nbytes) of a tensor's data, as its dtype (plain memory)."""
        root = self.sources[source].ckpt.root
        with self._fds_lock:
            if self._closed:
                raise _Stopped
            fd = self._fds.get((source, info.file))
            if fd is None:
                fd = self._fds[(source, info.file)] = os.open(root / info.file, os.O_RDONLY | os.O_CLOEXEC)
        if not nbytes:
            return torch.empty(0, dtype=info.dtype)
        # a mapping of its own, handed back to the OS when the piece is dropped: from the heap,
        # pieces freed by the writer's thread left holes that later, smaller tensors split, and
        # resident memory grew with every piece (+60 MB over a 64 MB tensor)
        buf = mmap.mmap(-1, nbytes)
        pread_exactly(fd, memoryview(buf), info.begin + start, root / info.file)
        return torch.frombuffer(buf, dtype=torch.uint8).view(info.dtype)

    def _produce(self, g: Group) -> list[torch.Tensor]:
        src = self.sources[g.source]
        if isinstance(g, Copy):
            return [src.ckpt.get(g.src)]
        if isinstance(g, Dequant):
            return [src.reader.dequantize_any(g.src_base).to(src.dtype)]
        if isinstance(g, SharedLinear):
            return list(src.plain_linear(g.src_base).values())
        lin = src.expert_role(src.layer(g.layer), g.expert, g.role)
        return list(lin.values())

    def _stacked_slice(self, g: Stacked, i: int, e: int) -> Linear:
        src = self.sources[g.sources[i] if g.sources else 0]
        layer = src.layer(g.layer)
        return src.expert_w13(layer, e) if g.which == "w13" else src.expert_role(layer, e, "down")

    def _fused_slice(self, g: Fused, i: int, e: int) -> Linear:
        """Expert e's slice of each tensor of a fused group: the weight [2N, H] / [H, N] (dense:
        transposed when input-first; quantized: in the format's fused layout), its bias; gate
        and up rows interleaved where the group says so."""
        src = self.sources[g.sources[i] if g.sources else 0]
        layer = src.layer(g.layer)
        fmt, n = src.out_fmt, layer.intermediate
        lin = src.expert_role(layer, e, "down") if g.which == "down" else src.expert_w13(layer, e)
        out = {}
        for s, t in lin.items():
            if g.which == "gate_up" and g.interleaved:  # gate rows [0, N) and up rows [N, 2N) alternate
                t = t.reshape(2, n, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
            if s == "bias":
                out[s] = t
            elif not fmt.quantized:
                out[s] = t.t().contiguous() if g.input_first else t.contiguous()
            else:
                out[s] = fmt.to_fused(s, t.contiguous())
        return out


# ---------------------------------------------------------------------------------- running


def run_plan(plan: Plan, sources: list[Source], out: OutputDir, *, bytes_in: int, progress: bool = True,
             stats: ErrorStats | None = None, links: bool = True, files: int | None = None,
             more_manifest=None) -> Summary:
    """Write every file of ``plan`` (skipping ones a previous run finished), ``files`` at a time
    (``files_at_once``), in plan order; then each ``same_as`` file, hard-linked (or with
    ``links=False`` copied) from its twin; then the JSON files, index and manifest last (with
    the entries ``more_manifest()`` returns then)."""
    from tqdm import tqdm

    try:
        t0 = time.perf_counter()
        files = files or files_at_once()
        device = sources[0].device.type if sources else "cpu"
        executor = Executor(sources, converting_threads(files, device))
        bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc="writing", disable=not progress,
                   leave=False)
        lock = threading.Lock()

        def on_bytes(n: int) -> None:
            with lock:
                bar.update(n)

        # the executor converts one linear per core: torch's own intra-op threads on top of
        # that only contend for the cores (and spin while they wait)
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for src in sources:
                src.ready()
            written = _write_files([pf for pf in plan.files if not pf.same_as], executor, out, files, on_bytes)
            for pf in (pf for pf in plan.files if pf.same_as):
                if not out.already_done(pf.name, pf.file_size(), pf.same_as):
                    out.same_file(pf.name, pf.same_as, link=links)
                    written += 1
                on_bytes(pf.nbytes)
        finally:
            bar.close()
            executor.close()
            torch.set_num_threads(torch_threads)
        finish_plan(plan, out, more_manifest)
    finally:
        out.close()  # the folder is released either way; without a manifest it stays unfinished
    return plan.summary(bytes_in=bytes_in, seconds=time.perf_counter() - t0, written=written,
                        errors=stats.summary() if stats else None)


def _write_files(todo: list[PlannedFile], executor: Executor, out: OutputDir, files: int, on_bytes) -> int:
    """Each planned file of ``todo`` that ``out`` does not already have, ``files`` at a time
    (started in order): the count written. After a failure, or Ctrl-C in the calling thread,
    no further file starts and those being written stop at their next linear, left unfinished."""
    stop = executor.stop

    def one(pf: PlannedFile) -> int:
        try:
            if stop.is_set():
                return 0
            if out.already_done(pf.name, pf.file_size()):
                on_bytes(pf.nbytes)
                return 0
            chunks = executor.chunks(pf)
            try:
                out.write_safetensors(pf.name, pf.specs, chunks, metadata=SAFETENSORS_METADATA,
                                      on_bytes=on_bytes)
            finally:
                # now, not when the traceback holding it goes: its piece tasks finish before
                # run_plan closes the files they read
                chunks.close()
            return 1
        except _Stopped:
            return 0
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(files, thread_name_prefix="moetool-file") as pool:
        futures = [pool.submit(one, pf) for pf in todo]
        try:
            return sum(f.result() for f in futures)
        except BaseException:
            stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
