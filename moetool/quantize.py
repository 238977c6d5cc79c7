"""Library API of ``moetool quantize`` and ``moetool repack``: one plan builder, two entry points.

quantize: routed experts (and optionally shared experts) go to the output format; everything
else passes through bit-identical (quantized non-expert linears of another format are
written back in the model dtype). repack: same format, per-expert <-> stacked layout.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import torch

from moetool.arch import ModelSpec, describe
from moetool.checkpoint import Checkpoint, open_checkpoint
from moetool.convert import (
    ROLES,
    Copy,
    Dequant,
    ErrorStats,
    ExpertLinear,
    Group,
    Plan,
    Planner,
    SharedLinear,
    Source,
    Stacked,
    Summary,
    assign_files,
    other_files,
    run_plan,
)
from moetool.errors import MoetoolError
from moetool.formats import get_format
from moetool.formats.base import WeightFormat
from moetool.writer import OutputDir, TensorSpec

Layout = Literal["per-expert", "stacked"]
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_ONLY_SUFFIXES = {"weight_scale_inv", "weight_scale", "weight_packed", "weight_shape", "weight_zero_point",
                           "input_scale", "weight_global_scale"}


def expert_groups(src: Source, layout: Layout, *, slots: dict[int, list[int]] | None = None,
                  slot_names: bool = False) -> tuple[list[Group], list[str]]:
    """Groups writing the routed experts, with each group's home input file.

    ``slots``: per layer index, the global experts to write (default all, in order);
    ``slot_names``: name per-expert outputs by local slot (EP shards) instead of global id.
    """
    groups: list[Group] = []
    homes: list[str] = []
    for layer in src.spec.moe_layers:
        experts = slots[layer.index] if slots is not None else list(range(layer.n_stored))
        lin_names = src.spec.family.expert_linears
        home = _home_of_layer(src.ckpt, layer)
        if layout == "stacked":
            for which in ("w13", "w2"):
                groups.append(Stacked(layer.index, which, tuple(experts), f"{layer.prefix}.experts.{which}"))
                homes.append(home(experts[0]) if experts else home(0))
            continue
        for slot, e in enumerate(experts):
            for r, role in enumerate(ROLES):
                name_index = slot if slot_names else e
                dst = f"{layer.prefix}.experts.{name_index}.{lin_names[r]}"
                groups.append(ExpertLinear(layer.index, e, role, dst))
                homes.append(home(e))
    return groups, homes


def _home_of_layer(ckpt: Checkpoint, layer):
    st = layer.storage
    if st.kind == "per-expert":
        def home(e: int) -> str:
            base = st.per_expert_bases(e)[0]
            info = ckpt.tensors.get(f"{base}.weight") or ckpt.tensors.get(f"{base}.weight_packed")
            return info.file
        return home
    first = next(n for n in ckpt.tensors if n.startswith(st.gate_up))
    return lambda e: ckpt.tensors[first].file


def non_expert_groups(src: Source, *, include_shared: bool) -> tuple[list[Group], list[str]]:
    """Everything that is not a routed expert: copied, or requantized (shared experts when
    asked), or dequantized (a quantized linear whose format the output does not keep)."""
    ckpt = src.ckpt
    expert_names: set[str] = set()
    for layer in src.spec.moe_layers:
        expert_names |= Planner.expert_tensor_names(ckpt, layer)
    shared = {b for layer in src.spec.moe_layers for b in (layer.shared_bases or ())} if include_shared else set()
    bases_done: set[str] = set()
    groups: list[Group] = []
    homes: list[str] = []
    for name, info in sorted(ckpt.tensors.items(), key=lambda kv: (kv[1].file, kv[1].begin)):
        if name in expert_names:
            continue
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


def plan_id(ckpt: Checkpoint, **options) -> str:
    """Fingerprint of inputs (names, sizes, mtimes) and options: a journal from another plan is ignored."""
    h = hashlib.sha256()
    for f in ckpt.files:
        st = (ckpt.root / f).stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def build_plan(src: Source, *, layout: Layout, include_shared: bool, max_shard_size: int | None,
               changed_format: bool) -> Plan:
    planner = Planner([src])
    planner.validate_experts(src)
    eg, eh = expert_groups(src, layout)
    ng, nh = non_expert_groups(src, include_shared=include_shared)
    groups, homes = _merge_in_file_order(src.ckpt, ng + eg, nh + eh)
    specs = [planner.specs(g) for g in groups]
    files = assign_files(groups, homes, specs, max_shard_size)
    flat = [s for sp in specs for s in sp]
    config = output_config(src.ckpt.config, src.out_fmt, changed_format, flat)
    return Plan(files, config, src.out_fmt.name, layout, other_files=other_files(src.ckpt.root),
                json_files={"config.json": config},
                manifest_extra={"kind": "checkpoint", "format": src.out_fmt.name, "layout": layout})


def _merge_in_file_order(ckpt: Checkpoint, groups: list[Group], homes: list[str]):
    order = {f: i for i, f in enumerate(ckpt.files)}
    idx = sorted(range(len(groups)), key=lambda i: order.get(homes[i], 0))  # stable: keeps order within a file
    return [groups[i] for i in idx], [homes[i] for i in idx]


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
    return convert_checkpoint(source, out, fmt=None, layout=layout, **kw)
