"""Tiny MoE layers and the rank functions the verify tests spawn (module level: spawn
pickles them by name). Letters: T = tokens, H = hidden, N = intermediate, E = experts."""
from __future__ import annotations

import errno
import os
import time

import torch

from moetool.errors import MoetoolError
from moetool.formats import get_format
from moetool.model.spec import ExpertPlacement, LocalExperts, RouterSpec
from moetool.verify.dispatchers import get_dispatcher
from moetool.verify.experts import ExpertsBackend, TorchExperts, TritonExperts
from moetool.verify.layer import run_moe_layer
from moetool.verify.numerics import numerics_for
from moetool.verify.peer_memory import PeerMemory
from moetool.verify.topology import Topology
from moetool.verify.transports import choose_transport

try:  # the ranks' interpreted kernels launch as cheaply as the test process's (tests/conftest.py)
    import interpreter_speed
except ImportError:  # tests/ not on this rank's path
    pass
else:
    interpreter_speed.install()

#: H > 128 and not a multiple of it: two fp8 activation groups, the second partial
H, N = 136, 32

#: router families: name -> (spec, experts E)
ROUTERS = {
    "softmax": (RouterSpec(top_k=2), 8),  # Mixtral / Qwen-MoE
    "softmax-noren": (RouterSpec(top_k=3, renormalize=False), 7),  # DeepSeek-V2 without groups
    "v2-grouped": (RouterSpec(top_k=3, n_group=4, topk_group=2, group_score="max", renormalize=False,
                              routed_scaling_factor=1.5), 8),
    "v3-grouped": (RouterSpec(top_k=3, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2-sum",
                              routed_scaling_factor=2.5, has_correction_bias=True), 8),
    "llama4": (RouterSpec(top_k=1, scoring="sigmoid", renormalize=False, apply_weight_on_input=True), 7),
}


def make_layer(router: str, seed: int = 0, shared: bool = False, shared_gate: bool = False) -> dict:
    """A random fp32 MoE layer with E experts: gate, bias, spec, experts [(g, u, d)], shared."""
    spec, E = ROUTERS[router]
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, H, generator=gen)
    bias = torch.randn(E, generator=gen) * 0.1 if spec.has_correction_bias else None
    experts = [(torch.randn(N, H, generator=gen) / H ** 0.5, torch.randn(N, H, generator=gen) / H ** 0.5,
                torch.randn(H, N, generator=gen) / N ** 0.5) for _ in range(E)]
    sh = None
    if shared:
        sh = (torch.randn(2 * N, H, generator=gen) / H ** 0.5, torch.randn(2 * N, H, generator=gen) / H ** 0.5,
              torch.randn(H, 2 * N, generator=gen) / N ** 0.5,
              torch.randn(1, H, generator=gen) if shared_gate else None)
    return {"gate": gate, "bias": bias, "spec": spec, "experts": experts, "shared": sh}


def make_tokens(total: int, seed: int = 1, integer: bool = False) -> torch.Tensor:
    """[T, H]: random rows whose column 0 is the token's global position (a token that
    comes back to the wrong place shows up as the wrong position). ``integer``: small
    integers only (DeepEP style), so sums of power-of-two multiples are exact in any order."""
    gen = torch.Generator().manual_seed(seed)
    if integer:
        x = torch.randint(-4, 5, (total, H), generator=gen).float()
        x[:, 0] = torch.arange(total, dtype=torch.float32) + 1
        return x
    x = torch.randn(total, H, generator=gen)
    x[:, 0] = torch.arange(total, dtype=torch.float32) / total
    return x


class ProbeExperts(ExpertsBackend):
    """Expert e multiplies its token by 2**e and ignores the top-k weights: with integer
    tokens every output is exact, so dispatch + combine must match bit for bit."""

    name = "probe"

    @property
    def applies_weights_and_reduces(self) -> bool:
        return True

    def bind(self, local, device):
        self.codes = 2.0 ** torch.tensor(local.slot_to_global, dtype=torch.float32, device=device)

    def apply(self, hidden, hidden_scale, local_ids, topk_weights, expert_num_tokens, out_dtype=torch.float32,
              out=None):  # out ignored: finalize copies into its buffer itself (that path is tested too)
        x = hidden.float()
        out = torch.zeros_like(x)
        for j in range(local_ids.shape[1]):
            ids = local_ids[:, j]
            code = torch.where(ids >= 0, self.codes[ids.clamp(min=0)], torch.zeros_like(x[:, 0]))
            out += x * code[:, None]
        return out.to(out_dtype)


def probe_reference(x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """What ProbeExperts + any correct dispatcher must return: x * sum_j 2**topk_ids[:, j]."""
    return x * (2.0 ** topk_ids.float()).sum(dim=1, keepdim=True)


def linear_placement(E: int, R: int, extra: dict[int, list[int]] | None = None) -> ExpertPlacement:
    """vLLM linear placement (remainder on the last rank) plus redundant replicas
    ``extra[e] = [ranks]`` appended as new slots."""
    replicas: dict[int, list[tuple[int, int]]] = {}
    nslots = [0] * R
    per = E // R
    for e in range(E):
        r = min(e // per, R - 1)
        replicas[e] = [(r, nslots[r])]
        nslots[r] += 1
    for e, ranks in (extra or {}).items():
        for r in ranks:
            replicas[e].append((r, nslots[r]))
            nslots[r] += 1
    return ExpertPlacement(num_experts=E, num_ranks=R, replicas=replicas)


def local_experts(layer: dict, placement: ExpertPlacement, rank: int, fmt_name: str = "dense",
                  dtype: torch.dtype = torch.float32, **fmt_params) -> LocalExperts:
    """Rank ``rank``'s experts in ``fmt_name``, stacked as a shard holds them."""
    fmt = get_format(fmt_name, **fmt_params)
    slots = placement.slots[rank]
    w13s, w2s = [], []
    for e in slots:
        g, u, d = layer["experts"][e]
        w13s.append(fmt.cat_rows([fmt.quantize(g, dtype), fmt.quantize(u, dtype)]))  # gate rows, then up
        w2s.append(fmt.quantize(d, dtype))

    def stack(ts):
        return {k: torch.stack([t[k] for t in ts]) for k in ts[0]} if ts else {}

    return LocalExperts(fmt=fmt, w13=stack(w13s), w2=stack(w2s), slot_to_global=list(slots),
                        intermediate=N, hidden=H)


def group_tokens(x: torch.Tensor, group_sizes: list[int], g: int) -> torch.Tensor:
    start = sum(group_sizes[:g])
    return x[start:start + group_sizes[g]]


def run_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Each case: dp, router, seed, shared, shared_gate, group_sizes [dp], placement extra,
    dispatcher, reduce (TorchExperts), numerics (served | exact, the default), chunk_size, fmt, swap (rank, slot a, slot b) to corrupt,
    timeout_s (all2all: the transport's own waits). Returns per case {"y": this rank's [T_g, H],
    "stats": ..., "peer_timeout_ms": the mapped transport's barrier timeout, or None}."""
    torch.manual_seed(0)
    topos: dict[int, Topology] = {}
    results = []
    for case in cases:
        dp = case["dp"]
        if dp not in topos:
            topos[dp] = Topology.create(dp)
        topo = topos[dp]
        layer = make_layer(case["router"], case.get("seed", 0), case.get("shared", False),
                           case.get("shared_gate", False))
        E = layer["gate"].shape[0]
        placement = linear_placement(E, world, case.get("extra"))
        local = local_experts(layer, placement, rank, case.get("fmt", "dense"), **case.get("fmt_params", {}))
        swap = case.get("swap")
        if swap and swap[0] == rank:  # a shard with two experts exchanged
            _, a, b = swap
            for t in (local.w13, local.w2):
                for v in t.values():
                    v[[a, b]] = v[[b, a]]
        scale = case.get("scale")
        if scale and scale[0] == rank:  # a wrong scale (dense: a wrong weight) in one expert
            key = local.fmt.suffixes[-1]
            local.w2[key][scale[1]] *= 2
        sizes = case["group_sizes"]
        x = group_tokens(make_tokens(sum(sizes), case.get("seed", 0) + 1, case.get("probe", False)),
                         sizes, topo.group_index)
        name, _, transport = case["dispatcher"].partition("-")  # "all2all-mapped": the mapped transport
        options = {"transport": transport} if transport else {}
        if "timeout_s" in case:
            options["timeout_s"] = case["timeout_s"]
        dispatcher = get_dispatcher(name, topo, comm_dtype=getattr(torch, case.get("comm_dtype", "float32")), **options)
        numerics = numerics_for(case.get("numerics", "exact"), local.fmt, torch.float32)
        if case.get("probe"):
            experts = ProbeExperts()
        elif case.get("experts") == "triton":
            experts = TritonExperts(numerics)
        else:
            experts = TorchExperts(reduce=case.get("reduce", True), numerics=numerics)
        ys = []
        for _ in range(case.get("repeat", 1)):  # the same dispatcher again: CUDA graph replays on GPUs
            y, stats = run_moe_layer(x, layer["gate"], layer["bias"], layer["spec"], local, placement,
                                     layer["shared"], dispatcher, experts, case.get("chunk_size", 4096))
            ys.append(y)
        graphs = getattr(getattr(dispatcher, "transport", None), "dispatch_graphs", None)  # mapped only
        buffers = getattr(getattr(dispatcher, "transport", None), "buffers", None)  # mapped only
        results.append({"y": y, "ys": ys, "stats": stats,
                        "graph_replays": graphs.replays if graphs is not None else 0,
                        "peer_timeout_ms": buffers.memory.timeout_ms if buffers is not None else None})
    return results


def preloaded(rank: int, world: int) -> dict:
    """What this rank found imported before it ran (the fork server's preloads, tests/conftest.py)
    and which implementation of the EP steps it picks for CPU tensors."""
    import sys

    from moetool.verify.transports import ROUTE_TOKENS

    cpu = torch.zeros(1)
    return {"rank_steps": "rank_steps" in sys.modules,
            "route_tokens": "reference" if ROUTE_TOKENS.pick(cpu) is ROUTE_TOKENS.ref else "kernel"}


def imported(rank: int, world: int, names: list[str]) -> list[str]:
    """Which of ``names`` this rank found imported before it ran (the fork server's preloads)."""
    import sys

    return [n for n in names if n in sys.modules]


def raise_on(rank: int, world: int, bad_rank: int) -> int:
    """Every rank enters a collective; ``bad_rank`` raises first."""
    if rank == bad_rank:
        raise ValueError(f"shard for rank {rank} is corrupt (test)")
    t = torch.ones(4)
    torch.distributed.all_reduce(t)
    return rank


def exit_on(rank: int, world: int, bad_rank: int) -> int:
    """``bad_rank`` dies without a word (as a segfault or the OOM killer would)."""
    if rank == bad_rank:
        os._exit(7)
    t = torch.ones(4)
    torch.distributed.all_reduce(t)
    return rank


def hang_on(rank: int, world: int, bad_rank: int) -> int:
    """``bad_rank`` never joins the collective; the others must time out, not hang."""
    if rank == bad_rank:
        time.sleep(600)
    t = torch.ones(4)
    torch.distributed.all_reduce(t)
    return rank


def shm_full(rank: int, world: int) -> tuple[str, list[str]]:
    """PeerMemory on CPU ranks when the shared-memory folder has no room: (the MoetoolError's
    text, the shared-memory files this rank created, all of which must be gone)."""
    created = []

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def recording_open(path, flags, *args):
        if flags & os.O_CREAT and "moetool-peer-" in str(path):
            created.append(str(path))
        return real_open(path, flags, *args)

    real_open, real_fallocate = os.open, os.posix_fallocate
    os.open, os.posix_fallocate = recording_open, no_space
    try:
        PeerMemory(1 << 20, torch.device("cpu"))
    except MoetoolError as e:
        return str(e), created
    finally:  # the world may run more checks after this one
        os.open, os.posix_fallocate = real_open, real_fallocate
    return "no error", created


def transports(rank: int, world: int) -> list[str]:
    """choose_transport on CPU ranks: auto, explicit mapped, and mapped with a rank not on this host."""
    cpu = torch.device("cpu")
    out = [choose_transport("auto", cpu), choose_transport("mapped", cpu), choose_transport("collectives", cpu)]
    local_world = os.environ["LOCAL_WORLD_SIZE"]
    if rank == 1:
        os.environ["LOCAL_WORLD_SIZE"] = "1"  # as torchrun on two hosts would set it
    try:
        out.append(choose_transport("mapped", cpu))
    except MoetoolError as e:
        out.append(str(e))
    finally:  # the world may run more checks after this one
        os.environ["LOCAL_WORLD_SIZE"] = local_world
    return out


#: checks a world can run after its cases (``run_world``), by name
CHECKS = {"transports": transports, "shm_full": shm_full}


def run_world(rank: int, world: int, cases: list[dict], checks: tuple[str, ...] = (),
              ep_steps: str = "kernels") -> dict:
    """``run_cases`` then each named check of CHECKS, in one world (one start-up for all):
    {"cases": run_cases' list, check name: its result}. ``ep_steps``: the dispatch and combine
    steps' Triton kernels (interpreted on CPU) or their pure-torch ``references`` (tests/rank_steps.py)."""
    import rank_steps

    rank_steps.use(ep_steps)
    out = {"cases": run_cases(rank, world, cases)}
    for name in checks:
        out[name] = CHECKS[name](rank, world)
    return out


def transports_cuda(rank: int, world: int) -> str:
    """choose_transport("auto") on NCCL ranks, one GPU each."""
    return choose_transport("auto", torch.device("cuda", torch.cuda.current_device()))
