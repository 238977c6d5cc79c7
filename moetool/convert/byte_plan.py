"""Outputs that are byte ranges of the input: the plan ``moetool.convert.byte_executor`` executes (pure values).

When nothing is quantized and the experts of an unquantized checkpoint are stored per expert,
stacked, or fused as transformers v5 saves them (``experts.gate_up_proj`` [E, 2N, H], gate rows
then up rows, ``experts.down_proj`` [E, H, N]: the stacked layout under other names), every
output tensor of ``repack`` and ``shard`` is a concatenation of input bytes:

    Copy                         the tensor's bytes
    Stacked w13 [E', 2N, H]      for each expert: gate [N, H] then up [N, H] (or its slot of a stacked w13)
    Stacked w2  [E', H, N]       for each expert: down [H, N] (or its slot of a stacked w2)
    ExpertLinear gate / up / down  that linear's bytes (or rows [0, N) / [N, 2N) of a stacked slot)

so an output file is its safetensors header followed by a list of :class:`Span` (input file,
offset, length). The groups, names and files are the same as the torch executor's
(``moetool.convert.plan`` builds both); only the tensor specs come from the input headers here instead of
probing converted experts. A checkpoint this module does not fully understand (quantized, fp8,
input-first or interleaved fused experts, experts with biases or other tensors than ``weight``,
mismatched shapes...) is not
planned here: :func:`why_not_byte_copy` says why, and the torch executor takes it (and raises the
error, where there is one).
"""
from __future__ import annotations

from dataclasses import dataclass

from moetool.model.families import ModelSpec, MoELayerSpec
from moetool.read.checkpoint import Checkpoint
from moetool.read.safetensors import DTYPE_SIZES, TensorInfo
from moetool.errors import MoetoolError
from moetool.convert.plan import QUANTIZED_ONLY_SUFFIXES, ROLES, Copy, ExpertLinear, Group, Plan, Stacked
from moetool.convert.planning import non_expert_tensors

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + length) of input file ``file`` (relative to the checkpoint root)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class RawSpec:
    """An output tensor as its safetensors header entry describes it (``TensorSpec`` without torch)."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype_name]
        for d in self.shape:
            n *= d
        return n


@dataclass
class ByteFile:
    """One output safetensors file: ``header`` then the bytes of ``spans`` in order."""

    name: str
    header: bytes
    spans: list[Span]

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(s.length for s in self.spans)


# ---------------------------------------------------------------------------------- what qualifies


def why_not_byte_copy(ckpt: Checkpoint, spec: ModelSpec) -> str | None:
    """None when every expert and non-expert tensor of ``ckpt`` can be written as input bytes
    (dense weights, experts per expert, stacked or fused output-first, each expert like expert 0),
    else the reason."""
    if ckpt.config.get("quantization_config") is not None:
        return "quantized checkpoint"
    for name, info in ckpt.tensors.items():
        if info.dtype_name.startswith("F8_"):
            return f"{name}: fp8 tensor"
        if name.rpartition(".")[2] in QUANTIZED_ONLY_SUFFIXES:
            return f"{name}: part of a quantized linear"
    for layer in spec.moe_layers:
        kind = layer.storage.kind
        reason = (_per_expert_reason(ckpt, layer) if kind == "per-expert" else
                  _fused_reason(ckpt, layer) if kind == "fused" else _stacked_reason(ckpt, layer))
        if reason:
            return f"{layer.prefix}: {reason}"
    return None


def _per_expert_reason(ckpt: Checkpoint, layer: MoELayerSpec) -> str | None:
    st = layer.storage
    n, h = layer.intermediate, layer.hidden
    first = ckpt.tensors.get(f"{st.per_expert_bases(0)[0]}.weight")
    dtype = first.dtype_name if first else "no weight"
    if dtype not in FLOAT_DTYPES:
        return f"experts stored as {dtype}"
    want = [(dtype, (n, h)), (dtype, (n, h)), (dtype, (h, n))]  # gate, up, down
    for e in range(layer.n_stored):
        for base, w in zip(st.per_expert_bases(e), want):
            if ckpt.suffixes(base) != {"weight"}:
                return f"{base} stores {sorted(ckpt.suffixes(base))}, not only weight"
            info = ckpt.tensors[f"{base}.weight"]
            if (info.dtype_name, info.shape) != w:
                return f"{base}.weight is {info.dtype_name}{list(info.shape)}, not {w[0]}{list(w[1])}"
    return None


def _stacked_reason(ckpt: Checkpoint, layer: MoELayerSpec) -> str | None:
    st = layer.storage
    if st.kind != "stacked":
        return f"{st.kind} experts"
    n, h, e = layer.intermediate, layer.hidden, layer.n_stored
    for base, shape in ((st.gate_up, (e, 2 * n, h)), (st.down, (e, h, n))):
        if ckpt.suffixes(base, sep="_") != {"weight"}:
            return f"{base} stores {sorted(ckpt.suffixes(base, sep='_'))}, not only weight"
        info = ckpt.tensors[f"{base}_weight"]
        if info.dtype_name not in FLOAT_DTYPES or info.shape != shape:
            return f"{base}_weight is {info.dtype_name}{list(info.shape)}, not float{list(shape)}"
    return None


def _fused_reason(ckpt: Checkpoint, layer: MoELayerSpec) -> str | None:
    st = layer.storage
    if st.gate_up_input_first or st.down_input_first:
        return "fused experts stored input-first"
    if st.interleaved:
        return "fused experts with gate/up rows interleaved"
    if st.gate_up_bias or st.down_bias:
        return "fused experts with biases"
    n, h, e = layer.intermediate, layer.hidden, layer.n_stored
    for name, shape in ((st.gate_up, (e, 2 * n, h)), (st.down, (e, h, n))):
        info = ckpt.tensors[name]
        if info.dtype_name not in FLOAT_DTYPES or info.shape != shape:
            return f"{name} is {info.dtype_name}{list(info.shape)}, not float{list(shape)}"
    return None


def _experts_tensor(st, gate_up: bool) -> str:
    """The stacked (``w13_weight``) or fused (``gate_up_proj``) tensor holding every expert."""
    base = st.gate_up if gate_up else st.down
    return base if st.kind == "fused" else f"{base}_weight"


# ---------------------------------------------------------------------------------- groups as bytes


def copy_groups(ckpt: Checkpoint, spec: ModelSpec) -> tuple[list[Group], list[str]]:
    """Every tensor that is not a routed expert, copied, in input order (file, offset), with
    its home file: what ``non_expert_groups`` gives for a checkpoint that qualifies."""
    kept = non_expert_tensors(ckpt, spec)
    return [Copy(n, n) for n, _ in kept], [i.file for _, i in kept]


class ByteSource:
    """Specs and spans of each group of a qualifying checkpoint (``why_not_byte_copy`` is None)."""

    def __init__(self, ckpt: Checkpoint, spec: ModelSpec):
        self.ckpt = ckpt
        self.layers = {m.index: m for m in spec.moe_layers}

    def specs(self, g: Group) -> list[RawSpec]:
        if isinstance(g, Copy):
            info = self.ckpt.info(g.src)
            return [RawSpec(g.dst, info.dtype_name, info.shape)]
        if isinstance(g, Stacked):
            dtype, shape = self._linear_sig(self.layers[g.layer], g.which)
            return [RawSpec(f"{g.dst_base}_weight", dtype, (len(g.experts), *shape))]
        if isinstance(g, ExpertLinear):
            dtype, shape = self._linear_sig(self.layers[g.layer], g.role)
            return [RawSpec(f"{g.dst_base}.weight", dtype, shape)]
        raise MoetoolError(f"{type(g).__name__}: not a byte copy")

    def spans(self, g: Group) -> list[Span]:
        if isinstance(g, Copy):
            return [_whole(self.ckpt.info(g.src))]
        layer = self.layers[g.layer]
        if isinstance(g, Stacked):
            roles = ("gate", "up") if g.which == "w13" else ("down",)
            return [s for e in g.experts for r in roles for s in self._expert_role(layer, e, r)]
        return self._expert_role(layer, g.expert, g.role)

    def _linear_sig(self, layer: MoELayerSpec, which: str) -> tuple[str, tuple[int, ...]]:
        """dtype and shape of one expert's linear: gate / up [N, H], down or w2 [H, N], w13 [2N, H]."""
        n, h = layer.intermediate, layer.hidden
        st = layer.storage
        if st.kind != "per-expert":
            dtype = self.ckpt.tensors[_experts_tensor(st, which in ("w13", "gate", "up"))].dtype_name
        else:
            dtype = self.ckpt.tensors[f"{st.per_expert_bases(0)[0]}.weight"].dtype_name
        return dtype, {"w13": (2 * n, h), "gate": (n, h), "up": (n, h), "down": (h, n), "w2": (h, n)}[which]

    def _expert_role(self, layer: MoELayerSpec, e: int, role: str) -> list[Span]:
        st = layer.storage
        if st.kind == "per-expert":
            return [_whole(self.ckpt.tensors[f"{st.per_expert_bases(e)[ROLES.index(role)]}.weight"])]
        info = self.ckpt.tensors[_experts_tensor(st, role != "down")]
        slot = info.nbytes // info.shape[0]
        begin = info.begin + e * slot
        if role == "down":
            return [Span(info.file, begin, slot)]
        half = slot // 2  # gate rows [0, N), then up rows [N, 2N)
        return [Span(info.file, begin + (half if role == "up" else 0), half)]


def _whole(info: TensorInfo) -> Span:
    return Span(info.file, info.begin, info.nbytes)


def byte_files(plan: Plan, source: ByteSource) -> list[ByteFile]:
    """Each safetensors file of ``plan`` (built with ``source.specs``) to write as header +
    spans: all but those ``same_as`` another."""
    return [ByteFile(pf.name, pf.header(), [s for g in pf.groups for s in source.spans(g)])
            for pf in plan.files if not pf.same_as]


def coalesce(spans: list[Span]) -> list[Span]:
    """Adjacent spans of the same input file merged (experts stored one after another are one read)."""
    out: list[Span] = []
    for s in spans:
        if out and out[-1].file == s.file and out[-1].offset + out[-1].length == s.offset:
            out[-1] = Span(s.file, out[-1].offset, out[-1].length + s.length)
        elif s.length:
            out.append(s)
    return out
