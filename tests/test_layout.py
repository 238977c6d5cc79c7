"""The rules of the house (docs/dev.md), checked by walking every module's imports with ``ast``.

- no command module imports another: the CLI modules, and the convert entry points
  (quantize, repack, shard, merge), which share planning and ``moetool.convert.conversion``;
- planning does no I/O: ``moetool.convert.plan`` / ``planning`` import no executor, output
  folder, sink or torch, and open no file;
- reading never imports convert or verify; the model package imports only itself and errors;
- kernels import torch, triton, ``moetool.errors`` and each other only (never a format);
- every import names its module in the source: no ``import_module`` of an f-string or other
  computed name; a function-level import is of a heavy package only (torch, triton,
  huggingface_hub, tqdm, or our modules that load Triton), in a module that must load without it;
- the CLI imports no torch (a byte-copy shard starts in ~0.15 s).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"moetool": ROOT / "moetool", "moetool.formats": ROOT / "formats", "moetool.kernels": ROOT / "kernels"}
CLI_COMMANDS = {"inspect", "quantize", "repack", "shard", "verify", "demo"}
ENTRY_POINTS = {"quantize", "repack", "shard", "merge"}
#: what a module may import inside a function: heavy packages that light modules load on use
#: (moetool.kernels and the verify rank module load Triton; a verify run's parent never does)
LAZY_OK = ("torch", "triton", "huggingface_hub", "tqdm", "moetool.kernels", "moetool.verify.rank")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if package == "moetool" and parts[:1] in (["formats"], ["kernels"]):
                continue  # a source-tree link, not a module of its own
            found[name] = path
    return found


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """[(imported module, line, inside a function)] of one module (``from x import y`` gives
    ``x.y`` when that is a module of ours, else ``x``)."""
    tree = ast.parse(MODULES[module].read_text())
    out = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(module, child)
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub if sub in MODULES else base, child.lineno, in_function))
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # imports for annotations only
            visit(child, inside)

    visit(tree, False)
    return out


def _is_type_checking(test) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _violations(rule) -> list[str]:
    bad = []
    for module in MODULES:
        for imported, line, in_function in _imports(module):
            why = rule(module, imported, in_function)
            if why:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {imported}: {why}")
    return bad


def test_the_walk_sees_the_packages():
    assert {"moetool.cli.shard", "moetool.convert.planning", "moetool.read.checkpoint", "moetool.verify.driver",
            "moetool.formats.fp8_block", "moetool.kernels.quant"} <= set(MODULES)
    assert any(i == "moetool.convert.plan" for i, _, _ in _imports("moetool.convert.planning"))


def test_no_command_module_imports_another():
    def rule(module, imported, _):
        for group, names in (("moetool.cli", CLI_COMMANDS), ("moetool.convert", ENTRY_POINTS)):
            mine = module.rsplit(".", 1)
            theirs = imported.rsplit(".", 1)
            if (len(mine) == 2 and mine[0] == group and mine[1] in names and len(theirs) == 2
                    and theirs[0] == group and theirs[1] in names and theirs[1] != mine[1]):
                return "a command module imports another (share a library module instead)"
        return None

    assert _violations(rule) == []


def test_planning_does_no_io():
    io = ("moetool.convert.output", "moetool.convert.sink", "moetool.convert.byte_executor",
          "moetool.convert.torch_executor", "moetool.convert.conversion", "torch", "shutil")

    def rule(module, imported, _):
        if module in ("moetool.convert.plan", "moetool.convert.planning") and any(_under(imported, m) for m in io):
            return "planning must not write, convert or import torch"
        return None

    assert _violations(rule) == []
    for module in ("moetool.convert.plan", "moetool.convert.planning"):
        tree = ast.parse(MODULES[module].read_text())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "open" not in calls, f"{module} opens a file"


@pytest.mark.parametrize("package,forbidden", [
    ("moetool.read", ("moetool.convert", "moetool.verify", "moetool.cli", "moetool.demo")),
    ("moetool.model", ("moetool.read", "moetool.convert", "moetool.verify", "moetool.cli", "moetool.demo",
                       "moetool.formats", "moetool.kernels")),
    ("moetool.formats", ("moetool.read", "moetool.convert", "moetool.verify", "moetool.cli", "moetool.demo")),
    ("moetool.convert", ("moetool.verify", "moetool.cli", "moetool.demo")),
])
def test_layer_rules(package, forbidden):
    def rule(module, imported, _):
        if _under(module, package) and any(_under(imported, f) for f in forbidden):
            return f"{package} must not import {', '.join(forbidden)}"
        return None

    assert _violations(rule) == []


def test_kernels_are_a_leaf():
    allowed = ("torch", "triton", "moetool.errors", "moetool.kernels")

    def rule(module, imported, _):
        if not _under(module, "moetool.kernels"):
            return None
        top = imported.split(".")[0]
        if any(_under(imported, a) for a in allowed) or top in sys.stdlib_module_names:
            return None
        return "kernels import torch, triton and moetool.errors only"

    assert _violations(rule) == []


def test_function_level_imports_are_of_heavy_packages_only():
    def rule(module, imported, in_function):
        if in_function and not any(_under(imported, p) for p in LAZY_OK):
            return "import it at the top of the module (a function-level import hides the import graph)"
        return None

    assert _violations(rule) == []


def test_no_import_from_a_computed_name():
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        constants = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                     for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name not in ("import_module", "__import__") or not node.args:
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) or (isinstance(arg, ast.Name) and arg.id in constants):
                continue
            if module == "moetool.cli" and isinstance(arg, ast.Name):
                continue  # the command table: literal module names in moetool.cli.COMMANDS
            if module == "moetool.lazy":
                continue  # the wrapper itself
            if module == "moetool.formats.registry":
                continue  # imports every module of formats/ it finds: a format is one file, no list of names
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []


def test_the_cli_imports_no_torch():
    code = "import sys, moetool.cli, moetool.cli.shard, moetool.cli.repack; assert 'torch' not in sys.modules"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
