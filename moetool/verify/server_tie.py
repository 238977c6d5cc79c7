"""Imported first by the ranks' fork server: the server ends with the process that started it.

multiprocessing's server notices its parent is gone only once it serves, after its imports
(seconds: torch, transformers' modeling code): a verify stopped by Ctrl-C or killed while the
server still imported left it importing on, and holding the command's stderr, so a pipe such as
``moetool verify ... | tee log`` stayed open until it was done. Where the start came from the
main thread (:func:`moetool.verify.fork_server.start` names that process in ``PARENT_ENV``),
the kernel now kills the server when it ends (a start from another thread cannot ask that: the
signal follows the thread). The ranks forked from the server do not inherit the signal; they
tie themselves to the server (:mod:`moetool.verify.launch`).
"""
import os

from moetool.read.prefetch import end_with_parent
from moetool.verify.fork_server import PARENT_ENV


def _tie() -> None:
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None:
        return
    end_with_parent()
    if os.getppid() != int(parent):  # it ended before the death signal was set
        os._exit(0)


_tie()
