"""Shared fixtures: the CLI runner and tiny checkpoints made once per session.

Every checkpoint here is made on the fly (transformers ``save_pretrained`` or our own
``moetool.demo.tiny`` writer); nothing is downloaded. Tests that modify a checkpoint copy it first
(``copy_ckpt``); the session ones are treated as read-only.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/moeutil.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The tensors are tiny and pytest-xdist runs a worker per core: torch's intra-op threads only
# contend for the cores and spin while they wait (two workers of two threads on 2 cores: ~25 %
# more CPU time than of one). One thread, read when torch is imported, here and in every process
# a test starts (the command-line runs, the benchmark scripts; CPU ranks take one anyway)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The commands' warm-up of the code their last run imported (moetool.read.code_files) would
# read and write the user's cache folder: off, but in the tests of it, which name their own list
os.environ["MOETOOL_CODE_LIST"] = "off"

@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which registers "dsession" in its controller
def pytest_configure(config):
    """Set up a process that runs tests: a pytest-xdist worker, or a run without it. The
    controller only hands the tests out: importing torch and transformers there took ~5 s of
    the 2-core machine before the workers even started."""
    if not config.pluginmanager.has_plugin("dsession"):
        _set_up_test_process()


def _set_up_test_process() -> None:
    # Triton reads TRITON_INTERPRET when it is first imported, and collecting tests/bench imports
    # it (moetool.kernels) before tests/kernels/conftest.py can set it under a plain `pytest`;
    # set it here, before any test module is collected, as that one does
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import interpreter_speed

    interpreter_speed.install()
    _preload_every_world_s_modules()


def _preload_every_world_s_modules() -> None:
    """A test process's worlds all start from one fork server, which imports what its first
    start asked for (``fork_server.start``: a world's, or an in-process verify or demo
    command's): a later world of another kind had each of its ranks import transformers'
    modeling code again (~1 CPU-s a rank). Here the server imports what any world of the
    suite imports, whichever starts it, and ``rank_steps``: its ranks run the EP steps' torch
    references unless a world asks for the interpreted kernels (tests/rank_steps.py)."""
    from moetool.verify import driver, fork_server, whole_model

    modules = tuple(dict.fromkeys(("verify_workers", "rank_steps", *driver.RANK_MODULES, *whole_model.RANK_MODULES)))
    real = fork_server.start
    fork_server.start = lambda preload=(): real(modules)


#: the files that keep a worker longest (spawned ranks, Triton-interpreted matrices, fsync'd
#: outputs: 10 to 40 s each on 2 cores), longest first. pytest-xdist hands out one file at a
#: time in collection order (--dist=loadfile --no-loadscope-reorder, pyproject.toml): started
#: first, they run beside each other and the short files fill the end of the run, instead of
#: one long file running alone at the end while the other workers wait. The rest keep their order.
LONGEST_FIRST = (
    "tests/kernels/test_kernels_fused_moe.py",
    "tests/hostile/test_hostile_output.py",
    "tests/verify/test_verify_dispatch.py",
    "tests/hostile/test_hostile_cli.py",
    "tests/verify/test_verify_e2e.py",
    "tests/verify/test_verify_whole_model.py",
    "tests/cli/test_cli_verify.py",
    "tests/kernels/test_kernels_ep_dispatch.py",
    "tests/bench/test_bench_scripts.py",
    "tests/verify/test_verify_gpt_oss.py",
    "tests/kernels/test_kernels_splitk.py",
    "tests/kernels/test_kernels_swap_ab.py",
    "tests/verify/test_verify_streaming.py",
    "tests/convert/test_convert_layouts.py",
    "tests/kernels/test_kernels_int4_quant.py",
    "tests/convert/test_convert_quantize.py",
    "tests/hostile/test_hostile_orphans.py",
    "tests/convert/test_convert_shard.py",
    "tests/verify/test_verify_launch.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable: files stay whole


@pytest.fixture
def cli(capsys):
    """cli("inspect", path, "--json") -> CliResult(code, out, err), through moetool.cli.main."""
    from moeutil import run_cli

    return lambda *args: run_cli(capsys, *args)


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory):
    """hf_model(family, layout="original" | "v5", **config overrides) -> HFModel saved by
    transformers in that layout (made once per session and arguments)."""
    pytest.importorskip("transformers")
    from moeutil import save_hf_model

    cache: dict = {}
    root = tmp_path_factory.mktemp("hf")

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            name = family + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
            cache[key] = save_hf_model(family, root / name, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(family, **make_tiny_checkpoint kwargs) -> Path, made once per session and arguments.

    Defaults: 2 layers (3 for DeepSeek: the first is dense), 4 experts (8 for DeepSeek, whose
    routers use 4 groups), hidden 256, intermediate 128, top-2, bf16, 2 shards."""
    from moetool.demo.tiny import make_tiny_checkpoint

    cache: dict = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(family: str = "mixtral", **kw):
        deepseek = family.startswith("deepseek")
        args = dict(hidden=256, intermediate=128, experts=8 if deepseek else 4, top_k=1 if family == "llama4" else 2,
                    layers=3 if deepseek else 2, shards=2)
        args.update(kw)
        key = (family, tuple(sorted((k, str(v)) for k, v in args.items())))
        if key not in cache:
            path = root / f"{family}-{len(cache)}"
            cache[key] = make_tiny_checkpoint(path, family, **args)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def verify_chain(tmp_path_factory):
    """(model, {format: quantized checkpoint}) that ``moetool verify`` is run on (tests/verify,
    tests/cli), made once per session: a DeepSeek-V3-style model of 8 experts, hidden 256 and
    N = 192, which exercises partial fp8 blocks and per-half w13 scales; int4 uses groups of 64
    (192 is not a multiple of 128). Read-only."""
    from moetool.convert.quantize import quantize
    from moetool.demo.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("verify-chain")
    model = make_tiny_checkpoint(root / "model", "deepseek_v3", hidden=256, intermediate=192, experts=8, top_k=2,
                                 layers=3, shards=2)
    out = {"dense": model}
    for fmt in ("fp8-block", "fp8-channel", "int4-group"):
        out[fmt] = root / fmt
        quantize(model, out[fmt], fmt, group_size=64, progress=False)
    return model, out


@pytest.fixture(scope="session")
def verify_shards(verify_chain, tmp_path_factory):
    """verify_shards(fmt, ep, **shard kwargs) -> EP shards of ``verify_chain``'s checkpoint in
    ``fmt``, made once per session and arguments. Read-only: a test that damages shards copies
    them first (or makes its own with ``moetool.convert.shard.shard``)."""
    from moetool.convert.shard import shard

    cache: dict = {}
    root = tmp_path_factory.mktemp("verify-shards")

    def get(fmt: str, ep: int, **kw) -> Path:
        key = (fmt, ep, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in cache:
            dst = root / f"{fmt}-ep{ep}-{len(cache)}"
            shard(verify_chain[1][fmt], dst, ep, progress=False, **kw)
            cache[key] = dst
        return cache[key]

    return get


@pytest.fixture
def copy_ckpt(tmp_path):
    """copy_ckpt(src) -> a private copy under tmp_path (for tests that damage a checkpoint)."""
    counter = [0]

    def copy(src: Path) -> Path:
        counter[0] += 1
        dst = tmp_path / f"ckpt{counter[0]}"
        shutil.copytree(src, dst)
        return dst

    return copy
