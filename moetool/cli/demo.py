from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Optional

import typer

from moetool.cli import command_app
from moetool.errors import VerificationFailed
from moetool.lazy import import_module
from moetool.verify import fork_server

app = command_app()


@app.command("demo")
def demo_cmd(
    workdir: Annotated[Optional[Path], typer.Option("--workdir", help="write the demo's files here and keep them (default: a temporary folder, removed at the end)")] = None,
    fmt: Annotated[str, typer.Option("--format", help="a format `moetool quantize` writes, by name or by its flag (int4); int4 with group size 64")] = "fp8-block",
) -> None:
    """Write a tiny MoE model, quantize it, shard it over 4 EP ranks and verify it (CPU, < 1 min),
    then print the commands it ran, to re-run by hand."""
    # the verify steps' ranks fork from a server that imports what both checks' ranks need
    # while this process imports torch and converts (as `moetool verify` starts it)
    fork_server.start(fork_server.WHOLE_MODEL_MODULES if importlib.util.find_spec("transformers")
                      else fork_server.MOE_ONLY_MODULES)
    chain = import_module("moetool.demo.chain")  # torch
    if not chain.run_demo(workdir, echo=typer.echo, fmt=fmt):
        raise VerificationFailed("demo verification failed")
