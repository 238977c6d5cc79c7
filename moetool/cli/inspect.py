from __future__ import annotations

import json

import typer

from moetool.cli import app
from moetool.cli.options import Json, Revision, Source


@app.command("inspect")
def inspect_cmd(source: Source, revision: Revision = None, json_out: Json = False) -> None:
    """What is in a checkpoint: architecture, MoE layers, experts, dims, weight format, bytes."""
    from moetool.checkpoint import open_checkpoint
    from moetool.lazy import import_module

    lib = import_module("moetool.inspect")
    inspect_checkpoint, render = lib.inspect_checkpoint, lib.render

    with open_checkpoint(source, revision) as ckpt:
        info = inspect_checkpoint(ckpt)
    typer.echo(json.dumps(info, indent=2) if json_out else render(info))
