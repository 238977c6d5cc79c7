"""gpt-oss through every converter (issue 16, point 5): ``quantize`` to every output format,
``repack``, ``shard`` and ``shard --merge``, from both its dense layout (transformers'
``experts.gate_up_proj`` [E, H, 2N], interleaved) and its MXFP4 release (``_blocks`` /
``_scales``). The expert biases travel unquantized, bit for bit, in every layout:
per-expert ``experts.{e}.gate_proj.bias`` ..., stacked ``experts.w13_bias`` [E, 2N] (gate then
up, vLLM's name) and ``w2_bias``, fused ``gate_up_proj_bias`` (interleaved) and ``down_proj_bias``.
``--layout fused`` writes what transformers and vLLM load for gpt-oss: the dense layout, or in
mxfp4 the release layout itself (byte for byte what the release of the same codes holds).
"""
from __future__ import annotations

import json

import pytest
import torch

from moeutil import bit_equal, read_tensors, save_gpt_oss_mxfp4, save_hf_model

pytest.importorskip("transformers")

from moetool.convert.merge import merge  # noqa: E402
from moetool.convert.quantize import quantize  # noqa: E402
from moetool.convert.repack import repack  # noqa: E402
from moetool.convert.shard import shard  # noqa: E402
from moetool.errors import MoetoolError  # noqa: E402

#: every output format; int4 in groups of 32 (the tiny H = N = 32)
FORMATS = {"fp8-block": {}, "fp8-channel": {}, "int4-group": {"group_size": 32}, "nvfp4": {}, "mxfp4": {},
           "dense": {}}
GPT_OSS = dict(intermediate_size=32, swiglu_limit=1.0)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """{"root", "model" (HFModel, bf16), "dense" (its folder), "mxfp4" (the release layout)}."""
    root = tmp_path_factory.mktemp("gpt-oss-convert")
    model = save_hf_model("gpt_oss", root / "dense", dtype=torch.bfloat16, **GPT_OSS)
    return {"root": root, "model": model, "dense": model.path, "mxfp4": save_gpt_oss_mxfp4(model, root / "mxfp4")}


def _biases(model, prefix: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gu, dn = model.state[f"{prefix}.experts.gate_up_proj_bias"][e], model.state[f"{prefix}.experts.down_proj_bias"][e]
    return gu[0::2], gu[1::2], dn


def _same(a, b) -> bool:
    ta, tb = read_tensors(a), read_tensors(b)
    return set(ta) == set(tb) and all(bit_equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("source", ["dense", "mxfp4"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_shard_merge(world, source, fmt):
    """Per-expert output with its biases; EP shards (stacked, w13_bias / w2_bias) merge back to
    the same bytes."""
    model, root = world["model"], world["root"]
    out = root / f"{source}-{fmt}"
    quantize(world[source], out, fmt, progress=False, **FORMATS[fmt])
    t = read_tensors(out)
    for i in range(2):
        p = f"model.layers.{i}.mlp"
        assert f"{p}.router.bias" in t and f"{p}.experts.gate_up_proj_bias" not in t
        for e in range(4):
            for lin, bias in zip(("gate_proj", "up_proj", "down_proj"), _biases(model, p, e)):
                assert bit_equal(t[f"{p}.experts.{e}.{lin}.bias"], bias)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg.get("quantization_config") is None) == (fmt == "dense")
    shards = root / f"{source}-{fmt}-ep2"
    shard(out, shards, 2, progress=False)
    rank1 = read_tensors(shards / "rank-00001-of-00002")
    assert bit_equal(rank1["model.layers.1.mlp.experts.w13_bias"],
                     torch.stack([torch.cat(_biases(model, "model.layers.1.mlp", e)[:2]) for e in (2, 3)]))
    assert bit_equal(rank1["model.layers.1.mlp.experts.w2_bias"],
                     torch.stack([_biases(model, "model.layers.1.mlp", e)[2] for e in (2, 3)]))
    merge(shards, root / f"{source}-{fmt}-merged", progress=False)
    assert _same(out, root / f"{source}-{fmt}-merged")


@pytest.mark.parametrize("source", ["dense", "mxfp4"])
def test_shard_merge_gives_back_the_fused_input(world, source):
    """Both gpt-oss layouts, sharded (stacked mxfp4 or dense) and merged: the same tensors,
    bytes and config.json as the input (the release's quantization_config included)."""
    root = world["root"]
    shard(world[source], root / f"{source}-ep2", 2, progress=False)
    merge(root / f"{source}-ep2", root / f"{source}-back", progress=False)
    assert _same(world[source], root / f"{source}-back")
    assert (json.loads((root / f"{source}-back" / "config.json").read_text())
            == json.loads((world[source] / "config.json").read_text()))


def test_fused_layout_is_what_the_loaders_read(world):
    """``--layout fused``: mxfp4 gives the release layout (the same bytes as the release of the
    same codes) with gpt-oss's quantization_config; dense gives transformers' own tensors back."""
    root = world["root"]
    quantize(world["dense"], root / "fused-mxfp4", "mxfp4", layout="fused", progress=False)
    assert _same(world["mxfp4"], root / "fused-mxfp4")
    qc = json.loads((root / "fused-mxfp4" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4"
    assert {"model.embed_tokens", "lm_head", "model.layers.1.mlp.router", "model.layers.0.self_attn.q_proj"} <= set(
        qc["modules_to_not_convert"])
    assert not any(".experts" in m for m in qc["modules_to_not_convert"])
    quantize(world["dense"], root / "fused-dense", "dense", layout="fused", progress=False)
    assert _same(world["dense"], root / "fused-dense")
    # the release repacked stacked (compressed-tensors names and config) and back
    repack(world["mxfp4"], root / "mx-stacked", "stacked", progress=False)
    assert json.loads((root / "mx-stacked" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    repack(root / "mx-stacked", root / "mx-fused", "fused", progress=False)
    assert _same(world["mxfp4"], root / "mx-fused")


def test_fused_layout_needs_a_fused_format(world):
    with pytest.raises(MoetoolError, match=r"^model.layers.0.mlp.experts.gate_up_proj: fused expert tensors are "
                                           r"written unquantized or in a format with a fused layout \(mxfp4\), "
                                           r"not fp8-block$"):
        quantize(world["dense"], world["root"] / "fused-fp8", "fp8-block", layout="fused", progress=False)
