"""Where a rank stands: the dp x tp grid, its process groups, and where each expert lives.

World size R = ep ranks, ``dp`` data-parallel groups of ``tp = R // dp`` ranks: group g =
ranks [g*tp, (g+1)*tp) holds the same tokens (replicated); experts are placed over all R
ranks. The "dp subgroup" of tp-index i = ranks {g*tp + i : g < dp}.

Replicas. A token with global index t (position in the concatenation of all groups' tokens)
that chose expert e goes to ``replicas[e][t % len(replicas[e])]``, so every replica is
exercised, identically in both dispatchers.

Letters: E = experts, W = most replicas of one expert, m = tokens this rank routes, k = top-k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moetool.errors import MoetoolError
from moetool.model.spec import ExpertPlacement, LocalExperts

# torch 2.13 renamed the tensor collectives; the old names warn on every call
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def row_split(t: int, parts: int) -> list[int]:
    """torch.tensor_split sizes: the first t % parts parts get one row more."""
    return [t // parts + (1 if i < t % parts else 0) for i in range(parts)]


@dataclass
class RouteTable:
    """Global expert -> replicas as tensors; picks each (token, k)'s destination."""

    rank: torch.Tensor  # int64 [E, W], -1 padded
    slot: torch.Tensor  # int64 [E, W]
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
