"""How the all2all dispatcher moves token rows to the ranks of their experts and the results
back: two transports with one interface, and the vote that picks one (``--transport``).

- ``collectives``: a count exchange, the host reads the counts, then ``all_to_all_single`` of
  exactly the rows (any backend, any number of hosts).
- ``mapped``: ranks of one host store rows and counts straight into each other's mapped
  buffers and read their tokens' results straight from them (CUDA symmetric memory over
  NVLink; shared memory between CPU ranks), with a barrier where the collectives were and no
  host synchronisation (DeepEP's intranode idea).

Each EP step runs its Triton kernel (``moetool.kernels.ep_dispatch`` / ``ep_combine``) on CUDA
and under the Triton interpreter, and its pure-torch reference elsewhere (same arguments, same
results): ``KernelOrRef`` below.

Letters: m = tokens this rank routes, P = (token, destination) pairs sent, M = rows received,
H = hidden, k = top-k, L = local slots, R = ranks, B = bytes of a token row.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from moetool.errors import MoetoolError
from moetool.kernels import ep_combine, ep_dispatch
from moetool.kernels.common import is_interpreted
from moetool.verify.chunk import ChunkInfo, CommStats, Prepared
from moetool.verify.graphs import GraphCache
from moetool.verify.peer_memory import MappedBuffers
from moetool.verify.topology import RouteTable, Topology, all_gather_tensor, row_split
from moetool.verify.wire import RowLayout, pack_format


@dataclass(frozen=True)
class KernelOrRef:
    """One EP step: its checked Triton wrapper, the ``@triton.jit`` function behind it, and its
    pure-torch reference (same arguments, same results)."""

    kernel: Callable
    jit: Any
    ref: Callable

    def pick(self, like: torch.Tensor) -> Callable:
        """The kernel for CUDA tensors and under the Triton interpreter (TRITON_INTERPRET=1, how
        the tests run them on CPU), else the reference."""
        return self.kernel if like.is_cuda or is_interpreted(self.jit) else self.ref


ROUTE_TOKENS = KernelOrRef(ep_dispatch.route_tokens, ep_dispatch._route_tokens_kernel, ep_dispatch.route_tokens_ref)
PACK_ROWS = KernelOrRef(ep_dispatch.pack_rows, ep_dispatch._pack_rows_kernel, ep_dispatch.pack_rows_ref)
LOCAL_SLOTS = KernelOrRef(ep_dispatch.local_slots, ep_dispatch._local_slots_kernel, ep_dispatch.local_slots_ref)
COMBINE_ROWS = KernelOrRef(ep_combine.combine_rows, ep_combine._combine_rows_kernel, ep_combine.combine_rows_ref)
COMBINE_FROM_PEERS = KernelOrRef(ep_combine.combine_from_peers, ep_combine._combine_from_peers_kernel,
                                 ep_combine.combine_from_peers_ref)


def _group(act_group: int | None) -> int:
    """pack_rows' group argument: the fp8 group size (unused for unquantized rows)."""
    return 128 if act_group is None else act_group


class Transport:
    """Moves one chunk's token rows to the ranks that hold their experts (``dispatch``) and the
    expert results back to the ranks that routed the tokens (``combine``)."""

    name: ClassVar[str]

    def __init__(self, topo: Topology, wire: torch.dtype, timeout_s: float = 300.0):
        """``wire``: dtype of the expert results on the way back. ``timeout_s``: how long a
        wait for the other ranks may take where the transport has its own (mapped barriers)."""
        self.topo = topo
        self.wire = wire
        self.timeout_s = timeout_s

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 token_index: torch.Tensor, chunk: ChunkInfo, table: RouteTable, num_slots: int,
                 act_group: int | None, layout: RowLayout, stats: CommStats) -> Prepared:
        """x [m, H] float32, topk_ids int64 [m, k] (global), topk_weights float32 [m, k],
        token_index int64 [m] (global positions), act_group: fp8 quantization of the rows
        (``wire.py``; None: sent in the layout's dtype), ``layout`` the row they travel in
        (``wire.token_rows``) -> the rows this rank's experts get, with state["pos"] int64
        [R, m] (where each (rank, token) row went, -1: not sent) and state["t"] (group chunk size)."""
        raise NotImplementedError

    def combine(self, out: torch.Tensor, prep: Prepared, width: int, stats: CommStats) -> torch.Tensor:
        """out [M, H] wire dtype (this rank's reduced expert results, one per received row) ->
        each routed token's rows summed in rank order: [m, H] float32 when tp = 1, else the tp
        group's rows [tp * width, H] (rank i's part at row i * width)."""
        raise NotImplementedError

    def _dispatch_stats(self, stats: CommStats, send_l: list[int], recv_l: list[int], B: int) -> None:
        """Dispatch counters of one chunk: rows of B bytes sent to / received from each rank,
        plus the 8-byte counts to every other rank."""
        R, me = self.topo.world_size, self.topo.rank
        stats.dispatch_bytes_sent += (sum(send_l) - send_l[me]) * B + 8 * (R - 1)
        stats.add_split("dispatch_split_bytes", [n * B for n in send_l])
        stats.dispatch_bytes_recv += (sum(recv_l) - recv_l[me]) * B + 8 * (R - 1)
        stats.tokens_received += sum(recv_l)

    def _combine_stats(self, stats: CommStats, send_l: list[int], recv_l: list[int], row_bytes: int,
                       width: int) -> None:
        """Combine counters of one chunk: result rows back, plus the tp all-gather's parts."""
        topo, me = self.topo, self.topo.rank
        gather_bytes = width * row_bytes if topo.tp > 1 else 0  # each tp rank's part of the all-gather
        stats.combine_bytes_sent += (sum(recv_l) - recv_l[me]) * row_bytes + (topo.tp - 1) * gather_bytes
        stats.combine_bytes_recv += (sum(send_l) - send_l[me]) * row_bytes + (topo.tp - 1) * gather_bytes
        stats.add_split("combine_split_bytes", [n * row_bytes + (gather_bytes if r in topo.tp_ranks and r != me else 0)
                                                for r, n in enumerate(recv_l)])


class CollectivesTransport(Transport):
    """Counts first (the one host synchronisation), then ``all_to_all_single`` of exactly the
    rows; results come back the same way, are summed per token in rank order
    (``moetool.kernels.ep_combine``) straight into the input of the tp group's all-gather."""

    name = "collectives"

    def dispatch(self, x, topk_ids, topk_weights, token_index, chunk, table, num_slots, act_group, layout, stats):
        topo = self.topo
        R, me = topo.world_size, topo.rank
        k = topk_ids.shape[1]
        route_tokens, pack_rows, local_slots = ROUTE_TOKENS.pick(x), PACK_ROWS.pick(x), LOCAL_SLOTS.pick(x)
        counts_buf = torch.empty(2, R, dtype=torch.int64, device=x.device)  # [sent to, received from] per rank
        send_counts, recv_counts = counts_buf.unbind(0)
        order = route_tokens(topk_ids, token_index, table.rank, table.count, send_counts)  # [R, m]
        counts_sent = dist.all_to_all_single(recv_counts, send_counts, async_op=True)  # counts first
        # While the counts travel, the GPU fills the send rows: their places need only this
        # rank's own counts, and the buffer is sized for the worst case (every token to
        # min(k, R) ranks), so nothing here waits for the host.
        send = torch.empty(x.shape[0] * min(k, R), layout.row_bytes, dtype=torch.uint8, device=x.device)
        pos = pack_rows(x, topk_ids, topk_weights, token_index, order, send_counts, send,
                        *pack_format(layout, act_group), _group(act_group))  # [R, m] send row of (r, t) or -1
        # the one host synchronisation: on a side stream on CUDA, so the host learns the counts
        # as soon as they arrive while the packing may still run on the compute stream
        with self._counts_stream(x.device):
            counts_sent.wait()
            send_l, recv_l = counts_buf.tolist()
        B = layout.row_bytes
        recv = send.new_empty(sum(recv_l), B)
        dist.all_to_all_single(recv, send[:sum(send_l)], output_split_sizes=recv_l, input_split_sizes=send_l)
        self._dispatch_stats(stats, send_l, recv_l, B)
        hidden, *rest = layout.unpack(recv)
        scale = rest[0] if act_group is not None else None
        local_ids, expert_counts = local_slots(rest[-3], rest[-1][:, 0], table.rank, table.slot, table.count,
                                               me, num_slots)  # [M, k], [L]
        return Prepared(hidden, scale, local_ids, rest[-2].contiguous(), expert_counts,
                        {"pos": pos, "send": send_l, "recv": recv_l, "t": chunk.sizes[topo.group_index]},
                        out_dtype=self.wire)

    def combine(self, out, prep, width, stats):
        topo, st = self.topo, prep.state
        H = out.shape[1]
        back = out.new_empty(sum(st["send"]), H)  # [P, H]
        dist.all_to_all_single(back, out, output_split_sizes=st["send"], input_split_sizes=st["recv"])
        pos = st["pos"].t()  # [m, R]
        combine_rows = COMBINE_ROWS.pick(back)
        if topo.tp == 1:
            full = combine_rows(back, pos, None)  # [m, H] fp32, summed over destinations in rank order
        else:
            part = back.new_empty(width, H)  # the tp all-gather's input, written in place
            combine_rows(back, pos, part[:pos.shape[0]])
            if pos.shape[0] < width:
                part[pos.shape[0]:].zero_()
            full = part.new_empty(topo.tp * width, H)
            all_gather_tensor(full, part, group=topo.tp_group)
        self._combine_stats(stats, st["send"], st["recv"], H * out.element_size(), width)
        return full

    def _counts_stream(self, device: torch.device):
        """Context for reading the counts back: a side stream of this transport on CUDA."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        if getattr(self, "_side_stream", None) is None:
            self._side_stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self._side_stream)


class MappedTransport(Transport):
    """Every rank's receive buffer has one region of ``cap`` rows per source rank (cap: the
    most tokens any rank routes in this chunk, known everywhere), so a row's place there needs
    only the sender's own order: route, pack into the peers' buffers, barrier. The combine
    reads each token's results from the ranks that computed them.

    Nothing here waits for the host, so on CUDA the launches of each side are captured once
    per set of input addresses as a CUDA graph and replayed (one launch instead of a dozen)."""

    name = "mapped"

    def __init__(self, topo: Topology, wire: torch.dtype, timeout_s: float = 300.0):
        super().__init__(topo, wire, timeout_s)
        self.buffers: MappedBuffers | None = None
        # dispatch's topk ids, weights and token positions are new tensors every call: staged
        self.dispatch_graphs, self.combine_graphs = GraphCache(staged=(1, 2, 3)), GraphCache()

    def dispatch(self, x, topk_ids, topk_weights, token_index, chunk, table, num_slots, act_group, layout, stats):
        topo = self.topo
        cap = max(max(row_split(n, topo.tp)) for n in chunk.sizes)
        bufs = self._buffers(max(cap, 1), layout.row_bytes, x.shape[1])
        args = (x, topk_ids, topk_weights, token_index, table, num_slots, act_group, layout, bufs)
        out = self.dispatch_graphs.run(self._dispatch, args) if x.is_cuda else None
        if out is None:
            out = self._dispatch(*args)
        pos, counts, hidden, scale, local_ids, weights, expert_counts = out
        return Prepared(hidden, scale, local_ids, weights, expert_counts,
                        {"pos": pos, "counts": counts, "t": chunk.sizes[topo.group_index]},
                        out_dtype=self.wire, out_buffer=bufs.results.views[topo.rank])

    def _dispatch(self, x, topk_ids, topk_weights, token_index, table, num_slots, act_group, layout, bufs):
        """The device work of the dispatch (no host synchronisation: capturable)."""
        topo = self.topo
        R, me = topo.world_size, topo.rank
        route_tokens, pack_rows, local_slots = ROUTE_TOKENS.pick(x), PACK_ROWS.pick(x), LOCAL_SLOTS.pick(x)
        counts = torch.empty(2, R, dtype=torch.int64, device=x.device)  # [sent to, received from] per rank
        send_counts = counts[0]
        order = route_tokens(topk_ids, token_index, table.rank, table.count, send_counts, bufs.counts, me)  # [R, m]
        pos = pack_rows(x, topk_ids, topk_weights, token_index, order, send_counts, bufs.rows,
                        *pack_format(layout, act_group), _group(act_group), me)  # [R, m]: r * cap + order, or -1
        bufs.memory.barrier(0)  # every rank's rows and counts have arrived
        recv_counts = bufs.counts.views[me]  # [R] rows from each source, first in its region
        hidden, *rest = layout.unpack(bufs.rows.views[me])  # [R * cap, ...] views
        local_ids, expert_counts = local_slots(rest[-3], rest[-1][:, 0], table.rank, table.slot, table.count,
                                               me, num_slots, recv_counts)
        counts[1].copy_(recv_counts)  # kept for the statistics: the next chunk's counts overwrite the buffer
        return pos, counts, hidden, rest[0] if act_group is not None else None, local_ids, rest[-2].contiguous(), expert_counts

    def _buffers(self, cap: int, B: int, H: int) -> MappedBuffers:
        """The buffers for this chunk's sizes; collective when they have to grow (every rank
        derives the same sizes from the chunk)."""
        cur = self.buffers
        if cur is not None and cur.key[0] >= cap and cur.key[1:] == (B, H, self.wire):
            return cur
        cap = max(cap, cur.key[0] if cur is not None else 0)
        self.dispatch_graphs.clear()  # they store into the old buffers
        self.combine_graphs.clear()
        self.buffers = MappedBuffers.create(self.topo, cap, B, H, self.wire, None if cur is None else cur.memory,
                                            timeout_s=self.timeout_s)
        return self.buffers

    def combine(self, out, prep, width, stats):
        st = prep.state
        # the other ranks read the results where they lie: in the mapped results buffer
        if out.data_ptr() != prep.out_buffer.data_ptr():
            prep.out_buffer.copy_(out)  # experts that did not write into it
        args = (st["pos"], width, self.buffers)
        full = self.combine_graphs.run(self._combine, args) if out.is_cuda else None
        if full is None:
            full = self._combine(*args)
        # the row counts stay on the device until the counters are read (CommStats.settle), so
        # nothing here waits for the GPU; the graph's counts buffer is reused by the next replay
        counts = st["counts"].clone() if out.is_cuda else st["counts"]
        stats.defer(functools.partial(self._count, stats, counts, self.buffers.rows.views[0].shape[1],
                                      out.shape[1] * out.element_size(), width))
        return full

    def _combine(self, pos: torch.Tensor, width: int, bufs: MappedBuffers) -> torch.Tensor:
        """The device work of the combine (capturable): every rank's experts have written their
        results buffer (barrier), then each token's rows are read from the ranks that computed
        them and summed in rank order; with tp > 1 the sums go straight into every tp rank's
        gather buffer ([tp * width, H], which the result aliases until the next chunk:
        run_moe_layer copies it out at once). A rank's results buffer is next written after the
        next chunk's dispatch barrier, which every rank reaches only after this read."""
        topo, me = self.topo, self.topo.rank
        combine = COMBINE_FROM_PEERS.pick(bufs.results.views[me])
        bufs.memory.barrier(1)
        if topo.tp == 1:
            return combine(bufs.results, pos.t(), me)  # [m, H] fp32
        combine(bufs.results, pos.t(), me, peers=bufs.gathered, row0=topo.tp_index * width)
        bufs.memory.barrier(2)
        return bufs.gathered.views[topo.tp_index][:topo.tp * width]

    def _count(self, stats: CommStats, counts: torch.Tensor, B: int, row_bytes: int, width: int) -> None:
        """Both counters of one chunk, from its [2, R] device counts (sent to, received from)."""
        send_l, recv_l = counts.tolist()
        self._dispatch_stats(stats, send_l, recv_l, B)
        self._combine_stats(stats, send_l, recv_l, row_bytes, width)


TRANSPORTS: dict[str, type[Transport]] = {"collectives": CollectivesTransport, "mapped": MappedTransport}


def choose_transport(requested: str, device: torch.device) -> str:
    """The all2all transport for ``--transport`` (auto | collectives | mapped). Collective:
    every rank calls it, and all take the same answer. auto is mapped when, on every rank,
    the ranks all run on this host (LOCAL_WORLD_SIZE = WORLD_SIZE, as ``verify``'s own spawn
    sets), on distinct GPUs that can all access each other; collectives otherwise."""
    one_host = os.environ.get("LOCAL_WORLD_SIZE") == str(dist.get_world_size())
    if requested == "collectives":
        return requested
    able = one_host and (requested == "mapped" or device.type == "cuda")
    if able and device.type == "cuda":
        able = _all_peers_reachable()
    vote = torch.tensor([int(able)], dtype=torch.int64, device=device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    if device.type == "cuda" and int(vote):  # distinct GPUs: not one cuda:0 per process
        index = torch.tensor([device.index if device.index is not None else torch.cuda.current_device()],
                             dtype=torch.int64, device=device)
        indices = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
        all_gather_tensor(indices, index)
        vote.fill_(int(len(set(indices.tolist())) == dist.get_world_size()))
    if int(vote):
        return "mapped"
    if requested == "mapped":
        raise MoetoolError("--transport mapped needs every rank on one host (LOCAL_WORLD_SIZE = WORLD_SIZE), "
                           "each on its own GPU with peer access to the others")
    return "collectives"


def _all_peers_reachable() -> bool:
    """Every pair of this host's GPUs can map each other's memory (NVLink or PCIe P2P)."""
    n = torch.cuda.device_count()
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b)
