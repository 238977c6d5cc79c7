"""The ``moetool`` command line: one thin module per subcommand over the library API.

Errors: a MoetoolError prints as one line ``error: ...`` with its exit status (2 for bad
input, 1 for a failed verification); an OSError (a file that cannot be read or written: no
permission, no space, a folder in the way) prints as one line naming the file, exit status 2;
set MOETOOL_TRACEBACK=1 for the full traceback.
"""
from __future__ import annotations

import os
import sys

import typer

from moetool.errors import MoetoolError

app = typer.Typer(
    name="moetool",
    help="Convert Mixture-of-Experts checkpoints (fp8 / int4, stacked, expert-parallel shards) and verify them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# registers the commands; each imports its library when it runs (only quantize, verify and a
# repack or shard that converts import torch: a byte-copy shard or repack starts in ~0.1 s)
from moetool.cli import demo, inspect, quantize, repack, shard, verify  # noqa: E402,F401


def main(argv: list[str] | None = None) -> None:
    from moetool.memory import bound_malloc

    bound_malloc()
    try:
        app(args=argv, prog_name="moetool", standalone_mode=False)
    except MoetoolError as err:
        if os.environ.get("MOETOOL_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted; outputs are left unfinished (re-run to resume)", file=sys.stderr)
        sys.exit(130)
    except OSError as err:
        if os.environ.get("MOETOOL_TRACEBACK"):
            raise
        print(f"error: {os_error_line(err)}", file=sys.stderr)
        sys.exit(2)
    except SystemExit:
        raise
    except Exception as err:  # click usage errors and the like
        usage, abort = _click_exceptions()
        if isinstance(err, usage):
            err.show()
            sys.exit(err.exit_code)
        if isinstance(err, abort):
            sys.exit(1)
        raise


def os_error_line(err: OSError) -> str:
    """'PATH: reason' (both paths of a rename), or the error's own text when it names no file."""
    if err.filename is None:
        return str(err)
    names = str(err.filename) + (f" -> {err.filename2}" if err.filename2 else "")
    return f"{names}: {err.strerror or err}"


def _click_exceptions() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(ClickException, Abort) classes: typer >= 0.2x vendors click as ``typer._click``,
    older typer uses the ``click`` package; accept whichever are importable."""
    usage: tuple[type, ...] = ()
    abort: tuple[type, ...] = (typer.Abort,)
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            mod = __import__(module, fromlist=["ClickException"])
        except ImportError:
            continue
        usage += (mod.ClickException,)
        abort += tuple(c for c in (getattr(mod, "Abort", None),) if c is not None)
    return usage, abort
