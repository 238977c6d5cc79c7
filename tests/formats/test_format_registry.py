"""The registry is the only table of formats: a format class registered anywhere is a choice of
``moetool quantize`` (its ``--format`` name, flag, parameters and help) and reads back from its
own config, with no other edit; every format defines the whole contract of formats/base.py;
the torch-free cards that the byte-copy path reads equal the registry.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from moetool.formats import FORMATS, TOLERANCES, detect_format, format_params, get_format, read_format_params
from moetool.formats.base import CliParam, Tensors, WeightFormat, register
from moetool.formats.cards import cards, quantized_suffixes
from moetool.kernels.moe_weights import SCHEMES
from moeutil import read_tensors, tree_hashes

from moetool.read.checkpoint import open_checkpoint


@dataclass(frozen=True)
class RowInt(WeightFormat):
    """A format for this test only: ``bits``-bit integer codes (stored as int8) with one float32
    scale per row, w ~= q * s."""

    name: ClassVar[str] = "test-row-int"
    suffixes: ClassVar[tuple[str, ...]] = ("weight_codes", "weight_row_scale")
    row_blocks: ClassVar[dict[str, int]] = {"weight_codes": 1, "weight_row_scale": 1}
    tolerance: ClassVar[dict[str, float]] = {"rel_err": 0.05, "sqnr_db": 26.0}
    verify_tolerances: ClassVar[dict[str, float]] = {"rel_err": 0.1, "expert_rel_err": 0.1}
    config_method: ClassVar[str | None] = "test-row-int"
    cli_flags: ClassVar[tuple[str, ...]] = ("--row-int",)
    cli_help: ClassVar[str] = "integer codes with a scale per row (a test format)"
    cli_params: ClassVar[dict[str, CliParam]] = {"bits": CliParam("--row-bits", "bits per code", positive=True)}

    bits: int = 8

    def quantize(self, w: torch.Tensor, orig_dtype: torch.dtype) -> Tensors:
        w32 = w.float()
        scale = w32.abs().amax(1, keepdim=True).clamp(min=1e-12) / (2 ** (self.bits - 1) - 1)  # [N, 1]
        return {"weight_codes": torch.round(w32 / scale).to(torch.int8), "weight_row_scale": scale}

    def dequantize(self, t: Tensors) -> torch.Tensor:
        return t["weight_codes"].float() * t["weight_row_scale"]

    def logical_shape(self, t: Tensors) -> tuple[int, int]:
        n, k = t["weight_codes"].shape
        return n, k

    def quantization_config(self, ignore: list[str]) -> dict | None:
        return {"quant_method": self.config_method, "bits": self.bits, "ignore": list(ignore)}

    @classmethod
    def params_from_config(cls, config: dict) -> dict | None:
        return {"bits": config["bits"]}


def _flat(text: str) -> str:
    """Text without whitespace and box-drawing characters (Rich's panels, wrapped lines)."""
    return re.sub(r"[\s\u2500-\u257f]+", "", text)


def test_a_registered_format_needs_no_other_edit(tiny, cli, tmp_path):
    src = tiny("mixtral")
    register(RowInt)
    try:
        shown = _flat(cli("quantize", "--help").out)
        for text in ("--format", "test-row-int", "--row-int", "--row-bits", RowInt.cli_help, "bits per code",
                     "--fp8-block", "--int4", "--group-size"):
            assert _flat(text) in shown, text
        r = cli("quantize", src, tmp_path / "format", "--format", "test-row-int", "--row-bits", "6", "--quiet")
        assert r.code == 0, r.err
        assert cli("quantize", src, tmp_path / "flag", "--row-int", "--row-bits", "6", "--quiet").code == 0
        assert tree_hashes(tmp_path / "format") == tree_hashes(tmp_path / "flag")
        config = json.loads((tmp_path / "format" / "config.json").read_text())["quantization_config"]
        assert config["quant_method"] == "test-row-int" and config["bits"] == 6
        with open_checkpoint(tmp_path / "format") as ck:
            suffixes = {n.rpartition(".")[2] for n in ck.tensors}
            assert detect_format(ck.config, suffixes) == RowInt(bits=6)
        tensors = read_tensors(tmp_path / "format")
        codes = [t for n, t in tensors.items() if n.endswith(".weight_codes")]  # every routed expert linear
        assert codes and all(t.dtype == torch.int8 and int(t.abs().max()) <= 31 for t in codes)
        assert cli("quantize", src, tmp_path / "zero", "--row-int", "--row-bits", "0").error_line == \
            "--row-bits 0 must be positive"
        assert cli("quantize", src, tmp_path / "none", "--quiet").error_line == \
            "choose exactly one of " + ", ".join(flag for cls in FORMATS.values() for flag in cls.cli_flags)
        assert TOLERANCES["test-row-int"] == RowInt.tolerance
    finally:
        del FORMATS[RowInt.name]
    r = cli("quantize", src, tmp_path / "gone", "--format", "test-row-int")
    assert r.code == 2 and "Invalid value for '--format'" in r.err
    assert "--row-int" not in cli("quantize", "--help").out


def test_every_format_defines_the_contract():
    flags = [flag for cls in FORMATS.values() for flag in cls.cli_flags]
    assert len(flags) == len(set(flags))
    assert sum(not cls.quantized for cls in FORMATS.values()) == 1
    for cls in FORMATS.values():
        assert set(cls.tolerance) == {"rel_err", "sqnr_db"}, cls.name
        assert set(cls.verify_tolerances) == {"rel_err", "expert_rel_err"}, cls.name
        assert cls.kernel_scheme is None or cls.kernel_scheme in SCHEMES, cls.name
        assert cls.activation_quant in (None, "fp8-1x128", "fp8-token"), cls.name
        fmt = cls()
        if not cls.quantized:
            assert fmt.quantization_config([]) is None
            continue
        params, _ = format_params(cls.name, vars(fmt))
        assert read_format_params(fmt.quantization_config([])) == (cls.name, params), cls.name
        assert cls.cli_flags and cls.cli_help, cls.name
        assert set(cls.cli_params) <= set(params), cls.name


def test_cards_read_without_torch_equal_the_registry():
    assert [c["name"] for c in cards()] == list(FORMATS)
    for card in cards():
        cls = FORMATS[card["name"]]
        assert card == {"name": cls.name, "suffixes": cls.suffixes, "optional_suffixes": cls.optional_suffixes,
                        "quantized": cls.quantized}
    from moetool.formats import registry

    assert quantized_suffixes() == registry.quantized_suffixes()
    code = ("import sys; import moetool.formats, moetool.convert.plan as p\n"
            "assert p.QUANTIZED_ONLY_SUFFIXES >= {'weight_scale_inv', 'weight_zero_point'}\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_asymmetric_int4_stores_its_optional_suffix():
    fmt = get_format("int4-group", group_size=32, symmetric=False)
    assert set(fmt.quantize(torch.randn(16, 64), torch.bfloat16)) == set(fmt.suffixes)
    assert set(fmt.suffixes) - set(type(fmt).suffixes) == set(type(fmt).optional_suffixes)


@pytest.mark.parametrize("name, params", [("fp8-block", {}), ("int4-group", {"group_size": 64, "symmetric": False})])
def test_quantize_cuda_is_the_cpu_quantize_or_declines(name, params):
    """On CPU no kernel runs: quantize_cuda of a weight no kernel takes returns None."""
    fmt = get_format(name, **params)
    if torch.cuda.is_available():
        w = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
        got, want = fmt.quantize_cuda(w, torch.bfloat16), fmt.quantize(w.cpu(), torch.bfloat16)
        assert list(got) == list(want)
        for suffix in want:
            assert torch.equal(got[suffix].cpu().view(torch.uint8), want[suffix].view(torch.uint8))
    assert get_format("fp8-channel").quantize_cuda(torch.randn(8, 8), torch.bfloat16) is None
