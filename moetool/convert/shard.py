"""Library API of ``moetool shard``: one folder per EP rank, and ``--merge`` back.

Output::

    OUT/rank-00000-of-00004/config.json, index
                            model-0000i-of-0000n.safetensors           rank 0's experts by local slot
                            model-common-0000i-of-0000n.safetensors    every non-expert tensor
    OUT/rank-00001-of-00004/...                                         (model-common*: hard links
    ...                                                                  to rank 0's, or copies)
    OUT/manifest.json   format, layout, placement, per layer global expert -> [(rank, slot)...],
                        the source's tensor -> file map, sha256 + size of every file (written last)

Each rank folder is a checkpoint of its own: config.json is the model's, plus a ``moetool_ep``
entry saying which rank it is and how many experts each layer stores there.
"""
from __future__ import annotations

import json
from pathlib import Path

from moetool.model.families import describe
from moetool.read.checkpoint import Checkpoint, open_checkpoint
from moetool.errors import MoetoolError
from moetool.lazy import import_module
from moetool.model.placement import placement_from_json
from moetool.convert.plan import ROLES, ExpertLinear, Layout, Plan, Stacked, Summary, assign_files, other_files, plan_id, \
    plan_placements, rank_dir, shard_plan  # noqa: F401
from moetool.model.spec import ExpertPlacement
from moetool.convert.output import MANIFEST_NAME, OutputDir, verify_manifest

# torch is imported only where tensors are converted (moetool.convert.torch_executor, moetool.convert.quantize): a
# shard that is a byte copy of its input (moetool.convert.byte_executor) runs without it


def build_shard_plan(src, ep: int, placements: dict[int, ExpertPlacement], layout: Layout,
                     max_shard_size: int | None, placement_name: str, redundant: int) -> Plan:
    """The plan of ``shard`` through the torch executor (``src``: a ``moetool.convert.torch_executor.Source``)."""
    from moetool.convert.torch_executor import Planner
    from moetool.convert.quantize import non_expert_groups

    planner = Planner([src])
    planner.validate_experts(src)
    return shard_plan(src.ckpt, src.spec, ep, placements, layout, max_shard_size, placement_name, redundant,
                      non_expert_groups(src, include_shared=False), planner.specs, src.out_fmt.name,
                      {k: v for k, v in vars(src.out_fmt).items() if k != "suffixes"})


def shard(source, out, ep: int, *, placement: str = "linear", redundant: int = 0, expert_load: Path | None = None,
          layout: Layout = "stacked", max_shard_size: int | None = None, dry_run: bool = False, force: bool = False,
          progress: bool = True, revision: str | None = None, byte_copy: bool = True,
          links: bool = True) -> Summary | Plan:
    """Write one folder per EP rank and the manifest. An unquantized checkpoint whose experts
    are stored per expert or stacked is copied byte range by byte range (``moetool.convert.byte_executor``,
    no torch; ``byte_copy=False`` forces the torch executor, same output bytes). The
    non-expert tensors are written once, in rank 0's ``model-common`` files; the other ranks'
    are hard links to them (``links=False``, or a file system without hard links: copies)."""
    ckpt = open_checkpoint(source, revision)
    try:
        spec = describe(ckpt.config, ckpt.tensors)  # a rank folder or a shard root: refused by open_checkpoint
        placements = plan_placements(spec, ep, placement, redundant, expert_load)
        pid = plan_id(ckpt, ep=ep, placement=placement, redundant=redundant, layout=layout, load=str(expert_load),
                      max=max_shard_size)
        if byte_copy and not dry_run:
            from moetool.convert.byte_executor import shard_by_copy

            done = shard_by_copy(ckpt, spec, out, ep, placements, layout=layout, placement_name=placement,
                                 redundant=redundant, max_shard_size=max_shard_size, force=force,
                                 progress=progress, plan_id=pid, links=links)
            if done is not None:
                return done
        convert = import_module("moetool.convert.torch_executor")  # torch
        ErrorStats, Source, run_plan = convert.ErrorStats, convert.Source, convert.run_plan
        src = Source(ckpt, spec, None, ErrorStats())
        plan = build_shard_plan(src, ep, placements, layout, max_shard_size, placement, redundant)
        if dry_run:
            return plan
        outdir = OutputDir(Path(out), inputs=[ckpt.root], force=force, plan_id=pid)
        return run_plan(plan, [src], outdir, bytes_in=ckpt.files_bytes(), progress=progress, links=links)
    finally:
        ckpt.close()


# ------------------------------------------------------------------------------------ reading


def _refuse_rank_folder(root: Path) -> None:
    """One rank folder given where the shard root goes (``verify``, ``shard --merge``): say so."""
    if (root / MANIFEST_NAME).exists() or not (root / "config.json").is_file():
        return
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if isinstance(config, dict) and isinstance(config.get("moetool_ep"), dict):
        raise MoetoolError(f"{root}: is one rank folder of a moetool shard output; give the shard folder that holds "
                           f"every rank and manifest.json ({root.parent})")


class EPShards:
    """A finished ``moetool shard`` output: manifest, placements and per-rank checkpoints."""

    def __init__(self, root: Path, *, check: bool = True):
        self.root = Path(root)
        _refuse_rank_folder(self.root)
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
        ckpt = open_checkpoint(self.root / rank_dir(rank, self.ep), ep_rank=True)
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
    from moetool.convert.torch_executor import ErrorStats, Planner, Source, run_plan
    from moetool.convert.quantize import non_expert_groups

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

