"""Hostile corpus, input side: every bad input is one line ``error: ...`` naming the file,
tensor, key or option at fault, exit status 2, the input untouched and nothing written.

Each row of ``ROWS`` makes one bad input (a damaged copy of a tiny model, a folder written by
``moetool shard`` where a model goes, a wrong option...) and says which command it is given
to and what the error line must contain. ``test_refused`` runs every row in-process through
the real entry point (``cli``); ``test_refused_in_a_real_process`` runs a few through
``python -m moetool``. Each asserts the exit status, the fragment of the one error line, the
sha256 of every input file before and after, and that the output folder was not even made.
The models and the shard outputs are made once per module; a row that damages a model copies
it first.
"""
from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from hostile import assert_unfinished, digest, moetool

from moetool.read.manifest import rank_dir
from moetool.read.safetensors import DTYPE_SIZES

INDEX = "model.safetensors.index.json"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
RANK1 = "rank-00001-of-00004"


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def made(tiny, tmp_path_factory) -> dict[str, Path]:
    """The good inputs, made once: a Mixtral-style model (8 experts, K = 64), the same with 4
    experts, a DeepSeek-V3-style one, its fp8-block quantization, its EP-4 shards and a copy of
    them without manifest.json (an unfinished shard output), and its EP-2 shards (verified:
    two rank processes start faster than four)."""
    from moetool.convert.quantize import quantize
    from moetool.convert.shard import shard

    root = tmp_path_factory.mktemp("hostile-inputs")
    model = tiny("mixtral", hidden=64, intermediate=32, experts=8)
    out = {"model": model, "small": tiny("mixtral", hidden=64, intermediate=32, experts=4),
           "deepseek": tiny("deepseek_v3", hidden=64, intermediate=32),
           "fp8": root / "fp8", "shards": root / "shards", "unfinished": root / "unfinished",
           "shards-ep2": root / "shards-ep2"}
    quantize(model, out["fp8"], "fp8-block", progress=False)
    out["fp8_shards"] = root / "fp8-shards"
    shard(out["fp8"], out["fp8_shards"], 2, progress=False)
    shard(model, out["shards"], 4, progress=False)
    shard(model, out["shards-ep2"], 2, progress=False)
    out["deepseek-shards"] = root / "deepseek-shards"
    shard(out["deepseek"], out["deepseek-shards"], 2, progress=False)
    shutil.copytree(out["shards"], out["unfinished"])
    (out["unfinished"] / "manifest.json").unlink()
    return out


@dataclass
class Ctx:
    """What a row builds its bad input from: the module's good inputs, a private folder, and
    ``out``, where a command would write (it must still not exist after the run)."""

    made: dict[str, Path]
    tmp: Path
    out: Path
    copies: int = 0

    def __getattr__(self, name: str) -> Path:
        try:
            return self.made[name]
        except KeyError:
            raise AttributeError(name) from None

    def copy(self, name: str = "model") -> Path:
        """A private copy of a good input, to damage."""
        self.copies += 1
        dst = self.tmp / f"{name}-{self.copies}"
        shutil.copytree(self.made[name], dst)
        return dst


@pytest.fixture
def ctx(made, tmp_path, monkeypatch) -> Ctx:
    monkeypatch.chdir(tmp_path)  # relative paths (tiny/mixtrall) are looked up here
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # ~/... too
    (tmp_path / "home").mkdir()
    return Ctx(made, tmp_path, tmp_path / "out")


# ------------------------------------------------------------------------------ helpers


def read_raw(path: Path) -> tuple[dict, bytes]:
    """(header dict, data section) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_header(path: Path, mutate: Callable[[dict], object]) -> None:
    """Change the header of a safetensors file, its data left as it is."""
    header, data = read_raw(path)
    mutate(header)
    write_raw(path, header, data)


def tensors_by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def edit_config(root: Path, **changes) -> Path:
    path = root / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))
    return path


_DROP = object()

# ------------------------------------------------------------------------------ the rows

#: name -> (build(ctx) -> (argv, [input folders], fragment of the error line), exit status)
ROWS: dict[str, tuple[Callable[[Ctx], tuple[list, list[Path], str]], int]] = {}


def row(name: str, code: int = 2):
    def register(build):
        assert name not in ROWS, name
        ROWS[name] = (build, code)
        return build
    return register


def quantize(c: Ctx, src: Path, *extra) -> list:
    return ["quantize", src, c.out, "--fp8-block", "--quiet", *extra]


# -- malformed safetensors headers (already refused)


@row("header-length-too-big")
def _(c):
    ck = c.copy()
    f = ck / SHARD1
    raw = bytearray(f.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    f.write_bytes(bytes(raw))
    return quantize(c, ck), [ck], f"{f}: corrupt or truncated safetensors header (header length {1 << 40}"


@row("header-not-json")
def _(c):
    ck = c.copy()
    f = ck / SHARD1
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"#not json!#{"
    f.write_bytes(bytes(raw))
    return quantize(c, ck), [ck], f"{f}: corrupt safetensors header (JSONDecodeError)"


@row("header-offsets-overlap")
def _(c):
    ck = c.copy()
    f = ck / SHARD1
    a = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    b = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    edit_header(f, lambda h: h[b].update(data_offsets=h[a]["data_offsets"]))
    return quantize(c, ck), [ck], f"{f}: tensors "


@row("header-offsets-out-of-range")
def _(c):
    ck = c.copy()
    f = ck / SHARD1

    def beyond(h):
        last = tensors_by_offset(h)[-1]
        begin, end = h[last]["data_offsets"]
        h[last]["data_offsets"] = [begin + 4096, end + 4096]
    edit_header(f, beyond)
    return quantize(c, ck), [ck], f"{f}: truncated safetensors file: header says"


@row("header-dimension-past-int64")
def _(c):
    """A zero-size tensor passes the byte-range check whatever its other dimensions; one past
    int64 (no torch tensor has it) reached torch.empty with a traceback."""
    ck = c.copy()
    f = ck / SHARD1

    def huge(h):
        end = h[tensors_by_offset(h)[-1]]["data_offsets"][1]
        h["model.extra.weight"] = {"dtype": "BF16", "shape": [0, 2**64 + 5], "data_offsets": [end, end]}
    edit_header(f, huge)
    index = json.loads((ck / INDEX).read_text())
    index["weight_map"]["model.extra.weight"] = SHARD1
    (ck / INDEX).write_text(json.dumps(index))
    return quantize(c, ck), [ck], f"{f}: tensor model.extra.weight has shape [0, {2**64 + 5}]: a dimension or"


@row("header-unknown-dtype")
def _(c):
    ck = c.copy()
    f = ck / SHARD1
    edit_header(f, lambda h: h["model.embed_tokens.weight"].update(dtype="C64"))
    return (quantize(c, ck), [ck],
            f"{f}: tensor model.embed_tokens.weight has dtype C64, not one of {', '.join(DTYPE_SIZES)}")


@row("header-shape-offsets-mismatch")
def _(c):
    ck = c.copy()
    f = ck / SHARD1
    edit_header(f, lambda h: h["model.embed_tokens.weight"].update(shape=[3]))
    return quantize(c, ck), [ck], f"{f}: tensor model.embed_tokens.weight byte range"


@row("truncated-file")
def _(c):
    ck = c.copy()
    f = ck / SHARD2
    f.write_bytes(f.read_bytes()[:-10])
    return quantize(c, ck), [ck], f"{f}: truncated safetensors file"


# -- C: bytes that belong to no tensor (new)


@row("trailing-bytes")
def _(c):
    ck = c.copy()
    f = ck / SHARD2
    size = f.stat().st_size
    f.write_bytes(f.read_bytes() + bytes(16))
    return (quantize(c, ck), [ck],
            f"{f}: 16 trailing bytes after the last tensor (header says {size} bytes, file has {size + 16}")


@row("trailing-bytes-inspect")
def _(c):
    ck = c.copy()
    f = ck / SHARD1
    f.write_bytes(f.read_bytes() + b"appended")
    return ["inspect", ck], [ck], f"{f}: 8 trailing bytes after the last tensor"


@row("hole-before-the-first-tensor")
def _(c):
    ck = c.copy()
    f = ck / SHARD1
    header, data = read_raw(f)
    for k in tensors_by_offset(header):
        header[k]["data_offsets"] = [o + 8 for o in header[k]["data_offsets"]]
    first = tensors_by_offset(header)[0]
    write_raw(f, header, bytes(8) + data)
    return quantize(c, ck), [ck], f"{f}: bytes 0..8 of the data section belong to no tensor (before {first}"


@row("hole-between-tensors")
def _(c):
    ck = c.copy()
    f = ck / SHARD1
    header, data = read_raw(f)
    order = tensors_by_offset(header)
    cut = header[order[1]]["data_offsets"][0]
    for k in order[1:]:
        header[k]["data_offsets"] = [o + 4 for o in header[k]["data_offsets"]]
    write_raw(f, header, data[:cut] + bytes(4) + data[cut:])
    return (quantize(c, ck), [ck],
            f"{f}: bytes {cut}..{cut + 4} of the data section belong to no tensor (before {order[1]}")


# -- bad index.json (already refused)


@row("index-names-a-missing-file")
def _(c):
    ck = c.copy()
    (ck / SHARD2).unlink()
    return quantize(c, ck), [ck], f"{ck / SHARD2}: shard named in {INDEX} is missing"


@row("index-tensor-in-the-wrong-file")
def _(c):
    ck = c.copy()
    index = json.loads((ck / INDEX).read_text())
    name = next(k for k, v in sorted(index["weight_map"].items()) if v == SHARD1)
    index["weight_map"][name] = SHARD2
    (ck / INDEX).write_text(json.dumps(index))
    return quantize(c, ck), [ck], f"{ck / SHARD1}: tensor {name} is indexed under {SHARD2}"


@row("index-invalid-json")
def _(c):
    ck = c.copy()
    (ck / INDEX).write_text('{"weight_map": ')
    return quantize(c, ck), [ck], f"{ck / INDEX}: invalid index"


# -- bad config.json (missing keys, unknown architecture: already refused)


@row("config-missing-key")
def _(c):
    ck = c.copy()
    edit_config(ck, num_hidden_layers=_DROP)
    return quantize(c, ck), [ck], "config.json: missing num_hidden_layers"


@row("config-unknown-architecture")
def _(c):
    ck = c.copy()
    edit_config(ck, model_type="llama")
    return quantize(c, ck), [ck], "config.json: unsupported architecture model_type='llama'"


@row("config-invalid-json")
def _(c):
    ck = c.copy()
    (ck / "config.json").write_text("{oops")
    return quantize(c, ck), [ck], f"{ck / 'config.json'}: invalid JSON"


# -- JSON that Python's parser gives up on: an integer past its digit limit, nesting past the
# recursion limit (each once a traceback and exit 1)

HUGE_INT = "9" * 5000
DEEP = "[" * 100000 + "]" * 100000


@row("config-integer-of-5000-digits")
def _(c):
    ck = c.copy()
    (ck / "config.json").write_text(json.dumps(json.loads((ck / "config.json").read_text()))[:-1]
                                    + f', "vocab_size_bomb": {HUGE_INT}}}')
    return quantize(c, ck), [ck], f"{ck / 'config.json'}: invalid JSON (Exceeds the limit (4300 digits)"


@row("config-nested-too-deeply")
def _(c):
    ck = c.copy()
    (ck / "config.json").write_text(DEEP)
    return quantize(c, ck), [ck], f"{ck / 'config.json'}: invalid JSON (maximum recursion depth exceeded"


@row("index-nested-too-deeply")
def _(c):
    ck = c.copy()
    (ck / INDEX).write_text('{"weight_map": ' + DEEP + "}")
    return quantize(c, ck), [ck], f"{ck / INDEX}: invalid index"


def _header_bomb(c: Ctx, value: str, error: str) -> tuple:
    """A shard whose header gains the entry ``"__bomb__": value`` (raw JSON text)."""
    ck = c.copy()
    f = ck / SHARD1
    header, data = read_raw(f)
    text = json.dumps(header)[:-1] + ', "__bomb__": ' + value + "}"
    f.write_bytes(struct.pack("<Q", len(text)) + text.encode() + data)
    return quantize(c, ck), [ck], f"{f}: corrupt safetensors header ({error})"


@row("header-nested-too-deeply")
def _(c):
    return _header_bomb(c, DEEP, "RecursionError")


@row("header-integer-of-5000-digits")
def _(c):
    return _header_bomb(c, HUGE_INT, "ValueError")


@row("verify-manifest-nested-too-deeply")
def _(c):
    args, inputs, path = _manifest_row(c, lambda m: DEEP)
    return args, inputs, f"{path}: not a valid manifest (not JSON: maximum recursion depth exceeded"


# -- B: config values of the wrong type (new)


@row("config-quantization-config-a-list")
def _(c):
    ck = c.copy()
    edit_config(ck, quantization_config=[1])
    return quantize(c, ck), [ck], f"{ck / 'config.json'}: quantization_config is [1], not a JSON object"


@row("config-compressed-tensors-groups-a-list")
def _(c):
    ck = c.copy()
    edit_config(ck, quantization_config={"quant_method": "compressed-tensors", "config_groups": [1]})
    return (["inspect", ck], [ck],
            "unsupported compressed-tensors quantization_config: config_groups is not a JSON object")


@row("config-more-layers-than-any-model")
def _(c):
    ck = c.copy()
    # 10**9 filled the machine's memory with a list of layers before any error; over the bound,
    # but few enough that a moetool without it fails this test rather than the machine
    edit_config(ck, num_hidden_layers=200_000)
    return quantize(c, ck), [ck], "config.json: num_hidden_layers must be an integer of at most 100000, got 200000"


@row("config-intermediate-size-not-the-experts")
def _(c):
    ck = c.copy()
    edit_config(ck, intermediate_size=16)  # the experts hold 32 rows: an output transformers would refuse
    return (quantize(c, ck), [ck], "model.layers.0.block_sparse_moe.experts.0.w1.weight: shape [32, 64], but "
            "config.json gives [16, 64] (hidden size and expert intermediate size)")


@row("an-expert-the-config-does-not-count")
def _(c):
    # a fifth expert beside num_local_experts 4 was copied through unquantized, unseen
    from moeutil import file_of, rewrite_file

    ck = c.copy("small")
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    rewrite_file(file_of(ck, name), lambda t: t.__setitem__(name.replace(".0.", ".4."), t[name].clone()))
    return (quantize(c, ck), [ck], "model.layers.1.block_sparse_moe.experts.4: a tensor of expert 4, but the layer "
            "has 4 experts (config.json)")


@row("an-expert-tensor-the-format-does-not-read")
def _(c):
    # compressed-tensors' static activation scale beside a linear: dropped from every output
    import torch
    from moeutil import file_of, rewrite_file

    ck = c.copy()
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    rewrite_file(file_of(ck, name), lambda t: t.__setitem__(name.replace(".weight", ".input_scale"),
                                                            torch.ones(1, dtype=torch.float32)))
    return (quantize(c, ck), [ck], "model.layers.0.block_sparse_moe.experts.0.w1.input_scale: a tensor of the experts "
            "that dense does not read (it holds weight); moetool would drop it")


@row("fp8-experts-without-scales-or-config")
def _(c):
    # e4m3 codes read as values (rel err ~1800 against the model), with no error
    from moeutil import rewrite_file

    ck = c.copy("fp8")
    edit_config(ck, quantization_config=_DROP)
    for f in sorted(ck.glob("*.safetensors")):
        rewrite_file(f, lambda t: [t.pop(k) for k in [k for k in t if ".experts." in k and k.endswith("_scale_inv")]])
    return (["quantize", ck, c.out, "--int4", "--quiet"], [ck], "experts of model.layers.0.block_sparse_moe: "
            "config.json has no "
            "quantization_config (dense) but the weights are float8_e4m3fn with no scale tensors")


@row("config-expert-count-a-string")
def _(c):
    ck = c.copy("deepseek")
    edit_config(ck, n_routed_experts="8")
    return quantize(c, ck), [ck], 'config.json: n_routed_experts must be an integer, got "8" (a string)'


@row("config-expert-count-a-string-inspect")
def _(c):
    ck = c.copy()
    edit_config(ck, num_local_experts="8")
    return ["inspect", ck], [ck], 'config.json: num_local_experts must be an integer, got "8" (a string)'


@row("config-top-k-a-float")
def _(c):
    ck = c.copy()
    edit_config(ck, num_experts_per_tok=2.0)
    return quantize(c, ck), [ck], "config.json: num_experts_per_tok must be an integer, got 2.0 (a number)"


@row("config-list-for-an-int")
def _(c):
    ck = c.copy()
    edit_config(ck, hidden_size=[64])
    return quantize(c, ck), [ck], "config.json: hidden_size must be an integer, got [64] (a list)"


@row("config-bool-for-an-int")
def _(c):
    ck = c.copy()
    edit_config(ck, num_hidden_layers=True)
    return quantize(c, ck), [ck], "config.json: num_hidden_layers must be an integer, got true (a boolean)"


@row("config-negative-dense-layers")
def _(c):
    ck = c.copy("deepseek")
    edit_config(ck, first_k_dense_replace=-1)
    return quantize(c, ck), [ck], "config.json: first_k_dense_replace must be an integer of at least 0, got -1"


@row("config-string-for-a-bool")
def _(c):
    ck = c.copy("deepseek")
    edit_config(ck, norm_topk_prob="false")
    return quantize(c, ck), [ck], 'config.json: norm_topk_prob must be true or false, got "false" (a string)'


@row("config-unknown-scoring")
def _(c):
    ck = c.copy("deepseek")
    edit_config(ck, scoring_func="relu")
    return quantize(c, ck), [ck], 'config.json: scoring_func must be "sigmoid" or "softmax", got "relu" (a string)'


# -- bad options, pickles, output inside input (already refused)


@row("shard-ep-0")
def _(c):
    return ["shard", c.model, c.out, "--ep", "0", "--quiet"], [c.model], "--ep 0: must be at least 1"


@row("shard-ep-more-than-experts")
def _(c):
    return (["shard", c.model, c.out, "--ep", "9", "--quiet"], [c.model],
            "--ep 9: more ranks than experts (8); every rank needs an expert")


@row("verify-ep-not-the-shards")
def _(c):
    return (["verify", c.shards, "--ref", c.model, "--ep", "3"], [c.shards, c.model],
            f"--ep 3: the shards in {c.shards} were made for ep 4")


@row("verify-dp-not-dividing-ep")
def _(c):
    return (["verify", c.shards, "--ref", c.model, "--ep", "4", "--dp", "3"], [c.shards, c.model],
            "--dp 3 must be at least 1 and divide --ep 4")


@row("int4-group-size-not-dividing")
def _(c):
    return (["quantize", c.model, c.out, "--int4", "--group-size", "48", "--quiet"], [c.model],
            "has K=64 columns, which group size 48 does not divide")


@row("unknown-layout")
def _(c):
    return ["repack", c.model, c.out, "--layout", "diagonal", "--quiet"], [c.model], "--layout 'diagonal'"


@row("pickle-only-checkpoint")
def _(c):
    ck = c.tmp / "pickled"
    ck.mkdir()
    shutil.copy(c.model / "config.json", ck)
    (ck / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle; never loaded
    return quantize(c, ck), [ck], f"{ck / 'pytorch_model.bin'}: pickle checkpoints are refused"


@row("output-inside-input")
def _(c):
    ck = c.copy()
    c.out = ck / "quantized"
    return quantize(c, ck), [ck], f"output {c.out} is inside the input {ck}"


# -- A: a rank folder or a shard root where a model goes (new)


@row("quantize-a-rank-folder")
def _(c):
    rank = c.shards / RANK1
    return (quantize(c, rank), [c.shards],
            f"{rank}: is one rank folder (rank 1 of 4) of a moetool shard output, not a model")


@row("repack-a-rank-folder")
def _(c):
    rank = c.shards / RANK1
    return (["repack", rank, c.out, "--layout", "per-expert", "--quiet"], [c.shards],
            f"`moetool verify` and `moetool shard --merge` take the shard folder ({c.shards})")


@row("shard-a-rank-folder")
def _(c):
    rank = c.shards / RANK1
    return ["shard", rank, c.out, "--ep", "2", "--quiet"], [c.shards], f"{rank}: is one rank folder (rank 1 of 4)"


@row("verify-ref-a-rank-folder")
def _(c):
    rank = c.shards / "rank-00000-of-00004"
    return (["verify", c.shards, "--ref", rank, "--ep", "4"], [c.shards],
            f"{rank}: is one rank folder (rank 0 of 4) of a moetool shard output, not a model")


@row("quantize-a-shard-root")
def _(c):
    return (quantize(c, c.shards), [c.shards],
            f"{c.shards}: is the output of moetool shard (EP 4, finished), not a model; "
            "`moetool verify` and `moetool shard --merge` take it")


@row("repack-a-shard-root")
def _(c):
    return (["repack", c.shards, c.out, "--quiet"], [c.shards],
            f"{c.shards}: is the output of moetool shard (EP 4, finished), not a model")


@row("shard-a-shard-root")
def _(c):
    return (["shard", c.shards, c.out, "--ep", "2", "--quiet"], [c.shards],
            f"{c.shards}: is the output of moetool shard (EP 4, finished), not a model")


@row("verify-ref-a-shard-root")
def _(c):
    return (["verify", c.shards, "--ref", c.shards, "--ep", "4"], [c.shards],
            f"{c.shards}: is the output of moetool shard (EP 4, finished), not a model")


@row("quantize-an-unfinished-shard-root")
def _(c):
    return (quantize(c, c.unfinished), [c.unfinished],
            f"{c.unfinished}: is the output of moetool shard (EP 4, unfinished: no manifest.json), not a model")


@row("verify-a-rank-folder-as-the-shards")
def _(c):
    rank = c.shards / RANK1
    return (["verify", rank, "--ref", c.model, "--ep", "4"], [c.shards, c.model],
            f"{rank}: is one rank folder of a moetool shard output; give the shard folder that holds every rank "
            f"and manifest.json ({c.shards})")


@row("merge-a-rank-folder")
def _(c):
    rank = c.shards / RANK1
    return (["shard", "--merge", rank, c.out, "--quiet"], [c.shards],
            f"{rank}: is one rank folder of a moetool shard output; give the shard folder")


# -- D: a mistyped local path is not a Hub repo id (new)


@row("mistyped-path-with-a-slash")
def _(c):
    (c.tmp / "tiny").mkdir()
    shutil.copytree(c.model, c.tmp / "tiny" / "mixtral")
    return (quantize(c, "tiny/mixtrall"), [c.tmp / "tiny"],
            "tiny/mixtrall: no such folder (the folder tiny exists here, so this is taken as a local path, "
            "not a Hub repo id)")


@row("mistyped-path-under-home")
def _(c):
    return ["inspect", "~/mixtral"], [c.tmp / "home"], "~/mixtral: no such folder"


# -- E: verify --ref must be the model the shards were made from, not a quantized output (new)


@row("verify-ref-quantized")
def _(c):
    return (["verify", c.shards, "--ref", c.fp8, "--ep", "4"], [c.shards, c.fp8],
            f"--ref {c.fp8}: is a fp8-block output of moetool, not the model it was made from; "
            "give the original checkpoint")


@row("verify-ref-a-moetool-output-without-its-manifest")
def _(c):
    # copied without manifest.json (or uploaded so): its config still says what made it
    ref = c.copy("fp8")
    (ref / "manifest.json").unlink()
    return (["verify", c.shards, "--ref", ref, "--ep", "4"], [c.shards, ref],
            f"--ref {ref}: is a fp8-block output of moetool, not the model it was made from; "
            "give the original checkpoint")


@row("verify-ref-a-moetool-output-dequantized-again")
def _(c):
    # dequantized to bf16 again: its values still carry fp8's error
    from moetool.convert.quantize import quantize

    ref = c.tmp / "dequantized"
    quantize(c.fp8, ref, "dense", progress=False)
    return (["verify", c.shards, "--ref", ref, "--ep", "4"], [c.shards, ref],
            f"--ref {ref}: is a dense copy of a fp8-block output of moetool, not the model it was made from; "
            "give the original checkpoint")


@row("verify-ref-another-architecture")
def _(c):
    return (["verify", c.shards, "--ref", c.deepseek, "--ep", "4"], [c.shards, c.deepseek],
            f"--ref {c.deepseek}: is deepseek-v3, 8 experts in MoE layers 1-2 (hidden 64, expert intermediate 32), "
            f"but the shards in {c.shards} hold mixtral, 8 experts in MoE layers 0-1 (hidden 64, expert "
            "intermediate 32); --ref must be the model they were made from")


@row("verify-shards-routed-unlike-the-reference")
def _(c):
    # DeepSeek's routed_scaling_factor 2.5 -> 2.25 in every rank's config: a layer error of ~0.14,
    # under int4's threshold of 0.25 (found by the verify review)
    shards = c.copy("deepseek-shards")
    for rank in range(2):
        edit_config(shards / rank_dir(rank, 2), routed_scaling_factor=2.25)
        resign(shards, f"{rank_dir(rank, 2)}/config.json")
    return (["verify", shards, "--ref", c.deepseek, "--ep", "2"], [shards, c.deepseek],
            f"{shards}: layer 1 routes with routed_scaling_factor 2.25, the reference --ref {c.deepseek} with 2.5; "
            "the router is never converted")


@row("verify-shards-router-not-the-reference")
def _(c):
    # the router rounded to fp8 before the shards were made: a layer error of 0.17 under
    # int4's 0.25 (the verify review); the MoE-only check has no router check of its own
    import torch
    from moeutil import file_of, rewrite_file

    from moetool.convert.shard import shard

    model, shards, name = c.copy("deepseek"), c.tmp / "router-shards", "model.layers.1.mlp.gate.weight"
    rewrite_file(file_of(model, name), lambda t: t.__setitem__(
        name, t[name].to(torch.float8_e4m3fn).to(t[name].dtype)))
    shard(model, shards, 2, progress=False)
    return (["verify", shards, "--ref", c.deepseek, "--ep", "2"], [shards, c.deepseek],
            f"{shards}: layer 1's {name} is not the reference's (max abs difference ")


@row("verify-shards-shared-expert-not-the-reference")
def _(c):
    # the shared expert rounded to fp8 (a per-tensor scale) and stored back in bf16 before the
    # shards were made: the layer moved by ~0.01, 0.060 against fp8-block's 0.08 (MoE-only
    # verify passed it; --whole-model's shared-expert row did not)
    import torch
    from moeutil import file_of, rewrite_file

    from moetool.convert.quantize import quantize
    from moetool.convert.shard import shard

    model, shards = c.copy("deepseek"), c.tmp / "shared-shards"
    name = "model.layers.2.mlp.shared_experts.down_proj.weight"

    def fp8_rounded(t):
        w = t[name].float()
        scale = w.abs().amax() / 448
        t[name] = ((w / scale).to(torch.float8_e4m3fn).float() * scale).to(t[name].dtype)
    rewrite_file(file_of(model, name), fp8_rounded)
    quantize(model, c.tmp / "shared-fp8", "fp8-block", progress=False)
    shard(c.tmp / "shared-fp8", shards, 2, progress=False)
    return (["verify", shards, "--ref", c.deepseek, "--ep", "2"], [shards, c.deepseek],
            f"{shards}: layer 2's shared expert model.layers.2.mlp.shared_experts.down_proj is not the reference's "
            f"(max abs difference ")


@row("verify-ref-other-expert-count")
def _(c):
    return (["verify", c.shards, "--ref", c.small, "--ep", "4"], [c.shards, c.small],
            f"--ref {c.small}: is mixtral, 4 experts in MoE layers 0-1 (hidden 64, expert intermediate 32), "
            f"but the shards in {c.shards} hold mixtral, 8 experts")


# -- F: a shard output's manifest that is not one, and ranks that disagree (new): before any
# rank starts. Each damaged file is signed again in the manifest, as a converter that wrote it
# so would have signed it, so that only the check named can find it.


def resign(root: Path, *names: str) -> None:
    """The manifest of ``root`` with the size and sha256 of ``names`` as they are now."""
    from moetool.read.manifest import sha256_file

    m = json.loads((root / "manifest.json").read_text())
    for n in names:
        m["files"][n] = {**m["files"][n], "size": (root / n).stat().st_size, "sha256": sha256_file(root / n)}
    (root / "manifest.json").write_text(json.dumps(m))


def _manifest_row(c: Ctx, edit: Callable[[dict], object]) -> tuple[list, list[Path], Path]:
    shards = c.copy("shards")
    m = json.loads((shards / "manifest.json").read_text())
    edited = edit(m)
    (shards / "manifest.json").write_text(edited if isinstance(edited, str) else json.dumps(m))
    return ["verify", shards, "--ref", c.model, "--ep", "4"], [shards, c.model], shards / "manifest.json"


@row("verify-manifest-not-json")
def _(c):
    args, inputs, path = _manifest_row(c, lambda m: "{not json")
    return args, inputs, f"{path}: not a valid manifest (not JSON: "


@row("verify-manifest-ep-a-word")
def _(c):
    args, inputs, path = _manifest_row(c, lambda m: m.update(ep="four"))
    return args, inputs, f"{path}: \"ep\" is 'four', not a number of ranks"


@row("verify-manifest-unknown-format")
def _(c):
    args, inputs, path = _manifest_row(c, lambda m: m.update(format="fp9"))
    return args, inputs, f"{path}: format 'fp9' is not one moetool reads (known: dense, fp8-block"


@row("verify-manifest-names-another-format")
def _(c):
    # int4-group's thresholds are ~3x fp8's: a manifest naming it would loosen the check of
    # whatever the ranks hold
    args, inputs, path = _manifest_row(c, lambda m: m.update(format="int4-group"))
    return args, inputs, f"{path}: says format int4-group, but rank 0's experts are stored as dense"


@row("verify-manifest-expert-on-a-rank-beyond-ep")
def _(c):
    args, inputs, path = _manifest_row(c, lambda m: m["layers"][1]["replicas"].update({"3": [[7, 0]]}))
    return args, inputs, f"{path}: layer 1: expert 3 is placed on rank 7, of 4"


@row("verify-manifest-file-without-size")
def _(c):
    name = f"{RANK1}/config.json"
    args, inputs, path = _manifest_row(c, lambda m: m["files"][name].pop("size"))
    return args, inputs, f"{path}: not a valid manifest (entry '{name}' needs a size in bytes and a sha256)"


@row("verify-a-rank-whose-non-expert-tensors-differ")
def _(c):
    shards = c.copy("shards")
    name = next(p.relative_to(shards).as_posix() for p in sorted((shards / RANK1).glob("model-common*")))
    header, data = read_raw(shards / name)
    first = tensors_by_offset(header)[0]
    at = header[first]["data_offsets"][0]
    write_raw(shards / name, header, data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:])  # one bit of a value
    resign(shards, name)
    return (["verify", shards, "--ref", c.model, "--ep", "4"], [shards, c.model],
            f"{shards / name}: differs from rank 0's copy (sha256 in the manifest): every rank must hold the same "
            "non-expert tensors")


@row("verify-a-rank-whose-config-differs")
def _(c):
    shards = c.copy("shards")
    edit_config(shards / RANK1, rms_norm_eps=1e-3)
    resign(shards, f"{RANK1}/config.json")
    return (["verify", shards, "--ref", c.model, "--ep", "4"], [shards, c.model],
            f"{shards / RANK1}/config.json: differs from rank 0's in more than its moetool_ep entry")


@row("verify-chunk-size-zero")
def _(c):
    # refused by the ranks once they had started: "rank 2 failed: ... (3 other rank(s) failed after it)"
    return (["verify", c.shards, "--ref", c.model, "--ep", "4", "--chunk-size", "0"], [c.shards, c.model],
            "--chunk-size must be positive, got 0")


@row("verify-exact-with-w8a8-kernels")
def _(c):
    return (["verify", c.fp8_shards, "--ref", c.model, "--ep", "2", "--experts", "triton", "--numerics", "exact"],
            [c.fp8_shards, c.model], "--numerics exact with --experts triton: the fp8-block kernels compute W8A8")


@row("verify-timeout-zero")
def _(c):
    return (["verify", c.shards, "--ref", c.model, "--ep", "4", "--timeout", "0"], [c.shards, c.model],
            "--timeout 0.0: must be a positive number of seconds")


@row("verify-whole-model-timeout-nan")
def _(c):
    return (["verify", c.shards, "--ref", c.model, "--ep", "4", "--whole-model", "--timeout", "nan"],
            [c.shards, c.model], "--timeout nan: must be a positive number of seconds")


@row("verify-layers-backwards")
def _(c):
    return (["verify", c.shards, "--ref", c.model, "--ep", "4", "--layers", "1-0"], [c.shards, c.model],
            "--layers '1-0': expected a list like 1,3,5-7 (layer numbers, ranges upwards)")


# ------------------------------------------------------------------------------ the tests


def _check(c: Ctx, name: str, run) -> None:
    build, code = ROWS[name]
    args, inputs, fragment = build(c)
    before = [digest(p) for p in inputs]
    r = run(*args)
    assert r.code == code, (r.code, r.out, r.err)
    assert fragment in r.error_line, r.error_line
    assert [digest(p) for p in inputs] == before, "the input was modified"
    assert not c.out.exists(), f"{c.out} was made by a refused command"
    assert_unfinished(c.out)


@pytest.mark.parametrize("name", list(ROWS))
def test_refused(ctx, cli, name):
    _check(ctx, name, cli)


@pytest.mark.parametrize("name", ["verify-chunk-size-zero", "verify-exact-with-w8a8-kernels", "verify-dp-not-dividing-ep"])
def test_verify_options_are_refused_before_any_rank_starts(ctx, cli, monkeypatch, name):
    """--chunk-size 0 and --numerics exact with the W8A8 kernels were refused by the ranks once
    started ("rank 2 failed: ... (3 other rank(s) failed after it)")."""
    import moetool.verify.driver as driver

    def no_ranks(*args, **kw):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(driver, "spawn_world", no_ranks)
    _check(ctx, name, cli)


@pytest.mark.parametrize("name", ["quantize-a-rank-folder", "trailing-bytes", "config-expert-count-a-string"])
def test_refused_in_a_real_process(ctx, name):
    _check(ctx, name, lambda *args: moetool(*args, cwd=ctx.tmp, extra_env={"HOME": str(ctx.tmp / "home")}))


# -- what is not refused


@pytest.mark.parametrize("fmt", ["int4-group", "fp8-block"])
def test_a_shared_expert_kept_or_converted_on_purpose_is_not_refused(made, tmp_path, fmt):
    """The shared-expert check of the MoE-only verify refuses only a shared expert changed
    against the reference: kept as the reference stores it (fp8-block: a release whose shared
    expert is fp8 too, as DeepSeek-V3's, sharded as it is) or quantized by the conversion
    (``--include-shared-experts``: the layer's check measures it) passes, as do shards left
    dense."""
    from moetool.convert.quantize import quantize
    from moetool.convert.shard import shard
    from moetool.read.checkpoint import open_checkpoint
    from moetool.read.shards import EPShards
    from moetool.model.families import describe
    from moetool.verify.driver import check_shared_experts

    model = made["deepseek"]
    quantized = tmp_path / "quantized"
    quantize(model, quantized, fmt, include_shared=True, progress=False, **({"group_size": 8} if fmt == "int4-group" else {}))
    ref = model
    if fmt == "fp8-block":  # the release: its own fp8 shared expert, the shards' copied from it
        (quantized / "manifest.json").unlink()
        ref = quantized
    shard(quantized, tmp_path / "shards", 2, progress=False)
    for shards, against in ((tmp_path / "shards", ref), (made["deepseek-shards"], model)):
        with open_checkpoint(against) as ref_ckpt:
            check_shared_experts(EPShards(shards, check=False), ref_ckpt, describe(ref_ckpt.config, ref_ckpt.tensors),
                                 against, [1, 2])


def test_expert_biases_not_the_references_fail_the_layer(tmp_path):
    """gpt-oss: two experts' down biases swapped in one rank's file (signed again). Biases are
    never converted, yet measured only against fp8-block's lossy limit they passed (a verify
    review); they are now compared exactly, and the layer FAILS naming the expert."""
    import torch
    from moeutil import file_of, rewrite_file

    from moetool.convert.quantize import quantize
    from moetool.convert.shard import shard
    from moetool.demo.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "gpt-oss", "gpt_oss", hidden=64, intermediate=32, experts=4, top_k=2,
                                 layers=2)
    shards, name = tmp_path / "shards", "model.layers.0.mlp.experts.w2_bias"
    quantize(model, tmp_path / "fp8", "fp8-block", progress=False)
    shard(tmp_path / "fp8", shards, 2, progress=False)
    rank = shards / rank_dir(1, 2)
    rewrite_file(file_of(rank, name), lambda t: t.__setitem__(name, torch.flip(t[name], [0])))
    resign(shards, *(p.relative_to(shards).as_posix() for p in rank.iterdir()))  # its index rewritten too
    r = moetool("verify", shards, "--ref", model, "--ep", "2")
    assert r.code == 1, (r.out, r.err)
    assert r.error_line.startswith("verification failed: layer 0: expert 2's down bias on rank 1 (slot 0) is not "
                                   "the reference's (max abs difference ")
    assert r.error_line.endswith("): expert biases are never converted"), r.error_line


def test_inspect_describes_a_shard_root(made, cli):
    shards = made["shards"]
    r = cli("inspect", shards, "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    files = [p for p in shards.rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert info == {**info, "kind": "ep-shards", "complete": True, "status": "complete", "architecture": "mixtral",
                    "ep": 4, "placement": "linear", "layout": "stacked", "weight_format": "dense",
                    "moe_layers": [0, 1], "experts": 8, "experts_per_rank": {"0": [2, 2, 2, 2], "1": [2, 2, 2, 2]},
                    "files": len(files), "bytes": sum(p.stat().st_size for p in files),
                    "ranks": [f"rank-{r:05d}-of-00004" for r in range(4)]}
    r = cli("inspect", shards)
    assert r.code == 0, r.err
    assert "no .safetensors" not in r.out + r.err
    lines = dict(line.split(None, 1) if not line.startswith(("experts per rank", "weight format")) else
                 (line[:16], line[16:].strip()) for line in r.out.splitlines())
    assert lines["status"] == "complete"
    assert lines["ranks"] == "EP 4, 4 rank folder(s), placement linear, layout stacked"
    assert lines["layers"] == "MoE 2 (0..1), 8 experts per layer"
    assert lines["experts per rank"] == "2, 2, 2, 2 (every MoE layer)"
    assert lines["use"] == f"moetool verify {shards} --ref MODEL --ep 4; moetool shard --merge {shards} OUT"


def test_inspect_describes_an_unfinished_shard_root(made, cli, tmp_path):
    part = tmp_path / "part"
    shutil.copytree(made["unfinished"], part)
    shutil.rmtree(part / "rank-00003-of-00004")  # not written yet
    r = cli("inspect", part, "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    assert info["complete"] is False and info["status"].startswith("unfinished: no manifest.json (3 rank folder(s)")
    assert info["ep"] == 4 and info["architecture"] == "mixtral" and info["experts"] == 8
    assert info["experts_per_rank"] == {"0": [2, 2, 2, None], "1": [2, 2, 2, None]}
    r = cli("inspect", part)
    assert r.code == 0 and "2, 2, 2, ? (every MoE layer)" in r.out and "moetool verify" not in r.out


def test_inspect_still_describes_a_rank_folder(made, cli):
    """inspect reads, it never converts: one rank folder is described as such (EP rank row)."""
    r = cli("inspect", made["shards"] / RANK1, "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["ep_rank"] == {"rank": 1, "ep": 4, "layout": "stacked",
                                            "stored_experts": {"0": 2, "1": 2}}


def test_a_path_under_home_is_a_local_folder(ctx, cli):
    shutil.copytree(ctx.model, ctx.tmp / "home" / "mixtral")
    r = cli("inspect", "~/mixtral", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["path"] == str(ctx.tmp / "home" / "mixtral")


@pytest.mark.slow
def test_exact_shards_still_name_their_worst_expert(made):
    """Unquantized shards match the reference exactly, expert by expert: the report still
    names an expert and its rank (it said -1 (-1) when no error was above 0)."""
    from moetool.verify.driver import VerifyOptions, verify

    import torch

    opts = VerifyOptions(ep=2, tokens=8, layers=(0,), backend="gloo", timeout_s=120, numerics="exact")
    rep = verify(made["shards-ep2"], made["model"], opts)
    assert rep.passed, rep.render()
    (layer,) = rep.layers
    assert layer.worst_expert in range(8) and layer.worst_expert_rank in range(2)
    if not torch.cuda.is_available():  # ranks and reference on the CPU: bit-identical experts
        assert layer.worst_expert_rel_err == 0.0 and (layer.worst_expert, layer.worst_expert_rank) == (0, 0)
    assert "-1 (-1)" not in rep.render()


def test_a_quantized_original_release_is_a_valid_reference(made, tmp_path):
    """DeepSeek-V3 and Kimi-K2 ship fp8-block: a quantized checkpoint that moetool did not
    write is the model itself (dequantized), so it is accepted as --ref."""
    from moetool.model.families import describe
    from moetool.read.checkpoint import open_checkpoint
    from moetool.read.shards import EPShards
    from moetool.verify.driver import check_reference

    from moetool.read.manifest import QUANTIZED_KEY

    release = tmp_path / "release"
    shutil.copytree(made["fp8"], release)
    (release / "manifest.json").unlink()  # what the release has not: moetool's manifest and config key
    config = json.loads((release / "config.json").read_text())
    del config[QUANTIZED_KEY]
    (release / "config.json").write_text(json.dumps(config))
    shards = made["shards"]
    with open_checkpoint(release) as ck:
        check_reference(EPShards(shards, check=False), ck, describe(ck.config, ck.tensors), str(release))
