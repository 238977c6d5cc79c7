"""What one chunk of tokens carries between the layer loop, the dispatcher, its transport and
the experts: the chunk's sizes (ChunkInfo), prepare's hand-off to the experts (Prepared), and
the communication counters of a layer (CommStats).

Letters: M = rows received, H = hidden, k = top-k, L = local slots, G = ceil(H/128),
R = ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of every dp group's tokens: ``sizes[g]`` rows starting at global token
    position ``starts[g]`` (chunks are cut identically on every rank)."""

    sizes: list[int]  # [dp]
    starts: list[int]  # [dp]


def num_chunks(tokens: int, chunk_size: int) -> int:
    return math.ceil(tokens / chunk_size) if tokens else 0


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
