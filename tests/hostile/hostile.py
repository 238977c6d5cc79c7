"""Helpers of the hostile corpus (tests/hostile): run moetool as a user would, in a real
process, and check the promise "the input is never modified; an output is complete or visibly
unfinished".

- ``moetool(*args)``: ``python -m moetool ARGS`` in a process of its own -> Run(code, out, err);
  ``start(*args)`` the same, not waited for (to signal it). Both start it from the warm Python
  of tests/warm_python.py (torch imported once) where they can.
- ``digest(path)``: {relative name: sha256} of every file under a folder (the input's state).
- ``assert_complete(out)``: manifest.json present, every listed file matches it, no temporary
  names (``*.incomplete``), no journal, nothing unlisted but the manifest itself.
- ``assert_unfinished(out)``: no manifest.json anywhere under ``out``.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import warm_python

from moeutil import CliResult as Run  # noqa: F401  code, out, err and the one error line
from moeutil import tree_hashes as digest  # noqa: F401  {relative name: sha256} of every file under a folder

#: files of ours that a complete output may hold beside the listed ones
OUTPUT_EXTRAS = {"manifest.json"}
TEMPORARY_SUFFIXES = (".incomplete",)


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    e.pop("MOETOOL_TRACEBACK", None)
    e.update(extra)
    return e


def argv(*args) -> list[str]:
    return [sys.executable, "-m", "moetool", *map(str, args)]


def moetool(*args, timeout: float = 120, extra_env: dict[str, str] | None = None, cwd=None) -> Run:
    p = warm_python.run(argv(*args), timeout=timeout, env=env(**(extra_env or {})), cwd=cwd)
    return Run(p.returncode, p.stdout, p.stderr)


def start(*args, extra_env: dict[str, str] | None = None, cwd=None) -> subprocess.Popen:
    """moetool ARGS started in its own session (so a test can signal it, and its group)."""
    return warm_python.Popen(argv(*args), env=env(**(extra_env or {})), cwd=cwd, start_new_session=True)


def temporary_names(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*")
                  if p.name.endswith(TEMPORARY_SUFFIXES))


def assert_complete(out: Path) -> dict:
    """The output folder is finished and exactly what its manifest says; returns the manifest."""
    out = Path(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert temporary_names(out) == [], f"temporary names in a complete output: {temporary_names(out)}"
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    listed = set(manifest["files"])
    assert files - listed <= OUTPUT_EXTRAS, f"unlisted files in a complete output: {sorted(files - listed - OUTPUT_EXTRAS)}"
    assert listed <= files, f"listed but missing: {sorted(listed - files)}"
    for name, rec in manifest["files"].items():
        data = (out / name).read_bytes()
        assert len(data) == rec["size"] and hashlib.sha256(data).hexdigest() == rec["sha256"], name
    return manifest


def assert_unfinished(out: Path) -> None:
    out = Path(out)
    if out.exists():
        found = sorted(str(p.relative_to(out)) for p in out.rglob("manifest.json"))
        assert not found, f"an unfinished output holds a manifest: {found}"
