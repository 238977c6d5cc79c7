"""Library API of ``moetool verify``: run EP shards through the distributed MoE forward and
compare every layer with the unquantized single-process reference.

Per selected MoE layer, every rank loads only its own shard folder (its files' sha256 checked
against the manifest on threads meanwhile), builds its local experts, and runs
route -> quantize + dispatch -> experts -> combine (+ shared experts) on deterministic tokens
(seeded, scaled by the layer's own post-attention norm like real hidden states; different
tokens per dp group). Each rank also runs every one of its local expert slots alone on a
fixed probe batch, so a wrong expert is named even when the layer output hides it.
While the ranks run, the parent computes the reference from the original checkpoint on a
thread (per-expert loop, fp32, each expert read once for every dp group and the probe, the
next read ahead). Each layer is compared as soon as the ranks' outputs and the reference are
both in (``LayerCollector``; neither side runs more than ``COMPARE_WINDOW`` layers ahead, so
the parent's memory does not grow with the layers checked), and reported: relative error,
SQNR, max abs error, tokens per rank, the worst expert, pass/fail against thresholds kept as
data. The report stands only once every rank's files passed their sha256 check.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from moetool.errors import JSON_ERRORS, MoetoolError
from moetool.formats.registry import FORMATS
from moetool.model.families import describe, family_for
from moetool.read.checkpoint import open_checkpoint
from moetool.read.experts import ExpertReader, detect_expert_format
from moetool.read.order import layer_steps, read_verify_inputs_ahead
from moetool.read.manifest import MANIFEST_NAME, QUANTIZED_KEY, made_by_moetool
from moetool.read.shards import EPShards
from moetool.verify import fork_server
from moetool.verify.launch import run_under_torchrun, spawn_world
from moetool.verify.numerics import NUMERICS, Numerics, model_numerics
from moetool.verify.reference import StreamingReference
from moetool.verify.report import LayerReport, VerifyReport
from moetool.verify.tokens import make_tokens, norm_weight_name, probe_tokens

#: pass thresholds per shard format, for a whole layer and for one expert alone on the probe
#: batch: each format's ``verify_tolerances`` (measured values in its module)
THRESHOLDS: dict[str, dict[str, float]] = {name: dict(cls.verify_tolerances) for name, cls in FORMATS.items()}
#: layers each side (the ranks, the parent's reference) may run ahead of the comparisons
COMPARE_WINDOW = 2


@dataclass(frozen=True)
class VerifyOptions:
    dp: int = 1
    ep: int = 2
    dispatch: str = "allgather"  # allgather | all2all
    experts: str = "torch"  # torch | triton
    tokens: int = 256  # per dp group
    layers: tuple[int, ...] | None = None
    backend: str | None = None  # nccl | gloo | None (auto)
    chunk_size: int = 4096
    seed: int = 0
    max_rel_err: float | None = None
    max_expert_rel_err: float | None = None
    timeout_s: float = 900.0
    warmup: int = 0  # extra untimed runs of each layer; > 0 also aligns ranks before each timed phase
    repeat: int = 1  # timed runs of each layer; each phase's time is the median over them
    transport: str = "auto"  # all2all only: collectives | mapped | auto (mapped on the GPUs of one host)
    numerics: str = "served"  # served (the engine's math for the format) | exact (float32, weights' error only)


# ------------------------------------------------------------------------------------ ranks


#: what a rank imports, imported once by the fork server the ranks start from (``spawn_world``'s
#: preload; the verify command starts the server with them before its own imports)
RANK_MODULES = fork_server.MOE_ONLY_MODULES


def _rank_jobs(rank: int, world_size: int, jobs: list[tuple[str, VerifyOptions, list[int]]]) -> list[dict]:
    """Entry of a rank process (spawned, or this process under torchrun): ``rank.run_jobs``."""
    # imported in the rank only: the rank runtime loads Triton, which the parent must never load
    from moetool.verify.rank import run_jobs

    return run_jobs(rank, world_size, jobs)


# ------------------------------------------------------------------------------------ parent


@dataclass
class LayerReference:
    """The reference side of one MoE layer: each dp group's output [T_g, H] and each expert's
    output alone on the probe batch {expert: [P, H]}, float32 on the device that computed them
    (the layer is compared there)."""

    groups: list[torch.Tensor]
    probe: dict[int, torch.Tensor]


def reference_device(ep: int) -> torch.device:
    """Where the parent computes the reference: a GPU no rank uses when there is one, else the
    last GPU (it needs two experts' weights and the tokens), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", min(ep, torch.cuda.device_count() - 1))


def iter_references(ref_ckpt, spec, opts: VerifyOptions, layer_ids: list[int], numerics: Numerics,
                    device: torch.device, stop: threading.Event | None = None) -> Iterator[tuple[int, LayerReference]]:
    """(layer, its reference) for every layer in ``layer_ids`` in order: the checkpoint's experts
    read once, an expert at a time while the next is read (``ExpertReader.iter_fp32``), each run
    on every dp group's tokens and on the probe batch. ``stop``: set by another thread to end
    early."""
    reader = ExpertReader(ref_ckpt, spec)
    for i in layer_ids:
        if stop is not None and stop.is_set():
            return
        layer = spec.layer(i)
        nw_name = norm_weight_name(layer)
        nw = ref_ckpt.get(nw_name) if nw_name in ref_ckpt else None
        gate, bias, rbias = reader.router_fp32(layer, device)
        shared = reader.shared_fp32(layer, device)
        xs = [make_tokens(i, g, opts.tokens, layer.hidden, opts.seed, nw, numerics).to(device) for g in range(opts.dp)]
        probe = probe_tokens(i, layer.hidden, opts.seed, nw, numerics).to(device)
        biases = None
        if layer.storage.biased:
            biases = [tuple(b.float().to(device) for b in reader.biases(layer, e)) for e in range(layer.num_experts)]
        ref = StreamingReference(xs, gate, bias, layer.router, router_bias=rbias, act=layer.activation, probe=probe)
        for e, (g, u, d) in reader.iter_fp32(layer, device, stop=stop):
            ref.add(e, g, u, d, None if biases is None else biases[e])
        if stop is not None and stop.is_set():
            return
        yield i, LayerReference(ref.finish(shared), ref.probe_out)


@dataclass
class LayerOutcome:
    """One layer's comparison, the tensors gone: the layer's rel err, SQNR (dB) and max abs err
    over every dp group, the worst expert alone on the probe batch (expert, rank, rel err:
    every copy of it, replicas too; (-1, -1, 0.0) where no rank holds one), each rank's stats."""

    rel_err: float
    sqnr_db: float
    max_abs_err: float
    worst: tuple[int, int, float]
    stats: list[dict]


def compare_layer(reference: LayerReference, per_rank: list[dict], dp: int) -> LayerOutcome:
    """``reference`` against the ranks' outputs of the layer (rank order: see ``rank.run_job``)."""
    ref = torch.cat(reference.groups)
    ys = [next(r for r in per_rank if r["group"] == g and r["y"] is not None)["y"] for g in range(dp)]
    rel, sqnr, mx = _metrics(torch.cat(ys).to(ref.device), ref)
    worst = None  # (expert, rank, rel err): the first of the largest (every expert is on a rank)
    for rank, r in enumerate(per_rank):
        if not r["slots"]:
            continue
        theirs = torch.stack([reference.probe[e] for e in r["slots"]])
        for e, erel in zip(r["slots"], _rel_errs(r["probe"].to(theirs.device), theirs)):
            if worst is None or not erel <= worst[2] and not (math.isnan(erel) and math.isnan(worst[2])):
                worst = (e, rank, erel)
    return LayerOutcome(rel, sqnr, mx, worst or (-1, -1, 0.0), [r["stats"] for r in per_rank])


def _rel_errs(y: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """Relative error of each y[l] against ref[l] (y, ref [L, ...]), as ``_metrics`` takes it
    for one, in one pass on ``ref``'s device (float64 sums; inf where y[l] is not finite)."""
    y, ref = y.flatten(1).double(), ref.flatten(1).double()
    noise, sig = (y - ref).pow(2).sum(1), ref.pow(2).sum(1)
    rel = torch.where(sig > 0, (noise / sig).sqrt(), torch.where(noise == 0, 0.0, float("inf")))
    return torch.where(torch.isfinite(y).all(1), rel, float("inf")).tolist()


class LayerCollector:
    """Meets each layer's rank outputs (``on_message`` of ``spawn_world``) with its reference
    (the reference thread) as both arrive, compares them on a thread of its own (the watch
    loop of ``spawn_world`` stays free to notice a failing rank) and drops the tensors at once.
    Each side waits before running more than ``window`` layers ahead of the comparisons: the
    parent holds at most that many layers' outputs and references, however many are checked.

    Keys are (job, layer). ``stop``: set when the run failed; a waiting side then returns. A
    failed comparison is kept in ``error`` and sets ``stop`` and ``abort`` (the world's)."""

    def __init__(self, ep: int, dps: list[int], window: int, stop: threading.Event, abort: threading.Event,
                 on_compared: Callable[[tuple[int, int]], None] = lambda key: None):
        self.ep, self.dps, self.window, self.stop, self.abort = ep, dps, window, stop, abort
        #: called with (job, layer) once the layer is compared (its inputs are no longer needed)
        self.on_compared = on_compared
        self.outcomes: dict[tuple[int, int], LayerOutcome] = {}
        self.error: BaseException | None = None
        #: seconds ``add_reference`` waited for the ranks (not the reference's own work)
        self.waited_s = 0.0
        self._refs: dict[tuple[int, int], LayerReference] = {}
        self._outputs: dict[tuple[int, int], dict[int, tuple[dict, Callable[[], None]]]] = {}
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moetool-compare")

    def add_rank_output(self, rank: int, message: tuple, release: Callable[[], None]) -> None:
        job, layer, outputs = message
        with self._cond:
            got = self._outputs.setdefault((job, layer), {})
            if rank in got:  # a second copy would leak the first one's credit: the rank would wait forever
                raise MoetoolError(f"rank {rank} sent layer {layer} of verification {job} twice")
            got[rank] = (outputs, release)
        self._pool.submit(self._compare_if_ready, (job, layer))

    def add_reference(self, job: int, layer: int, reference: LayerReference) -> None:
        """Waits while ``window`` references wait for their ranks' outputs (or until ``stop``)."""
        with self._cond:
            self._refs[(job, layer)] = reference
        self._pool.submit(self._compare_if_ready, (job, layer))
        t0 = time.perf_counter()
        with self._cond:
            while len(self._refs) >= self.window and not self.stop.is_set():
                self._cond.wait(0.5)
        self.waited_s += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the comparisons under way (those not started are dropped after a failure)."""
        self._pool.shutdown(wait=True, cancel_futures=self.stop.is_set())

    def _compare_if_ready(self, key: tuple[int, int]) -> None:
        try:
            with self._cond:
                outputs = self._outputs.get(key, {})
                if key not in self._refs or len(outputs) < self.ep or self.stop.is_set():
                    return
                reference = self._refs.pop(key)
                del self._outputs[key]
            outcome = compare_layer(reference, [outputs[r][0] for r in range(self.ep)], self.dps[key[0]])
        except BaseException as err:  # noqa: BLE001 - the driver raises it
            with self._cond:
                self.error = self.error or err
                self._cond.notify_all()
            self.stop.set()
            self.abort.set()
            return
        with self._cond:
            self.outcomes[key] = outcome
            self._cond.notify_all()
        for _, release in outputs.values():
            release()
        self.on_compared(key)


def _metrics(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    y, ref = y.float(), ref.float()  # a rank sends bf16 where that is exact (rank.compact)
    noise = float((y - ref).pow(2).sum())
    sig = float(ref.pow(2).sum())
    rel = math.sqrt(noise / sig) if sig > 0 else (0.0 if noise == 0 else float("inf"))
    sqnr = 10 * math.log10(sig / noise) if noise > 0 and sig > 0 else float("inf")
    mx = float((y - ref).abs().max()) if y.numel() else 0.0
    if not math.isfinite(float(y.abs().sum())):
        rel, sqnr, mx = float("inf"), float("-inf"), float("inf")
    return rel, sqnr, mx


def resolve_backend(opts: VerifyOptions) -> str:
    if opts.backend is not None:
        if opts.backend not in ("nccl", "gloo"):
            raise MoetoolError(f"--backend {opts.backend!r}: expected nccl or gloo")
        return opts.backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= opts.ep else "gloo"


def check_timeout(timeout_s: float) -> None:
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise MoetoolError(f"--timeout {timeout_s}: must be a positive number of seconds")


def check_options(opts: VerifyOptions, shards: EPShards) -> None:
    check_timeout(opts.timeout_s)
    if opts.ep != shards.ep:
        raise MoetoolError(f"--ep {opts.ep}: the shards in {shards.root} were made for ep {shards.ep}")
    if opts.dp < 1 or opts.ep % opts.dp:
        raise MoetoolError(f"--dp {opts.dp} must be at least 1 and divide --ep {opts.ep}")
    if opts.tokens < 1:
        raise MoetoolError(f"--tokens {opts.tokens} must be positive")
    if opts.warmup < 0 or opts.repeat < 1:
        raise MoetoolError(f"--warmup {opts.warmup} / --repeat {opts.repeat}: need warmup >= 0 and repeat >= 1")
    if opts.dispatch not in ("allgather", "all2all"):
        raise MoetoolError(f"--all2all {opts.dispatch!r}: expected allgather or all2all")
    if opts.experts not in ("torch", "triton"):
        raise MoetoolError(f"--experts {opts.experts!r}: expected torch or triton")
    if opts.transport not in ("auto", "collectives", "mapped"):
        raise MoetoolError(f"--transport {opts.transport!r}: expected auto, collectives or mapped")
    if opts.numerics not in NUMERICS:
        raise MoetoolError(f"--numerics {opts.numerics!r}: expected {' or '.join(NUMERICS)}")
    if opts.transport == "mapped" and opts.dispatch != "all2all":
        raise MoetoolError(f"--transport mapped is a transport of --all2all all2all, not {opts.dispatch}")
    if opts.chunk_size < 1:
        raise MoetoolError(f"--chunk-size must be positive, got {opts.chunk_size}")
    fmt = FORMATS.get(shards.manifest.get("format"))  # an unknown one: check_files_present says so
    if fmt is not None and opts.experts == "triton":  # as the ranks' experts would refuse it, before they start
        if fmt.kernel_scheme is None:
            raise MoetoolError(f"--experts triton: no fused kernel reads {fmt.name}; use --experts torch")
        if opts.numerics == "exact" and fmt.activation_quant is not None:
            raise MoetoolError(f"--numerics exact with --experts triton: the {fmt.name} kernels compute W8A8 "
                               "(fp8 activations); use --experts torch for float32 activations")


def check_files_present(shards: EPShards) -> None:
    """Cheap pre-flight before any process starts: the shards' format is one moetool reads,
    every rank holds the same non-expert tensors and config (``EPShards.check_ranks_agree``),
    and every file in the manifest exists with its size (each rank then checks the sha256 of
    its own files); the format the manifest names is the one rank 0's experts are stored in
    (the thresholds and the served numerics are that format's)."""
    fmt = shards.manifest["format"]
    if fmt not in FORMATS:
        raise MoetoolError(f"{shards.root}/manifest.json: format {fmt!r} is not one moetool reads "
                           f"(known: {', '.join(FORMATS)})")
    shards.check_ranks_agree()
    for name, rec in shards.manifest["files"].items():
        p = shards.root / name
        if not p.is_file():
            raise MoetoolError(f"{p}: missing (listed in {shards.root}/manifest.json)")
        if p.stat().st_size != rec["size"]:
            raise MoetoolError(f"{p}: {p.stat().st_size} bytes, the manifest says {rec['size']} (truncated or modified)")
    rank0, rank0_spec = shards.open_rank(0, check=False)
    with rank0:
        found = detect_expert_format(rank0, rank0_spec).name
    if found != fmt:
        raise MoetoolError(f"{shards.root}/manifest.json: says format {fmt}, but rank 0's experts are stored as {found} "
                           "(its thresholds would be applied to them)")


def _check_router_tensors(shards: EPShards, rank0, theirs, ref_ckpt, mine, ref) -> None:
    """The layer's router weight and biases in rank 0 (every rank's, check_ranks_agree) equal
    the reference's rounded to their dtype: a router rounded to fp8 moves a layer's output by
    less than int4's threshold (0.17 against 0.25), which the layer check alone let pass."""
    for what in ("router_weight", "correction_bias", "router_bias"):
        name, ref_name = getattr(theirs, what), getattr(mine, what)
        if name is None:
            continue
        got, want = rank0.get(name), ref_ckpt.get(ref_name)
        if got.shape != want.shape or not torch.equal(want.to(got.dtype), got):
            _not_the_reference(shards, theirs.index, name, got, want, ref, ROUTER_NOT_CONVERTED)


def check_shared_experts(shards: EPShards, ref_ckpt, spec, ref, layer_ids: list[int]) -> None:
    """Each checked layer's shared expert in rank 0 (every rank's, check_ranks_agree) is the
    reference's where the shards keep it as it was: stored as the reference stores it, the same
    tensors; left unquantized, the reference's values in its dtype. A shared expert quantized
    by the conversion (``--include-shared-experts``) is measured by the layer's check alone. The
    MoE-only check has no shared-expert check of its own: a shared expert rounded to fp8 and
    stored back in bf16 moved a layer by ~0.01 (0.060 against fp8-block's 0.08) and passed."""
    rank0, rank0_spec = shards.open_rank(0, check=False)
    with rank0:
        theirs_reader, mine_reader = ExpertReader(rank0, rank0_spec), ExpertReader(ref_ckpt, spec)
        for i in layer_ids:
            theirs, mine = rank0_spec.layer(i), spec.layer(i)
            if (theirs.shared_bases is None) != (mine.shared_bases is None):
                has = "has" if theirs.shared_bases is not None else "has no"
                raise MoetoolError(f"{shards.root}: layer {i} {has} shared expert, unlike the reference --ref {ref}")
            if theirs.shared_bases is None:
                continue
            for t_base, m_base in zip(theirs.shared_bases, mine.shared_bases):
                t_fmt, t_lin = theirs_reader.plain_linear(t_base)
                m_fmt, m_lin = mine_reader.plain_linear(m_base)
                if t_fmt == m_fmt:  # stored as the reference stores it
                    same = t_lin.keys() == m_lin.keys() and all(
                        t_lin[k].shape == m_lin[k].shape and torch.equal(t_lin[k], m_lin[k]) for k in t_lin)
                elif not t_fmt.quantized:  # left unquantized: the reference's values in the shards' dtype
                    got = t_lin["weight"]
                    want = m_fmt.dequantize(m_lin).to(got.dtype)
                    same = got.shape == want.shape and torch.equal(got, want)
                else:  # quantized by the conversion
                    continue
                if not same:
                    _not_the_reference(shards, i, f"shared expert {t_base}", t_fmt.dequantize(t_lin),
                                       m_fmt.dequantize(m_lin), ref, SHARED_NOT_CONVERTED)
            if theirs.shared_gate_weight is not None:
                got, want = rank0.get(theirs.shared_gate_weight), ref_ckpt.get(mine.shared_gate_weight)
                if got.shape != want.shape or not torch.equal(want.to(got.dtype), got):
                    _not_the_reference(shards, i, theirs.shared_gate_weight, got, want, ref, SHARED_NOT_CONVERTED)


def check_expert_biases(shards: EPShards, ref_ckpt, spec, ref, layer_ids: list[int]) -> dict[int, str]:
    """Expert biases (gpt-oss) are never converted: every rank's, slot by slot, must be the
    reference's biases of the expert the manifest places there, in the rank's dtype. Returns,
    per layer, the first that is not (a reason the layer's report fails with). Against the
    format's lossy limit alone, two experts' down biases swapped, the gate and up biases
    swapped, or one expert's negated passed the MoE-only check (and the swap --whole-model)."""
    mine_reader = ExpertReader(ref_ckpt, spec)
    faults: dict[int, str] = {}
    layer_ids = [i for i in layer_ids if spec.layer(i).storage.biased]
    for r in range(shards.ep if layer_ids else 0):
        ckpt, rank_spec = shards.open_rank(r, check=False)
        with ckpt:
            reader = ExpertReader(ckpt, rank_spec)
            for i in layer_ids:
                if not rank_spec.layer(i).storage.biased:
                    raise MoetoolError(f"{shards.root}: layer {i}'s experts have no biases on rank {r}; the "
                                       f"reference --ref {ref} has them")
                for slot, e in enumerate(shards.placements[i].slots[r]):
                    got, want = reader.biases(rank_spec.layer(i), slot), mine_reader.biases(spec.layer(i), e)
                    for role, g, w in zip(("gate", "up", "down"), got, want):
                        if i not in faults and (g.shape != w.shape or not torch.equal(w.to(g.dtype), g)):
                            diff = "shape " + str(list(g.shape)) if g.shape != w.shape else \
                                f"max abs difference {(g.float() - w.float()).abs().max().item():.3g}"
                            faults[i] = (f"expert {e}'s {role} bias on rank {r} (slot {slot}) is not the reference's "
                                         f"({diff}): {BIAS_NOT_CONVERTED}")
    return faults


#: why a tensor of the shards must be the reference's (the end of each refusal or reason)
ROUTER_NOT_CONVERTED = "the router is never converted"
SHARED_NOT_CONVERTED = "a shared expert is converted only with --include-shared-experts"
BIAS_NOT_CONVERTED = "expert biases are never converted"


def _not_the_reference(shards: EPShards, layer: int, what: str, got: torch.Tensor, want: torch.Tensor, ref,
                       why: str) -> None:
    diff = "shape " + str(list(got.shape)) if got.shape != want.shape else \
        f"max abs difference {(got.float() - want.float()).abs().max().item():.3g}"
    raise MoetoolError(f"{shards.root}: layer {layer}'s {what} is not the reference's ({diff}; --ref {ref}): {why}")


def _layer_list(indices: list[int]) -> str:
    """[1, 2, 3] -> '1-3'; [0, 2] -> '0, 2'."""
    if indices and indices == list(range(indices[0], indices[-1] + 1)) and len(indices) > 1:
        return f"{indices[0]}-{indices[-1]}"
    return ", ".join(map(str, indices))


def _model_text(arch: str, layers: list[tuple[int, int, int, int]]) -> str:
    """'deepseek-v3, 8 experts in MoE layers 1-2 (hidden 256, expert intermediate 192)' from
    [(layer, experts, hidden, intermediate)]."""
    experts = sorted({e for _, e, _, _ in layers})
    dims = sorted({(h, n) for _, _, h, n in layers})
    return (f"{arch}, {'/'.join(map(str, experts))} experts in MoE layers {_layer_list([i for i, *_ in layers])} "
            f"(hidden {'/'.join(str(h) for h, _ in dims)}, expert intermediate {'/'.join(str(n) for _, n in dims)})")


def check_reference(shards: EPShards, ref_ckpt, spec, ref, *, routers: bool = False) -> None:
    """The reference is the model the shards were made from: the same architecture, MoE
    layers, expert counts and dims as the shards' manifest, routed alike (each layer's router
    config), and not a quantized output of moetool (that would compare the shards with
    quantized weights, not with the model, and hide every quantization error). ``routers``
    (the MoE-only check, which has no router check of its own): each layer's router weight and
    biases in the shards are the reference's, to the shards' dtype."""
    try:
        shard_config = json.loads((shards.root / shards.manifest["ranks"][0] / "config.json").read_text())
        shard_arch = family_for(shard_config).name
    except (OSError, KeyError, IndexError, TypeError, MoetoolError, *JSON_ERRORS):
        shard_arch = "unknown architecture"
    theirs = sorted((int(l["layer"]), int(l["num_experts"]), int(l["hidden"]), int(l["intermediate"]))
                    for l in shards.manifest["layers"])
    ours = [(m.index, m.num_experts, m.hidden, m.intermediate) for m in _checkable_layers(shards, spec)]
    if shard_arch != spec.family.name or theirs != ours:
        raise MoetoolError(f"--ref {ref}: is {_model_text(spec.family.name, ours)}, but the shards in {shards.root} "
                           f"hold {_model_text(shard_arch, theirs)}; --ref must be the model they were made from")
    rank0, rank0_spec = shards.open_rank(0, check=False)
    with rank0:
        for theirs_layer in rank0_spec.moe_layers:  # the ranks route with the shards' config, the reference with its own
            mine_layer = spec.layer(theirs_layer.index)
            mine, shards_router = mine_layer.router, theirs_layer.router
            if shards_router != mine:
                field = next(f.name for f in dataclasses.fields(mine)
                             if getattr(mine, f.name) != getattr(shards_router, f.name))
                raise MoetoolError(f"{shards.root}: layer {theirs_layer.index} routes with {field} "
                                   f"{getattr(shards_router, field)!r}, the reference --ref {ref} with "
                                   f"{getattr(mine, field)!r}; the router is never converted")
            if routers:
                _check_router_tensors(shards, rank0, theirs_layer, ref_ckpt, mine_layer, ref)
    fmt = detect_expert_format(ref_ckpt, spec)
    # a quantized checkpoint moetool did not write is an original release (DeepSeek-V3 and
    # Kimi-K2 ship fp8-block): its dequantized weights are the model, a valid reference. One it
    # quantized says so in its config (its manifest may be gone: copied without it, uploaded),
    # dequantized again too: its values carry the quantization's error
    quantized_by = ref_ckpt.config.get(QUANTIZED_KEY)
    if quantized_by is None and fmt.quantized and made_by_moetool(Path(ref_ckpt.root) / MANIFEST_NAME):
        quantized_by = fmt.name
    if quantized_by is not None:
        what = f"a {quantized_by} output" if quantized_by == fmt.name else \
            f"a {fmt.name} copy of a {quantized_by} output"
        raise MoetoolError(f"--ref {ref}: is {what} of moetool, not the model it was made from; "
                           "give the original checkpoint")


def _checkable_layers(shards: EPShards, spec) -> list:
    """The reference's MoE layers that the shards must hold: each decoder layer's, and the
    multi-token-prediction layers the shards placed (a shard made before they were MoE
    layers copied their experts whole into every rank, unchecked then as now)."""
    return [m for m in spec.moe_layers if m.index < spec.num_layers or m.index in shards.placements]


def _layers_to_check(shards: EPShards, spec, opts: VerifyOptions) -> list[int]:
    # each layer once: its outputs and reference meet under its index
    layer_ids = (list(dict.fromkeys(opts.layers)) if opts.layers
                 else [m.index for m in _checkable_layers(shards, spec)])
    for i in layer_ids:
        layer = spec.layer(i)
        if i not in shards.placements:
            raise MoetoolError(f"layer {i}: not in the shards' manifest ({shards.root})")
        m = next(l for l in shards.manifest["layers"] if int(l["layer"]) == i)
        if (m["num_experts"], m["hidden"], m["intermediate"]) != (layer.num_experts, layer.hidden, layer.intermediate):
            raise MoetoolError(f"layer {i}: shards have {m['num_experts']} experts of [{m['intermediate']}, {m['hidden']}], "
                               f"the reference {layer.num_experts} of [{layer.intermediate}, {layer.hidden}]")
    return layer_ids


def verify(shards_dir, ref, opts: VerifyOptions, *, revision: str | None = None) -> VerifyReport:
    """Run the check and return the report (raise nothing for failing layers: see ``.passed``)."""
    return verify_many([(shards_dir, ref, opts)], revision=revision)[0]


def verify_many(jobs: list[tuple], *, revision: str | None = None) -> list[VerifyReport]:
    """Several verifications of the same ``ep`` in one set of rank processes (start-up paid once).

    ``jobs``: [(shards_dir, ref, VerifyOptions)]; all options must share ep and backend."""
    if not jobs:
        return []
    prepared = []
    for shards_dir, ref, opts in jobs:
        shards = EPShards(Path(shards_dir), check=False)
        check_options(opts, shards)
        check_files_present(shards)
        numerics = shards_numerics(shards, opts)  # describes rank 0's config here, not first in a rank
        prepared.append((shards, ref, opts, resolve_backend(opts), numerics))
    eps = {p[2].ep for p in prepared}
    backends = {p[3] for p in prepared}
    if len(eps) != 1 or len(backends) != 1:
        raise MoetoolError(f"verify_many: jobs need one ep and backend, got {sorted(eps)} / {sorted(backends)}")
    refs, specs, rank_jobs, bias_faults = [], [], [], []
    reading_done = threading.Event()
    try:
        for shards, ref, opts, *_ in prepared:
            ref_ckpt = open_checkpoint(ref, revision)
            refs.append(ref_ckpt)
            specs.append(describe(ref_ckpt.config, ref_ckpt.tensors))
            check_reference(shards, ref_ckpt, specs[-1], ref, routers=True)
            rank_jobs.append((str(shards.root), opts, _layers_to_check(shards, specs[-1], opts)))
            check_shared_experts(shards, ref_ckpt, specs[-1], ref, rank_jobs[-1][2])
            bias_faults.append(check_expert_biases(shards, ref_ckpt, specs[-1], ref, rank_jobs[-1][2]))
        # the disk reads what the run takes, in its order, while the ranks start (seconds a cold
        # disk would otherwise idle); not before this process's imports, which it would starve;
        # paced by the comparisons (a layer compared is a layer read)
        ep, backend = eps.pop(), backends.pop()
        ahead = read_verify_inputs_ahead([(p[0].root, r.root, job[2]) for p, r, job in zip(prepared, refs, rank_jobs)],
                                         stop=reading_done, gpu=backend == "nccl")
        timeout = sum(p[2].timeout_s for p in prepared)
        device = reference_device(ep)
        stop, abort = threading.Event(), threading.Event()
        timings = [{} for _ in prepared]
        place = [layer_steps(job[2]) for job in rank_jobs]  # the read-ahead's steps

        def compared(key: tuple[int, int]) -> None:
            if ahead is not None:
                ahead.reached((key[0], place[key[0]][key[1]] + 1))

        collector = LayerCollector(ep, [p[2].dp for p in prepared], COMPARE_WINDOW, stop, abort, on_compared=compared)

        def references() -> None:
            for j, (p, ref_ckpt, spec, job, t) in enumerate(zip(prepared, refs, specs, rank_jobs, timings)):
                t_ref, waited = time.perf_counter(), collector.waited_s
                for i, reference in iter_references(ref_ckpt, spec, p[2], job[2], p[4], device, stop):
                    collector.add_reference(j, i, reference)
                # the reference's own seconds, not those it waited for the ranks
                t["reference_s"] = time.perf_counter() - t_ref - (collector.waited_s - waited)

        # the parent reads and runs the reference while the ranks start, read their shards
        # and run: the two sides' reads overlap (one pass over each checkpoint, at the disk's
        # rate), and each layer is compared as soon as both sides have it
        t0, t0_epoch = time.perf_counter(), time.time()
        with ThreadPoolExecutor(1, thread_name_prefix="moetool-reference") as pool:
            pending = pool.submit(references)
            pending.add_done_callback(lambda f: f.exception() is not None and abort.set())
            try:
                results = spawn_world(_rank_jobs, ep, backend, args=(rank_jobs,), timeout_s=timeout,
                                      on_message=collector.add_rank_output, window=COMPARE_WINDOW, abort=abort,
                                      preload=RANK_MODULES)
                ranks_s = time.perf_counter() - t0
                pending.result()
                collector.close()
            except BaseException:
                stop.set()
                collector.close()
                # the cause first: a failed comparison, then a failed reference, then the world's error
                if collector.error is not None:
                    raise collector.error from None
                if pending.done() and pending.exception() is not None:
                    raise pending.exception() from None
                raise
        if collector.error is not None:
            raise collector.error
        reports = []
        for j, ((shards, _, opts, _, numerics), ref_ckpt, spec) in enumerate(zip(prepared, refs, specs)):
            per_rank = [r[j] for r in results]
            outcomes = {i: collector.outcomes[(j, i)] for i in rank_jobs[j][2]}
            timings[j].update(ranks_s=ranks_s, wall_s=time.perf_counter() - t0,
                              **_rank_timeline(per_rank, outcomes, t0_epoch))
            started = process_started()
            if started is not None:
                timings[j]["startup_s"] = t0_epoch - started  # this process's start to the ranks' spawn
            reports.append(build_report(shards, ref_ckpt, spec, opts, backend, rank_jobs[j][2], outcomes, numerics,
                                        timings[j], exact_faults=bias_faults[j]))
        return reports
    finally:
        reading_done.set()
        for r in refs:
            r.close()


def _rank_timeline(per_rank: list[dict], outcomes: dict[int, LayerOutcome], t0_epoch: float) -> dict:
    """{"rank_<step>_s": seconds from the spawn until the last rank ended that step}: each rank's
    start and check (``run_job``'s timeline) and its layers' steps (rehearsed, loaded, forward,
    probed), each from the last layer that has it (the rehearsal is the first layer's)."""
    out: dict = {}
    for r, result in enumerate(per_rank):
        steps = dict(result["timeline"])
        for i in sorted(outcomes):
            steps.update(outcomes[i].stats[r].get("timeline", {}))
        for step, at in steps.items():
            out[f"rank_{step}_s"] = max(out.get(f"rank_{step}_s", 0.0), at - t0_epoch)
    return out


def process_started() -> float | None:
    """This process's start, epoch seconds (Linux /proc), or None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(l.split()[1]) for l in Path("/proc/stat").read_text().splitlines() if l.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def shards_numerics(shards: EPShards, opts: VerifyOptions) -> Numerics:
    """The numerics of the run, from the shards (rank 0's config and router dtype), as the ranks
    take them: both sides round the tokens alike."""
    rank0, rank0_spec = shards.open_rank(0, check=False)
    with rank0:
        return model_numerics(opts.numerics, FORMATS[shards.manifest["format"]], rank0, rank0_spec)


def build_report(shards: EPShards, ref_ckpt, spec, opts: VerifyOptions, backend: str, layer_ids: list[int],
                 outcomes: dict[int, LayerOutcome], numerics: Numerics, timings: dict | None = None,
                 exact_faults: dict[int, str] | None = None) -> VerifyReport:
    """``exact_faults``: per layer, a tensor never converted that is not the reference's."""
    fmt = shards.manifest["format"]
    th = dict(THRESHOLDS.get(fmt, THRESHOLDS["dense"]))
    if opts.max_rel_err is not None:
        th["rel_err"] = opts.max_rel_err
    if opts.max_expert_rel_err is not None:
        th["expert_rel_err"] = opts.max_expert_rel_err
    reports = []
    for i in layer_ids:
        layer = spec.layer(i)
        out = outcomes[i]
        rel, sqnr, mx, worst, stats = out.rel_err, out.sqnr_db, out.max_abs_err, out.worst, out.stats
        reasons = []
        served = stats[0].get("activation")
        if served is not None and served != layer.activation.describe():
            reasons.append(f"the shards' config.json runs the experts with {served}, --ref with "
                           f"{layer.activation.describe()}")
        if not rel <= th["rel_err"]:
            reasons.append(f"layer rel err {rel:.3g} > {th['rel_err']:g}")
        if not worst[2] <= th["expert_rel_err"]:
            reasons.append(f"expert {worst[0]} on rank {worst[1]} rel err {worst[2]:.3g} > {th['expert_rel_err']:g}")
        if exact_faults and i in exact_faults:
            reasons.append(exact_faults[i])
        timing = {"total": max(s["time_total_s"] for s in stats) * 1e3}
        for phase in ("route", "dispatch", "experts", "combine", "shared"):
            key = f"cuda_{phase}_s" if f"cuda_{phase}_s" in stats[0] else f"time_{phase}_s"
            timing[phase] = max(s[key] for s in stats) * 1e3
        timing["load"] = max(s.get("time_load_s", 0.0) for s in stats) * 1e3  # the layer's experts onto the device
        rehearse = max(s.get("time_rehearse_s", 0.0) for s in stats)  # the first layer on zeros, where run
        if rehearse:
            timing["rehearse"] = rehearse * 1e3
        moved = {k: sum(s[k] for s in stats) for k in ("dispatch_bytes_sent", "combine_bytes_sent")}
        if stats[0].get("dispatch_split_bytes"):  # [R][R]: row r = bytes rank r sent to each rank
            moved.update({k: [s[k] for s in stats] for k in ("dispatch_split_bytes", "combine_split_bytes")})
        reports.append(LayerReport(i, rel, sqnr, mx, [s["pairs_computed"] for s in stats], worst[0], worst[1],
                                   worst[2], not reasons, "; ".join(reasons), timing, moved))
    options = {**asdict(opts), "backend": backend, "layers": layer_ids,
               "numerics_detail": numerics.describe(),  # "numerics" stays the option: served | exact
               "transport": outcomes[layer_ids[0]].stats[0].get("transport") if layer_ids else None}
    return VerifyReport(str(shards.root), str(ref_ckpt.root), shards.manifest["format"], options, th, reports,
                        dict(timings or {}))


def _torchrun_rank(rank: int, world_size: int, jobs) -> list | None:
    res = _rank_jobs(rank, world_size, jobs)
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(res, gathered, dst=0)
    return gathered


def verify_torchrun(shards_dir, ref, opts: VerifyOptions, *, revision: str | None = None) -> VerifyReport | None:
    """``moetool verify`` inside a torchrun launch (one process per rank, any number of nodes).

    Every rank loads its own shard; rank 0 gathers the outputs, computes the reference and
    returns the report; the other ranks return None."""
    shards = EPShards(Path(shards_dir), check=False)
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != opts.ep:
        raise MoetoolError(f"--ep {opts.ep}: torchrun started {world} processes; they must match")
    check_options(opts, shards)
    check_files_present(shards)
    layer_ids = list(dict.fromkeys(opts.layers)) if opts.layers else [int(l["layer"]) for l in shards.manifest["layers"]]
    backend = opts.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    gathered = run_under_torchrun(_torchrun_rank, ([(str(shards.root), opts, layer_ids)],), backend=backend,
                                  collective_timeout_s=opts.timeout_s)
    if gathered is None:
        return None
    with open_checkpoint(ref, revision) as ref_ckpt:
        spec = describe(ref_ckpt.config, ref_ckpt.tensors)
        check_reference(shards, ref_ckpt, spec, ref, routers=True)
        _layers_to_check(shards, spec, VerifyOptions(**{**asdict(opts), "layers": tuple(layer_ids)}))
        check_shared_experts(shards, ref_ckpt, spec, ref, layer_ids)
        bias_faults = check_expert_biases(shards, ref_ckpt, spec, ref, layer_ids)
        numerics = shards_numerics(shards, opts)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        t0 = time.perf_counter()
        outcomes = {i: compare_layer(reference, [g[0]["layers"][i] for g in gathered], opts.dp)  # one layer held
                    for i, reference in iter_references(ref_ckpt, spec, opts, layer_ids, numerics, device)}
        timings = {"reference_s": time.perf_counter() - t0}
        return build_report(shards, ref_ckpt, spec, opts, backend, layer_ids, outcomes, numerics, timings,
                            exact_faults=bias_faults)


