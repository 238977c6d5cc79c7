"""``python -m moetool`` and the ``moetool`` command."""


def entry() -> None:
    """The moetool process. Importing torch, typer and the rest makes about 250,000 objects
    that live until exit and no garbage: the collector is off while they are made, and they are
    frozen out of its scans afterwards (otherwise it walks them again and again, about 0.15 s
    of each run).

    When the command has finished (or exited with a status), the process ends with ``os._exit``
    after flushing stdout and stderr: tearing the interpreter down with torch loaded (a last
    garbage collection, torch's operator-library finalizers) took 0.3-0.5 s of every run, and
    there is nothing left to do by then: every output file is fsync'd, renamed and closed, and
    rank processes are joined. An unexpected exception still ends the normal way (traceback)."""
    import gc
    import os
    import sys

    gc.disable()
    from moetool.cli import main

    gc.freeze()
    gc.enable()
    try:
        main()
        status = 0
    except SystemExit as done:
        status = done.code
    if status is not None and not isinstance(status, int):
        print(status, file=sys.stderr)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)


if __name__ == "__main__":
    entry()
