"""What verify reads ahead while torch imports: exactly the experts' bytes, in the order the
reference pass reads them, within a budget; nothing for what is not a local checkpoint."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moetool.demo.tiny import make_tiny_checkpoint
from moetool.model.families import describe
from moetool.read.checkpoint import expert_tensor_names, open_checkpoint
from moetool.read.prefetch import expert_ranges, read_ahead_ranges


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


def test_read_ahead_reads_the_ranges_in_order_within_the_budget(model, monkeypatch):
    calls = []
    real = os.sendfile

    def recording(out, fd, offset, count):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, count))
        return real(out, fd, offset, count)

    monkeypatch.setattr(os, "sendfile", recording)
    ranges = expert_ranges(model)
    total = sum(n for *_, n in ranges)
    read_ahead_ranges(ranges, budget=total).join()
    assert [(Path(f).name, off, n) for f, off, n in calls] == [(p.name, off, n) for p, off, n in ranges]
    calls.clear()
    read_ahead_ranges(ranges, budget=ranges[0][2] + 1).join()
    assert sum(n for *_, n in calls) == ranges[0][2] + 1
