from __future__ import annotations

import json

import typer

from moetool.cli import command_app
from moetool.cli.options import Json, Revision, Source
from moetool.read.checkpoint import ShardOutputError, open_checkpoint
from moetool.read.inspect import inspect_checkpoint, inspect_shards, render, render_shards

app = command_app()


@app.command("inspect")
def inspect_cmd(source: Source, revision: Revision = None, json_out: Json = False) -> None:
    """What is in a checkpoint: architecture, MoE layers, experts, dims, weight format, bytes.
    Also one rank folder of `moetool shard` output, or its shard root (ranks, placement, files)."""
    try:
        with open_checkpoint(source, revision, ep_rank=True) as ckpt:
            info, text = inspect_checkpoint(ckpt), render
    except ShardOutputError as err:  # a shard root: described, not refused
        if err.rank is not None:
            raise
        info, text = inspect_shards(err.root), render_shards
    typer.echo(json.dumps(info, indent=2) if json_out else text(info))
