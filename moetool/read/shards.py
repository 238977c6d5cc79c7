"""A finished ``moetool shard`` output: its manifest, the placements and one checkpoint per
EP rank (read by ``verify`` and ``shard --merge``)."""
from __future__ import annotations

import json
from pathlib import Path

from moetool.errors import JSON_ERRORS, MoetoolError
from moetool.model.families import describe
from moetool.model.placement import placement_from_json
from moetool.read.checkpoint import Checkpoint, open_checkpoint
from moetool.read.manifest import COMMON_STEM, MANIFEST_NAME, rank_dir, read_manifest, verify_manifest


#: what each entry of a shard manifest's "layers" gives, besides the placement
LAYER_FIELDS = ("layer", "num_experts", "hidden", "intermediate")


class EPShards:
    """A finished ``moetool shard`` output: manifest, placements and per-rank checkpoints."""

    def __init__(self, root: Path, *, check: bool = True):
        self.root = Path(root)
        _refuse_rank_folder(self.root)
        path = self.root / MANIFEST_NAME
        if check:
            self.manifest = verify_manifest(self.root)
        else:
            if not path.is_file():
                raise MoetoolError(f"{self.root}: no {MANIFEST_NAME} (not a finished moetool shard output)")
            self.manifest = read_manifest(path)
        m = self.manifest
        if m.get("kind") != "ep-shards":
            raise MoetoolError(f"{self.root}: {MANIFEST_NAME} is not from moetool shard (kind {m.get('kind')!r})")
        self.ep = m.get("ep")
        if type(self.ep) is not int or self.ep < 1:
            raise MoetoolError(f"{path}: \"ep\" is {self.ep!r}, not a number of ranks")
        if m.get("ranks") != [rank_dir(r, self.ep) for r in range(self.ep)]:
            raise MoetoolError(f"{path}: \"ranks\" does not name the {self.ep} rank folders")
        self.layout = m.get("layout")
        if not isinstance(self.layout, str) or not isinstance(m.get("format"), str):
            raise MoetoolError(f"{path}: no \"layout\" or \"format\" name")
        if not isinstance(m.get("layers"), list) or not m["layers"]:
            raise MoetoolError(f"{path}: no \"layers\" list")
        self.placements = {}
        for entry in m["layers"]:
            dims = [entry.get(k) if isinstance(entry, dict) else None for k in LAYER_FIELDS]
            if not all(type(v) is int and v >= 0 for v in dims):
                raise MoetoolError(f"{path}: a layer entry needs {', '.join(LAYER_FIELDS)} as numbers, got "
                                   f"{dict(zip(LAYER_FIELDS, dims))}")
            try:
                self.placements[dims[0]] = placement_from_json(entry, dims[1], self.ep)
            except MoetoolError as e:
                raise MoetoolError(f"{path}: layer {dims[0]}: {e}") from None

    def check_ranks_agree(self) -> None:
        """Every rank holds the same non-expert tensors and model config: its ``model-common``
        files the same as rank 0's (names and sha256 in the manifest; each rank then checks its
        bytes against it), its config.json the same but for its ``moetool_ep`` entry. A check
        compares the outputs of one rank per group, but every rank runs its own copy of the
        router, shared experts, attention and head: a copy that differs would go unseen."""
        first = self._common(0)
        config = self._config_without_rank(0)
        for rank in range(1, self.ep):
            mine = self._common(rank)
            for name in sorted(set(first) | set(mine)):
                if first.get(name) != mine.get(name):
                    where = f"{self.root}/{rank_dir(rank, self.ep)}/{name}"
                    what = "is missing" if name not in mine else "is not in rank 0" if name not in first else \
                        "differs from rank 0's copy (sha256 in the manifest)"
                    raise MoetoolError(f"{where}: {what}: every rank must hold the same non-expert tensors")
            if self._config_without_rank(rank) != config:
                raise MoetoolError(f"{self.root}/{rank_dir(rank, self.ep)}/config.json: differs from rank 0's "
                                   "in more than its moetool_ep entry")

    def _common(self, rank: int) -> dict[str, str]:
        """{file name in the rank folder: sha256} of a rank's ``model-common`` files."""
        d = rank_dir(rank, self.ep) + "/"
        return {n[len(d):]: rec["sha256"] for n, rec in self.manifest["files"].items()
                if n.startswith(d + COMMON_STEM)}

    def _config_without_rank(self, rank: int) -> dict:
        path = self.root / rank_dir(rank, self.ep) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, *JSON_ERRORS) as e:
            raise MoetoolError(f"{path}: cannot be read as JSON ({e})") from None
        if not isinstance(config, dict):
            raise MoetoolError(f"{path}: not a JSON object")
        config.pop("moetool_ep", None)
        return config

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
    except (OSError, *JSON_ERRORS):
        return
    if isinstance(config, dict) and isinstance(config.get("moetool_ep"), dict):
        raise MoetoolError(f"{root}: is one rank folder of a moetool shard output; give the shard folder that holds "
                           f"every rank and manifest.json ({root.parent})")
