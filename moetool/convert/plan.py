"""Conversion plans as pure values, shared by every way of executing them (no torch here).

A :class:`Plan` lists output files; each file lists *groups*, and each group knows the exact
output tensors it produces before any data is read:

- :class:`Copy`          a tensor passed through bit-identical,
- :class:`Dequant`       a quantized non-expert linear written back in the model dtype,
- :class:`ExpertLinear`  one expert's gate, up or down linear in the output format (per-expert layout),
- :class:`SharedLinear`  a shared-expert linear requantized (``--include-shared-experts``),
- :class:`Stacked`       a layer's ``w13_*`` or ``w2_*`` tensors for a list of experts (stacked layout),
- :class:`Fused`         a layer's transformers ``experts.gate_up_proj`` or ``experts.down_proj`` (fused
                         layout: unquantized, or a format's fused layout such as gpt-oss's mxfp4
                         ``_blocks`` / ``_scales``; with the experts' biases).

Which groups a conversion has and how they are put into files is decided here, once, for
both executors: ``moetool.convert.torch_executor`` (read, convert and write tensors with torch) and
``moetool.convert.byte_executor`` (outputs that are byte ranges of the input, copied without torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Union

from moetool.formats.cards import quantized_suffixes
from moetool.read.manifest import JOURNAL_NAME, MANIFEST_NAME
from moetool.read.safetensors import SAFETENSORS_METADATA, TensorSpec, safetensors_header

#: how experts are written: per expert (HF names), stacked (vLLM's FusedMoE w13 / w2), or fused
#: as transformers stores the family (``experts.gate_up_proj`` / ``down_proj``: gpt-oss's layout)
Layout = Literal["per-expert", "stacked", "fused"]
MergeLayout = Layout
ROLES = ("gate", "up", "down")
OTHER_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
SKIP_FILES = {"config.json", "model.safetensors.index.json", MANIFEST_NAME, JOURNAL_NAME}
#: tensor suffixes only a quantized linear has (its weight is then no plain tensor to copy): every
#: format's, read from formats/ without importing torch (the byte-copy path never does), and
#: those of formats moetool does not read (static fp8 activation scales, fp4 global scales)
QUANTIZED_ONLY_SUFFIXES = set(quantized_suffixes()) | {"input_scale", "weight_global_scale"}


@dataclass(frozen=True)
class Copy:
    src: str
    dst: str
    source: int = 0


@dataclass(frozen=True)
class Dequant:
    src_base: str
    dst: str
    source: int = 0


@dataclass(frozen=True)
class ExpertLinear:
    layer: int
    expert: int
    role: str  # gate | up | down
    dst_base: str
    source: int = 0


@dataclass(frozen=True)
class SharedLinear:
    src_base: str
    dst_base: str
    source: int = 0


@dataclass(frozen=True)
class Stacked:
    layer: int
    which: str  # w13 | w2
    experts: tuple[int, ...]
    dst_base: str
    #: per-entry source index (merge reads each expert from its rank); empty = all from 0
    sources: tuple[int, ...] = ()


@dataclass(frozen=True)
class Fused:
    """One transformers fused experts tensor and its partners, written expert by expert along
    their first dim: ``gate_up`` [E', 2N, H] (or input-first [E', H, 2N]; gate and up rows
    interleaved when ``interleaved``, else gate half then up half) or ``down`` [E', H, N]
    (input-first [E', N, H]), named ``dst``; in a quantized format its fused layout's tensors
    ``{dst}_{name}`` instead (mxfp4: ``_blocks``, ``_scales``, output rows first); the experts'
    biases ``{dst}_bias`` [E', 2N] (interleaved as the rows) / [E', H]."""

    layer: int
    which: str  # gate_up | down
    experts: tuple[int, ...]
    dst: str
    input_first: bool = False
    interleaved: bool = False
    #: per-entry source index (merge reads each expert from its rank); empty = all from 0
    sources: tuple[int, ...] = ()


Group = Union[Copy, Dequant, ExpertLinear, SharedLinear, Stacked, Fused]
#: a group's output tensors (``TensorSpec``, or ``byteplan.RawSpec`` for a byte copy)
SpecsOf = Callable[[Group], list]


@dataclass
class PlannedFile:
    name: str
    groups: list[Group]
    specs: list[TensorSpec] = field(default_factory=list)
    #: the name of an earlier file of the plan that this one is byte for byte (every EP rank's
    #: non-expert file): made from that file (``OutputDir.same_file``), not written again
    same_as: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def header(self) -> bytes:
        """Its safetensors header, with ``SAFETENSORS_METADATA``, as the executors write it."""
        return safetensors_header(self.specs, SAFETENSORS_METADATA)

    def file_size(self) -> int:
        """Its size on disk: header and data."""
        return len(self.header()) + self.nbytes


@dataclass
class Plan:
    files: list[PlannedFile]
    config: dict
    out_format: str
    layout: str
    other_files: list[tuple[Path, str]] = field(default_factory=list)  # (source path, output name)
    manifest_extra: dict = field(default_factory=dict)
    write_index: bool = True
    #: extra JSON files written with the config (e.g. per-rank config.json): name -> obj
    json_files: dict[str, dict] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Tensor data bytes of every planned file (``same_as`` files included)."""
        return sum(f.nbytes for f in self.files)

    def summary(self, *, bytes_in: int, seconds: float, written: int, errors: dict | None = None) -> "Summary":
        """What an executor reports once the plan is written: ``written`` of its files made in
        this run, the others resumed."""
        return Summary(tensors=sum(len(f.specs) for f in self.files), bytes_in=bytes_in, bytes_out=self.nbytes,
                       seconds=seconds, files_written=written, files_skipped=len(self.files) - written,
                       errors=errors or {}, out_format=self.out_format, layout=self.layout,
                       bytes_same=sum(f.nbytes for f in self.files if f.same_as))

    def describe(self) -> str:
        lines = [f"plan: {len(self.files)} file(s), format {self.out_format}, layout {self.layout}"]
        for f in self.files:
            kinds: dict[str, int] = {}
            for g in f.groups:
                kinds[type(g).__name__] = kinds.get(type(g).__name__, 0) + 1
            what = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            if f.same_as:
                what = f"the same as {f.same_as}: a hard link to it, or a copy with --no-links"
            lines.append(f"  {f.name}: {len(f.specs)} tensors, {f.nbytes / 1e6:.1f} MB ({what})")
        for src, name in self.other_files:
            lines.append(f"  {name}: copied")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- which groups


# ------------------------------------------------------------------------------- EP shards


# ------------------------------------------------------------------------------- into files


# ------------------------------------------------------------------------------- results


@dataclass
class Summary:
    tensors: int
    bytes_in: int
    bytes_out: int
    seconds: float
    files_written: int
    files_skipped: int
    errors: dict
    out_format: str
    layout: str
    #: of ``bytes_out``, the bytes of ``same_as`` files (hard links or copies, not converted again)
    bytes_same: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_in / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def render(self) -> str:
        lines = [
            f"{self.tensors} tensors, {self.bytes_in / 1e9:.3f} GB in -> {self.bytes_out / 1e9:.3f} GB out "
            + (f"({self.bytes_same / 1e9:.3f} GB of it the non-expert tensors every rank repeats: hard links to "
               "rank 0's files, or copies with --no-links) "
               if self.bytes_same else "")
            + f"in {self.seconds:.2f} s ({self.gbps:.2f} GB/s); {self.files_written} file(s) written, "
            f"{self.files_skipped} resumed"
        ]
        if self.errors:
            e = self.errors
            lines.append(
                f"{self.out_format} error over {e['linears']} linears: mean rel {e['mean_rel_err']:.4f}, "
                f"max rel {e['max_rel_err']:.4f}, SQNR {e['sqnr_db']:.1f} dB (min {e['min_sqnr_db']:.1f} dB)"
            )
        return "\n".join(lines)
