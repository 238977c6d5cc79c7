"""Every layout transformers writes, through every command (issue 16, point 1).

transformers 5 saves a MoE model in the family's original names (its default) or, with
``save_pretrained(..., save_original_format=False)``, in its own v5 layout. Both are written here
by transformers itself (``moeutil.save_hf_model``) for every family moetool claims, and each
goes through ``inspect``, ``quantize`` (one format per row, the three rotating over the rows:
tests/convert/test_convert_quantize.py has every format on the original layout), ``repack``
both ways, ``shard``, ``shard --merge`` (the same names and bytes back) and ``verify`` of the
MoE blocks on EP 2 (every row in one world of rank processes), plus ``verify --whole-model``
of the v5 rows. gpt-oss is inspect only (its biased experts are not converted yet).

    family        original (default save)                      v5 (save_original_format=False)
    mixtral       block_sparse_moe.experts.{e}.w1/w3/w2           mlp.experts.gate_up_proj [E, 2N, H], down_proj [E, H, N]
    qwen2/3-moe,  mlp.experts.{e}.gate_proj/up_proj/down_proj     mlp.experts.gate_up_proj [E, 2N, H], down_proj [E, H, N]
    olmoe, deepseek-v2/v3 (Kimi-K2)
    llama4        feed_forward.experts.gate_up_proj [E, H, 2N], down_proj [E, N, H] (input-first): the same in both
    gpt-oss       mlp.experts.gate_up_proj [E, H, 2N] (gate/up interleaved), down_proj [E, N, H], biases: the same
"""
from __future__ import annotations

import json

import pytest
import torch

from moeutil import HF_CONFIGS, HF_LAYOUTS, bit_equal, hf_expert, read_tensors, tensor_files

pytest.importorskip("transformers")

from moetool.convert.quantize import quantize  # noqa: E402
from moetool.convert.shard import shard  # noqa: E402
from moetool.read.checkpoint import open_checkpoint  # noqa: E402
from moetool.read.experts import ExpertReader  # noqa: E402

FAMILIES = list(HF_CONFIGS)
#: families moetool converts (gpt-oss: inspect only)
CONVERTED = [f for f in FAMILIES if f != "gpt_oss"]
ROWS = [(f, layout) for f in CONVERTED for layout in HF_LAYOUTS]
ROW_IDS = [f"{f}-{layout}" for f, layout in ROWS]
FORMATS = ("fp8-block", "fp8-channel", "int4-group")
#: int4 groups of 8 divide both K = hidden 32 and K = intermediate 24
GROUP_SIZE = 8
#: family -> layout -> (MoE module, expert storage as inspect shows it)
STORAGE = {
    "mixtral": {"original": ("block_sparse_moe", "per-expert"), "v5": ("mlp", "fused")},
    **{f: {"original": ("mlp", "per-expert"), "v5": ("mlp", "fused")}
       for f in ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3")},
    "llama4": {layout: ("feed_forward", "fused (input-first)") for layout in HF_LAYOUTS},
    "gpt_oss": {layout: ("mlp", "fused (interleaved gate/up) (input-first) (biases)") for layout in HF_LAYOUTS},
}


def row_format(family: str, layout: str) -> str:
    """The row's quantize format: the three formats rotate, so each meets both layouts."""
    return FORMATS[ROWS.index((family, layout)) % len(FORMATS)]


@pytest.mark.parametrize("layout", HF_LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_inspect(hf_model, cli, family, layout):
    model = hf_model(family, layout=layout)
    r = cli("inspect", model.path, "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    module, storage = STORAGE[family][layout]
    assert info["expert_storage"] == storage
    assert info["weight_format"] == "dense"
    assert info["activation"] == ("clamped SwiGLU (alpha 1.702, limit 7, up + 1)" if family == "gpt_oss"
                                  else "silu (SwiGLU)")
    with open_checkpoint(model.path) as ck:
        spec = ExpertReader(ck).spec
    assert all(m.prefix == f"model.layers.{m.index}.{module}" for m in spec.moe_layers)
    if family in ("llama4", "gpt_oss"):  # nothing to convert: transformers saves one layout
        assert tensor_files(model.path) == tensor_files(hf_model(family, layout="original").path)


@pytest.mark.parametrize("family, layout", ROWS, ids=ROW_IDS)
def test_quantize(hf_model, cli, tmp_path, family, layout):
    """Per-expert output under the input's MoE module, every expert within the format's
    round-trip error of the model's own weights, everything else bit-identical."""
    model = hf_model(family, layout=layout)
    fmt = row_format(family, layout)
    out = tmp_path / "q"
    group = ["--group-size", GROUP_SIZE] if fmt == "int4-group" else []  # another format refuses it
    r = cli("quantize", model.path, out, "--format", fmt, *group, "--quiet")
    assert r.code == 0, r.err
    src, got = read_tensors(model.path), read_tensors(out)
    with open_checkpoint(out) as ck:
        reader = ExpertReader(ck)
        assert reader.fmt.name == fmt and reader.spec.moe_layers[0].storage.kind == "per-expert"
        tol = reader.fmt.tolerance["rel_err"]
        for layer in reader.spec.moe_layers:
            assert layer.prefix.endswith("." + STORAGE[family][layout][0])
            for e in range(layer.num_experts):
                for w, q in zip(hf_expert(model, layer.prefix, e, layer.intermediate), reader.expert_fp32(layer, e)):
                    assert ((q - w).norm() / w.norm()).item() < tol, (layer.index, e)
    experts = {n for n in src if ".experts." in n}
    assert {n: t for n, t in src.items() if n not in experts}.keys() <= got.keys()
    assert all(bit_equal(got[n], t) for n, t in src.items() if n not in experts)


@pytest.mark.parametrize("family, layout", ROWS, ids=ROW_IDS)
def test_repack_both_ways(hf_model, cli, tmp_path, family, layout):
    """stacked w13 / w2 hold the model's own experts bit for bit, and so does the per-expert
    repack of that; the per-expert output loads in transformers with the model's weights."""
    model = hf_model(family, layout=layout)
    stacked, per_expert = tmp_path / "stacked", tmp_path / "per-expert"
    assert cli("repack", model.path, stacked, "--layout", "stacked", "--quiet").code == 0
    assert cli("repack", stacked, per_expert, "--layout", "per-expert", "--quiet").code == 0
    st, pe = read_tensors(stacked), read_tensors(per_expert)
    with open_checkpoint(model.path) as ck:
        spec = ExpertReader(ck).spec
    for layer in spec.moe_layers:
        for e in range(layer.num_experts):
            g, u, d = hf_expert(model, layer.prefix, e, layer.intermediate)
            assert torch.equal(st[f"{layer.prefix}.experts.w13_weight"][e], torch.cat([g, u]))
            assert torch.equal(st[f"{layer.prefix}.experts.w2_weight"][e], d)
            bases = [f"{layer.prefix}.experts.{e}.{lin}.weight" for lin in spec.family.expert_linears]
            assert all(torch.equal(pe[b], w) for b, w in zip(bases, (g, u, d)))
    if family != "llama4":  # transformers reads Llama-4's experts fused only
        import transformers

        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(per_expert, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        state = loaded.state_dict()
        assert state.keys() == model.state.keys()
        assert all(torch.equal(state[k], v) for k, v in model.state.items())


@pytest.mark.parametrize("family, layout", ROWS, ids=ROW_IDS)
def test_shard_and_merge_give_back_the_input(hf_model, cli, tmp_path, family, layout):
    """The guide's promise: the same tensor names, bytes and files (fused stays fused)."""
    model = hf_model(family, layout=layout)
    shards, merged = tmp_path / "shards", tmp_path / "merged"
    assert cli("shard", model.path, shards, "--ep", 2, "--quiet").code == 0
    assert cli("shard", "--merge", shards, merged, "--quiet").code == 0
    assert tensor_files(merged) == tensor_files(model.path)
    a, b = read_tensors(model.path), read_tensors(merged)
    assert all(bit_equal(b[n], t) for n, t in a.items())


# ------------------------------------------------------------------------------------ verify


@pytest.fixture(scope="module")
def verified(hf_model, tmp_path_factory):
    """{row id: report}: each row's quantized output sharded on EP 2 and verified (MoE blocks)
    against the transformers-saved model, every row in one world of 2 rank processes; and
    {row id: whole-model report} for the v5 rows."""
    from moetool.verify.driver import VerifyOptions, verify_many
    from moetool.verify.whole_model import WholeModelOptions, verify_whole_model_many

    root = tmp_path_factory.mktemp("layouts-verify")
    jobs, whole = [], []
    for (family, layout), rid in zip(ROWS, ROW_IDS):
        model = hf_model(family, layout=layout)
        q, sh = root / f"{rid}-q", root / f"{rid}-shards"
        quantize(model.path, q, row_format(family, layout), group_size=GROUP_SIZE, progress=False)
        shard(q, sh, 2, progress=False)
        jobs.append((sh, model.path, VerifyOptions(ep=2, tokens=16, timeout_s=300)))
        if layout == "v5":
            dense = root / f"{rid}-dense"
            shard(model.path, dense, 2, progress=False)
            whole.append((rid, (dense, model.path, WholeModelOptions(dp=1, ep=2, tokens=16, seq_len=8))))
    moe = dict(zip(ROW_IDS, verify_many(jobs)))
    return moe, dict(zip([r for r, _ in whole], verify_whole_model_many([j for _, j in whole])))


@pytest.mark.slow
@pytest.mark.parametrize("row", ROW_IDS)
def test_verify_moe_blocks(verified, row):
    report = verified[0][row]
    assert report.passed, report.render()
    assert report.format == row_format(*ROWS[ROW_IDS.index(row)])


@pytest.mark.slow
@pytest.mark.parametrize("row", [r for r in ROW_IDS if r.endswith("-v5")])
def test_verify_whole_model_v5(verified, row):
    report = verified[1][row]
    assert report.passed, report.render()
    assert report.logits["top1"] == 1.0, report.render()
