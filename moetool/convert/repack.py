"""Library API of ``moetool repack``: per-expert <-> stacked, the weight format unchanged.

An unquantized checkpoint whose experts are stored per expert or stacked is repacked as a byte
copy (``moetool.convert.byte_executor``: no torch is imported); any other goes through the torch executor
(``moetool.convert.conversion.convert_checkpoint`` with no target format). Both write the same bytes.
"""
from __future__ import annotations

from pathlib import Path

from moetool.convert.byte_executor import FORMAT, repack_by_copy
from moetool.convert.plan import Layout, Plan, Summary
from moetool.convert.planning import plan_id
from moetool.lazy import import_module
from moetool.model.families import describe
from moetool.read.checkpoint import open_checkpoint

#: the torch path, imported only when the repack is not a byte copy (see moetool.convert.shard)
TORCH_PATH = "moetool.convert.conversion"


def repack(source, out, layout: Layout, *, max_shard_size: int | None = None, dry_run: bool = False,
           force: bool = False, progress: bool = True, revision: str | None = None, device: str = "cpu",
           byte_copy: bool = True) -> Summary | Plan:
    """``byte_copy=False`` forces the torch executor (same output bytes). ``layout`` "fused":
    transformers' fused tensors of the family (gpt-oss's own layout), through the torch executor."""
    if byte_copy and not dry_run and device == "cpu" and layout != "fused":
        ckpt = open_checkpoint(source, revision)
        try:
            spec = describe(ckpt.config, ckpt.tensors)
            # the torch executor's fingerprint of the same plan: either one resumes the other's files
            pid = plan_id(ckpt, fmt=FORMAT, params={}, layout=layout, shared=False, max=max_shard_size)
            done = repack_by_copy(ckpt, spec, Path(out), layout, max_shard_size=max_shard_size, force=force,
                                  progress=progress, plan_id=pid)
            if done is not None:
                return done
        finally:
            ckpt.close()
    return import_module(TORCH_PATH).convert_checkpoint(source, out, fmt=None, layout=layout, max_shard_size=max_shard_size, dry_run=dry_run,
                              force=force, progress=progress, revision=revision, device=device)
