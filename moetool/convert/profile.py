"""What the torch executor says about sharding one quantized checkpoint, kept with it, so that
a byte-copy shard of it is checked without importing torch (no torch here).

A byte copy of a quantized checkpoint (``moetool.convert.byte_executor``) is committed only
where the torch executor would write the same shard (``moetool.convert.byte_check``). What
only torch code can say does not depend on the shard's options: the format and its parameters
(the registry reads the config), and for each layer shape, what the torch executor writes for
one expert's gate, up, down, w13 and w2 (the tensors' names, dtypes and shapes, and sha256 of
their bytes for expert 0 of the first layer of that shape: ``cat_rows`` of the format, not a
rule of the byte plan). That is the *profile*, made by ``byte_check.format_profile``. From it,
:func:`plan_facts` builds the torch executor's plan of any shard of the checkpoint with the
planning code both executors share, and reports what the byte plan must agree with: every
file's header, the manifest, the JSON files and the sampled slices' sha256.

``quantize`` (and ``repack``) writes the profile of its output into the output's manifest
(``PROFILE_KEY``), keyed on the moetool code that wrote it (sha256 of its source files) and
the output's headers and config: a later ``shard`` of that output finds it with
:func:`stored_profile` (a profile of other code or other files is ignored) and spends no
child process importing torch (10.5 s of a cold-cache H100 host's 12 s fp8 shard).
"""
from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

from moetool.convert.byte_plan import RawSpec, copy_groups
from moetool.convert.plan import Copy, ExpertLinear, Stacked
from moetool.convert.planning import plan_placements, shard_plan
from moetool.errors import JSON_ERRORS
import moetool.formats.cards as format_cards
from moetool.model.families import ModelSpec, MoELayerSpec
from moetool.read.checkpoint import Checkpoint
from moetool.read.manifest import MANIFEST_NAME

#: the manifest entry holding a checkpoint's profile
PROFILE_KEY = "shard_profile"
#: what a profile holds for each layer shape: one expert's linears, as the torch executor
#: writes them (per-expert roles, stacked halves)
WHICH = ("gate", "up", "down", "w13", "w2")
#: the expert whose bytes a profile samples
SAMPLED_EXPERT = 0


#: the moetool packages whose code a profile depends on (besides the version and the formats)
CODE = ("convert", "read", "model")


@cache
def code_digest() -> str:
    """sha256 of the source of moetool's conversion code (its version, ``CODE`` and every
    format's module): a profile made by other code is not trusted."""
    package = Path(__file__).resolve().parents[1]
    formats = Path(format_cards.__file__).resolve().parent
    paths = [(package, package / "__init__.py")]
    paths += [(package, p) for part in CODE for p in sorted((package / part).rglob("*.py"))]
    paths += [(formats, p) for p in sorted(formats.glob("*.py"))]
    h = hashlib.sha256()
    for root, path in paths:
        h.update(f"{path.relative_to(root)}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def inputs_digest(ckpt: Checkpoint) -> str:
    """sha256 of what a profile is about: the checkpoint's config and the header of each of its
    safetensors files (names, dtypes, shapes and offsets of every tensor)."""
    h = hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode())
    for name in sorted(ckpt.files):
        with open(ckpt.root / name, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            h.update(f"\0{name}\0".encode())
            h.update(f.read(size))
    return h.hexdigest()


def shape_key(layer: MoELayerSpec) -> str:
    """A layer's shape, as profiles name it: "HIDDENxINTERMEDIATE"."""
    return f"{layer.hidden}x{layer.intermediate}"


def probe_key(layer: MoELayerSpec, which: str) -> str:
    """The profile's key of ``which`` (one of ``WHICH``) of a layer's shape."""
    return f"{shape_key(layer)}:{which}"


def sampled_layers(spec: ModelSpec) -> dict[str, int]:
    """The first MoE layer of each shape: ``shape_key`` -> layer index."""
    out: dict[str, int] = {}
    for layer in spec.moe_layers:
        out.setdefault(shape_key(layer), layer.index)
    return out


def sealed(profile: dict) -> dict:
    """``profile`` as JSON gives it back (lists for tuples), with its own sha256 (``digest``)."""
    plain = json.loads(json.dumps({k: v for k, v in profile.items() if k != "digest"}))
    return {**plain, "digest": _digest(plain)}


def _digest(profile: dict) -> str:
    body = {k: v for k, v in profile.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def stored_profile(ckpt: Checkpoint) -> dict | None:
    """The profile a checkpoint's manifest holds, when it is whole (its digest), this code made
    it, it names the manifest's format (and format parameters, where the manifest gives them:
    a shard's), config.json's quantization_config does not contradict its format parameters,
    and the checkpoint's headers and config are still those it was made of; else None. (The
    digest only says the profile is whole: anyone can make it again, so what it says of the
    format is checked against what the input declares.)"""
    try:
        manifest = json.loads((ckpt.root / MANIFEST_NAME).read_text())
        profile = manifest.get(PROFILE_KEY)
    except (OSError, AttributeError, *JSON_ERRORS):
        return None
    if not isinstance(profile, dict) or profile.get("digest") != _digest(profile):
        return None
    if profile.get("code") != code_digest() or profile.get("format") != manifest.get("format"):
        return None
    params = profile.get("format_params")
    if not isinstance(params, dict) or manifest.get("format_params", params) != params:
        return None
    if _config_contradicts(params, ckpt.config):
        return None
    try:
        return profile if profile.get("inputs") == inputs_digest(ckpt) else None
    except OSError:
        return None


def _config_contradicts(params: dict, config: dict) -> bool:
    """Whether config.json's compressed-tensors quantization_config (its one group's weights
    arguments) gives another value for one of the format parameters ``params`` (group_size,
    symmetric) than ``params`` does; torch-free, for the byte copy."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    if not groups:
        return False
    if not isinstance(groups, dict) or len(groups) != 1:
        return True
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") if isinstance(scheme, dict) else None
    if not isinstance(weights, dict):
        return True
    return any(key in weights and weights[key] != value for key, value in params.items())


def plan_facts(ckpt: Checkpoint, spec: ModelSpec, profile: dict, *, ep: int, placement: str, redundant: int,
               expert_load: str | None, layout: str, max_shard_size: int | None, samples: list[list]) -> dict | None:
    """The torch executor's plan of ``shard`` with these options, built from ``profile``:
    {"headers": {file: sha256 of its header}, "manifest_extra", "json_files", "samples": [[sha256
    of each tensor of expert slice 0] for each (file, group index) of ``samples``]}; None when
    the profile cannot say (a sampled slice of another expert or layer than it sampled)."""
    placements = plan_placements(spec, ep, placement, redundant, Path(expert_load) if expert_load else None)
    layers = {m.index: m for m in spec.moe_layers}
    linears = profile["linears"]

    def specs_of(g) -> list[RawSpec]:
        if isinstance(g, Copy):
            info = ckpt.info(g.src)
            return [RawSpec(g.dst, info.dtype_name, info.shape)]
        if isinstance(g, Stacked):
            return [RawSpec(f"{g.dst_base}_{s}", dtype, (len(g.experts), *shape))
                    for s, dtype, shape in linears[probe_key(layers[g.layer], g.which)]]
        return [RawSpec(f"{g.dst_base}.{s}", dtype, tuple(shape))
                for s, dtype, shape in linears[probe_key(layers[g.layer], g.role)]]

    plan = shard_plan(ckpt, spec, ep, placements, layout, max_shard_size, placement, redundant,
                      copy_groups(ckpt, spec), specs_of, profile["format"], profile["format_params"])
    files = {pf.name: pf for pf in plan.files}
    shas = []
    for name, index in samples:
        g = files[name].groups[index]
        layer = layers[g.layer]
        expert = g.experts[0] if isinstance(g, Stacked) else g.expert if isinstance(g, ExpertLinear) else None
        key = probe_key(layer, g.which if isinstance(g, Stacked) else g.role)
        if expert != SAMPLED_EXPERT or profile["layers"].get(shape_key(layer)) != g.layer:
            return None
        shas.append(profile["samples"][key])
    return {"headers": {pf.name: hashlib.sha256(pf.header()).hexdigest() for pf in plan.files if not pf.same_as},
            "manifest_extra": plan.manifest_extra, "json_files": plan.json_files, "samples": shas}
