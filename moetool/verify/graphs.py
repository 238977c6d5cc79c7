"""CUDA graphs of a function that never waits for the host, captured once per set of argument
addresses and replayed: the mapped transport's dispatch and combine (a dozen launches become one)."""
from __future__ import annotations

import warnings

import torch

from moetool.verify.peer_memory import MappedBuffers
from moetool.verify.topology import RouteTable


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
            if isinstance(a, MappedBuffers):  # kept by the transport, which clears the cache when they grow
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
