"""Library API of ``moetool inspect``: what a checkpoint holds, as a dict and as a table."""
from __future__ import annotations

from collections import Counter

from moetool.arch import describe
from moetool.checkpoint import Checkpoint
from moetool.convert import Planner
from moetool.experts_io import detect_expert_format


def _router_text(r) -> str:
    parts = [f"{r.scoring}", f"top-{r.top_k}"]
    if r.n_group:
        parts.append(f"grouped {r.topk_group}/{r.n_group} ({r.group_score})")
    if r.has_correction_bias:
        parts.append("correction bias")
    parts.append("renormalize" if r.renormalize else "no renormalize")
    if r.routed_scaling_factor != 1.0:
        parts.append(f"scale {r.routed_scaling_factor:g}")
    if r.apply_weight_on_input:
        parts.append("weight on input")
    return ", ".join(parts)


def inspect_checkpoint(ckpt: Checkpoint) -> dict:
    spec = describe(ckpt.config, ckpt.tensors)
    fmt = detect_expert_format(ckpt, spec)
    expert_names: set[str] = set()
    for layer in spec.moe_layers:
        expert_names |= Planner.expert_tensor_names(ckpt, layer)
    expert_bytes = sum(ckpt.tensors[n].nbytes for n in expert_names)
    total_bytes = sum(i.nbytes for i in ckpt.tensors.values())
    dtypes = Counter(str(i.dtype).replace("torch.", "") for i in ckpt.tensors.values())
    first = spec.moe_layers[0]
    return {
        "path": str(ckpt.root),
        "architecture": spec.family.name,
        "model_type": spec.model_type,
        "layers": spec.num_layers,
        "moe_layers": [m.index for m in spec.moe_layers],
        "dense_layers": spec.dense_layers,
        "experts": first.num_experts,
        "top_k": first.router.top_k,
        "hidden_size": first.hidden,
        "expert_intermediate_size": first.intermediate,
        "router": _router_text(first.router),
        "shared_experts": (
            {"intermediate_size": first.shared.intermediate, "gated": first.shared.has_gate} if first.shared else None
        ),
        "expert_storage": first.storage.kind + (" (interleaved gate/up)" if first.storage.interleaved else "")
        + (" (input-first)" if first.storage.gate_up_input_first else ""),
        "weight_format": fmt.name,
        "format_params": {k: v for k, v in vars(fmt).items() if k != "suffixes"},
        "files": len(ckpt.files),
        "tensors": len(ckpt.tensors),
        "dtypes": dict(sorted(dtypes.items())),
        "expert_bytes": expert_bytes,
        "other_bytes": total_bytes - expert_bytes,
        "notes": spec.family.notes or None,
        "ep_rank": _ep_rank(ckpt.config, spec),
    }


def _ep_rank(config: dict, spec) -> dict | None:
    """For one rank folder of ``moetool shard``: which rank, and the experts it stores per layer."""
    ep = config.get("moetool_ep")
    if not isinstance(ep, dict):
        return None
    return {"rank": ep.get("rank"), "ep": ep.get("ep"), "layout": ep.get("layout"),
            "stored_experts": {str(m.index): m.n_stored for m in spec.moe_layers}}


def render(info: dict) -> str:
    def gb(n: int) -> str:
        return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"

    moe = info["moe_layers"]
    moe_text = f"{len(moe)} ({moe[0]}..{moe[-1]})" if len(moe) > 1 else str(moe)
    shared = info["shared_experts"]
    rows = [
        ("checkpoint", info["path"]),
        ("architecture", f"{info['architecture']} (model_type {info['model_type']})"),
        ("layers", f"{info['layers']} total, MoE {moe_text}, dense {len(info['dense_layers'])}"),
        ("experts", f"{info['experts']} per layer, top-{info['top_k']}"),
        ("dims", f"hidden {info['hidden_size']}, expert intermediate {info['expert_intermediate_size']}"),
        ("router", info["router"]),
        ("shared experts", "none" if not shared else
         f"intermediate {shared['intermediate_size']}" + (", sigmoid-gated" if shared["gated"] else "")),
        ("expert storage", info["expert_storage"]),
        ("weight format", info["weight_format"] + (f" {info['format_params']}" if info["format_params"] else "")),
        ("tensors", f"{info['tensors']} in {info['files']} file(s); " + ", ".join(f"{k} {v}" for k, v in info["dtypes"].items())),
        ("bytes", f"experts {gb(info['expert_bytes'])}, other {gb(info['other_bytes'])}"),
    ]
    if info.get("ep_rank"):
        r = info["ep_rank"]
        stored = sorted(set(r["stored_experts"].values()))
        rows.append(("EP rank", f"{r['rank']} of {r['ep']} ({r['layout']}): stores "
                     f"{'/'.join(map(str, stored))} of the {info['experts']} experts per layer"))
    if info.get("notes"):
        rows.append(("notes", info["notes"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
