"""The order verify reads its inputs ahead in: embeddings, each decoder layer in numeric order,
then the rest; file order within each; the reference before the shards within a stage."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from moetool.errors import MoetoolError

from moetool.read.safetensors import TensorInfo
from moetool.read.order import (WHOLE_FILES_STAGE, PacedReadAhead, package_files, read_order, read_ahead_window,
                                read_verify_inputs_ahead, stage, verify_order)


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


def _stages(ckpt_root: Path, ranges) -> list[int]:
    """The stage of each range that is one tensor of a checkpoint under ``ckpt_root``."""
    from moetool.read.checkpoint import open_checkpoint

    out = []
    for path, offset, length in ranges:
        folder = path.parent
        with open_checkpoint(folder, ep_rank=folder != ckpt_root) as ckpt:
            hit = [t for t in ckpt.tensors.values() if ckpt.root / t.file == path and t.begin == offset]
            out.append(stage(hit[0].name) if hit and hit[0].end - hit[0].begin == length else None)
    return out


def test_verify_reads_each_layer_reference_then_shards_then_whole_files(verify_chain, verify_shards):
    from moetool.read.checkpoint import open_checkpoint

    model, shards = verify_chain[0], verify_shards("fp8-block", 2)
    ranks = sorted(p for p in shards.iterdir() if p.name.startswith("rank-"))
    with open_checkpoint(model) as ref:
        moe_only_keyed = verify_order(ranks, ref, [1, 2])
        # the run's order, not the layers' (--layers 2,1): layer 2's step first
        assert verify_order(ranks, ref, [2, 1])[:3] == [(0, r) for s, r in moe_only_keyed if s == 1][:3]
        whole_keyed = verify_order(ranks, ref, None)
        whole = [r for _, r in whole_keyed]
        ref_bytes = sum(t.end - t.begin for t in ref.tensors.values())
    moe_only = [r for _, r in moe_only_keyed]
    staged = [r for s, r in moe_only_keyed if s != WHOLE_FILES_STAGE]
    assert staged == [r for r in moe_only if r[1] or r[2] != r[0].stat().st_size]
    assert [s for s, _ in moe_only_keyed] == sorted(s for s, _ in moe_only_keyed)
    sides = [r[0].parent == model for r in staged]
    stages = _stages(model, staged)
    assert set(stages) == {1, 2} and stages == sorted(stages)  # layer 1 before layer 2, nothing else
    assert [s for s, r in moe_only_keyed if s != WHOLE_FILES_STAGE] == [{1: 0, 2: 1}[x] for x in stages]  # steps: places in the run's list
    for s in (1, 2):  # within a layer, the reference before the shards
        mine = [ref_side for ref_side, st in zip(sides, stages) if st == s]
        assert mine == sorted(mine, reverse=True) and mine[0] and not mine[-1]
    # then every rank file whole, each inode once (rank 0's common files are hard-linked)
    tail = moe_only[len(staged):]
    files = {p for r in ranks for p in r.glob("*.safetensors")}
    assert {p for p, _, _ in tail} <= files and all(o == 0 and n == p.stat().st_size for p, o, n in tail)
    inodes = {(p.stat().st_dev, p.stat().st_ino) for p in files}
    assert len(tail) == len(inodes)
    # --whole-model: every reference tensor, the stages in order; within a stage the ranks'
    # tensors first (the converted side of a row runs before its reference side)
    whole_staged = [r for r in whole if r[0].parent == model]
    assert sum(n for _, _, n in whole_staged) == ref_bytes
    assert _stages(model, whole_staged) == sorted(_stages(model, whole_staged))
    for s in (-1, 0, 1, 2):  # the embeddings, the dense layer, both MoE layers
        ref_side = [r[0].parent == model for st, r in whole_keyed if st == s]
        assert ref_side == sorted(ref_side) and not ref_side[0] and ref_side[-1], s


def test_read_ahead_of_a_verify_is_only_a_hint(verify_chain, verify_shards, tmp_path):
    model, shards = verify_chain[0], verify_shards("fp8-block", 2)
    ahead = read_verify_inputs_ahead([(shards, model, [1]), (shards, model, None)])
    assert ahead is not None
    ahead.reached((2, 0))  # past every key: the run is done with all of it
    ahead.thread.join(30)
    assert not ahead.thread.is_alive()
    # what the run itself reports (no such folder, a damaged header) is not raised here
    assert read_verify_inputs_ahead([(shards, tmp_path / "nothing", None)]) is None
    bad = tmp_path / "ref"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    (bad / "config.json").write_text("{}")
    assert read_verify_inputs_ahead([(shards, bad, [1])]) is None


def test_the_code_the_ranks_load_is_found_not_imported():
    import sys

    files = {p.name for p, offset, n in package_files("moetool") if offset == 0 and n == p.stat().st_size}
    assert {"order.py", "__main__.py"} <= files
    assert package_files("moetool_no_such_package") == []
    assert "moetool_no_such_package" not in sys.modules


def _settled(ahead: PacedReadAhead, want: int) -> int:
    """``ahead.issued`` once it reaches ``want`` (or 5 s pass), then 0.2 s more: what it holds at."""
    deadline = time.monotonic() + 5
    while ahead.issued < want and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    return ahead.issued


def test_reads_ahead_stay_within_the_window_of_what_the_run_still_needs(tmp_path):
    """A model larger than memory is read just ahead of its use, never evicting what the run has
    not used yet: the reader holds at ``window`` bytes past the run's position, moves on as
    the run does, takes a range larger than the window once it is the next one needed, and
    ends when told."""
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(16 << 20))
    mib = 1 << 20
    keyed = [((0, i), (data, i * mib, mib)) for i in range(8)] + [((0, 8), (data, 8 * mib, 8 * mib))]
    # ranges of one key that follow each other in a file are read as one (a tensor each, 100k of them)
    split = [((0, i), (data, i * mib + h * (mib // 2), mib // 2)) for i in range(8) for h in range(2)]
    stopped_at_once = threading.Event()
    stopped_at_once.set()
    assert PacedReadAhead(split, window=0, stop=stopped_at_once)._ranges == [r for _, r in keyed[:8]]
    ahead = PacedReadAhead(keyed, window=3 * mib)
    assert _settled(ahead, 3 * mib) == 3 * mib  # layers 0-2, then waits
    ahead.reached((0, 2))  # done with 0 and 1
    assert _settled(ahead, 5 * mib) == 5 * mib
    ahead.reached((0, 7))
    assert _settled(ahead, 8 * mib) == 8 * mib  # the 8 MiB range waits until it is next
    ahead.reached((0, 8))
    assert _settled(ahead, 16 * mib) == 16 * mib
    ahead.thread.join(5)
    assert not ahead.thread.is_alive()

    stopped = PacedReadAhead(keyed, window=mib)
    assert _settled(stopped, mib) == mib
    stopped.stop()
    stopped.thread.join(5)
    assert not stopped.thread.is_alive() and stopped.issued == mib


def test_without_sendfile_the_read_ahead_ends_quietly(tmp_path, monkeypatch):
    """A hint only: where there is no sendfile nothing is read ahead, and the thread ends
    without a traceback (the cache filler refuses to start)."""
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 4096)
    monkeypatch.delattr(os, "sendfile")
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    ahead = PacedReadAhead([((0, 0), (data, 0, 4096))], window=1 << 20)
    ahead.thread.join(30)
    assert not ahead.thread.is_alive() and raised == [] and ahead.issued == 0


def test_the_read_ahead_window_can_be_set(monkeypatch):
    monkeypatch.setenv("MOETOOL_READ_AHEAD_MB", "64")
    assert read_ahead_window() == 64 << 20
    for bad in ("lots", "inf", "0", "-5", "nan"):
        monkeypatch.setenv("MOETOOL_READ_AHEAD_MB", bad)
        with pytest.raises(MoetoolError, match=f"MOETOOL_READ_AHEAD_MB='{bad}': expected a positive number of MiB"):
            read_ahead_window()
    monkeypatch.delenv("MOETOOL_READ_AHEAD_MB")
    assert read_ahead_window() > 0
