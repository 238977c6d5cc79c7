"""Read one expert's linears from any on-disk storage, as format tensors or fp32.

A *linear* is ``{suffix: tensor}`` in the checkpoint's weight format (see formats/base.py).
Per-expert, fused (dense, or a format's fused layout: gpt-oss's mxfp4 release) and stacked
storages all come out the same way, so the converters and the verifier never branch on how a
checkpoint was laid out. Experts with biases (gpt-oss) have them read apart from the linears
(:meth:`ExpertReader.biases`), in the stored dtype: a bias is never quantized.
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, TypeVar

import torch

from moetool.model.families import ExpertStorage, ModelSpec, MoELayerSpec, describe
from moetool.read.checkpoint import Checkpoint
from moetool.errors import MoetoolError
from moetool.formats import FORMATS, detect_format, get_format, linear_format
from moetool.formats.base import WeightFormat

Linear = dict[str, torch.Tensor]
ROLES = ("gate", "up", "down")
T = TypeVar("T")


def read_ahead(read: Callable[[int], T], count: int, depth: int = 1) -> Iterator[T]:
    """``read(0)``, ..., ``read(count - 1)`` in order, the next ``depth`` started on threads while
    the caller works on the one before (disk reads overlap compute; depth + 1 results held at a
    time). A depth over 1 is for reads that one thread cannot keep up with: from the page
    cache, one thread copies at a few GB/s."""
    with ThreadPoolExecutor(depth, thread_name_prefix="moetool-read-ahead") as pool:
        ahead = deque(pool.submit(read, i) for i in range(min(depth, count)))
        for i in range(count):
            got = ahead.popleft().result()
            if i + depth < count:
                ahead.append(pool.submit(read, i + depth))
            yield got


class ExpertReader:
    """Reads experts of a described checkpoint. ``fmt`` is the experts' weight format."""

    def __init__(self, ckpt: Checkpoint, spec: ModelSpec | None = None, fmt: WeightFormat | None = None):
        self.ckpt = ckpt
        self.spec = spec or describe(ckpt.config, ckpt.tensors)
        self.fmt = fmt or detect_expert_format(ckpt, self.spec)

    # -- format tensors ------------------------------------------------------------------
    def _linear(self, base: str, sep: str = ".", scratch: bool = False) -> Linear:
        t = {s: self.ckpt.get(f"{base}{sep}{s}", scratch=f"read.{s}" if scratch else None)
             for s in self.fmt.suffixes if f"{base}{sep}{s}" in self.ckpt}
        if self.fmt.suffixes[0] not in t:
            raise MoetoolError(f"{base}{sep}{self.fmt.suffixes[0]}: not found ({self.fmt.name} weights expected)")
        return t

    def linear(self, base: str, scratch: bool = False) -> Linear:
        """A plain linear (shared experts, dense MLPs) by its base name. ``scratch``: read into
        this thread's reusable buffers (``Checkpoint.get``): for a linear that is converted
        and dropped before the thread reads the next one."""
        return self._linear(base, scratch=scratch)

    def gate_up_down(self, layer: MoELayerSpec, e: int) -> tuple[Linear, Linear, Linear]:
        """Expert e's (gate [N,H], up [N,H], down [H,N]) linears in the checkpoint's format."""
        _check_expert(layer, e)
        st = layer.storage
        if st.kind == "per-expert":
            return tuple(self._linear(b) for b in st.per_expert_bases(e))  # type: ignore[return-value]
        if st.kind == "stacked":
            gate, up = self.fmt.split_rows(self._stacked_slot(st.gate_up, e), [layer.intermediate, layer.intermediate])
            return gate, up, self._stacked_slot(st.down, e)
        if st.fused_suffixes:
            return self._fused_quantized(layer, st, e)
        gate, up, down = self._fused_dense(layer, st, e)
        return {"weight": gate}, {"weight": up}, {"weight": down}

    def expert_linears(self, layer: MoELayerSpec, e: int, roles: tuple[str, ...]) -> dict[str, Linear]:
        """Only the linears of ``roles`` ("gate", "up", "down") of expert e: per-expert and
        stacked storage read just those bytes (a fused tensor's row holds them all)."""
        _check_expert(layer, e)
        st = layer.storage
        if st.kind == "per-expert":
            bases = dict(zip(("gate", "up", "down"), st.per_expert_bases(e)))
            return {r: self._linear(bases[r]) for r in roles}
        if st.kind == "stacked":
            out: dict[str, Linear] = {}
            if "gate" in roles or "up" in roles:
                gate, up = self.fmt.split_rows(self._stacked_slot(st.gate_up, e), [layer.intermediate] * 2)
                out.update({r: t for r, t in (("gate", gate), ("up", up)) if r in roles})
            if "down" in roles:
                out["down"] = self._stacked_slot(st.down, e)
            return out
        return {r: t for r, t in zip(("gate", "up", "down"), self.gate_up_down(layer, e)) if r in roles}

    def w13(self, layer: MoELayerSpec, e: int) -> Linear:
        """Expert e's fused gate+up linear [2N, H] (gate rows first)."""
        if layer.storage.kind == "stacked":
            _check_expert(layer, e)
            return self._stacked_slot(layer.storage.gate_up, e)
        gate, up, _ = self.gate_up_down(layer, e)
        return self.fmt.cat_rows([gate, up])

    def down(self, layer: MoELayerSpec, e: int) -> Linear:
        if layer.storage.kind == "stacked":
            _check_expert(layer, e)
            return self._stacked_slot(layer.storage.down, e)
        return self.gate_up_down(layer, e)[2]

    def _stacked_slot(self, base: str, e: int) -> Linear:
        t = {}
        for s in self.fmt.suffixes:
            name = f"{base}_{s}"
            if name in self.ckpt:
                t[s] = self.ckpt.get_rows(name, e)
        if self.fmt.suffixes[0] not in t:
            raise MoetoolError(f"{base}_{self.fmt.suffixes[0]}: not found ({self.fmt.name} weights expected)")
        return t

    def _fused_quantized(self, layer: MoELayerSpec, st: ExpertStorage, e: int) -> tuple[Linear, Linear, Linear]:
        """Expert e of a format's fused layout: each fused tensor's rows [2N, ...] / [H, ...]
        back in the format's own tensors, gate and up rows apart."""
        names = getattr(self.fmt, "fused_names", {})
        n = layer.intermediate
        gate, up, down = {}, {}, {}
        for suffix, fused in names.items():
            try:
                gu = self.fmt.from_fused(suffix, self.ckpt.get_rows(f"{st.gate_up}_{fused}", e))  # [2N, ...]
                down[suffix] = self.fmt.from_fused(suffix, self.ckpt.get_rows(f"{st.down}_{fused}", e))  # [H, ...]
            except MoetoolError as err:
                raise MoetoolError(f"{st.gate_up}_{fused}: {err}") from None
            gate[suffix], up[suffix] = ((gu[0::2], gu[1::2]) if st.interleaved else (gu[:n], gu[n:]))
            gate[suffix], up[suffix] = gate[suffix].contiguous(), up[suffix].contiguous()
        return gate, up, down

    def _fused_dense(self, layer: MoELayerSpec, st: ExpertStorage, e: int):
        if self.fmt.quantized:
            raise MoetoolError(f"{st.gate_up}: fused expert tensors are only read unquantized, found {self.fmt.name}")
        n = layer.intermediate
        gu = self.ckpt.get_rows(st.gate_up, e)  # [2N, H] or [H, 2N]
        if st.gate_up_input_first:
            gu = gu.t()
        gate, up = (gu[0::2], gu[1::2]) if st.interleaved else (gu[:n], gu[n:])
        down = self.ckpt.get_rows(st.down, e)
        if st.down_input_first:
            down = down.t()
        return gate.contiguous(), up.contiguous(), down.contiguous()

    # -- biases ----------------------------------------------------------------------------
    def biases(self, layer: MoELayerSpec, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Expert e's (gate [N], up [N], down [H]) biases in the stored dtype, or None."""
        st = layer.storage
        if not st.biased:
            return None
        _check_expert(layer, e)
        n = layer.intermediate
        if st.kind == "per-expert":
            return tuple(self.ckpt.get(f"{b}.bias") for b in st.per_expert_bases(e))  # type: ignore[return-value]
        if st.kind == "stacked":
            gu, down = self.ckpt.get_rows(f"{st.gate_up}_bias", e), self.ckpt.get_rows(f"{st.down}_bias", e)
        else:
            gu, down = self.ckpt.get_rows(st.gate_up_bias, e), self.ckpt.get_rows(st.down_bias, e)
        interleaved = st.kind == "fused" and st.interleaved
        gate, up = (gu[0::2], gu[1::2]) if interleaved else (gu[:n], gu[n:])
        return gate.contiguous(), up.contiguous(), down

    def stacked_biases(self, layer: MoELayerSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every stored expert's biases, stacked: (w13 [E, 2N] gate then up, w2 [E, H]), or None."""
        if not layer.storage.biased:
            return None
        per = [self.biases(layer, e) for e in range(layer.n_stored)]
        return (torch.stack([torch.cat([g, u]) for g, u, _ in per]), torch.stack([d for _, _, d in per]))

    # -- fp32 -------------------------------------------------------------------------------
    def expert_fp32(self, layer: MoELayerSpec, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [N,H], up [N,H], down [H,N]) dequantized to float32."""
        return tuple(self.dequantize(lin, f"layer {layer.index} expert {e}") for lin in self.gate_up_down(layer, e))  # type: ignore[return-value]

    def iter_fp32(self, layer: MoELayerSpec, device: torch.device, roles: tuple[str, ...] = ROLES,
                  stop: threading.Event | None = None) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
        """(e, the ``roles`` linears of expert e in float32 on ``device``) for every expert in
        order, each expert's stored bytes (only those linears) read once while a thread reads
        the next one's: host memory holds two experts' stored bytes, never a layer. On a GPU
        the reads go to page-locked buffers (this reader's checkpoint then reads that way) and
        the bytes are dequantized there. ``stop``: set by another thread to end early."""
        if device.type == "cuda":
            self.ckpt.pin_memory = True
        reads = read_ahead(lambda e: self.expert_linears(layer, e, roles), layer.num_experts)
        for e, lins in enumerate(reads):
            if stop is not None and stop.is_set():
                return
            yield e, tuple(self.dequantize({k: v.to(device, non_blocking=True) for k, v in lins[r].items()},
                                           f"layer {layer.index} expert {e}").float() for r in roles)

    def router_fp32(self, layer: MoELayerSpec, device: torch.device | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(router weight [E, H], its score correction bias [E] or None, its logit bias [E] or
        None: gpt-oss) of the MoE layer in float32, on ``device`` (default: where read)."""
        get = lambda name: self.ckpt.get(name).float().to(device) if name else None  # noqa: E731
        return get(layer.router_weight), get(layer.correction_bias), get(layer.router_bias)

    def shared_fp32(self, layer: MoELayerSpec, device: torch.device | None = None):
        """(gate, up, down, shared_gate_weight|None) of the shared expert in float32, on
        ``device`` (default: where read), or None."""
        if layer.shared_bases is None:
            return None
        g, u, d = (self.dequantize_any(b).float().to(device) for b in layer.shared_bases)
        sg = self.ckpt.get(layer.shared_gate_weight).float().to(device) if layer.shared_gate_weight else None
        return g, u, d, sg

    def dequantize(self, lin: Linear, where: str) -> torch.Tensor:
        try:
            return self.fmt.dequantize(lin)
        except MoetoolError as err:
            raise MoetoolError(f"{where}: {err}") from None

    def dequantize_any(self, base: str) -> torch.Tensor:
        """A linear outside the experts, in whatever format it is stored (may differ from experts')."""
        fmt, lin = self.plain_linear(base)
        try:
            return fmt.dequantize(lin)
        except MoetoolError as err:
            raise MoetoolError(f"{base}: {err}") from None

    def plain_linear(self, base: str) -> tuple[WeightFormat, Linear]:
        """(its format, its tensors) for a linear outside the routed experts: the checkpoint's
        format when it has all that format's tensors, dense when it is in the ignore list."""
        fmt = self.linear_format(base)
        return fmt, {s: self.ckpt.get(f"{base}.{s}") for s in fmt.suffixes if f"{base}.{s}" in self.ckpt}

    def linear_format(self, base: str) -> WeightFormat:
        sufs = self.ckpt.suffixes(base)
        info = self.ckpt.tensors.get(f"{base}.weight")
        try:
            return linear_format(self.fmt, sufs, info.dtype if info else None)
        except MoetoolError as err:
            raise MoetoolError(f"{base}: {err}") from None


def _check_expert(layer: MoELayerSpec, e: int) -> None:
    if not 0 <= e < layer.n_stored:
        raise MoetoolError(f"layer {layer.index}: expert {e} out of range (0..{layer.n_stored - 1})")


def detect_expert_format(ckpt: Checkpoint, spec: ModelSpec) -> WeightFormat:
    """The format of the routed experts, from config.json and the first expert's tensors."""
    layer = spec.moe_layers[0]
    st = layer.storage
    if st.kind == "per-expert":
        base = st.per_expert_bases(0)[0]
        sufs, main = ckpt.suffixes(base), f"{base}.weight"
    elif st.kind == "stacked":
        sufs, main = ckpt.suffixes(st.gate_up, sep="_") - {"bias"}, f"{st.gate_up}_weight"
    elif st.fused_suffixes:
        return _fused_format(ckpt, layer)
    else:
        sufs, main = {"weight"}, st.gate_up
    method = (ckpt.config.get("quantization_config") or {}).get("quant_method")
    fused_config = next((c for c in FORMATS.values() if method and getattr(c, "fused_config_method", None) == method),
                        None)
    if fused_config is not None:  # a fused layout's config on experts stored otherwise: EP rank folders of it
        fmt = get_format(fused_config.name)
        missing = [s for s in fmt.suffixes if s not in sufs]
        if missing:
            raise MoetoolError(f"{ckpt.root}: experts of {layer.prefix}: config.json declares quant_method "
                               f"{method!r} ({fmt.name}) but no tensor ends in {', '.join(missing)}")
        return fmt
    info = ckpt.tensors.get(main)
    try:
        fmt = detect_format(ckpt.config, sufs, info.dtype if info else None)
    except MoetoolError as err:
        raise MoetoolError(f"{ckpt.root}: experts of {layer.prefix}: {err}") from None
    # a tensor of the linear that the format does not read would be dropped from every output
    # (a static activation scale, input_scale, that the kept config still declares)
    unread = sorted(sufs - set(fmt.suffixes) - {"bias"})
    if unread:
        stored = f"{base}.{unread[0]}" if st.kind == "per-expert" else f"{st.gate_up}_{unread[0]}"
        raise MoetoolError(f"{stored}: a tensor of the experts that {fmt.name} does not read (it holds "
                           f"{', '.join(fmt.suffixes)}); moetool would drop it")
    return fmt


def _fused_format(ckpt: Checkpoint, layer: MoELayerSpec) -> WeightFormat:
    """The format whose fused layout (``fused_names``) stores the layer's quantized fused
    experts, as config.json's ``quant_method`` declares it."""
    st = layer.storage
    stored = set(st.fused_suffixes)
    method = (ckpt.config.get("quantization_config") or {}).get("quant_method")
    for cls in FORMATS.values():
        if set(getattr(cls, "fused_names", {}).values()) == stored:
            if method != cls.fused_config_method:
                raise MoetoolError(f"{ckpt.root}: experts of {layer.prefix} are stored as {st.gate_up}_"
                                   f"{'/'.join(st.fused_suffixes)} ({cls.name}'s fused layout) but config.json "
                                   f"declares quant_method {method!r}, not {cls.fused_config_method!r}")
            return get_format(cls.name)
    raise MoetoolError(f"{ckpt.root}: experts of {layer.prefix}: no weight format stores fused experts as "
                       f"{st.gate_up}_{'/'.join(st.fused_suffixes)}")


