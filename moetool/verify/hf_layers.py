"""transformers' own modules for a checkpoint, built on the meta device and filled one module
at a time (the whole-model check's reference, and the converted side's attention, norms and
dense MLPs).

A :class:`Skeleton` is the family's ``*ForCausalLM`` built on the meta device from a config.json
(no memory); its decoder layers, embeddings, final norm and ``lm_head`` are filled from a
checkpoint when used (``load_state_dict(assign=True, strict=True)``) and emptied back to meta
afterwards, so a process holds one layer's weights at a time. The per-layer arguments
(rotary cos/sin, attention masks of each layer type) are taken from the family's own model
``forward``, run once with recording stand-ins in place of the layers.

transformers v5 keeps routed experts fused in memory (``experts.gate_up_proj`` [E, 2N, H] gate
half first, ``experts.down_proj`` [E, H, N]; input-first [E, H, 2N] / [E, N, H] for Llama-4 and
gpt-oss, gpt-oss with gate/up columns interleaved and the biases ``gate_up_proj_bias`` [E, 2N]
(interleaved) / ``down_proj_bias`` [E, H]) while checkpoints may hold per-expert tensors, or
gpt-oss's MXFP4 blocks: they are read with moetool's ExpertReader (dequantized to fp32) and
stacked into the module's layout. Every tensor is float32.
Letters: B = sequences, S = sequence length, H = hidden, E = experts, N = expert intermediate.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

try:  # optional: `pip install "moetool[model]"`; only --whole-model needs it
    import transformers
except ImportError:
    transformers = None

from moetool.errors import MoetoolError
from moetool.model.families import ModelSpec, text_config
from moetool.read.checkpoint import Checkpoint
from moetool.read.experts import ExpertReader

INSTALL_HINT = 'pip install "moetool[model]"'
#: config.json keys moetool adds or rewrites; not part of the model's math
MOETOOL_KEYS = ("moetool_ep", "quantization_config")
#: model_type of a config.json -> the transformers model_type that runs it (same architecture;
#: Kimi-K2 ships DeepSeek-V3's modeling code under its own name)
TRANSFORMERS_MODEL_TYPE = {"kimi_k2": "deepseek_v3"}
#: the decoder layer's attribute holding its MLP / MoE block, by family (in memory)
MLP_ATTRS = ("mlp", "feed_forward", "block_sparse_moe")
#: transformers' fused routed-expert tensors, built from the checkpoint's experts whatever
#: their storage (per-expert, stacked, fused, a format's fused layout)
FUSED_EXPERT_TENSORS = (".experts.gate_up_proj", ".experts.down_proj", ".experts.gate_up_proj_bias",
                        ".experts.down_proj_bias")


def require_transformers():
    """The transformers module, or a one-line error saying what to install."""
    if transformers is None:
        raise MoetoolError(f"--whole-model runs transformers' own modules: {INSTALL_HINT}")
    return transformers


def hf_config(config: dict):
    """A transformers config object from a config.json dict (moetool's keys dropped), eager
    attention (plain matmuls, the same on every device and batch)."""
    require_transformers()
    cfg = {k: v for k, v in text_config(config).items() if k not in MOETOOL_KEYS}
    model_type = cfg.pop("model_type", None)
    model_type = TRANSFORMERS_MODEL_TYPE.get(model_type, model_type)
    try:
        out = transformers.AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as e:
        raise MoetoolError(f"config.json: transformers cannot build model_type {model_type!r}: {e}") from None
    out._attn_implementation = "eager"
    return out


def causal_lm_class(cfg) -> type:
    """transformers' causal-LM class of a config object (importing its modeling module: seconds
    of small reads on a cold disk)."""
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(cfg)]
    except KeyError:
        raise MoetoolError(f"transformers has no causal LM for model_type {cfg.model_type!r}") from None


class _Recorder(nn.Module):
    """Stands in for decoder layer i while the model's forward runs once: keeps the arguments
    the layer is called with and returns the hidden states unchanged."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for attr in ("attention_type", "is_moe_layer", "use_chunked_attention", "layer_idx"):
            if hasattr(layer, attr):
                setattr(self, attr, getattr(layer, attr))
        self.args: tuple = ()
        self.kwargs: dict = {}

    def forward(self, hidden_states, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        return hidden_states


class Skeleton:
    """The family's causal-LM module tree on the meta device, filled from ``ckpt`` on demand."""

    def __init__(self, config: dict, ckpt: Checkpoint, spec: ModelSpec, reader: ExpertReader,
                 device: torch.device | None = None):
        require_transformers()
        self.cfg = hf_config(config)
        self.ckpt, self.spec, self.reader = ckpt, spec, reader
        #: where filled modules compute (the rank's device)
        self.device = device or torch.device("cpu")
        if self.device.type == "cuda":  # page-locked reads: the copies to the GPU run at full speed
            ckpt.pin_memory = True
        with torch.device("meta"):
            self.model = causal_lm_class(self.cfg)(self.cfg)
        self.model.eval()
        base = getattr(self.model, "model", None) or self.model.base_model  # the decoder stack
        self.base = base
        # rotary embeddings hold computed (non-persistent) buffers: build them for real
        for name, mod in list(base.named_children()):
            if "rotary" in name:
                setattr(base, name, type(mod)(config=self.cfg).to(self.device))
        self.layers: nn.ModuleList = base.layers
        # the decoder's MoE layers: the causal LM neither loads nor runs a multi-token-prediction
        # layer (DeepSeek-V3's layer 61; only generate(use_mtp=True)'s MtpModel does), which
        # MoE-only verify checks as a block
        self.moe_index = {m.index: m for m in spec.moe_layers if m.index < len(self.layers)}
        #: bytes of weights filled now, and the most at any time (the memory bound, measured)
        self.held_bytes = self.peak_bytes = 0
        #: in-memory name prefix -> on-disk prefix: a multimodal wrapper (Llama-4) keeps the
        #: text model under language_model.
        self.roots = {"model.": "model.", "lm_head.": "lm_head."}
        for root, head in (("language_model.model.", "language_model.lm_head."), ("model.language_model.", "lm_head.")):
            if any(n.startswith(root + "layers.") for n in ckpt.tensors):
                self.roots = {"model.": root, "lm_head.": head}

    # -- per-layer arguments ------------------------------------------------------------------
    @torch.no_grad()
    def layer_arguments(self, batch: int, seq: int) -> list[tuple[tuple, dict]]:
        """(args, kwargs) each decoder layer is called with for a [B, S] batch, as the family's
        model forward makes them (rotary cos/sin, the mask of each layer's attention type)."""
        real, norm = self.base.layers, self.base.norm
        recorders = nn.ModuleList([_Recorder(l) for l in real])
        self.base.layers, self.base.norm = recorders, nn.Identity()
        try:
            x = torch.zeros(batch, seq, self.cfg.hidden_size, device=self.device)
            self.base(inputs_embeds=x, use_cache=False)
        finally:
            self.base.layers, self.base.norm = real, norm
        return [(r.args, r.kwargs) for r in recorders]

    # -- filling --------------------------------------------------------------------------------
    def mlp_attr(self, layer: nn.Module) -> str:
        for a in MLP_ATTRS:
            if hasattr(layer, a):
                return a
        raise MoetoolError(f"{type(layer).__name__}: no MLP block found (looked for {', '.join(MLP_ATTRS)})")

    def fill(self, module: nn.Module, prefix: str, disk_prefix: str | None = None) -> nn.Module:
        """Fill ``module`` (in-memory names under ``prefix``, e.g. ``model.layers.3.``) from the
        checkpoint; strict: every parameter and persistent buffer, each shape checked."""
        disk_prefix = self.disk_name(prefix) if disk_prefix is None else disk_prefix
        state = {}
        for name, t in module.state_dict(keep_vars=True).items():
            state[name] = self._tensor(prefix + name, disk_prefix + name, tuple(t.shape))
        module.load_state_dict(state, strict=True, assign=True)
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_meta:
                raise MoetoolError(f"{prefix}{name}: not filled from {self.ckpt.root}")
        self.held_bytes += _bytes(module)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return module

    def disk_name(self, name: str) -> str:
        """The checkpoint's name of an in-memory name (``model.layers.0.`` ->
        ``language_model.model.layers.0.`` in a Llama-4 wrapper)."""
        for mem, disk in self.roots.items():
            if name.startswith(mem):
                return disk + name[len(mem):]
        return name

    def empty(self, module: nn.Module) -> None:
        """Give a filled module's memory back (its tensors go back to the meta device)."""
        self.held_bytes -= _bytes(module)
        module.to("meta")

    def _tensor(self, mem_name: str, disk_name: str, shape: tuple) -> torch.Tensor:
        t = self._read(mem_name, disk_name, shape)
        if tuple(t.shape) != shape:
            raise MoetoolError(f"{self.ckpt.root}: {disk_name} has shape {list(t.shape)}, transformers' "
                               f"{mem_name} needs {list(shape)}")
        return t.to(device=self.device, dtype=torch.float32).contiguous()

    def _locate(self, mem_name: str, disk_name: str) -> tuple[str, str]:
        """Where an in-memory tensor comes from: ("experts", "") for the fused routed experts,
        ("tensor", name) for a stored tensor, ("linear", base) for a quantized linear."""
        layer = _layer_index(mem_name)
        moe = self.moe_index.get(layer) if layer is not None else None
        if moe is not None and mem_name.endswith(FUSED_EXPERT_TENSORS):
            return "experts", ""
        candidates = [disk_name]
        if moe is not None:  # Mixtral: mlp in memory, block_sparse_moe on disk
            moe_attr = moe.prefix.rsplit(".", 1)[1]
            for a in MLP_ATTRS:
                candidates.append(disk_name.replace(f".{a}.", f".{moe_attr}.", 1))
        if mem_name.endswith("lm_head.weight") and getattr(self.cfg, "tie_word_embeddings", False):
            candidates.append(self.disk_name("model.embed_tokens.weight"))
        for name in candidates:
            base, _, last = name.rpartition(".")
            if name in self.ckpt:
                if last == "weight" and len(self.ckpt.suffixes(base)) > 1 and self.reader.linear_format(base).name != "dense":
                    return "linear", base
                return "tensor", name
            if last == "weight" and self.ckpt.suffixes(base):  # quantized linear (weight_packed, ...)
                return "linear", base
        raise MoetoolError(f"{self.ckpt.root}: no tensor for transformers' {mem_name} (looked for "
                           f"{', '.join(dict.fromkeys(candidates))}); is it a {self.cfg.model_type} checkpoint "
                           "as transformers stores it?")

    def _read(self, mem_name: str, disk_name: str, shape: tuple) -> torch.Tensor:
        kind, name = self._locate(mem_name, disk_name)
        if kind == "experts":
            moe = self.moe_index[_layer_index(mem_name)]
            if mem_name.endswith("_bias"):
                return self._fused_biases(moe, mem_name.endswith("gate_up_proj_bias"))
            return self._fused_experts(moe, mem_name.endswith("gate_up_proj"), shape)
        return self.reader.dequantize_any(name) if kind == "linear" else self.ckpt.get(name)

    def check(self, *, moe_blocks: bool = True) -> None:
        """Before any rank starts: every tensor transformers' modules need is in the checkpoint,
        with its shape (``moe_blocks=False``: not the MoE blocks, which the converted side runs
        with moetool's forward from tensors ``describe`` has checked)."""
        if moe_blocks:
            self._check_activation()
        skip = tuple(f"model.layers.{i}.{self.mlp_attr(self.layers[i])}." for i in self.moe_index) if not moe_blocks else ()
        for mem_name, t in self.model.state_dict(keep_vars=True).items():
            if mem_name.startswith(skip):
                continue
            kind, name = self._locate(mem_name, self.disk_name(mem_name))
            if kind == "tensor" and tuple(self.ckpt.info(name).shape) != tuple(t.shape):
                raise MoetoolError(f"{self.ckpt.root}: {name} has shape {list(self.ckpt.info(name).shape)}, "
                                   f"transformers' {mem_name} needs {list(t.shape)}")

    def _check_activation(self) -> None:
        """transformers' experts clamp as the config says. Versions up to 5.18 hold gpt-oss's
        ``alpha`` and ``limit`` as constants (1.702 and 7.0, whatever ``swiglu_limit``
        says): such modules cannot be the reference of a checkpoint that sets other values."""
        act = self.spec.activation
        if act.kind != "clamped-swiglu" or not self.moe_index:
            return
        layer = self.layers[next(iter(self.moe_index))]  # every MoE layer's experts are one class
        experts = getattr(getattr(layer, self.mlp_attr(layer)), "experts", None)
        held = getattr(experts, "alpha", None), getattr(experts, "limit", None)
        if None not in held and (float(held[0]), float(held[1])) != (act.alpha, act.limit):
            raise MoetoolError(
                f"{self.ckpt.root}: transformers {transformers.__version__}'s {type(experts).__name__} computes "
                f"the clamped SwiGLU with alpha {held[0]:g}, limit {held[1]:g} whatever config.json says (alpha "
                f"{act.alpha:g}, limit {act.limit:g}): it cannot be this checkpoint's reference; install a "
                "transformers that reads them (5.19 or later)")

    def _fused_experts(self, moe, gate_up: bool, shape: tuple) -> torch.Tensor:
        """[E, 2N, H] / [E, H, N] (or input-first) from the checkpoint's experts, fp32, made on
        this skeleton's device one expert at a time: the expert's stored bytes (only the linears
        this tensor needs) go to the device as they are and are dequantized there, while a
        thread reads the next expert's (host memory: two experts' stored bytes, not the layer)."""
        E, H, N = moe.num_experts, moe.hidden, moe.intermediate
        input_first = shape == ((E, H, 2 * N) if gate_up else (E, N, H)) and (
            shape != ((E, 2 * N, H) if gate_up else (E, H, N)) or self.spec.family.fused_input_first)
        interleaved = self.spec.family.fused_interleaved  # gpt-oss: gate and up alternate
        roles = ("gate", "up") if gate_up else ("down",)
        out = torch.empty(shape, dtype=torch.float32, device=self.device)  # no second copy
        for e, w in self.reader.iter_fp32(moe, self.device, roles):
            if gate_up:
                g, u = w  # [N, H] each
                w = torch.stack([g, u], 1).reshape(2 * N, H) if interleaved else torch.cat([g, u])
            else:
                w = w[0]  # [H, N]
            out[e] = w.t() if input_first else w
        return out

    def _fused_biases(self, moe, gate_up: bool) -> torch.Tensor:
        """[E, 2N] (gate and up as the weight's columns) or [E, H] from the experts' biases."""
        interleaved = self.spec.family.fused_interleaved
        rows = []
        for e in range(moe.num_experts):
            biases = self.reader.biases(moe, e)
            if biases is None:
                raise MoetoolError(f"{self.ckpt.root}: layer {moe.index}'s experts have no biases; transformers' "
                                   f"{self.cfg.model_type} experts need them")
            g, u, d = (b.float() for b in biases)
            rows.append((torch.stack([g, u], 1).reshape(-1) if interleaved else torch.cat([g, u])) if gate_up else d)
        return torch.stack(rows)


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values() if not t.is_meta)


def _layer_index(name: str) -> int | None:
    head, sep, tail = name.partition(".layers.")
    if not sep:
        return None
    try:
        return int(tail.split(".", 1)[0])
    except ValueError:
        return None


def capture(module: nn.Module, store: dict, key: str) -> Callable[[], None]:
    """Keep ``module``'s first input and its output (first element of a tuple) in ``store``
    under ``key``; returns the function that removes the hook."""

    def hook(mod, args, kwargs, out):
        x = args[0] if args else kwargs.get("hidden_states")
        store[key] = (x, out[0] if isinstance(out, tuple) else out)

    return module.register_forward_hook(hook, with_kwargs=True).remove
