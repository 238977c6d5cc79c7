"""The command line as a user starts it: ``python -m moetool`` (output, exit status), the Typer
app through Typer's own test runner, and the start-up of a byte-copy command (no torch)."""
from __future__ import annotations

import json
import subprocess
import sys

from moetool.read.manifest import verify_manifest


def test_typer_cli_runner(hf_model):
    """The Typer app itself, through typer.testing.CliRunner (as Typer's docs test apps)."""
    from typer.testing import CliRunner

    from moetool.cli import app

    result = CliRunner().invoke(app, ["inspect", str(hf_model("olmoe").path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["architecture"] == "olmoe"


def test_entry_point_output_and_exit_status(tiny, tmp_path):
    """Through ``python -m moetool`` (the entry point, with its gc settings and its exit without
    interpreter shutdown): stdout arrives whole, a written output is complete (every file
    matches its manifest), and the status is the command's."""
    src = tiny("mixtral")
    p = subprocess.run([sys.executable, "-m", "moetool", "inspect", str(src), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["experts"] == 4
    out = tmp_path / "q"
    p = subprocess.run([sys.executable, "-m", "moetool", "quantize", str(src), str(out), "--int4", "-q"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (out / "manifest.json").exists() and not list(out.rglob("*.incomplete"))
    verify_manifest(out)
    assert "int4-group error over" in subprocess.run(
        [sys.executable, "-m", "moetool", "quantize", str(src), str(out), "--int4", "--force"],
        capture_output=True, text=True, timeout=120).stdout
    p = subprocess.run([sys.executable, "-m", "moetool", "quantize", str(src), str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--fp8-block" in p.stderr


def test_cli_does_not_import_torch(tiny, tmp_path):
    """``moetool shard`` / ``repack`` of a qualifying checkpoint never import torch (~1 s of start-up)."""
    src = tiny("mixtral")
    code = ("import sys\nfrom moetool.cli import main\n"
            f"main(['shard', {str(src)!r}, {str(tmp_path / 's')!r}, '--ep', '2', '-q'])\n"
            f"main(['repack', {str(src)!r}, {str(tmp_path / 'r')!r}, '--layout', 'stacked', '-q'])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    verify_manifest(tmp_path / "s")
    verify_manifest(tmp_path / "r")
