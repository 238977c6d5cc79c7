from __future__ import annotations

from typing import Annotated

import typer

from moetool.cli import command_app
from moetool.cli.options import DryRun, Force, MaxShardSize, Out, Quiet, Revision, Source, check_layout, parse_size
from moetool.errors import MoetoolError

app = command_app()


@app.command("quantize")
def quantize_cmd(
    source: Source,
    out: Out,
    fp8_block: Annotated[bool, typer.Option("--fp8-block", help="fp8 e4m3, 128x128 block scales (DeepSeek-V3)")] = False,
    fp8_channel: Annotated[bool, typer.Option("--fp8-channel", help="fp8 e4m3, per-channel scales (compressed-tensors)")] = False,
    int4: Annotated[bool, typer.Option("--int4", help="int4 group W4A16 (compressed-tensors pack-quantized)")] = False,
    group_size: Annotated[int, typer.Option("--group-size", help="int4 group size")] = 128,
    symmetric: Annotated[bool, typer.Option("--symmetric/--asymmetric", help="int4 zero point")] = True,
    include_shared_experts: Annotated[bool, typer.Option("--include-shared-experts", help="quantize shared experts too")] = False,
    layout: Annotated[str, typer.Option("--layout", help="per-expert (what vLLM loads) or stacked")] = "per-expert",
    device: Annotated[str, typer.Option("--device", help="cpu or cuda")] = "cpu",
    max_shard_size: MaxShardSize = None,
    dry_run: DryRun = False,
    force: Force = False,
    quiet: Quiet = False,
    revision: Revision = None,
) -> None:
    """Requantize routed-expert weights; everything else passes through bit-identical."""
    chosen = [n for n, on in (("fp8-block", fp8_block), ("fp8-channel", fp8_channel), ("int4-group", int4)) if on]
    if len(chosen) != 1:
        raise MoetoolError("choose exactly one of --fp8-block, --fp8-channel, --int4")
    check_layout(layout)
    if group_size < 1:
        raise MoetoolError(f"--group-size {group_size} must be positive")
    from moetool.lazy import import_module

    quantize = import_module("moetool.convert.quantize").quantize

    result = quantize(source, out, chosen[0], group_size=group_size, symmetric=symmetric, layout=layout,
                      include_shared=include_shared_experts, max_shard_size=parse_size(max_shard_size),
                      dry_run=dry_run, force=force, progress=not quiet, revision=revision, device=device)
    typer.echo(result.describe() if dry_run else result.render())
