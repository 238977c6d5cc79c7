"""``python -m moetool`` and the ``moetool`` command."""
import atexit
import gc
import os
import sys

from moetool import lazy

#: commands whose process ends with os._exit once they have returned: every file they write
#: is fsync'd and renamed (or written and closed) before they return, they start no child
#: process and leave nothing for exit handlers. Interpreter shutdown after torch was imported
#: (module teardown, torch's static destructors) took 0.1-0.15 s of each `moetool quantize`
#: here. demo and verify spawn ranks through multiprocessing and exit normally.
FAST_EXIT_COMMANDS = frozenset({"quantize", "repack", "shard", "inspect"})


def entry() -> None:
    """The moetool process. Importing torch, typer and the rest makes about 250,000 objects
    that live until exit and no garbage: the collector is off while they are made, and they are
    frozen out of its scans afterwards (otherwise it walks them again and again, about 0.15 s
    of each run). ``lazy.import_module`` does both, for the CLI here and for what a command
    imports when it runs. At a normal exit they are handed back to the collector first:
    extension modules built with nanobind (Triton's) list every object of theirs still alive
    at their teardown, ~30 lines under a one-line error."""
    lazy.freeze_imports = True
    atexit.register(gc.unfreeze)
    main = lazy.import_module("moetool.cli").main
    main()
    if sys.argv[1:2] and sys.argv[1] in FAST_EXIT_COMMANDS:
        exit_now()


def exit_now() -> None:
    """Exit status 0 without interpreter shutdown, once stdout and stderr are flushed (a
    failed flush, such as a closed pipe, leaves the exit to the interpreter as usual)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(0)


if __name__ == "__main__":
    entry()
