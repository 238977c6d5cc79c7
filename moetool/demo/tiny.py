"""Tiny synthetic MoE checkpoints in the real on-disk layout of each family, written with our
own streaming writer. Used by ``moetool demo`` and the tests (no download, a few MB).

Each is a whole model transformers loads (``AutoModelForCausalLM.from_pretrained``, no missing
and no unexpected weights): the family's own attention (GQA with Qwen2-MoE's q/k/v biases,
Qwen3-MoE's per-head and OLMoE's whole-projection q/k norms, gpt-oss's biases and sinks,
DeepSeek-V2/V3's multi-head latent attention) and every config key its transformers config
reads, so ``verify --whole-model`` runs on it too.
"""
from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch

from moetool.convert.output import OutputDir
from moetool.read.safetensors import SAFETENSORS_METADATA, TensorSpec

FAMILY_CONFIGS = {
    "mixtral": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts="E",
                    intermediate_size="N"),
    "qwen2_moe": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts="E",
                      moe_intermediate_size="N", intermediate_size="2N", shared_expert_intermediate_size="2N",
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts="E",
                      moe_intermediate_size="N", intermediate_size="2N", norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[]),
    "olmoe": dict(model_type="olmoe", architectures=["OlmoeForCausalLM"], num_experts="E", intermediate_size="N",
                  norm_topk_prob=False),
    "deepseek_v2": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], n_routed_experts="E",
                        moe_intermediate_size="N", intermediate_size="2N", n_shared_experts=2, first_k_dense_replace=1,
                        n_group=4, topk_group=2, topk_method="group_limited_greedy", norm_topk_prob=False,
                        routed_scaling_factor=1.0),
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], n_routed_experts="E",
                        moe_intermediate_size="N", intermediate_size="2N", n_shared_experts=1, first_k_dense_replace=1,
                        n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                        routed_scaling_factor=2.5),
    "llama4": dict(model_type="llama4_text", architectures=["Llama4ForCausalLM"], num_local_experts="E",
                   intermediate_size="N", intermediate_size_mlp="2N", interleave_moe_layer_step=1),
    "gpt_oss": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_local_experts="E",
                    intermediate_size="N", swiglu_limit=7.0),
}
FAMILY_LAYOUT = {  # moe module, router module, per-expert linear names (None = fused on disk)
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v2": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "llama4": ("feed_forward", "router", None),
    "gpt_oss": ("mlp", "router", None),
}
#: families with multi-head latent attention (q_a/q_b, kv_a_proj_with_mqa/kv_b, their norms)
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
HEADS = 4
#: the two layouts transformers saves (see tiny_tensors)
LAYOUTS = ("original", "v5")
#: the MoE module where transformers' v5 layout renames it
V5_MOE_MODULE = {"mixtral": "mlp"}


def tiny_config(family: str, *, hidden: int, intermediate: int, experts: int, top_k: int, layers: int,
                dtype: torch.dtype) -> dict:
    """config.json of a tiny model: ``HEADS`` attention heads of hidden / HEADS (a multiple of
    16: MLA's rotary part is half a head), 2 key-value heads (MLA: one per head), MLA ranks
    hidden / 2 (q) and hidden / 4 (kv)."""
    if hidden % (4 * HEADS):
        raise ValueError(f"hidden {hidden}: tiny models need a multiple of {4 * HEADS}")
    base = dict(FAMILY_CONFIGS[family])
    sizes = {"E": experts, "N": intermediate, "2N": 2 * intermediate}
    cfg = {k: (sizes[v] if isinstance(v, str) and v in sizes else v) for k, v in base.items()}
    head_dim = hidden // HEADS
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, num_experts_per_tok=top_k, vocab_size=128,
               num_attention_heads=HEADS, torch_dtype=str(dtype).replace("torch.", ""), rms_norm_eps=1e-6,
               hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if family in MLA_FAMILIES:
        cfg.update(num_key_value_heads=HEADS, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4,
                   qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim)
    else:
        cfg.update(num_key_value_heads=2, head_dim=head_dim)
    return cfg


def moe_layer_indices(cfg: dict) -> list[int]:
    first = cfg.get("first_k_dense_replace", 0)
    return list(range(first, cfg["num_hidden_layers"]))


def tiny_tensors(family: str, cfg: dict, *, seed: int = 0, layout: str = "original") -> dict[str, torch.Tensor]:
    """All tensors of a tiny model: embeddings, attention, norms, MoE blocks, dense MLPs, lm_head.

    Weights are N(0, 1/fan_in) so activations keep their scale through the layer (real checkpoints
    look alike); the router is scaled up so routing is decisive. ``layout``: "original" (the
    family's own names, transformers' default save) or "v5" (``save_original_format=False``:
    routed experts fused in ``experts.gate_up_proj`` [E, 2N, H] / ``experts.down_proj``
    [E, H, N], Mixtral's ``block_sparse_moe`` named ``mlp``; Llama-4 and gpt-oss are the same
    in both).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    g = torch.Generator().manual_seed(seed)
    # attention has its own generator: the main one draws what the first writer drew, in the
    # same order, so every other tensor of a seed keeps its values (and what was measured on them)
    g_attn = torch.Generator().manual_seed(seed + (1 << 32))
    dtype = getattr(torch, cfg["torch_dtype"])
    H, E = cfg["hidden_size"], _experts(cfg)
    N = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    moe_module, router_module, linears = FAMILY_LAYOUT[family]
    if layout == "v5":
        moe_module = V5_MOE_MODULE.get(family, moe_module)

    def rnd(*shape, scale=None, gen=g):
        fan_in = shape[-1]
        return (torch.randn(*shape, generator=gen) * (scale if scale is not None else 1 / math.sqrt(fan_in))).to(dtype)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], H, scale=1.0)}
    moe = set(moe_layer_indices(cfg))
    n_layers, mtp = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 0)
    # the multi-token-prediction layers draw from a generator of their own: the decoder
    # layers' values do not depend on whether they are written
    g_mtp = torch.Generator().manual_seed(seed + (2 << 32))
    for i in range(n_layers + mtp):
        gi, ga = (g, g_attn) if i < n_layers else (g_mtp, g_mtp)
        r = partial(rnd, gen=gi)
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=dtype)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(H, dtype=dtype)
        for _ in range(4):  # the first writer's q, k, v, o [H, H] (see g_attn)
            torch.randn(H, H, generator=gi)
        t.update(_attention(family, cfg, f"{p}.self_attn", partial(rnd, gen=ga)))
        if i < n_layers and i not in moe:
            inter = cfg["intermediate_size"]
            t[f"{p}.mlp.gate_proj.weight"] = r(inter, H)
            t[f"{p}.mlp.up_proj.weight"] = r(inter, H)
            t[f"{p}.mlp.down_proj.weight"] = r(H, inter)
            continue
        m = f"{p}.{moe_module}"
        t[f"{m}.{router_module}.weight"] = r(E, H, scale=4 / math.sqrt(H))
        if family == "deepseek_v3":
            t[f"{m}.{router_module}.e_score_correction_bias"] = (torch.randn(E, generator=gi) * 0.1).float()
        if family == "gpt_oss":
            t[f"{m}.router.bias"] = r(E, scale=0.1)
        if linears is None:  # fused on disk in both layouts
            gu = torch.stack([torch.cat([r(N, H), r(N, H)]) for _ in range(E)])  # [E, 2N, H]
            dn = torch.stack([r(H, N) for _ in range(E)])  # [E, H, N]
            if family in ("llama4", "gpt_oss"):
                if family == "gpt_oss":  # interleave gate/up rows
                    gu = torch.stack([gu[:, :N], gu[:, N:]], dim=2).reshape(E, 2 * N, H)
                gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
            t[f"{m}.experts.gate_up_proj"] = gu
            t[f"{m}.experts.down_proj"] = dn
            if family == "gpt_oss":
                t[f"{m}.experts.gate_up_proj_bias"] = r(E, 2 * N, scale=0.01)
                t[f"{m}.experts.down_proj_bias"] = r(E, H, scale=0.01)
        else:  # the same experts in both layouts: per expert, or fused as transformers v5 saves them
            experts = [(r(N, H), r(N, H), r(H, N)) for _ in range(E)]  # (gate, up, down)
            if layout == "v5":
                t[f"{m}.experts.gate_up_proj"] = torch.stack([torch.cat([g_, u_]) for g_, u_, _ in experts])
                t[f"{m}.experts.down_proj"] = torch.stack([d_ for _, _, d_ in experts])
            else:
                for e, ws in enumerate(experts):
                    for lin, w in zip(linears, ws):
                        t[f"{m}.experts.{e}.{lin}.weight"] = w
        shared = {"qwen2_moe": ("shared_expert", cfg.get("shared_expert_intermediate_size")),
                  "deepseek_v2": ("shared_experts", N * cfg.get("n_shared_experts", 0)),
                  "deepseek_v3": ("shared_experts", N * cfg.get("n_shared_experts", 0)),
                  "llama4": ("shared_expert", N)}.get(family)
        if shared:
            name, inter = shared
            t[f"{m}.{name}.gate_proj.weight"] = r(inter, H)
            t[f"{m}.{name}.up_proj.weight"] = r(inter, H)
            t[f"{m}.{name}.down_proj.weight"] = r(H, inter)
            if family == "qwen2_moe":
                t[f"{m}.shared_expert_gate.weight"] = r(1, H)
        if i >= n_layers:  # DeepSeek-V3's MTP module around the decoder layer
            t.update({f"{p}.embed_tokens.weight": r(cfg["vocab_size"], H, scale=1.0),
                      f"{p}.enorm.weight": torch.ones(H, dtype=dtype), f"{p}.hnorm.weight": torch.ones(H, dtype=dtype),
                      f"{p}.eh_proj.weight": r(H, 2 * H), f"{p}.shared_head.norm.weight": torch.ones(H, dtype=dtype),
                      f"{p}.shared_head.head.weight": r(cfg["vocab_size"], H)})
    t["model.norm.weight"] = torch.ones(H, dtype=dtype)
    t["lm_head.weight"] = rnd(cfg["vocab_size"], H)
    return t


def _attention(family: str, cfg: dict, a: str, rnd) -> dict[str, torch.Tensor]:
    """The attention tensors of one layer (``a``: its ``model.layers.{i}.self_attn``), as the
    family's transformers module holds them. Norm weights are 1 + noise, so a swap shows."""
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]

    def norm(n: int) -> torch.Tensor:
        return 1 + rnd(n, scale=0.1)

    if family in MLA_FAMILIES:
        q_rank, kv_rank, v = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["v_head_dim"]
        nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        return {f"{a}.q_a_proj.weight": rnd(q_rank, H), f"{a}.q_a_layernorm.weight": norm(q_rank),
                f"{a}.q_b_proj.weight": rnd(heads * (nope + rope), q_rank),
                f"{a}.kv_a_proj_with_mqa.weight": rnd(kv_rank + rope, H), f"{a}.kv_a_layernorm.weight": norm(kv_rank),
                f"{a}.kv_b_proj.weight": rnd(heads * (nope + v), kv_rank), f"{a}.o_proj.weight": rnd(H, heads * v)}
    q, kv = heads * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    t = {f"{a}.q_proj.weight": rnd(q, H), f"{a}.k_proj.weight": rnd(kv, H), f"{a}.v_proj.weight": rnd(kv, H),
         f"{a}.o_proj.weight": rnd(H, q)}
    if family in ("qwen2_moe", "gpt_oss"):
        t.update({f"{a}.q_proj.bias": rnd(q, scale=0.02), f"{a}.k_proj.bias": rnd(kv, scale=0.02),
                  f"{a}.v_proj.bias": rnd(kv, scale=0.02)})
    if family == "gpt_oss":
        t.update({f"{a}.o_proj.bias": rnd(H, scale=0.02), f"{a}.sinks": rnd(heads, scale=1.0)})
    if family == "qwen3_moe":  # per head
        t.update({f"{a}.q_norm.weight": norm(cfg["head_dim"]), f"{a}.k_norm.weight": norm(cfg["head_dim"])})
    if family == "olmoe":  # over the whole projection
        t.update({f"{a}.q_norm.weight": norm(q), f"{a}.k_norm.weight": norm(kv)})
    return t


def _experts(cfg: dict) -> int:
    for k in ("num_local_experts", "num_experts", "n_routed_experts"):
        if k in cfg:
            return cfg[k]
    raise KeyError("experts")


def write_checkpoint(path: Path, config: dict, tensors: dict[str, torch.Tensor], *, shards: int = 1) -> Path:
    """Write a checkpoint folder (config.json, safetensors shards, index when sharded) with our writer."""
    path = Path(path)
    out = OutputDir(path, force=True)
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        specs = [TensorSpec(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in part]
        out.write_safetensors(fname, specs, ((n, tensors[n]) for n in part), metadata=SAFETENSORS_METADATA)
        weight_map.update({n: fname for n in part})
    if shards > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        out.write_json("model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    out.write_json("config.json", config)
    out.finish({"kind": "checkpoint"})
    (path / "manifest.json").unlink()  # an input checkpoint, not a moetool output
    return path


def make_tiny_checkpoint(path: Path, family: str = "deepseek_v3", *, hidden: int = 256, intermediate: int = 192,
                         experts: int = 16, top_k: int = 4, layers: int = 3, dtype: torch.dtype = torch.bfloat16,
                         shards: int = 2, seed: int = 0, layout: str = "original", mtp: int = 0) -> Path:
    """``mtp``: DeepSeek-V3 multi-token-prediction layers after the ``layers`` decoder layers
    (``num_nextn_predict_layers``), stored as DeepSeek's releases store layer 61."""
    cfg = tiny_config(family, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, layers=layers,
                      dtype=dtype)
    if mtp:
        if family != "deepseek_v3":
            raise ValueError(f"mtp layers: DeepSeek-V3 only, not {family}")
        cfg["num_nextn_predict_layers"] = mtp
    return write_checkpoint(path, cfg, tiny_tensors(family, cfg, seed=seed, layout=layout), shards=shards)
