"""Dispatchers: move routed tokens to the ranks that hold their experts, and results back.

As vLLM's ``FusedMoEPrepareAndFinalize``: ``prepare`` quantizes activations where the format
allows it and sends tokens plus top-k ids/weights, handing the experts backend LOCAL ids
(-1 = not on this rank) and per-local-expert counts; ``finalize`` brings expert outputs back
and sums them per token. Any dispatcher composes with any experts backend; the all2all one
moves its rows through a transport object (``transports.py``). Where ranks stand and which
replica serves a token: ``topology.py``.

Letters: t = tokens of a group's chunk, m = tokens this rank routes, M = rows received,
H = hidden, k = top-k, L = local slots.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist

from moetool.errors import MoetoolError
from moetool.model.spec import ExpertPlacement
from moetool.verify.chunk import ChunkInfo, CommStats, Prepared
from moetool.verify.experts import weight_and_reduce
from moetool.verify.topology import RouteTable, Topology, all_gather_tensor, reduce_scatter_tensor, row_split
from moetool.verify.transports import TRANSPORTS
from moetool.verify.wire import RowLayout, payload, token_rows

class Dispatcher:
    """Prepare (quantize + dispatch) and finalize (combine) for one communication backend."""

    name: ClassVar[str]

    def __init__(self, topo: Topology, comm_dtype: torch.dtype = torch.float32):
        """``comm_dtype``: dtype of unquantized token rows on the wire. Expert outputs travel back
        in float32 (allgather), or in ``comm_dtype`` when that is bfloat16 or float32 and in
        float32 otherwise (all2all). Whether rows travel as fp8 is the caller's ``act_group``
        (the numerics of the run, ``moetool.verify.numerics``)."""
        self.topo = topo
        self.comm_dtype = comm_dtype
        self._tables: dict[int, tuple[ExpertPlacement, RouteTable]] = {}

    def route_table(self, placement: ExpertPlacement) -> RouteTable:
        """The placement's RouteTable on this rank's device, built once per placement object
        (the same tensors at every call, so captured graphs can read them in place)."""
        cached = self._tables.get(id(placement))
        if cached is None or cached[0] is not placement:
            cached = self._tables[id(placement)] = (placement, RouteTable.build(placement, self.topo.device))
        return cached[1]

    def token_slice(self, t: int) -> slice:
        """Rows of this group's chunk of t tokens that this rank routes and sends."""
        raise NotImplementedError

    def prepare(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                token_index: torch.Tensor, chunk: ChunkInfo, table: RouteTable, num_slots: int,
                act_group: int | None, stats: CommStats) -> Prepared:
        """x [m, H] float32, topk_ids int64 [m, k] (global), topk_weights float32 [m, k],
        token_index int64 [m] (global positions) for the rows ``token_slice`` chose; act_group:
        the fp8 group size the rows are quantized with before the send (128, or 0 for one scale
        per token), None = sent unquantized in ``comm_dtype``."""
        raise NotImplementedError

    def finalize(self, expert_out: torch.Tensor, prep: Prepared, reduced: bool,
                 stats: CommStats) -> torch.Tensor:
        """Expert output ([M, H] if ``reduced`` else [M, k, H]) -> this group's chunk [t, H]
        (float32, or the wire dtype where the last step was a collective), every expert's
        weighted contribution summed, replicated on the tp group."""
        raise NotImplementedError


def _expert_counts(local_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """local_ids [M, k] (-1 = elsewhere) -> pairs per local slot, int64 [L]; no host sync
    (bincount on CUDA reads the maximum back to size its output)."""
    flat = local_ids.flatten()
    if flat.numel() * num_slots <= 1 << 26:  # one-hot sum: atomics would contend on L addresses
        return (flat[:, None] == torch.arange(num_slots, device=flat.device)).sum(dim=0)  # [L]
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=flat.device)
    inside = (flat >= 0) & (flat < num_slots)  # out-of-range ids count nowhere, as above
    counts.scatter_add_(0, torch.where(inside, flat + 1, 0), torch.ones_like(flat))
    return counts[1:]


class AllGatherDispatcher(Dispatcher):
    """Naive DP/EP (vLLM naive all2all): all-gather every group's chunk over the dp subgroup,
    run the local experts on all of it (weights applied on the expert side), reduce-scatter
    the sums back over the dp subgroup, then all-reduce over the tp group, whose ranks hold
    different experts of the same tokens."""

    name = "allgather"

    def token_slice(self, t: int) -> slice:
        return slice(0, t)

    def prepare(self, x, topk_ids, topk_weights, token_index, chunk, table, num_slots, act_group, stats):
        topo = self.topo
        dev = x.device
        t, k = topk_ids.shape
        sizes = chunk.sizes  # [dp]
        tmax = max(sizes)
        parts, like = payload(x, act_group, self.comm_dtype)
        layout = RowLayout(tuple(like) + ((torch.int64, k), (torch.float32, k)))
        buf = layout.pack(parts + [topk_ids, topk_weights])  # uint8 [t, B]
        if t < tmax:
            buf = torch.cat([buf, buf.new_zeros(tmax - t, buf.shape[1])])
        if topo.dp > 1:
            gathered = buf.new_empty(topo.dp * tmax, buf.shape[1])
            all_gather_tensor(gathered, buf, group=topo.dp_group)
        else:
            gathered = buf
        stats.dispatch_bytes_sent += (topo.dp - 1) * buf.numel()
        stats.dispatch_bytes_recv += (topo.dp - 1) * buf.numel()
        unpacked = layout.unpack(gathered)
        ids, weights = unpacked[-2], unpacked[-1].contiguous()  # [dp*tmax, k]
        rows = torch.arange(tmax, device=dev)
        valid = torch.cat([rows < sizes[g] for g in range(topo.dp)])  # [dp*tmax]
        gidx = torch.cat([chunk.starts[g] + rows for g in range(topo.dp)])  # [dp*tmax]
        ids = torch.where(valid[:, None], ids, torch.zeros_like(ids))  # padding rows hold zeros
        dest_rank, dest_slot = table.destinations(ids, gidx)
        mine = (dest_rank == topo.rank) & valid[:, None]
        local_ids = torch.where(mine, dest_slot, torch.full_like(dest_slot, -1))  # [dp*tmax, k]
        counts = _expert_counts(local_ids, num_slots)
        stats.tokens_received += int(mine.any(dim=1).sum())
        stats.rows_padding += topo.dp * tmax - sum(sizes)
        return Prepared(unpacked[0], unpacked[1] if act_group is not None else None, local_ids, weights, counts,
                        {"t": t})

    def finalize(self, expert_out, prep, reduced, stats):
        topo = self.topo
        out = expert_out if reduced else weight_and_reduce(expert_out, prep.local_ids, prep.topk_weights)
        out = out.float().contiguous()  # [dp*tmax, H]
        tmax = out.shape[0] // topo.dp
        if topo.dp > 1:
            y = out.new_empty(tmax, out.shape[1])
            reduce_scatter_tensor(y, out, group=topo.dp_group)
        else:
            y = out
        stats.combine_bytes_sent += (topo.dp - 1) * y.numel() * 4
        stats.combine_bytes_recv += (topo.dp - 1) * y.numel() * 4
        y = y[:prep.state["t"]].contiguous()  # [t, H]
        if topo.tp > 1:
            dist.all_reduce(y, group=topo.tp_group)
            ring = 2 * (topo.tp - 1) * y.numel() * 4 // topo.tp
            stats.combine_bytes_sent += ring
            stats.combine_bytes_recv += ring
        return y


class All2AllDispatcher(Dispatcher):
    """DeepEP high-throughput style. Rank i of a tp group takes the i-th contiguous slice of
    the group's chunk (no token is sent twice) and sends each token row once to every rank
    holding one of its experts: one packed row per token (``wire.token_rows``: row, [fp8
    scales], global expert ids, weights, global position; the receiver picks the ids it holds
    with the same replica rule). The combine returns one row per (token, destination) in the
    wire dtype with the top-k weights already applied on the expert side; the source sums them
    in rank order into the tp group's rows, which restores the replicated [t, H] chunk. How
    the rows travel is the transport's business (``transports.py``)."""

    name = "all2all"

    def __init__(self, topo: Topology, comm_dtype: torch.dtype = torch.float32, transport: str = "collectives",
                 timeout_s: float = 300.0):
        """``transport``: a name of ``transports.TRANSPORTS`` (collectives | mapped).
        ``timeout_s``: how long the transport's own waits for the other ranks may take."""
        super().__init__(topo, comm_dtype)
        if transport not in TRANSPORTS:
            raise MoetoolError(f"unknown all2all transport {transport!r} (known: {', '.join(TRANSPORTS)})")
        self.transport = TRANSPORTS[transport](topo, self._wire, timeout_s)

    def token_slice(self, t: int) -> slice:
        split = row_split(t, self.topo.tp)
        start = sum(split[:self.topo.tp_index])
        return slice(start, start + split[self.topo.tp_index])

    @property
    def _wire(self) -> torch.dtype:
        """dtype of the expert results on the way back"""
        return self.comm_dtype if self.comm_dtype in (torch.float32, torch.bfloat16) else torch.float32

    def prepare(self, x, topk_ids, topk_weights, token_index, chunk, table, num_slots, act_group, stats):
        layout = token_rows(x.shape[1], topk_ids.shape[1], act_group, self.comm_dtype)
        return self.transport.dispatch(x, topk_ids, topk_weights, token_index, chunk, table, num_slots, act_group,
                                       layout, stats)

    def finalize(self, expert_out, prep, reduced, stats):
        topo = self.topo
        t = prep.state["t"]
        out = expert_out if reduced else weight_and_reduce(expert_out, prep.local_ids, prep.topk_weights)
        # partial sums travel back in the wire dtype (bf16 as in serving, fp32 when exactness is
        # tested); experts that reduce already wrote them in it (prep.out_dtype)
        out = out.to(prep.out_dtype).contiguous()  # [M, H]
        split = row_split(t, topo.tp)
        width = max(split)
        full = self.transport.combine(out, prep, width, stats)
        if topo.tp == 1 or width * topo.tp == t:
            return full  # [t, H]
        return torch.cat([full[i * width:i * width + split[i]] for i in range(topo.tp)])  # [t, H]


DISPATCHERS: dict[str, type[Dispatcher]] = {"allgather": AllGatherDispatcher, "all2all": All2AllDispatcher}


def get_dispatcher(name: str, topo: Topology, **kwargs) -> Dispatcher:
    """A dispatcher by CLI name: "allgather" or "all2all"."""
    if name not in DISPATCHERS:
        raise MoetoolError(f"unknown dispatch backend {name!r} (known: {', '.join(DISPATCHERS)})")
    return DISPATCHERS[name](topo, **kwargs)
