"""Helpers shared by the checkpoint / quantize / repack / shard tests (plain functions; the
fixtures that use them are in conftest.py).

Two independent producers of tiny MoE checkpoints:
- ``save_hf_model``: a random transformers model saved with ``save_pretrained`` (float32, the
  family's real on-disk names), with the model's own in-memory weights kept for comparison;
- ``moetool.demo.tiny.make_tiny_checkpoint``: our synthetic writer.
Shapes keep hidden H != 2N (N = expert intermediate) so a transposed or half-swapped fused
tensor cannot pass a shape check by accident.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

H, N = 32, 24  # hidden, expert intermediate of the transformers-made models (2N = 48 != H)
#: where tests that run on either put their tensors: the GPU where there is one (Triton compiles
#: for it: tests/conftest.py sets TRITON_INTERPRET only without CUDA), else the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bench_module(name: str):
    """bench/NAME.py loaded as a module (``bench_NAME``), for tests of a benchmark's pieces."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------ /proc


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it waits for a reaper that may never come in a container)."""
    st = proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def wait_gone(pids: list[int], within: float) -> list[int]:
    """The pids still alive after ``within`` seconds (empty as soon as all are gone)."""
    end = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


@dataclass
class CliResult:
    code: int
    out: str
    err: str

    @property
    def error_line(self) -> str:
        """The one ``error: ...`` line (asserts there is exactly one line on stderr)."""
        lines = [l for l in self.err.splitlines() if l.strip()]
        assert len(lines) == 1, f"expected one error line, got: {self.err!r}"
        assert lines[0].startswith("error: "), lines[0]
        return lines[0][len("error: "):]


def run_cli(capsys, *args) -> CliResult:
    """``moetool ARGS`` in-process through the real entry point (error table included)."""
    from moetool.cli import main

    capsys.readouterr()
    code = 0
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    cap = capsys.readouterr()
    return CliResult(code, cap.out, cap.err)


# ------------------------------------------------------------------------------ files


def tree_hashes(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def read_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file directly in ``root``."""
    out: dict[str, torch.Tensor] = {}
    for p in sorted(Path(root).glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = f.get_tensor(k)
    return out


def tensor_files(root: Path) -> dict[str, str]:
    """{tensor name: file name} from the safetensors headers in ``root``."""
    out = {}
    for p in sorted(Path(root).glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            out.update({k: p.name for k in f.keys()})
    return out


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # flattened first: a contiguous tensor whose last dim is 1 may still have stride(-1) != 1
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def assert_same_tensors(got: dict, want: dict) -> None:
    """Two {name: tensor} dicts (a kernel's and its reference's) hold the same names in the same
    order, and each the same dtype, shape and bytes (``bit_equal``; tensors may be on any device)."""
    assert list(got) == list(want)
    for key, value in want.items():
        assert bit_equal(got[key].cpu(), value.cpu()), key


def wide_range_weights(shape: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor:
    """Normal data with a wide dynamic range per row, an all-zero block and exact ties."""
    N, K = shape
    w = torch.randn(N, K) * torch.exp(torch.randn(N, 1) * 2)
    if N > 2 and K > 2:
        w[: min(N, 3), : min(K, 3)] = 0.0  # part of an all-zero region
    return w.to(dtype).to(device)


def rewrite_file(path: Path, mutate) -> None:
    """Load one safetensors file, let ``mutate(dict)`` change it, save it back (and fix the
    index of the folder so that it stays consistent with the new contents)."""
    path = Path(path)
    tensors = load_file(str(path))
    before = set(tensors)
    mutate(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = path.parent / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        wm = data["weight_map"]
        for gone in before - set(tensors):
            wm.pop(gone, None)
        for new in set(tensors) - before:
            wm[new] = path.name
        index.write_text(json.dumps(data))


@functools.cache
def transformers_gpt_oss_reads_its_limit() -> bool:
    """Whether the installed transformers' GptOssExperts clamps at its config's ``swiglu_limit``
    (5.19 and later do; up to 5.18 it holds 7.0 and 1.702 as constants, whatever the config
    says). The tiny gpt-oss models clamp at small limits so that the clamp cuts; with a
    transformers of constants they cannot be its reference. True without transformers (its
    tests skip on their own)."""
    try:
        import transformers
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return True
    cfg = transformers.GptOssConfig(hidden_size=8, intermediate_size=2, num_local_experts=2, swiglu_limit=3.0)
    gate_up = torch.full((1, 4), 5.0)  # past 3, under 7: gate and up clamped to 3 only if the config is read
    clamped = 3.0 * torch.sigmoid(torch.tensor(3.0 * 1.702)) * (3.0 + 1)
    return torch.allclose(GptOssExperts(cfg)._apply_gate(gate_up), clamped.expand(1, 2))


def edited_copy(src: Path, dst: Path, mutate=None, config=None) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``mutate(tensors)`` applied to the file holding
    its embeddings (``rewrite_file``) and ``config(dict)`` to its config.json."""
    shutil.copytree(src, dst)
    if mutate is not None:
        rewrite_file(file_of(dst, "model.embed_tokens.weight"), mutate)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def file_of(root: Path, tensor: str) -> Path:
    return Path(root) / tensor_files(root)[tensor]


def raw_safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


# ------------------------------------------------------------------------------ transformers models

#: family -> (transformers config class name, kwargs); every one a 2-layer float32 model
HF_CONFIGS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=N, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=64, moe_intermediate_size=N, shared_expert_intermediate_size=40,
                                         num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=64, moe_intermediate_size=N, num_experts=4,
                                         num_experts_per_tok=2, head_dim=8, norm_topk_prob=True)),
    "deepseek_v2": ("DeepseekV2Config", dict(intermediate_size=64, moe_intermediate_size=N, first_k_dense_replace=1,
                                             num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                                             num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=2,
                                             topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=3, intermediate_size=64, moe_intermediate_size=N,
                                             first_k_dense_replace=1, num_key_value_heads=4, n_routed_experts=8,
                                             n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                             v_head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=N, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2)),
    "llama4": ("Llama4TextConfig", dict(intermediate_size=N, intermediate_size_mlp=64, num_local_experts=4,
                                        num_experts_per_tok=1, head_dim=8, interleave_moe_layer_step=1)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=N, num_local_experts=4, num_experts_per_tok=2, head_dim=8)),
}


@dataclass
class HFModel:
    family: str
    path: Path
    state: dict[str, torch.Tensor]  # the model's own parameters (in-memory layout)
    config: dict  # the saved config.json


#: the two layouts transformers 5 saves: its default, the family's original on-disk names
#: (``save_original_format=True``), and its own v5 names (Mixtral: ``mlp``, every family's
#: routed experts fused in ``experts.gate_up_proj`` / ``experts.down_proj``)
HF_LAYOUTS = ("original", "v5")


def save_hf_model(family: str, path: Path, *, dtype: torch.dtype = torch.float32, layout: str = "original",
                  **overrides) -> HFModel:
    """A random transformers model of ``family`` saved in ``layout`` (one of HF_LAYOUTS)."""
    import transformers

    if layout not in HF_LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {HF_LAYOUTS}")

    cls_name, kw = HF_CONFIGS[family]
    args = dict(vocab_size=64, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    args.update(kw)
    args.update(overrides)
    cfg = getattr(transformers, cls_name)(**args)
    torch.manual_seed(sum(map(ord, family)))
    if family == "llama4":
        model = transformers.Llama4ForCausalLM(cfg)
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.to(dtype)
    with torch.no_grad():  # HF init leaves some tensors at 0/1; make every weight distinct
        for name, p in model.named_parameters():
            if p.dim() >= 1:
                p.copy_(torch.randn_like(p) * (1 / p.shape[-1] ** 0.5))
    model.save_pretrained(str(path), save_original_format=layout == "original")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return HFModel(family, Path(path), state, json.loads((Path(path) / "config.json").read_text()))


def hf_expert(model: HFModel, prefix: str, e: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [N,H], up [N,H], down [H,N]) of expert e as the transformers module holds it.

    transformers v5 keeps experts fused in memory: ``gate_up_proj`` [E, 2N, H] (gate half first)
    and ``down_proj`` [E, H, N]; Llama-4 and gpt-oss are input-first ([E, H, 2N], [E, N, H]),
    gpt-oss with gate/up columns interleaved. Older layouts hold per-expert modules."""
    s = model.state
    layer = prefix.split(".layers.")[1].split(".")[0]
    # in memory the MoE module may have another name than on disk (Mixtral: mlp vs block_sparse_moe)
    fused = next((k for k in s if k.startswith(f"model.layers.{layer}.") and k.endswith(".experts.gate_up_proj")),
                 f"{prefix}.experts.gate_up_proj")
    if fused not in s:
        names = ("w1", "w3", "w2") if model.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        return tuple(s[f"{prefix}.experts.{e}.{lin}.weight"] for lin in names)  # type: ignore[return-value]
    gu, dn = s[fused][e], s[fused.replace("gate_up_proj", "down_proj")][e]
    if model.family == "gpt_oss":
        return gu[:, 0::2].t(), gu[:, 1::2].t(), dn.t()
    if model.family == "llama4":
        return gu[:, :n].t(), gu[:, n:].t(), dn.t()
    return gu[:n], gu[n:], dn


#: gpt-oss's release ``quantization_config`` (openai/gpt-oss-20b and -120b config.json)
GPT_OSS_MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                   "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def save_gpt_oss_mxfp4(model: HFModel, path: Path) -> Path:
    """``model`` (a transformers-made gpt-oss) in gpt-oss's MXFP4 release layout at ``path``:
    every ``experts.gate_up_proj`` [E, H, 2N] / ``experts.down_proj`` [E, N, H] becomes
    ``*_blocks`` uint8 [E, rows, K/32, 16] and ``*_scales`` uint8 [E, rows, K/32], output rows
    first (gate and up rows interleaved, as the dense tensor's columns are), each row's e2m1
    codes from moetool's mxfp4 quantizer packed two a byte, element 2j in the low nibble; the
    rest (biases included) as saved, and the release's ``quantization_config``. (transformers
    cannot write it: its quantizer needs the Hub's triton kernels.)"""
    from moetool.formats import get_format

    mxfp4 = get_format("mxfp4")
    path = Path(path)
    path.mkdir(parents=True)
    out = {}
    for name, t in read_tensors(model.path).items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            out[name] = t
            continue
        rows = t.transpose(1, 2)  # [E, R, K]: output rows
        E, R, K = rows.shape
        q = [mxfp4.quantize(rows[e].float(), t.dtype) for e in range(E)]
        out[f"{name}_blocks"] = torch.stack([x["weight_packed"] for x in q]).reshape(E, R, K // 32, 16)
        out[f"{name}_scales"] = torch.stack([x["weight_scale"] for x in q])
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = dict(model.config, quantization_config=GPT_OSS_MXFP4_CONFIG)
    (path / "config.json").write_text(json.dumps(config))
    return path


def hf_param(model: HFModel, disk_name: str) -> torch.Tensor:
    """A non-expert parameter by its on-disk name (Mixtral's block_sparse_moe is mlp in memory)."""
    if disk_name in model.state:
        return model.state[disk_name]
    return model.state[disk_name.replace(".block_sparse_moe.", ".mlp.")]
