"""The order a whole-model rank reads the reference ahead in: embeddings, each decoder layer in
numeric order, then the rest; file order within each."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from moetool.read.safetensors import TensorInfo
from moetool.verify.whole_model import read_order


def test_the_reference_is_read_ahead_layer_by_layer():
    names = {  # name -> (file, begin)
        "lm_head.weight": ("b.safetensors", 0),
        "model.norm.weight": ("a.safetensors", 900),
        "model.layers.10.mlp.experts.0.down_proj.weight": ("a.safetensors", 100),
        "model.layers.9.self_attn.o_proj.weight": ("b.safetensors", 500),
        "model.layers.9.input_layernorm.weight": ("a.safetensors", 800),
        "model.layers.0.mlp.gate.weight": ("b.safetensors", 300),
        "model.embed_tokens.weight": ("b.safetensors", 700),
    }
    tensors = {n: TensorInfo(n, f, "BF16", (4,), b, b + 8) for n, (f, b) in names.items()}
    got = read_order(SimpleNamespace(tensors=tensors, root="/ckpt"))
    assert got == [(Path("/ckpt") / f, b, 8) for f, b in [
        ("b.safetensors", 700),  # embeddings
        ("b.safetensors", 300),  # layer 0
        ("a.safetensors", 800), ("b.safetensors", 500),  # layer 9, file order
        ("a.safetensors", 100),  # layer 10 after 9
        ("a.safetensors", 900), ("b.safetensors", 0),  # the rest
    ]]
