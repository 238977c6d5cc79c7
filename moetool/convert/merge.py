"""Library API of ``moetool shard --merge``: rebuild the unsharded checkpoint from EP shards."""
from __future__ import annotations

from pathlib import Path

from moetool.convert.conversion import non_expert_groups
from moetool.convert.output import OutputDir
from moetool.convert.plan import ROLES, ExpertLinear, Layout, Plan, Stacked, Summary
from moetool.convert.planning import assign_files, other_files
from moetool.convert.torch_executor import ErrorStats, Planner, Source, run_plan
from moetool.read.manifest import rank_dir
from moetool.read.shards import EPShards


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
