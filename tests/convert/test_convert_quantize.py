"""``moetool quantize``: bit-exact experts, pass-through everything else, configs loaders read,
atomic and resumable output, every bad input a one-line error.

The reference for each expert is the format's own ``quantize`` applied to the weight that the
ExpertReader returns (which test_arch checks against transformers' modules), so these tests
pin the conversion plumbing: names, files, dtypes, scales and which tensors are touched.
"""
from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
import warm_python

from moetool.read.checkpoint import open_checkpoint
from moetool.read.manifest import QUANTIZED_KEY
from moetool.convert.torch_executor import model_dtype
from moetool.read.experts import ExpertReader
from moetool.read.checkpoint import expert_tensor_names
from moetool.formats import TOLERANCES, Fp8Block, Fp8Channel, Int4Group, get_format
from moetool.read.manifest import JOURNAL_NAME, MANIFEST_NAME, sha256_file
from moetool.errors import MoetoolError
from moeutil import bit_equal, file_of, read_tensors, rewrite_file, tensor_files, tree_hashes

FORMATS = {
    "fp8-block": (["--fp8-block"], Fp8Block()),
    "fp8-channel": (["--fp8-channel"], Fp8Channel()),
    "int4-g128-sym": (["--int4"], Int4Group(128, True)),
    "int4-g64-asym": (["--int4", "--group-size", "64", "--asymmetric"], Int4Group(64, False)),
    "int4-g128-mse": (["--int4", "--int4-clip", "mse"], Int4Group(128, True, "mse")),
}
ROLES = ("gate", "up", "down")


def expert_names(ckpt) -> set[str]:
    spec = ExpertReader(ckpt).spec
    names: set[str] = set()
    for layer in spec.moe_layers:
        names |= expert_tensor_names(ckpt, layer)
    return names


def check_quantized(src: Path, out: Path, fmt, *, include_shared: bool = False, same_files: bool = True) -> dict:
    """Every check of a quantize output against its input; returns the output config."""
    out_t = read_tensors(out)
    with open_checkpoint(src) as ck_in, open_checkpoint(out) as ck_out:
        reader = ExpertReader(ck_in)
        spec = reader.spec
        dtype = model_dtype(ck_in.config)
        in_fmt = reader.fmt
        experts_in = expert_names(ck_in)
        shared_bases = {b for m in spec.moe_layers for b in (m.shared_bases or ())}
        # 1. routed experts: bit-exact against the format's quantize of the original weight
        lin_names = spec.family.expert_linears
        produced: set[str] = set()
        for layer in spec.moe_layers:
            for e in range(layer.num_experts):
                for r, lin in enumerate(reader.gate_up_down(layer, e)):
                    base = f"{layer.prefix}.experts.{e}.{lin_names[r]}"
                    want = fmt.quantize(in_fmt.dequantize(lin), dtype)
                    for s, t in want.items():
                        assert bit_equal(out_t[f"{base}.{s}"], t), f"{base}.{s}"
                        produced.add(f"{base}.{s}")
        # 2. shared experts: quantized when asked, else untouched
        for base in shared_bases:
            if include_shared:
                want = fmt.quantize(ck_in.get(f"{base}.weight").float(), dtype)
                for s, t in want.items():
                    assert bit_equal(out_t[f"{base}.{s}"], t), f"{base}.{s}"
                    produced.add(f"{base}.{s}")
        # 3. everything else: bit-identical, in the same file as in the input
        in_files, out_files = tensor_files(src), tensor_files(out)
        for name in ck_in.tensors:
            if name in experts_in or (include_shared and name.rpartition(".")[0] in shared_bases):
                continue
            assert bit_equal(out_t[name], ck_in.get(name)), name
            assert out_files[name] == in_files[name] or not same_files, name
            produced.add(name)
        assert set(out_t) == produced, sorted(set(out_t) ^ produced)[:5]
        assert sorted(ck_out.files) == sorted(ck_in.files) or not same_files
        # 4. the output reads back as the format
        assert ExpertReader(ck_out).fmt == fmt
        cfg = ck_out.config
    # 5. config: the input's plus the format's quantization_config with the right ignore list
    cfg_in = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == \
        {**{k: v for k, v in cfg_in.items() if k != "quantization_config"}, QUANTIZED_KEY: fmt.name}
    qc = cfg["quantization_config"]
    ignore = qc.get("ignore", qc.get("ignored_layers", []))
    assert qc == fmt.quantization_config(ignore)
    ignore = set(ignore)
    for layer in spec.moe_layers:
        assert layer.router_weight.removesuffix(".weight") in ignore
        for e in range(layer.num_experts):
            assert not {f"{layer.prefix}.experts.{e}.{n}" for n in lin_names} & ignore
        if layer.shared_gate_weight:
            assert layer.shared_gate_weight.removesuffix(".weight") in ignore
    assert "lm_head" in ignore
    assert {n.removesuffix(".weight") for n in out_t if ".self_attn." in n and n.endswith("proj.weight")} <= ignore
    assert (shared_bases <= ignore) != include_shared or not shared_bases
    # every unquantized 2-D float linear is ignored, no quantized one is
    for name, t in out_t.items():
        base = name.rpartition(".")[0]
        if name.endswith(".weight") and t.dim() == 2 and t.dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert base in ignore, base
    quantized_bases = {n.rpartition(".")[0] for n in out_t if n.rpartition(".")[2] in fmt.suffixes[1:] or
                       n.endswith("weight_packed")}
    assert quantized_bases and not quantized_bases & ignore
    # 6. manifest: sha256 and size of every file, journal gone
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert set(manifest["files"]) == files
    for name, rec in manifest["files"].items():
        assert rec == {"sha256": sha256_file(out / name), "size": (out / name).stat().st_size}
    assert manifest["kind"] == "checkpoint" and manifest["format"] == fmt.name
    assert not (out / JOURNAL_NAME).exists()
    assert not list(out.rglob("*.incomplete"))
    return cfg


def check_summary(text: str, fmt, linears: int) -> None:
    lines = text.strip().splitlines()
    assert "tensors" in lines[0] and "GB/s" in lines[0] and "0 resumed" in lines[0]
    err = lines[1]
    assert err.startswith(f"{fmt.name} error over {linears} linears: mean rel ")
    max_rel = float(err.split("max rel ")[1].split(",")[0])
    assert 0 < max_rel < TOLERANCES[fmt.name]["rel_err"]
    assert "SQNR" in err


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt_id", list(FORMATS))
def test_quantize_tiny(tiny, cli, tmp_path, family, fmt_id):
    args, fmt = FORMATS[fmt_id]
    src = tiny(family)
    before = tree_hashes(src)
    out = tmp_path / "out"
    r = cli("quantize", src, out, *args, "--quiet")
    assert r.code == 0, r.err
    assert tree_hashes(src) == before  # the input folder is never written
    check_quantized(src, out, fmt)
    with open_checkpoint(src) as ck:
        spec = ExpertReader(ck).spec
    check_summary(r.out, fmt, sum(3 * m.num_experts for m in spec.moe_layers))


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "deepseek_v2", "mixtral", "llama4"])
@pytest.mark.parametrize("args, fmt", [(["--fp8-block"], Fp8Block()), (["--fp8-channel"], Fp8Channel()),
                                       (["--int4", "--group-size", "8"], Int4Group(8, True))],
                         ids=["fp8-block", "fp8-channel", "int4-g8"])
def test_quantize_transformers_models(hf_model, cli, tmp_path, family, args, fmt):
    """float32 models saved by transformers, hidden 32 / intermediate 24: every fp8 block is a
    partial one; int4 with groups of 8 (a divisor of both K = 32 and K = 24)."""
    model = hf_model(family)
    out = tmp_path / "out"
    r = cli("quantize", model.path, out, *args, "--quiet")
    assert r.code == 0, r.err
    cfg = check_quantized(model.path, out, fmt)
    # side files are copied as they are (and listed in the manifest)
    gen = model.path / "generation_config.json"
    assert (out / "generation_config.json").read_bytes() == gen.read_bytes()
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert loaded.model_type == model.config["model_type"]
    qc = loaded.quantization_config
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    assert qc["quant_method"] == cfg["quantization_config"]["quant_method"]


@pytest.mark.parametrize("family", ["llama4", "qwen3_moe-v5"])
def test_quantize_fused_inputs_write_per_expert(tiny, cli, tmp_path, family):
    src = tiny("qwen3_moe", layout="v5") if family == "qwen3_moe-v5" else tiny(family)
    out = tmp_path / "out"
    r = cli("quantize", src, out, "--fp8-block", "--quiet")
    assert r.code == 0, r.err
    check_quantized(src, out, Fp8Block())
    info = json.loads(cli("inspect", out, "--json").out)
    assert info["expert_storage"] == "per-expert"


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "llama4"])
def test_include_shared_experts(tiny, cli, tmp_path, family):
    src = tiny(family)
    out = tmp_path / "out"
    r = cli("quantize", src, out, "--int4", "--include-shared-experts", "--quiet")
    assert r.code == 0, r.err
    check_quantized(src, out, Int4Group(), include_shared=True)
    with open_checkpoint(src) as ck:
        spec = ExpertReader(ck).spec
    # the summary counts each converted linear once: routed experts and the shared ones
    check_summary(r.out, Int4Group(), sum(3 * m.num_experts + 3 for m in spec.moe_layers))


# ------------------------------------------------------------------------------ requantize


def test_requantize_fp8_block_to_int4(tiny, cli, tmp_path):
    src = tiny("deepseek_v3")
    fp8 = tmp_path / "fp8"
    assert cli("quantize", src, fp8, "--fp8-block", "--quiet").code == 0
    int4 = tmp_path / "int4"
    r = cli("quantize", fp8, int4, "--int4", "--group-size", "64", "--quiet")
    assert r.code == 0, r.err
    cfg = check_quantized(fp8, int4, Int4Group(64, True))  # reference: int4 of dequantized fp8
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    # non-experts still bit-identical to the original bf16 model
    orig, got = read_tensors(src), read_tensors(int4)
    for name in ("lm_head.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                 "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert bit_equal(got[name], orig[name])


def _all_fp8_checkpoint(path: Path) -> Path:
    """A DeepSeek-V3-style checkpoint where attention, dense and shared MLPs are fp8-block too
    (only embeddings, norms, routers and lm_head are not)."""
    from moetool.demo.tiny import tiny_config, tiny_tensors, write_checkpoint

    cfg = tiny_config("deepseek_v3", hidden=256, intermediate=128, experts=8, top_k=2, layers=3,
                      dtype=torch.bfloat16)
    fmt = Fp8Block()
    out = {}
    for k, v in tiny_tensors("deepseek_v3", cfg).items():
        if k.endswith("proj.weight") and v.dim() == 2:
            out.update({f"{k.removesuffix('.weight')}.{s}": t for s, t in fmt.quantize(v.float(), v.dtype).items()})
        else:
            out[k] = v
    cfg["quantization_config"] = fmt.quantization_config(["lm_head"])
    return write_checkpoint(path, cfg, out, shards=2)


def test_requantize_fully_fp8_model(tmp_path, cli):
    """Quantized non-expert linears of another format are written back dequantized, in the
    model dtype, and listed in the ignore list."""
    src = _all_fp8_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    r = cli("quantize", src, out, "--int4", "--quiet")
    assert r.code == 0, r.err
    got, orig = read_tensors(out), read_tensors(src)
    q = "model.layers.0.self_attn.q_a_proj"
    assert f"{q}.weight_scale_inv" not in got
    want = Fp8Block().dequantize({"weight": orig[f"{q}.weight"], "weight_scale_inv": orig[f"{q}.weight_scale_inv"]})
    assert bit_equal(got[f"{q}.weight"], want.to(torch.bfloat16))
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert q in ignore and "model.layers.1.mlp.shared_experts.gate_proj" in ignore
    # routed experts: int4 of the fp8 values
    with open_checkpoint(src) as ck:
        layer = ExpertReader(ck).spec.moe_layers[0]
        w = ExpertReader(ck).expert_fp32(layer, 3)[2]
    ref = Int4Group().quantize(w, torch.bfloat16)
    for s, t in ref.items():
        assert bit_equal(got[f"model.layers.1.mlp.experts.3.down_proj.{s}"], t)


def test_fp8_weight_without_scale_is_refused(tmp_path, cli):
    src = _all_fp8_checkpoint(tmp_path / "src")
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    rewrite_file(file_of(src, name), lambda t: t.pop(name))
    for args in (["--int4"], ["--fp8-channel"]):
        r = cli("quantize", src, tmp_path / "out", *args, "--quiet")
        assert r.code == 2
        assert r.error_line == ("model.layers.0.self_attn.q_a_proj.weight: float8_e4m3fn weight without its scale "
                                "(model.layers.0.self_attn.q_a_proj.weight_scale_inv not found)")
        assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ loaders


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("args, fmt", [
    (["--fp8-block"], Fp8Block()),
    (["--fp8-channel"], Fp8Channel()),
    (["--int4", "--group-size", "64"], Int4Group(64, True)),
], ids=["fp8-block", "fp8-channel", "int4-sym"])
def test_transformers_loads_quantized_moe(hf_model, cli, tmp_path, args, fmt):
    """transformers (dequantizing on load, so it runs on CPU) reads our output of a Qwen3-MoE
    and holds exactly our dequantized experts (rounded once to bf16), the rest untouched.

    Shapes are multiples of 128: transformers fuses the per-expert fp8 blocks into
    gate_up_proj and cannot do that when N is not (its limitation, not the checkpoint's).
    Asymmetric int4 is not here: transformers 5.23 drops weight_zero_point when it fuses
    compressed-tensors experts ("Asymmetric quant requires zero-point values"); the next test
    decompresses those experts with compressed-tensors itself."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    model = hf_model("qwen3_moe", hidden_size=128, moe_intermediate_size=256, head_dim=32, dtype=torch.bfloat16)
    out = tmp_path / "out"
    assert cli("quantize", model.path, out, *args, "--quiet").code == 0
    if isinstance(fmt, Fp8Block):
        qc = transformers.FineGrainedFP8Config(dequantize=True)
    else:
        qc = transformers.CompressedTensorsConfig(dequantize=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, quantization_config=qc)
    state = loaded.state_dict()
    with open_checkpoint(out) as ck:
        reader = ExpertReader(ck)
        for layer in reader.spec.moe_layers:
            gu = state[f"{layer.prefix}.experts.gate_up_proj"]
            dn = state[f"{layer.prefix}.experts.down_proj"]
            for e in range(layer.num_experts):
                g, u, d = reader.expert_fp32(layer, e)
                assert torch.equal(gu[e], torch.cat([g, u]).to(torch.bfloat16)), (layer.index, e)
                assert torch.equal(dn[e], d.to(torch.bfloat16)), (layer.index, e)
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.gate.weight", "lm_head.weight"):
            assert torch.equal(state[name], ck.get(name)), name


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("args", [["--fp8-channel"], ["--int4", "--group-size", "64"]], ids=["fp8-channel", "int4"])
def test_transformers_keeps_a_tied_lm_head_unquantized(hf_model, cli, tmp_path, args):
    """Tied embeddings store no lm_head.weight, but lm_head is a linear of the model: the
    ignore list names it, or transformers quantizes it on load (fp8-channel: logits ~1e16 off;
    int4: AttributeError while loading)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    model = hf_model("qwen3_moe", hidden_size=128, moe_intermediate_size=256, head_dim=32, dtype=torch.bfloat16,
                     tie_word_embeddings=True)
    out = tmp_path / "out"
    assert cli("quantize", model.path, out, *args, "--quiet").code == 0
    assert "lm_head" in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    with open_checkpoint(out) as ck:
        assert "lm_head.weight" not in ck
        assert torch.equal(loaded.lm_head.weight, ck.get("model.embed_tokens.weight"))


@pytest.mark.parametrize("args", [["--int4", "--asymmetric", "--group-size", "64"], ["--int4"], ["--fp8-channel"]],
                         ids=["int4-asym", "int4-sym", "fp8-channel"])
def test_compressed_tensors_decompresses_every_expert(tiny, cli, tmp_path, args):
    """compressed-tensors' own compressor, fed each expert's tensors as stored in our output
    with the scheme parsed from our config.json, gives our dequantized values."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "out"
    assert cli("quantize", tiny("mixtral"), out, *args, "--quiet").code == 0
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    compressor = BaseCompressor.get_value_from_registry(qc.format)
    scheme = qc.config_groups["group_0"]
    with open_checkpoint(out) as ck:
        reader = ExpertReader(ck)
        for layer in reader.spec.moe_layers:
            for e in range(layer.num_experts):
                for lin in reader.gate_up_down(layer, e):
                    theirs = compressor.decompress(dict(lin), scheme)["weight"]
                    assert torch.equal(theirs, reader.fmt.dequantize(lin).to(theirs.dtype)), (layer.index, e)


def test_compressed_tensors_parses_our_config(tiny, cli, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "out"
    assert cli("quantize", tiny("mixtral"), out, "--int4", "--asymmetric", "--quiet").code == 0
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    w = qc.config_groups["group_0"].weights
    assert (w.num_bits, w.group_size, w.symmetric, str(getattr(w.strategy, "value", w.strategy))) == (4, 128, False, "group")
    assert "model.layers.0.block_sparse_moe.gate" in qc.ignore


# ------------------------------------------------------------------------------ options and bad inputs


def test_dry_run_writes_nothing(tiny, cli, tmp_path):
    out = tmp_path / "out"
    r = cli("quantize", tiny("mixtral"), out, "--fp8-block", "--dry-run")
    assert r.code == 0, r.err
    assert r.out.startswith("plan: 2 file(s), format fp8-block, layout per-expert")
    assert "model-00001-of-00002.safetensors" in r.out
    assert not out.exists()


@pytest.mark.parametrize("case", ["the-input", "inside-the-input", "foreign-files", "complete", "another-plan",
                                  "under-a-file"])
@pytest.mark.parametrize("command", ["quantize", "shard", "merge"])
def test_dry_run_refuses_what_the_run_refuses(tiny, cli, tmp_path, copy_ckpt, monkeypatch, command, case):
    """--dry-run printed a plan, exit 0, for outputs the real run refuses; it now says what the
    run would say, still writing nothing."""
    from moetool.convert.shard import shard

    src = copy_ckpt(tiny("mixtral"))
    if command == "merge":
        ranks = tmp_path / "ranks"
        shard(src, ranks, 2, progress=False)
        src = ranks
    args = {"quantize": ["quantize", src], "shard": ["shard", src], "merge": ["shard", "--merge", src]}[command]
    option, other = {"quantize": (["--fp8-block"], ["--int4"]), "shard": (["--ep", "2"], ["--ep", "4"]),
                     "merge": ([], ["--max-shard-size", "1MB"])}[command]
    run = lambda out, *more: cli(*args, out, "--quiet", *more)  # noqa: E731
    out = {"the-input": src, "inside-the-input": src / "sub", "under-a-file": tmp_path / "a-file" / "out"}.get(
        case, tmp_path / "out")
    if case == "under-a-file":
        (tmp_path / "a-file").write_text("not a folder")
    if case == "foreign-files":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "complete":
        assert run(out, *option).code == 0
    elif case == "another-plan":  # an unfinished output of the same command with other options
        from moetool.convert.output import OutputDir

        def stopped(self, *args, **kw):
            raise MoetoolError("stopped before its manifest")

        with monkeypatch.context() as m:
            m.setattr(OutputDir, "finish", stopped)
            r = run(out, *other)
            assert r.code == 2 and r.error_line == "stopped before its manifest", r
    before = tree_hashes(tmp_path)
    real = run(out, *option)
    dry = run(out, *option, "--dry-run")
    assert real.code == dry.code == 2 and dry.error_line == real.error_line, (real, dry)
    assert tree_hashes(tmp_path) == before


def test_complete_output_refused_without_force(tiny, cli, tmp_path):
    src, out = tiny("mixtral"), tmp_path / "out"
    assert cli("quantize", src, out, "--fp8-block", "--quiet").code == 0
    first = tree_hashes(out)
    r = cli("quantize", src, out, "--fp8-block", "--quiet")
    assert r.code == 2
    assert r.error_line == f"{out}: already holds a complete output (manifest.json); use --force to overwrite"
    assert tree_hashes(out) == first
    r = cli("quantize", src, out, "--fp8-block", "--quiet", "--force")
    assert r.code == 0 and "2 file(s) written, 0 resumed" in r.out
    assert tree_hashes(out) == first


@pytest.mark.parametrize("where", ["inside", "same", "parent"])
def test_output_inside_input_refused(tiny, cli, tmp_path, copy_ckpt, where):
    src = copy_ckpt(tiny("mixtral", hidden=64, intermediate=32))
    before = tree_hashes(src)
    out = {"inside": src / "quantized", "same": src, "parent": src.parent}[where]
    r = cli("quantize", src, out, "--fp8-block", "--quiet")
    assert r.code == 2
    if where == "parent":
        assert r.error_line == f"input {src} is inside the output {out}; choose an output folder elsewhere"
    else:
        assert r.error_line == f"output {out} is inside the input {src}; the input folder is never written"
    assert tree_hashes(src) == before


def test_nan_weight_names_the_tensor(tiny, cli, tmp_path, copy_ckpt):
    src = copy_ckpt(tiny("mixtral"))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"

    def poison(t):
        t[name][3, 5] = float("nan")

    rewrite_file(file_of(src, name), poison)
    out = tmp_path / "out"
    r = cli("quantize", src, out, "--fp8-block", "--quiet")
    assert r.code == 2
    assert r.error_line == "model.layers.1.block_sparse_moe.experts.2.w3.weight: contains NaN/Inf (1 of 32768 values)"
    assert not (out / MANIFEST_NAME).exists()


def test_inf_in_a_shared_expert(tiny, cli, tmp_path, copy_ckpt):
    src = copy_ckpt(tiny("qwen2_moe"))
    name = "model.layers.0.mlp.shared_expert.up_proj.weight"

    def poison(t):
        t[name][0, 0] = float("inf")

    rewrite_file(file_of(src, name), poison)
    r = cli("quantize", src, tmp_path / "out", "--int4", "--include-shared-experts", "--quiet")
    assert r.code == 2
    assert r.error_line == "model.layers.0.mlp.shared_expert.up_proj.weight: contains NaN/Inf (1 of 65536 values)"
    # without --include-shared-experts the tensor passes through untouched (it is not quantized)
    assert cli("quantize", src, tmp_path / "out2", "--int4", "--quiet").code == 0


def test_group_size_not_dividing_k(tiny, cli, tmp_path):
    out = tmp_path / "out"
    r = cli("quantize", tiny("mixtral"), out, "--int4", "--group-size", "96", "--quiet")
    assert r.code == 2
    assert r.error_line == ("model.layers.0.block_sparse_moe.experts.0.w1.weight: has K=256 columns, which group size 96 "
                            "does not divide (compressed-tensors and vLLM need whole groups; pick a divisor of K)")
    assert not out.exists()  # found while planning, before any output


@pytest.mark.parametrize("expert", [2, 0])
def test_missing_scale_partner(tiny, cli, tmp_path, expert):
    fp8 = tmp_path / "fp8"
    assert cli("quantize", tiny("mixtral"), fp8, "--fp8-block", "--quiet").code == 0
    (fp8 / MANIFEST_NAME).unlink()
    name = f"model.layers.1.block_sparse_moe.experts.{expert}.w3.weight_scale_inv"
    rewrite_file(file_of(fp8, name), lambda t: t.pop(name))
    for args in (["--int4"], ["--fp8-channel"]):
        out = tmp_path / "out"
        r = cli("quantize", fp8, out, *args, "--quiet")
        assert r.code == 2
        assert r.error_line == (f"{name}: not found (expert {expert} of layer 1; fp8-block stores weight, "
                                "weight_scale_inv)")
        assert not out.exists()


@pytest.mark.parametrize("flags, spelled", [
    (["--fp8-block"], ["--format", "fp8-block"]),
    (["--fp8-channel"], ["--format", "fp8-channel"]),
    (["--int4", "--group-size", "64", "--asymmetric"], ["--format", "int4-group", "--group-size", "64", "--asymmetric"]),
    (["--int4"], ["--int4", "--format", "int4-group"]),  # both spellings of one format
], ids=["fp8-block", "fp8-channel", "int4-g64-asym", "int4-both"])
def test_format_option_writes_what_the_flag_writes(tiny, cli, tmp_path, flags, spelled):
    """``--format NAME`` (and its parameters' options) is another spelling of the format's flag:
    the same bytes in every output file."""
    src = tiny("mixtral")
    assert cli("quantize", src, tmp_path / "flag", *flags, "--quiet").code == 0
    r = cli("quantize", src, tmp_path / "format", *spelled, "--quiet")
    assert r.code == 0, r.err
    assert tree_hashes(tmp_path / "format") == tree_hashes(tmp_path / "flag")


@pytest.mark.parametrize("args, message", [
    (["--fp8-block", "--int4"], "choose exactly one of --fp8-block, --fp8-channel, --int4, --mxfp4, --nvfp4"),
    ([], "choose exactly one of --fp8-block, --fp8-channel, --int4, --mxfp4, --nvfp4"),
    (["--format", "fp8-block", "--int4"], "--format fp8-block and --int4 choose different formats"),
    (["--format", "int4-group", "--group-size", "0"], "--group-size 0 must be positive"),
    (["--int4", "--group-size", "0"], "--group-size 0 must be positive"),
    (["--fp8-block", "--layout", "blocked"], "--layout 'blocked': expected per-expert, stacked or fused"),
    (["--fp8-block", "--device", "tpu"], "--device 'tpu': expected cpu or cuda"),
    # another format's option would be ignored (it was, silently)
    (["--fp8-block", "--group-size", "32"], "--group-size is an option of int4-group, not of fp8-block"),
    (["--nvfp4", "--group-size", "64"], "--group-size is an option of int4-group, not of nvfp4"),
    (["--mxfp4", "--asymmetric"], "--symmetric/--asymmetric is an option of int4-group, not of mxfp4"),
    (["--fp8-channel", "--int4-clip", "mse"], "--int4-clip is an option of int4-group, not of fp8-channel"),
    (["--fp8-block", "--max-shard-size", "lots"], "--max-shard-size 'lots': expected a size such as 5GB or 500MiB"),
])
def test_bad_options(tiny, cli, tmp_path, args, message):
    r = cli("quantize", tiny("mixtral"), tmp_path / "out", *args, "--quiet")
    assert r.code == 2
    assert r.error_line == message
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_cuda_without_cuda(tiny, cli, tmp_path):
    r = cli("quantize", tiny("mixtral"), tmp_path / "out", "--fp8-block", "--device", "cuda", "--quiet")
    assert r.code == 2 and r.error_line == "--device cuda: no CUDA device is available"


def test_include_shared_needs_a_new_format(tmp_path, cli, tiny):
    fp8 = tmp_path / "fp8"
    assert cli("quantize", tiny("qwen2_moe"), fp8, "--fp8-block", "--quiet").code == 0
    r = cli("quantize", fp8, tmp_path / "again", "--fp8-block", "--include-shared-experts", "--quiet")
    assert r.code == 2
    assert r.error_line == "--include-shared-experts needs a target format different from the input's"


def test_usage_error_is_not_a_traceback(tiny, cli, tmp_path):
    r = cli("quantize", tiny("mixtral"), tmp_path / "out", "--fp8-blok")
    assert r.code == 2
    assert "Traceback" not in r.err and "No such option: --fp8-blok" in r.err


@pytest.mark.parametrize("name", ["nf4", "dense"])
def test_format_option_takes_only_quantized_formats(tiny, cli, tmp_path, name):
    r = cli("quantize", tiny("mixtral"), tmp_path / "out", "--format", name)
    assert r.code == 2 and "Traceback" not in r.err
    assert "Invalid value for '--format'" in r.err and "fp8-block" in r.err and "int4-group" in r.err
    assert not (tmp_path / "out").exists()


def test_max_shard_size(tiny, cli, tmp_path):
    src, out = tiny("deepseek_v3"), tmp_path / "out"
    r = cli("quantize", src, out, "--fp8-block", "--max-shard-size", "1MB", "--quiet")
    assert r.code == 0, r.err
    files = sorted(out.glob("*.safetensors"))
    assert len(files) >= 3
    biggest_tensor = max(t.numel() * t.element_size() for t in read_tensors(src).values())
    for f in files:
        assert f.stat().st_size <= 10**6 + biggest_tensor + 64 * 1024
    with open_checkpoint(out) as ck:  # the index agrees with the files (checked on open)
        assert len(ck.files) == len(files)
    check_quantized(src, out, Fp8Block(), same_files=False)


# ------------------------------------------------------------------------------ interrupt and resume

KILLER = r"""
import os, signal, sys
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # one file at a time, as on 2 cores
from moetool.convert import torch_executor as convert
orig = convert.Executor.chunks
seen = {"files": 0}
def chunks(self, pf):
    seen["files"] += 1
    for i, item in enumerate(orig(self, pf)):
        if seen["files"] == 2 and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-way through the second file
        yield item
convert.Executor.chunks = chunks
from moetool.cli import main
main(sys.argv[1:])
"""


def test_interrupt_and_resume(tiny, cli, tmp_path):
    src = tiny("deepseek_v3")
    args = ["--int4", "--group-size", "64", "--quiet"]
    ref = tmp_path / "ref"
    assert cli("quantize", src, ref, *args).code == 0

    out = tmp_path / "out"
    p = warm_python.run([sys.executable, "-c", KILLER, "quantize", str(src), str(out), *args], timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    first = out / "model-00001-of-00002.safetensors"
    assert first.is_file() and (out / JOURNAL_NAME).is_file()
    assert (out / "model-00002-of-00002.safetensors.incomplete").is_file()
    assert not (out / "model-00002-of-00002.safetensors").exists() and not (out / MANIFEST_NAME).exists()
    stamp = (first.stat().st_ino, first.stat().st_mtime_ns)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(out, corrupt)
    r = cli("quantize", src, out, *args)
    assert r.code == 0, r.err
    assert "1 file(s) written, 1 resumed" in r.out
    assert (first.stat().st_ino, first.stat().st_mtime_ns) == stamp  # skipped, not rewritten
    assert tree_hashes(out) == tree_hashes(ref)

    # a finished file modified after the interrupt is detected by its checksum and rewritten
    cf = corrupt / "model-00001-of-00002.safetensors"
    data = bytearray(cf.read_bytes())
    data[-1] ^= 0xFF
    cf.write_bytes(bytes(data))
    r = cli("quantize", src, corrupt, *args)
    assert r.code == 0, r.err
    assert "2 file(s) written, 0 resumed" in r.out
    assert tree_hashes(corrupt) == tree_hashes(ref)


def test_journal_of_other_options_is_refused_then_rewritten_with_force(tiny, cli, tmp_path):
    """A journal written for other options is not resumed: the run is refused (the folder is
    left as it is); with --force every file is rewritten."""
    src, out = tiny("mixtral"), tmp_path / "out"
    assert cli("quantize", src, out, "--fp8-block", "--quiet").code == 0
    (out / MANIFEST_NAME).unlink()
    (out / JOURNAL_NAME).write_text(json.dumps({"plan_id": "other", "files": {
        n: {"sha256": sha256_file(out / n), "size": (out / n).stat().st_size} for n in
        ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")}}))
    before = tree_hashes(out)
    r = cli("quantize", src, out, "--fp8-channel", "--quiet")
    assert r.code == 2 and "holds the unfinished output of another moetool run" in r.error_line
    assert tree_hashes(out) == before
    r = cli("quantize", src, out, "--fp8-channel", "--quiet", "--force")
    assert r.code == 0 and "2 file(s) written, 0 resumed" in r.out
    check_quantized(src, out, Fp8Channel())


def test_library_api_matches_cli(tiny, tmp_path, cli):
    from moetool.convert.quantize import quantize

    src = tiny("mixtral")
    summary = quantize(src, tmp_path / "lib", "int4-group", group_size=64, symmetric=False, progress=False)
    assert summary.files_written == 2 and summary.errors["linears"] == 24
    assert cli("quantize", src, tmp_path / "cli", "--int4", "--group-size", "64", "--asymmetric", "--quiet").code == 0
    assert tree_hashes(tmp_path / "lib") == tree_hashes(tmp_path / "cli")
    assert get_format("int4-group", group_size=64, symmetric=False) == Int4Group(64, False)


def test_unfinished_output_used_as_input(tiny, cli, tmp_path):
    """An input that still holds a moetool journal (an unfinished output): the journal is not
    copied as a side file, so the new output's manifest lists only files that exist."""
    src = tmp_path / "src"
    assert cli("quantize", tiny("mixtral"), src, "--fp8-block", "--quiet").code == 0
    (src / MANIFEST_NAME).unlink()
    (src / JOURNAL_NAME).write_text(json.dumps({"plan_id": "x", "files": {}}))
    out = tmp_path / "out"
    assert cli("quantize", src, out, "--int4", "--quiet").code == 0
    assert not (out / JOURNAL_NAME).exists()
    from moetool.read.manifest import verify_manifest

    assert JOURNAL_NAME not in verify_manifest(out)["files"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("args", [["--fp8-block"], ["--fp8-channel"], ["--int4", "--group-size", "64", "--asymmetric"]],
                         ids=["fp8-block", "fp8-channel", "int4-asym"])
def test_device_cuda_matches_cpu(tiny, cli, tmp_path, args):
    """--device cuda quantizes on the GPU: the same bytes as on the CPU."""
    src = tiny("deepseek_v3", hidden=320, intermediate=192)
    assert cli("quantize", src, tmp_path / "cpu", *args, "--quiet").code == 0
    r = cli("quantize", src, tmp_path / "gpu", *args, "--device", "cuda", "--quiet")
    assert r.code == 0, r.err
    assert tree_hashes(tmp_path / "gpu") == tree_hashes(tmp_path / "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("args", [["--fp8-block"], ["--fp8-channel"], ["--int4", "--group-size", "64"], ["--nvfp4"],
                                  ["--mxfp4"]], ids=["fp8-block", "fp8-channel", "int4", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_device_cuda_refuses_a_weight_that_is_not_finite(tiny, cli, tmp_path, args, value):
    """One NaN or Inf in an expert: the GPU kernels' block maxima skip a NaN (the hardware max
    returns the other operand), so --device cuda wrote an fp8 NaN under a finite scale and a
    complete output; it is refused naming the tensor, as on the CPU."""
    from moeutil import file_of, rewrite_file

    src = shutil.copytree(tiny("deepseek_v3", hidden=320, intermediate=192), tmp_path / "src")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    rewrite_file(file_of(src, name), lambda t: t[name].__setitem__((5, 7), float(value)))
    on_cpu = cli("quantize", src, tmp_path / "cpu", *args, "--quiet")
    assert on_cpu.code == 2 and "contains NaN/Inf (1 of " in on_cpu.error_line, on_cpu.err
    r = cli("quantize", src, tmp_path / "gpu", *args, "--device", "cuda", "--quiet")
    assert r.code == 2 and r.error_line == on_cpu.error_line, r.err
    assert not (tmp_path / "gpu" / "manifest.json").exists()


def test_same_format_again_is_a_copy_and_other_params_requantize(tiny, cli, tmp_path):
    src = tiny("mixtral")
    g128 = tmp_path / "g128"
    assert cli("quantize", src, g128, "--int4", "--quiet").code == 0
    again = tmp_path / "again"
    r = cli("quantize", g128, again, "--int4", "--quiet")
    assert r.code == 0, r.err
    a, b = read_tensors(g128), read_tensors(again)
    assert set(a) == set(b) and all(bit_equal(a[n], b[n]) for n in a)
    assert json.loads((again / "config.json").read_text()) == json.loads((g128 / "config.json").read_text())
    g64 = tmp_path / "g64"
    assert cli("quantize", g128, g64, "--int4", "--group-size", "64", "--quiet").code == 0
    check_quantized(g128, g64, Int4Group(64, True))


def test_force_leaves_no_stale_shards(tiny, cli, tmp_path):
    """--force over an output of other file names: the old files go, the new output opens."""
    src, out = tiny("deepseek_v3"), tmp_path / "out"
    assert cli("quantize", src, out, "--fp8-block", "--max-shard-size", "1MB", "--quiet").code == 0
    assert len(list(out.glob("*.safetensors"))) > 2
    assert cli("quantize", src, out, "--fp8-block", "--force", "--quiet").code == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                 "model-00002-of-00002.safetensors"]
    assert cli("inspect", out).code == 0
    check_quantized(src, out, Fp8Block())


def test_cli_layout_fused(tiny, cli, tmp_path):
    """`--layout fused` from the command line: the family's fused tensors (what vLLM and
    transformers load for gpt-oss), in mxfp4 its release layout; a format without a fused
    layout is one line naming the tensor and the formats that have one."""
    from moeutil import read_tensors

    src = tiny("mixtral", hidden=64, intermediate=32, experts=4)
    r = cli("quantize", src, tmp_path / "mx", "--mxfp4", "--layout", "fused", "--quiet")
    assert r.code == 0, r.err
    names = read_tensors(tmp_path / "mx")
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj_blocks" in names
    r = cli("quantize", src, tmp_path / "fp8", "--fp8-block", "--layout", "fused")
    assert r.code == 2 and r.error_line.endswith("fused expert tensors are written unquantized or in a format with "
                                                 "a fused layout (mxfp4), not fp8-block"), r.error_line
    assert cli("shard", src, tmp_path / "sh", "--ep", "2", "--layout", "fused").error_line == \
        "--layout 'fused': expected per-expert or stacked"
