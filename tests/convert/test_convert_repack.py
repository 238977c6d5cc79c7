"""``moetool repack``: vLLM FusedMoE stacked layout and back, bit-identical, every format.

Letters: E experts, N expert intermediate, K = H hidden (w13 is [E, 2N, K], w2 is [E, K, N]).
"""
from __future__ import annotations

import json
from math import ceil

import pytest
import torch

from moetool.read.checkpoint import open_checkpoint
from moetool.read.experts import ExpertReader
from moetool.read.manifest import MANIFEST_NAME
from moeutil import bit_equal, file_of, hf_expert, read_tensors, rewrite_file, tensor_files, tree_hashes

FORMAT_ARGS = {
    "bf16": None,
    "fp8-block": ["--fp8-block"],
    "fp8-channel": ["--fp8-channel"],
    "int4-sym": ["--int4", "--group-size", "64"],
    "int4-asym": ["--int4", "--group-size", "64", "--asymmetric"],
}


def stacked_shapes(fmt_id: str, E: int, N: int, K: int) -> dict[str, tuple]:
    """vLLM FusedMoE parameter shapes of one layer, by suffix of ``experts.``."""
    if fmt_id == "bf16":
        return {"w13_weight": (E, 2 * N, K), "w2_weight": (E, K, N)}
    if fmt_id == "fp8-block":
        return {"w13_weight": (E, 2 * N, K), "w2_weight": (E, K, N),
                "w13_weight_scale_inv": (E, 2 * ceil(N / 128), ceil(K / 128)),
                "w2_weight_scale_inv": (E, ceil(K / 128), ceil(N / 128))}
    if fmt_id == "fp8-channel":
        return {"w13_weight": (E, 2 * N, K), "w2_weight": (E, K, N),
                "w13_weight_scale": (E, 2 * N, 1), "w2_weight_scale": (E, K, 1)}
    g = 64
    shapes = {"w13_weight_packed": (E, 2 * N, K // 8), "w2_weight_packed": (E, K, N // 8),
              "w13_weight_scale": (E, 2 * N, K // g), "w2_weight_scale": (E, K, N // g),
              "w13_weight_shape": (E, 2), "w2_weight_shape": (E, 2)}
    if fmt_id == "int4-asym":
        shapes |= {"w13_weight_zero_point": (E, ceil(2 * N / 8), K // g), "w2_weight_zero_point": (E, ceil(K / 8), N // g)}
    return shapes


@pytest.fixture(scope="module")
def inputs(tiny, tmp_path_factory):
    """Per-expert checkpoints in every format: DeepSeek-V3 layout, hidden 320 and intermediate
    192, so fp8 blocks are partial in both directions and w13 keeps per-half scale rows."""
    from moetool.convert.quantize import quantize

    src = tiny("deepseek_v3", hidden=320, intermediate=192)
    root = tmp_path_factory.mktemp("repack_inputs")
    out = {"bf16": src}
    for fmt_id, args in FORMAT_ARGS.items():
        if args is None:
            continue
        name = {"fp8-block": "fp8-block", "fp8-channel": "fp8-channel"}.get(fmt_id, "int4-group")
        params = {"group_size": 64, "symmetric": fmt_id == "int4-sym"} if name == "int4-group" else {}
        quantize(src, root / fmt_id, name, progress=False, **params)
        (root / fmt_id / MANIFEST_NAME).unlink()  # an input like any other
        out[fmt_id] = root / fmt_id
    return out


@pytest.mark.parametrize("fmt_id", list(FORMAT_ARGS))
def test_per_expert_to_stacked_and_back(inputs, cli, tmp_path, fmt_id):
    src = inputs[fmt_id]
    before = tree_hashes(src)
    stacked, back = tmp_path / "stacked", tmp_path / "back"
    r = cli("repack", src, stacked, "--quiet")
    assert r.code == 0, r.err
    r = cli("repack", stacked, back, "--layout", "per-expert", "--quiet")
    assert r.code == 0, r.err
    assert tree_hashes(src) == before
    # per-expert -> stacked -> per-expert: every tensor bit-identical. (A layer whose experts
    # straddle two input files comes back whole in the file of its expert 0: the stacked
    # checkpoint does not remember the per-expert homes; test_round_trip_same_bytes.)
    a, b = read_tensors(src), read_tensors(back)
    assert set(a) == set(b)
    assert all(bit_equal(a[n], b[n]) for n in a), [n for n in a if not bit_equal(a[n], b[n])][:3]
    fa, fb = tensor_files(src), tensor_files(back)
    assert {n for n in fa if fa[n] != fb[n]} <= {n for n in fa if ".experts." in n}

    # stacked: vLLM FusedMoE names and shapes, the experts' own tensors stacked (gate rows, then up)
    s = read_tensors(stacked)
    orig = read_tensors(src)
    with open_checkpoint(src) as ck:
        reader = ExpertReader(ck)
        spec, fmt = reader.spec, reader.fmt
        for layer in spec.moe_layers:
            E, N, K = layer.num_experts, layer.intermediate, layer.hidden
            p = f"{layer.prefix}.experts."
            names = {n[len(p):] for n in s if n.startswith(p)}
            shapes = stacked_shapes(fmt_id, E, N, K)
            assert names == set(shapes)
            for suffix, shape in shapes.items():
                assert tuple(s[p + suffix].shape) == shape, suffix
            for e in range(E):
                gate, up, down = reader.gate_up_down(layer, e)
                w13 = fmt.cat_rows([gate, up])
                for suf, t in w13.items():
                    assert bit_equal(s[f"{p}w13_{suf}"][e], t), (layer.index, e, suf)
                for suf, t in down.items():
                    assert bit_equal(s[f"{p}w2_{suf}"][e], t), (layer.index, e, suf)
                # and the logical weight: gate rows first (split by the sizes: an fp8-block w13
                # of N % 128 != 0 carries per-half scale rows and is never read as one linear)
                g13, u13 = fmt.split_rows({k: s[f"{p}w13_{k}"][e] for k in fmt.suffixes}, [N, N])
                assert torch.equal(fmt.dequantize(g13), fmt.dequantize(gate))
                assert torch.equal(fmt.dequantize(u13), fmt.dequantize(up))
    # non-expert tensors untouched
    for name, t in orig.items():
        if ".experts." not in name:
            assert bit_equal(s[name], t), name
    assert json.loads((stacked / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert json.loads(cli("inspect", stacked, "--json").out)["expert_storage"] == "stacked"


@pytest.mark.parametrize("fmt_id", list(FORMAT_ARGS))
def test_round_trip_same_bytes(tiny, cli, tmp_path, fmt_id):
    """One input file: per-expert -> stacked -> per-expert gives the same files byte for byte
    (the input written by moetool, so that tensor order within the file is moetool's)."""
    src = tmp_path / "src"
    base = tiny("mixtral", hidden=192, intermediate=128, shards=1)
    args = FORMAT_ARGS[fmt_id] or []
    assert cli("quantize" if args else "repack", base, src, *(args or ["--layout", "per-expert"]), "--quiet").code == 0
    assert cli("repack", src, tmp_path / "stacked", "--quiet").code == 0
    assert cli("repack", tmp_path / "stacked", tmp_path / "back", "--layout", "per-expert", "--quiet").code == 0
    assert tree_hashes(tmp_path / "back") == tree_hashes(src)


def test_fp8_block_stacked_scale_rows_per_half(inputs):
    """N = 192: one w13 of 384 rows has 2*ceil(192/128) = 4 scale rows (gate's 2, then up's 2),
    not ceil(384/128) = 3: vLLM's w13_weight_scale_inv."""
    from moetool.convert.repack import repack

    stacked = inputs["fp8-block"].parent / "fp8-block-stacked"
    repack(inputs["fp8-block"], stacked, "stacked", progress=False)
    s, orig = read_tensors(stacked), read_tensors(inputs["fp8-block"])
    sc = s["model.layers.1.mlp.experts.w13_weight_scale_inv"]
    assert tuple(sc.shape) == (8, 4, 3)
    assert torch.equal(sc[5, :2], orig["model.layers.1.mlp.experts.5.gate_proj.weight_scale_inv"])
    assert torch.equal(sc[5, 2:], orig["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"])


@pytest.mark.parametrize("family", ["llama4", "qwen3_moe"])
def test_fused_inputs_normalised(hf_model, cli, tmp_path, family):
    """transformers-made fused (Llama-4 input-first) and per-expert models: stacked w13/w2 hold
    the module's own gate/up/down."""
    model = hf_model(family)
    out = tmp_path / "stacked"
    assert cli("repack", model.path, out, "--quiet").code == 0
    s = read_tensors(out)
    with open_checkpoint(model.path) as ck:
        spec = ExpertReader(ck).spec
    for layer in spec.moe_layers:
        N = layer.intermediate
        for e in range(layer.num_experts):
            g, u, d = hf_expert(model, layer.prefix, e, N)
            assert torch.equal(s[f"{layer.prefix}.experts.w13_weight"][e], torch.cat([g, u]))
            assert torch.equal(s[f"{layer.prefix}.experts.w2_weight"][e], d)
    # and stacked -> per-expert gives the HF per-expert names of the family
    per = tmp_path / "per"
    assert cli("repack", out, per, "--layout", "per-expert", "--quiet").code == 0
    p = read_tensors(per)
    layer = spec.moe_layers[-1]
    g, u, d = hf_expert(model, layer.prefix, 3, layer.intermediate)
    assert torch.equal(p[f"{layer.prefix}.experts.3.gate_proj.weight"], g)
    assert torch.equal(p[f"{layer.prefix}.experts.3.up_proj.weight"], u)
    assert torch.equal(p[f"{layer.prefix}.experts.3.down_proj.weight"], d)


@pytest.mark.parametrize("family", ["llama4", "qwen3_moe"])
def test_fused_on_disk_from_our_writer(tiny, cli, tmp_path, family):
    src = tiny(family, layout="v5" if family == "qwen3_moe" else "original")
    out, per = tmp_path / "stacked", tmp_path / "per"
    assert cli("repack", src, out, "--quiet").code == 0
    assert cli("repack", src, per, "--layout", "per-expert", "--quiet").code == 0
    s, p = read_tensors(out), read_tensors(per)
    with open_checkpoint(src) as ck:
        reader = ExpertReader(ck)
        for layer in reader.spec.moe_layers:
            for e in range(layer.num_experts):
                g, u, d = (x["weight"] for x in reader.gate_up_down(layer, e))
                assert torch.equal(s[f"{layer.prefix}.experts.w13_weight"][e], torch.cat([g, u]))
                assert torch.equal(s[f"{layer.prefix}.experts.w2_weight"][e], d)
                assert torch.equal(p[f"{layer.prefix}.experts.{e}.gate_proj.weight"], g)
                assert torch.equal(p[f"{layer.prefix}.experts.{e}.down_proj.weight"], d)
    assert not any("gate_up_proj" in n for n in s) and not any("gate_up_proj" in n for n in p)


def test_quantize_straight_to_stacked(inputs, cli, tmp_path):
    """quantize --layout stacked == quantize, then repack."""
    direct = tmp_path / "direct"
    assert cli("quantize", inputs["bf16"], direct, "--fp8-block", "--layout", "stacked", "--quiet").code == 0
    two = tmp_path / "two"
    assert cli("repack", inputs["fp8-block"], two, "--quiet").code == 0
    a, b = read_tensors(direct), read_tensors(two)
    assert set(a) == set(b)
    for name in a:
        assert bit_equal(a[name], b[name]), name


def test_requantize_stacked_input(inputs, cli, tmp_path):
    """A stacked fp8 checkpoint is read like any other: to int4, per-expert, equals the
    int4 of the per-expert fp8 input."""
    stacked = tmp_path / "stacked"
    assert cli("repack", inputs["fp8-block"], stacked, "--quiet").code == 0
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli("quantize", stacked, a, "--int4", "--group-size", "64", "--layout", "per-expert", "--quiet").code == 0
    assert cli("quantize", inputs["fp8-block"], b, "--int4", "--group-size", "64", "--quiet").code == 0
    ta, tb = read_tensors(a), read_tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        assert bit_equal(ta[name], tb[name]), name


def test_stacked_missing_scale_partner(inputs, cli, tmp_path, copy_ckpt):
    stacked = tmp_path / "stacked"
    assert cli("repack", inputs["fp8-block"], stacked, "--quiet").code == 0
    (stacked / MANIFEST_NAME).unlink()
    name = "model.layers.2.mlp.experts.w2_weight_scale_inv"
    rewrite_file(file_of(stacked, name), lambda t: t.pop(name))
    for args in (["repack", "--layout", "per-expert"], ["quantize", "--int4"], ["shard", "--ep", "2"]):
        r = cli(args[0], stacked, tmp_path / "out", *args[1:], "--quiet")
        assert r.code == 2
        assert r.error_line == f"{name}: not found (layer 2; fp8-block stores weight, weight_scale_inv)"
        assert not (tmp_path / "out").exists()


def test_stacked_wrong_expert_count(inputs, cli, tmp_path):
    stacked = tmp_path / "stacked"
    assert cli("repack", inputs["bf16"], stacked, "--quiet").code == 0
    (stacked / MANIFEST_NAME).unlink()
    name = "model.layers.2.mlp.experts.w2_weight"
    rewrite_file(file_of(stacked, name), lambda t: t.__setitem__(name, t[name][:7].clone()))
    r = cli("repack", stacked, tmp_path / "out", "--layout", "per-expert", "--quiet")
    assert r.code == 2
    assert r.error_line == f"{name}: shape [7, 320, 192], expected 8 experts in its first dimension"


def test_repack_options(inputs, cli, tmp_path):
    r = cli("repack", inputs["bf16"], tmp_path / "o", "--layout", "blocked")
    assert r.code == 2 and r.error_line == "--layout 'blocked': expected per-expert, stacked or fused"
    r = cli("repack", inputs["bf16"], tmp_path / "o", "--dry-run")
    assert r.code == 0 and r.out.startswith("plan: 2 file(s), format dense, layout stacked")
    assert not (tmp_path / "o").exists()
    r = cli("repack", inputs["bf16"], inputs["bf16"] / "inside", "--quiet")
    assert r.code == 2 and "is inside the input" in r.error_line


@pytest.mark.parametrize("byte_copy", [True, False])
def test_output_file_that_cannot_be_written_is_one_error_line(tiny, cli, tmp_path, byte_copy):
    """An OSError (here a folder where an output file goes) is one line naming the file and
    exit status 2, from the byte copy and from the torch executor (fp8 input: no byte copy)."""
    base = tiny("mixtral", hidden=192, intermediate=128, shards=1)
    if not byte_copy:
        assert cli("quantize", base, tmp_path / "fp8", "--fp8-block", "--quiet").code == 0
        base = tmp_path / "fp8"
    out = tmp_path / "out"
    (out / "model.safetensors.incomplete").mkdir(parents=True)
    r = cli("repack", base, out, "--quiet", "--force")  # --force: the folder is not refused as foreign
    assert r.code == 2, r.err
    assert r.error_line == f"{out / 'model.safetensors.incomplete'}: Is a directory"
