"""Dispatchers: move routed tokens to the ranks that hold their experts, and results back.

As vLLM's ``FusedMoEPrepareAndFinalize``: ``prepare`` quantizes activations where the format
allows it and sends tokens plus top-k ids/weights, handing the experts backend LOCAL ids
(-1 = not on this rank) and per-local-expert counts; ``finalize`` brings expert outputs back
and sums them per token. Any dispatcher composes with any experts backend.

Topology. World size R = ep ranks, ``dp`` data-parallel groups of ``tp = R // dp`` ranks:
group g = ranks [g*tp, (g+1)*tp) holds the same tokens (replicated); experts are placed over
all R ranks. The "dp subgroup" of tp-index i = ranks {g*tp + i : g < dp}.

Replicas. A token with global index t (position in the concatenation of all groups'
tokens) that chose expert e goes to ``replicas[e][t % len(replicas[e])]``, so every replica
is exercised, identically in both backends.

Letters: t = tokens of a chunk, m = tokens this rank routes, P = (token, destination) pairs
sent, M = rows received, H = hidden, k = top-k, L = local slots, G = ceil(H/128).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from moetool.errors import MoetoolError
from moetool.kernels.common import PeerBuffers
from moetool.model.spec import ExpertPlacement, LocalExperts
from moetool.verify.experts import ACT_GROUP, weight_and_reduce

# torch 2.13 renamed the tensor collectives; the old names warn on every call
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: formats whose activations are quantized before the send (W8A8, per-token 1x128 groups)
ACT_QUANT_FORMATS = ("fp8-block",)


# --------------------------------------------------------------------------- topology


@dataclass
class Topology:
    """This rank's place in the dp x tp grid and its two process groups."""

    rank: int
    world_size: int
    dp: int
    tp: int
    group_index: int  # g: which dp group (token set) this rank serves
    tp_index: int  # i: position inside the group
    tp_ranks: list[int]
    dp_ranks: list[int]
    tp_group: Any  # ProcessGroup over tp_ranks
    dp_group: Any  # ProcessGroup over dp_ranks (the dp subgroup)
    device: torch.device

    @classmethod
    def create(cls, dp: int, device: torch.device | None = None) -> "Topology":
        """Collective: every rank of the initialised default group must call it, same ``dp``."""
        if not dist.is_initialized():
            raise MoetoolError("Topology.create needs an initialised process group")
        R, rank = dist.get_world_size(), dist.get_rank()
        if dp < 1 or R % dp:
            raise MoetoolError(f"--dp {dp} must divide the number of ranks (--ep {R})")
        tp = R // dp
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if dist.get_backend() == "nccl" else torch.device("cpu"))
        tp_group = dp_group = None
        # new_group is collective over the world: every rank creates every group, same order
        for g in range(dp):
            ranks = list(range(g * tp, (g + 1) * tp))
            pg = dist.new_group(ranks)
            if rank in ranks:
                tp_group, tp_ranks = pg, ranks
        for i in range(tp):
            ranks = [g * tp + i for g in range(dp)]
            pg = dist.new_group(ranks)
            if rank in ranks:
                dp_group, dp_ranks = pg, ranks
        return cls(rank, R, dp, tp, rank // tp, rank % tp, tp_ranks, dp_ranks, tp_group, dp_group, device)


@dataclass
class RouteTable:
    """Global expert -> replicas as tensors; picks each (token, k)'s destination."""

    rank: torch.Tensor  # int64 [E, max_replicas], -1 padded
    slot: torch.Tensor  # int64 [E, max_replicas]
    count: torch.Tensor  # int64 [E]

    @classmethod
    def build(cls, placement: ExpertPlacement, device: torch.device) -> "RouteTable":
        E = placement.num_experts
        missing = [e for e in range(E) if not placement.replicas.get(e)]
        if missing:
            raise MoetoolError(f"expert placement has no rank for expert(s) {missing[:8]}")
        width = max(len(placement.replicas[e]) for e in range(E))
        rank = torch.full((E, width), -1, dtype=torch.int64)
        slot = torch.full((E, width), -1, dtype=torch.int64)
        for e in range(E):
            for j, (r, s) in enumerate(placement.replicas[e]):
                if not 0 <= r < placement.num_ranks:
                    raise MoetoolError(f"expert placement puts expert {e} on rank {r} of {placement.num_ranks}")
                rank[e, j], slot[e, j] = r, s
        count = torch.tensor([len(placement.replicas[e]) for e in range(E)], dtype=torch.int64)
        return cls(rank.to(device), slot.to(device), count.to(device))

    def destinations(self, topk_ids: torch.Tensor, token_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_ids int64 [m, k] (global), token_index int64 [m] (global token positions)
        -> (rank, local slot) int64 [m, k] each."""
        choice = token_index[:, None] % self.count[topk_ids]  # [m, k]
        return self.rank[topk_ids, choice], self.slot[topk_ids, choice]


def check_local_experts(local: LocalExperts, placement: ExpertPlacement, rank: int, world_size: int) -> None:
    """The shard this rank loaded must be the one the placement describes."""
    if placement.num_ranks != world_size:
        raise MoetoolError(f"the expert placement is for {placement.num_ranks} ranks but {world_size} are running")
    slot_ids = sorted(s for places in placement.replicas.values() for r, s in places if r == rank)
    if slot_ids != list(range(len(slot_ids))):
        raise MoetoolError(f"rank {rank}: placement slots {slot_ids} are not 0..{len(slot_ids) - 1}")
    want = placement.slots[rank]
    if list(local.slot_to_global) != want:
        raise MoetoolError(f"rank {rank} holds experts {list(local.slot_to_global)} but the "
                           f"placement puts {want} there")


# --------------------------------------------------------------------------- values passed around


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of every dp group's tokens: ``sizes[g]`` rows starting at global token
    position ``starts[g]`` (chunks are cut identically on every rank)."""

    sizes: list[int]  # [dp]
    starts: list[int]  # [dp]


@dataclass
class Prepared:
    """What ``prepare`` hands the experts backend, plus its own state for ``finalize``."""

    hidden: torch.Tensor  # [M, H] comm dtype, or float8_e4m3fn; may be a row-strided view of the receive buffer
    hidden_scale: torch.Tensor | None  # float32 [M, G] with fp8 hidden (may be row-strided too)
    local_ids: torch.Tensor  # int64 [M, k], -1 = not on this rank
    topk_weights: torch.Tensor  # float32 [M, k]
    expert_num_tokens: torch.Tensor  # int64 [L]
    state: dict = field(default_factory=dict)
    #: dtype finalize wants a reduced expert output in (experts that reduce write it directly)
    out_dtype: torch.dtype = torch.float32
    #: where experts that reduce should write their [M, H] out_dtype result, when the
    #: dispatcher has a place for it (the mapped transport's results buffer, read by the other
    #: ranks); None = anywhere
    out_buffer: torch.Tensor | None = None


@dataclass
class CommStats:
    """Counters one rank accumulates over a layer. Bytes are the algorithm's logical payload
    to or from OTHER ranks (a ring all-gather of n ranks moves (n-1) blocks each way; a
    ring all-reduce 2(n-1)/n of the buffer), not what the transport adds."""

    tokens_received: int = 0  # token rows that reached this rank's experts (padding excluded)
    pairs_computed: int = 0  # (token, local slot) pairs computed = sum of expert_num_tokens
    rows_padding: int = 0  # rows carried only to even out collectives
    dispatch_bytes_sent: int = 0
    dispatch_bytes_recv: int = 0
    combine_bytes_sent: int = 0
    combine_bytes_recv: int = 0
    expert_tokens: list[int] = field(default_factory=list)  # [L] pairs per local slot
    #: bytes this rank's payload collectives sent to each rank (self included, as the
    #: collective moves it): all2all only, [R] each; a raw all_to_all_single with exactly these
    #: splits is the benchmarks' comparator that keeps the routing's imbalance
    dispatch_split_bytes: list[int] = field(default_factory=list)
    combine_split_bytes: list[int] = field(default_factory=list)

    #: counting left for later (see :meth:`defer`), run by :meth:`settle`
    pending: list[Callable[[], None]] = field(default_factory=list)

    def add_split(self, name: str, per_rank: list[int]) -> None:
        cur = getattr(self, name)
        setattr(self, name, [a + b for a, b in zip(cur, per_rank)] if cur else list(per_rank))

    def defer(self, count: Callable[[], None]) -> None:
        """Count later: ``count()`` reads device tensors back, which would make the host wait
        for the GPU inside a timed phase."""
        self.pending.append(count)

    def settle(self) -> "CommStats":
        """Run the deferred counting (one host synchronisation); call before reading the counters."""
        pending, self.pending = self.pending, []
        for count in pending:
            count()
        return self


# --------------------------------------------------------------------------- helpers


def fp8_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, H] -> (q float8_e4m3fn [m, H], s float32 [m, G]), x ~ q * s per 1x128 group:
    the Triton kernel on CUDA, its pure-torch reference elsewhere (moetool.kernels.quant)."""
    from moetool.kernels import quant

    x = x.float().contiguous()
    if x.shape[0] == 0:
        return (torch.empty(0, x.shape[1], dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty(0, math.ceil(x.shape[1] / ACT_GROUP), dtype=torch.float32, device=x.device))
    fn = quant.fp8_act_quant if x.is_cuda else quant.fp8_act_quant_ref
    q, s = fn(x, ACT_GROUP)
    return q, s.float()


@dataclass(frozen=True)
class RowLayout:
    """Several 2-D parts side by side in one uint8 row, so one collective carries tokens,
    scales, ids and weights together (gloo cannot send float8 either). Each part starts at a
    16-byte boundary, so reading a part back is a strided view of the received buffer, not a copy."""

    parts: tuple[tuple[torch.dtype, int], ...]  # (dtype, columns) of each part

    ALIGN: ClassVar[int] = 16

    @property
    def offsets(self) -> list[int]:
        out, off = [], 0
        for dtype, cols in self.parts:
            out.append(off)
            off += -(-cols * dtype.itemsize // self.ALIGN) * self.ALIGN
        return out + [off]

    @property
    def row_bytes(self) -> int:
        return self.offsets[-1]

    def pack(self, values: list[torch.Tensor]) -> torch.Tensor:
        """values[i] [n, cols_i] (any dtype castable to part i's) -> uint8 [n, row_bytes]."""
        n = values[0].shape[0]
        buf = torch.empty(n, self.row_bytes, dtype=torch.uint8, device=values[0].device)
        for view, v in zip(self.unpack(buf), values):
            view.copy_(v)
        return buf

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """uint8 [n, row_bytes] -> one strided view [n, cols_i] per part (dtype_i)."""
        offs = self.offsets
        return [buf[:, offs[i]:offs[i] + cols * dtype.itemsize].view(dtype)
                for i, (dtype, cols) in enumerate(self.parts)]


def _payload(x: torch.Tensor, act_quant: bool, comm_dtype: torch.dtype) -> tuple[list[torch.Tensor], list]:
    """x [m, H] -> the parts to send (hidden, [scales]) and their (dtype, columns)."""
    if act_quant:
        q, s = fp8_act_quant(x.float())  # [m, H], [m, G]
        return [q, s], [(torch.float8_e4m3fn, q.shape[1]), (torch.float32, s.shape[1])]
    return [x], [(comm_dtype, x.shape[1])]


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


def _kernel_or_ref(module: str, name: str, like: torch.Tensor):
    """``moetool.kernels.<module>.<name>`` for CUDA tensors and under the Triton interpreter
    (TRITON_INTERPRET=1, how the tests run them on CPU), else its torch reference ``<name>_ref``
    (same arguments, same results)."""
    import importlib

    from moetool.kernels.common import is_interpreted

    mod = importlib.import_module(f"moetool.kernels.{module}")
    kernel = getattr(mod, name)
    if like.is_cuda or is_interpreted(getattr(mod, f"_{name}_kernel")):
        return kernel
    return getattr(mod, f"{name}_ref")


def _combine(rows: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [P, H], pos [m, R] -> sum of each token's rows in rank order (moetool.kernels.ep_combine)."""
    return _kernel_or_ref("ep_combine", "combine_rows", rows)(rows, pos, out)


def _row_split(t: int, parts: int) -> list[int]:
    """torch.tensor_split sizes: the first t % parts parts get one row more."""
    return [t // parts + (1 if i < t % parts else 0) for i in range(parts)]


# --------------------------------------------------------------------------- mapped memory


class PeerMemory:
    """One byte buffer on every rank of the world that every rank maps, so kernels store
    straight into another rank's copy. Collective to create; :meth:`barrier` is the point after
    which every rank's stores before it are visible to all.

    ``cuda``: torch symmetric memory (NVLink / P2P between the GPUs of one host).
    ``shm``: one shared-memory file per rank, each mapped by all (CPU ranks of one host: how
    the tests run the mapped transport with gloo)."""

    ALIGN: ClassVar[int] = 256

    def __init__(self, nbytes: int, device: torch.device, timeout_s: float = 300.0):
        self.nbytes = nbytes
        self.device = device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout_ms = int(timeout_s * 1000)
        if device.type == "cuda":
            import torch.distributed._symmetric_memory as symm_mem

            group_name = dist.group.WORLD.group_name
            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(group_name):
                with warnings.catch_warnings():  # needed before torch 2.9, deprecated since
                    warnings.simplefilter("ignore")
                    enable(group_name)
            try:
                self._local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
                self._handle = symm_mem.rendezvous(self._local, group_name)
            except Exception as e:  # noqa: BLE001 - any reason: say what to use instead
                raise MoetoolError(f"rank {self.rank}: --transport mapped needs CUDA symmetric memory between "
                                   f"the GPUs ({type(e).__name__}: {e}); use --transport collectives") from e
            self._maps = None
        elif device.type == "cpu":
            self._handle = None
            self._maps = self._map_shared_files(nbytes)
        else:
            raise MoetoolError(f"mapped transport: no peer memory on {device}")

    def _map_shared_files(self, nbytes: int) -> list[torch.Tensor]:
        import tempfile

        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        tag = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(tag, src=0)  # one name for this buffer on every rank
        names = [os.path.join(folder, f"moetool-peer-{int(tag)}-{r}") for r in range(self.world)]
        mine, created = names[self.rank], False
        try:
            fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
            try:  # allocate now: a sparse file on a full tmpfs would SIGBUS at the first store
                os.posix_fallocate(fd, 0, max(nbytes, 1))
            finally:
                os.close(fd)
            dist.barrier()
            maps = [torch.from_file(n, shared=True, size=max(nbytes, 1), dtype=torch.uint8) for n in names]
            dist.barrier()  # every rank mapped every file: the names can go
        except OSError as e:
            raise MoetoolError(f"rank {self.rank}: --transport mapped: cannot map {nbytes} bytes of shared memory "
                               f"in {folder} ({e.strerror or e}); use --transport collectives") from e
        finally:
            if created:
                os.unlink(mine)
        return maps

    def view(self, rank: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s copy of bytes [offset, offset + numel * itemsize) as ``shape`` ``dtype``."""
        numel = math.prod(shape)
        if offset % dtype.itemsize or offset + numel * dtype.itemsize > self.nbytes:
            raise MoetoolError(f"peer memory view at byte {offset} of {shape} {dtype} is outside {self.nbytes} bytes")
        if self._handle is not None:
            return self._handle.get_buffer(rank, tuple(shape), dtype, offset // dtype.itemsize)
        return self._maps[rank][offset:offset + numel * dtype.itemsize].view(dtype).view(shape)

    def peers(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> PeerBuffers:
        return PeerBuffers([self.view(r, offset, shape, dtype) for r in range(self.world)], self.device)

    def barrier(self, channel: int = 0) -> None:
        """Every rank's stores (in stream order before this) are visible to every rank after it."""
        if self._handle is not None:
            self._handle.barrier(channel=channel, timeout_ms=self.timeout_ms)
        else:
            dist.barrier()


@dataclass
class MappedBuffers:
    """The mapped all2all transport's buffers for chunks of up to ``cap`` rows per rank:
    rows [R * cap, B] uint8 (region s: the rows rank s sent), counts int64 [R] (rows rank s
    sent), results [R * cap, H] wire dtype (this rank's expert output; region s: the results
    of the rows rank s sent, which rank s reads),
    gathered [tp * cap, H] wire dtype (the tp group's combined rows, part i at row i * width)."""

    key: tuple  # (cap, B, H, wire dtype)
    memory: PeerMemory
    rows: PeerBuffers
    counts: PeerBuffers
    results: PeerBuffers
    gathered: PeerBuffers  # only this rank's tp group

    @classmethod
    def create(cls, topo: Topology, cap: int, B: int, H: int, wire: torch.dtype,
               memory: PeerMemory | None = None) -> "MappedBuffers":
        """Collective when it allocates (every rank, same arguments); reuses ``memory`` when it is large enough."""
        R, a = topo.world_size, PeerMemory.ALIGN
        sizes = [R * cap * B, R * 8, R * cap * H * wire.itemsize, topo.tp * cap * H * wire.itemsize]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + -(-n // a) * a)
        if memory is None or memory.nbytes < offsets[-1]:
            memory = PeerMemory(offsets[-1], topo.device)
        gathered = [memory.view(r, offsets[3], (topo.tp * cap, H), wire) for r in topo.tp_ranks]
        return cls((cap, B, H, wire), memory, memory.peers(offsets[0], (R * cap, B), torch.uint8),
                   memory.peers(offsets[1], (R,), torch.int64),
                   memory.peers(offsets[2], (R * cap, H), wire), PeerBuffers(gathered, topo.device))


class GraphCache:
    """CUDA graphs of a function with no host synchronisation, one per set of argument
    addresses and shapes. Arguments listed in ``staged`` are copied into buffers of the graph
    before each replay (small per-call tensors whose addresses change); the others are read
    where they lie, so their addresses are part of the key. The first call of a new key runs
    eagerly (which also compiles the Triton kernels) and captures; later calls replay.
    Replays overwrite the outputs of the previous one, so a caller must be done with them
    first (the dispatcher is: the chunk before has been combined). If keys keep changing (more
    captures than ``max_graphs`` and fewer replays than half of them), or a capture fails,
    it stops and the caller runs eagerly."""

    def __init__(self, staged: tuple[int, ...] = (), max_graphs: int = 8):
        self.enabled = True
        self.staged = staged
        self.max_graphs = max_graphs
        self.captures = 0
        self.replays = 0
        self._graphs: dict = {}  # insertion order = age
        self._stream: torch.cuda.Stream | None = None  # where captures run

    def _key(self, args) -> tuple:
        def one(a, staged=False):
            if isinstance(a, torch.Tensor):
                return (None if staged else a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
            if isinstance(a, RouteTable):
                return tuple(one(v) for v in (a.rank, a.slot, a.count))
            if isinstance(a, MappedBuffers):  # kept by the dispatcher, which clears the cache when it grows
                return id(a)
            return a  # ints, bools, RowLayout (frozen, compared by value)
        return tuple(one(a, i in self.staged) for i, a in enumerate(args))

    def run(self, fn, args):
        """fn(*args)'s outputs from a replay, or None when the caller should run fn itself
        (a new key: this call captures for the next one)."""
        if not self.enabled:
            return None
        key = self._key(args)
        hit = self._graphs.get(key)
        if hit is not None:
            graph, buffers, out = hit
            if buffers:  # one call for all of them: each separate copy costs ~10 us of host time
                torch._foreach_copy_(buffers, [args[i] for i in self.staged])
            graph.replay()
            self.replays += 1
            return out
        if self.captures >= self.max_graphs and self.captures > 2 * self.replays:
            self.enabled = False  # keys change nearly every call: capturing would only cost
            self._graphs.clear()
            return None
        if len(self._graphs) >= self.max_graphs:
            del self._graphs[next(iter(self._graphs))]
        out = fn(*args)  # eager: compiles what needs compiling, and is this call's result
        buffers = [args[i].clone() for i in self.staged]
        graph_args = list(args)
        for i, buf in zip(self.staged, buffers):
            graph_args[i] = buf
        # capture on a side stream, without torch.cuda.graph's empty_cache (which would hand the
        # next call's tensors new addresses, and so a new key, every time)
        side = self._stream = self._stream or torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    captured = fn(*graph_args)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
        except Exception as e:  # noqa: BLE001 - any capture problem: run eagerly from now on
            warnings.warn(f"CUDA graph capture of the dispatch failed, running it eagerly: {e}")
            self.enabled = False
            return out
        self.captures += 1
        self._graphs[key] = (graph, buffers, captured)
        return out

    def clear(self) -> None:
        """Forget every graph (their buffers are being replaced)."""
        self._graphs.clear()


# --------------------------------------------------------------------------- dispatchers


class Dispatcher:
    """Prepare (quantize + dispatch) and finalize (combine) for one communication backend."""

    name: ClassVar[str]

    def __init__(self, topo: Topology, quantize_activations: bool | None = None,
                 comm_dtype: torch.dtype = torch.float32):
        """``quantize_activations``: None = when the format allows (fp8-block), False = never.
        ``comm_dtype``: dtype of unquantized token rows on the wire. Expert outputs travel back
        in float32 (allgather), or in ``comm_dtype`` when that is bfloat16 or float32 and in
        float32 otherwise (all2all)."""
        self.topo = topo
        self.quantize_activations = quantize_activations
        self.comm_dtype = comm_dtype
        self._tables: dict[int, tuple[ExpertPlacement, RouteTable]] = {}

    def route_table(self, placement: ExpertPlacement) -> RouteTable:
        """The placement's RouteTable on this rank's device, built once per placement object
        (the same tensors at every call, so captured graphs can read them in place)."""
        cached = self._tables.get(id(placement))
        if cached is None or cached[0] is not placement:
            cached = self._tables[id(placement)] = (placement, RouteTable.build(placement, self.topo.device))
        return cached[1]

    def act_quant_for(self, fmt_name: str) -> bool:
        if self.quantize_activations is False:
            return False
        if self.quantize_activations and fmt_name not in ACT_QUANT_FORMATS:
            raise MoetoolError(f"activation quantization is defined for {ACT_QUANT_FORMATS}, not {fmt_name}")
        return fmt_name in ACT_QUANT_FORMATS

    def token_slice(self, t: int) -> slice:
        """Rows of this group's chunk of t tokens that this rank routes and sends."""
        raise NotImplementedError

    def prepare(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                token_index: torch.Tensor, chunk: ChunkInfo, table: RouteTable, num_slots: int,
                act_quant: bool, stats: CommStats) -> Prepared:
        """x [m, H] float32, topk_ids int64 [m, k] (global), topk_weights float32 [m, k],
        token_index int64 [m] (global positions) for the rows ``token_slice`` chose."""
        raise NotImplementedError

    def finalize(self, expert_out: torch.Tensor, prep: Prepared, reduced: bool,
                 stats: CommStats) -> torch.Tensor:
        """Expert output ([M, H] if ``reduced`` else [M, k, H]) -> this group's chunk [t, H]
        (float32, or the wire dtype where the last step was a collective), every expert's
        weighted contribution summed, replicated on the tp group."""
        raise NotImplementedError


class AllGatherDispatcher(Dispatcher):
    """Naive DP/EP (vLLM naive all2all): all-gather every group's chunk over the dp subgroup,
    run the local experts on all of it (weights applied on the expert side), reduce-scatter
    the sums back over the dp subgroup, then all-reduce over the tp group, whose ranks hold
    different experts of the same tokens."""

    name = "allgather"

    def token_slice(self, t: int) -> slice:
        return slice(0, t)

    def prepare(self, x, topk_ids, topk_weights, token_index, chunk, table, num_slots, act_quant, stats):
        topo = self.topo
        dev = x.device
        t, k = topk_ids.shape
        sizes = chunk.sizes  # [dp]
        tmax = max(sizes)
        parts, like = _payload(x, act_quant, self.comm_dtype)
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
        return Prepared(unpacked[0], unpacked[1] if act_quant else None, local_ids, weights, counts,
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
    holding one of its experts: counts first (the one host synchronisation), then one packed
    payload per token: row, [fp8 scales], global expert ids, weights, global position (the
    receiver picks the ids it holds with the same replica rule). The combine returns one row
    per (token, destination) in the wire dtype with the top-k weights already applied on the
    expert side; the source sums them in rank order (``moetool.kernels.ep_combine``) straight
    into the buffer of an all-gather in the tp group, which restores the replicated [t, H] chunk."""

    name = "all2all"
    TRANSPORTS: ClassVar[tuple[str, ...]] = ("collectives", "mapped")

    def __init__(self, topo: Topology, quantize_activations: bool | None = None,
                 comm_dtype: torch.dtype = torch.float32, transport: str = "collectives"):
        """``transport``: "collectives" = a count exchange, the host reads the counts, then
        ``all_to_all_single`` of exactly the rows (any backend, any number of hosts);
        "mapped" = ranks of one host store rows and counts straight into each other's mapped
        buffers and read their tokens' results straight from them (CUDA symmetric memory over
        NVLink; shared memory between CPU ranks), with a barrier where the collectives were and
        no host synchronisation (DeepEP's intranode idea)."""
        super().__init__(topo, quantize_activations, comm_dtype)
        if transport not in self.TRANSPORTS:
            raise MoetoolError(f"unknown all2all transport {transport!r} (known: {', '.join(self.TRANSPORTS)})")
        self.transport = transport
        self._mapped: MappedBuffers | None = None
        self._layouts: dict[tuple, RowLayout] = {}  # per (H, k, act_quant): built once, the same object for the graph key
        # prepare's topk ids, weights and token positions are new tensors every call: staged
        self._graphs, self._combine_graphs = GraphCache(staged=(1, 2, 3)), GraphCache()

    def token_slice(self, t: int) -> slice:
        split = _row_split(t, self.topo.tp)
        start = sum(split[:self.topo.tp_index])
        return slice(start, start + split[self.topo.tp_index])

    @property
    def _wire(self) -> torch.dtype:
        """dtype of the expert results on the way back"""
        return self.comm_dtype if self.comm_dtype in (torch.float32, torch.bfloat16) else torch.float32

    def prepare(self, x, topk_ids, topk_weights, token_index, chunk, table, num_slots, act_quant, stats):
        if self.transport == "mapped":
            return self._prepare_mapped(x, topk_ids, topk_weights, token_index, chunk, table, num_slots,
                                        act_quant, stats)
        topo = self.topo
        R, me = topo.world_size, topo.rank
        k = topk_ids.shape[1]
        route_tokens, pack_rows, local_slots = (_kernel_or_ref("ep_dispatch", name, x)
                                                for name in ("route_tokens", "pack_rows", "local_slots"))
        counts_buf = torch.empty(2, R, dtype=torch.int64, device=x.device)  # [sent to, received from] per rank
        send_counts, recv_counts = counts_buf.unbind(0)
        order = route_tokens(topk_ids, token_index, table.rank, table.count, send_counts)  # [R, m]
        counts_sent = dist.all_to_all_single(recv_counts, send_counts, async_op=True)  # counts first
        # While the counts travel, the GPU fills the send rows: their places need only this
        # rank's own counts, and the buffer is sized for the worst case (every token to
        # min(k, R) ranks), so nothing here waits for the host.
        layout = self._row_layout(x.shape[1], k, act_quant)
        send = torch.empty(x.shape[0] * min(k, R), layout.row_bytes, dtype=torch.uint8, device=x.device)
        pos = pack_rows(x, topk_ids, topk_weights, token_index, order, send_counts, send,
                        *self._pack_format(layout, act_quant), ACT_GROUP)  # [R, m] send row of (r, t) or -1
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
        scale = rest[0] if act_quant else None
        local_ids, expert_counts = local_slots(rest[-3], rest[-1][:, 0], table.rank, table.slot, table.count,
                                               me, num_slots)  # [M, k], [L]
        return Prepared(hidden, scale, local_ids, rest[-2].contiguous(), expert_counts,
                        {"pos": pos, "send": send_l, "recv": recv_l, "t": chunk.sizes[topo.group_index]},
                        out_dtype=self._wire)

    def _prepare_mapped(self, x, topk_ids, topk_weights, token_index, chunk, table, num_slots, act_quant, stats):
        """Every rank's receive buffer has one region of ``cap`` rows per source rank (cap: the
        most tokens any rank routes in this chunk, known everywhere), so a row's place there
        needs only the sender's own order: route, pack into the peers' buffers, barrier.

        Nothing here waits for the host, so on CUDA the launches are captured once per set of
        input addresses as a CUDA graph and replayed (one launch instead of a dozen)."""
        topo = self.topo
        layout = self._row_layout(x.shape[1], topk_ids.shape[1], act_quant)
        cap = max(max(_row_split(n, topo.tp)) for n in chunk.sizes)
        bufs = self._mapped_buffers(max(cap, 1), layout.row_bytes, x.shape[1])
        args = (x, topk_ids, topk_weights, token_index, table, num_slots, act_quant, layout, bufs)
        out = self._graphs.run(self._mapped_dispatch, args) if x.is_cuda else None
        if out is None:
            out = self._mapped_dispatch(*args)
        pos, counts, hidden, scale, local_ids, weights, expert_counts = out
        return Prepared(hidden, scale, local_ids, weights, expert_counts,
                        {"pos": pos, "counts": counts, "t": chunk.sizes[topo.group_index]},
                        out_dtype=self._wire, out_buffer=bufs.results.views[topo.rank])

    def _mapped_dispatch(self, x, topk_ids, topk_weights, token_index, table, num_slots, act_quant, layout, bufs):
        """The device work of the mapped prepare (no host synchronisation: capturable)."""
        topo = self.topo
        R, me = topo.world_size, topo.rank
        route_tokens, pack_rows, local_slots = (_kernel_or_ref("ep_dispatch", name, x)
                                                for name in ("route_tokens", "pack_rows", "local_slots"))
        counts = torch.empty(2, R, dtype=torch.int64, device=x.device)  # [sent to, received from] per rank
        send_counts = counts[0]
        order = route_tokens(topk_ids, token_index, table.rank, table.count, send_counts, bufs.counts, me)  # [R, m]
        pos = pack_rows(x, topk_ids, topk_weights, token_index, order, send_counts, bufs.rows,
                        *self._pack_format(layout, act_quant), ACT_GROUP, me)  # [R, m]: r * cap + order, or -1
        bufs.memory.barrier(0)  # every rank's rows and counts have arrived
        recv_counts = bufs.counts.views[me]  # [R] rows from each source, first in its region
        hidden, *rest = layout.unpack(bufs.rows.views[me])  # [R * cap, ...] views
        local_ids, expert_counts = local_slots(rest[-3], rest[-1][:, 0], table.rank, table.slot, table.count,
                                               me, num_slots, recv_counts)
        counts[1].copy_(recv_counts)  # kept for the statistics: the next chunk's counts overwrite the buffer
        return pos, counts, hidden, rest[0] if act_quant else None, local_ids, rest[-2].contiguous(), expert_counts

    def _mapped_buffers(self, cap: int, B: int, H: int) -> MappedBuffers:
        """The buffers for this chunk's sizes; collective when they have to grow (every rank
        derives the same sizes from the chunk)."""
        cur = self._mapped
        if cur is not None and cur.key[0] >= cap and cur.key[1:] == (B, H, self._wire):
            return cur
        cap = max(cap, cur.key[0] if cur is not None else 0)
        self._graphs.clear()  # they store into the old buffers
        self._combine_graphs.clear()
        self._mapped = MappedBuffers.create(self.topo, cap, B, H, self._wire, None if cur is None else cur.memory)
        return self._mapped

    def _mapped_combine(self, pos: torch.Tensor, width: int, bufs: MappedBuffers) -> torch.Tensor:
        """The device work of the mapped finalize (capturable): every rank's experts have
        written their results buffer (barrier), then each token's rows are read from the ranks
        that computed them and summed in rank order; with tp > 1 the sums go straight into every
        tp rank's gather buffer ([tp * width, H], which the result aliases until the next chunk:
        run_moe_layer copies it out at once). A rank's results buffer is next written after the
        next chunk's dispatch barrier, which every rank reaches only after this read."""
        topo, me = self.topo, self.topo.rank
        combine = _kernel_or_ref("ep_combine", "combine_from_peers", bufs.results.views[me])
        bufs.memory.barrier(1)
        if topo.tp == 1:
            return combine(bufs.results, pos.t(), me)  # [m, H] fp32
        combine(bufs.results, pos.t(), me, peers=bufs.gathered, row0=topo.tp_index * width)
        bufs.memory.barrier(2)
        return bufs.gathered.views[topo.tp_index][:topo.tp * width]

    def _dispatch_stats(self, stats: CommStats, send_l: list[int], recv_l: list[int], B: int) -> None:
        """Dispatch counters of one chunk: rows of B bytes sent to / received from each rank,
        plus the 8-byte counts to every other rank."""
        R, me = self.topo.world_size, self.topo.rank
        stats.dispatch_bytes_sent += (sum(send_l) - send_l[me]) * B + 8 * (R - 1)
        stats.add_split("dispatch_split_bytes", [n * B for n in send_l])
        stats.dispatch_bytes_recv += (sum(recv_l) - recv_l[me]) * B + 8 * (R - 1)
        stats.tokens_received += sum(recv_l)

    def _count_mapped(self, stats: CommStats, counts: torch.Tensor, B: int, row_bytes: int, gather_bytes: int) -> None:
        """Both counters of one mapped chunk, from its [2, R] device counts (sent to, received from)."""
        send_l, recv_l = counts.tolist()
        self._dispatch_stats(stats, send_l, recv_l, B)
        self._combine_stats(stats, send_l, recv_l, row_bytes, gather_bytes)

    def _combine_stats(self, stats: CommStats, send_l: list[int], recv_l: list[int], row_bytes: int,
                       gather_bytes: int) -> None:
        """Combine counters of one chunk: result rows back, plus the tp all-gather's parts."""
        topo, me = self.topo, self.topo.rank
        stats.combine_bytes_sent += (sum(recv_l) - recv_l[me]) * row_bytes + (topo.tp - 1) * gather_bytes
        stats.combine_bytes_recv += (sum(send_l) - send_l[me]) * row_bytes + (topo.tp - 1) * gather_bytes
        stats.add_split("combine_split_bytes", [n * row_bytes + (gather_bytes if r in topo.tp_ranks and r != me else 0)
                                                for r, n in enumerate(recv_l)])

    def _counts_stream(self, device: torch.device):
        """Context for reading the counts back: a side stream of this dispatcher on CUDA."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        if getattr(self, "_side_stream", None) is None:
            self._side_stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self._side_stream)

    def _pack_format(self, layout: RowLayout, act_quant: bool) -> tuple[torch.dtype, tuple]:
        """pack_rows' hidden dtype and byte offsets (scale, ids, weights, token) for ``layout``."""
        hidden_dtype = torch.float8_e4m3fn if act_quant else self.comm_dtype
        return hidden_dtype, tuple(([layout.offsets[1]] if act_quant else [None]) + layout.offsets[-4:-1])

    def _row_layout(self, H: int, k: int, act_quant: bool) -> RowLayout:
        """payload (fp8 codes + fp32 scales, or the wire dtype), int32 ids, fp32 weights, int64 position."""
        key = (H, k, act_quant)
        layout = self._layouts.get(key)
        if layout is None:
            payload = (((torch.float8_e4m3fn, H), (torch.float32, math.ceil(H / ACT_GROUP))) if act_quant
                       else ((self.comm_dtype, H),))
            layout = self._layouts[key] = RowLayout(payload + ((torch.int32, k), (torch.float32, k), (torch.int64, 1)))
        return layout

    def finalize(self, expert_out, prep, reduced, stats):
        topo = self.topo
        st = prep.state
        out = expert_out if reduced else weight_and_reduce(expert_out, prep.local_ids, prep.topk_weights)
        # partial sums travel back in the wire dtype (bf16 as in serving, fp32 when exactness is
        # tested); experts that reduce already wrote them in it (prep.out_dtype)
        out = out.to(prep.out_dtype).contiguous()  # [M, H]
        H, nb = out.shape[1], out.element_size()
        split = _row_split(st["t"], topo.tp)
        width = max(split)
        gather_bytes = width * H * nb if topo.tp > 1 else 0  # each tp rank's part of the all-gather
        if self.transport == "mapped":
            # the other ranks read the results where they lie: in the mapped results buffer
            if out.data_ptr() != prep.out_buffer.data_ptr():
                prep.out_buffer.copy_(out)  # experts that did not write into it
            args = (st["pos"], width, self._mapped)
            full = self._combine_graphs.run(self._mapped_combine, args) if out.is_cuda else None
            if full is None:
                full = self._mapped_combine(*args)
            # the row counts stay on the device until the counters are read (CommStats.settle), so
            # nothing here waits for the GPU; the graph's counts buffer is reused by the next replay
            counts = st["counts"].clone() if out.is_cuda else st["counts"]
            stats.defer(functools.partial(self._count_mapped, stats, counts, self._mapped.rows.views[0].shape[1],
                                          H * nb, gather_bytes))
        else:
            back = out.new_empty(sum(st["send"]), H)  # [P, H]
            dist.all_to_all_single(back, out, output_split_sizes=st["send"], input_split_sizes=st["recv"])
            pos = st["pos"].t()  # [m, R]
            if topo.tp == 1:
                full = _combine(back, pos)  # [m, H] fp32, summed over destinations in rank order
            else:
                part = back.new_empty(width, H)  # the tp all-gather's input, written in place
                _combine(back, pos, out=part[:pos.shape[0]])
                if pos.shape[0] < width:
                    part[pos.shape[0]:].zero_()
                full = part.new_empty(topo.tp * width, H)
                all_gather_tensor(full, part, group=topo.tp_group)
            self._combine_stats(stats, st["send"], st["recv"], H * nb, gather_bytes)
        if topo.tp == 1 or width * topo.tp == st["t"]:
            return full  # [t, H]
        return torch.cat([full[i * width:i * width + split[i]] for i in range(topo.tp)])  # [t, H]


DISPATCHERS: dict[str, type[Dispatcher]] = {"allgather": AllGatherDispatcher, "all2all": All2AllDispatcher}


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


def get_dispatcher(name: str, topo: Topology, **kwargs) -> Dispatcher:
    """A dispatcher by CLI name: "allgather" or "all2all"."""
    if name not in DISPATCHERS:
        raise MoetoolError(f"unknown dispatch backend {name!r} (known: {', '.join(DISPATCHERS)})")
    return DISPATCHERS[name](topo, **kwargs)


def num_chunks(tokens: int, chunk_size: int) -> int:
    return math.ceil(tokens / chunk_size) if tokens else 0
