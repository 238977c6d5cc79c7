"""Architecture registry: each MoE family described as data, resolved against a checkpoint.

A :class:`Family` row says where a family keeps its MoE tensors and how its config names
things. :func:`describe` reads config.json and the tensor names of a checkpoint and returns a
:class:`ModelSpec`: every MoE layer with its experts' storage (per-expert names, a fused
tensor and how it splits, or our stacked vLLM layout), router, activation, shared experts and
dims; each shape is checked against the config.

Both layouts transformers saves are read: its default, the family's original on-disk names,
and ``save_pretrained(..., save_original_format=False)``, its own v5 layout, which fuses the
routed experts into ``experts.gate_up_proj`` [E, 2N, H] (gate rows, then up) and
``experts.down_proj`` [E, H, N], and renames Mixtral's ``block_sparse_moe`` to ``mlp``.
Llama-4 and gpt-oss are fused input-first ([E, H, 2N], [E, N, H]) in both. gpt-oss's release
stores its experts fused and quantized (``quant_method: mxfp4``): ``experts.gate_up_proj_blocks``
[E, 2N, H/32, 16] and ``gate_up_proj_scales`` [E, 2N, H/32], ``down_proj_blocks`` [E, H, N/32, 16]
and ``down_proj_scales`` [E, H, N/32], output rows first (the blocks of a row are its packed
values, formats/mxfp4.py), gate and up rows interleaved as in the dense tensor; and biases
``experts.gate_up_proj_bias`` [E, 2N] (interleaved) and ``experts.down_proj_bias`` [E, H].
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Literal

from moetool.errors import MoetoolError
from moetool.model.spec import SILU_NAMES, ExpertActivation, RouterSpec, SharedExpertSpec

# ----------------------------------------------------------------------------- family table


@dataclass(frozen=True)
class Family:
    """How one family stores its MoE blocks. Names are relative to ``model.layers.{i}``."""

    name: str
    model_types: tuple[str, ...]
    moe_module: str  # "mlp", "block_sparse_moe", "feed_forward"
    router_module: str  # router linear: f"{moe}.{router_module}.weight"
    expert_linears: tuple[str, str, str]  # per-expert (gate, up, down) module names
    num_experts: tuple[str, ...]  # config keys tried in order
    intermediate: tuple[str, ...]
    router: Callable[["ConfigReader"], RouterSpec]
    moe_layers: Callable[["ConfigReader"], list[int]]
    shared_module: str | None = None
    shared_gate_module: str | None = None
    shared_intermediate: Callable[["ConfigReader"], int] | None = None
    #: fused on-disk default: (gate_up interleaved?, input-first?) when shapes can't tell
    fused_interleaved: bool = False
    fused_input_first: bool = False
    router_has_bias: bool = False
    #: other names of the MoE module (Mixtral's transformers-v5 layout: ``mlp``)
    moe_module_aliases: tuple[str, ...] = ()
    #: the experts' activation from the config (default: ``hidden_act``, SwiGLU)
    activation: Callable[["ConfigReader"], ExpertActivation] | None = None
    #: the config key counting the multi-token-prediction layers stored after the decoder
    #: layers (DeepSeek-V3's ``num_nextn_predict_layers``: layer 61 of 61), MoE blocks like
    #: the others that the causal LM does not run and an MTP drafter (vLLM's, transformers'
    #: ``generate(use_mtp=True)``) does
    mtp_key: str | None = None
    notes: str = ""


_MISSING = object()


def _shown(v) -> str:
    """A config value as JSON with its kind: '"16" (a string)', '2.0 (a number)'."""
    kind = ("a boolean" if isinstance(v, bool) else
            "not a finite number" if isinstance(v, float) and not math.isfinite(v) else
            "a number" if isinstance(v, (int, float)) else
            "a string" if isinstance(v, str) else "a list" if isinstance(v, list) else
            "an object" if isinstance(v, dict) else "null" if v is None else type(v).__name__)
    text = json.dumps(v)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({kind})"


class ConfigReader:
    """Typed reads of config.json: a value of the wrong type (``"n_routed_experts": "16"``, a
    float top-k, a list or a bool where an integer goes) is refused naming the file and the key,
    never coerced. ``prefix``: where the values sit (``text_config.`` of a Llama-4 wrapper)."""

    def __init__(self, data: dict, prefix: str = ""):
        self.data, self.prefix = data, prefix

    def _bad(self, key: str, want: str, v) -> MoetoolError:
        return MoetoolError(f"config.json: {self.prefix}{key} must be {want}, got {_shown(v)}")

    def get(self, key: str, default=None):
        """The raw value (for keys only compared, never computed with)."""
        return self.data.get(key, default)

    def int(self, key: str, default=_MISSING, *, minimum: int = 1, maximum: int | None = None) -> int:
        """A JSON integer >= ``minimum`` (and <= ``maximum``); ``default`` when absent or null
        (missing: refused)."""
        v = self.data.get(key)
        if v is None:
            if default is _MISSING:
                raise MoetoolError(f"config.json: missing {self.prefix}{key}")
            return default
        if type(v) is not int:
            raise self._bad(key, "an integer", v)
        if v < minimum:
            raise self._bad(key, f"an integer of at least {minimum}", v)
        if maximum is not None and v > maximum:
            raise self._bad(key, f"an integer of at most {maximum}", v)
        return v

    def first_int(self, keys: tuple[str, ...], what: str) -> int:
        """The first of ``keys`` present (not null), as :meth:`int`."""
        for k in keys:
            if self.data.get(k) is not None:
                return self.int(k)
        raise MoetoolError(f"config.json: missing {what} (looked for {', '.join(self.prefix + k for k in keys)})")

    def number(self, key: str, default: float, *, positive: bool = False) -> float:
        """A JSON number (above 0 where ``positive``); ``default`` when absent or null."""
        v = self.data.get(key)
        if v is None:
            return float(default)
        try:
            finite = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        except OverflowError:  # an integer past a float's range
            finite = False
        if not finite:
            raise self._bad(key, "a finite number", v)
        if positive and v <= 0:
            raise self._bad(key, "a number above 0", v)
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        """A JSON boolean; ``default`` when absent (null reads as false, as it always did)."""
        v = self.data.get(key, default)
        if v is not None and not isinstance(v, bool):
            raise self._bad(key, "true or false", v)
        return bool(v)

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        v = self.data.get(key)
        if v is None:
            return default
        if v not in choices:
            raise self._bad(key, " or ".join(json.dumps(c) for c in choices), v)
        return v

    def int_list(self, key: str) -> list[int] | None:
        """A list of integers >= 0 (layer indices), or None when absent or null."""
        v = self.data.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(type(x) is int and x >= 0 for x in v):
            raise self._bad(key, "a list of layer indices (integers >= 0)", v)
        return v


def _hidden_act(config: ConfigReader) -> ExpertActivation:
    """SwiGLU experts: ``hidden_act`` "silu" (the default of every family's transformers
    config) or its alias "swish"; anything else is refused, never run as SiLU."""
    v = config.get("hidden_act")
    if v is not None and v not in SILU_NAMES:
        raise MoetoolError(f"config.json: {config.prefix}hidden_act {_shown(v)} is not supported (moetool runs "
                           f"SwiGLU experts: {' or '.join(json.dumps(n) for n in SILU_NAMES)})")
    return ExpertActivation("silu")


def _gpt_oss_act(config: ConfigReader) -> ExpertActivation:
    # transformers' GptOssExperts apply this whatever hidden_act says (and vLLM's swigluoai too)
    return ExpertActivation("clamped-swiglu", alpha=config.number("swiglu_alpha", 1.702),
                            limit=config.number("swiglu_limit", 7.0))


#: more decoder layers than any model has: a config above it is refused before a list of that
#: many layers is built (10**9 took the machine's memory)
MAX_LAYERS = 100_000


def _num_layers(config: ConfigReader) -> int:
    return config.int("num_hidden_layers", maximum=MAX_LAYERS)


def _every_layer_with_sparse_step(config: ConfigReader) -> list[int]:
    n = _num_layers(config)
    step = config.int("decoder_sparse_step", 1, minimum=0) or 1
    mlp_only = set(config.int_list("mlp_only_layers") or [])
    return [i for i in range(n) if i not in mlp_only and (i + 1) % step == 0]


def _all_layers(config: ConfigReader) -> list[int]:
    return list(range(_num_layers(config)))


def _deepseek_v2_layers(config: ConfigReader) -> list[int]:
    return _deepseek_layers(config, first_dense=0)


def _deepseek_v3_layers(config: ConfigReader) -> list[int]:
    return _deepseek_layers(config, first_dense=3)


def _deepseek_layers(config: ConfigReader, first_dense: int) -> list[int]:
    """From ``first_k_dense_replace`` (the default of transformers' config class when absent)
    on, every ``moe_layer_freq``-th layer, as vLLM builds them (transformers ignores the
    frequency: a checkpoint it saved with one above 1 holds experts in layers this calls dense,
    which :func:`describe` refuses)."""
    first = config.int("first_k_dense_replace", first_dense, minimum=0)
    freq = config.int("moe_layer_freq", 1, minimum=0) or 1
    return [i for i in range(first, _num_layers(config)) if i % freq == 0]


def _llama4_layers(config: ConfigReader) -> list[int]:
    layers = config.int_list("moe_layers")
    if layers is not None:
        return list(layers)
    step = config.int("interleave_moe_layer_step", 1, minimum=0) or 1
    return [i for i in range(_num_layers(config)) if (i + 1) % step == 0]


def _softmax_router(config: ConfigReader) -> RouterSpec:
    return RouterSpec(top_k=config.int("num_experts_per_tok"), scoring="softmax",
                      renormalize=config.bool("norm_topk_prob", False))


def _mixtral_router(config: ConfigReader) -> RouterSpec:
    return RouterSpec(top_k=config.int("num_experts_per_tok"), scoring="softmax", renormalize=True)


def _deepseek_v2_router(config: ConfigReader) -> RouterSpec:
    # the defaults of transformers' DeepseekV2Config, which vLLM reads the config through
    method = config.choice("topk_method", "greedy", ("greedy", "group_limited_greedy"))
    if config.bool("norm_topk_prob", False):
        # transformers' DeepseekV2 router never renormalizes (it scales); vLLM renormalizes and
        # scales; DeepSeek's own code renormalizes instead of scaling: no one model to check against
        raise MoetoolError(f"config.json: {config.prefix}norm_topk_prob true is not supported for deepseek_v2 "
                           "(transformers scales the top-k softmax weights without renormalizing them, vLLM "
                           "renormalizes: the served numerics are not one)")
    grouped = method == "group_limited_greedy"
    return RouterSpec(
        top_k=config.int("num_experts_per_tok"),
        scoring="softmax",
        renormalize=False,
        n_group=config.int("n_group") if grouped else None,
        topk_group=config.int("topk_group") if grouped else None,
        group_score="max",
        routed_scaling_factor=config.number("routed_scaling_factor", 1.0, positive=True),
    )


def _deepseek_v3_router(config: ConfigReader) -> RouterSpec:
    # the defaults of transformers' DeepseekV3Config, which vLLM reads the config through: a
    # config.json without routed_scaling_factor is served with 2.5, not 1
    method = config.choice("topk_method", "noaux_tc", ("noaux_tc", "greedy", "group_limited_greedy"))
    if method != "noaux_tc":  # vLLM then drops the correction bias the checkpoint holds; transformers uses it
        raise MoetoolError(f"config.json: {config.prefix}topk_method {json.dumps(method)} is not supported for "
                           "deepseek_v3 (transformers routes with the correction bias, vLLM without it): only \"noaux_tc\"")
    scoring = config.choice("scoring_func", "sigmoid", ("sigmoid", "softmax"))
    if scoring != "sigmoid":
        raise MoetoolError(f"config.json: {config.prefix}scoring_func {json.dumps(scoring)} is not supported for "
                           "deepseek_v3 (transformers scores by sigmoid whatever it says, vLLM by softmax): only \"sigmoid\"")
    n_group = config.int("n_group", 8)
    return RouterSpec(
        top_k=config.int("num_experts_per_tok", 8),
        scoring="sigmoid",
        renormalize=config.bool("norm_topk_prob", True),
        n_group=n_group if n_group > 1 else None,
        topk_group=config.int("topk_group", 4) if n_group > 1 else None,
        group_score="top2-sum",
        routed_scaling_factor=config.number("routed_scaling_factor", 2.5, positive=True),
        has_correction_bias=True,
    )


def _llama4_router(config: ConfigReader) -> RouterSpec:
    return RouterSpec(top_k=config.int("num_experts_per_tok"), scoring="sigmoid", renormalize=False,
                      apply_weight_on_input=True)


def _gpt_oss_router(config: ConfigReader) -> RouterSpec:
    # softmax over the k largest biased logits = softmax, top-k, renormalize
    key = "num_experts_per_tok" if config.get("num_experts_per_tok") else "experts_per_token"
    return RouterSpec(top_k=config.int(key), scoring="softmax", renormalize=True, has_router_bias=True)


FAMILIES: list[Family] = [
    Family("mixtral", ("mixtral",), "block_sparse_moe", "gate", ("w1", "w3", "w2"),
           ("num_local_experts",), ("intermediate_size",), _mixtral_router, _all_layers,
           moe_module_aliases=("mlp",)),
    Family("qwen2-moe", ("qwen2_moe",), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
           ("num_experts",), ("moe_intermediate_size",), _softmax_router, _every_layer_with_sparse_step,
           shared_module="shared_expert", shared_gate_module="shared_expert_gate",
           shared_intermediate=lambda c: c.int("shared_expert_intermediate_size")),
    Family("qwen3-moe", ("qwen3_moe",), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
           ("num_experts", "num_local_experts"), ("moe_intermediate_size",), _softmax_router, _every_layer_with_sparse_step),
    Family("olmoe", ("olmoe",), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
           ("num_experts",), ("intermediate_size",), _softmax_router, _all_layers),
    Family("deepseek-v2", ("deepseek_v2",), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
           ("n_routed_experts",), ("moe_intermediate_size",), _deepseek_v2_router, _deepseek_v2_layers,
           shared_module="shared_experts",
           shared_intermediate=lambda c: c.int("moe_intermediate_size") * c.int("n_shared_experts", 2, minimum=0)),
    Family("deepseek-v3", ("deepseek_v3", "kimi_k2"), "mlp", "gate", ("gate_proj", "up_proj", "down_proj"),
           ("n_routed_experts",), ("moe_intermediate_size",), _deepseek_v3_router, _deepseek_v3_layers,
           shared_module="shared_experts",
           shared_intermediate=lambda c: c.int("moe_intermediate_size") * c.int("n_shared_experts", 1, minimum=0),
           mtp_key="num_nextn_predict_layers"),
    Family("llama4", ("llama4_text", "llama4"), "feed_forward", "router", ("gate_proj", "up_proj", "down_proj"),
           ("num_local_experts",), ("intermediate_size",), _llama4_router, _llama4_layers,
           shared_module="shared_expert", shared_intermediate=lambda c: c.int("intermediate_size"),
           fused_input_first=True),
    Family("gpt-oss", ("gpt_oss",), "mlp", "router", ("gate_proj", "up_proj", "down_proj"),
           ("num_local_experts", "num_experts"), ("intermediate_size",), _gpt_oss_router, _all_layers,
           fused_interleaved=True, fused_input_first=True, router_has_bias=True, activation=_gpt_oss_act,
           notes="clamped SwiGLU, expert biases, router bias; --experts torch only"),
]
FAMILY_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}

# ----------------------------------------------------------------------------- resolved spec

StorageKind = Literal["per-expert", "fused", "stacked"]


@dataclass(frozen=True)
class ExpertStorage:
    """How one layer's routed experts sit on disk.

    per-expert: ``gate``/``up``/``down`` are base-name templates with ``{e}``; tensors are
      ``f"{base}.{suffix}"`` (suffix from the weight format: weight, weight_scale_inv...);
      ``has_bias``: each linear also has ``f"{base}.bias"``.
    fused: ``gate_up`` [E, 2N, H] (or input-first [E, H, 2N]) and ``down`` [E, H, N] (or
      [E, N, H]) are whole tensor names; ``interleaved`` = gate/up rows alternate (gpt-oss),
      else gate half then up half. Quantized (``fused_suffixes``, gpt-oss's mxfp4 release):
      the tensors are ``f"{gate_up}_{s}"`` for each s ("blocks", "scales"), output rows first,
      [E, rows, ...] (the format maps them to its own tensors). Optional
      ``gate_up_bias`` [E, 2N] (interleaved as the rows) / ``down_bias`` [E, H].
    stacked: our vLLM FusedMoE layout; ``gate_up``/``down`` are bases ``P.experts.w13``/
      ``P.experts.w2`` and tensors are ``f"{base}_{suffix}"`` with a leading E dim;
      ``has_bias``: ``w13_bias`` [E, 2N] (gate then up) and ``w2_bias`` [E, H] (vLLM's names).
    """

    kind: StorageKind
    gate: str = ""
    up: str = ""
    down: str = ""
    gate_up: str = ""
    interleaved: bool = False
    gate_up_input_first: bool = False
    down_input_first: bool = False
    gate_up_bias: str | None = None
    down_bias: str | None = None
    fused_suffixes: tuple[str, ...] = ()
    has_bias: bool = False

    def per_expert_bases(self, e: int) -> tuple[str, str, str]:
        return self.gate.format(e=e), self.up.format(e=e), self.down.format(e=e)

    @property
    def biased(self) -> bool:
        """The experts' linears have biases (gpt-oss)."""
        return self.has_bias or self.gate_up_bias is not None

    def describe(self) -> str:
        """'fused (interleaved gate/up) (input-first)', 'per-expert (biases)'..."""
        return (self.kind + (" (interleaved gate/up)" if self.interleaved else "")
                + (" (input-first)" if self.gate_up_input_first else "")
                + (f" ({', '.join(self.fused_suffixes)})" if self.fused_suffixes else "")
                + (" (biases)" if self.biased else ""))


@dataclass(frozen=True)
class MoELayerSpec:
    """One MoE layer. ``prefix`` is the MoE module (``model.layers.3.mlp``)."""

    index: int
    prefix: str
    num_experts: int
    hidden: int
    intermediate: int
    router: RouterSpec
    router_weight: str
    correction_bias: str | None
    storage: ExpertStorage
    shared: SharedExpertSpec | None = None
    shared_bases: tuple[str, str, str] | None = None  # (gate, up, down) base names
    shared_gate_weight: str | None = None
    router_bias: str | None = None
    #: experts present on disk (an EP rank folder holds fewer than ``num_experts``, by local slot)
    stored_experts: int = -1
    #: of the routed and the shared experts
    activation: ExpertActivation = ExpertActivation()

    @property
    def n_stored(self) -> int:
        return self.num_experts if self.stored_experts < 0 else self.stored_experts

    def per_expert_template(self, linear: str) -> str:
        """Canonical HF per-expert base names for output (``{e}`` placeholder)."""
        return f"{self.prefix}.experts.{{e}}.{linear}"


@dataclass(frozen=True)
class ModelSpec:
    family: Family
    model_type: str
    num_layers: int
    hidden: int
    moe_layers: list[MoELayerSpec]
    dense_layers: list[int] = field(default_factory=list)

    @property
    def num_experts(self) -> int:
        return max((m.num_experts for m in self.moe_layers), default=0)

    @property
    def top_k(self) -> int:
        return max((m.router.top_k for m in self.moe_layers), default=0)

    @property
    def activation(self) -> ExpertActivation:
        """Of every expert MLP (routed and shared): one per model."""
        return self.moe_layers[0].activation if self.moe_layers else ExpertActivation()

    def layer(self, index: int) -> MoELayerSpec:
        for m in self.moe_layers:
            if m.index == index:
                return m
        raise MoetoolError(f"layer {index} is not a MoE layer (MoE layers: {[m.index for m in self.moe_layers]})")


def supported_families() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)


def family_for(config: dict) -> Family:
    model_type = config.get("model_type")
    if model_type is None and isinstance(config.get("text_config"), dict):
        model_type = config["text_config"].get("model_type")
    fam = FAMILY_BY_MODEL_TYPE.get(model_type)
    if fam is None:
        raise MoetoolError(f"config.json: unsupported architecture model_type={model_type!r}; supported: {supported_families()}")
    return fam


def text_config(config: dict) -> dict:
    """Multimodal wrappers (Llama-4) keep the language model under text_config."""
    if config.get("model_type") == "llama4" and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def _has_linear(names: set[str], base: str) -> bool:
    """A linear exists in any format: base.weight or base.weight_packed."""
    return f"{base}.weight" in names or f"{base}.weight_packed" in names


def _layer_prefix(names: set[str], i: int) -> str:
    for p in (f"model.layers.{i}", f"language_model.model.layers.{i}", f"model.language_model.layers.{i}"):
        if any(n.startswith(p + ".") for n in names):
            return p
    return f"model.layers.{i}"


def describe(config: dict, tensors: dict, stored_experts: dict[int, int] | None = None) -> ModelSpec:
    """Resolve the family against config.json and the tensors present.

    ``tensors``: {name: TensorInfo-like with .shape}. Every MoE layer must have its router and
    all its experts (by name and shape) or a MoetoolError names what is missing.
    ``stored_experts``: for EP rank folders, how many experts (local slots) each layer holds.
    """
    family = family_for(config)
    cfg = text_config(config)
    ep = config.get("moetool_ep")
    if stored_experts is None and isinstance(ep, dict) and isinstance(ep.get("stored_experts"), dict):
        # one rank folder of ``moetool shard``: it stores only its local slots
        try:
            stored_experts = {int(k): int(v) for k, v in ep["stored_experts"].items()}
        except (TypeError, ValueError):
            raise MoetoolError(f"config.json: moetool_ep.stored_experts must map layer indices to expert counts, "
                               f"got {_shown(ep['stored_experts'])}") from None
    names = set(tensors)
    conf = ConfigReader(cfg, "text_config." if cfg is not config else "")
    hidden = conf.first_int(("hidden_size",), "hidden_size")
    num_experts = conf.first_int(family.num_experts, "expert count")
    intermediate = conf.first_int(family.intermediate, "expert intermediate size")
    n_layers = conf.first_int(("num_hidden_layers",), "num_hidden_layers")
    router = family.router(conf)
    activation = (family.activation or _hidden_act)(conf)
    moe_indices = family.moe_layers(conf)
    mtp_indices, mtp_unrouted = _mtp_layers(family, conf, names, n_layers)
    if stored_experts is not None:  # a rank folder of a shard made before MTP layers were MoE layers
        mtp_indices = [i for i in mtp_indices if i in stored_experts]
    moe_indices = moe_indices + mtp_indices
    if router.top_k < 1 or router.top_k > num_experts:
        raise MoetoolError(f"config.json: top-k {router.top_k} must be between 1 and the expert count {num_experts}")
    if router.apply_weight_on_input and router.top_k != 1:
        # vLLM applies the weight on the input for top-1 only: the served numerics do not exist
        raise MoetoolError(f"config.json: {conf.prefix}num_experts_per_tok {router.top_k} with the router weight "
                           "applied to the input (Llama-4) is not supported: only top-1 is")
    if router.n_group is not None and (num_experts % router.n_group or not 1 <= (router.topk_group or 0) <= router.n_group):
        raise MoetoolError(f"config.json: {conf.prefix}n_group {router.n_group} must divide the expert count "
                           f"{num_experts} and topk_group {router.topk_group} must be between 1 and it")
    layers = []
    highest = _highest_expert_ids(names)
    for i in moe_indices:
        lp = _layer_prefix(names, i)
        prefix = _moe_prefix(family, lp, names)
        n_stored = stored_experts.get(i, 0) if stored_experts is not None else num_experts
        storage = _detect_storage(family, prefix, names, tensors, n_stored, hidden, intermediate)
        if highest.get(prefix, -1) >= n_stored:  # copied as a plain tensor, unconverted, it would go unseen
            raise MoetoolError(f"{prefix}.experts.{highest[prefix]}: a tensor of expert {highest[prefix]}, but the "
                               f"layer has {n_stored} experts (config.json)")
        router_weight = f"{prefix}.{family.router_module}.weight"
        if router_weight not in names:
            raise MoetoolError(f"layer {i}: router weight {router_weight} not found")
        rshape = tuple(tensors[router_weight].shape)
        if rshape != (num_experts, hidden):
            raise MoetoolError(f"{router_weight}: shape {list(rshape)}, expected [{num_experts}, {hidden}]")
        bias = None
        if router.has_correction_bias:
            bias = f"{prefix}.{family.router_module}.e_score_correction_bias"
            if bias not in names:
                raise MoetoolError(f"layer {i}: router correction bias {bias} not found")
        shared = shared_bases = shared_gate = None
        if family.shared_module and family.shared_intermediate:
            sbase = f"{prefix}.{family.shared_module}"
            if _has_linear(names, f"{sbase}.gate_proj"):
                shared_bases = (f"{sbase}.gate_proj", f"{sbase}.up_proj", f"{sbase}.down_proj")
                for b in shared_bases:
                    if not _has_linear(names, b):
                        raise MoetoolError(f"layer {i}: shared expert tensor {b}.weight not found")
                for b in shared_bases:
                    if f"{b}.bias" in names:
                        raise MoetoolError(f"{b}.bias: shared experts with biases are not supported "
                                           f"(config.json mlp_bias)")
                if family.shared_gate_module:
                    # transformers and vLLM always gate the shared expert: one without its gate
                    # would be run as something neither serves
                    shared_gate = f"{prefix}.{family.shared_gate_module}.weight"
                    if shared_gate not in names:
                        raise MoetoolError(f"layer {i}: shared expert gate {shared_gate} not found")
                try:
                    shared_intermediate = family.shared_intermediate(conf)
                except MoetoolError as e:
                    if not str(e).startswith("config.json: missing "):
                        raise
                    raise MoetoolError(f"{e} (layer {i} has a shared expert)") from None
                shared = SharedExpertSpec(intermediate=shared_intermediate, has_gate=shared_gate is not None)
        router_bias = None
        if router.has_router_bias:
            router_bias = f"{prefix}.{family.router_module}.bias"
            if router_bias not in names:
                raise MoetoolError(f"layer {i}: router bias {router_bias} not found")
            if tuple(tensors[router_bias].shape) != (num_experts,):
                raise MoetoolError(f"{router_bias}: shape {list(tensors[router_bias].shape)}, expected [{num_experts}]")
        layers.append(MoELayerSpec(i, prefix, num_experts, hidden, intermediate, router, router_weight, bias, storage,
                                   shared, shared_bases, shared_gate, router_bias,
                                   stored_experts=-1 if stored_experts is None else n_stored, activation=activation))
    layers = _without_mtp_of_another_format(layers, n_layers, names)
    moe_indices = [m.index for m in layers]
    if not layers:
        raise MoetoolError(f"config.json: {family.name} model has no MoE layers")
    dense = [i for i in range(n_layers) if i not in set(moe_indices)]
    _check_dense_layers(family, names, dense, mtp_unrouted)
    return ModelSpec(family, cfg.get("model_type", ""), n_layers, hidden, layers, dense)


def _without_mtp_of_another_format(layers: list[MoELayerSpec], n_layers: int, names: set[str]) -> list[MoELayerSpec]:
    """``layers`` less the MTP layers whose experts are stored with other tensors than the
    decoder's (a quantized output of moetool before 0.1's MTP handling kept them unquantized,
    in its ignore list): as then, they are plain tensors, copied as they are."""
    decoder = [m for m in layers if m.index < n_layers]
    if not decoder:
        return layers
    kept = _expert_suffixes(decoder[0], names)
    return [m for m in layers if m.index < n_layers or _expert_suffixes(m, names) == kept]


def _expert_suffixes(layer: MoELayerSpec, names: set[str]) -> frozenset[str]:
    """What expert 0's first linear stores (``weight``, ``weight_scale_inv``...; stacked: the
    ``w13_*`` tensors), which says its format."""
    st = layer.storage
    base, sep = (st.per_expert_bases(0)[0], ".") if st.kind == "per-expert" else (st.gate_up, "_")
    return frozenset(n[len(base) + 1:] for n in names if n.startswith(base + sep) and "." not in n[len(base) + 1:])


def _mtp_layers(family: Family, config: ConfigReader, names: set[str], n_layers: int) -> tuple[list[int], list[int]]:
    """The multi-token-prediction layers of the config's count after the decoder layers, as
    (those holding a router, those holding none). The first are MoE layers: their experts are
    converted, sharded and verified as any MoE layer's (transformers saves none; DeepSeek's
    releases keep theirs); one of the second that holds experts is refused by
    :func:`_check_dense_layers`."""
    if family.mtp_key is None:
        return [], []
    count = config.int(family.mtp_key, 1, minimum=0, maximum=MAX_LAYERS)  # transformers' num_mtp_layers: 1
    layers = range(n_layers, n_layers + count)
    routed = {i for i in layers
              if _moe_prefix(family, _layer_prefix(names, i), names) + f".{family.router_module}.weight" in names}
    return [i for i in layers if i in routed], [i for i in layers if i not in routed]


def _check_dense_layers(family: Family, names: set[str], dense: list[int], mtp_unrouted: list[int]) -> None:
    """A layer the config makes dense, or an MTP layer without its router, holds no router and
    no experts: left as plain tensors they would be copied unquantized into every rank and
    never checked (transformers' DeepSeek saves experts in every layer from
    ``first_k_dense_replace`` on, whatever ``moe_layer_freq`` says; vLLM builds dense MLPs
    where it says so)."""
    if not dense and not mtp_unrouted:
        return
    by_layer: dict[int, str] = {}
    pattern = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:%s)\.(?:%s\.weight|experts\.)" % (
        "|".join(re.escape(m) for m in (family.moe_module, *family.moe_module_aliases)), re.escape(family.router_module)))
    for name in names:
        m = pattern.match(name)
        if m:
            by_layer.setdefault(int(m[1]), name)
    for i in mtp_unrouted:
        if i in by_layer:
            raise MoetoolError(f"{by_layer[i]}: layer {i}, a multi-token-prediction layer, holds experts but not "
                               f"its router (.{family.moe_module}.{family.router_module}.weight)")
    for i in dense:
        if i in by_layer:
            raise MoetoolError(f"{by_layer[i]}: layer {i} holds MoE tensors, but config.json makes it a dense layer "
                               f"(its MoE layers: first_k_dense_replace, moe_layer_freq, decoder_sparse_step, "
                               f"mlp_only_layers or moe_layers); the checkpoint and its config disagree")


def _moe_prefix(family: Family, layer_prefix: str, names: set[str]) -> str:
    """The layer's MoE module: the family's name, or an alias (Mixtral v5: ``mlp``) where that
    one holds the router and the family's name does not."""
    for module in (family.moe_module, *family.moe_module_aliases):
        if f"{layer_prefix}.{module}.{family.router_module}.weight" in names:
            return f"{layer_prefix}.{module}"
    return f"{layer_prefix}.{family.moe_module}"


def _detect_storage(family: Family, prefix: str, names: set[str], tensors: dict, E: int, H: int, N: int) -> ExpertStorage:
    """E: experts stored on disk."""
    if any(n.startswith(f"{prefix}.experts.w13_") for n in names):
        st = ExpertStorage("stacked", gate_up=f"{prefix}.experts.w13", down=f"{prefix}.experts.w2",
                           has_bias=f"{prefix}.experts.w13_bias" in names)
        for base in (st.gate_up, st.down):
            if not any(n.startswith(base + "_") and n != f"{base}_bias" for n in names):
                raise MoetoolError(f"{prefix}: stacked experts tensor {base}_weight not found")
        if st.has_bias:
            _check_biases(names, tensors, f"{st.gate_up}_bias", f"{st.down}_bias", E, H, N)
        return st
    fused, down = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
    gb, db = f"{fused}_bias", f"{down}_bias"
    # a format's fused layout (gpt-oss's _blocks / _scales) when there is no plain gate_up_proj
    quantized = () if fused in names else tuple(sorted(n[len(fused) + 1:] for n in names
                                                       if n.startswith(fused + "_") and n != gb))
    if fused in names or quantized:
        for name in (down,) if fused in names else (f"{down}_{s}" for s in quantized):
            if name not in names:
                raise MoetoolError(f"{prefix}: fused experts tensor {name} not found")
        biases = gb in names or db in names
        if biases:
            _check_biases(names, tensors, gb, db, E, H, N)
        if quantized:  # output rows first: [E, 2N, ...] and [E, H, ...], the rest the format's
            for name, rows in ((f"{fused}_{quantized[0]}", 2 * N), (f"{down}_{quantized[0]}", H)):
                shape = list(tensors[name].shape)
                if shape[:2] != [E, rows]:
                    raise MoetoolError(f"{name}: shape {shape}, expected [{E}, {rows}, ...] (experts, output rows)")
            return ExpertStorage("fused", gate_up=fused, down=down, interleaved=family.fused_interleaved,
                                 gate_up_bias=gb if biases else None, down_bias=db if biases else None,
                                 fused_suffixes=quantized)
        gu, dn = tuple(tensors[fused].shape), tuple(tensors[down].shape)
        gate_up_input_first = _input_first(fused, gu, (E, 2 * N, H), (E, H, 2 * N), family.fused_input_first)
        down_input_first = _input_first(down, dn, (E, H, N), (E, N, H), family.fused_input_first)
        return ExpertStorage("fused", gate_up=fused, down=down, interleaved=family.fused_interleaved,
                             gate_up_input_first=gate_up_input_first, down_input_first=down_input_first,
                             gate_up_bias=gb if biases else None, down_bias=db if biases else None)
    g, u, d = (f"{prefix}.experts.{{e}}.{lin}" for lin in family.expert_linears)
    st = ExpertStorage("per-expert", gate=g, up=u, down=d, has_bias=f"{g.format(e=0)}.bias" in names)
    for e in range(E):
        for base, rows, cols in zip(st.per_expert_bases(e), (N, N, H), (H, H, N)):
            if not _has_linear(names, base):
                raise MoetoolError(f"{prefix}: expert {e} tensor {base}.weight not found ({E} experts expected)")
            weight = tensors.get(f"{base}.weight")  # a plain or fp8 weight holds the linear's own shape
            if weight is not None and list(weight.shape) != [rows, cols]:
                raise MoetoolError(f"{base}.weight: shape {list(weight.shape)}, but config.json gives [{rows}, {cols}] "
                                   "(hidden size and expert intermediate size)")
            bias = f"{base}.bias"
            if (bias in names) != st.has_bias:
                raise MoetoolError(f"{prefix}: expert {e} tensor {bias} " + ("not found (expert 0 has biases)"
                                   if st.has_bias else "found, but expert 0 has no biases"))
            if st.has_bias and tuple(tensors[bias].shape) != (rows,):
                raise MoetoolError(f"{bias}: shape {list(tensors[bias].shape)}, expected [{rows}]")
    return st


_EXPERT_ID = re.compile(r"(.+)\.experts\.(\d+)\.")


def _highest_expert_ids(names: set[str]) -> dict[str, int]:
    """{MoE block prefix: the highest expert id a tensor name holds} (``P.experts.N.``)."""
    highest: dict[str, int] = {}
    for name in names:
        m = _EXPERT_ID.match(name)
        if m:
            highest[m[1]] = max(highest.get(m[1], -1), int(m[2]))
    return highest


def _check_biases(names: set[str], tensors: dict, gate_up: str, down: str, E: int, H: int, N: int) -> None:
    """Both expert bias tensors of a fused or stacked layer, [E, 2N] and [E, H]."""
    for name, shape in ((gate_up, (E, 2 * N)), (down, (E, H))):
        if name not in names:
            raise MoetoolError(f"{name}: not found (the experts' other linear has biases)")
        if tuple(tensors[name].shape) != shape:
            raise MoetoolError(f"{name}: shape {list(tensors[name].shape)}, expected {list(shape)}")


def _input_first(name: str, shape: tuple, out_first: tuple, in_first: tuple, default: bool) -> bool:
    if shape == out_first and shape == in_first:
        return default
    if shape == out_first:
        return False
    if shape == in_first:
        return True
    raise MoetoolError(f"{name}: shape {list(shape)}, expected {list(out_first)} or input-first {list(in_first)}")
