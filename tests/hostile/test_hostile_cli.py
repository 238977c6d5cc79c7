"""Hostile corpus, what a new user reads: the demo's commands can be re-run by hand, its files
kept or said to be gone, help texts shown whole, progress bars in the summaries' units, and
the source tree importable whatever kind of install put it on sys.path.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hostile import assert_complete, digest, moetool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    from moetool.demo.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("in") / "dsv3", "deepseek_v3", experts=8, layers=2)


# ------------------------------------------------------------------------------------- demo


@pytest.mark.slow
def test_demo_prints_commands_that_rerun_by_hand(tmp_path, cli):
    """`demo --workdir W --format int4` keeps its files in W and ends with the five commands
    it ran (the last the whole-model check), with their real paths and the group size it
    really used (quantize's default 128 does not divide the tiny model's K = 192): run again by
    hand, they work."""
    work = tmp_path / "demo work"  # a space: the printed paths must be quoted for a shell
    # as a user runs it on a CPU machine, without the Triton interpreter this suite sets for
    # tests/kernels and tests/verify: interpreted, the all2all kernels took 12 of its 19 CPU-s
    r = moetool("demo", "--workdir", work, "--format", "int4", timeout=180, extra_env={"TRITON_INTERPRET": "0"})
    assert r.code == 0, r.err
    assert "demo PASSED" in r.out and f"moetool demo: writing in {work} (kept)" in r.out
    assert r.out.splitlines()[-1] == f"the files are kept in {work}"
    assert sorted(p.name for p in work.iterdir()) == ["tiny-moe", "tiny-moe-int4-group", "tiny-moe-int4-group-ep4"]
    lines = r.out.splitlines()
    at = next(i for i, line in enumerate(lines) if "to re-run by hand" in line)
    commands = [shlex.split(line) for line in lines[at + 1:at + 6]]
    assert [c[:2] for c in commands] == [["moetool", "inspect"], ["moetool", "quantize"], ["moetool", "shard"],
                                         ["moetool", "verify"], ["moetool", "verify"]]
    inspect_, quantize, shard, verify, whole = commands
    assert inspect_[2] == str(work / "tiny-moe")
    assert quantize[2:] == [str(work / "tiny-moe"), str(work / "tiny-moe-int4-group"), "--format", "int4-group",
                            "--group-size", "64"]
    assert shard[2:] == [str(work / "tiny-moe-int4-group"), str(work / "tiny-moe-int4-group-ep4"), "--ep", "4"]
    assert verify[2:] == [str(work / "tiny-moe-int4-group-ep4"), "--ref", str(work / "tiny-moe"), "--dp", "2",
                          "--ep", "4", "--all2all", "all2all"]
    assert whole[2:] == verify[2:] + ["--whole-model", "--tokens", "128", "--seq-len", "32"]
    assert "PASSED: every layer and the logits within the thresholds of int4-group" in r.out
    assert_complete(work / "tiny-moe-int4-group")
    assert_complete(work / "tiny-moe-int4-group-ep4")

    for step, command in enumerate(commands, 1):  # the step lines run the same commands
        assert any(line.startswith(f"[{step}/5] ") and shlex.join(command) in line for line in lines), command
    # re-run through the same entry point in this process (the demo was the real one)
    assert cli(*inspect_[1:]).code == 0
    again = tmp_path / "again"
    r2 = cli("quantize", quantize[2], again, *quantize[4:], "--quiet")
    assert r2.code == 0, r2.err
    assert digest(again) == digest(work / "tiny-moe-int4-group")  # what the demo wrote, byte for byte


def test_demo_without_workdir_says_its_temporary_folder_is_gone(monkeypatch):
    """Without --workdir the files go to a temporary folder: the first line says so and how
    to keep them, the last that it is removed (the chain itself stubbed: one demo run in the
    suite is enough)."""
    import moetool.demo.chain as demo

    seen = {}

    def chain(root, echo, **kw):
        seen.update(root=root, existed=root.is_dir(), **kw)
        return True

    monkeypatch.setattr(demo, "_run", chain)
    lines = []
    assert demo.run_demo(echo=lines.append) is True
    root = seen["root"]
    assert seen["existed"] and not root.exists() and seen["fmt"] == "fp8-block"
    assert lines == [
        f"moetool demo: writing in the temporary folder {root} (removed at the end; --workdir DIR keeps the files)",
        f"the files were in a temporary folder, removed now ({root}): run `moetool demo --workdir DIR` to keep them",
    ]


def test_demo_refuses_a_workdir_of_other_files(tmp_path, cli):
    work = tmp_path / "w"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    before = digest(work)
    r = cli("demo", "--workdir", work)
    assert r.code == 2
    assert r.error_line == f"--workdir {work}: holds files the demo did not write (notes.txt); give it a new or empty folder"
    assert digest(work) == before and [p.name for p in work.iterdir()] == ["notes.txt"]


def test_demo_refuses_an_unknown_format(tmp_path, cli):
    from moetool.formats.registry import quantize_targets

    r = cli("demo", "--workdir", tmp_path / "w", "--format", "int8")
    names = ", ".join(cls.name for cls in quantize_targets())  # every format quantize writes
    assert names.startswith("fp8-block, fp8-channel, int4-group")
    assert r.code == 2 and r.error_line == f"--format 'int8': expected one of {names}"
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------ help texts


def _flat(text: str) -> str:
    """Text without whitespace and box-drawing characters (Rich's panels, wrapped lines)."""
    return re.sub(r"[\s\u2500-\u257f]+", "", text)


def test_help_texts_are_shown_whole():
    """Every command's description and every option's help appear in its --help as written:
    Rich reads `[tokens per expert]` as markup and drops it, so no help text may hold a
    square-bracketed word."""
    import typer.main
    from typer.testing import CliRunner

    from moetool.cli import COMMANDS, app

    group = typer.main.get_command(app)
    runner = CliRunner()
    checked = 0
    for name, command in [("", group), *((n, group.get_command(None, n)) for n in COMMANDS)]:
        shown = runner.invoke(app, [name, "--help"] if name else ["--help"]).output
        texts = [command.help or ""] + [p.help for p in command.params if getattr(p, "help", None)]
        for text in texts:
            assert _flat(text) in _flat(shown), f"`moetool {name} --help` loses part of: {text!r}"
            checked += 1
    assert "shard" in COMMANDS and checked > 50


# -------------------------------------------------------------------------- progress units


@pytest.mark.parametrize("command", ["shard", "quantize"])
def test_progress_bar_counts_in_the_summarys_units(src, tmp_path, capsys, command):
    """The bar's total is the summary's "GB out" in decimal units (MB = 1e6 bytes), not
    KiB/MiB: shard copies bytes (moetool.convert.byte_executor), quantize converts (moetool.convert.torch_executor)."""
    from tqdm import tqdm

    if command == "shard":
        from moetool.convert.shard import shard as run
        args = (2,)
    else:
        from moetool.convert.quantize import quantize as run
        args = ("fp8-block",)
    nbytes = run(src, tmp_path / "plan", *args, dry_run=True).nbytes
    summary = run(src, tmp_path / "out", *args, progress=True).render()
    bar = capsys.readouterr().err
    assert f"{nbytes / 1e9:.3f} GB out" in summary
    decimal, binary = tqdm.format_sizeof(nbytes), tqdm.format_sizeof(nbytes, divisor=1024)
    assert decimal != binary and f"/{decimal} " in bar and f"/{binary} " not in bar, bar


# ------------------------------------------------------------------------ source-tree import


def test_source_tree_imports_formats_and_kernels_without_an_editable_finder():
    """A legacy editable install (`setup.py develop`, or setuptools' editable_mode=compat) only
    puts the repo root on sys.path: moetool.formats and moetool.kernels, mapped from the
    top-level folders formats/ and kernels/, must still import, from those folders. Here: no
    site processing (-S, so no editable finder from a .pth), the root and site-packages set by hand."""
    import site

    path = [str(REPO), *site.getsitepackages()]
    code = (f"import sys; sys.path[:0] = {path!r}\n"
            "import moetool.formats.fp8_block, moetool.kernels.quant\n"
            "print(moetool.__file__); print(moetool.formats.fp8_block.__file__); print(moetool.kernels.quant.__file__)")
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=120,
                       cwd="/")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == [str(REPO / "moetool" / "__init__.py"), str(REPO / "formats" / "fp8_block.py"),
                                str(REPO / "kernels" / "quant.py")]
