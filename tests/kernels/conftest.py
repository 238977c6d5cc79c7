"""Kernel tests run on CPU through the Triton interpreter unless CUDA is present.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a kernel, so it is set here, before any
test module imports ``moetool.kernels``.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moeutil import DEVICE  # noqa: E402


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
