"""The ``moetool`` command line: one thin module per subcommand over the library API,
imported through the lazy command table ``COMMANDS`` when the command runs.

Errors: a MoetoolError prints as one line ``error: ...`` with its exit status (2 for bad
input, 1 for a failed verification); SIGINT / SIGTERM print ``error: interrupted`` and exit
with 130 / 143, a writing command's output left unfinished and resumable (the line says so);
an OSError (a file that cannot be read or written: no permission, no space, a folder in the
way) prints as one line naming the file, exit status 2; set MOETOOL_TRACEBACK=1 for the full
traceback.
"""
from __future__ import annotations

import os
import signal
import sys

import typer
from typer.core import TyperCommand, TyperGroup

from moetool.cli.signals import catch_stop_signals
from moetool.errors import Interrupted, MoetoolError
from moetool.lazy import import_module
from moetool.memory import bound_malloc
from moetool.read import code_files

#: every command: the module that defines it (imported only when the command runs or shows its
#: own --help, so a byte-copy shard or repack never imports torch: ~0.15 s of start-up) and the
#: line `moetool --help` shows for it
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": ("moetool.cli.inspect", "What is in a checkpoint: architecture, MoE layers, experts, dims, format, bytes."),
    "quantize": ("moetool.cli.quantize", "Requantize routed experts (fp8 block, fp8 per-channel, int4 group)."),
    "repack": ("moetool.cli.repack", "Per-expert <-> stacked w13 / w2, bit-identical, in any format."),
    "shard": ("moetool.cli.shard", "Split experts over EP ranks: one folder per rank plus a manifest (or --merge)."),
    "verify": ("moetool.cli.verify", "Run EP shards through dispatch -> experts -> combine against the reference."),
    "demo": ("moetool.cli.demo", "Quantize, shard and verify a built-in tiny model on CPU processes."),
}


class LazyCommands(TyperGroup):
    """The root command group: a command's module is imported when the command is looked up;
    the root's --help lists the commands from :data:`COMMANDS` without importing any."""

    _listing = False

    def list_commands(self, ctx) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx, name: str):
        if name not in COMMANDS:
            return None
        module, short_help = COMMANDS[name]
        if self._listing:
            return TyperCommand(name, help=short_help, short_help=short_help)
        return typer.main.get_command(import_module(module).app)

    def format_help(self, ctx, formatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    name="moetool",
    cls=LazyCommands,
    help="Convert Mixture-of-Experts checkpoints (fp8 / int4, stacked, expert-parallel shards) and verify them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Convert Mixture-of-Experts checkpoints (fp8 / int4, stacked, expert-parallel shards) and verify them."""


def command_app() -> typer.Typer:
    """The one-command Typer app a command module defines its command on."""
    return typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def main(argv: list[str] | None = None) -> None:
    """Run one command; a failure ends the process through ``sys.exit`` with its status:
    2 bad input or I/O error, 1 failed verification, 130 SIGINT, 143 SIGTERM."""
    bound_malloc()
    restore_signals = catch_stop_signals()
    command = _command(sys.argv[1:] if argv is None else argv)
    if command in CODE_WARMED_COMMANDS:
        code_files.watch()  # what the command's imports open: the next run's warm-up
        code_files.warm()  # before the command's imports: they find their files in memory
    try:
        status = app(args=argv, prog_name="moetool", standalone_mode=False)
    except MoetoolError as err:
        if os.environ.get("MOETOOL_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except (Interrupted, KeyboardInterrupt) as err:
        _interrupted(err.exit_code if isinstance(err, Interrupted) else 128 + signal.SIGINT, command)
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
    finally:
        restore_signals()
        if command in CODE_WARMED_COMMANDS:
            code_files.record()  # what this run imported: the next run's warm-up
    # typer hands back the status of a typer.Exit instead of raising it (standalone_mode=False),
    # 130 for a KeyboardInterrupt it caught itself
    if isinstance(status, int) and status:
        if status == 128 + signal.SIGINT:
            _interrupted(status, command)
        sys.exit(status)


#: the commands that write an output folder (journaled: a re-run resumes it)
WRITING_COMMANDS = ("quantize", "shard", "repack")
#: the commands that import torch before reading a checkpoint: their code files are read into
#: the page cache first thing (:mod:`moetool.read.code_files`)
CODE_WARMED_COMMANDS = ("quantize", "verify", "demo")


def _command(args: list[str]) -> str | None:
    """The command a command line runs: its first argument that is not an option."""
    return next((a for a in args if not a.startswith("-")), None)


def _interrupted(status: int, command: str | None) -> None:
    """``error: interrupted``, with how to resume where the command writes an output folder
    (verify and inspect write none: the hint would send the user looking for one)."""
    hint = ("; an output folder without manifest.json is unfinished: re-run the same command to resume it"
            if command in WRITING_COMMANDS else "")
    print(f"error: interrupted{hint}", file=sys.stderr)
    sys.exit(status)


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
