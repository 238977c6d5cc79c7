"""Planning: which groups a conversion has and how they are put into files, decided once for
both executors from the checkpoint's headers and config (no tensor data is read, nothing is
written). The values it builds are in ``moetool.convert.plan``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from moetool.convert.plan import (OTHER_FILE_SUFFIXES, ROLES, SKIP_FILES, ExpertLinear, Fused, Group, Layout, Plan,
                                  PlannedFile, SpecsOf, Stacked)
from moetool.errors import MoetoolError
from moetool.model.families import ModelSpec, MoELayerSpec
from moetool.model.placement import add_redundant, make_placement, placement_to_json, read_expert_load
from moetool.model.spec import ExpertPlacement
from moetool.read.checkpoint import Checkpoint
from moetool.read.checkpoint import expert_tensor_names
from moetool.read.manifest import COMMON_STEM, rank_dir
from moetool.read.safetensors import TensorInfo, TensorSpec


def non_expert_tensors(ckpt: Checkpoint, spec: ModelSpec) -> list[tuple[str, TensorInfo]]:
    """Every input tensor that is not a routed expert, in input order (file, offset)."""
    experts: set[str] = set()
    for layer in spec.moe_layers:
        experts |= expert_tensor_names(ckpt, layer)
    return sorted(((n, i) for n, i in ckpt.tensors.items() if n not in experts), key=lambda kv: (kv[1].file, kv[1].begin))


def expert_groups(ckpt: Checkpoint, spec: ModelSpec, layout: Layout, *, slots: dict[int, list[int]] | None = None,
                  slot_names: bool = False) -> tuple[list[Group], list[str]]:
    """Groups writing the routed experts, with each group's home input file.

    ``slots``: per layer index, the global experts to write (default all, in order);
    ``slot_names``: name per-expert outputs by local slot (EP shards) instead of global id.
    """
    groups: list[Group] = []
    homes: list[str] = []
    for layer in spec.moe_layers:
        experts = slots[layer.index] if slots is not None else list(range(layer.n_stored))
        lin_names = spec.family.expert_linears
        home = home_of_layer(ckpt, layer)
        if layout == "stacked":
            for which in ("w13", "w2"):
                groups.append(Stacked(layer.index, which, tuple(experts), f"{layer.prefix}.experts.{which}"))
                homes.append(home(experts[0]) if experts else home(0))
            continue
        if layout == "fused":  # transformers' names, orientation and row order of the family
            fam = spec.family
            for which in ("gate_up", "down"):
                groups.append(Fused(layer.index, which, tuple(experts), f"{layer.prefix}.experts.{which}_proj",
                                    input_first=fam.fused_input_first, interleaved=fam.fused_interleaved))
                homes.append(home(experts[0]) if experts else home(0))
            continue
        for slot, e in enumerate(experts):
            for r, role in enumerate(ROLES):
                name_index = slot if slot_names else e
                dst = f"{layer.prefix}.experts.{name_index}.{lin_names[r]}"
                groups.append(ExpertLinear(layer.index, e, role, dst))
                homes.append(home(e))
    return groups, homes


def home_of_layer(ckpt: Checkpoint, layer: MoELayerSpec):
    """expert id -> the input file holding it (the output file it goes to by default)."""
    st = layer.storage
    if st.kind == "per-expert":
        def home(e: int) -> str:
            base = st.per_expert_bases(e)[0]
            info = ckpt.tensors.get(f"{base}.weight") or ckpt.tensors.get(f"{base}.weight_packed")
            return info.file
        return home
    first = next(n for n in ckpt.tensors if n.startswith(st.gate_up) and n != st.gate_up_bias)
    return lambda e: ckpt.tensors[first].file


def in_file_order(ckpt: Checkpoint, groups: list[Group], homes: list[str]) -> tuple[list[Group], list[str]]:
    """Groups sorted by their home's position among the input files (stable within a file)."""
    order = {f: i for i, f in enumerate(ckpt.files)}
    idx = sorted(range(len(groups)), key=lambda i: order.get(homes[i], 0))
    return [groups[i] for i in idx], [homes[i] for i in idx]


#: changes whenever the same inputs and options would give other output files (another version
#: of moetool must not resume a journal of this one): 2 = EP ranks' model-common files
PLAN_VERSION = 2


def plan_id(ckpt: Checkpoint, **options) -> str:
    """Fingerprint of inputs (names, sizes, mtimes, and the config: an edited dtype changes
    what is written), options and ``PLAN_VERSION``: a journal from another plan is ignored."""
    h = hashlib.sha256(f"plan {PLAN_VERSION};".encode())
    for f in ckpt.files:
        st = (ckpt.root / f).stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(json.dumps(ckpt.config, sort_keys=True, default=str).encode())
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def checkpoint_files(ckpt: Checkpoint, spec: ModelSpec, layout: Layout, non_experts: tuple[list[Group], list[str]],
                     specs_of: SpecsOf, max_shard_size: int | None) -> list[PlannedFile]:
    """The files of a converted checkpoint (quantize, repack): the experts in ``layout`` and
    ``non_experts`` (groups, home files), in input file order. ``specs_of(group)``: its output
    tensors (converted or copied: the executor decides)."""
    eg, eh = expert_groups(ckpt, spec, layout)
    ng, nh = non_experts
    groups, homes = in_file_order(ckpt, ng + eg, nh + eh)
    return assign_files(groups, homes, [specs_of(g) for g in groups], max_shard_size)


def checkpoint_plan(ckpt: Checkpoint, files: list[PlannedFile], config: dict, format_name: str, layout: Layout) -> Plan:
    return Plan(files, config, format_name, layout, other_files=other_files(ckpt.root),
                json_files={"config.json": config},
                manifest_extra={"kind": "checkpoint", "format": format_name, "layout": layout})


def plan_placements(spec: ModelSpec, ep: int, placement: str, redundant: int,
                    load_file: Path | None) -> dict[int, ExpertPlacement]:
    if redundant and load_file is None:
        raise MoetoolError("--redundant-experts needs --expert-load FILE (per-layer token counts per expert)")
    if load_file is not None and not redundant:
        raise MoetoolError("--expert-load is only used with --redundant-experts R (R > 0)")
    # the multi-token-prediction layers may be left out of the load file (an engine's statistics
    # of the decoder): they then get no replicas
    mtp = {m.index for m in spec.moe_layers if m.index >= spec.num_layers}
    loads = read_expert_load(load_file, {m.index: m.num_experts for m in spec.moe_layers},
                             optional=mtp) if load_file else {}
    out = {}
    for layer in spec.moe_layers:
        p = make_placement(placement, layer.num_experts, ep)
        if redundant and layer.index in loads:
            p = add_redundant(p, loads[layer.index], redundant)
        out[layer.index] = p
    return out


def rank_slots(placements: dict[int, ExpertPlacement], rank: int) -> dict[int, list[int]]:
    """Per layer index, the global experts rank ``rank`` stores, by local slot."""
    return {i: p.slots[rank] for i, p in placements.items()}


def rank_config(config: dict, rank: int, ep: int, layout: Layout, slots: dict[int, list[int]]) -> dict:
    """A rank folder's config.json: the model's, plus which rank it is and its experts per layer."""
    cfg = dict(config)
    cfg["moetool_ep"] = {"rank": rank, "ep": ep, "layout": layout,
                         "stored_experts": {str(i): len(s) for i, s in slots.items()}}
    return cfg


def shard_manifest(ckpt: Checkpoint, spec: ModelSpec, ep: int, placements: dict[int, ExpertPlacement],
                   layout: Layout, placement_name: str, redundant: int, format_name: str,
                   format_params: dict) -> dict:
    """What manifest.json of ``moetool shard`` says besides the files' checksums."""
    return {
        "kind": "ep-shards",
        "ep": ep,
        "format": format_name,
        "format_params": format_params,
        "layout": layout,
        "placement": placement_name,
        "redundant_experts": redundant,
        "ranks": [rank_dir(r, ep) for r in range(ep)],
        "source": {
            "layout": spec.moe_layers[0].storage.kind,
            "tensor_files": {n: i.file for n, i in ckpt.tensors.items()},
        },
        "layers": [
            {"layer": m.index, "prefix": m.prefix, "num_experts": m.num_experts, "hidden": m.hidden,
             "intermediate": m.intermediate, **placement_to_json(placements[m.index]), **_fused_source(m)}
            for m in spec.moe_layers
        ],
    }


def _fused_source(layer: MoELayerSpec) -> dict:
    """For a layer stored fused (transformers), how: ``shard --merge`` writes it back the same way."""
    st = layer.storage
    if st.kind != "fused":
        return {}
    return {"fused": {"gate_up": st.gate_up, "down": st.down, "gate_up_input_first": st.gate_up_input_first,
                      "down_input_first": st.down_input_first, "interleaved": st.interleaved,
                      "suffixes": list(st.fused_suffixes), "biases": st.biased}}


def shard_plan(ckpt: Checkpoint, spec: ModelSpec, ep: int, placements: dict[int, ExpertPlacement], layout: Layout,
               max_shard_size: int | None, placement_name: str, redundant: int,
               non_experts: tuple[list[Group], list[str]], specs_of: SpecsOf, format_name: str,
               format_params: dict) -> Plan:
    """The plan of ``moetool shard``: per rank folder, the rank's experts (named by local slot)
    in ``model*`` files, every non-expert group in ``model-common*`` files (the same bytes in
    every rank folder: rank 0 writes them, the other ranks' are ``same_as`` them), both
    grouped as in the input (or by ``max_shard_size``), its config.json and the input's side
    files (tokenizer, generation config: a rank folder loads on its own, and ``shard --merge``
    gives them back); the manifest's placement record."""
    ng, nh = non_experts
    n_specs = [specs_of(g) for g in ng]
    common = assign_files(ng, nh, n_specs, max_shard_size, stem=COMMON_STEM)
    files: list[PlannedFile] = []
    json_files = {}
    side = other_files(ckpt.root)
    copies: list[tuple[Path, str]] = []
    for r in range(ep):
        slots = rank_slots(placements, r)
        eg, eh = expert_groups(ckpt, spec, layout, slots=slots, slot_names=True)
        d = rank_dir(r, ep)
        copies += [(path, f"{d}/{name}") for path, name in side]
        files += [PlannedFile(f"{d}/{f.name}", f.groups, f.specs, same_as=f"{rank_dir(0, ep)}/{f.name}" if r else None)
                  for f in common]
        files += assign_files(eg, eh, [specs_of(g) for g in eg], max_shard_size, prefix=f"{d}/")
        json_files[f"{d}/config.json"] = rank_config(ckpt.config, r, ep, layout, slots)
    manifest = shard_manifest(ckpt, spec, ep, placements, layout, placement_name, redundant, format_name,
                              format_params)
    return Plan(files, ckpt.config, format_name, layout, other_files=copies, json_files=json_files,
                manifest_extra=manifest)


def assign_files(groups: list[Group], homes: list[str], specs: list[list[TensorSpec]],
                 max_shard_size: int | None, prefix: str = "", stem: str = "model") -> list[PlannedFile]:
    """Put groups into output files: by their home input file, or greedily by size; named
    ``{prefix}{stem}.safetensors``, or ``{prefix}{stem}-00001-of-00003.safetensors``..."""
    buckets: list[tuple[list[Group], list[TensorSpec]]] = []
    if max_shard_size:
        size = 0
        for g, sp in zip(groups, specs):
            nb = sum(s.nbytes for s in sp)
            if not buckets or (size + nb > max_shard_size and size > 0):
                buckets.append(([], []))
                size = 0
            buckets[-1][0].append(g)
            buckets[-1][1].extend(sp)
            size += nb
    else:
        order: dict[str, int] = {}
        for g, sp, home in zip(groups, specs, homes):
            if home not in order:
                order[home] = len(buckets)
                buckets.append(([], []))
            buckets[order[home]][0].append(g)
            buckets[order[home]][1].extend(sp)
    n = len(buckets)
    files = []
    for i, (gs, sp) in enumerate(buckets):
        name = f"{stem}.safetensors" if n == 1 else f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
        files.append(PlannedFile(prefix + name, gs, sp))
    return files


def other_files(root: Path) -> list[tuple[Path, str]]:
    """Small side files (tokenizer, generation config) copied as they are; never pickles."""
    return [(p, p.name) for p in sorted(root.iterdir())
            if p.is_file() and p.suffix in OTHER_FILE_SUFFIXES and p.name not in SKIP_FILES
            and not p.name.endswith(".incomplete")]
