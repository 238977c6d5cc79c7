"""Expert placement over EP ranks: linear (vLLM ``determine_expert_map``), round-robin, and
redundant replicas of the hottest experts (EPLB) from a load-statistics file."""
from __future__ import annotations

import json
import math
from pathlib import Path

from moetool.errors import JSON_ERRORS, MoetoolError
from moetool.model.spec import ExpertPlacement

PLACEMENTS = ("linear", "round-robin")


def check_ep(ep: int, num_experts: int) -> None:
    if ep < 1:
        raise MoetoolError(f"--ep {ep}: must be at least 1")
    if ep > num_experts:
        raise MoetoolError(f"--ep {ep}: more ranks than experts ({num_experts}); every rank needs an expert")


def linear_placement(num_experts: int, ep: int) -> ExpertPlacement:
    """Rank r owns experts [r*base, (r+1)*base) with base = E // ep; the last rank also takes
    the remainder (vLLM ``determine_expert_map``)."""
    check_ep(ep, num_experts)
    base = num_experts // ep
    replicas = {}
    for e in range(num_experts):
        rank = min(e // base, ep - 1)
        replicas[e] = [(rank, e - rank * base)]
    return ExpertPlacement(num_experts, ep, replicas)


def round_robin_placement(num_experts: int, ep: int) -> ExpertPlacement:
    """Expert e on rank e % ep, local slot e // ep."""
    check_ep(ep, num_experts)
    return ExpertPlacement(num_experts, ep, {e: [(e % ep, e // ep)] for e in range(num_experts)})


def make_placement(kind: str, num_experts: int, ep: int) -> ExpertPlacement:
    if kind == "linear":
        return linear_placement(num_experts, ep)
    if kind == "round-robin":
        return round_robin_placement(num_experts, ep)
    raise MoetoolError(f"--placement {kind!r}: expected one of {', '.join(PLACEMENTS)}")


def add_redundant(placement: ExpertPlacement, load: list[float], redundant: int) -> ExpertPlacement:
    """Add ``redundant`` replicas, one at a time: the expert with the highest load per copy gets
    a copy on the least-loaded rank that does not hold it yet (load split evenly over copies).
    Deterministic: ties go to the lower expert id / rank."""
    E, R = placement.num_experts, placement.num_ranks
    if redundant < 0:
        raise MoetoolError(f"--redundant-experts {redundant}: must be >= 0")
    if redundant and R == 1:
        raise MoetoolError("--redundant-experts needs --ep of at least 2 (a replica must sit on another rank)")
    if len(load) != E:
        raise MoetoolError(f"expert load has {len(load)} entries, the layer has {E} experts")
    reps = {e: list(p) for e, p in placement.replicas.items()}
    next_slot = [0] * R
    for places in reps.values():
        for r, s in places:
            next_slot[r] = max(next_slot[r], s + 1)

    def rank_load(r: int) -> float:
        return sum(load[e] / len(p) for e, p in reps.items() for rr, _ in p if rr == r)

    for _ in range(redundant):
        e = max(range(E), key=lambda x: (load[x] / len(reps[x]), -x))
        held = {r for r, _ in reps[e]}
        free = [r for r in range(R) if r not in held]
        if not free:
            raise MoetoolError(f"--redundant-experts {redundant}: expert {e} already has a copy on every rank")
        r = min(free, key=lambda x: (rank_load(x), x))
        reps[e].append((r, next_slot[r]))
        next_slot[r] += 1
    return ExpertPlacement(E, R, reps)


def read_expert_load(path: Path, moe_layers: dict[int, int], optional: set[int] = frozenset()) -> dict[int, list[float]]:
    """Load file: JSON ``{"layers": {"<layer>": [tokens per expert, ...], ...}}`` (or the
    inner mapping alone), one entry per MoE layer (its index in decimal, once; the layers of
    ``optional`` may be left out), one count per expert: a finite JSON number >= 0 (no NaN,
    Infinity, string or boolean)."""
    try:
        data = json.loads(Path(path).read_text(), parse_constant=_not_a_count, object_pairs_hook=_unique_keys)
    except FileNotFoundError:
        raise MoetoolError(f"--expert-load {path}: no such file") from None
    except JSON_ERRORS as e:
        raise MoetoolError(f"--expert-load {path}: invalid JSON ({e})") from None
    layers = data.get("layers", data) if isinstance(data, dict) else None
    if not isinstance(layers, dict):
        raise MoetoolError(f"--expert-load {path}: expected {{\"layers\": {{\"<layer>\": [counts...]}}}}")
    loads: dict[int, list[float]] = {}
    for key, counts in layers.items():
        if not (key.isascii() and key.isdigit() and str(int(key)) == key):
            raise MoetoolError(f"--expert-load {path}: layer key {json.dumps(key)[:40]} is not a layer index")
        if not isinstance(counts, list):
            raise MoetoolError(f"--expert-load {path}: layer {key} needs a list of counts, one per expert")
        for e, c in enumerate(counts):
            if type(c) not in (int, float) or not _finite(c) or c < 0:
                raise MoetoolError(f"--expert-load {path}: layer {key} expert {e}: {json.dumps(c)[:40]} is not a "
                                   "count (a finite number >= 0)")
        loads[int(key)] = [float(c) for c in counts]
    if not set(moe_layers) - set(optional) <= set(loads) <= set(moe_layers):
        missing = sorted(set(moe_layers) - set(optional) - set(loads))
        extra = sorted(set(loads) - set(moe_layers))
        raise MoetoolError(f"--expert-load {path}: layers do not match the model's MoE layers "
                           f"(missing {missing}, not MoE layers {extra})")
    for layer, counts in loads.items():
        if len(counts) != moe_layers[layer]:
            raise MoetoolError(f"--expert-load {path}: layer {layer} has {len(counts)} counts for {moe_layers[layer]} experts")
    return loads


def _finite(x: float) -> bool:
    """``x`` is a float's worth of a finite number (an integer of 400 digits is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _not_a_count(constant: str):
    raise ValueError(f"{constant} is not a count")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {json.dumps(key)[:40]} appears twice")
        out[key] = value
    return out


def placement_to_json(p: ExpertPlacement) -> dict:
    return {"replicas": {str(e): [list(x) for x in places] for e, places in sorted(p.replicas.items())},
            "slots": p.slots}


def placement_from_json(d: dict, num_experts: int, num_ranks: int) -> ExpertPlacement:
    """The placement ``placement_to_json`` wrote. Raises MoetoolError saying what is wrong where
    it is not one: every expert placed at least once, each copy a (rank, slot) pair of a rank
    that exists, and each rank's slots 0, 1, ... holding one expert each."""
    replicas = d.get("replicas") if isinstance(d, dict) else None
    if not isinstance(replicas, dict):
        raise MoetoolError("no \"replicas\" object")
    reps: dict[int, list[tuple[int, int]]] = {}
    for e, places in replicas.items():
        if not (isinstance(e, str) and e.isdigit() and int(e) < num_experts):
            raise MoetoolError(f"expert {e!r} is not one of the layer's {num_experts}")
        if not isinstance(places, list) or not places or not all(
                isinstance(x, list) and len(x) == 2 and all(type(v) is int and v >= 0 for v in x) for x in places):
            raise MoetoolError(f"expert {e}: its copies must be [rank, slot] pairs, got {places!r}")
        reps[int(e)] = [tuple(x) for x in places]
    missing = sorted(set(range(num_experts)) - set(reps))
    if missing:
        raise MoetoolError(f"expert {missing[0]} is on no rank")
    taken: dict[tuple[int, int], int] = {}
    for e, places in sorted(reps.items()):
        for rank, slot in places:
            if rank >= num_ranks:
                raise MoetoolError(f"expert {e} is placed on rank {rank}, of {num_ranks}")
            if (rank, slot) in taken:
                raise MoetoolError(f"rank {rank} slot {slot} holds both expert {taken[rank, slot]} and {e}")
            taken[rank, slot] = e
    for rank in range(num_ranks):
        slots = sorted(s for r, s in taken if r == rank)
        if slots != list(range(len(slots))):
            raise MoetoolError(f"rank {rank}'s slots are {slots}, not 0 to {len(slots) - 1}")
    return ExpertPlacement(num_experts, num_ranks, reps)
