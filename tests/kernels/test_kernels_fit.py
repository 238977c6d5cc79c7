"""A tile whose pipeline does not fit the device's shared memory (the tables are tuned with
16-bit output rows; a float32 model's rows need more) runs with fewer stages, the same
result, and the next call goes straight to the tile that fit. Triton raises OutOfResources
when it compiles, before anything runs: faked here, as the interpreter has no shared memory."""
import pytest
import torch
from triton.runtime.errors import OutOfResources

from moetool.kernels import fused_moe as fm
from moetool.kernels import moe_gemm as mg
from moetool.kernels.moe_tiles import MoeConfig

from test_kernels_fused_moe import CASES, _to, make_hidden, make_routing, make_weights


class _SharedMemoryOf:
    """The GEMM kernel, refusing to compile pipelines deeper than ``stages``."""

    def __init__(self, kernel, stages: int):
        self.kernel, self.stages, self.tried = kernel, stages, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.tried.append(kw["num_stages"])
            if kw["num_stages"] > self.stages:
                raise OutOfResources(40960 * kw["num_stages"], 40960 * self.stages, "shared memory")
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("case", ["dense-fp32", "fp8-block-w8a8"])
def test_a_pipeline_too_deep_runs_with_the_stages_that_fit(case, device, monkeypatch):
    fmt, hdtype, _, _ = CASES[case]
    T, E, H, N, k = 9, 3, 256, 128, 2
    w13, w2 = make_weights(fmt, E, H, N, 128, True)
    ids, tw = make_routing(T, E, k)
    x, scale = make_hidden(T, H, hdtype)
    args = (x.to(device), _to(w13, device), _to(w2, device), fmt, ids.to(device), tw.to(device))
    kw = {} if scale is None else {"hidden_scale": scale.to(device)}
    fits = fm.fused_experts(*args, config=MoeConfig(16, 32, 128, 1, 4, 2), **kw).cpu()
    fake = _SharedMemoryOf(mg._moe_gemm_kernel, stages=2)
    interpreted = mg.is_interpreted(mg._moe_gemm_kernel)  # the wrapper is not the jit object it asks about
    monkeypatch.setattr(mg, "is_interpreted", lambda fn: interpreted)
    monkeypatch.setattr(mg, "_moe_gemm_kernel", fake)
    monkeypatch.setattr(mg, "_FITTED", {})
    deep = MoeConfig(16, 32, 128, 1, 4, 4)
    assert torch.equal(fm.fused_experts(*args, config=deep, **kw).cpu(), fits)
    # GEMM1 down to the 2 stages that fit; GEMM2 too, or straight there with GEMM1's dtypes
    assert fake.tried in ([4, 3, 2, 4, 3, 2], [4, 3, 2, 2]), fake.tried
    fake.tried.clear()
    assert torch.equal(fm.fused_experts(*args, config=deep, **kw).cpu(), fits)
    assert set(fake.tried) == {2}  # remembered
    monkeypatch.setattr(mg, "_FITTED", {})
    fake.stages = 0
    with pytest.raises(OutOfResources):  # nothing fits: the compiler's own error
        fm.fused_experts(*args, config=deep, **kw)
