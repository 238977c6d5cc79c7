"""Library API of ``moetool shard``: one folder per EP rank (``--merge`` back: ``moetool.convert.merge``).

Output::

    OUT/rank-00000-of-00004/config.json, index
                            model-0000i-of-0000n.safetensors           rank 0's experts by local slot
                            model-common-0000i-of-0000n.safetensors    every non-expert tensor
    OUT/rank-00001-of-00004/...                                         (model-common*: hard links
    ...                                                                  to rank 0's, or copies)
    OUT/manifest.json   format, layout, placement, per layer global expert -> [(rank, slot)...],
                        the source's tensor -> file map, sha256 + size of every file (written last)

Each rank folder is a checkpoint of its own: config.json is the model's, plus a ``moetool_ep``
entry saying which rank it is and how many experts each layer stores there.
"""
from __future__ import annotations

from pathlib import Path

from moetool.convert.byte_executor import shard_by_copy
from moetool.convert.plan import Layout, Plan, Summary
from moetool.convert.planning import plan_id, plan_placements
from moetool.lazy import import_module
from moetool.model.families import describe
from moetool.model.placement import placement_to_json
from moetool.read.checkpoint import open_checkpoint

#: the torch path, imported only when a shard is not a byte copy of its input (a byte copy runs
#: without torch: start-up 0.1 s instead of 1 s)
TORCH_PATH = "moetool.convert.conversion"


def shard(source, out, ep: int, *, placement: str = "linear", redundant: int = 0, expert_load: Path | None = None,
          layout: Layout = "stacked", max_shard_size: int | None = None, dry_run: bool = False, force: bool = False,
          progress: bool = True, revision: str | None = None, byte_copy: bool = True,
          links: bool = True) -> Summary | Plan:
    """Write one folder per EP rank and the manifest. A checkpoint whose experts are stored per
    expert or stacked is copied byte range by byte range (``moetool.convert.byte_executor``, no
    torch; a quantized one is checked against the torch executor's plan, in a child process,
    before its files are committed; ``byte_copy=False`` forces the torch executor, same output
    bytes). The
    non-expert tensors are written once, in rank 0's ``model-common`` files; the other ranks'
    are hard links to them (``links=False``, or a file system without hard links: copies)."""
    ckpt = open_checkpoint(source, revision)
    try:
        spec = describe(ckpt.config, ckpt.tensors)  # a rank folder or a shard root: refused by open_checkpoint
        placements = plan_placements(spec, ep, placement, redundant, expert_load)
        # the placements themselves, not the load file's name: edited, it may place the replicas
        # elsewhere, and a resumed run would keep the rank files of the old placement
        pid = plan_id(ckpt, ep=ep, placement=placement, redundant=redundant, layout=layout, max=max_shard_size,
                      placements={i: placement_to_json(p) for i, p in placements.items()})
        if byte_copy and not dry_run:
            done = shard_by_copy(ckpt, spec, out, ep, placements, layout=layout, placement_name=placement,
                                 redundant=redundant, max_shard_size=max_shard_size, force=force,
                                 progress=progress, plan_id=pid, links=links, expert_load=expert_load)
            if done is not None:
                return done
        conversion = import_module(TORCH_PATH)
        return conversion.shard_checkpoint(ckpt, spec, out, ep, placements, layout=layout, placement_name=placement,
                                           redundant=redundant, max_shard_size=max_shard_size, dry_run=dry_run,
                                           force=force, progress=progress, plan_id=pid, links=links)
    finally:
        ckpt.close()


# ------------------------------------------------------------------------------------ reading


