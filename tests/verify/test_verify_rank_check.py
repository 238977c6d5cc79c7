"""A rank checks its files' sha256 on threads while it reads and runs them: the verdict still
comes before anything leaves the rank, and a damaged file is named rather than what it broke."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from moetool.errors import MoetoolError
from moetool.read.manifest import verify_manifest
from moetool.read.order import file_steps
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
    with opened_and_checked(shards, 1) as (ckpt, spec, _):
        assert spec.moe_layers and ckpt.tensors


def test_a_damaged_tensor_raises_on_leaving_after_the_work(shards):
    path = _largest_file(shards, 1)
    _flip(path, path.stat().st_size - 100)  # inside the last tensor's bytes: opening works
    done = []
    with pytest.raises(MoetoolError, match=f"{path.name}: sha256 does not match"):
        with opened_and_checked(shards, 1) as (ckpt, _, _):
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


def test_each_file_is_hashed_as_the_run_comes_to_it(shards, monkeypatch):
    """Beyond memory, a file hashed long before its layer would be read twice: each file waits
    until the run is one step before its first layer (--whole-model's steps: the stages), files
    no step reads go first, and whatever the run did not reach is hashed when it leaves."""
    import moetool.read.manifest as manifest

    hashed: list[str] = []
    real = manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda p: hashed.append(p.name) or real(p))

    def settled() -> set[str]:
        time.sleep(0.3)
        return set(hashed)

    with opened_and_checked(shards, 1) as (ckpt, _, progress):
        steps = file_steps(ckpt, None)
        by_step = {k: {f for f, s in steps.items() if s == k} for k in set(steps.values())}
        assert settled() == {"config.json", "model.safetensors.index.json"}  # no step reads them
        seen = {"config.json", "model.safetensors.index.json"}
        for step in sorted(by_step):
            progress.reached(step - 1)
            seen |= by_step[step]
            assert settled() == seen, step
        assert max(by_step) > 1  # the shard's layers span files, so the test paces something
    assert set(hashed) == {Path(n).name for n in shards.rank_files(1)}


def test_a_run_that_stops_early_still_names_a_damaged_later_file(shards):
    """The run fails at its first layer: the files of layers it never reached are hashed on the
    way out, and the damaged one is what is raised."""
    with opened_and_checked(shards, 1) as (ckpt, _, _):
        steps = file_steps(ckpt, [1, 2])
        last = max(steps, key=steps.get)
    _flip(shards.root / shards.rank_files(1)[0].split("/")[0] / last, 100)
    with pytest.raises(MoetoolError, match=f"{last}: sha256 does not match"):
        with opened_and_checked(shards, 1, [1, 2]) as (_, _, progress):
            progress.reached(0)
            raise MoetoolError("layer 1 broke")
