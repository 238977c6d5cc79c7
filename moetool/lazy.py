"""Libraries imported when a command needs them, not when the CLI starts.

``moetool shard`` / ``repack`` by byte copy never import torch; the commands that do import it
(and the formats, kernels, verify runtime) when they run. Importing torch makes ~250,000
objects that live until exit and are no garbage: as ``moetool.__main__`` does for start-up,
the collector is off while they are made and, in the ``moetool`` process (``freeze_imports``,
set by ``moetool.__main__``; a library caller's process is left alone), they are frozen out of
its scans afterwards (with the collector on, ``import torch`` took ~0.3-0.5 s longer here).
"""
from __future__ import annotations

import gc
import importlib
from types import ModuleType

#: gc.freeze() after each import (only the moetool process itself sets it)
freeze_imports = False


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with the garbage collector off (then ``gc.freeze()``
    where ``freeze_imports`` is set)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        if freeze_imports:
            gc.freeze()
        if enabled:
            gc.enable()
