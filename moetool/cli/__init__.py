"""The ``moetool`` command line: one thin module per subcommand over the library API.

Errors: a MoetoolError prints as one line ``error: ...`` with its exit status (2 for bad
input, 1 for a failed verification); set MOETOOL_TRACEBACK=1 for the full traceback.
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

from moetool.cli import demo, inspect, quantize, repack, shard, verify  # noqa: E402,F401  (registers commands)


def main(argv: list[str] | None = None) -> None:
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
    except SystemExit:
        raise
    except Exception as err:  # click usage errors and the like
        import click

        if isinstance(err, click.exceptions.ClickException):
            err.show()
            sys.exit(err.exit_code)
        if isinstance(err, click.exceptions.Abort):
            sys.exit(1)
        raise
