from __future__ import annotations

import json

import typer

from moetool.cli import app
from moetool.cli.options import Json, Revision, Source


@app.command("inspect")
def inspect_cmd(source: Source, revision: Revision = None, json_out: Json = False) -> None:
    """What is in a checkpoint: architecture, MoE layers, experts, dims, weight format, bytes.
    Also one rank folder of `moetool shard` output, or its shard root (ranks, placement, files)."""
    from moetool.read.checkpoint import ShardOutputError, open_checkpoint
    from moetool.lazy import import_module

    lib = import_module("moetool.read.inspect")
    try:
        with open_checkpoint(source, revision, ep_rank=True) as ckpt:
            info, text = lib.inspect_checkpoint(ckpt), lib.render
    except ShardOutputError as err:  # a shard root: described, not refused
        if err.rank is not None:
            raise
        info, text = lib.inspect_shards(err.root), lib.render_shards
    typer.echo(json.dumps(info, indent=2) if json_out else text(info))
