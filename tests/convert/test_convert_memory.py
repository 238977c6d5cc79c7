"""Peak memory of a conversion is flat in the input's size: twice the layers and tensors twice
as large (the embeddings and lm_head) peak no higher. Measured as the child process's VmHWM
(peak resident set) above its own after the imports."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetool.convert import torch_executor as executor
from moetool.convert.quantize import quantize
from moetool.demo.tiny import tiny_config, tiny_tensors, write_checkpoint
from moeutil import tree_hashes

#: MB the larger input may peak above the smaller one (allocator noise: 0-3 MB measured)
FLAT_MB = 24
#: MB above the imports a conversion of these inputs may take at all (measured: 56-57)
BUDGET_MB = 128

#: the child runs on 2 CPUs: how many files are written at once, and linears converted for
#: each, follows the cores (``torch_executor.files_at_once``), and with them how many tensors
#: are held at once. On an H100 host's 16 cores this test measured 83 -> 112 MB (bound 24): the
#: peak follows the largest tensor times the files in flight, not the input's total size
CHILD = """
import os, sys
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
from moetool.memory import bound_malloc
bound_malloc()  # as the CLI runs
from moetool.convert.quantize import quantize
import moetool.formats.registry


def hwm():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) // 1024


base = hwm()
quantize(sys.argv[1], sys.argv[2], sys.argv[3], progress=False)
print(hwm() - base)
"""


def build(path: Path, layers: int, vocab: int) -> Path:
    cfg = tiny_config("mixtral", hidden=512, intermediate=512, experts=4, top_k=2, layers=layers, dtype=torch.bfloat16)
    cfg["vocab_size"] = vocab  # embeddings and lm_head of vocab x 512 bf16
    return write_checkpoint(path, cfg, tiny_tensors("mixtral", cfg), shards=2)


def peak_mb(src: Path, out: Path, fmt: str) -> int:
    r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), fmt], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_peak_memory_is_flat_in_the_input_size(tmp_path):
    small = build(tmp_path / "small", layers=2, vocab=32768)  # 32 MB embeddings, 32 MB lm_head
    large = build(tmp_path / "large", layers=4, vocab=65536)  # twice the layers, 64 MB each
    got = {name: peak_mb(src, tmp_path / f"out-{name}", "fp8-block") for name, src in
           (("small", small), ("large", large))}
    assert got["large"] <= got["small"] + FLAT_MB, got
    assert max(got.values()) <= BUDGET_MB, got


def test_copied_tensors_in_pieces_write_the_same_bytes(tiny, tmp_path, monkeypatch):
    """Pieces of any size (here 1000 bytes: not a multiple of a bf16 row) write the same file."""
    src = tiny("mixtral")
    quantize(src, tmp_path / "whole", "fp8-block", progress=False)
    monkeypatch.setattr(executor, "COPY_PIECE", 1000)
    quantize(src, tmp_path / "pieces", "fp8-block", progress=False)
    assert tree_hashes(tmp_path / "pieces") == tree_hashes(tmp_path / "whole")
