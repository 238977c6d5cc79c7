"""mxfp4: the bytes (nibble order, e8m0 exponents), the quantization formula, the banded CPU
quantizer and the Triton kernel against it, rows, the config, what compressed-tensors and
transformers read back (transformers: test_format_transformers_load.py), and
`moetool quantize --format mxfp4` through repack, shard and verify."""
from __future__ import annotations

import json

import pytest
import torch
from moeutil import DEVICE, read_tensors

from moetool.errors import MoetoolError
from moetool.formats import Mxfp4, common, read_format_params
from moetool.formats.mxfp4 import E2M1_VALUES, e2m1_decode, e2m1_encode, e8m0_to_float, pack_fp4, unpack_fp4
from moetool.kernels import fp4_quant as k4

FMT = Mxfp4()


def random_weight(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.02
    w[0, :64] = 0  # all-zero groups
    w[-1, -9:] *= 50  # outliers
    return w.to(dtype)


def naive_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values float32 [N, K], e8m0 codes int [N, K/32]) one group at a time, as the module
    docstring words it: amax rounded up to a power of two from a 1.75 mantissa, minus 2; each
    element the nearest e2m1 value of w / scale (clamped to 6), ties to the even code."""
    w32 = w.float()
    n, k = w32.shape
    grid = torch.tensor(E2M1_VALUES)
    values = torch.empty(n, k)
    codes = torch.empty(n, k // 32, dtype=torch.int64)
    for j in range(k // 32):
        block = w32[:, j * 32 : (j + 1) * 32]
        amax = block.abs().amax(dim=1)
        mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
        e = (exponent - 1 + (mantissa >= 0.875).long() - 2 + 127).clamp(0, 254)
        e[amax == 0] = 0
        codes[:, j] = e
        y = (block / torch.pow(2.0, (e - 127).double()).float()[:, None]).clamp(-6, 6)
        dist = (y.abs()[..., None] - grid).abs()
        best = dist.min(dim=-1).values
        index = torch.where(dist == best[..., None], torch.arange(8), 99).amin(dim=-1)  # lowest of a tie...
        tie = (dist == best[..., None]).sum(dim=-1) > 1
        index = torch.where(tie & (index % 2 == 1), index + 1, index)  # ...moved to the even code
        values[:, j * 32 : (j + 1) * 32] = grid[index] * torch.where(y < 0, -1.0, 1.0) * torch.pow(
            2.0, (e - 127).double()).float()[:, None]
    return values, codes


def test_bit_layout_of_a_hand_made_row():
    """Element 2j in the low nibble; code = sign << 3 | index of 0, .5, 1, 1.5, 2, 3, 4, 6."""
    w = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
                      + [0.0] * 16])
    t = FMT.quantize(w, torch.float32)
    assert t["weight_scale"].tolist() == [[127]]  # amax 6: 2^0
    assert t["weight_packed"][0, :8].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert torch.equal(FMT.dequantize(t)[0, :16], w[0, :16])
    assert torch.equal(unpack_fp4(pack_fp4(torch.arange(16, dtype=torch.uint8)[None])), torch.arange(16)[None].byte())


def test_small_negatives_keep_their_sign_as_minus_zero():
    w = torch.tensor([[4.0, -0.1, 0.1, -1.25, 1.25, -5.0, 5.0, -6.9] + [0.0] * 24])  # amax 6.9: scale 2^0
    codes = unpack_fp4(FMT.quantize(w, torch.float32)["weight_packed"])[0, :8]
    assert codes.tolist() == [6, 8, 0, 10, 2, 14, 6, 15]  # ties 1.25 -> 1, 5 -> 4; 6.9 saturates at 6
    assert torch.equal(e2m1_encode(w[0, :8]), codes)
    assert torch.signbit(e2m1_decode(codes)).tolist() == [False, True, False, True, False, True, False, True]


@pytest.mark.parametrize("shape", [(8, 64), (33, 96), (300, 384)])
def test_quantize_is_the_formula(shape):
    w = random_weight(shape, seed=shape[0])
    values, codes = naive_mxfp4(w)
    t = FMT.quantize(w, torch.bfloat16)
    assert t["weight_scale"].dtype == torch.uint8 and torch.equal(t["weight_scale"].long(), codes)
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (shape[0], shape[1] // 2)
    assert torch.equal(FMT.dequantize(t), values)


@pytest.fixture(params=[1 << 12, 1 << 19], ids=["small-bands", "default-bands"])
def band(request, monkeypatch):
    monkeypatch.setattr(common, "BAND_ELEMENTS", request.param)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (130, 1024)])
def test_banded_quantizer_equals_the_kernel_reference_and_measures_exactly(shape, dtype, band):
    w = random_weight(shape, dtype, seed=shape[1])
    t, sig, noise = FMT.quantize_measured(w, dtype)
    ref = k4.mxfp4_quant_ref(w)
    assert list(t) == ["weight_packed", "weight_scale"]
    assert all(torch.equal(t[s], ref[s]) for s in t)
    assert all(torch.equal(t[s], v) for s, v in FMT.quantize(w, dtype).items())
    w64 = w.double()
    diff = FMT.dequantize(t).double() - w64
    assert sig == pytest.approx(float((w64 * w64).sum()), rel=1e-5)
    assert noise == pytest.approx(float((diff * diff).sum()), rel=1e-5)


def test_quantize_cuda_is_the_cpu_quantize():
    """The Triton kernel (on CUDA, or interpreted on CPU) writes the same bytes."""
    w = random_weight((96, 256)).to(DEVICE)
    got = FMT.quantize_cuda(w, torch.bfloat16)
    assert all(torch.equal(got[s].cpu(), v) for s, v in FMT.quantize(w.cpu(), torch.bfloat16).items())
    w[3, 3] = float("nan")
    assert FMT.quantize_cuda(w, torch.bfloat16) is None
    assert FMT.quantize_cuda(torch.zeros(4, 48, device=DEVICE), torch.bfloat16) is None


def test_dequantize_is_code_value_times_a_power_of_two():
    t = FMT.quantize(random_weight((16, 128)), torch.bfloat16)
    values = e2m1_decode(unpack_fp4(t["weight_packed"]))
    assert torch.equal(FMT.dequantize(t), values * e8m0_to_float(t["weight_scale"]).repeat_interleave(32, 1))
    assert e8m0_to_float(torch.tensor([0, 1, 127, 254])).tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0**127]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(bad):
    w = random_weight((64, 128), torch.float32)
    w[40, 5] = bad
    for quantize in (FMT.quantize, FMT.quantize_measured):
        with pytest.raises(MoetoolError, match=r"^contains NaN/Inf \(1 of 8192 values\)$"):
            quantize(w, torch.bfloat16)


def test_k_must_be_whole_groups_of_32():
    with pytest.raises(MoetoolError, match="K=48 columns, which mxfp4's groups of 32 do not divide"):
        FMT.quantize(random_weight((4, 48)), torch.bfloat16)


def test_logical_shape_checks_every_tensor():
    t = FMT.quantize(random_weight((24, 256)), torch.bfloat16)
    assert FMT.logical_shape(t) == (24, 256)
    with pytest.raises(MoetoolError, match=r"weight_scale has shape \[24, 4\], expected \[24, 8\]"):
        FMT.logical_shape({**t, "weight_scale": t["weight_scale"][:, :4]})
    with pytest.raises(MoetoolError, match="weight_packed has dtype torch.int32"):
        FMT.logical_shape({**t, "weight_packed": t["weight_packed"].view(torch.int32)})
    with pytest.raises(MoetoolError, match="is missing weight_scale"):
        FMT.logical_shape({"weight_packed": t["weight_packed"]})


def test_rows_concatenate_and_split_exactly():
    gate, up = (FMT.quantize(random_weight((40, 128), seed=s), torch.bfloat16) for s in (1, 2))
    w13 = FMT.cat_rows([gate, up])
    assert w13["weight_packed"].shape == (80, 64) and w13["weight_scale"].shape == (80, 4)
    for part, want in zip(FMT.split_rows(w13, [40, 40]), (gate, up)):
        assert all(torch.equal(part[s], want[s]) for s in want)


def test_config_is_what_llm_compressor_writes_for_mxfp4a16():
    config = FMT.quantization_config(["lm_head"])
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "mxfp4-pack-quantized"
    group = config["config_groups"]["group_0"]
    assert group["format"] == "mxfp4-pack-quantized" and group["input_activations"] is None
    assert group["weights"] == {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                                "scale_dtype": "torch.uint8", "symmetric": True, "dynamic": False}
    assert read_format_params(config) == ("mxfp4", {})


@pytest.mark.parametrize("change, message", [
    (lambda g: g["weights"].update(group_size=16), "mxfp4 with group_size 16; mxfp4 has groups of 32"),
    (lambda g: g["weights"].update(symmetric=False), "mxfp4 with zero points"),
    (lambda g: g.update(input_activations={"num_bits": 4, "type": "float", "strategy": "group",
                                           "group_size": 32, "dynamic": True}),
     "mxfp4 with quantized input activations"),
])
def test_variants_moetool_cannot_read_are_refused(change, message):
    config = json.loads(json.dumps(FMT.quantization_config([])))
    change(config["config_groups"]["group_0"])
    with pytest.raises(MoetoolError, match=message):
        read_format_params(config)


# ---------------------------------------------------------------------- reader: compressed-tensors


def test_compressed_tensors_reads_and_writes_our_bytes():
    """compressed-tensors' MXFP4 compressor decompresses our tensors to our values (rounded once
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
    packed = compressor.compress({"weight": w.float(), "weight_scale": e8m0_to_float(t["weight_scale"])}, scheme)
    assert torch.equal(packed["weight_packed"], t["weight_packed"]) and torch.equal(packed["weight_scale"], t["weight_scale"])


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
# ---------------------------------------------------------------------- the commands, end to end


@pytest.mark.slow  # verify starts rank processes
def test_quantize_inspect_repack_shard_verify(tiny, cli, tmp_path):
    src = tiny("mixtral")
    quant, stacked, shards = tmp_path / "q", tmp_path / "stacked", tmp_path / "ep2"
    assert cli("quantize", src, quant, "--format", "mxfp4", "--quiet").code == 0
    r = cli("inspect", quant, "--json")
    assert r.code == 0 and json.loads(r.out)["weight_format"] == "mxfp4"
    tensors = read_tensors(quant)
    base = "model.layers.0.block_sparse_moe.experts.1.w2"
    assert tensors[f"{base}.weight_packed"].dtype == torch.uint8 and tensors[f"{base}.weight_packed"].shape == (256, 64)
    assert tensors[f"{base}.weight_scale"].dtype == torch.uint8 and tensors[f"{base}.weight_scale"].shape == (256, 4)
    assert cli("repack", quant, stacked, "--layout", "stacked", "--quiet").code == 0
    stacked_tensors = read_tensors(stacked)
    w13 = "model.layers.0.block_sparse_moe.experts.w13"
    assert stacked_tensors[f"{w13}_weight_packed"].shape == (4, 256, 128)
    gate = "model.layers.0.block_sparse_moe.experts.2.w1"
    assert torch.equal(stacked_tensors[f"{w13}_weight_packed"][2, :128], tensors[f"{gate}.weight_packed"])
    assert cli("shard", stacked, shards, "--ep", "2", "--quiet").code == 0
    r = cli("verify", shards, "--ref", src, "--ep", "2", "--experts", "torch", "--tokens", "32")
    assert r.code == 0, r.err
    assert "format mxfp4" in r.out and "PASSED: 2/2 layers" in r.out
