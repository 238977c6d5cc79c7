"""Tests only: the Triton interpreter, made cheaper to launch.

Every interpreted launch re-patches ``triton.language`` with the interpreter's builtins, and
finds them with ``inspect.getmembers`` over each module each time: ~20 % of the CPU time of
tests/kernels (triton 3.9). The builtins of a module do not change, so the list is found once
(in the unpatched state of the first launch) and the patching itself, and its undoing after the
launch, stay the interpreter's. A triton without these internals is left as it is.

Two more costs of the same kind, measured on tests/kernels (triton 3.9): a JIT function called
from a kernel patches the whole language again at every call, in every program of the grid, on
top of the launch's own patching (and never restores it: the launch's restore does); and
``_get_np_dtype`` builds its table of 19 numpy dtypes at each of its ~10^5 calls. The first is
skipped where the launch under way has patched the modules the function sees; the second is
looked up once per Triton dtype. Both give what the interpreter's own code gives.

And the interpreter's builder has ``sanitize_overflow`` on but ``debug`` off: every int32 add,
sub and mul is done once more in int64 with two comparisons for a ``device_assert`` that, with
``debug`` off, asserts nothing. That work (~30 % of tests/kernels' interpreter time) is skipped
where ``debug`` is off; the values computed are the same.
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
    _patch_once_per_launch(interpreter)
    _cache_np_dtypes(interpreter)
    _skip_unasserted_overflow_checks(interpreter)
    return True


def _skip_unasserted_overflow_checks(interpreter) -> None:
    """The shared builder's options with ``sanitize_overflow`` off where ``debug`` is off (its
    checks end in a ``device_assert`` that returns at once without ``debug``)."""
    import dataclasses

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or not dataclasses.is_dataclass(options) or getattr(options, "debug", True) \
            or not getattr(options, "sanitize_overflow", False):
        return
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


def _patch_once_per_launch(interpreter) -> None:
    """``_patch_lang(fn)`` is called by each launch (``GridExecutor.__call__``, which restores its
    scope when the grid is done) and by each device-function call (which drops its scope: what
    it patched stays until the launch restores the attributes). A call whose language modules
    are already patched in the launch under way gets an empty scope: the attributes it would set
    are the interpreter's already, bound to the same builder and semantic."""
    real = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    executor = getattr(interpreter, "GridExecutor", None)
    tl = getattr(interpreter, "tl", None)
    if real is None or scope_type is None or executor is None or tl is None \
            or not isinstance(getattr(scope_type(), "_changes", None), list):
        return
    launches: list[set] = []  # per launch under way, innermost last: the language modules patched
    starting = [False]  # a launch is about to patch

    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    class LaunchScope(scope_type):
        def restore(self) -> None:
            try:
                super().restore()
            finally:
                launches.pop()

    def patch_lang(fn):
        langs = langs_of(fn)
        if starting[0]:
            starting[0] = False
            scope = real(fn)
            launch = LaunchScope()
            launch._changes = scope._changes
            launches.append(set(langs))
            return launch
        if launches and langs <= launches[-1]:
            return scope_type()
        scope = real(fn)
        if launches:
            launches[-1] |= langs
        return scope

    real_call = executor.__call__

    def call(self, *args, **kwargs):
        starting[0] = True
        try:
            return real_call(self, *args, **kwargs)
        finally:
            starting[0] = False

    interpreter._patch_lang = patch_lang
    executor.__call__ = call


def _cache_np_dtypes(interpreter) -> None:
    """``_get_np_dtype(dtype)``, one table lookup: the numpy dtype depends only on the Triton
    element type (pointers: uint64)."""
    real = getattr(interpreter, "_get_np_dtype", None)
    tl = getattr(interpreter, "tl", None)
    if real is None or tl is None:
        return
    found: dict = {}

    def get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            key = "pointer"
        np_dtype = found.get(key)
        if np_dtype is None:
            np_dtype = found[key] = real(tt_dtype)
        return np_dtype

    interpreter._get_np_dtype = get_np_dtype
