"""A rank checks its files' sha256 on threads while it reads and runs them: the verdict still
comes before anything leaves the rank, and a damaged file is named rather than what it broke."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moetool.errors import MoetoolError
from moetool.read.manifest import verify_manifest
from moetool.read.shards import EPShards
from moetool.verify.rank import opened_and_checked


@pytest.fixture
def shards(verify_shards, tmp_path) -> EPShards:
    """A private copy of fp8-block ep-2 shards, to damage."""
    dst = tmp_path / "sh"
    shutil.copytree(verify_shards("fp8-block", 2), dst)
    return EPShards(dst, check=False)


def _largest_file(sh: EPShards, rank: int) -> Path:
    return max((sh.root / n for n in sh.rank_files(rank) if n.endswith(".safetensors")), key=lambda p: p.stat().st_size)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_intact_rank_opens_and_passes(shards):
    with opened_and_checked(shards, 1) as (ckpt, spec):
        assert spec.moe_layers and ckpt.tensors


def test_a_damaged_tensor_raises_on_leaving_after_the_work(shards):
    path = _largest_file(shards, 1)
    _flip(path, path.stat().st_size - 100)  # inside the last tensor's bytes: opening works
    done = []
    with pytest.raises(MoetoolError, match=f"{path.name}: sha256 does not match"):
        with opened_and_checked(shards, 1) as (ckpt, _):
            done.append(len(ckpt.tensors))
    assert done  # the work ran; its results never left


def test_a_damaged_header_is_named_not_what_it_broke(shards):
    path = _largest_file(shards, 0)
    _flip(path, 12)  # inside the JSON header: opening fails first
    with pytest.raises(MoetoolError):
        shards.open_rank(0, check=False)
    with pytest.raises(MoetoolError, match=f"{path.name}: sha256 does not match"):
        with opened_and_checked(shards, 0):
            pass


def test_the_callers_own_error_passes_through_when_the_files_are_intact(shards):
    with pytest.raises(ValueError, match="the rank's own failure"):
        with opened_and_checked(shards, 0):
            raise ValueError("the rank's own failure")


def test_parallel_hashing_names_the_first_damaged_file_in_order(shards):
    names = [n for n in shards.rank_files(0) + shards.rank_files(1) if n.endswith(".safetensors")]
    for n in names[-2:]:
        _flip(shards.root / n, (shards.root / n).stat().st_size - 1)
    with pytest.raises(MoetoolError, match=f"{names[-2]}: sha256 does not match"):
        verify_manifest(shards.root, names)
