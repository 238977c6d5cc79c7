"""Options shared by several subcommands (Annotated aliases) and their parsing."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from moetool.errors import MoetoolError

Source = Annotated[str, typer.Argument(help="checkpoint folder or Hugging Face Hub repo id", show_default=False)]
Out = Annotated[Path, typer.Argument(help="output folder (written atomically; a re-run resumes)", show_default=False)]
Revision = Annotated[Optional[str], typer.Option("--revision", help="Hub revision (branch, tag or commit)")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="print the plan and write nothing")]
Force = Annotated[bool, typer.Option("--force", help="write into a folder holding a complete output, another "
                                     "run's unfinished one, or other files (ours are replaced, others left)")]
MaxShardSize = Annotated[Optional[str], typer.Option("--max-shard-size", help="e.g. 5GB, 500MB (default: like the input)")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="no progress bar")]
Json = Annotated[bool, typer.Option("--json", help="machine-readable output")]

LAYOUTS = ("per-expert", "stacked")
#: quantize and repack also write the family's fused tensors (transformers' names; gpt-oss's
#: release layout in mxfp4), what vLLM and transformers load for gpt-oss
CONVERT_LAYOUTS = (*LAYOUTS, "fused")


def check_layout(layout: str, allowed: tuple[str, ...] = LAYOUTS) -> str:
    if layout not in allowed:
        raise MoetoolError(f"--layout {layout!r}: expected {', '.join(allowed[:-1])} or {allowed[-1]}")
    return layout


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | None) -> int | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise MoetoolError(f"--max-shard-size {text!r}: expected a size such as 5GB or 500MiB")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise MoetoolError(f"--max-shard-size {text!r} must be positive")
    return size
