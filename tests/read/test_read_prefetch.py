"""The read-ahead hint verify gives the kernel while torch imports: exactly the experts' bytes,
in the order the reference pass reads them, within a budget; nothing for what is not a local
checkpoint."""
from __future__ import annotations

import os

import pytest
import torch

from moetool.demo.tiny import make_tiny_checkpoint
from moetool.model.families import describe
from moetool.read.checkpoint import expert_tensor_names, open_checkpoint
from moetool.read.prefetch import advise_ranges, expert_ranges


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pf") / "m", "qwen3_moe", hidden=64, intermediate=32,
                                experts=4, top_k=2, layers=3, dtype=torch.float32, shards=2)


def _covered(ranges) -> set[tuple[str, int]]:
    return {(p.name, b) for p, off, n in ranges for b in range(off, off + n)}


def test_expert_ranges_cover_exactly_the_experts_in_layer_order(model):
    ranges = expert_ranges(model)
    with open_checkpoint(model) as ckpt:
        spec = describe(ckpt.config, ckpt.tensors)
        want = set()
        for layer in spec.moe_layers:
            for name in expert_tensor_names(ckpt, layer):
                info = ckpt.info(name)
                want |= {(info.file, b) for b in range(info.begin, info.end)}
        assert _covered(ranges) == want
        first = [m.index for m in spec.moe_layers][1]
        only = expert_ranges(model, [first])
        names = expert_tensor_names(ckpt, spec.layer(first))
        assert sum(n for *_, n in only) == sum(ckpt.info(n).nbytes for n in names)


def test_expert_ranges_are_empty_for_what_is_not_a_local_checkpoint(tmp_path):
    assert expert_ranges("org/some-model") == []
    (tmp_path / "config.json").write_text("{not json")
    assert expert_ranges(tmp_path) == []


def test_advise_ranges_asks_in_order_within_the_budget(model, monkeypatch):
    asked = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: asked.append((off, n, how)), raising=False)
    ranges = expert_ranges(model)
    total = sum(n for *_, n in ranges)
    advise_ranges(ranges, budget=total).join()
    assert [(off, n) for off, n, _ in asked] == [(off, n) for _, off, n in ranges]
    assert {how for *_, how in asked} == {os.POSIX_FADV_WILLNEED}
    asked.clear()
    advise_ranges(ranges, budget=ranges[0][2] + 1).join()
    assert sum(n for _, n, _ in asked) == ranges[0][2] + 1
