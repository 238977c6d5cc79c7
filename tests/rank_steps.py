"""Tests only: which implementation of the EP dispatch and combine steps the suite's ranks run.

The suite sets TRITON_INTERPRET=1, under which ``transports.KernelOrRef`` picks the Triton
kernels for CPU tensors too. Interpreted, they were ~37 % of the CPU time of the worlds that
check what the ranks do around them (whole-model, streaming, end-to-end: 2-core machine), while
a CPU user's run takes the pure-torch references and a GPU's the compiled kernels. So the fork
server of a test process (tests/conftest.py preloads this module) makes its ranks pick the
references; a world that checks the kernels in the distributed run asks for them back
(``verify_workers.run_world``: the ep 2 world of test_verify_dispatch, through every dispatcher,
format and fault). tests/kernels holds each kernel bit-exact to its reference.
"""
from __future__ import annotations

from moetool.verify.transports import KernelOrRef

_PICK = KernelOrRef.pick  # this module is the only one that replaces it


def use(steps: str) -> None:
    """``kernels``: as moetool picks (the kernels on CUDA or interpreted); ``references``: the
    pure-torch references for CPU tensors, as a CPU user's run takes them (CUDA tensors keep
    the compiled kernels: the GPU worlds check those)."""
    if steps not in ("kernels", "references"):
        raise ValueError(f"steps {steps!r}: expected kernels or references")
    KernelOrRef.pick = _PICK if steps == "kernels" else _cuda_kernels_cpu_references


def _cuda_kernels_cpu_references(self: KernelOrRef, like):
    return self.kernel if like.is_cuda else self.ref


use("references")
