"""The GPU's start begun at ``quantize --device cuda``'s first instant (moetool.convert.gpu_start)."""
from __future__ import annotations

import sys

import pytest
import torch

from moetool.convert import gpu_start


@pytest.mark.parametrize("args, index", [
    (["quantize", "src", "out", "--fp8-block", "--device", "cuda"], 0),
    (["quantize", "src", "out", "--device=cuda:1"], 1),
    (["quantize", "src", "out", "--device", "cpu"], None),
    (["quantize", "src", "out", "--device", "cuda:x"], None),
    (["quantize", "src", "out", "--device"], None),
    (["quantize", "src", "out"], None),
])
def test_the_device_a_command_line_names(args, index):
    assert gpu_start.cuda_index(args) == index


def test_quantize_begins_the_gpu_only_for_a_cuda_device(monkeypatch):
    from moetool.cli import quantize

    begun = []
    monkeypatch.setattr(gpu_start, "begin", begun.append)
    for device, want in (("cpu", []), ("cuda:0", [0]), ("cuda", [0])):
        begun.clear()
        monkeypatch.setattr(sys, "argv", ["moetool", "quantize", "src", "out", "--fp8-block", "--device", device])
        quantize.quantize_app()
        assert begun == want


def test_a_missing_gpu_is_left_to_the_conversion():
    """Without CUDA (this suite's machines) the start ends quietly, its Triton key made."""
    from triton.runtime.cache import triton_key

    thread = gpu_start.begin(0 if torch.cuda.is_available() else 7)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert triton_key.cache_info().currsize == 1  # the key is made once per process: later kernels reuse it
    if torch.cuda.is_available():
        assert torch.cuda.is_initialized()
