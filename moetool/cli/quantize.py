"""``moetool quantize``: its format options come from the format registry.

``--format NAME`` takes any format ``moetool.formats`` can write; each format adds its own
alias flags (``--fp8-block``, ``--int4``) and its parameters as options (int4-group:
``--group-size``, ``--symmetric/--asymmetric``). The command is built from the registry each
time it is looked up, so a format module in formats/ is all a new format needs.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from moetool.cli import command_app
from moetool.cli.options import DryRun, Force, MaxShardSize, Out, Quiet, Revision, Source, CONVERT_LAYOUTS, check_layout, parse_size
from moetool.convert import gpu_start
from moetool.errors import MoetoolError
from moetool.lazy import import_module
from moetool.read import code_files
from moetool.read.prefetch import prefetch

HELP = "Requantize routed-expert weights; everything else passes through bit-identical."


def _options(
    source: Source,
    out: Out,
    include_shared_experts: Annotated[bool, typer.Option("--include-shared-experts", help="quantize shared experts too")] = False,
    layout: Annotated[str, typer.Option("--layout", help="per-expert (what vLLM loads), stacked, or fused (the "
                                        "family's fused tensors: gpt-oss with --mxfp4 or dense)")] = "per-expert",
    device: Annotated[str, typer.Option("--device", help="cpu or cuda")] = "cpu",
    max_shard_size: MaxShardSize = None,
    dry_run: DryRun = False,
    force: Force = False,
    quiet: Quiet = False,
    revision: Revision = None,
) -> None:
    """The options of every format (the format's own go between ``out`` and these)."""


def quantize_app() -> typer.Typer:
    """A one-command Typer app: ``quantize`` with the options of the formats registered now."""
    _prefetch_source(sys.argv[1:])
    index = gpu_start.cuda_index(sys.argv[1:]) if "quantize" in sys.argv[1:] else None
    if index is not None:
        gpu_start.begin(index)  # beside torch's import, instead of after the plan
    registry = import_module("moetool.formats.registry")  # torch: the command converts anyway
    targets = registry.quantize_targets()
    FormatName = registry.name_enum([cls.name for cls in targets])  # the choices of --format
    given = inspect.signature(_options, eval_str=True).parameters
    names = [cls.name for cls in targets]
    listed = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    params = [given["source"], given["out"], _option(
        "format_name", Optional[FormatName], None, "--format", f"output weight format: {listed} (or its flag below)",
        metavar="NAME")]
    for cls in targets:
        params += [_option(_identifier(flag), bool, False, flag, cls.cli_help) for flag in cls.cli_flags]
    for cls in targets:
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        params += [_option(field, type(defaults[field]), defaults[field], p.flag, p.help)
                   for field, p in cls.cli_params.items()]
    params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for name, p in given.items()
               if name not in ("source", "out")]
    unique: dict[str, inspect.Parameter] = {}
    for p in params:
        unique.setdefault(p.name, p)  # a parameter two formats share: one option

    def quantize_cmd(**options) -> None:
        _run(registry, options)

    quantize_cmd.__signature__ = inspect.Signature(list(unique.values()))
    quantize_cmd.__doc__ = HELP
    app = command_app()
    app.command("quantize")(quantize_cmd)
    return app


def _prefetch_source(args: list[str]) -> None:
    """The command is built from the format registry, so torch is imported (4 s on an H100
    host) before its arguments are parsed: meanwhile the kernel reads the source, taken as the
    first checkpoint folder after ``quantize`` in the process's arguments (a hint only: the
    parsed arguments decide what is converted)."""
    if "quantize" not in args:
        return
    for arg in args[args.index("quantize") + 1:]:
        if not arg.startswith("-") and os.path.isdir(arg) and any(Path(arg).glob("*.safetensors")):
            # the imports' code first (bulk reads would starve its small reads); in a child
            # process, whose reads wait for no GIL that `import torch` holds
            prefetch(Path(arg), idle=True, after=code_files.warming(), in_child=True)
            return


def __getattr__(name: str):
    """``app``, built from the registry each time ``moetool.cli`` looks the command up."""
    if name == "app":
        return quantize_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _option(name: str, kind, default, flag: str, help_text: str, **option) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, typer.Option(flag, help=help_text, **option)])


def _identifier(flag: str) -> str:
    """"--fp8-block" -> "fp8_block"."""
    return flag.lstrip("-").replace("-", "_")


def _run(registry, options: dict) -> None:
    targets = registry.quantize_targets()
    name = options["format_name"]
    chosen = [name.value] if name is not None else []
    flags = [(cls.name, flag) for cls in targets for flag in cls.cli_flags]
    chosen += [fmt for fmt, flag in flags if options[_identifier(flag)]]
    if len(set(chosen)) != 1:
        if name is not None:
            others = ", ".join(flag for fmt, flag in flags if fmt in chosen and fmt != name.value)
            raise MoetoolError(f"--format {name.value} and {others} choose different formats")
        raise MoetoolError(f"choose exactly one of {', '.join(flag for _, flag in flags)}")
    check_layout(options["layout"], CONVERT_LAYOUTS)
    for cls in targets:
        for field, p in cls.cli_params.items():
            if p.positive and options[field] < 1:
                raise MoetoolError(f"{p.flag} {options[field]} must be positive")
    fmt = registry.FORMATS[chosen[0]]
    for cls in targets:  # another format's option given a value: it would be ignored
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for field, p in cls.cli_params.items():
            if field not in fmt.cli_params and options[field] != defaults[field]:
                owners = " and ".join(c.name for c in targets if field in c.cli_params)
                raise MoetoolError(f"{p.flag} is an option of {owners}, not of {fmt.name}")
    params = {field: options[field] for field in fmt.cli_params}
    quantize = import_module("moetool.convert.quantize").quantize

    result = quantize(options["source"], options["out"], fmt.name, **params, layout=options["layout"],
                      include_shared=options["include_shared_experts"],
                      max_shard_size=parse_size(options["max_shard_size"]), dry_run=options["dry_run"],
                      force=options["force"], progress=not options["quiet"], revision=options["revision"],
                      device=options["device"])
    typer.echo(result.describe() if options["dry_run"] else result.render())
