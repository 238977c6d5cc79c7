"""Architecture registry and ExpertReader against independent producers.

transformers-made models, saved in both layouts transformers writes (its default, the
original names, and its v5 layout): the reader's per-expert gate/up/down must equal the
weights the transformers module itself holds (fused [E, 2N, H] in memory in transformers v5;
Llama-4 and gpt-oss input-first, gpt-oss interleaved). Our own writer: equal to the tensors it
generated, for per-expert, transformers-v5 fused and Llama-4 / gpt-oss fused layouts.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moetool.model.families import FAMILIES, describe
from moetool.read.checkpoint import open_checkpoint
from moetool.errors import MoetoolError
from moetool.read.experts import ExpertReader
from moetool.demo.tiny import tiny_config, tiny_tensors
from moeutil import HF_CONFIGS, HF_LAYOUTS, N, hf_expert, hf_param

HF_FAMILIES = list(HF_CONFIGS)


@pytest.mark.parametrize("layout", HF_LAYOUTS)
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_reader_matches_transformers_module_weights(hf_model, family, layout):
    model = hf_model(family, layout=layout)
    with open_checkpoint(model.path) as ck:
        reader = ExpertReader(ck)
        assert reader.fmt.name == "dense"
        fused = layout == "v5" or family in ("llama4", "gpt_oss")
        assert {m.storage.kind for m in reader.spec.moe_layers} == {"fused" if fused else "per-expert"}
        for layer in reader.spec.moe_layers:
            assert layer.intermediate == N and layer.hidden == 32
            for e in range(layer.num_experts):
                want = hf_expert(model, layer.prefix, e, N)
                got = reader.gate_up_down(layer, e)
                for role, w, g in zip(("gate", "up", "down"), want, got):
                    assert set(g) == {"weight"}
                    assert g["weight"].dtype == w.dtype, (layer.index, e, role)
                    assert torch.equal(g["weight"], w), (layer.index, e, role)
                for w, g in zip(want, reader.expert_fp32(layer, e)):
                    assert g.dtype == torch.float32 and torch.equal(g, w.float())
                w13 = reader.w13(layer, e)["weight"]
                assert torch.equal(w13, torch.cat([want[0], want[1]]))
                assert torch.equal(reader.down(layer, e)["weight"], want[2])
            # the router and shared experts are where the spec says
            assert torch.equal(ck.get(layer.router_weight), hf_param(model, layer.router_weight))
            if layer.shared_bases:
                g, u, d, sg = reader.shared_fp32(layer)
                assert torch.equal(g, hf_param(model, f"{layer.shared_bases[0]}.weight"))
                assert torch.equal(d, hf_param(model, f"{layer.shared_bases[2]}.weight"))
                if layer.shared_gate_weight:
                    assert torch.equal(sg, hf_param(model, layer.shared_gate_weight))


def test_reader_range_check(hf_model):
    with open_checkpoint(hf_model("mixtral").path) as ck:
        reader = ExpertReader(ck)
        layer = reader.spec.moe_layers[0]
        with pytest.raises(MoetoolError, match=r"^layer 0: expert 4 out of range \(0\.\.3\)$"):
            reader.gate_up_down(layer, 4)


TINY = [("mixtral", "original"), ("qwen2_moe", "original"), ("qwen3_moe", "original"), ("qwen3_moe", "v5"),
        ("olmoe", "original"), ("deepseek_v2", "original"), ("deepseek_v3", "original"), ("deepseek_v3", "v5"),
        ("mixtral", "v5"), ("llama4", "original"), ("gpt_oss", "original")]


@pytest.mark.parametrize("family, layout", TINY, ids=[f"{f}-{v}" for f, v in TINY])
def test_reader_matches_our_writer(tiny, family, layout):
    hidden, inter, experts = 64, 48, (8 if family.startswith("deepseek") else 4)
    path = tiny(family, hidden=hidden, intermediate=inter, experts=experts, layout=layout, shards=3)
    cfg = tiny_config(family, hidden=hidden, intermediate=inter, experts=experts,
                      top_k=1 if family == "llama4" else 2, layers=3 if family.startswith("deepseek") else 2,
                      dtype=torch.bfloat16)
    src = tiny_tensors(family, cfg, seed=0, layout=layout)
    with open_checkpoint(path) as ck:
        reader = ExpertReader(ck)
        spec = reader.spec
        fused = layout == "v5" or family in ("llama4", "gpt_oss")
        if family == "mixtral":  # transformers v5 renames the block
            assert {m.prefix.rsplit(".", 1)[1] for m in spec.moe_layers} == {"mlp" if fused else "block_sparse_moe"}
        for layer in spec.moe_layers:
            assert layer.storage.kind == ("fused" if fused else "per-expert")
            for e in range(experts):
                g, u, d = (lin["weight"] for lin in reader.gate_up_down(layer, e))
                assert g.shape == (inter, hidden) and d.shape == (hidden, inter)
                if not fused:
                    names = [f"{b}.weight" for b in layer.storage.per_expert_bases(e)]
                    want = [src[n] for n in names]
                else:
                    gu, dn = src[f"{layer.prefix}.experts.gate_up_proj"][e], src[f"{layer.prefix}.experts.down_proj"][e]
                    if family in ("llama4", "gpt_oss"):  # input-first on disk
                        gu, dn = gu.t(), dn.t()
                    if family == "gpt_oss":
                        want = [gu[0::2], gu[1::2], dn]
                    else:
                        want = [gu[:inter], gu[inter:], dn]
                for w, got in zip(want, (g, u, d)):
                    assert torch.equal(got, w)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_our_v5_layout_holds_the_same_experts(tiny, family):
    """tiny(..., layout="v5") is the original model saved as transformers v5 saves it."""
    with open_checkpoint(tiny(family, hidden=64, intermediate=48)) as a, \
            open_checkpoint(tiny(family, hidden=64, intermediate=48, layout="v5")) as b:
        ra, rb = ExpertReader(a), ExpertReader(b)
        for la, lb in zip(ra.spec.moe_layers, rb.spec.moe_layers):
            assert (la.storage.kind, lb.storage.kind) == ("per-expert", "fused")
            for e in range(la.num_experts):
                assert all(torch.equal(x["weight"], y["weight"])
                           for x, y in zip(ra.gate_up_down(la, e), rb.gate_up_down(lb, e)))


def test_gpt_oss_biases_found(hf_model):
    with open_checkpoint(hf_model("gpt_oss").path) as ck:
        layer = describe(ck.config, ck.tensors).moe_layers[0]
        st = layer.storage
        assert st.interleaved and st.gate_up_input_first and st.down_input_first
        assert st.gate_up_bias == "model.layers.0.mlp.experts.gate_up_proj_bias"
        assert st.down_bias == "model.layers.0.mlp.experts.down_proj_bias"
        assert layer.router_bias == "model.layers.0.mlp.router.bias"


# ------------------------------------------------------------------------------ describe() on configs


def shapes(**named):
    return {k.replace("__", "."): SimpleNamespace(shape=v) for k, v in named.items()}


def _mixtral_like(prefix="model.layers.{i}.block_sparse_moe", layers=(0, 1), E=4, H=16, Nn=8, fused=None):
    t = {}
    for i in layers:
        p = prefix.format(i=i)
        t[f"{p}.gate.weight"] = SimpleNamespace(shape=(E, H))
        if fused is None:
            for e in range(E):
                t[f"{p}.experts.{e}.w1.weight"] = SimpleNamespace(shape=(Nn, H))
                t[f"{p}.experts.{e}.w3.weight"] = SimpleNamespace(shape=(Nn, H))
                t[f"{p}.experts.{e}.w2.weight"] = SimpleNamespace(shape=(H, Nn))
        else:
            t[f"{p}.experts.gate_up_proj"] = SimpleNamespace(shape=fused[0])
            t[f"{p}.experts.down_proj"] = SimpleNamespace(shape=fused[1])
    return t


MIXTRAL_CFG = dict(model_type="mixtral", hidden_size=16, num_local_experts=4, intermediate_size=8,
                   num_experts_per_tok=2, num_hidden_layers=2)


def test_describe_per_expert_and_dims():
    spec = describe(MIXTRAL_CFG, _mixtral_like())
    assert spec.family.name == "mixtral" and spec.num_experts == 4 and spec.top_k == 2
    assert [m.index for m in spec.moe_layers] == [0, 1] and spec.dense_layers == []
    assert spec.moe_layers[1].storage.per_expert_bases(3) == (
        "model.layers.1.block_sparse_moe.experts.3.w1", "model.layers.1.block_sparse_moe.experts.3.w3",
        "model.layers.1.block_sparse_moe.experts.3.w2")


@pytest.mark.parametrize("gu, dn, input_first", [((4, 16, 16), (4, 16, 8), False), ((4, 16, 16), (4, 8, 16), True)])
def test_describe_fused_detects_orientation_from_shapes(gu, dn, input_first):
    """H=16, N=8: gate_up [E, 2N, H] and [E, H, 2N] look alike (2N = H), so the down tensor's
    shape decides it; the family default only applies when shapes cannot tell."""
    spec = describe(MIXTRAL_CFG, _mixtral_like(fused=(gu, dn)))
    st = spec.moe_layers[0].storage
    assert st.kind == "fused" and st.down_input_first == input_first
    assert st.gate_up_input_first is False  # ambiguous square: mixtral default (output-first)


def test_describe_fused_input_first_unambiguous():
    cfg = dict(MIXTRAL_CFG, intermediate_size=12)
    spec = describe(cfg, _mixtral_like(Nn=12, fused=((4, 16, 24), (4, 12, 16))))
    st = spec.moe_layers[0].storage
    assert st.gate_up_input_first and st.down_input_first


def test_describe_fused_wrong_shape():
    cfg = dict(MIXTRAL_CFG, intermediate_size=12)
    with pytest.raises(MoetoolError) as err:
        describe(cfg, _mixtral_like(Nn=12, fused=((4, 24, 24), (4, 12, 16))))
    assert str(err.value) == ("model.layers.0.block_sparse_moe.experts.gate_up_proj: shape [4, 24, 24], "
                              "expected [4, 24, 16] or input-first [4, 16, 24]")


def test_describe_fused_without_down():
    t = _mixtral_like(fused=((4, 16, 16), (4, 16, 8)))
    del t["model.layers.1.block_sparse_moe.experts.down_proj"]
    with pytest.raises(MoetoolError, match=r"^model.layers.1.block_sparse_moe: fused experts tensor "
                                           r"model.layers.1.block_sparse_moe.experts.down_proj not found$"):
        describe(MIXTRAL_CFG, t)


def test_describe_top_k_out_of_range():
    with pytest.raises(MoetoolError, match=r"^config.json: top-k 5 must be between 1 and the expert count 4$"):
        describe(dict(MIXTRAL_CFG, num_experts_per_tok=5), _mixtral_like())


def test_describe_missing_hidden_size():
    cfg = {k: v for k, v in MIXTRAL_CFG.items() if k != "hidden_size"}
    with pytest.raises(MoetoolError, match=r"^config.json: missing hidden_size \(looked for hidden_size\)$"):
        describe(cfg, _mixtral_like())


def test_qwen_sparse_step_and_mlp_only_layers():
    cfg = dict(model_type="qwen2_moe", hidden_size=16, num_experts=4, moe_intermediate_size=8,
               num_experts_per_tok=2, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    t = {}
    for i in (1, 5):
        p = f"model.layers.{i}.mlp"
        t[f"{p}.gate.weight"] = SimpleNamespace(shape=(4, 16))
        for e in range(4):
            for lin, shp in (("gate_proj", (8, 16)), ("up_proj", (8, 16)), ("down_proj", (16, 8))):
                t[f"{p}.experts.{e}.{lin}.weight"] = SimpleNamespace(shape=shp)
    spec = describe(cfg, t)
    assert [m.index for m in spec.moe_layers] == [1, 5]
    assert spec.dense_layers == [0, 2, 3, 4]
    assert spec.moe_layers[0].shared is None  # no shared expert tensors: none reported


def test_deepseek_v3_needs_correction_bias():
    cfg = dict(model_type="deepseek_v3", hidden_size=16, n_routed_experts=4, moe_intermediate_size=8,
               num_experts_per_tok=2, num_hidden_layers=2, first_k_dense_replace=1, n_group=1)
    t = {"model.layers.1.mlp.gate.weight": SimpleNamespace(shape=(4, 16))}
    for e in range(4):
        for lin, shp in (("gate_proj", (8, 16)), ("up_proj", (8, 16)), ("down_proj", (16, 8))):
            t[f"model.layers.1.mlp.experts.{e}.{lin}.weight"] = SimpleNamespace(shape=shp)
    with pytest.raises(MoetoolError, match=r"^layer 1: router correction bias "
                                           r"model.layers.1.mlp.gate.e_score_correction_bias not found$"):
        describe(cfg, t)
    t["model.layers.1.mlp.gate.e_score_correction_bias"] = SimpleNamespace(shape=(4,))
    spec = describe(cfg, t)
    r = spec.moe_layers[0].router
    assert r.scoring == "sigmoid" and r.has_correction_bias and r.n_group is None


def test_llama4_multimodal_wrapper_and_interleaved_moe():
    """Llama-4 checkpoints on the Hub: model_type llama4 with the LM under text_config, tensors
    under language_model.model.layers, MoE every 2nd layer (Maverick)."""
    text = dict(model_type="llama4_text", hidden_size=16, num_local_experts=4, intermediate_size=12,
                num_experts_per_tok=1, num_hidden_layers=4, interleave_moe_layer_step=2)
    cfg = {"model_type": "llama4", "text_config": text}
    t = {}
    for i in (1, 3):
        p = f"language_model.model.layers.{i}.feed_forward"
        t[f"{p}.router.weight"] = SimpleNamespace(shape=(4, 16))
        t[f"{p}.experts.gate_up_proj"] = SimpleNamespace(shape=(4, 16, 24))
        t[f"{p}.experts.down_proj"] = SimpleNamespace(shape=(4, 12, 16))
        for lin, shp in (("gate_proj", (12, 16)), ("up_proj", (12, 16)), ("down_proj", (16, 12))):
            t[f"{p}.shared_expert.{lin}.weight"] = SimpleNamespace(shape=shp)
    for i in (0, 2):
        t[f"language_model.model.layers.{i}.feed_forward.gate_proj.weight"] = SimpleNamespace(shape=(24, 16))
    spec = describe(cfg, t)
    assert spec.family.name == "llama4"
    assert [m.prefix for m in spec.moe_layers] == ["language_model.model.layers.1.feed_forward",
                                                   "language_model.model.layers.3.feed_forward"]
    assert spec.dense_layers == [0, 2]
    m = spec.moe_layers[0]
    assert m.router.apply_weight_on_input and m.router.scoring == "sigmoid" and m.router.top_k == 1
    assert m.storage.gate_up_input_first and m.shared is not None and m.shared.intermediate == 12


def test_every_family_has_a_model_type():
    assert {t for f in FAMILIES for t in f.model_types} >= {
        "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "llama4_text", "gpt_oss"}


def test_deepseek_v3_mtp_layers_are_moe_layers_where_stored(tmp_path):
    """DeepSeek's releases store the multi-token-prediction layer after the decoder (layer 61
    of 61, ``num_nextn_predict_layers`` 1); transformers saves none (its config still says 1)."""
    from moetool.demo.tiny import make_tiny_checkpoint
    from moetool.read.checkpoint import open_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "deepseek_v3", hidden=64, intermediate=32, experts=8, top_k=2,
                                layers=2, shards=1, mtp=1)
    with open_checkpoint(path) as ck:
        spec = describe(ck.config, ck.tensors)
        assert [m.index for m in spec.moe_layers] == [1, 2] and spec.num_layers == 2 and spec.dense_layers == [0]
        assert spec.layer(2).prefix == "model.layers.2.mlp" and spec.layer(2).shared is not None
        config, tensors = dict(ck.config), dict(ck.tensors)
    without = {n: v for n, v in tensors.items() if not n.startswith("model.layers.2.")}
    assert [m.index for m in describe(config, without).moe_layers] == [1]  # none stored: no MTP layer
    assert [m.index for m in describe({**config, "num_nextn_predict_layers": 0}, without).moe_layers] == [1]
    # transformers' num_mtp_layers defaults to 1: a config without the key still has the layer
    nokey = {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}
    assert [m.index for m in describe(nokey, tensors).moe_layers] == [1, 2]
    # a rank folder of a shard made before MTP layers were MoE layers stores none for it
    assert [m.index for m in describe(config, tensors, stored_experts={1: 8}).moe_layers] == [1]
    no_router = {n: v for n, v in tensors.items() if not n.startswith("model.layers.2.mlp.gate.")}
    with pytest.raises(MoetoolError, match=r"layer 2, a multi-token-prediction layer, holds experts but not its "
                                           r"router \(\.mlp\.gate\.weight\)$"):
        describe(config, no_router)
