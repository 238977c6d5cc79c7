"""One rank of a verify run: load its own shard, run every selected MoE layer through the
dispatcher and the experts backend, run each local expert alone on the probe batch, and hand
outputs and counters back to the parent. Only rank processes load this module (it loads the
Triton kernels; the parent of a spawned run never does).

Letters: L = local expert slots, P = probe tokens, H = hidden, T_g = tokens per dp group.
"""
from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist

from moetool.errors import MoetoolError
from moetool.model.families import MoELayerSpec
from moetool.model.spec import LocalExperts
from moetool.read.experts import ExpertReader, read_ahead
from moetool.read.manifest import rank_dir, verify_manifest
from moetool.read.order import Progress, file_steps
from moetool.read.shards import EPShards
from moetool.verify.dispatchers import get_dispatcher
from moetool.verify.experts import ExpertsBackend, get_experts
from moetool.verify.launch import send_to_parent
from moetool.verify.layer import run_moe_layer
from moetool.verify.numerics import model_numerics
from moetool.verify.tokens import make_tokens, norm_weight_name, probe_tokens
from moetool.verify.topology import Topology
from moetool.verify.transports import choose_transport

if TYPE_CHECKING:
    from moetool.verify.driver import VerifyOptions


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, VerifyOptions, list[int]]]) -> list[dict]:
    """One rank of a world running several verifications of the same ep in turn:
    jobs [(shards folder, options, layer indices)] -> one ``run_job`` result per job."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    topologies: dict[int, Topology] = {}
    out = []
    for j, (shards_root, opts, layer_ids) in enumerate(jobs):
        if opts.dp not in topologies:
            topologies[opts.dp] = Topology.create(opts.dp, device)
        out.append(run_job(rank, shards_root, opts, layer_ids, topologies[opts.dp], job=j))
    return out


def run_job(rank: int, shards_root: str, opts: VerifyOptions, layer_ids: list[int], topo: Topology,
            job: int = 0) -> dict:
    """Load this rank's shard and run every selected layer. Each layer's outputs {"y": [T_g, H]
    on tp index 0 (else None), "group": dp group, "probe": [L, P, H], "slots": [L] global ids,
    "stats": ...} go to the parent as soon as they exist (``send_to_parent((job, layer,
    outputs))``, the parent comparing them while the rank goes on) or, where no parent takes
    them (torchrun), come back here. Returns {"layers": {layer: outputs, or None where sent},
    "timeline": {"start", "checked": epoch seconds}}: the rank's files passed their check by then."""
    shards = EPShards(Path(shards_root), check=False)
    started = time.time()
    with opened_and_checked(shards, rank, layer_ids) as (ckpt, spec, progress):
        layers = _run_job(rank, shards, ckpt, spec, opts, layer_ids, topo, job, progress)
    return {"layers": layers, "timeline": {"start": started, "checked": time.time()}}


@contextmanager
def opened_and_checked(shards: EPShards, rank: int, layers: list[int] | None = None) -> Iterator[tuple]:
    """(checkpoint, spec, progress) of this rank's shard, its files' sha256 checked on a thread
    while the caller reads and runs them (hashing is slower than the disk: done first, it
    doubled the rank's time). Each file is hashed as the run comes to it: the caller says
    ``progress.reached(step)`` (steps as ``read.order.verify_order``'s for ``layers``: the
    MoE-only run's layers in its order, None for --whole-model's stages); files no step reads
    are hashed first. The check's verdict stands before anything leaves: on leaving, the files
    left are hashed and a mismatch raises; when the caller failed, a damaged file is named
    rather than what it broke. The thread is a daemon: an interrupted rank leaves at once, not
    after the hashing."""
    verdict: list[BaseException | None] = []
    progress = Progress()
    steps: dict[str, float] = {}  # file -> first step, once the shard is open (else every file at once)
    planned = threading.Event()
    check = threading.Thread(target=_check_into, args=(shards, rank, steps, planned, progress, verdict),
                             name="moetool-check", daemon=True)
    check.start()
    try:
        try:
            ckpt, spec = shards.open_rank(rank, check=False)
            steps.update(file_steps(ckpt, layers))
        finally:
            planned.set()
        with ckpt:
            yield ckpt, spec, progress
    except Exception:
        progress.finish()
        check.join()
        if verdict[0] is not None:
            raise verdict[0] from None
        raise
    finally:
        progress.finish()  # whatever the run did not reach is hashed now
    check.join()
    if verdict[0] is not None:
        raise verdict[0]


def _check_into(shards: EPShards, rank: int, steps: dict[str, float], planned: threading.Event, progress: Progress,
                verdict: list) -> None:
    try:
        planned.wait()
        prefix = rank_dir(rank, shards.ep) + "/"
        first = {prefix + f: k for f, k in steps.items()}
        names = sorted(shards.rank_files(rank), key=lambda n: first.get(n, float("-inf")))
        verify_manifest(shards.root, names, before=lambda n: progress.wait_for(first.get(n, float("-inf"))))
        verdict.append(None)
    except BaseException as err:  # noqa: BLE001 - handed to the rank's thread
        verdict.append(err)


def _run_job(rank: int, shards: EPShards, ckpt, spec, opts: VerifyOptions, layer_ids: list[int],
             topo: Topology, job: int, progress: Progress | None = None) -> dict:
    device = topo.device
    reader = ExpertReader(ckpt, spec)
    transport = choose_transport(opts.transport, device) if opts.dispatch == "all2all" else None
    numerics = model_numerics(opts.numerics, reader.fmt, ckpt, spec)
    experts = get_experts(opts.experts, numerics)
    dispatcher = get_dispatcher(opts.dispatch, topo, comm_dtype=numerics.wire_dtype,
                                **({"transport": transport, "timeout_s": opts.timeout_s} if transport else {}))
    results: dict[int, dict] = {}
    rehearse = ranks_rehearse(device)
    for n, i in enumerate(layer_ids):
        if progress is not None:
            progress.reached(n)  # this layer's files may be hashed now
        layer = spec.layer(i)
        placement = shards.placements[i]
        gate, bias, rbias = reader.router_fp32(layer, device)
        shared = reader.shared_fp32(layer, device)
        nw_name = norm_weight_name(layer)
        nw = ckpt.get(nw_name) if nw_name in ckpt else None
        x = make_tokens(i, topo.group_index, opts.tokens, layer.hidden, opts.seed, nw, numerics).to(device)
        probe_x = probe_tokens(i, layer.hidden, opts.seed, nw, numerics)

        def forward(local: LocalExperts, timed: bool = False):
            return run_moe_layer(x, gate, bias, layer.router, local, placement, shared, dispatcher, experts,
                                 opts.chunk_size, align_phases=timed and opts.warmup > 0, router_bias=rbias)

        timeline: dict[str, float] = {}
        spent: dict[str, float] = {}

        def rehearsal(local: LocalExperts) -> None:
            """The layer once on zero weights, before they are read: every kernel is compiled, the
            transport's buffers made and its graphs captured while the disk is busy with the
            parent's reference (and the next reads), not after the weights are in."""
            t = time.perf_counter()
            forward(local)
            _probe_slots(experts, local, probe_x, device, slots=1)
            experts.release()  # the torch backend keeps dequantized copies of the zero weights
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timeline["rehearsed"] = time.time()
            spent["rehearse_s"] = time.perf_counter() - t

        t_load = time.perf_counter()
        local = load_local_experts(reader, layer, placement.slots[rank], device,
                                   before_fill=rehearsal if rehearse and n == 0 else None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        load_s = time.perf_counter() - t_load - spent.get("rehearse_s", 0.0)
        timeline["loaded"] = time.time()
        for _ in range(opts.warmup):
            forward(local)
        timed = []
        for _ in range(opts.repeat):
            y, stats = forward(local, timed=True)
            timed.append({k: v for k, v in stats.items() if k.startswith(("time_", "cuda_"))})
        stats.update({k: statistics.median(t[k] for t in timed) for k in timed[0]}, transport=transport,
                     time_load_s=load_s, time_rehearse_s=spent.get("rehearse_s", 0.0))
        timeline["forward"] = time.time()
        probe = _probe_slots(experts, local, probe_x, device)
        timeline["probed"] = time.time()
        stats["timeline"] = timeline
        outputs = {"y": compact(y) if topo.tp_index == 0 else None, "group": topo.group_index,
                   "probe": compact(probe), "slots": list(local.slot_to_global), "stats": stats}
        del local, y, probe
        experts.release()
        results[i] = None if send_to_parent((job, i, outputs)) else outputs
    return results


#: environment variable: 1 rehearses the first layer on every device, 0 never (default: on GPUs,
#: where the kernels' first calls compile; on the CPU nothing is compiled and it would only cost)
REHEARSE_ENV = "MOETOOL_REHEARSE"


def _rehearses(device: torch.device) -> bool:
    """Whether this rank would run its first layer once on zero weights before reading them
    (the ranks then agree: any rank's no is everyone's)."""
    forced = os.environ.get(REHEARSE_ENV)
    return device.type == "cuda" if forced not in ("0", "1") else forced == "1"


def ranks_rehearse(device: torch.device, possible: bool = True) -> bool:
    """Whether every rank rehearses (``_rehearses`` and ``possible`` on each): collective, as
    the rehearsal runs collectives, one answer for all."""
    vote = torch.tensor([int(_rehearses(device) and possible)], device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    return bool(vote.item())


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU for the parent, in bf16 or fp16 where that holds every value exactly
    (served outputs are rounded to the served dtype already; at full size the rows and probe
    outputs are ~0.5 GB, and the pipe to the parent takes seconds per GB), else as it is."""
    if t.dtype == torch.float32 and t.numel():
        for half in (torch.bfloat16, torch.float16):
            h = t.to(half)
            if torch.equal(h.float(), t):  # NaN never compares equal: such a tensor goes as it is
                return h.cpu()
    return t.cpu()


def load_local_experts(reader: ExpertReader, layer: MoELayerSpec, slot_to_global: list[int],
                       device: torch.device | None = None,
                       before_fill: Callable[[LocalExperts], None] | None = None,
                       fill: bool = True) -> LocalExperts:
    """This rank's experts of ``layer`` in the stacked layout of the shard's format, on ``device``
    (default CPU). On a GPU they go there an expert at a time through page-locked buffers while
    the next expert is read: host memory holds two experts' stored bytes, never the layer.

    ``before_fill(local)``: called once the stacked tensors exist on ``device`` and before
    the experts are read into them, which hold zeros then. Nothing reads the checkpoint
    meanwhile but for expert 0 of a per-expert storage (its tensors give the stack's shapes).
    Without it, on the CPU, a stacked storage's tensors are the checkpoint's own (no copy).
    ``fill=False``: those zeros, the experts never read (what a rehearsal computes on)."""
    ckpt, st = reader.ckpt, layer.storage
    device = device or torch.device("cpu")
    if device.type == "cuda":  # page-locked reads: the copies to the GPU run at full speed
        ckpt.pin_memory = True
    biases = reader.stacked_biases(layer)  # (w13 [L, 2N], w2 [L, H]) or None
    if biases is not None:
        biases = tuple(b.to(device) for b in biases)
    if st.kind == "stacked":
        names = [{s: f"{base}_{s}" for s in reader.fmt.suffixes if f"{base}_{s}" in ckpt} for base in (st.gate_up, st.down)]
        separate = device.type == "cuda" or before_fill is not None or not fill  # else the checkpoint's own
        w13, w2 = ({s: _stacked_empty(ckpt, n, device) if separate else ckpt.get(n) for s, n in part.items()}
                   for part in names)
        first = None
    else:
        first = _w13_down(reader, layer, 0) if layer.n_stored else ({}, {})
        w13, w2 = ({s: _zeros((layer.n_stored, *v.shape), v.dtype, device) for s, v in part.items()} for part in first)
    local = _local_experts(reader, layer, slot_to_global, w13, w2, biases)
    if before_fill is not None:
        before_fill(local)
    if not fill:
        return local
    if st.kind == "stacked":
        if separate:
            for part, tensors in zip(names, (w13, w2)):
                for s, name in part.items():
                    _fill_stacked(ckpt, name, tensors[s])
    elif layer.n_stored:
        rest = read_ahead(lambda i: _w13_down(reader, layer, i + 1), layer.n_stored - 1, depth=FILL_DEPTH)
        for i, (a, b) in enumerate(itertools.chain([first], rest)):
            for name, dst, part in (("w13", w13, a), ("w2", w2, b)):
                want = {s: (tuple(t.shape[1:]), t.dtype) for s, t in dst.items()}
                got = {s: (tuple(v.shape), v.dtype) for s, v in part.items()}
                if got != want:  # each expert alike, as a stack of them would require
                    raise MoetoolError(f"{layer.prefix}: local slot {i} (expert {slot_to_global[i]}) has {name} "
                                       f"tensors {_describe(got)}, slot 0 {_describe(want)}")
                for s, v in part.items():
                    dst[s][i].copy_(v, non_blocking=True)
    return local


def _local_experts(reader: ExpertReader, layer: MoELayerSpec, slot_to_global: list[int], w13: dict, w2: dict,
                   biases: tuple | None) -> LocalExperts:
    """The LocalExperts over stacked tensors, each checked to hold one row per placed slot."""
    b13, b2 = biases if biases is not None else (None, None)
    for name, t in (("w13", {**w13, "bias": b13}), ("w2", {**w2, "bias": b2})):
        for s, v in t.items():
            if v is not None and v.shape[0] != len(slot_to_global):
                raise MoetoolError(f"{layer.prefix}.experts.{name}_{s}: {v.shape[0]} experts stored, "
                                   f"the manifest places {len(slot_to_global)} on this rank")
    return LocalExperts(reader.fmt, w13, w2, list(slot_to_global), layer.intermediate, layer.hidden,
                        bias13=b13, bias2=b2, activation=layer.activation, num_experts=layer.num_experts)


def _w13_down(reader: ExpertReader, layer: MoELayerSpec, i: int) -> tuple[dict, dict]:
    """Stored expert i's (w13 [2N, H] gate rows first, w2 [H, N]) linears, read once."""
    gate, up, down = reader.gate_up_down(layer, i)
    return reader.fmt.cat_rows([gate, up]), down


def _describe(specs: dict) -> str:
    return ", ".join(f"{s} {list(shape)} {str(dtype).replace('torch.', '')}" for s, (shape, dtype) in sorted(specs.items()))


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros: what a rehearsal before the fill computes on (deterministic, never NaN)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def _stacked_empty(ckpt, name: str, device: torch.device) -> torch.Tensor:
    """Zeros of a stacked [L, ...] tensor's shape and dtype on ``device``."""
    info = ckpt.info(name)
    return _zeros(tuple(info.shape), info.dtype, device)


#: slots read at once while the previous one is copied: after a rehearsal the shard is mostly in
#: the page cache (the sha256 threads read it meanwhile), where one reading thread gives ~7 GB/s
FILL_DEPTH = 3


def _fill_stacked(ckpt, name: str, out: torch.Tensor) -> None:
    """A stacked tensor of the shard into ``out``, one slot at a time while the next are read."""
    for i, row in enumerate(read_ahead(lambda i: ckpt.get_rows(name, i), out.shape[0], depth=FILL_DEPTH)):
        out[i].copy_(row, non_blocking=True)


def _probe_slots(experts: ExpertsBackend, local: LocalExperts, x: torch.Tensor, device: torch.device,
                 slots: int | None = None) -> torch.Tensor:
    """Each local slot (the first ``slots`` of them; default all) alone on the probe batch:
    [L, P, H] float32 (weight 1, no routing)."""
    experts.bind(local, device)
    x = x.to(device)
    P = x.shape[0]
    outs = []
    for s in range(len(local.slot_to_global) if slots is None else min(slots, len(local.slot_to_global))):
        ids = torch.full((P, 1), s, dtype=torch.int64, device=device)
        w = torch.ones(P, 1, dtype=torch.float32, device=device)
        counts = torch.zeros(len(local.slot_to_global), dtype=torch.int64, device=device)
        counts[s] = P
        y = experts.apply(x, None, ids, w, counts)
        if not experts.applies_weights_and_reduces:
            y = y.sum(dim=1)
        outs.append(y.float())
    return torch.stack(outs) if outs else torch.zeros(0, P, x.shape[1])
