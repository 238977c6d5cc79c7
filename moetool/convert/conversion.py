"""Conversions through the torch executor, shared by the entry points (quantize, repack,
shard, merge), which never import each other: the non-expert groups of a checkpoint, the
output config, the plan of a whole-checkpoint conversion or of EP shards, and the run.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moetool.convert.byte_check import checkpoint_profile
from moetool.convert.output import OutputDir, refuse_output
from moetool.convert.plan import QUANTIZED_ONLY_SUFFIXES, Copy, Dequant, Group, Layout, Plan, SharedLinear, Summary
from moetool.convert.profile import PROFILE_KEY
from moetool.convert.planning import checkpoint_files, checkpoint_plan, non_expert_tensors, plan_id, shard_plan
from moetool.convert.torch_executor import ErrorStats, Planner, Source, run_plan
from moetool.errors import MoetoolError
from moetool.formats.base import FP8_DTYPES, WeightFormat
from moetool.model.families import ModelSpec, describe
from moetool.model.spec import ExpertPlacement
from moetool.read.checkpoint import open_checkpoint
from moetool.read.manifest import QUANTIZED_KEY
from moetool.read.prefetch import prefetch
from moetool.read.safetensors import TensorSpec


def non_expert_groups(src: Source, *, include_shared: bool) -> tuple[list[Group], list[str]]:
    """Everything that is not a routed expert: copied, or requantized (shared experts when
    asked), or dequantized (a quantized linear whose format the output does not keep)."""
    ckpt = src.ckpt
    shared = {b for layer in src.spec.moe_layers for b in (layer.shared_bases or ())} if include_shared else set()
    bases_done: set[str] = set()
    groups: list[Group] = []
    homes: list[str] = []
    for name, info in non_expert_tensors(ckpt, src.spec):
        base, _, suffix = name.rpartition(".")
        if base in shared:
            if base not in bases_done:
                bases_done.add(base)
                groups.append(SharedLinear(base, base))
                homes.append(info.file)
            continue
        quantized_linear = suffix in QUANTIZED_ONLY_SUFFIXES or (
            suffix == "weight" and any(f"{base}.{s}" in ckpt for s in QUANTIZED_ONLY_SUFFIXES))
        if suffix == "weight" and not quantized_linear and info.dtype in FP8_DTYPES:
            # an fp8 weight whose scale partner is missing: never pass it through unscaled
            scales = [s for s in src.in_fmt.suffixes if s != "weight"] or ["weight_scale_inv"]
            raise MoetoolError(f"{name}: {str(info.dtype).replace('torch.', '')} weight without its scale "
                               f"({', '.join(f'{base}.{s}' for s in scales)} not found)")
        if quantized_linear and not src.passthrough:
            if base not in bases_done:
                bases_done.add(base)
                groups.append(Dequant(base, f"{base}.weight"))
                homes.append(info.file)
            continue
        groups.append(Copy(name, name))
        homes.append(info.file)
    return groups, homes


def output_config(config: dict, out_fmt: WeightFormat, changed: bool, specs: list[TensorSpec],
                  layout: Layout = "per-expert") -> dict:
    """config.json of the output: the input's, with ``QUANTIZED_KEY`` (a quantized output) and
    the output format's quantization_config, whose ignore list names every linear left
    unquantized (in the fused layout, the config of the format's fused layout: gpt-oss's
    ``quant_method: mxfp4``)."""
    cfg = dict(config)
    if not changed:
        return cfg
    ignore = sorted({s.name[: -len(".weight")] for s in specs
                     if s.name.endswith(".weight") and len(s.shape) == 2 and s.dtype.is_floating_point
                     and s.dtype.itemsize > 1} | set(tied_lm_heads(specs)))
    fused = layout == "fused" and out_fmt.quantized
    if out_fmt.quantized:
        cfg[QUANTIZED_KEY] = out_fmt.name
    qc = out_fmt.fused_quantization_config(ignore) if fused else out_fmt.quantization_config(ignore)
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    return cfg


def tied_lm_heads(specs: list[TensorSpec]) -> list[str]:
    """The ``lm_head`` module of a model whose output embedding is tied to its input one (no
    ``lm_head.weight`` on disk): a linear of the model all the same, which a reader of the
    quantization config (transformers' compressed-tensors) quantizes unless it is listed (the
    logits came out ~1e16 off with fp8-channel; int4 failed to load)."""
    names = {s.name for s in specs}
    heads = []
    for name in names:
        if name.endswith("model.embed_tokens.weight"):
            head = name[: -len("model.embed_tokens.weight")] + "lm_head"
            if f"{head}.weight" not in names:
                heads.append(head)
    return heads


#: the linears the planner probes per layer shape, by output layout
PROBES = {"per-expert": ("gate", "up", "down"), "stacked": ("w13", "w2"), "fused": ("w13", "w2")}


def build_plan(src: Source, *, layout: Layout, include_shared: bool, max_shard_size: int | None,
               changed_format: bool) -> Plan:
    planner = Planner([src])
    planner.validate_experts(src)
    if changed_format:
        planner.probe_ahead(PROBES[layout])
    files = checkpoint_files(src.ckpt, src.spec, layout, non_expert_groups(src, include_shared=include_shared),
                             planner.specs, max_shard_size)
    config = output_config(src.ckpt.config, src.out_fmt, changed_format or _layout_config_changes(src, layout),
                           [s for f in files for s in f.specs], layout)
    return checkpoint_plan(src.ckpt, files, config, src.out_fmt.name, layout)


def _layout_config_changes(src: Source, layout: Layout) -> bool:
    """A quantized checkpoint whose layout changes between a format's fused layout and another
    (gpt-oss's release repacked stacked, or back): its quantization_config is the layout's."""
    fused_in = src.spec.moe_layers[0].storage.kind == "fused"
    return src.out_fmt.quantized and fused_in != (layout == "fused")


def convert_checkpoint(
    source: str | Path,
    out: str | Path,
    *,
    fmt: WeightFormat | None,
    layout: Layout = "per-expert",
    include_shared: bool = False,
    max_shard_size: int | None = None,
    dry_run: bool = False,
    force: bool = False,
    progress: bool = True,
    revision: str | None = None,
    device: str = "cpu",
) -> Summary | Plan:
    """Quantize (``fmt`` given) or repack (``fmt`` None) a checkpoint into ``out``."""
    ckpt = open_checkpoint(source, revision)
    try:
        spec: ModelSpec = describe(ckpt.config, ckpt.tensors)
        stats = ErrorStats()
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise MoetoolError(f"--device {device!r}: expected cpu or cuda")
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise MoetoolError("--device cuda: no CUDA device is available")
        src = Source(ckpt, spec, fmt, stats, device=device)
        if include_shared and src.passthrough:
            raise MoetoolError("--include-shared-experts needs a target format different from the input's")
        plan = build_plan(src, layout=layout, include_shared=include_shared, max_shard_size=max_shard_size,
                          changed_format=not src.passthrough)
        pid = plan_id(ckpt, fmt=src.out_fmt.name, params=vars(src.out_fmt), layout=layout, shared=include_shared,
                      max=max_shard_size)
        if dry_run:
            refuse_output(Path(out), inputs=[ckpt.root], force=force, plan_id=pid)
            return plan
        prefetch(ckpt.root)  # quantize's command asked already, before importing torch: cached by now, or queued
        outdir = OutputDir(Path(out), inputs=[ckpt.root], sources=[ckpt], force=force, plan_id=pid)
        # a quantized output keeps the torch executor's profile of it: its shard is then checked
        # without torch (``moetool.convert.profile``)
        profile = (lambda: _profile_entry(outdir.root)) if src.out_fmt.quantized and layout != "fused" else None
        return run_plan(plan, [src], outdir, bytes_in=ckpt.files_bytes(), progress=progress, stats=stats,
                        more_manifest=profile)
    finally:
        ckpt.close()


def _profile_entry(root: Path) -> dict:
    profile = checkpoint_profile(root)
    return {} if profile is None else {PROFILE_KEY: profile}


def build_shard_plan(src, ep: int, placements: dict[int, ExpertPlacement], layout: Layout,
                     max_shard_size: int | None, placement_name: str, redundant: int) -> Plan:
    """The plan of ``shard`` through the torch executor (``src``: a ``moetool.convert.torch_executor.Source``)."""
    planner = Planner([src])
    planner.validate_experts(src)
    return shard_plan(src.ckpt, src.spec, ep, placements, layout, max_shard_size, placement_name, redundant,
                      non_expert_groups(src, include_shared=False), planner.specs, src.out_fmt.name,
                      {k: v for k, v in vars(src.out_fmt).items() if k != "suffixes"})


def shard_checkpoint(ckpt, spec: ModelSpec, out, ep: int, placements: dict[int, ExpertPlacement], *, layout: Layout,
                     placement_name: str, redundant: int, max_shard_size: int | None, dry_run: bool, force: bool,
                     progress: bool, plan_id: str, links: bool) -> Summary | Plan:
    """``shard`` through the torch executor (an input the byte copy does not take)."""
    src = Source(ckpt, spec, None, ErrorStats())
    plan = build_shard_plan(src, ep, placements, layout, max_shard_size, placement_name, redundant)
    if dry_run:
        refuse_output(Path(out), inputs=[ckpt.root], force=force, plan_id=plan_id)
        return plan
    prefetch(ckpt.root)
    outdir = OutputDir(Path(out), inputs=[ckpt.root], sources=[ckpt], force=force, plan_id=plan_id)
    return run_plan(plan, [src], outdir, bytes_in=ckpt.files_bytes(), progress=progress, links=links)
