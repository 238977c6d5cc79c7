"""Run one moetool command with a fault injected into the writer; used by the hostile tests.

    python faults.py POINT K [READY] -- moetool-args...

POINT is where the process stops, at the K-th time (1-based) it gets there (for after-rename,
K may also be ``name:TEXT``: the first rename onto a path containing TEXT):
  after-rename     os.replace returned (a finished file, or the journal, has its final name)
  after-fsync      os.fsync returned (a file's bytes are durable, not yet renamed)
  before-journal   OutputDir._save_journal is about to run
  before-manifest  OutputDir.finish is about to write manifest.json
  pause            after the K-th committed file, create the file READY and wait (the test then
                   signals the process); the wait ends once the signal is being handled, as a
                   worker thread's real write would, so the clean-up is not held up
  signal-in-thread as pause, but the committing thread sends SIGTERM to itself (the kernel's
                   choice when it hands a process's signal to a worker thread, made certain);
                   if the main thread has not handled it 20 s later, exit with status 8
  count            no fault: print each os.replace destination to stderr as "replace NAME"
The fault is ``os._exit(9)``: no finally, no flush, no exit handler, as a kill -9.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waited too long asks where it hangs
    sep = sys.argv.index("--")
    point, k, *rest = sys.argv[1:sep]
    args = sys.argv[sep + 1:]
    name = k[len("name:"):] if k.startswith("name:") else None
    k = 0 if name else int(k)
    calls = [0]

    from moetool.convert import output as writer
    from moetool.cli import main as moetool_main

    def hit() -> bool:
        calls[0] += 1
        return calls[0] == k

    if point in ("after-rename", "count"):
        real_replace = os.replace

        def replace(src, dst, *a, **kw):
            real_replace(src, dst, *a, **kw)
            if point == "count":
                print(f"replace {dst}", file=sys.stderr)
            elif (name in str(dst)) if name else hit():
                os._exit(9)

        os.replace = replace
    elif point == "after-fsync":
        real_fsync = os.fsync

        def fsync(fd):
            real_fsync(fd)
            if hit():
                os._exit(9)

        os.fsync = fsync
    elif point in ("before-journal", "before-manifest"):
        name = "_save_journal" if point == "before-journal" else "finish"
        real = getattr(writer.OutputDir, name)

        def stop_first(self, *a, **kw):
            if hit():
                os._exit(9)
            return real(self, *a, **kw)

        setattr(writer.OutputDir, name, stop_first)
    elif point in ("pause", "signal-in-thread"):
        from moetool import errors

        real_commit = writer.OutputDir.commit
        real_interrupted = errors.Interrupted.__init__
        stopping = threading.Event()

        def interrupted(self, signum):
            stopping.set()
            real_interrupted(self, signum)

        def commit(self, *a, **kw):
            record = real_commit(self, *a, **kw)
            if hit():
                if point == "pause":
                    open(rest[0], "w").close()
                    stopping.wait(60)
                else:
                    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
                    if not stopping.wait(20):
                        print("faults.py: the main thread did not handle the signal in 20 s", file=sys.stderr)
                        os._exit(8)
            return record

        errors.Interrupted.__init__ = interrupted
        writer.OutputDir.commit = commit
    else:
        raise SystemExit(f"unknown fault point {point}")
    moetool_main(args)


if __name__ == "__main__":
    main()
