"""Library API of ``moetool shard``: one folder per EP rank, and ``--merge`` back.

Output::

    OUT/rank-00000-of-00004/config.json, model*.safetensors[, index]   rank 0's experts by local slot
    ...                                                                  + every non-expert tensor
    OUT/manifest.json   format, layout, placement, per layer global expert -> [(rank, slot)...],
                        the source's tensor -> file map, sha256 + size of every file (written last)

Each rank folder is a checkpoint of its own: config.json is the model's, plus a ``moetool_ep``
entry saying which rank it is and how many experts each layer stores there.
"""
from __future__ import annotations

import json
from pathlib import Path

from moetool.arch import describe
from moetool.checkpoint import Checkpoint, open_checkpoint
from moetool.convert import ROLES, Copy, ErrorStats, ExpertLinear, Plan, Planner, Source, Stacked, Summary, \
    assign_files, other_files, run_plan
from moetool.errors import MoetoolError
from moetool.placement import add_redundant, make_placement, placement_from_json, placement_to_json, \
    read_expert_load
from moetool.quantize import Layout, expert_groups, non_expert_groups, plan_id
from moetool.spec import ExpertPlacement
from moetool.writer import MANIFEST_NAME, OutputDir, verify_manifest


def rank_dir(rank: int, ep: int) -> str:
    return f"rank-{rank:05d}-of-{ep:05d}"


def plan_placements(spec, ep: int, placement: str, redundant: int, load_file: Path | None) -> dict[int, ExpertPlacement]:
    if redundant and load_file is None:
        raise MoetoolError("--redundant-experts needs --expert-load FILE (per-layer token counts per expert)")
    if load_file is not None and not redundant:
        raise MoetoolError("--expert-load is only used with --redundant-experts R (R > 0)")
    loads = read_expert_load(load_file, {m.index: m.num_experts for m in spec.moe_layers}) if load_file else {}
    out = {}
    for layer in spec.moe_layers:
        p = make_placement(placement, layer.num_experts, ep)
        if redundant:
            p = add_redundant(p, loads[layer.index], redundant)
        out[layer.index] = p
    return out


def build_shard_plan(src: Source, ep: int, placements: dict[int, ExpertPlacement], layout: Layout,
                     max_shard_size: int | None, placement_name: str, redundant: int) -> Plan:
    spec = src.spec
    planner = Planner([src])
    planner.validate_experts(src)
    ng, nh = non_expert_groups(src, include_shared=False)
    n_specs = [planner.specs(g) for g in ng]
    files = []
    json_files = {}
    for r in range(ep):
        slots = {i: p.slots[r] for i, p in placements.items()}
        eg, eh = expert_groups(src, layout, slots=slots, slot_names=True)
        e_specs = [planner.specs(g) for g in eg]
        d = rank_dir(r, ep)
        files += assign_files(ng + eg, nh + eh, n_specs + e_specs, max_shard_size, prefix=f"{d}/")
        cfg = dict(src.ckpt.config)
        cfg["moetool_ep"] = {"rank": r, "ep": ep, "layout": layout,
                             "stored_experts": {str(i): len(s) for i, s in slots.items()}}
        json_files[f"{d}/config.json"] = cfg
    manifest = {
        "kind": "ep-shards",
        "ep": ep,
        "format": src.out_fmt.name,
        "format_params": {k: v for k, v in vars(src.out_fmt).items() if k != "suffixes"},
        "layout": layout,
        "placement": placement_name,
        "redundant_experts": redundant,
        "ranks": [rank_dir(r, ep) for r in range(ep)],
        "source": {
            "layout": spec.moe_layers[0].storage.kind,
            "tensor_files": {n: i.file for n, i in src.ckpt.tensors.items()},
        },
        "layers": [
            {"layer": m.index, "prefix": m.prefix, "num_experts": m.num_experts, "hidden": m.hidden,
             "intermediate": m.intermediate, **placement_to_json(placements[m.index])}
            for m in spec.moe_layers
        ],
    }
    return Plan(files, src.ckpt.config, src.out_fmt.name, layout, json_files=json_files, manifest_extra=manifest)


def shard(source, out, ep: int, *, placement: str = "linear", redundant: int = 0, expert_load: Path | None = None,
          layout: Layout = "stacked", max_shard_size: int | None = None, dry_run: bool = False, force: bool = False,
          progress: bool = True, revision: str | None = None) -> Summary | Plan:
    ckpt = open_checkpoint(source, revision)
    try:
        spec = describe(ckpt.config, ckpt.tensors)
        if "moetool_ep" in ckpt.config:
            raise MoetoolError(f"{ckpt.root}: is one rank of EP shards; merge them first (moetool shard --merge)")
        placements = plan_placements(spec, ep, placement, redundant, expert_load)
        src = Source(ckpt, spec, None, ErrorStats())
        plan = build_shard_plan(src, ep, placements, layout, max_shard_size, placement, redundant)
        if dry_run:
            return plan
        outdir = OutputDir(Path(out), inputs=[ckpt.root], force=force,
                           plan_id=plan_id(ckpt, ep=ep, placement=placement, redundant=redundant, layout=layout,
                                           load=str(expert_load), max=max_shard_size))
        return run_plan(plan, [src], outdir, bytes_in=ckpt.files_bytes(), progress=progress)
    finally:
        ckpt.close()


# ------------------------------------------------------------------------------------ reading


class EPShards:
    """A finished ``moetool shard`` output: manifest, placements and per-rank checkpoints."""

    def __init__(self, root: Path, *, check: bool = True):
        self.root = Path(root)
        if check:
            self.manifest = verify_manifest(self.root)
        else:
            path = self.root / MANIFEST_NAME
            if not path.is_file():
                raise MoetoolError(f"{self.root}: no {MANIFEST_NAME} (not a finished moetool shard output)")
            self.manifest = json.loads(path.read_text())
        if self.manifest.get("kind") != "ep-shards":
            raise MoetoolError(f"{self.root}: {MANIFEST_NAME} is not from moetool shard (kind {self.manifest.get('kind')!r})")
        self.ep = int(self.manifest["ep"])
        self.layout = self.manifest["layout"]
        self.placements = {int(l["layer"]): placement_from_json(l, int(l["num_experts"]), self.ep)
                           for l in self.manifest["layers"]}

    def rank_files(self, rank: int) -> list[str]:
        d = rank_dir(rank, self.ep) + "/"
        return [n for n in self.manifest["files"] if n.startswith(d)]

    def open_rank(self, rank: int, *, check: bool = True) -> tuple[Checkpoint, object]:
        """(checkpoint, ModelSpec) of one rank; with ``check`` its files' sha256 are verified first."""
        if check:
            verify_manifest(self.root, self.rank_files(rank))
        ckpt = open_checkpoint(self.root / rank_dir(rank, self.ep))
        stored = {int(k): v for k, v in ckpt.config["moetool_ep"]["stored_experts"].items()}
        if ckpt.config["moetool_ep"]["rank"] != rank:
            raise MoetoolError(f"{ckpt.root}/config.json: says rank {ckpt.config['moetool_ep']['rank']}, expected {rank}")
        for i, p in self.placements.items():
            if stored.get(i) != len(p.slots[rank]):
                raise MoetoolError(f"{ckpt.root}: layer {i} stores {stored.get(i)} experts, the manifest places {len(p.slots[rank])}")
        return ckpt, describe(ckpt.config, ckpt.tensors, stored_experts=stored)


def merge(shards_dir, out, *, layout: Layout | None = None, max_shard_size: int | None = None,
          dry_run: bool = False, force: bool = False, progress: bool = True) -> Summary | Plan:
    """Rebuild the unsharded checkpoint: every expert from its primary copy, names and file
    assignment of the source (recorded in the manifest); non-expert tensors from rank 0."""
    shards = EPShards(Path(shards_dir))
    man = shards.manifest
    opened = [shards.open_rank(r, check=False) for r in range(shards.ep)]
    try:
        stats = ErrorStats()
        sources = [Source(ck, sp, None, stats) for ck, sp in opened]
        src0 = sources[0]
        out_layout = layout or ("stacked" if man["source"]["layout"] == "stacked" else "per-expert")
        tensor_files = man["source"]["tensor_files"]
        groups, homes = [], []
        ng, _ = non_expert_groups(src0, include_shared=False)
        for g in ng:
            groups.append(g)
            homes.append(tensor_files.get(g.dst, "model.safetensors"))
        lin_names = src0.spec.family.expert_linears
        for layer in src0.spec.moe_layers:
            p = shards.placements[layer.index]
            primary = [p.replicas[e][0] for e in range(layer.num_experts)]
            # a fused source (gate_up_proj / down_proj) comes back per-expert, in the fused tensors' file
            fused_home = tensor_files.get(f"{layer.prefix}.experts.gate_up_proj", "")
            if out_layout == "stacked":
                for which in ("w13", "w2"):
                    base = f"{layer.prefix}.experts.{which}"
                    groups.append(Stacked(layer.index, which, tuple(s for _, s in primary), base,
                                          sources=tuple(r for r, _ in primary)))
                    homes.append(tensor_files.get(f"{base}_weight", tensor_files.get(f"{base}_weight_packed", fused_home)))
                continue
            for e, (r, slot) in enumerate(primary):
                for k, role in enumerate(ROLES):
                    base = f"{layer.prefix}.experts.{e}.{lin_names[k]}"
                    groups.append(ExpertLinear(layer.index, slot, role, base, source=r))
                    homes.append(tensor_files.get(f"{base}.weight", tensor_files.get(f"{base}.weight_packed", fused_home)))
        order = {f: i for i, f in enumerate(dict.fromkeys(sorted(set(tensor_files.values()))))}
        idx = sorted(range(len(groups)), key=lambda i: order.get(homes[i], len(order)))
        groups, homes = [groups[i] for i in idx], [homes[i] for i in idx]
        planner = Planner(sources)
        specs = [planner.specs(g) for g in groups]
        files = assign_files(groups, homes, specs, max_shard_size)
        cfg = dict(src0.ckpt.config)
        cfg.pop("moetool_ep", None)
        plan = Plan(files, cfg, man["format"], out_layout, other_files=other_files(src0.ckpt.root),
                    json_files={"config.json": cfg},
                    manifest_extra={"kind": "checkpoint", "format": man["format"], "layout": out_layout})
        if dry_run:
            return plan
        outdir = OutputDir(Path(out), inputs=[shards.root], force=force,
                           plan_id=f"merge:{man['files'][rank_dir(0, shards.ep) + '/config.json']['sha256'][:16]}")
        bytes_in = sum(v["size"] for v in man["files"].values())
        return run_plan(plan, sources, outdir, bytes_in=bytes_in, progress=progress)
    finally:
        for ck, _ in opened:
            ck.close()

