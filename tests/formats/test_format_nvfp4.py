"""nvfp4: the global scale (a divisor, one per fused w13), the quantization formula, the banded
CPU quantizer and the Triton kernel against it, rows, the config, what compressed-tensors and
transformers read back (transformers: test_format_transformers_load.py), and
`moetool quantize --format nvfp4` through repack, shard and verify."""
from __future__ import annotations

import json

import pytest
import torch
from moeutil import DEVICE, read_tensors

from moetool.errors import MoetoolError
from moetool.formats import FORMATS, Nvfp4, common, detect_format, read_format_params
from moetool.formats.mxfp4 import E2M1_VALUES, e2m1_decode, unpack_fp4
from moetool.kernels import fp4_quant as k4

FMT = Nvfp4()


def random_weight(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.02
    w[0, :64] = 0  # all-zero groups
    w[-1, -9:] *= 50  # outliers
    return w.to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[s].dtype == b[s].dtype and torch.equal(raw(a[s]), raw(b[s])) for s in a)


def naive_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values float32 [N, K], scales e4m3 [N, K/16], global scale float32 [1]) one group at a
    time, as the module docstring words it."""
    w32 = w.float()
    n, k = w32.shape
    gs = torch.tensor([2688.0]) / w32.abs().max().clamp(min=1e-12)
    grid = torch.tensor(E2M1_VALUES)
    values = torch.empty(n, k)
    scales = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn)
    for j in range(k // 16):
        block = w32[:, j * 16 : (j + 1) * 16]
        s = ((block.abs().amax(dim=1) / 6) * gs).clamp(2.0**-9, 448).to(torch.float8_e4m3fn)
        scales[:, j] = s
        eff = s.float() / gs
        y = (block / eff[:, None]).clamp(-6, 6)
        dist = (y.abs()[..., None] - grid).abs()
        best = dist.min(dim=-1).values
        index = torch.where(dist == best[..., None], torch.arange(8), 99).amin(dim=-1)
        tie = (dist == best[..., None]).sum(dim=-1) > 1
        index = torch.where(tie & (index % 2 == 1), index + 1, index)  # ties to the even code
        values[:, j * 16 : (j + 1) * 16] = grid[index] * torch.where(y < 0, -1.0, 1.0) * eff[:, None]
    return values, scales, gs


@pytest.mark.parametrize("shape", [(8, 64), (33, 96), (300, 384)])
def test_quantize_is_the_formula(shape):
    w = random_weight(shape, seed=shape[0])
    values, scales, gs = naive_nvfp4(w)
    t = FMT.quantize(w, torch.bfloat16)
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (shape[0], shape[1] // 2)
    assert torch.equal(raw(t["weight_scale"]), raw(scales))
    assert t["weight_global_scale"].dtype == torch.float32 and torch.equal(t["weight_global_scale"], gs)
    assert torch.equal(FMT.dequantize(t), values)


def test_the_global_scale_divides_the_group_scales():
    """w ~= e2m1 * weight_scale / weight_global_scale; the largest group's scale is 448."""
    w = random_weight((32, 128), torch.float32)
    t = FMT.quantize(w, torch.bfloat16)
    gs = t["weight_global_scale"]
    assert gs.shape == (1,) and gs.item() == pytest.approx(2688 / w.abs().max().item(), rel=1e-6)
    assert t["weight_scale"].float().max().item() == 448.0
    values = e2m1_decode(unpack_fp4(t["weight_packed"]))
    expected = values * (t["weight_scale"].float() / gs).repeat_interleave(16, 1)
    assert torch.equal(FMT.dequantize(t), expected)
    assert (FMT.dequantize(t)[0, :64] == 0).all()  # all-zero groups: the smallest scale, zero codes
    assert (t["weight_scale"][0, :4].float() == 2.0**-9).all()


@pytest.fixture(params=[1 << 12, 1 << 19], ids=["small-bands", "default-bands"])
def band(request, monkeypatch):
    monkeypatch.setattr(common, "BAND_ELEMENTS", request.param)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (130, 1024)])
def test_banded_quantizer_equals_the_kernel_reference_and_measures_exactly(shape, dtype, band):
    w = random_weight(shape, dtype, seed=shape[1])
    t, sig, noise = FMT.quantize_measured(w, dtype)
    assert same(t, k4.nvfp4_quant_ref(w))
    assert same(t, FMT.quantize(w, dtype))
    w64 = w.double()
    diff = FMT.dequantize(t).double() - w64
    assert sig == pytest.approx(float((w64 * w64).sum()), rel=1e-5)
    assert noise == pytest.approx(float((diff * diff).sum()), rel=1e-5)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN / Inf
def test_quantize_cuda_is_the_cpu_quantize():
    """The Triton kernel (on CUDA, or interpreted on CPU) writes the same bytes; a weight with NaN or Inf
    gets None (a NaN or zero global scale), so the caller's ``quantize`` names it."""
    w = random_weight((96, 256)).to(DEVICE)
    got = FMT.quantize_cuda(w, torch.bfloat16)
    assert same({s: t.cpu() for s, t in got.items()}, FMT.quantize(w.cpu(), torch.bfloat16))
    for bad in (float("nan"), float("inf")):
        w[3, 3] = bad
        assert FMT.quantize_cuda(w, torch.bfloat16) is None
    assert FMT.quantize_cuda(torch.zeros(4, 40, device=DEVICE), torch.bfloat16) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(bad):
    w = random_weight((64, 128), torch.float32)
    w[40, 5] = bad
    for quantize in (FMT.quantize, FMT.quantize_measured):
        with pytest.raises(MoetoolError, match=r"^contains NaN/Inf \(1 of 8192 values\)$"):
            quantize(w, torch.bfloat16)


def test_k_must_be_whole_groups_of_16():
    with pytest.raises(MoetoolError, match="K=40 columns, which nvfp4's groups of 16 do not divide"):
        FMT.quantize(random_weight((4, 40)), torch.bfloat16)


def test_logical_shape_checks_every_tensor():
    t = FMT.quantize(random_weight((24, 256)), torch.bfloat16)
    assert FMT.logical_shape(t) == (24, 256)
    with pytest.raises(MoetoolError, match=r"weight_scale has dtype torch.uint8"):
        FMT.logical_shape({**t, "weight_scale": t["weight_scale"].view(torch.uint8)})
    with pytest.raises(MoetoolError, match=r"weight_global_scale has shape \[\], expected \[1\]"):
        FMT.logical_shape({**t, "weight_global_scale": t["weight_global_scale"][0]})
    with pytest.raises(MoetoolError, match=r"weight_global_scale has shape \[5\]"):
        FMT.logical_shape({**t, "weight_global_scale": torch.ones(5)})


def test_gate_and_up_quantized_as_one_w13_share_the_global_scale():
    """What vLLM's fused w13 reads (one global scale for both halves): quantize the
    concatenation, cut it with split_rows; each half keeps the joint global scale, and its codes
    are those of quantizing it alone with that global scale."""
    gate, up = random_weight((64, 256), seed=1), random_weight((64, 256), seed=2) * 3
    joint = FMT.quantize(torch.cat([gate, up]), torch.bfloat16)
    g, u = FMT.split_rows(joint, [64, 64])
    assert torch.equal(g["weight_global_scale"], u["weight_global_scale"])
    assert torch.equal(g["weight_global_scale"], FMT.quantize(up, torch.bfloat16)["weight_global_scale"])
    assert same(u, FMT.quantize(up, torch.bfloat16))  # up holds the joint maximum
    assert torch.equal(torch.cat([FMT.dequantize(g), FMT.dequantize(u)]), FMT.dequantize(joint))


def test_a_stacked_w13_keeps_one_global_scale_per_half():
    gate, up = (FMT.quantize(random_weight((40, 128), seed=s), torch.bfloat16) for s in (1, 2))
    w13 = FMT.cat_rows([gate, up])
    assert w13["weight_global_scale"].shape == (2,)  # as vLLM's w13_weight_global_scale [E, 2]
    assert FMT.logical_shape(w13) == (80, 128)
    assert torch.equal(FMT.dequantize(w13), torch.cat([FMT.dequantize(gate), FMT.dequantize(up)]))
    parts = FMT.split_rows(w13, [40, 40])
    assert same(parts[0], gate) and same(parts[1], up)
    with pytest.raises(MoetoolError, match=r"rows \[0, 60\) straddle global scales of 40 rows each"):
        FMT.split_rows(w13, [60, 20])
    with pytest.raises(MoetoolError, match="each keeps its global scale"):
        FMT.cat_rows([gate, FMT.quantize(random_weight((24, 128)), torch.bfloat16)])


def test_config_is_what_llm_compressor_writes_for_nvfp4a16():
    config = FMT.quantization_config(["lm_head"])
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "nvfp4-pack-quantized"
    group = config["config_groups"]["group_0"]
    assert group["format"] == "nvfp4-pack-quantized" and group["input_activations"] is None
    assert group["weights"] == {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                                "scale_dtype": "torch.float8_e4m3fn", "symmetric": True, "dynamic": False}
    assert read_format_params(config) == ("nvfp4", {})


@pytest.mark.parametrize("change, message", [
    (lambda g: g["weights"].update(group_size=32), "nvfp4 with group_size 32; nvfp4 has groups of 16"),
    (lambda g: g["weights"].update(symmetric=False), "nvfp4 with zero points"),
    (lambda g: g.update(input_activations={"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                           "group_size": 16, "dynamic": "local"}),
     r"nvfp4 with quantized input activations; moetool reads the weight-only scheme \(NVFP4A16"),
])
def test_variants_moetool_cannot_read_are_refused(change, message):
    config = json.loads(json.dumps(FMT.quantization_config([])))
    change(config["config_groups"]["group_0"])
    with pytest.raises(MoetoolError, match=message):
        read_format_params(config)


def test_a_checkpoint_without_its_config_is_recognized_by_the_global_scale():
    suffixes = {"weight_packed", "weight_scale", "weight_global_scale"}
    assert detect_format({}, suffixes) == FMT
    assert not any(cls.recognized_without_config({"weight_packed", "weight_scale"}, None)
                   for cls in FORMATS.values())


# ---------------------------------------------------------------------- reader: compressed-tensors


def test_compressed_tensors_reads_and_writes_our_bytes():
    """compressed-tensors' NVFP4 compressor decompresses our tensors to our values (rounded once
    to bf16) and, given our scales, compresses the weight to our bytes."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(FMT.quantization_config(["lm_head"]))
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    w = random_weight((48, 256))
    t = FMT.quantize(w, torch.bfloat16)
    theirs = compressor.decompress(dict(t), scheme)["weight"]
    assert torch.equal(theirs, FMT.dequantize(t).to(theirs.dtype))
    packed = compressor.compress({"weight": w.float(), "weight_scale": t["weight_scale"].float(),
                                  "weight_global_scale": t["weight_global_scale"]}, scheme)
    assert same({s: packed[s] for s in t}, t)


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
# ---------------------------------------------------------------------- the commands, end to end


@pytest.mark.slow  # verify starts rank processes
def test_quantize_inspect_repack_shard_verify(tiny, cli, tmp_path):
    src = tiny("mixtral")
    quant, stacked, shards = tmp_path / "q", tmp_path / "stacked", tmp_path / "ep2"
    assert cli("quantize", src, quant, "--format", "nvfp4", "--quiet").code == 0
    r = cli("inspect", quant, "--json")
    assert r.code == 0 and json.loads(r.out)["weight_format"] == "nvfp4"
    tensors = read_tensors(quant)
    base = "model.layers.0.block_sparse_moe.experts.1.w2"
    assert tensors[f"{base}.weight_packed"].dtype == torch.uint8 and tensors[f"{base}.weight_packed"].shape == (256, 64)
    assert tensors[f"{base}.weight_scale"].dtype == torch.float8_e4m3fn and tensors[f"{base}.weight_scale"].shape == (256, 8)
    assert tensors[f"{base}.weight_global_scale"].dtype == torch.float32 and tensors[f"{base}.weight_global_scale"].shape == (1,)
    assert cli("repack", quant, stacked, "--layout", "stacked", "--quiet").code == 0
    stacked_tensors = read_tensors(stacked)
    w13 = "model.layers.0.block_sparse_moe.experts.w13"
    assert stacked_tensors[f"{w13}_weight_packed"].shape == (4, 256, 128)
    assert stacked_tensors[f"{w13}_weight_global_scale"].shape == (4, 2)
    expert2 = "model.layers.0.block_sparse_moe.experts.2"
    assert torch.equal(stacked_tensors[f"{w13}_weight_global_scale"][2],
                       torch.cat([tensors[f"{expert2}.w1.weight_global_scale"], tensors[f"{expert2}.w3.weight_global_scale"]]))
    assert cli("shard", stacked, shards, "--ep", "2", "--quiet").code == 0
    r = cli("verify", shards, "--ref", src, "--ep", "2", "--experts", "torch", "--tokens", "32")
    assert r.code == 0, r.err
    assert "format nvfp4" in r.out and "PASSED: 2/2 layers" in r.out
