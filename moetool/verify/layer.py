"""One distributed MoE layer: route -> quantize + dispatch -> experts -> combine -> + shared.

Runs on every rank of an initialised process group (see ``launch.py``). Letters:
T_g = tokens of this rank's dp group, H = hidden, E = experts, k = top-k, L = local slots.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from moetool.errors import MoetoolError
from moetool.model.spec import ExpertPlacement, LocalExperts, RouterSpec
from moetool.verify.chunk import ChunkInfo, CommStats, num_chunks
from moetool.verify.dispatchers import Dispatcher
from moetool.verify.experts import ExpertsBackend
from moetool.verify.numerics import Numerics
from moetool.verify.reference import SharedWeights, shared_forward
from moetool.verify.router import route
from moetool.verify.topology import all_gather_tensor, check_local_experts

PHASES = ("route", "dispatch", "experts", "combine", "shared")


class PhaseTimer:
    """Wall time per phase (time.perf_counter); on CUDA also CUDA-event time, with the current
    stream synchronized around each phase so the wall time belongs to that phase (a side
    stream's work, the shared expert's, runs on across phases: ``side``)."""

    def __init__(self, device: torch.device, align_ranks: bool = False):
        self.cuda = device.type == "cuda"
        #: barrier before each phase, so a phase's time is its own work and not the wait for a
        #: slower rank (for timing communication; adds a barrier per phase)
        self.align_ranks = align_ranks
        self.wall = {p: 0.0 for p in PHASES}
        self._events: dict[str, list] = {p: [] for p in PHASES}

    @contextmanager
    def phase(self, name: str):
        """Time the work issued on the current stream inside the block (the synchronizes wait
        for this stream only: a side stream's work goes on across phases)."""
        if self.align_ranks:
            dist.barrier()
        if self.cuda:
            torch.cuda.current_stream().synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                end.record()
                torch.cuda.current_stream().synchronize()
                self._events[name].append((start, end))
            self.wall[name] += time.perf_counter() - t0

    def side(self, name: str, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """Count the work between two events recorded on a side stream under ``name`` (CUDA
        time only: its wall time overlaps the other phases')."""
        self._events[name].append((start, end))

    def report(self) -> dict[str, float]:
        out = {f"time_{p}_s": self.wall[p] for p in PHASES}
        if self.cuda:
            for p in PHASES:
                out[f"cuda_{p}_s"] = sum(s.elapsed_time(e) for s, e in self._events[p]) / 1e3
        return out


def run_moe_layer(x_group: torch.Tensor, gate_weight: torch.Tensor,
                  correction_bias: torch.Tensor | None, router: RouterSpec, local: LocalExperts,
                  placement: ExpertPlacement, shared: SharedWeights | None,
                  dispatcher: Dispatcher, experts: ExpertsBackend,
                  chunk_size: int = 4096, align_phases: bool = False,
                  router_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Collective: every rank calls it with its group's tokens.

    x_group [T_g, H] float32 (identical on the tp ranks of a dp group); gate_weight [E, H];
    correction_bias [E] or None; router_bias [E] or None (gpt-oss: added to the logits);
    local: this rank's experts (slots as ``placement.slots[rank]``);
    shared: dense float32 shared expert, replicated, added once per token after combine (on a
    GPU its GEMMs run in the served dtype on a side stream, overlapping dispatch and the experts).
    Returns (y [T_g, H] float32, replicated in the tp group; stats: a dict of plain values,
    see ``_stats``). The numerics are the experts backend's (``experts.numerics``): served,
    the experts' and the shared expert's input and the output are in the served dtype and the
    rows travel as fp8 where the format's activations are (the router reads x_group as it is);
    exact, float32 throughout. Tokens run in chunks of ``chunk_size`` per group; ranks whose group has
    fewer chunks join the others' collectives with empty chunks.
    """
    topo = dispatcher.topo
    dev = topo.device
    if chunk_size < 1:
        raise MoetoolError(f"--chunk-size must be positive, got {chunk_size}")
    if x_group.dim() != 2 or x_group.shape[1] != local.hidden:
        raise MoetoolError(f"rank {topo.rank}: tokens {list(x_group.shape)} do not match hidden size {local.hidden}")
    if router.apply_weight_on_input and router.top_k != 1:
        raise MoetoolError(f"apply_weight_on_input needs top_k 1, not {router.top_k}")
    check_local_experts(local, placement, topo.rank, topo.world_size)
    timer = PhaseTimer(dev, align_phases)
    t_start = time.perf_counter()
    nm = experts.numerics
    x_group = x_group.to(device=dev, dtype=torch.float32)  # what the router sees
    # the experts' input as the engine holds it. The router keeps the float32 input, as the
    # reference's does: rounding it too could flip a near-tie between two experts, a
    # difference of the two sides' rounding, not of the checkpoint
    x_served = nm.round(x_group)
    gate_weight = gate_weight.to(dev)
    correction_bias = None if correction_bias is None else correction_bias.to(dev)
    router_bias = None if router_bias is None else router_bias.to(dev)
    side = None
    if shared is not None and dev.type == "cuda":
        # the engine's way: the shared expert's GEMMs in the served dtype (fp32 accumulation)
        # on a side stream, overlapping dispatch, the experts and combine
        shared = tuple(None if w is None else w.to(dev, nm.act_dtype) for w in shared)
        side = torch.cuda.Stream(dev)
    elif shared is not None:
        shared = tuple(None if w is None else nm.round(w.to(dev)) for w in shared)
    experts.bind(local, dev)
    table = dispatcher.route_table(placement)
    num_slots = len(local.slot_to_global)
    act_group = nm.act_group

    # every group's token count: global token positions, padding and the common chunk count
    counts = torch.zeros(topo.world_size, dtype=torch.int64, device=dev)
    all_gather_tensor(counts, torch.tensor([x_group.shape[0]], dtype=torch.int64, device=dev))
    counts_l = counts.tolist()
    group_tokens = [counts_l[g * topo.tp] for g in range(topo.dp)]
    for r, c in enumerate(counts_l):
        if c != group_tokens[r // topo.tp]:
            raise MoetoolError(f"rank {r} has {c} tokens but rank {(r // topo.tp) * topo.tp} of the "
                               f"same dp group has {group_tokens[r // topo.tp]}")
    group_start = [sum(group_tokens[:g]) for g in range(topo.dp)]
    chunks = max(num_chunks(t, chunk_size) for t in group_tokens)

    stats = CommStats(expert_tokens=[0] * num_slots)
    g = topo.group_index
    y = torch.zeros_like(x_group)  # [T_g, H]
    for c in range(chunks):
        lo = c * chunk_size
        sizes = [max(0, min(chunk_size, t - lo)) for t in group_tokens]
        info = ChunkInfo(sizes=sizes, starts=[group_start[i] + lo for i in range(topo.dp)])
        rows = dispatcher.token_slice(sizes[g])
        x_c = x_served[lo + rows.start:lo + rows.stop]  # [m, H]
        y_shared = None
        if side is not None and sizes[g]:
            y_shared = _shared_on_side(side, x_served[lo:lo + sizes[g]], shared, nm, local, timer)
        with timer.phase("route"):
            topk_ids, topk_weights = route(x_group[lo + rows.start:lo + rows.stop], gate_weight, router,
                                           correction_bias, router_bias)  # [m, k] x2
            if router.apply_weight_on_input:
                x_c = nm.round(x_c * topk_weights)  # [m, H] * [m, 1]
                topk_weights = torch.ones_like(topk_weights)
            token_index = info.starts[g] + rows.start + torch.arange(x_c.shape[0], device=dev)  # [m]
        with timer.phase("dispatch"):
            prep = dispatcher.prepare(x_c, topk_ids, topk_weights, token_index, info, table,
                                      num_slots, act_group, stats)
        with timer.phase("experts"):
            out = experts.apply(prep.hidden, prep.hidden_scale, prep.local_ids, prep.topk_weights,
                                prep.expert_num_tokens, out_dtype=prep.out_dtype, out=prep.out_buffer)
        for s, n in enumerate(prep.expert_num_tokens.tolist()):
            stats.expert_tokens[s] += n
        with timer.phase("combine"):
            y_c = dispatcher.finalize(out, prep, experts.applies_weights_and_reduces, stats)  # [t, H]
        if sizes[g]:
            if y_shared is not None:
                torch.cuda.current_stream().wait_stream(side)
                y_c = y_c.float() + y_shared.float()
            elif shared is not None:
                with timer.phase("shared"):
                    y_c = y_c.float() + shared_forward(x_served[lo:lo + sizes[g]], shared, nm.round,
                                                       local.activation)
            y[lo:lo + sizes[g]] = nm.round(y_c)
    if side is not None:  # the side stream's timing events are read below
        torch.cuda.current_stream().synchronize()
    stats.settle()
    stats.pairs_computed = sum(stats.expert_tokens)
    return y, _stats(topo, dispatcher, experts, stats, timer, x_group.shape[0], chunks,
                     time.perf_counter() - t_start, nm, local)


def _shared_on_side(side: torch.cuda.Stream, x: torch.Tensor, shared: SharedWeights, nm: Numerics,
                    local: LocalExperts, timer: PhaseTimer) -> torch.Tensor:
    """The shared expert [t, H] in the served dtype (weights already in it), issued on ``side``
    after the current stream's work so far; the caller waits on ``side`` before reading it."""
    side.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record()
        xs = x.to(nm.act_dtype)  # [t, H]
        gate, up, down, sgate = shared
        # the activation in float32, rounded once (an engine's fused silu-and-mul)
        h = local.activation.apply((xs @ gate.t()).float(), (xs @ up.t()).float()).to(nm.act_dtype)  # [t, Ns]
        y = h @ down.t()  # [t, H]
        if sgate is not None:  # the gate's logit in float32, as the emulation's
            y = (torch.sigmoid(xs.float() @ sgate.float().t()) * y.float()).to(nm.act_dtype)
        end.record()
    timer.side("shared", start, end)
    y.record_stream(torch.cuda.current_stream())  # read there later: keep the block until then
    return y


def _stats(topo, dispatcher, experts, cs: CommStats, timer: PhaseTimer, tokens: int, chunks: int,
           total_s: float, numerics: Numerics, local: LocalExperts) -> dict:
    """Per-rank stats, plain values only:
    rank, dp_group, tp_index, dispatcher, experts, format, activation (the experts', described),
    numerics ({mode, act_dtype,
    act_quant}), act_quant (the fp8 activation scheme on the wire or None), chunks,
    tokens_in (tokens of this rank's group), tokens_received (token rows reaching its experts),
    pairs_computed ((token, local slot) pairs run), rows_padding, expert_tokens [L],
    local_experts [L] (global ids), dispatch/combine_bytes_sent/recv, dispatch/combine_split_bytes
    ([R] bytes to each rank, all2all only), time_{route,dispatch,
    experts,combine,shared}_s, time_total_s (and cuda_*_s on CUDA)."""
    return {
        "rank": topo.rank,
        "dp_group": topo.group_index,
        "tp_index": topo.tp_index,
        "dispatcher": dispatcher.name,
        "experts": experts.name,
        "format": local.fmt.name,
        "activation": local.activation.describe(),
        "numerics": numerics.to_json(),
        "act_quant": numerics.act_quant,
        "chunks": chunks,
        "tokens_in": tokens,
        "tokens_received": cs.tokens_received,
        "pairs_computed": cs.pairs_computed,
        "rows_padding": cs.rows_padding,
        "expert_tokens": list(cs.expert_tokens),
        "local_experts": list(local.slot_to_global),
        "dispatch_bytes_sent": cs.dispatch_bytes_sent,
        "dispatch_bytes_recv": cs.dispatch_bytes_recv,
        "combine_bytes_sent": cs.combine_bytes_sent,
        "combine_bytes_recv": cs.combine_bytes_recv,
        "dispatch_split_bytes": list(cs.dispatch_split_bytes),
        "combine_split_bytes": list(cs.combine_split_bytes),
        **timer.report(),
        "time_total_s": total_s,
    }
