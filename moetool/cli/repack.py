from __future__ import annotations

from typing import Annotated

import typer

from moetool.cli import command_app
from moetool.cli.options import DryRun, Force, MaxShardSize, Out, Quiet, Revision, Source, CONVERT_LAYOUTS, check_layout, parse_size
from moetool.convert.repack import repack

app = command_app()


@app.command("repack")
def repack_cmd(
    source: Source,
    out: Out,
    layout: Annotated[str, typer.Option("--layout", help="stacked (vLLM FusedMoE w13/w2), per-expert (HF names) or "
                                        "fused (the family's fused tensors)")] = "stacked",
    max_shard_size: MaxShardSize = None,
    dry_run: DryRun = False,
    force: Force = False,
    quiet: Quiet = False,
    revision: Revision = None,
) -> None:
    """Per-expert <-> stacked w13 [E, 2N, K] / w2 [E, K, N], bit-identical, in any format."""
    check_layout(layout, CONVERT_LAYOUTS)
    result = repack(source, out, layout, max_shard_size=parse_size(max_shard_size), dry_run=dry_run, force=force,
                    progress=not quiet, revision=revision)
    typer.echo(result.describe() if dry_run else result.render())
