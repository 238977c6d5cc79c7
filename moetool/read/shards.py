"""A finished ``moetool shard`` output: its manifest, the placements and one checkpoint per
EP rank (read by ``verify`` and ``shard --merge``)."""
from __future__ import annotations

import json
from pathlib import Path

from moetool.errors import MoetoolError
from moetool.model.families import describe
from moetool.model.placement import placement_from_json
from moetool.read.checkpoint import Checkpoint, open_checkpoint
from moetool.read.manifest import MANIFEST_NAME, rank_dir, verify_manifest


class EPShards:
    """A finished ``moetool shard`` output: manifest, placements and per-rank checkpoints."""

    def __init__(self, root: Path, *, check: bool = True):
        self.root = Path(root)
        _refuse_rank_folder(self.root)
        if check:
            self.manifest = verify_manifest(self.root)
        else:
            path = self.root / MANIFEST_NAME
            if not path.is_file():
                raise MoetoolError(f"{self.root}: no {MANIFEST_NAME} (not a finished moetool shard output)")
            self.manifest = json.loads(path.read_text())
        if self.manifest.get("kind") != "ep-shards":
            raise MoetoolError(f"{self.root}: {MANIFEST_NAME} is not from moetool shard (kind {self.manifest.get('kind')!r})")
        self.ep = int(self.manifest["ep"])
        self.layout = self.manifest["layout"]
        self.placements = {int(l["layer"]): placement_from_json(l, int(l["num_experts"]), self.ep)
                           for l in self.manifest["layers"]}

    def rank_files(self, rank: int) -> list[str]:
        d = rank_dir(rank, self.ep) + "/"
        return [n for n in self.manifest["files"] if n.startswith(d)]

    def open_rank(self, rank: int, *, check: bool = True) -> tuple[Checkpoint, object]:
        """(checkpoint, ModelSpec) of one rank; with ``check`` its files' sha256 are verified first."""
        if check:
            verify_manifest(self.root, self.rank_files(rank))
        ckpt = open_checkpoint(self.root / rank_dir(rank, self.ep), ep_rank=True)
        stored = {int(k): v for k, v in ckpt.config["moetool_ep"]["stored_experts"].items()}
        if ckpt.config["moetool_ep"]["rank"] != rank:
            raise MoetoolError(f"{ckpt.root}/config.json: says rank {ckpt.config['moetool_ep']['rank']}, expected {rank}")
        for i, p in self.placements.items():
            if stored.get(i) != len(p.slots[rank]):
                raise MoetoolError(f"{ckpt.root}: layer {i} stores {stored.get(i)} experts, the manifest places {len(p.slots[rank])}")
        return ckpt, describe(ckpt.config, ckpt.tensors, stored_experts=stored)


def _refuse_rank_folder(root: Path) -> None:
    """One rank folder given where the shard root goes (``verify``, ``shard --merge``): say so."""
    if (root / MANIFEST_NAME).exists() or not (root / "config.json").is_file():
        return
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if isinstance(config, dict) and isinstance(config.get("moetool_ep"), dict):
        raise MoetoolError(f"{root}: is one rank folder of a moetool shard output; give the shard folder that holds "
                           f"every rank and manifest.json ({root.parent})")
