"""The code files a command's last run imported, recorded and read into the page cache at the
next run's start (moetool.read.code_files)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moetool.read import code_files


@pytest.fixture
def code_list(tmp_path, monkeypatch):
    """A list of this test's own (the suite turns them off), and no warm-up started yet."""
    path = tmp_path / "cache" / "code-files.txt"
    monkeypatch.setenv(code_files.ENV, str(path))
    monkeypatch.setattr(code_files, "_warming", None)
    return path


def test_record_lists_touched_ranges_of_libraries_and_imported_modules_never_checkpoints(code_list, tmp_path):
    from safetensors.torch import save_file

    ckpt = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4096)}, str(ckpt))
    with safe_open(str(ckpt), "pt") as f:  # the checkpoint is mapped while the list is made
        f.get_tensor("w")
        code_files.record()
    listed = code_files.read_list(code_list)
    lib = next(f for f in listed if Path(f).name.startswith("libtorch_cpu.so"))  # mapped by import torch
    spans = listed[lib]
    size = os.path.getsize(lib)
    assert spans and 0 < sum(n for _, n in spans) < size  # the pages touched, not the whole library
    assert all(o % 4096 == 0 and o + n <= size + 4096 for o, n in spans)
    for module in (code_files, torch):  # modules whole: the files their imports read
        reads = code_files.import_reads(module.__file__, module.__cached__)
        assert reads and all(listed[f] is None for f in reads)
    assert str(ckpt) not in listed and not any(f.endswith(".safetensors") for f in listed)
    assert all(os.path.isabs(f) and os.path.isfile(f) for f in listed)
    assert not list(code_list.parent.glob("*.tmp"))


#: the opens an audit hook notes while a test imports (its first item a marker: on); an audit
#: hook cannot be removed, so one is added per process and stays quiet otherwise
_READS: list[str] = []
_HOOKED: list[bool] = []


def _note_opens(event: str, args: tuple) -> None:
    if _READS and event == "open" and isinstance(args[0], str) and "importable" in args[0]:
        _READS.append(args[0])


@pytest.mark.parametrize("bytecode", ["timestamp", "stale", "touched", "none", "checked-hash", "unchecked-hash",
                                      "unchecked-hash-always", "checked-hash-never", "foreign"])
def test_the_list_names_what_an_import_reads(tmp_path, bytecode, monkeypatch):
    """A module's source and bytecode are listed as the import system reads them (an audit hook
    on its opens is the judge): bytecode valid for the source alone (the source is only
    stat'ed), else the source, and both where both are read (a stale cache, one checked against
    the source's hash, or any hash under --check-hash-based-pycs always)."""
    import _imp
    import importlib.util
    import py_compile

    if not _HOOKED:
        sys.addaudithook(_note_opens)
        _HOOKED.append(True)
    source = tmp_path / f"importable_{bytecode.replace('-', '_')}.py"
    source.write_text("VALUE = 1\n")
    cached = Path(importlib.util.cache_from_source(str(source)))
    mode = bytecode.replace("-always", "").replace("-never", "")
    modes = {"checked-hash": py_compile.PycInvalidationMode.CHECKED_HASH,
             "unchecked-hash": py_compile.PycInvalidationMode.UNCHECKED_HASH}
    if bytecode != "none":
        py_compile.compile(str(source), str(cached), doraise=True,
                           invalidation_mode=modes.get(mode, py_compile.PycInvalidationMode.TIMESTAMP))
    if bytecode == "stale":
        source.write_text("VALUE = 22\n")  # another size: the cache no longer matches
    if bytecode == "touched":
        st = source.stat()
        os.utime(source, (st.st_atime, st.st_mtime + 5))  # the same size, another mtime
    for check in ("always", "never"):
        if bytecode.endswith(check):
            monkeypatch.setattr(_imp, "check_hash_based_pycs", check)  # as --check-hash-based-pycs does
    if bytecode == "foreign":
        cached.write_bytes(b"\0\0\0\0" + cached.read_bytes()[4:])  # another Python's magic number
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # the import must leave the files as they are
    spec = importlib.util.spec_from_file_location(source.stem, source)
    module = importlib.util.module_from_spec(spec)
    _READS[:] = ["(recording)"]
    try:
        spec.loader.exec_module(module)
    finally:
        read, _READS[:] = _READS[1:], []
    assert module.VALUE == (22 if bytecode == "stale" else 1)
    opened = {f for f in read if os.path.isfile(f)}  # an open is noted before it is tried: a cache missing
    assert sorted(code_files.import_reads(module.__file__, module.__cached__)) == sorted(opened), read


def test_record_never_asks_a_lazy_module_for_what_it_lacks(code_list, tmp_path, monkeypatch):
    """A lazy module (transformers', scipy's) imports whatever attribute it is asked for: record
    read its files from its namespace, not through getattr (which made a rank's end import
    scipy.stats and transformers' docstring machinery: 2.4-6.8 s on an H100 host)."""
    import types

    asked = []

    class Lazy(types.ModuleType):
        def __getattr__(self, name):
            asked.append(name)
            raise AttributeError(name)

    lazy = Lazy("moetool_test_lazy")
    lazy.__file__ = str(tmp_path / "lazy.py")
    (tmp_path / "lazy.py").write_text("")
    monkeypatch.setitem(sys.modules, "moetool_test_lazy", lazy)
    monkeypatch.setitem(sys.modules, "moetool_test_not_a_module", object())
    code_files.record()
    assert asked == []  # __cached__ was not asked for
    assert str(tmp_path / "lazy.py") in code_files.read_list(code_list)

def test_touched_ranges_follow_the_pages_a_process_reads(tmp_path):
    """A library mapped and read at two places: the ranges hold those pages (and what the
    kernel maps around a fault: 64 KiB of cached pages, or a whole large folio, 2 MiB here),
    not the pages between."""
    import mmap

    lib = tmp_path / "libtouched.so"
    lib.write_bytes(os.urandom(64 << 20))
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m[5 << 20], m[40 << 20]  # noqa: B018 - touch two pages
        spans = code_files.touched_ranges()[str(lib)]
    assert any(o <= 5 << 20 < o + n for o, n in spans) and any(o <= 40 << 20 < o + n for o, n in spans)
    assert sum(n for _, n in spans) <= 2 * (2 << 20) + 2 * code_files.RANGE_GAP
    assert not any(o <= 20 << 20 < o + n for o, n in spans)


def test_merge_ranges_joins_overlaps_and_near_neighbours():
    assert code_files.merge_ranges([(8192, 4096), (0, 4096), (4096, 4096)], gap=0) == [(0, 12288)]
    assert code_files.merge_ranges([(0, 4096), (10 << 20, 4096)], gap=1 << 20) == [(0, 4096), (10 << 20, 4096)]
    assert code_files.merge_ranges([(0, 4096), (100_000, 4096)], gap=1 << 20) == [(0, 104_096)]


def test_record_merges_with_the_list_and_drops_files_gone(code_list, tmp_path):
    kept, gone, lib = tmp_path / "kept.py", tmp_path / "gone.so", tmp_path / "libkept.so"
    kept.write_bytes(b"x")
    lib.write_bytes(b"y" * 100_000)
    code_list.parent.mkdir(parents=True)
    code_list.write_text(f"{kept}\n{gone}\n{lib}\t0+4096,65536+4096\nrelative/line.so\n\x00junk\n"
                         f"{tmp_path}/bad.so\t12+x\n{tmp_path}/neg.so\t-4+10\n")
    code_files.record()
    listed = code_files.read_list(code_list)
    assert list(listed)[:2] == [str(kept), str(lib)] and str(gone) not in listed
    assert listed[str(kept)] is None and listed[str(lib)] == [(0, 4096), (65536, 4096)]
    assert all(f.startswith("/") for f in listed)


def test_record_is_quiet_where_the_list_cannot_be_written(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(code_files.ENV, str(tmp_path / "a-file" / "list.txt"))  # its folder is a file
    code_files.record()  # no error: a hint only
    monkeypatch.setenv(code_files.ENV, "off")
    assert code_files.list_path() is None
    code_files.record()


def test_a_damaged_list_warms_nothing(code_list):
    code_list.parent.mkdir(parents=True)
    code_list.write_bytes(b"\xff\xfe binary \x00 garbage")
    assert code_files.read_list(code_list) == {}
    assert code_files.warm() is None


def test_warming_reads_every_regular_file_and_never_opens_a_fifo(tmp_path):
    """A FIFO or folder named in the list is skipped (opening a FIFO blocks until a writer
    comes: the warm-up would never end); a missing file too; a file over the budget is left;
    a library's ranges are read, clipped to its size."""
    files = {}
    for i, size in enumerate((3 << 20, 5000, 0, 70_000)):
        f = tmp_path / (f"lib{i}.so.1" if i % 2 else f"mod{i}.py")
        f.write_bytes(os.urandom(size))
        files[str(f)] = None
    lib = tmp_path / "libranges.so"
    lib.write_bytes(os.urandom(1 << 20))
    files[str(lib)] = [(0, 4096), (1 << 19, 8192), ((1 << 20) - 100, 4096), (2 << 20, 4096)]
    fifo = tmp_path / "pipe.so"
    os.mkfifo(fifo)
    files.update({str(fifo): None, str(tmp_path): None, str(tmp_path / "missing.py"): None})
    want = (3 << 20) + 5000 + 70_000 + 4096 + 8192 + 100
    warm = code_files.Warming(files, budget=1 << 30)
    assert warm.wait(timeout=30), "the warm-up did not end"
    assert warm.bytes_read == warm.total_bytes == want
    small = code_files.Warming(files, budget=100_000)  # the 3 MiB module does not fit
    assert small.wait(timeout=30) and small.bytes_read == want - (3 << 20)


def test_warm_starts_once_per_process_from_the_list(code_list, tmp_path):
    lib = tmp_path / "libx.so"
    lib.write_bytes(b"y" * 1000)
    code_list.parent.mkdir(parents=True)
    code_list.write_text(f"{lib}\n")
    assert code_files.warming() is None
    first = code_files.warm()
    assert first is not None and code_files.warm() is first and code_files.warming() is first
    # a child interpreter reads (its threads take no GIL of this process), in its own session
    # (a Ctrl-C at the terminal is not its to print)
    assert os.getpgid(first.pid) != os.getpgid(0)
    assert first.wait(timeout=60) and first.returncode == 0


def test_commands_that_import_torch_warm_first_and_record_at_their_end(tmp_path, monkeypatch):
    """verify (and quantize, demo) start the warm-up before their command module is imported
    (which imports torch), and record what the run imported when they end, failed or not;
    inspect does neither."""
    code = (
        "import json, sys\n"
        "from moetool.read import code_files\n"
        "seen = []\n"
        "code_files.warm = lambda: seen.append(('warm', 'torch' in sys.modules))\n"
        "code_files.record = lambda: seen.append(('record', 'torch' in sys.modules))\n"
        "from moetool.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit as e:\n"
        "    print(json.dumps({'seen': seen, 'code': e.code}))\n"
    )
    env = dict(os.environ, MOETOOL_RANK_START="spawn")  # no fork server: only the warm-up is looked at
    argv = ["verify", str(tmp_path / "none"), "--ref", str(tmp_path)]
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert r.stdout.strip().splitlines()[-1].startswith('{"seen": [["warm", false], ["record", true]], "code": 2'), r
    from moetool.cli import main

    seen = []
    monkeypatch.setattr(code_files, "warm", lambda: seen.append("warm"))
    monkeypatch.setattr(code_files, "record", lambda: seen.append("record"))
    with pytest.raises(SystemExit):
        main(["inspect", str(tmp_path / "none")])
    assert seen == []


def test_whole_model_reads_ahead_once_the_warm_up_is_done(monkeypatch):
    """With a warm-up under way the check thread's callback does nothing and the read-ahead
    waits on the warm-up alone (not on the check's imports); without one it is the callback."""
    from moetool.verify import whole_model

    started = threading.Event()

    def read_ahead():
        started.set()

    monkeypatch.setattr(code_files, "_warming", None)
    assert whole_model._after_imports(read_ahead) is read_ahead

    release = threading.Event()

    class Held:
        def wait(self, timeout=None):
            release.wait(30)
            return True

    monkeypatch.setattr(code_files, "_warming", Held())
    callback = whole_model._after_imports(read_ahead)
    assert callback is not read_ahead
    callback()
    time.sleep(0.2)
    assert not started.is_set()  # the warm-up is not done
    release.set()
    assert started.wait(10)


WATCHED = r'''
import json, os, sys
from pathlib import Path
from moetool.read import code_files
tmp = Path(sys.argv[1])
sys.path.insert(0, str(tmp))
import early_module  # imported before watch(), from its valid bytecode
code_files.watch()
Path(early_module.__file__).read_text()  # its source read again later (as a warning's line is)
import xml.dom.minidom  # noqa: F401 - a module this process had not imported
import watched_module  # noqa: F401 - its bytecode is valid
(tmp / "config.json").read_text()
(tmp / "written.txt").write_text("out")  # written: not code to warm
with open(tmp / "model.safetensors", "rb") as f:  # checkpoint data, read
    f.read()
os.listdir(tmp / "folder")
warm = code_files.Warming({str(tmp / "warmed.py"): None}, budget=1 << 20)  # its own opens are not the run's
warm.wait(30)
code_files.record()
'''


def test_watch_notes_what_a_process_opens_for_reading_and_lists_never_data_or_its_own_reads(code_list, tmp_path):
    import importlib.util
    import py_compile

    for name in ("config.json", "model.safetensors", "warmed.py"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "folder").mkdir()
    for name in ("early_module", "watched_module"):
        source = tmp_path / f"{name}.py"
        source.write_text("VALUE = 1\n")
        cached = Path(importlib.util.cache_from_source(str(source)))
        py_compile.compile(str(source), str(cached), doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)  # whatever SOURCE_DATE_EPOCH says
    early = Path(importlib.util.cache_from_source(str(tmp_path / "early_module.py")))
    r = subprocess.run([sys.executable, "-c", WATCHED, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **{code_files.ENV: str(code_list)}))
    assert r.returncode == 0, r.stderr
    listed = code_files.read_list(code_list)
    import xml.dom

    assert str(tmp_path / "config.json") in listed and f"{tmp_path / 'folder'}/" in listed
    assert any(f.startswith(os.path.dirname(xml.dom.__file__)) and "minidom" in f for f in listed)
    # a module with valid bytecode, imported after watch(): its bytecode alone (the source only stat'ed)
    assert [f for f in listed if "watched_module" in f] == [str(cached)]
    assert str(early) in listed  # still what its import read, though its source was opened since
    assert not any(Path(f.rstrip("/")).name in ("written.txt", "model.safetensors", "warmed.py") for f in listed)


def test_watch_is_off_with_the_list(monkeypatch):
    monkeypatch.setattr(code_files, "_watching", False)
    hooks = []
    monkeypatch.setattr(sys, "addaudithook", hooks.append)
    monkeypatch.setenv(code_files.ENV, "off")
    code_files.watch()
    assert hooks == [] and not code_files._watching


def test_warming_lists_the_folders_the_imports_list(tmp_path, monkeypatch):
    listed = []
    real = os.scandir
    monkeypatch.setattr(code_files.os, "scandir", lambda p: listed.append(p) or real(p))
    (tmp_path / "pkg").mkdir()
    warm = code_files.Warming({f"{tmp_path / 'pkg'}/": None, f"{tmp_path / 'gone'}/": None}, budget=0)
    assert warm.wait(30) and listed == [f"{tmp_path / 'pkg'}/", f"{tmp_path / 'gone'}/"]


def test_a_list_whose_code_is_in_memory_starts_no_warm_up(code_list, tmp_path):
    """On a warm machine the child would only cost CPU: a page of each of the largest
    libraries' touched ranges read without waiting answers whether the code is in memory."""
    lib = tmp_path / "libhot.so"
    lib.write_bytes(os.urandom(1 << 20))  # just written: in the page cache
    files = {str(lib): [(0, 1 << 20)]}
    if getattr(os, "RWF_NOWAIT", None) is None:
        pytest.skip("no RWF_NOWAIT here")
    assert code_files.looks_cached(files)
    code_list.parent.mkdir(parents=True)
    code_list.write_text(f"{lib}\t0+1048576\n")
    assert code_files.warm() is None  # nothing to read
    if _file_system(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("the page cache is the file here: it cannot be dropped")
    with open(lib, "rb") as f:  # out of the page cache (clean pages: the kernel drops them when asked)
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    assert not code_files.looks_cached(files)
    assert not code_files.looks_cached({str(tmp_path / "gone.so"): [(0, 4096)]})
    assert not code_files.looks_cached({str(tmp_path / "mod.py"): None})  # no library to ask about


def test_a_list_that_holds_the_run_already_is_not_rewritten(code_list, tmp_path, monkeypatch):
    lib, mod = tmp_path / "liba.so", tmp_path / "a.py"
    lib.write_bytes(b"x" * 8192)
    mod.write_text("")
    ran = {str(lib): [(0, 4096)], str(mod): None}
    monkeypatch.setattr(code_files, "current_files", lambda: dict(ran))
    code_files.record()
    code_list.write_text(code_list.read_text() + "/no/such/file.py\n")  # a rewrite would drop it
    code_files.record()  # nothing new
    assert "/no/such/file.py" in code_list.read_text()
    ran[str(lib)] = [(4096, 4096)]  # a range not in the list yet
    code_files.record()
    assert code_files.read_list(code_list) == {str(lib): [(0, 8192)], str(mod): None}


def test_writers_at_once_leave_a_whole_list(code_list, tmp_path, monkeypatch):
    """Several processes end at once (the parent and rank 0): each writes its own temporary
    file and renames it, so the list is always one writer's whole list, never a mix."""
    libs = [tmp_path / f"lib{i}.so" for i in range(4)]
    for lib in libs:
        lib.write_bytes(b"x" * 4096 * 61)
    local = threading.local()  # each record a longer range: every one writes
    monkeypatch.setattr(code_files, "current_files", lambda: {str(libs[local.i]): [(0, 4096 * (1 + local.n))]})
    seen = []

    def writer(i: int) -> None:
        local.i = i
        for n in range(60):
            local.n = n
            code_files.record()
            seen.append(code_files.read_list(code_list))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(listed and all(len(r) == 1 and r[0][0] == 0 and r[0][1] % 4096 == 0 for r in listed.values())
               for listed in seen)
    assert not list(code_list.parent.glob("*.tmp"))


def _file_system(path: Path) -> str:
    """The type of the file system ``path`` is on (/proc/mounts: the longest mount point above it)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind



def test_the_warm_up_queues_exactly_a_librarys_ranges_with_read_ahead_off(tmp_path, monkeypatch):
    """Each touched range is asked for at once (POSIX_FADV_WILLNEED, in pieces the kernel reads
    whole), on a descriptor whose read-ahead is off (POSIX_FADV_RANDOM: sequential reads of a
    range otherwise grow the window past its end), then read through: every byte counted."""
    from moetool.read import prefetch

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise here")
    lib = tmp_path / "libx.so"
    lib.write_bytes(os.urandom(3 << 20))
    ranges = [(0, 4096), (1 << 20, prefetch.ASK_STEP * 2 + 4096)]
    calls, real = [], os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        calls.append((offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    warm = code_files.Warming({str(lib): ranges}, budget=1 << 30)
    assert warm.wait(timeout=30) and warm.bytes_read == sum(n for _, n in ranges)
    step = prefetch.ASK_STEP
    assert calls == [(0, 0, os.POSIX_FADV_RANDOM), (0, 4096, os.POSIX_FADV_WILLNEED),
                     (1 << 20, step, os.POSIX_FADV_WILLNEED), ((1 << 20) + step, step, os.POSIX_FADV_WILLNEED),
                     ((1 << 20) + 2 * step, 4096, os.POSIX_FADV_WILLNEED)]


def test_a_checkpoint_read_ahead_keeps_the_kernels_read_ahead(tmp_path, monkeypatch):
    from moetool.read.prefetch import CacheFiller

    f = tmp_path / "x.safetensors"
    f.write_bytes(os.urandom(1 << 20))
    advised = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: advised.append(a), raising=False)
    filler = CacheFiller()
    try:
        assert filler.fill(f, 0, 1 << 20) == 1 << 20 and not advised
    finally:
        filler.close()
