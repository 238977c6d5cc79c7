"""Library API of ``moetool shard --merge``: rebuild the unsharded checkpoint from EP shards."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from moetool.convert.conversion import non_expert_groups
from moetool.convert.output import OutputDir, refuse_output
from moetool.convert.plan import ROLES, ExpertLinear, Fused, MergeLayout, Plan, Stacked, Summary
from moetool.convert.planning import assign_files, other_files
from moetool.convert.torch_executor import ErrorStats, Planner, Source, run_plan
from moetool.errors import MoetoolError
from moetool.read.shards import EPShards


def merge(shards_dir, out, *, layout: MergeLayout | None = None, max_shard_size: int | None = None,
          dry_run: bool = False, force: bool = False, progress: bool = True) -> Summary | Plan:
    """Rebuild the unsharded checkpoint: every expert from its primary copy, names and file
    assignment of the source (recorded in the manifest); non-expert tensors from rank 0.
    ``layout`` (default: the source's): per-expert, stacked, or fused (a source stored
    fused, as transformers does: its ``experts.gate_up_proj`` / ``experts.down_proj`` back, the
    same names, shapes and bytes)."""
    shards = EPShards(Path(shards_dir))
    man = shards.manifest
    opened = [shards.open_rank(r, check=False) for r in range(shards.ep)]
    try:
        stats = ErrorStats()
        sources = [Source(ck, sp, None, stats) for ck, sp in opened]
        src0 = sources[0]
        source_layout = man["source"]["layout"]
        out_layout = layout or source_layout
        if out_layout == "fused" and source_layout != "fused":
            raise MoetoolError(f"{shards.root}: --layout fused needs a source stored fused; this one was {source_layout}")
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
            fused = _fused_record(man, layer, src0.spec.family)
            fused_home = _fused_file(tensor_files, fused["gate_up"], fused, "")
            if out_layout == "fused":
                for which in ("gate_up", "down"):
                    dst = fused[which]
                    groups.append(Fused(layer.index, which, tuple(s for _, s in primary), dst,
                                        input_first=fused[f"{which}_input_first"], interleaved=fused["interleaved"],
                                        sources=tuple(r for r, _ in primary)))
                    homes.append(_fused_file(tensor_files, dst, fused, "model.safetensors"))
                continue
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
        # the whole manifest (every file's sha256) and the options: a journal of a merge of other
        # shards, or into other files, is not resumed
        key = json.dumps({"manifest": man, "layout": out_layout, "max": max_shard_size}, sort_keys=True)
        pid = f"merge:{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        if dry_run:
            refuse_output(Path(out), inputs=[shards.root], force=force, plan_id=pid)
            return plan
        outdir = OutputDir(Path(out), inputs=[shards.root], sources=[ck for ck, _ in opened], force=force, plan_id=pid)
        bytes_in = sum(v["size"] for v in man["files"].values())
        return run_plan(plan, sources, outdir, bytes_in=bytes_in, progress=progress)
    finally:
        for ck, _ in opened:
            ck.close()


def _fused_file(tensor_files: dict, base: str, record: dict, default: str) -> str:
    """The source file of a fused tensor ``base`` (or of its first quantized part, ``base_blocks``)."""
    names = [base, *(f"{base}_{s}" for s in record.get("suffixes", ()))]
    return next((tensor_files[n] for n in names if n in tensor_files), default)


def _fused_record(manifest: dict, layer, family) -> dict:
    """How a fused source stored ``layer``'s experts: the manifest's record, or (a manifest
    written before it kept one) the transformers names in the family's orientation."""
    for rec in manifest["layers"]:
        if rec["layer"] == layer.index and isinstance(rec.get("fused"), dict):
            return rec["fused"]
    return {"gate_up": f"{layer.prefix}.experts.gate_up_proj", "down": f"{layer.prefix}.experts.down_proj",
            "gate_up_input_first": family.fused_input_first, "down_input_first": family.fused_input_first,
            "interleaved": family.fused_interleaved}
