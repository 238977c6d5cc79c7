"""Tests only: the Triton interpreter, made cheaper to launch.

Every interpreted launch re-patches ``triton.language`` with the interpreter's builtins, and
finds them with ``inspect.getmembers`` over each module each time: ~20 % of the CPU time of
tests/kernels (triton 3.9). The builtins of a module do not change, so the list is found once
(in the unpatched state of the first launch) and the patching itself, and its undoing after the
launch, stay the interpreter's. A triton without these internals is left as it is.
"""
from __future__ import annotations

import inspect
import os


def install() -> bool:
    """Cache the interpreter's builtin lists (only under TRITON_INTERPRET=1); True if done."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_attr, is_builtin = getattr(interpreter, "_patch_attr", None), getattr(interpreter.tl.core, "is_builtin", None)
    real = getattr(interpreter, "_patch_builtin", None)
    if patch_attr is None or is_builtin is None or real is None or getattr(real, "cached", False):
        return False
    found: dict[object, list] = {}  # module or class -> its (name, builtin) pairs

    def patch_builtin(pkg, builder, scope):
        builtins = found.get(pkg)
        if builtins is None:
            builtins = found[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if is_builtin(m)]
        for name, member in builtins:
            patch_attr(pkg, name, member, builder, scope)

    patch_builtin.cached = True
    interpreter._patch_builtin = patch_builtin
    return True
