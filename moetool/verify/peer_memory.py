"""Memory every rank of one host maps: one byte buffer per rank that the other ranks' kernels
store into (PeerMemory), and the mapped all2all transport's buffers carved out of it
(MappedBuffers).

Letters: R = ranks, cap = most rows one rank sends in a chunk, B = bytes of a token row,
H = hidden.
"""
from __future__ import annotations

import math
import os
import secrets
import tempfile
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from moetool.errors import MoetoolError
from moetool.kernels.common import PeerBuffers
from moetool.verify.topology import Topology


class PeerMemory:
    """One byte buffer on every rank of the world that every rank maps, so kernels store
    straight into another rank's copy. Collective to create; :meth:`barrier` is the point after
    which every rank's stores before it are visible to all (or a rank gives up after
    ``timeout_s``).

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
               memory: PeerMemory | None = None, *, timeout_s: float) -> "MappedBuffers":
        """Collective when it allocates (every rank, same arguments); reuses ``memory`` when it
        is large enough. ``timeout_s``: how long a barrier of new memory waits for the others."""
        R, a = topo.world_size, PeerMemory.ALIGN
        sizes = [R * cap * B, R * 8, R * cap * H * wire.itemsize, topo.tp * cap * H * wire.itemsize]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + -(-n // a) * a)
        if memory is None or memory.nbytes < offsets[-1]:
            memory = PeerMemory(offsets[-1], topo.device, timeout_s)
        gathered = [memory.view(r, offsets[3], (topo.tp * cap, H), wire) for r in topo.tp_ranks]
        return cls((cap, B, H, wire), memory, memory.peers(offsets[0], (R * cap, B), torch.uint8),
                   memory.peers(offsets[1], (R,), torch.int64),
                   memory.peers(offsets[2], (R * cap, H), wire), PeerBuffers(gathered, topo.device))
