"""moetool.demo.tiny writes whole models that transformers loads (issue 16, point 3).

Per family and layout: ``AutoModelForCausalLM.from_pretrained`` finds every weight it needs
and no other (the family's real attention: MLA for DeepSeek, q/k norms, biases, sinks), holds
exactly our tensors, and runs a forward to finite logits. The MoE tensors of a seed keep the
values the first tiny writer gave them (its hashes are recorded below), so numbers measured on
the demo model stay valid.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from moetool.demo.tiny import FAMILY_CONFIGS, LAYOUTS, make_tiny_checkpoint, tiny_config, tiny_tensors
from moetool.read.checkpoint import open_checkpoint
from moetool.read.experts import ExpertReader
from moeutil import HFModel, hf_expert, read_tensors

transformers = pytest.importorskip("transformers")

FAMILIES = list(FAMILY_CONFIGS)
#: sha256 (first 16 hex digits) of every tensor but attention, names and bytes in name order,
#: of tiny_tensors(family, tiny_config(family, hidden=64, intermediate=48, experts=4 (8 for
#: DeepSeek), top_k=2, layers=2 (3), bf16), seed=3) as the first tiny writer made them
FIRST_WRITER = {"mixtral": "4475f7e3b1ad302e", "qwen2_moe": "77f4be6856339268", "qwen3_moe": "80e531f0881d9114",
                "olmoe": "80e531f0881d9114", "deepseek_v2": "79ef8307e5638701", "deepseek_v3": "5d2670106317cd1c",
                "llama4": "3aa266a0d7fba824", "gpt_oss": "50971a30c02009b7"}


def _dims(family: str) -> dict:
    deepseek = family.startswith("deepseek")
    return dict(hidden=64, intermediate=48, experts=8 if deepseek else 4, top_k=1 if family == "llama4" else 2,
                layers=3 if deepseek else 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_tensors_keep_their_values(family):
    cfg = tiny_config(family, **_dims(family), dtype=torch.bfloat16)
    t = tiny_tensors(family, cfg, seed=3)
    h = hashlib.sha256()
    for name in sorted(t):
        if ".self_attn." not in name:
            h.update(name.encode())
            h.update(t[name].contiguous().view(torch.uint8).numpy().tobytes())
    assert h.hexdigest()[:16] == FIRST_WRITER[family]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_it(tmp_path, family, layout):
    path = make_tiny_checkpoint(tmp_path / "m", family, **_dims(family), dtype=torch.float32, layout=layout)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert type(model).__name__ == tiny_config(family, **_dims(family), dtype=torch.float32)["architectures"][0]
    state = {k: v.detach() for k, v in model.state_dict().items()}
    ours = read_tensors(path)
    # every tensor that is not a routed expert under its own name (Mixtral's block is mlp in memory)
    for name, t in ours.items():
        if ".experts." not in name:
            assert torch.equal(state[name.replace(".block_sparse_moe.", ".mlp.")], t), name
    hf = HFModel(family, path, state, {})
    with open_checkpoint(path) as ck:
        reader = ExpertReader(ck)
        for layer in reader.spec.moe_layers:
            for e in range(layer.num_experts):
                got = [lin["weight"] for lin in reader.gate_up_down(layer, e)]
                assert all(torch.equal(g, w) for g, w in zip(got, hf_expert(hf, layer.prefix, e, layer.intermediate)))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 16, 128) and torch.isfinite(logits).all()
