"""One rank of a verify run: load its own shard, run every selected MoE layer through the
dispatcher and the experts backend, run each local expert alone on the probe batch, and hand
outputs and counters back to the parent. Only rank processes load this module (it loads the
Triton kernels; the parent of a spawned run never does).

Letters: L = local expert slots, P = probe tokens, H = hidden, T_g = tokens per dp group.
"""
from __future__ import annotations

import statistics
import time
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from moetool.errors import MoetoolError
from moetool.model.families import MoELayerSpec
from moetool.model.spec import LocalExperts
from moetool.read.experts import ExpertReader, read_ahead
from moetool.read.manifest import verify_manifest
from moetool.read.shards import EPShards
from moetool.verify.dispatchers import get_dispatcher
from moetool.verify.experts import ExpertsBackend, get_experts
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
    for shards_root, opts, layer_ids in jobs:
        if opts.dp not in topologies:
            topologies[opts.dp] = Topology.create(opts.dp, device)
        out.append(run_job(rank, shards_root, opts, layer_ids, topologies[opts.dp]))
    return out


def run_job(rank: int, shards_root: str, opts: VerifyOptions, layer_ids: list[int], topo: Topology) -> dict:
    """Load this rank's shard and run every selected layer: {layer: {"y": [T_g, H] on tp index 0
    (else None), "group": dp group, "probe": [L, P, H], "slots": [L] global ids, "stats": ...}}."""
    shards = EPShards(Path(shards_root), check=False)
    started = time.time()
    with opened_and_checked(shards, rank) as (ckpt, spec):
        results = _run_job(rank, shards, ckpt, spec, opts, layer_ids, topo)
    checked = time.time()
    for r in results.values():  # when each step ended, epoch seconds (the parent makes them offsets)
        r["stats"]["timeline"] = {"start": started, **r["stats"]["timeline"], "checked": checked}
    return results


@contextmanager
def opened_and_checked(shards: EPShards, rank: int) -> Iterator[tuple]:
    """(checkpoint, spec) of this rank's shard, its files' sha256 checked on a thread while the
    caller reads and runs them (hashing is slower than the disk: done first, it doubled the
    rank's time). The check's verdict stands before anything leaves: on leaving, a mismatch
    raises; when the caller failed, a damaged file is named rather than what it broke. The
    thread is a daemon: an interrupted rank leaves at once, not after the hashing."""
    verdict: list[BaseException | None] = []
    check = threading.Thread(target=_check_into, args=(shards, rank, verdict), name="moetool-check", daemon=True)
    check.start()
    try:
        ckpt, spec = shards.open_rank(rank, check=False)
        with ckpt:
            yield ckpt, spec
    except Exception:
        check.join()
        if verdict[0] is not None:
            raise verdict[0] from None
        raise
    check.join()
    if verdict[0] is not None:
        raise verdict[0]


def _check_into(shards: EPShards, rank: int, verdict: list) -> None:
    try:
        verify_manifest(shards.root, shards.rank_files(rank))
        verdict.append(None)
    except BaseException as err:  # noqa: BLE001 - handed to the rank's thread
        verdict.append(err)


def _run_job(rank: int, shards: EPShards, ckpt, spec, opts: VerifyOptions, layer_ids: list[int],
             topo: Topology) -> dict:
    device = topo.device
    reader = ExpertReader(ckpt, spec)
    transport = choose_transport(opts.transport, device) if opts.dispatch == "all2all" else None
    numerics = model_numerics(opts.numerics, reader.fmt, ckpt, spec)
    experts = get_experts(opts.experts, numerics)
    dispatcher = get_dispatcher(opts.dispatch, topo, comm_dtype=numerics.wire_dtype,
                                **({"transport": transport, "timeout_s": opts.timeout_s} if transport else {}))
    results: dict[int, dict] = {}
    for i in layer_ids:
        layer = spec.layer(i)
        placement = shards.placements[i]
        t_load = time.perf_counter()
        local = load_local_experts(reader, layer, placement.slots[rank], device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        load_s = time.perf_counter() - t_load
        timeline = {"loaded": time.time()}
        gate = ckpt.get(layer.router_weight).float()
        bias = ckpt.get(layer.correction_bias).float() if layer.correction_bias else None
        rbias = ckpt.get(layer.router_bias).float().to(device) if layer.router_bias else None
        shared = reader.shared_fp32(layer)
        nw_name = norm_weight_name(layer)
        nw = ckpt.get(nw_name) if nw_name in ckpt else None
        x = make_tokens(i, topo.group_index, opts.tokens, layer.hidden, opts.seed, nw, numerics).to(device)
        # everything on the rank's device before the timed runs (no host copies inside)
        gate = gate.to(device)
        bias = None if bias is None else bias.to(device)
        shared = None if shared is None else tuple(None if w is None else w.float().to(device) for w in shared)
        for _ in range(opts.warmup):
            run_moe_layer(x, gate, bias, layer.router, local, placement, shared, dispatcher, experts,
                          opts.chunk_size, router_bias=rbias)
        timed = []
        for _ in range(opts.repeat):
            y, stats = run_moe_layer(x, gate, bias, layer.router, local, placement, shared, dispatcher,
                                     experts, opts.chunk_size, align_phases=opts.warmup > 0, router_bias=rbias)
            timed.append({k: v for k, v in stats.items() if k.startswith(("time_", "cuda_"))})
        stats.update({k: statistics.median(t[k] for t in timed) for k in timed[0]}, transport=transport,
                     time_load_s=load_s)
        timeline["forward"] = time.time()
        probe = _probe_slots(experts, local, probe_tokens(i, layer.hidden, opts.seed, nw, numerics), device)
        timeline["probed"] = time.time()
        stats["timeline"] = timeline
        results[i] = {"y": compact(y) if topo.tp_index == 0 else None, "group": topo.group_index,
                      "probe": compact(probe), "slots": list(local.slot_to_global), "stats": stats}
        experts.release()
    return results


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
                       device: torch.device | None = None) -> LocalExperts:
    """This rank's experts of ``layer`` in the stacked layout of the shard's format, on ``device``
    (default CPU). On a GPU they go there an expert at a time through page-locked buffers while
    the next expert is read: host memory holds two experts' stored bytes, never the layer."""
    ckpt, st = reader.ckpt, layer.storage
    device = device or torch.device("cpu")
    if device.type == "cuda":  # page-locked reads: the copies to the GPU run at full speed
        ckpt.pin_memory = True
    if st.kind == "stacked":
        w13 = {s: _stacked_on(ckpt, f"{st.gate_up}_{s}", device) for s in reader.fmt.suffixes
               if f"{st.gate_up}_{s}" in ckpt}
        w2 = {s: _stacked_on(ckpt, f"{st.down}_{s}", device) for s in reader.fmt.suffixes if f"{st.down}_{s}" in ckpt}
    else:
        w13, w2 = {}, {}
        for i, (a, b) in enumerate(read_ahead(lambda i: _w13_down(reader, layer, i), layer.n_stored)):
            for name, dst, part in (("w13", w13, a), ("w2", w2, b)):
                if i == 0:
                    dst.update({s: torch.empty((layer.n_stored, *v.shape), dtype=v.dtype, device=device)
                                for s, v in part.items()})
                want = {s: (tuple(t.shape[1:]), t.dtype) for s, t in dst.items()}
                got = {s: (tuple(v.shape), v.dtype) for s, v in part.items()}
                if got != want:  # each expert alike, as a stack of them would require
                    raise MoetoolError(f"{layer.prefix}: local slot {i} (expert {slot_to_global[i]}) has {name} "
                                       f"tensors {_describe(got)}, slot 0 {_describe(want)}")
                for s, v in part.items():
                    dst[s][i].copy_(v, non_blocking=True)
    biases = reader.stacked_biases(layer)  # (w13 [L, 2N], w2 [L, H]) or None
    if biases is not None:
        biases = tuple(b.to(device) for b in biases)
    if biases is not None:
        w13, w2 = {**w13, "bias": biases[0]}, {**w2, "bias": biases[1]}  # checked with the weights below
    for name, t in (("w13", w13), ("w2", w2)):
        for s, v in t.items():
            if v.shape[0] != len(slot_to_global):
                raise MoetoolError(f"{layer.prefix}.experts.{name}_{s}: {v.shape[0]} experts stored, "
                                   f"the manifest places {len(slot_to_global)} on this rank")
    b13, b2 = (w13.pop("bias"), w2.pop("bias")) if biases is not None else (None, None)
    return LocalExperts(reader.fmt, w13, w2, list(slot_to_global), layer.intermediate, layer.hidden,
                        bias13=b13, bias2=b2, activation=layer.activation)


def _w13_down(reader: ExpertReader, layer: MoELayerSpec, i: int) -> tuple[dict, dict]:
    """Stored expert i's (w13 [2N, H] gate rows first, w2 [H, N]) linears, read once."""
    gate, up, down = reader.gate_up_down(layer, i)
    return reader.fmt.cat_rows([gate, up]), down


def _describe(specs: dict) -> str:
    return ", ".join(f"{s} {list(shape)} {str(dtype).replace('torch.', '')}" for s, (shape, dtype) in sorted(specs.items()))


def _stacked_on(ckpt, name: str, device: torch.device) -> torch.Tensor:
    """A stacked [L, ...] tensor of the shard on ``device``: on a GPU, one slot at a time."""
    if device.type != "cuda":
        return ckpt.get(name)
    info = ckpt.info(name)
    out = torch.empty(tuple(info.shape), dtype=info.dtype, device=device)
    for i, row in enumerate(read_ahead(lambda i: ckpt.get_rows(name, i), info.shape[0])):
        out[i].copy_(row, non_blocking=True)
    return out


def _probe_slots(experts: ExpertsBackend, local: LocalExperts, x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Each local slot alone on the probe batch: [L, P, H] float32 (weight 1, no routing)."""
    experts.bind(local, device)
    x = x.to(device)
    P = x.shape[0]
    outs = []
    for s in range(len(local.slot_to_global)):
        ids = torch.full((P, 1), s, dtype=torch.int64, device=device)
        w = torch.ones(P, 1, dtype=torch.float32, device=device)
        counts = torch.zeros(len(local.slot_to_global), dtype=torch.int64, device=device)
        counts[s] = P
        y = experts.apply(x, None, ids, w, counts)
        if not experts.applies_weights_and_reduces:
            y = y.sum(dim=1)
        outs.append(y.float())
    return torch.stack(outs) if outs else torch.zeros(0, P, x.shape[1])
