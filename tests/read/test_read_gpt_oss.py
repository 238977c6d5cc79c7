"""gpt-oss's on-disk layouts read by moetool (issue 16, point 5): the dense one transformers
saves (``experts.gate_up_proj`` [E, H, 2N] input-first, gate/up columns interleaved) and the
MXFP4 release (``experts.gate_up_proj_blocks`` [E, 2N, H/32, 16] / ``_scales`` [E, 2N, H/32],
output rows first, gate/up rows interleaved), each with its expert and router biases.

The release is written by ``tests/moeutil.save_gpt_oss_mxfp4`` from a transformers-made model
(transformers cannot write it without the Hub's kernels); transformers' own loader then reads
it on this CPU (it dequantizes MXFP4 experts there) and must see what moetool's reader sees,
bit for bit: the row order, the interleaving and the nibble order are checked by an
independent implementation.
"""
from __future__ import annotations

import json

import pytest
import torch

from moeutil import save_gpt_oss_mxfp4, save_hf_model

transformers = pytest.importorskip("transformers")

from moetool.errors import MoetoolError  # noqa: E402
from moetool.read.checkpoint import open_checkpoint  # noqa: E402
from moetool.read.experts import ExpertReader  # noqa: E402

#: the gpt-oss of these tests: MXFP4 needs whole groups of 32 along H and N
GPT_OSS = dict(intermediate_size=32, swiglu_limit=1.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-read")
    model = save_hf_model("gpt_oss", root / "bf16", dtype=torch.bfloat16, **GPT_OSS)
    return model, save_gpt_oss_mxfp4(model, root / "mxfp4")


def test_dense_layout_is_transformers_experts(world):
    model, _ = world
    with open_checkpoint(model.path) as ck:
        reader = ExpertReader(ck)
        for layer in reader.spec.moe_layers:
            p = layer.prefix
            gu, dn = model.state[f"{p}.experts.gate_up_proj"], model.state[f"{p}.experts.down_proj"]
            gub, dnb = model.state[f"{p}.experts.gate_up_proj_bias"], model.state[f"{p}.experts.down_proj_bias"]
            for e in range(layer.num_experts):
                gate, up, down = reader.expert_fp32(layer, e)
                assert torch.equal(gate, gu[e][:, 0::2].t().float()) and torch.equal(up, gu[e][:, 1::2].t().float())
                assert torch.equal(down, dn[e].t().float())
                bg, bu, bd = reader.biases(layer, e)
                assert torch.equal(bg, gub[e, 0::2]) and torch.equal(bu, gub[e, 1::2]) and torch.equal(bd, dnb[e])
            assert layer.router_bias == f"{p}.router.bias" and layer.router.has_router_bias


def test_mxfp4_release_reads_as_transformers_dequantizes_it(world):
    model, mx = world
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(mx), dtype=torch.float32)
    with open_checkpoint(mx) as ck:
        reader = ExpertReader(ck)
        assert reader.fmt.name == "mxfp4"
        for layer in reader.spec.moe_layers:
            experts = hf.model.layers[layer.index].mlp.experts
            assert layer.storage.describe() == "fused (interleaved gate/up) (blocks, scales) (biases)"
            for e in range(layer.num_experts):
                gate, up, down = reader.expert_fp32(layer, e)
                gu, dn = experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()  # [H, 2N], [N, H]
                assert torch.equal(gate, gu[:, 0::2].t()) and torch.equal(up, gu[:, 1::2].t())
                assert torch.equal(down, dn.t())
                bg, bu, bd = reader.biases(layer, e)
                assert torch.equal(torch.stack([bg, bu], 1).reshape(-1).float(), experts.gate_up_proj_bias[e])
                assert torch.equal(bd.float(), experts.down_proj_bias[e])
                # and the values are the model's own, to MXFP4's error
                want = model.state[f"{layer.prefix}.experts.gate_up_proj"][e][:, 0::2].t().float()
                assert float((gate - want).norm() / want.norm()) < 0.15


def test_mxfp4_release_inspect(world, cli):
    _, mx = world
    r = cli("inspect", mx, "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    assert info["weight_format"] == "mxfp4" and info["router"] == "softmax, top-2, renormalize, logit bias"
    assert info["expert_storage"] == "fused (interleaved gate/up) (blocks, scales) (biases)"
    assert info["activation"] == "clamped SwiGLU (alpha 1.702, limit 1, up + 1)"


def test_mxfp4_release_needs_its_config(world, copy_ckpt, cli):
    _, mx = world
    bad = copy_ckpt(mx)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["quantization_config"]
    (bad / "config.json").write_text(json.dumps(cfg))
    r = cli("inspect", bad)
    assert r.code == 2
    assert r.error_line == (f"{bad}: experts of model.layers.0.mlp are stored as model.layers.0.mlp.experts."
                            "gate_up_proj_blocks/scales (mxfp4's fused layout) but config.json declares quant_method "
                            "None, not 'mxfp4'")


def test_missing_expert_bias_is_named(world, tmp_path):
    model, _ = world
    from moetool.model.families import describe

    with open_checkpoint(model.path) as ck:
        tensors = dict(ck.tensors)
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    with pytest.raises(MoetoolError, match=r"^model.layers.1.mlp.experts.down_proj_bias: not found \(the experts' "
                                           r"other linear has biases\)$"):
        describe(model.config, tensors)
    with open_checkpoint(model.path) as ck:
        tensors = dict(ck.tensors)
    del tensors["model.layers.0.mlp.router.bias"]
    with pytest.raises(MoetoolError, match=r"^layer 0: router bias model.layers.0.mlp.router.bias not found$"):
        describe(model.config, tensors)
