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
probing converted experts. A checkpoint this module does not fully understand (input-first or
interleaved fused experts, experts with biases or other tensors than ``weight``, mismatched
shapes...) is not planned here: :func:`why_not_byte_copy` says why, and the torch executor
takes it (and raises the error, where there is one).

A quantized checkpoint is planned here for ``shard`` (``quantized=True``) when its experts are
stored per expert (or stacked, staying stacked), every expert alike: each linear's tensors
(``weight`` + ``weight_scale_inv``...) are copied as they are, in the format's order (its
card: ``moetool.formats.cards``), and a stacked w13's tensor of each suffix is the gate's rows
then the up's, expert after expert, as ``cat_rows`` stacks them for every format whose tensors
are all cut along N. That is taken on trust here (no torch); ``moetool.convert.byte_check``
builds the torch executor's plan of the same shard and the copy is kept only where the two
agree (headers, manifest, one expert's bytes per layer shape).
"""
from __future__ import annotations

from dataclasses import dataclass

from moetool.formats.cards import cards
from moetool.model.families import ModelSpec, MoELayerSpec
from moetool.read.checkpoint import Checkpoint
from moetool.read.safetensors import DTYPE_SIZES, TensorInfo
from moetool.errors import MoetoolError
from moetool.convert.plan import QUANTIZED_ONLY_SUFFIXES, ROLES, Copy, ExpertLinear, Group, Layout, Plan, Stacked
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


def why_not_byte_copy(ckpt: Checkpoint, spec: ModelSpec, *, quantized: bool = False,
                      layout: Layout | None = None) -> str | None:
    """None when every expert and non-expert tensor of ``ckpt`` can be written as input bytes
    (dense weights, experts per expert, stacked or fused output-first, each expert like expert 0),
    else the reason. ``quantized``: a quantized checkpoint may qualify too (see the module
    docstring), written in ``layout``."""
    if is_quantized(ckpt):
        return _quantized_reason(ckpt, spec, layout) if quantized else "quantized checkpoint"
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


def is_quantized(ckpt: Checkpoint) -> bool:
    """A quantization_config, an fp8 tensor, or a tensor only quantized linears store."""
    return ckpt.config.get("quantization_config") is not None or any(
        info.dtype_name.startswith("F8_") or name.rpartition(".")[2] in QUANTIZED_ONLY_SUFFIXES
        for name, info in ckpt.tensors.items())


def suffix_order(stored: set[str]) -> list[str] | None:
    """The order a format writes a linear's tensors in (its card's ``suffixes``, then its
    optional ones), for the one format whose tensors ``stored`` are; None when no format, or
    more than one, stores exactly these."""
    orders = [[s for s in (*c["suffixes"], *c["optional_suffixes"]) if s in stored] for c in cards()
              if set(c["suffixes"]) <= stored <= {*c["suffixes"], *c["optional_suffixes"]}]
    return orders[0] if len(orders) == 1 else None


def _quantized_reason(ckpt: Checkpoint, spec: ModelSpec, layout: Layout | None) -> str | None:
    """Why a quantized checkpoint cannot be written as input bytes in ``layout`` (None: it can)."""
    for name, info in ckpt.tensors.items():  # the torch path refuses these: leave the error to it
        base, _, suffix = name.rpartition(".")
        if suffix == "weight" and info.dtype_name.startswith("F8_") and ckpt.suffixes(base) == {"weight"}:
            return f"{name}: fp8 weight without its scale"
    for layer in spec.moe_layers:
        st = layer.storage
        if st.kind == "fused":
            return f"{layer.prefix}: quantized fused experts"
        if st.biased:
            return f"{layer.prefix}: experts with biases"
        if st.kind == "stacked" and layout != "stacked":
            return f"{layer.prefix}: quantized stacked experts cut per expert"
        reason = _quantized_per_expert_reason(ckpt, layer, layout) if st.kind == "per-expert" else \
            _quantized_stacked_reason(ckpt, layer)
        if reason:
            return f"{layer.prefix}: {reason}"
    return None


def _quantized_per_expert_reason(ckpt: Checkpoint, layer: MoELayerSpec, layout: Layout | None) -> str | None:
    bases = layer.storage.per_expert_bases(0)
    want = [_signature(ckpt, b, ".") for b in bases]  # gate, up, down of expert 0
    if want[0] != want[1] or not want[0]:
        return f"{bases[1]} stores {want[1]}, the gate {want[0]}"
    if set(want[2]) != set(want[0]) or suffix_order(set(want[0])) is None:
        return f"{bases[0]} stores {sorted(want[0])}, no format's tensors"
    if layout == "stacked":
        for s, (dtype, shape) in want[0].items():  # stacking cuts every tensor along N
            if len(shape) == 1 and dtype.startswith(("I", "U")):
                return f"{bases[0]}.{s} is {dtype}{list(shape)}, a shape rather than rows"
    for e in range(1, layer.n_stored):
        for base, w in zip(layer.storage.per_expert_bases(e), want):
            if _signature(ckpt, base, ".") != w:
                return f"{base} differs from expert 0's"
    return None


def _quantized_stacked_reason(ckpt: Checkpoint, layer: MoELayerSpec) -> str | None:
    st = layer.storage
    gate_up, down = _signature(ckpt, st.gate_up, "_"), _signature(ckpt, st.down, "_")
    if set(gate_up) != set(down) or suffix_order(set(gate_up)) is None:
        return f"{st.gate_up} stores {sorted(gate_up)}, {st.down} {sorted(down)}"
    for sig in (gate_up, down):
        if any(not shape or shape[0] != layer.n_stored for _, shape in sig.values()):
            return f"{st.gate_up}: a tensor without {layer.n_stored} experts in its first dimension"
    return None


def _signature(ckpt: Checkpoint, base: str, sep: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{suffix: (dtype name, shape)} of the tensors stored under ``base``."""
    return {s: (ckpt.tensors[f"{base}{sep}{s}"].dtype_name, ckpt.tensors[f"{base}{sep}{s}"].shape)
            for s in sorted(ckpt.suffixes(base, sep))}


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
        self.spec = spec
        self.layers = {m.index: m for m in spec.moe_layers}

    def specs(self, g: Group) -> list[RawSpec]:
        if isinstance(g, Copy):
            info = self.ckpt.info(g.src)
            return [RawSpec(g.dst, info.dtype_name, info.shape)]
        if isinstance(g, Stacked):
            return [RawSpec(f"{g.dst_base}_{s}", dtype, (len(g.experts), *shape))
                    for s, (dtype, shape) in self._linear_sigs(self.layers[g.layer], g.which).items()]
        if isinstance(g, ExpertLinear):
            return [RawSpec(f"{g.dst_base}.{s}", dtype, shape)
                    for s, (dtype, shape) in self._linear_sigs(self.layers[g.layer], g.role).items()]
        raise MoetoolError(f"{type(g).__name__}: not a byte copy")

    def spans(self, g: Group) -> list[Span]:
        if isinstance(g, Copy):
            return [_whole(self.ckpt.info(g.src))]
        if isinstance(g, Stacked):  # each tensor of the format: every expert's slice in turn
            slices = [self.slice_spans(g, i) for i in range(len(g.experts))]
            return [span for s in self.suffixes(self.layers[g.layer]) for part in slices for span in part[s]]
        return [span for part in self.slice_spans(g, 0).values() for span in part]

    def slice_spans(self, g: Group, i: int) -> dict[str, list[Span]]:
        """The spans of each tensor (by suffix, in the format's order) of expert ``i`` of a
        stacked group, or of an expert linear (``i`` = 0)."""
        layer = self.layers[g.layer]
        if isinstance(g, Stacked):
            e = g.experts[i]
            roles = ("gate", "up") if g.which == "w13" else ("down",)
            if layer.storage.kind != "per-expert" and g.which == "w13":
                roles = ("gate_up",)  # the stored w13 slot as it is
            return {s: [span for r in roles for span in self._role_spans(layer, e, r, s)]
                    for s in self.suffixes(layer)}
        return {s: self._role_spans(layer, g.expert, g.role, s) for s in self.suffixes(layer)}

    def suffixes(self, layer: MoELayerSpec) -> list[str]:
        """The tensors of one expert linear, in the format's order (dense: ``weight``)."""
        st = layer.storage
        if st.kind == "fused":
            return ["weight"]
        stored = self.ckpt.suffixes(*((st.per_expert_bases(0)[0], ".") if st.kind == "per-expert"
                                      else (st.gate_up, "_")))
        return suffix_order(stored) or ["weight"]

    def _linear_sigs(self, layer: MoELayerSpec, which: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{suffix: (dtype, shape)} of one expert's linear: gate / up [N, ...], down or w2
        [H, ...], w13 (gate rows then up rows) [2N, ...] for a dense weight."""
        st = layer.storage
        gate_up = which in ("w13", "gate", "up")
        if st.kind == "fused":
            dtype = self.ckpt.tensors[_experts_tensor(st, gate_up)].dtype_name
            n, h = layer.intermediate, layer.hidden
            return {"weight": (dtype, {"w13": (2 * n, h), "gate": (n, h), "up": (n, h), "down": (h, n), "w2": (h, n)}[which])}
        out = {}
        for s in self.suffixes(layer):
            if st.kind == "per-expert":
                bases = st.per_expert_bases(0)
                info = self.ckpt.tensors[f"{bases[0 if gate_up else 2]}.{s}"]
                rows = info.shape[0] * (2 if which == "w13" else 1)  # gate and up: the same shapes
                out[s] = (info.dtype_name, (rows, *info.shape[1:]))
            else:
                info = self.ckpt.tensors[f"{st.gate_up if gate_up else st.down}_{s}"]
                shape = info.shape[1:]
                if which in ("gate", "up"):  # a dense weight's half (quantized stacked experts stay stacked)
                    shape = (shape[0] // 2, *shape[1:])
                out[s] = (info.dtype_name, shape)
        return out

    def _role_spans(self, layer: MoELayerSpec, e: int, role: str, suffix: str) -> list[Span]:
        """Expert e's tensor ``suffix`` of ``role`` ("gate_up": a stacked w13 slot whole)."""
        st = layer.storage
        if st.kind == "per-expert":
            return [_whole(self.ckpt.tensors[f"{st.per_expert_bases(e)[ROLES.index(role)]}.{suffix}"])]
        if st.kind == "fused":
            info = self.ckpt.tensors[_experts_tensor(st, role != "down")]
        else:
            info = self.ckpt.tensors[f"{st.gate_up if role != 'down' else st.down}_{suffix}"]
        slot = info.nbytes // info.shape[0]
        begin = info.begin + e * slot
        if role in ("down", "gate_up"):
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
