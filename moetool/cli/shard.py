from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from moetool.cli import command_app
from moetool.cli.options import DryRun, Force, MaxShardSize, Out, Quiet, Revision, Source, check_layout, parse_size
from moetool.errors import MoetoolError
from moetool.convert.shard import shard
from moetool.lazy import import_module

#: --merge converts through torch; a byte-copy shard never imports it
MERGE = "moetool.convert.merge"

app = command_app()


@app.command("shard")
def shard_cmd(
    source: Source,
    out: Out,
    ep: Annotated[Optional[int], typer.Option("--ep", help="number of expert-parallel ranks")] = None,
    placement: Annotated[str, typer.Option("--placement", help="linear (vLLM) or round-robin")] = "linear",
    redundant_experts: Annotated[int, typer.Option("--redundant-experts", help="extra replicas of the hottest experts, per layer")] = 0,
    expert_load: Annotated[Optional[Path], typer.Option("--expert-load", help='JSON: tokens routed to each expert, per MoE layer, e.g. {"layers": {"1": [120, 4, 37, ...], ...}}')] = None,
    layout: Annotated[str, typer.Option("--layout", help="stacked (vLLM FusedMoE w13/w2) or per-expert")] = "stacked",
    links: Annotated[bool, typer.Option("--links/--no-links", help="hard-link every rank's model-common files (the non-expert tensors) to rank 0's, or copy them (a resumed run keeps what an earlier run made)")] = True,
    merge_: Annotated[bool, typer.Option("--merge", help="SOURCE is a shard output: rebuild the unsharded checkpoint")] = False,
    max_shard_size: MaxShardSize = None,
    dry_run: DryRun = False,
    force: Force = False,
    quiet: Quiet = False,
    revision: Revision = None,
) -> None:
    """Split experts over EP ranks: one folder per rank plus a manifest (or --merge them back)."""
    check_layout(layout)
    if merge_:
        if ep is not None:
            raise MoetoolError("--merge takes the rank count from the manifest; drop --ep")
        result = import_module(MERGE).merge(source, out, max_shard_size=parse_size(max_shard_size), dry_run=dry_run, force=force,
                       progress=not quiet)
    else:
        if ep is None:
            raise MoetoolError("--ep N is required (or --merge)")
        result = shard(source, out, ep, placement=placement, redundant=redundant_experts, expert_load=expert_load,
                       layout=layout, max_shard_size=parse_size(max_shard_size), dry_run=dry_run, force=force,
                       progress=not quiet, revision=revision, links=links)
    typer.echo(result.describe() if dry_run else result.render())
