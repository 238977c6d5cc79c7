"""Hostile corpus, output side: nothing lost, nothing half-true.

Every case runs moetool in a real process and checks the exit status, the one error line, the
input (sha256 of every file before and after) and the output's state: no manifest.json unless
complete, and no temporary name in a complete output. Faults are injected by faults.py (an
``os._exit`` at a chosen step of the writer, or a pause to deliver a signal).
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_python
from hostile import argv, assert_complete, assert_unfinished, digest, env, moetool, temporary_names

from moetool.convert.output import FolderLock
from moetool.read.manifest import JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME

FAULTS = Path(__file__).with_name("faults.py")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    from moetool.demo.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("in") / "mixtral", "mixtral", hidden=256, intermediate=128,
                                experts=4, top_k=2, layers=2, shards=2)


@pytest.fixture(scope="module")
def clean(src, tmp_path_factory):
    """clean(command) -> the digest of an uninterrupted run's output (made once per command, in
    this process through the same entry point: the runs under test are the real processes)."""
    from moetool.cli import main

    root = tmp_path_factory.mktemp("clean")
    made: dict[str, dict] = {}

    def get(command: str) -> dict:
        if command not in made:
            out = root / command
            try:
                main([str(a) for a in COMMANDS[command](src, out)])
            except SystemExit as e:
                assert not e.code, f"{command} exited with {e.code}"
            assert_complete(out)
            made[command] = digest(out)
        return made[command]

    return get


COMMANDS = {
    "shard": lambda src, out: ("shard", src, out, "--ep", "2", "-q"),
    "quantize": lambda src, out: ("quantize", src, out, "--fp8-block", "-q"),
    "repack": lambda src, out: ("repack", src, out, "--layout", "stacked", "-q"),
}


def faulty(point: str, k, *args, ready: Path | None = None) -> list[str]:
    return [sys.executable, str(FAULTS), point, str(k), *([str(ready)] if ready else []), "--", *map(str, args)]


# ------------------------------------------------------------------------ crash and resume

CRASHES = [
    # shard is a byte copy whose model-common files of rank 1 are hard links to rank 0's
    ("shard", "before-journal", 1),  # before the journal that marks the folder ours
    ("shard", "after-fsync", 1),  # the first journal durable under its temporary name
    ("quantize", "after-fsync", 1),
    ("shard", "after-rename", 1),  # the first journal is in place, nothing else
    ("shard", "after-fsync", 2),  # a file durable under its temporary name
    ("shard", "after-rename", "name:rank-00000-of-00002/model-00002"),  # renamed, not journaled
    ("shard", "after-rename", "name:rank-00001-of-00002/model-common-00001"),  # a link renamed, not journaled
    ("shard", "before-journal", 4),
    ("shard", "after-rename", "name:config.json"),
    ("shard", "before-manifest", 1),
    ("quantize", "after-rename", "name:model-00001-of-00002.safetensors"),
    ("quantize", "before-manifest", 1),
]


@pytest.mark.parametrize("command,point,k", CRASHES, ids=[f"{c}-{p}-{k}" for c, p, k in CRASHES])
def test_crash_at_each_writer_step_resumes_to_the_same_bytes(src, clean, tmp_path, command, point, k):
    before = digest(src)
    out = tmp_path / "out"
    crashed = warm_python.run(faulty(point, k, *COMMANDS[command](src, out)), env=env())
    assert crashed.returncode == 9, crashed.stderr  # the fault was reached
    assert_unfinished(out)
    r = moetool(*COMMANDS[command](src, out))
    assert r.code == 0, r.err
    assert_complete(out)
    assert digest(out) == clean(command)  # byte for byte and name for name
    assert digest(src) == before


# ------------------------------------------------------------------------------- signals

SIGNALS = [("quantize", signal.SIGINT), ("quantize", signal.SIGTERM), ("shard", signal.SIGTERM),
           ("repack", signal.SIGINT)]


@pytest.mark.parametrize("command,sig", SIGNALS, ids=[f"{c}-{s.name}" for c, s in SIGNALS])
def test_signal_exits_with_its_status_and_resumes(src, clean, tmp_path, command, sig):
    before = digest(src)
    out, ready = tmp_path / "out", tmp_path / "ready"
    proc = warm_python.Popen(faulty("pause", 1, *COMMANDS[command](src, out), ready=ready), env=env())
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # faults.py dumps every thread's stack to stderr
        time.sleep(1)
        proc.kill()
        pytest.fail(f"{command} did not stop within 30 s of {sig.name}; its threads:\n{proc.communicate()[1]}")
    assert proc.returncode == 128 + sig, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["error: interrupted; an output folder without manifest.json is unfinished: re-run the same "
                     "command to resume it"], err
    assert_unfinished(out)
    assert (out / JOURNAL_NAME).exists()  # resumable
    r = moetool(*COMMANDS[command](src, out))
    assert r.code == 0 and "resumed" in r.out and " 0 resumed" not in r.out, r.out + r.err
    assert digest(out) == clean(command)
    assert digest(src) == before


@pytest.mark.parametrize("command", ["shard", "quantize"])
def test_a_signal_caught_by_a_worker_thread_still_stops_the_command_at_once(src, clean, tmp_path, command):
    """The kernel may hand SIGTERM to any thread; Python runs the handler in the main thread
    only, which, asleep waiting for that very worker, was not woken (CI saw shard sit 30 s).
    Here the committing worker thread takes the signal itself and waits for the interrupt."""
    out = tmp_path / "out"
    r = warm_python.run(faulty("signal-in-thread", 1, *COMMANDS[command](src, out)), env=env(), timeout=120)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr  # 8: the worker gave up waiting for the handler
    assert r.stderr.strip().splitlines()[-1].startswith("error: interrupted"), r.stderr
    assert_unfinished(out)
    assert moetool(*COMMANDS[command](src, out)).code == 0
    assert digest(out) == clean(command)


# ------------------------------------------------------------------- whose folder it is


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory) -> Path:
    from moetool.demo.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("other") / "qwen3", "qwen3_moe", hidden=128, intermediate=64,
                                experts=4, top_k=2, layers=1, shards=1)


@pytest.mark.parametrize("command", ["quantize", "shard"])
def test_folder_of_someone_elses_files_is_refused(src, other_checkpoint, tmp_path, command):
    out = tmp_path / "out"
    shutil.copytree(other_checkpoint, out)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # not ours: no manifest of ours, no journal
    before_in, before_out = digest(src), digest(out)
    r = moetool(*COMMANDS[command](src, out))
    assert r.code == 2
    assert r.error_line.startswith(f"{out}: is not empty and holds no unfinished moetool output (found config.json")
    assert "--force" in r.error_line
    assert digest(out) == before_out and digest(src) == before_in
    # --force writes into it (replacing files of our names, leaving the others)
    r = moetool(*COMMANDS[command](src, out), "--force")
    assert r.code == 0, r.err
    assert temporary_names(out) == [] and not (out / LOCK_NAME).exists()
    assert digest(src) == before_in


def test_another_plans_unfinished_output_is_refused(src, tmp_path):
    out = tmp_path / "out"
    crashed = warm_python.run(faulty("before-manifest", 1, *COMMANDS["quantize"](src, out)), env=env())
    assert crashed.returncode == 9
    before = digest(out)
    r = moetool("quantize", src, out, "--int4", "--group-size", "64", "-q")
    assert r.code == 2 and "holds the unfinished output of another moetool run" in r.error_line
    assert digest(out) == before


def test_empty_folder_and_a_stale_lock_are_fine(src, clean, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / LOCK_NAME).write_text(f"{dead.pid}\n")  # its writer died: no flock is held on it
    r = moetool(*COMMANDS["shard"](src, out))
    assert r.code == 0, r.err
    assert not (out / LOCK_NAME).exists()
    assert digest(out) == clean("shard")


def test_a_second_writer_fails_at_once_naming_the_first(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lock = FolderLock(out)  # this test process is the first writer
    lock.write_owner()
    try:
        t0 = time.monotonic()
        r = moetool(*COMMANDS["quantize"](src, out))
        assert r.code == 2
        assert r.error_line == f"{out} is being written by process {os.getpid()} (another moetool run); wait for it or stop it"
        assert time.monotonic() - t0 < 30  # no waiting for the lock
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    finally:
        lock.release()


def test_two_runs_into_one_folder_leave_one_consistent_output(src, tmp_path):
    """Two real processes, other formats, started together: one writes the folder, the other
    is refused (being written, or already complete); the result is one format, all of it."""
    out = tmp_path / "out"
    procs = [warm_python.Popen(argv(*args), env=env())
             for args in (("quantize", src, out, "--fp8-block", "-q"), ("quantize", src, out, "--fp8-channel", "-q"))]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "is being written by process" in loser or "already holds a complete output" in loser
    manifest = assert_complete(out)
    cfg = json.loads((out / "config.json").read_text())
    winner = "fp8-block" if results[0][0] == 0 else "fp8-channel"
    assert manifest["format"] == winner
    assert ("weight_block_size" in cfg["quantization_config"]) == (winner == "fp8-block")
    assert moetool("inspect", out).code == 0


# ---------------------------------------------------------------------------- full disk


def test_a_failed_write_names_the_file_and_leaves_the_output_unfinished(src, tmp_path):
    """A file-size limit makes a write fail as a full disk does (EFBIG instead of ENOSPC):
    one line naming the file being written, exit 2, no manifest; the re-run resumes."""
    out = tmp_path / "out"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    p = subprocess.run(argv(*COMMANDS["shard"](src, out)), env=env(), capture_output=True, text=True,
                       preexec_fn=limit)
    assert p.returncode == 2, p.stderr
    line = p.stderr.strip()
    assert line.startswith(f"error: {out}/") and ".safetensors.incomplete: File too large" in line, line
    assert_unfinished(out)
    assert moetool(*COMMANDS["shard"](src, out)).code == 0
    assert_complete(out)


# ------------------------------------------------------------------- values seen late


def test_nan_found_while_converting_names_the_tensor_and_leaves_the_output_unfinished(src, tmp_path):
    """Values are read only while converting (the README says so): the error names the tensor,
    the input is intact, the output has no manifest; once the input is mended, --force
    replaces the unfinished output of the earlier (other-input) run."""
    from moeutil import file_of, rewrite_file

    bad = tmp_path / "in"
    shutil.copytree(src, bad)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite_file(file_of(bad, name), lambda t: t[name].__setitem__((3, 5), float("nan")))
    before = digest(bad)
    out = tmp_path / "out"
    r = moetool("quantize", bad, out, "--fp8-block", "-q")
    assert r.code == 2 and r.error_line.startswith(f"{name}: contains NaN/Inf"), r.err
    assert digest(bad) == before
    assert_unfinished(out)
    rewrite_file(file_of(bad, name), lambda t: t[name].__setitem__((3, 5), 0.5))
    r = moetool("quantize", bad, out, "--fp8-block", "-q")
    assert r.code == 2 and "another moetool run" in r.error_line
    assert moetool("quantize", bad, out, "--fp8-block", "-q", "--force").code == 0
    assert_complete(out)


def test_crash_between_the_manifest_and_its_clean_up_leaves_a_clean_complete_output(src, clean, tmp_path):
    """The manifest is in place, the journal and lock file not yet removed: the output is
    complete; a re-run says so and removes them."""
    out = tmp_path / "out"
    crashed = warm_python.run(faulty("after-rename", "name:manifest.json", *COMMANDS["shard"](src, out)), env=env())
    assert crashed.returncode == 9
    r = moetool(*COMMANDS["shard"](src, out))
    assert r.code == 2 and "already holds a complete output" in r.error_line
    assert_complete(out)
    assert digest(out) == clean("shard")


def test_force_stopped_while_deleting_the_old_output_is_never_complete(src, clean, tmp_path):
    """--force over a complete output first turns its manifest into a journal: stopped then,
    the folder is an unfinished output (refused without --force, finished with it)."""
    out = tmp_path / "out"
    assert moetool(*COMMANDS["shard"](src, out)).code == 0
    crashed = warm_python.run(faulty("after-rename", 1, *COMMANDS["shard"](src, out), "--force"), env=env())
    assert crashed.returncode == 9
    assert_unfinished(out)
    r = moetool(*COMMANDS["shard"](src, out))
    assert r.code == 2 and "holds the unfinished output of another moetool run" in r.error_line
    assert moetool(*COMMANDS["shard"](src, out), "--force").code == 0
    assert digest(out) == clean("shard")


def test_force_leaves_files_that_are_not_moetools(src, tmp_path):
    """A manifest.json that moetool did not write lists nothing moetool may delete, nor does
    a symbolic link lead it outside the folder; a temporary name of another program stays."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "important.txt").write_text("keep")
    (out / "data").symlink_to(elsewhere)
    (out / "notes.txt").write_text("mine")
    (out / "manifest.json").write_text(json.dumps({"tool": "other", "files": {"notes.txt": {}, "data/important.txt": {}}}))
    (out / "download.bin.incomplete").write_text("partial")
    r = moetool(*COMMANDS["quantize"](src, out), "--force")
    assert r.code == 0, r.err
    assert (out / "notes.txt").read_text() == "mine" and (elsewhere / "important.txt").read_text() == "keep"
    assert (out / "download.bin.incomplete").exists()


def test_a_link_inside_the_output_to_the_input_is_not_written_through(src, cli, tmp_path):
    """An output whose rank folder is a symbolic link to the input: --force must not write
    the rank's files through it (it overwrote the input with rank 0's files)."""
    inp, out = tmp_path / "in", tmp_path / "out"
    shutil.copytree(src, inp)
    before = digest(inp)
    out.mkdir()
    (out / "rank-00000-of-00002").symlink_to(inp)
    r = cli(*COMMANDS["shard"](inp, out), "--force")
    assert r.code == 2 and r.error_line == (f"{out}/rank-00000-of-00002: is a link (to {inp}); moetool writes only "
                                            "into real folders (remove it, or choose another output folder)"), r.err
    assert digest(inp) == before
    assert_unfinished(out)


def test_the_input_under_another_path_is_not_the_output(src, cli, tmp_path):
    """The input folder bind-mounted as the output folder (another path, the same folder):
    refused like the input itself, --force or not."""
    inp, out = tmp_path / "in", tmp_path / "out"
    shutil.copytree(src, inp)
    out.mkdir()
    if subprocess.run(["mount", "--bind", str(inp), str(out)], capture_output=True).returncode != 0:
        pytest.skip("no bind mount here (needs root)")
    try:
        before = digest(inp)
        for force in ([], ["--force"]):
            r = cli(*COMMANDS["quantize"](inp, out), *force)
            assert r.code == 2 and r.error_line == f"output {out} is inside the input {inp}; the input folder is never written"
        assert digest(inp) == before
    finally:
        subprocess.run(["umount", str(out)], check=True)


def test_force_over_another_plans_crash_leaves_no_temporary_name(src, tmp_path):
    out = tmp_path / "out"
    crashed = warm_python.run(faulty("after-fsync", 3, "shard", src, out, "--ep", "4", "-q"), env=env())
    assert crashed.returncode == 9
    r = moetool(*COMMANDS["shard"](src, out), "--force")  # --ep 2
    assert r.code == 0, r.err
    assert temporary_names(out) == []
    assert_complete(out)


def test_an_error_after_tritons_import_is_one_line(src, tmp_path):
    """The moetool process keeps its imports out of the garbage collector; at an exit through
    the interpreter's shutdown (an error), Triton's bindings then found their objects alive and
    printed ~30 lines of "nanobind: leaked ..." under the error. ``--device cuda`` imports
    Triton from the command's first instant: without CUDA it is refused, with CUDA a NaN
    stops the conversion."""
    import torch

    expected = "--device cuda: no CUDA device is available"
    if torch.cuda.is_available():
        from moeutil import file_of, rewrite_file

        name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
        src = shutil.copytree(src, tmp_path / "in")
        rewrite_file(file_of(src, name), lambda t: t[name].__setitem__((3, 5), float("nan")))
        expected = f"{name}: contains NaN/Inf"
    r = moetool("quantize", src, tmp_path / "out", "--fp8-block", "--device", "cuda", "-q")
    assert r.code == 2 and r.error_line.startswith(expected), r.err
