"""Library API of ``moetool quantize`` and ``moetool repack``: one plan builder, two entry points.

quantize: routed experts (and optionally shared experts) go to the output format; everything
else passes through bit-identical (quantized non-expert linears of another format are
written back in the model dtype). repack: same format, per-expert <-> stacked layout.
"""
from __future__ import annotations

from pathlib import Path

import torch

from moetool.model.families import ModelSpec, describe
from moetool.read.checkpoint import open_checkpoint
from moetool.convert.torch_executor import (
    Copy,
    Dequant,
    ErrorStats,
    Group,
    Plan,
    Planner,
    SharedLinear,
    Source,
    Summary,
    run_plan,
)
from moetool.errors import MoetoolError
from moetool.formats import get_format
from moetool.formats.base import WeightFormat
from moetool.convert.plan import QUANTIZED_ONLY_SUFFIXES, Layout, checkpoint_files, checkpoint_plan, non_expert_tensors, \
    plan_id
from moetool.convert.output import OutputDir, TensorSpec

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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


def output_config(config: dict, out_fmt: WeightFormat, changed: bool, specs: list[TensorSpec]) -> dict:
    """config.json of the output: the input's, with the output format's quantization_config and
    an ignore list of every linear left unquantized."""
    cfg = dict(config)
    if not changed:
        return cfg
    ignore = sorted({s.name[: -len(".weight")] for s in specs
                     if s.name.endswith(".weight") and len(s.shape) == 2 and s.dtype.is_floating_point
                     and s.dtype.itemsize > 1})
    qc = out_fmt.quantization_config(ignore)
    if qc is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = qc
    return cfg


def build_plan(src: Source, *, layout: Layout, include_shared: bool, max_shard_size: int | None,
               changed_format: bool) -> Plan:
    planner = Planner([src])
    planner.validate_experts(src)
    files = checkpoint_files(src.ckpt, src.spec, layout, non_expert_groups(src, include_shared=include_shared),
                             planner.specs, max_shard_size)
    config = output_config(src.ckpt.config, src.out_fmt, changed_format, [s for f in files for s in f.specs])
    return checkpoint_plan(src.ckpt, files, config, src.out_fmt.name, layout)


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
            import torch

            if not torch.cuda.is_available():
                raise MoetoolError("--device cuda: no CUDA device is available")
        src = Source(ckpt, spec, fmt, stats, device=device)
        if include_shared and src.passthrough:
            raise MoetoolError("--include-shared-experts needs a target format different from the input's")
        plan = build_plan(src, layout=layout, include_shared=include_shared, max_shard_size=max_shard_size,
                          changed_format=not src.passthrough)
        if dry_run:
            return plan
        outdir = OutputDir(Path(out), inputs=[ckpt.root], force=force,
                           plan_id=plan_id(ckpt, fmt=src.out_fmt.name, params=vars(src.out_fmt), layout=layout,
                                           shared=include_shared, max=max_shard_size))
        return run_plan(plan, [src], outdir, bytes_in=ckpt.files_bytes(), progress=progress, stats=stats)
    finally:
        ckpt.close()


def quantize(source, out, fmt_name: str, *, group_size: int = 128, symmetric: bool = True, **kw) -> Summary | Plan:
    params = {"group_size": group_size, "symmetric": symmetric} if fmt_name == "int4-group" else {}
    return convert_checkpoint(source, out, fmt=get_format(fmt_name, **params), **kw)


def repack(source, out, layout: Layout, **kw) -> Summary | Plan:
    """``moetool.convert.repack.repack``: a byte copy where the checkpoint allows it, else ``convert_checkpoint``."""
    from moetool.convert.repack import repack as repack_

    return repack_(source, out, layout, **kw)
