"""Library API of ``moetool inspect``: what a checkpoint holds, as a dict and as a table."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from moetool.model.families import describe, family_for
from moetool.read.checkpoint import Checkpoint
from moetool.read.manifest import MANIFEST_NAME, RANK_DIR_RE, read_json_object
from moetool.errors import MoetoolError
from moetool.read.experts import detect_expert_format
from moetool.read.checkpoint import expert_tensor_names


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
    if r.has_router_bias:
        parts.append("logit bias")
    return ", ".join(parts)


def inspect_checkpoint(ckpt: Checkpoint) -> dict:
    spec = describe(ckpt.config, ckpt.tensors)
    fmt = detect_expert_format(ckpt, spec)
    expert_names: set[str] = set()
    for layer in spec.moe_layers:
        expert_names |= expert_tensor_names(ckpt, layer)
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
        "mtp_layers": [m.index for m in spec.moe_layers if m.index >= spec.num_layers],
        "dense_layers": spec.dense_layers,
        "experts": first.num_experts,
        "top_k": first.router.top_k,
        "hidden_size": first.hidden,
        "expert_intermediate_size": first.intermediate,
        "router": _router_text(first.router),
        "activation": spec.activation.describe(),
        "shared_experts": (
            {"intermediate_size": first.shared.intermediate, "gated": first.shared.has_gate} if first.shared else None
        ),
        "expert_storage": first.storage.describe(),
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


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def inspect_shards(root: Path) -> dict:
    """A shard root of ``moetool shard``, finished or not: what it holds, from its manifest
    or (unfinished) from the rank folders written so far. Complete means manifest.json is
    there and every file it lists is present with its size; the sha256 are not read here
    (``moetool verify`` and ``shard --merge`` check them)."""
    root = Path(root)
    ranks = sorted(p.name for p in root.iterdir() if p.is_dir() and RANK_DIR_RE.fullmatch(p.name))
    files = sorted(p for d in ranks for p in (root / d).rglob("*") if p.is_file())
    inodes = {}
    for f in files:
        st = f.stat()
        inodes[(st.st_dev, st.st_ino)] = st.st_size
    manifest = read_json_object(root / MANIFEST_NAME)
    if (root / MANIFEST_NAME).is_file() and (manifest is None or manifest.get("kind") != "ep-shards"):
        raise MoetoolError(f"{root / MANIFEST_NAME}: not a manifest of moetool shard (unreadable, or another kind)")
    configs = {d: read_json_object(root / d / "config.json") for d in ranks}
    config = next((c for c in configs.values() if c is not None), None)
    arch = model_type = None
    if config is not None:
        model_type = config.get("model_type")
        try:
            arch = family_for(config).name
        except MoetoolError:
            pass
    info: dict = {"path": str(root), "kind": "ep-shards", "complete": False, "status": "", "architecture": arch,
                  "model_type": model_type}
    if manifest is not None:
        try:
            layers = {int(l["layer"]): l for l in manifest["layers"]}
            per_rank = {str(i): [len(s) for s in l["slots"]] for i, l in layers.items()}
            listed = manifest["files"]
            bad = sorted(n for n, rec in listed.items()
                         if not (root / n).is_file() or (root / n).stat().st_size != rec["size"])
            info.update(ep=int(manifest["ep"]), placement=manifest.get("placement"),
                        redundant_experts=manifest.get("redundant_experts", 0), layout=manifest.get("layout"),
                        weight_format=manifest.get("format"), format_params=manifest.get("format_params") or {},
                        moe_layers=sorted(layers), experts=layers[min(layers)]["num_experts"] if layers else None,
                        experts_per_rank=per_rank)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise MoetoolError(f"{root / MANIFEST_NAME}: malformed manifest of moetool shard") from None
        info["complete"] = not bad
        info["status"] = ("complete" if not bad else
                          f"damaged: {len(bad)} listed file(s) missing or of another size, first {bad[0]}")
        info["missing"] = bad
    else:
        ep_cfg = {d: (c or {}).get("moetool_ep") for d, c in configs.items()}
        ep_cfg = {d: e for d, e in ep_cfg.items() if isinstance(e, dict)}
        found: dict[str, list] = {}  # layer -> experts stored on each rank (None: rank not written yet)
        ep = int(RANK_DIR_RE.fullmatch(ranks[0]).group(2)) if ranks else None
        for d in ranks:
            r = int(RANK_DIR_RE.fullmatch(d).group(1))
            stored = (ep_cfg.get(d) or {}).get("stored_experts") or {}
            for layer, n in (stored.items() if isinstance(stored, dict) else ()):
                found.setdefault(str(layer), [None] * (ep or 0))
                if ep and 0 <= r < ep:
                    found[str(layer)][r] = n
        first = next(iter(ep_cfg.values()), {})
        experts = None
        if config is not None:
            try:
                experts = int(next(config[k] for k in family_for(config).num_experts if config.get(k) is not None))
            except (MoetoolError, StopIteration, TypeError, ValueError):
                pass
        info.update(ep=ep, placement=None, redundant_experts=None, layout=first.get("layout"), weight_format=None,
                    format_params={}, moe_layers=sorted(int(k) for k in found if str(k).isdigit()),
                    experts=experts, experts_per_rank=found)
        info["status"] = (f"unfinished: no {MANIFEST_NAME} ({len(ranks)} rank folder(s) so far); "
                          "re-run the same moetool shard command to finish it")
    info.update(ranks=ranks, files=len(files), bytes=sum(f.stat().st_size for f in files),
                unique_bytes=sum(inodes.values()))
    return info


def render_shards(info: dict) -> str:
    moe = info["moe_layers"]
    moe_text = f"{len(moe)} ({moe[0]}..{moe[-1]})" if len(moe) > 1 else str(moe)
    per = info["experts_per_rank"]
    counts = {tuple(v) for v in per.values()}

    def row(v) -> str:
        return ", ".join("?" if n is None else str(n) for n in v)

    per_text = (f"{row(next(iter(counts)))} (every MoE layer)" if len(counts) == 1
                else "; ".join(f"layer {k}: {row(v)}" for k, v in per.items()) if per else "unknown")
    linked = info["bytes"] - info["unique_bytes"]
    path = info["path"]
    rows = [
        ("shards", f"{path} (output of moetool shard)"),
        ("status", info["status"]),
        ("architecture", f"{info['architecture'] or 'unknown'} (model_type {info['model_type']})"),
        ("ranks", f"EP {info['ep']}, {len(info['ranks'])} rank folder(s)"
         + (f", placement {info['placement']}" if info["placement"] else "")
         + (f", {info['redundant_experts']} redundant expert(s) per layer" if info["redundant_experts"] else "")
         + (f", layout {info['layout']}" if info["layout"] else "")),
        ("layers", f"MoE {moe_text}" + (f", {info['experts']} experts per layer" if info["experts"] else "")),
        ("experts per rank", per_text),
        ("weight format", (info["weight_format"] or "unknown")
         + (f" {info['format_params']}" if info["format_params"] else "")),
        ("files", f"{info['files']} in the rank folders, {_gb(info['bytes'])}"
         + (f" ({_gb(linked)} of it hard links to the same data)" if linked else "")),
    ]
    if info["complete"]:
        rows.append(("use", f"moetool verify {path} --ref MODEL --ep {info['ep']}; moetool shard --merge {path} OUT"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def render(info: dict) -> str:
    mtp = info.get("mtp_layers") or []
    moe = [i for i in info["moe_layers"] if i not in mtp]
    moe_text = f"{len(moe)} ({moe[0]}..{moe[-1]})" if len(moe) > 1 else str(moe)
    mtp_text = f", multi-token prediction {mtp} (MoE)" if mtp else ""
    shared = info["shared_experts"]
    rows = [
        ("checkpoint", info["path"]),
        ("architecture", f"{info['architecture']} (model_type {info['model_type']})"),
        ("layers", f"{info['layers']} total, MoE {moe_text}, dense {len(info['dense_layers'])}{mtp_text}"),
        ("experts", f"{info['experts']} per layer, top-{info['top_k']}"),
        ("dims", f"hidden {info['hidden_size']}, expert intermediate {info['expert_intermediate_size']}"),
        ("router", info["router"]),
        ("activation", info["activation"]),
        ("shared experts", "none" if not shared else
         f"intermediate {shared['intermediate_size']}" + (", sigmoid-gated" if shared["gated"] else "")),
        ("expert storage", info["expert_storage"]),
        ("weight format", info["weight_format"] + (f" {info['format_params']}" if info["format_params"] else "")),
        ("tensors", f"{info['tensors']} in {info['files']} file(s); " + ", ".join(f"{k} {v}" for k, v in info["dtypes"].items())),
        ("bytes", f"experts {_gb(info['expert_bytes'])}, other {_gb(info['other_bytes'])}"),
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
