"""``moetool verify --whole-model``: the converted model end to end against the unquantized
checkpoint run by transformers' own modules.

Every rank runs the converted model on its dp group's token ids: embeddings, each decoder layer
(transformers' attention, norms and dense MLPs filled from the rank's own shard folder: every
non-expert tensor comes from the shards; the MoE block (router, routed and shared experts)
replaced by moetool's distributed forward, ``run_moe_layer``, over all ranks: route -> dispatch
-> experts -> combine, each rank holding only its own experts of the layer), the final norm and
``lm_head``. The ranks of a dp group replicate the attention (DP attention).

The first rank of each dp group also runs the reference on its group's tokens, layer by layer:
transformers' decoder layer (its own router and experts) filled from ``--ref``, on the
reference's own residual stream (free-running) and on the converted stream's input
(teacher-forced: the layer's own error, which names the layer that diverges even when earlier
layers' errors accumulate); the attention, the MoE block, its router and its shared expert
alone, each side on the same input. At any time a rank holds one decoder layer of each side,
the residual streams, and the embeddings / ``lm_head`` while they are used. Before any rank
starts, the parent checks that both checkpoints hold every tensor transformers' modules need.

Rows of the report: ``embed``, every decoder layer, ``head`` (final norm + lm_head), and the
logits: KL(reference || converted) per token (mean, p99, max), top-1 agreement, perplexities
with ``--text``. Letters: B = sequences per dp group, S = sequence length, T = B*S, H = hidden,
V = vocabulary.
"""
from __future__ import annotations

import json
import math
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from moetool.errors import MoetoolError, VerificationFailed
from moetool.formats.registry import FORMATS
from moetool.model.families import describe, text_config
from moetool.read import code_files
from moetool.read.checkpoint import open_checkpoint
from moetool.read.experts import ExpertReader
from moetool.read.order import EMBED_STAGE, LAST_STAGE, read_verify_inputs_ahead
from moetool.read.shards import EPShards
from moetool.verify import fork_server
from moetool.verify.driver import THRESHOLDS as MOE_THRESHOLDS
from moetool.verify.driver import (check_files_present, check_reference, check_timeout, process_started,
                                   resolve_backend)
from moetool.verify.hf_layers import Skeleton, capture, causal_lm_class, hf_config, require_transformers
from moetool.verify.launch import spawn_world
from moetool.verify.numerics import NUMERICS, model_numerics
from moetool.verify.reference import shared_forward
from moetool.verify.router import route
from moetool.verify.topology import Topology

#: Pass thresholds of the whole-model check per shard format (data; the measured values on the
#: tiny families are in docs/guide.md):
#:   moe_rel_err: the MoE block alone (teacher-forced: both sides on the converted block's input);
#:   moe_token_rel_err: its worst token (a wrong expert or scale hides in the block's total
#:     behind int4 noise, not in the tokens it serves; about 2.3x the largest honest value);
#:   layer_rel_err: a MoE decoder layer alone, relative to what the layer adds to the stream;
#:   kl_mean / kl_max: KL(reference || converted) of the next-token distributions, per token;
#:   top1: least share of tokens whose most likely next token agrees.
#: Parts moetool never quantizes (embeddings, attention, norms, dense MLPs, lm_head) must agree
#: within EXACT_REL_ERR (a dequantized fp8 original rewritten in bf16 is at most 2^-9 off per
#: weight and stays inside it; a wrong tensor does not).
#: The logits' limits are the served numerics' measured values with margin, on the largest model
#: of the test suite, `moetool demo`'s (random DeepSeek-V3-style, hidden 256, 2 MoE layers, 2 x
#: 128 tokens; its random attention amplifies a layer's error about 3x down the stream, more than
#: trained models do): KL mean / max, top-1 = dense 1.0e-4 / 0.024 / 100 %, fp8-block 3.6e-3 /
#: 0.104 / 91.4 %, fp8-channel 3.8e-3 / 0.086 / 90.2 %, int4-group (g64) 1.5e-2 / 0.128 / 76.2 %.
#: A wrong tensor is named by its row long before the logits (the fault tests).
WM_THRESHOLDS: dict[str, dict[str, float]] = {
    "dense": {"moe_rel_err": MOE_THRESHOLDS["dense"]["rel_err"], "layer_rel_err": 0.01, "moe_token_rel_err": 0.05,
              "kl_mean": 1e-3, "kl_max": 0.1, "top1": 0.98},
    "fp8-block": {"moe_rel_err": MOE_THRESHOLDS["fp8-block"]["rel_err"], "layer_rel_err": 0.08, "moe_token_rel_err": 0.3,
                  "kl_mean": 0.02, "kl_max": 0.3, "top1": 0.8},
    "fp8-channel": {"moe_rel_err": MOE_THRESHOLDS["fp8-channel"]["rel_err"], "layer_rel_err": 0.08, "moe_token_rel_err": 0.3,
                    "kl_mean": 0.02, "kl_max": 0.3, "top1": 0.8},
    "int4-group": {"moe_rel_err": MOE_THRESHOLDS["int4-group"]["rel_err"], "layer_rel_err": 0.25, "moe_token_rel_err": 0.6,
                   "kl_mean": 0.05, "kl_max": 0.5, "top1": 0.6},
}
EXACT_REL_ERR = 0.01


def thresholds_for(fmt: str) -> dict[str, float]:
    """The format's row of WM_THRESHOLDS; a format without one (registered later) gets limits
    derived from its MoE-block tolerance (``verify_tolerances``), the logits' from int4's."""
    if fmt in WM_THRESHOLDS:
        return {**WM_THRESHOLDS[fmt], "exact_rel_err": EXACT_REL_ERR}
    rel = MOE_THRESHOLDS.get(fmt, MOE_THRESHOLDS["dense"])["rel_err"]
    return {**WM_THRESHOLDS["int4-group"], "moe_rel_err": rel, "layer_rel_err": rel, "moe_token_rel_err": 3 * rel,
            "exact_rel_err": EXACT_REL_ERR}


#: the phases of a distributed MoE block (``moetool.verify.layer.PHASES``; not imported: that
#: module loads the kernels, which the parent never does)
MOE_PHASES = ("route", "dispatch", "experts", "combine", "shared")

#: activations moetool's MoE runtime runs its experts with (SwiGLU)
MOE_ACTS = ("silu", "swish")


@dataclass(frozen=True)
class WholeModelOptions:
    dp: int = 1
    ep: int = 2
    tokens: int = 256  # per dp group: sequences x seq_len
    seq_len: int = 128
    text: str | None = None  # a text file tokenized with --ref's tokenizer; else seeded random ids
    seed: int = 0
    backend: str | None = None
    dispatch: str = "allgather"
    experts: str = "torch"
    transport: str = "auto"
    chunk_size: int = 4096
    timeout_s: float = 900.0
    numerics: str = "served"  # the MoE blocks' numerics (moetool.verify.numerics): served | exact


# ------------------------------------------------------------------------------------ report


@dataclass
class RowReport:
    """One row: ``embed``, a decoder layer (its index) or ``head``.

    stream_rel_err: the residual stream after this row, converted vs reference, each on its own
    stream (errors of earlier rows included); layer_rel_err: this row alone on the converted
    input, relative to what it adds (a layer) or to its output (embed, head); attn_rel_err and
    mlp_rel_err: the attention and the MLP / MoE block alone on the converted input."""

    name: str
    kind: str  # embed | dense | moe | head
    stream_rel_err: float
    layer_rel_err: float
    attn_rel_err: float | None = None
    mlp_rel_err: float | None = None
    #: MoE layers: the worst token of the block; the router's [T, E] weights; the shared expert
    moe_token_max_rel_err: float | None = None
    router_rel_err: float | None = None
    shared_rel_err: float | None = None
    passed: bool = True
    reason: str = ""


@dataclass
class WholeModelReport:
    shards: str
    reference: str
    format: str
    options: dict
    thresholds: dict
    tokens: dict  # source, dp groups, sequences per group, seq_len
    rows: list[RowReport]
    logits: dict  # kl_mean, kl_p99, kl_max, top1, ppl_reference, ppl_converted
    failures: list[str] = field(default_factory=list)
    #: per rank: seconds per phase (build, read_shards, converted_forward (of it moe_route,
    #: moe_dispatch, moe_experts, moe_combine, moe_shared), read_reference, reference_forward,
    #: compare), the same per row (``row_timings_s``: {row: {phase: seconds}}) and memory
    #: (peak RSS; the most weights filled at once)
    ranks: list[dict] = field(default_factory=list)
    #: the parent's timeline, seconds: imported_s (this process's start to the check's entry:
    #: its imports), startup_s (to the ranks' spawn: the inputs checked), then from the spawn:
    #: checked_s (transformers' modules checked), ranks_s, wall_s, and when the last rank
    #: ended each of its steps (rank_start_s, rank_built_s, rank_layer_<i>_s, rank_head_s,
    #: rank_checked_s: its files' sha256 passed)
    timings_s: dict = field(default_factory=dict)
    #: MoE layers after the decoder (DeepSeek-V3's multi-token prediction), which the causal
    #: LM does not run: the MoE-only check covers their blocks
    mtp_layers: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def first_divergent(self) -> str | None:
        return next((r.name for r in self.rows if not r.passed), None)

    def to_json(self) -> dict:
        return {"mode": "whole-model", "shards": self.shards, "reference": self.reference, "format": self.format,
                "passed": self.passed, "first_divergent": self.first_divergent, "failures": self.failures,
                "options": self.options, "thresholds": self.thresholds, "tokens": self.tokens,
                "rows": [asdict(r) for r in self.rows], "logits": self.logits, "ranks": self.ranks,
                "timings_s": self.timings_s, "mtp_layers": self.mtp_layers}

    def render(self) -> str:
        o, t = self.options, self.tokens
        head = (f"verify --whole-model {self.shards} against {self.reference} (transformers): format {self.format}, "
                f"ep {o['ep']}, dp {o['dp']}, {t['sequences']} x {t['seq_len']} tokens per dp group from "
                f"{t['source']}, backend {o['backend']}, numerics {o.get('numerics', 'served')}")
        fmt = lambda v: "-" if v is None else f"{v:.2e}"  # noqa: E731
        lines = [head, f"{'row':>6}  {'kind':>5}  {'stream err':>10}  {'own err':>9}  {'attn err':>9}  "
                       f"{'mlp/moe err':>11}  {'worst tok':>9}  {'router':>9}  {'shared':>9}  result"]
        for r in self.rows:
            lines.append(f"{r.name:>6}  {r.kind:>5}  {fmt(r.stream_rel_err):>10}  {fmt(r.layer_rel_err):>9}  "
                         f"{fmt(r.attn_rel_err):>9}  {fmt(r.mlp_rel_err):>11}  {fmt(r.moe_token_max_rel_err):>9}  "
                         f"{fmt(r.router_rel_err):>9}  {fmt(r.shared_rel_err):>9}  "
                         f"{'PASS' if r.passed else 'FAIL: ' + r.reason}")
        lg = self.logits
        line = (f"logits: KL(ref || converted) mean {lg['kl_mean']:.2e}, p99 {lg['kl_p99']:.2e}, max {lg['kl_max']:.2e}; "
                f"top-1 agreement {100 * lg['top1']:.1f}%")
        if lg.get("ppl_reference") is not None:
            line += f"; perplexity reference {lg['ppl_reference']:.3f}, converted {lg['ppl_converted']:.3f}"
        lines.append(line)
        if self.ranks:
            slowest = {p: max(r["timings_s"].get(p, 0.0) for r in self.ranks)
                       for p in dict.fromkeys(p for r in self.ranks for p in r["timings_s"])}
            lines.append("time (s, slowest rank): " + ", ".join(f"{p.replace('_', ' ')} {t:.3g}"
                                                               for p, t in slowest.items()))
            most = lambda key: max(r["memory"].get(key, 0.0) for r in self.ranks)  # noqa: E731
            lines.append(f"memory: weights held at once at most {most('converted_weights_peak_mb'):.3g} MiB converted, "
                         f"{most('reference_weights_peak_mb'):.3g} MiB reference; peak RSS of a rank "
                         f"{most('rss_peak_mb'):.0f} MiB")
        if self.mtp_layers:
            lines.append(f"not run: multi-token-prediction layer(s) {self.mtp_layers} (not part of the causal LM's "
                         "forward; verify without --whole-model checks their MoE blocks)")
        if self.passed:
            lines.append("PASSED: every layer and the logits within the thresholds of " + self.format)
        else:
            lines.append(f"FAILED: first divergent {self.first_divergent or 'logits'}; " + "; ".join(self.failures))
        return "\n".join(lines)


def raise_if_failed(report: WholeModelReport) -> None:
    if not report.passed:
        first = report.first_divergent
        raise VerificationFailed(f"whole-model verification failed (first divergent: "
                                 f"{'layer ' + first if first and first.isdigit() else first or 'logits'}): "
                                 + "; ".join(report.failures))


# ------------------------------------------------------------------------------------ tokens


def make_token_ids(opts: WholeModelOptions, vocab: int, ref_root: Path) -> tuple[torch.Tensor, str]:
    """Token ids [dp, B, S] int64 and where they came from: ``--text`` tokenized with the
    reference's tokenizer, else seeded uniform ids."""
    if opts.seq_len < 2 or opts.tokens < opts.seq_len:
        raise MoetoolError(f"--seq-len {opts.seq_len} / --tokens {opts.tokens}: need seq-len >= 2 and "
                           "tokens >= seq-len (tokens per dp group = sequences x seq-len)")
    B, S = opts.tokens // opts.seq_len, opts.seq_len
    if opts.text is None:
        g = torch.Generator().manual_seed(opts.seed * 7919 + 17)
        return torch.randint(0, vocab, (opts.dp, B, S), generator=g), f"random ids (seed {opts.seed})"
    transformers = require_transformers()
    path = Path(opts.text)
    if not path.is_file():
        raise MoetoolError(f"--text {path}: no such file")
    if not (Path(ref_root) / "tokenizer.json").is_file():
        raise MoetoolError(f"--text: {ref_root} has no tokenizer.json to tokenize {path} with")
    tok = transformers.AutoTokenizer.from_pretrained(str(ref_root))
    ids = torch.tensor(tok(path.read_text(encoding="utf-8"))["input_ids"], dtype=torch.int64)
    per_group = ids.numel() // (opts.dp * S)
    if per_group < 1:
        raise MoetoolError(f"--text {path}: {ids.numel()} tokens, fewer than --dp {opts.dp} x --seq-len {S}")
    B = min(B, per_group)
    if int(ids.max()) >= vocab:
        raise MoetoolError(f"--text {path}: the tokenizer gives id {int(ids.max())}, the model has {vocab} tokens")
    return ids[:opts.dp * B * S].view(opts.dp, B, S), f"{path.name} ({ids.numel()} tokens)"


# ------------------------------------------------------------------------------------ ranks


class _Sums:
    """Sums of squared errors and squared references, so dp groups merge exactly."""

    def __init__(self):
        self.v: dict[str, list[float]] = {}

    def add(self, key: str, y: torch.Tensor, ref: torch.Tensor, base: torch.Tensor | None = None) -> None:
        """||y - ref||^2 over ||ref - base||^2 (base: what the row adds to)."""
        y, ref = y.double(), ref.double().reshape(y.shape)  # Llama-4's MoE returns [T, H]
        sig = ref if base is None else ref - base.double().reshape(y.shape)
        n, s = self.v.get(key, [0.0, 0.0])
        noise = float((y - ref).pow(2).sum())
        self.v[key] = [n + (noise if math.isfinite(noise) else math.inf), s + float(sig.pow(2).sum())]

    def token_max(self, key: str, y: torch.Tensor, ref: torch.Tensor) -> None:
        """The largest per-token relative error (rows of [..., H]): a fault in one expert hides
        in the block's total error behind quantization noise, not in its own tokens."""
        y, ref = y.double().reshape(-1, y.shape[-1]), ref.double().reshape(-1, y.shape[-1])
        per = (y - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)  # [T]
        worst = float(per.max()) if per.numel() else 0.0
        worst = worst if math.isfinite(worst) else math.inf
        self.v[key] = [max(self.v.get(key, [0.0])[0], worst), 1.0]


def _peak_rss_mib() -> float:
    """This process's peak resident memory (Linux VmHWM: its own, not inherited from the process
    that spawned it as ``ru_maxrss`` is)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Clock:
    """Seconds spent per phase of a rank's run (on CUDA, the GPU's work of the phase included:
    synchronized at its end)."""

    def __init__(self, device: torch.device | None = None):
        self.s: dict[str, float] = {}
        #: the same per report row (embed, a layer's index, head): {row: {phase: seconds}}
        self.rows: dict[str, dict[str, float]] = {}
        self.row = "embed"
        self.cuda = device is not None and device.type == "cuda"
        #: when each step of the run ended, epoch seconds: {step: time} (the parent's timeline)
        self.marks: dict[str, float] = {"start": time.time()}

    def mark(self, step: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.marks[step] = time.time()

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.add(phase, time.perf_counter() - t0)

    def add(self, phase: str, seconds: float) -> None:
        self.s[phase] = self.s.get(phase, 0.0) + seconds
        row = self.rows.setdefault(self.row, {})
        row[phase] = row.get(phase, 0.0) + seconds


class DistributedMoE(torch.nn.Module):
    """The converted side's MoE block: moetool's distributed forward over the EP shards.
    Collective (every rank calls it for every MoE layer, in order)."""

    def __init__(self, layer, local, placement, gate, bias, shared, dispatcher, experts, chunk_size, returns_tuple,
                 run_moe_layer, router_bias=None):
        super().__init__()
        self.run_moe_layer = run_moe_layer  # moetool.verify.layer's, handed in by the rank (it loads Triton)
        self.layer, self.local, self.placement = layer, local, placement
        self.gate, self.bias, self.shared, self.router_bias = gate, bias, shared, router_bias
        self.dispatcher, self.experts, self.chunk_size = dispatcher, experts, chunk_size
        self.returns_tuple = returns_tuple
        #: the MoE layer's phase times of its last forward (``moetool.verify.layer.PHASES``)
        self.stats: dict = {}

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape  # [B, S, H]
        x = hidden_states.reshape(-1, shape[-1]).float()  # [T, H]
        y, self.stats = self.run_moe_layer(x, self.gate, self.bias, self.layer.router, self.local, self.placement,
                                           self.shared, self.dispatcher, self.experts, self.chunk_size,
                                           router_bias=self.router_bias)
        y = y.view(shape).to(hidden_states.dtype)
        return (y, None) if self.returns_tuple else y


#: what a rank imports, imported once by the fork server the ranks start from (``spawn_world``'s
#: preload; the verify command starts the server with them before its own imports)
RANK_MODULES = fork_server.WHOLE_MODEL_MODULES


def _rank_jobs(rank: int, world_size: int, jobs: list[dict]) -> list[dict]:
    """Entry of a rank process (spawned): each job in turn, the converted model on this rank's
    dp group, and the reference on the first rank of each group."""
    device = torch.device("cpu") if dist.get_backend() == "gloo" else torch.device("cuda", torch.cuda.current_device())
    topologies: dict[int, Topology] = {}
    out = []
    for job in jobs:
        dp = job["opts"].dp
        if dp not in topologies:
            topologies[dp] = Topology.create(dp, device)
        out.append(_rank_job(rank, topologies[dp], job))
    return out


def _rank_job(rank: int, topo, job: dict) -> dict:
    from moetool.verify.rank import opened_and_checked  # loads Triton: ranks only

    shards = EPShards(Path(job["shards"]), check=False)
    with opened_and_checked(shards, rank) as (ckpt, spec, progress):
        out = _rank_job_on(rank, topo, job, shards, ckpt, spec, progress)
    out["timeline"]["checked"] = time.time()  # every file's sha256 passed
    return out


def _rank_job_on(rank: int, topo, job: dict, shards: EPShards, ckpt, spec, progress=None) -> dict:
    # the rank runtime loads Triton, which the parent must never load
    from moetool.verify.rank import choose_transport, get_dispatcher, get_experts, load_local_experts, run_moe_layer

    opts: WholeModelOptions = job["opts"]
    reporting = topo.tp_index == 0
    ref_ckpt = open_checkpoint(job["ref"], job["revision"]) if reporting else None
    # the reporting rank paces the reads ahead by its layers (the parent's, from the spawn,
    # stop at the window: it cannot see how far the ranks are)
    ahead = read_verify_inputs_ahead([(shards.root, Path(job["ref"]), None)]) if reporting else None
    try:
        transport = choose_transport(opts.transport, topo.device) if opts.dispatch == "all2all" else None
        numerics = model_numerics(opts.numerics, FORMATS[shards.manifest["format"]], ckpt, spec)
        dispatcher = get_dispatcher(opts.dispatch, topo, comm_dtype=numerics.wire_dtype,
                                    **({"transport": transport, "timeout_s": opts.timeout_s} if transport else {}))
        experts = get_experts(opts.experts, numerics)
        ids = job["ids"][topo.group_index]  # [B, S]
        return _run(rank, topo, shards, ckpt, spec, ref_ckpt, ids, job, dispatcher, experts, load_local_experts,
                    run_moe_layer, ahead, progress)
    finally:
        if ahead is not None:
            ahead.stop()
        if ref_ckpt is not None:
            ref_ckpt.close()


@torch.no_grad()
def _run(rank, topo, shards, ckpt, spec, ref_ckpt, ids, job, dispatcher, experts, load_local_experts,
         run_moe_layer, ahead=None, progress=None) -> dict:
    opts: WholeModelOptions = job["opts"]
    clock = _Clock(topo.device)
    ids = ids.to(topo.device)
    reader = ExpertReader(ckpt, spec)
    with clock("build"):
        conv = Skeleton(ckpt.config, ckpt, spec, reader, topo.device)
        B, S = ids.shape
        conv_args = conv.layer_arguments(B, S)
    ref = ref_args = None
    if ref_ckpt is not None:
        with clock("build"):
            ref_spec = describe(ref_ckpt.config, ref_ckpt.tensors)
            ref = Skeleton(ref_ckpt.config, ref_ckpt, ref_spec, ExpertReader(ref_ckpt, ref_spec), topo.device)
            ref_args = ref.layer_arguments(B, S)
    clock.mark("built")
    rehearsal = _Rehearsal.start(rank, topo, shards, conv, reader, B * S, dispatcher, experts, opts.chunk_size,
                                 load_local_experts, run_moe_layer)
    sums = _Sums()
    reasons: dict[str, list[str]] = {}
    act = getattr(conv.cfg, "hidden_act", "silu")

    # embeddings
    if progress is not None:
        progress.reached(EMBED_STAGE)
    with clock("read_shards"):
        emb = conv.fill(conv.base.embed_tokens, "model.embed_tokens.")
    x = emb(ids).float()  # [B, S, H]
    conv.empty(emb)
    if ref is not None:
        with clock("read_reference"):
            remb = ref.fill(ref.base.embed_tokens, "model.embed_tokens.")
        x_ref = remb(ids).float()
        ref.empty(remb)
        sums.add("embed/stream", x, x_ref)
        sums.add("embed/own", x, x_ref)

    for i in range(len(conv.layers)):
        name = str(i)
        clock.row = name
        if ahead is not None:
            ahead.reached((0, i))  # the layers before are done with
        if progress is not None:
            progress.reached(i)  # the layer's shard files may be hashed now
        layer = conv.layers[i]
        moe = conv.moe_index.get(i)
        mlp_attr = conv.mlp_attr(layer)
        if moe is not None:
            if rehearsal is not None:  # the kernels compiled: its zeros go before the weights come
                with clock("rehearse_wait"):
                    rehearsal.join(clock.marks)
                rehearsal = None
            placement = shards.placements[i]
            with clock("read_shards"):
                local = load_local_experts(reader, moe, placement.slots[rank], topo.device)
                gate, bias, rbias = reader.router_fp32(moe)
                shared = reader.shared_fp32(moe)
            moe_bytes = sum(t.numel() * t.element_size() for t in [*local.w13.values(), *local.w2.values(), gate,
                                                                   *(b for b in (bias, rbias, local.bias13, local.bias2)
                                                                     if b is not None),
                                                                   *(w for w in (shared or ()) if w is not None)])
            conv.held_bytes += moe_bytes  # this rank's experts, router and shared expert of the layer
            setattr(layer, mlp_attr, DistributedMoE(moe, local, placement, gate, bias, shared, dispatcher, experts,
                                                    opts.chunk_size, _returns_tuple(layer), run_moe_layer, rbias))
            if act not in MOE_ACTS:
                reasons.setdefault(name, []).append(
                    f"config.json hidden_act {act!r}: the MoE runtime runs SwiGLU ({MOE_ACTS[0]}) experts")
            if ref is not None and i in ref.moe_index and ref.moe_index[i].activation != moe.activation:
                reasons.setdefault(name, []).append(
                    f"the shards' config.json runs the experts with {moe.activation.describe()}, --ref with "
                    f"{ref.moe_index[i].activation.describe()}")
        with clock("read_shards"):
            conv.fill(layer, f"model.layers.{i}.")
        seen: dict = {}
        removers = [capture(layer.self_attn, seen, "attn"), capture(getattr(layer, mlp_attr), seen, "mlp")]
        args, kwargs = conv_args[i]
        x_in = x
        with clock("converted_forward"):
            x = _first(layer(x, *args, **kwargs))  # collective in the MoE block
        if moe is not None:  # the MoE block's own phases, inside converted_forward
            block = getattr(layer, mlp_attr)
            for phase in MOE_PHASES:
                clock.add(f"moe_{phase}", block.stats.get(f"cuda_{phase}_s", block.stats.get(f"time_{phase}_s", 0.0)))
        for r in removers:
            r()
        conv.empty(layer)
        if moe is not None:
            experts.release()
            setattr(layer, mlp_attr, torch.nn.Identity())
            conv.held_bytes -= moe_bytes
        if ref is None:
            clock.mark(f"layer_{name}")
            continue
        rlayer = ref.layers[i]
        with clock("read_reference"):
            ref.fill(rlayer, f"model.layers.{i}.")
        rargs, rkwargs = ref_args[i]
        with clock("reference_forward"):
            x_ref = _first(rlayer(x_ref, *rargs, **rkwargs))  # the reference on its own stream
            rseen: dict = {}
            removers = [capture(rlayer.self_attn, rseen, "attn")]
            tf = _first(rlayer(x_in, *rargs, **rkwargs))  # the reference layer on the converted input
            for r in removers:
                r()
            mlp_ref = _first(getattr(rlayer, ref.mlp_attr(rlayer))(seen["mlp"][0]))  # the block alone, same input
        with clock("compare"):
            sums.add(f"{name}/stream", x, x_ref)
            sums.add(f"{name}/own", x, tf, base=x_in)
            sums.add(f"{name}/attn", seen["attn"][1], rseen["attn"][1])
            sums.add(f"{name}/mlp", _first(seen["mlp"][1]), mlp_ref)
            if moe is not None:
                sums.token_max(f"{name}/mlp_token", _first(seen["mlp"][1]), mlp_ref)
                _moe_parts(sums, name, moe, getattr(rlayer, ref.mlp_attr(rlayer)), seen["mlp"][0], gate, bias, shared,
                           rbias)
        ref.empty(rlayer)
        clock.mark(f"layer_{name}")

    # final norm and lm_head
    clock.row = "head"
    if ahead is not None:
        ahead.reached((0, LAST_STAGE))
    if progress is not None:
        progress.reached(LAST_STAGE)
    with clock("read_shards"):
        norm = conv.fill(conv.base.norm, "model.norm.")
        head = conv.fill(conv.model.lm_head, "lm_head.")
    logits = head(norm(x)).double()  # [B, S, V]
    conv.empty(norm)
    conv.empty(head)
    memory = {"rss_peak_mb": _peak_rss_mib(),
              "converted_weights_peak_mb": conv.peak_bytes / 2**20}
    if topo.device.type == "cuda":
        memory["gpu_peak_mb"] = torch.cuda.max_memory_allocated(topo.device) / 2**20
    if ref is None:
        clock.mark("head")
        return {"group": topo.group_index, "reporting": False, "timings_s": clock.s, "row_timings_s": clock.rows,
                "memory": memory, "timeline": clock.marks}
    with clock("read_reference"):
        rnorm = ref.fill(ref.base.norm, "model.norm.")
        rhead = ref.fill(ref.model.lm_head, "lm_head.")
    ref_logits = rhead(rnorm(x_ref)).double()
    tf_logits = rhead(rnorm(x)).double()
    sums.add("head/stream", logits, ref_logits)
    sums.add("head/own", logits, tf_logits)
    lp, lq = torch.log_softmax(ref_logits, -1), torch.log_softmax(logits, -1)  # [B, S, V]
    kl = (lp.exp() * (lp - lq)).sum(-1).flatten()  # [T]
    top1 = int((ref_logits.argmax(-1) == logits.argmax(-1)).sum())
    clock.mark("head")
    labels = ids[:, 1:]
    nll_ref = float(-lp[:, :-1].gather(-1, labels[..., None]).sum())
    nll_conv = float(-lq[:, :-1].gather(-1, labels[..., None]).sum())
    return {"group": topo.group_index, "reporting": True, "sums": sums.v, "kl": kl.float(), "top1": top1,
            "tokens": ids.numel(), "nll": (nll_ref, nll_conv, labels.numel()), "reasons": reasons,
            "shared_quantized": any(m.shared_bases is not None and reader.linear_format(m.shared_bases[0]).name != "dense"
                                    for m in spec.moe_layers),
            "kinds": {str(i): ("moe" if i in conv.moe_index else "dense") for i in range(len(conv.layers))},
            "mtp_layers": [m.index for m in spec.moe_layers if m.index >= len(conv.layers)],
            "timings_s": clock.s,
            "row_timings_s": clock.rows,
            "timeline": clock.marks,
            "memory": {**memory, "reference_weights_peak_mb": ref.peak_bytes / 2**20, "rss_peak_mb": _peak_rss_mib(),
                       **({"gpu_peak_mb": torch.cuda.max_memory_allocated(topo.device) / 2**20}
                          if topo.device.type == "cuda" else {})}}


class _Rehearsal:
    """The first MoE layer once on zero experts, on a thread of the rank, while its main thread
    reads and runs the rows before it: every kernel of the MoE block is compiled (7.4 s of an
    H100's first run at DeepSeek-V3 size) and the transport's buffers made before the layer's
    weights are in, instead of after. Real router, biases and shared expert (small), random
    tokens; the experts' zeros are freed at ``join``. On GPUs by default, as the MoE-only
    check's rehearsal (``MOETOOL_REHEARSE``); every rank takes part or none (collective)."""

    def __init__(self, run: Callable[[], None], device: torch.device):
        self.error: BaseException | None = None
        self.done_at = 0.0

        def body() -> None:
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)  # a new thread's current device is the first GPU
                with torch.no_grad():  # grad mode is the thread's own
                    run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            except BaseException as err:  # raised again by join, in the rank's main thread
                self.error = err
            self.done_at = time.time()

        self._thread = threading.Thread(target=body, name="moetool-rehearse", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, rank, topo, shards, conv, reader, tokens: int, dispatcher, experts, chunk_size,
              load_local_experts, run_moe_layer) -> "_Rehearsal | None":
        from moetool.verify.rank import ranks_rehearse

        if not ranks_rehearse(topo.device, possible=bool(conv.moe_index)):
            return None
        i = min(conv.moe_index)
        moe, placement = conv.moe_index[i], shards.placements[i]
        local = load_local_experts(reader, moe, placement.slots[rank], topo.device, fill=False)
        gate, bias, rbias = reader.router_fp32(moe)
        shared = reader.shared_fp32(moe)
        x = torch.randn(tokens, moe.hidden, generator=torch.Generator().manual_seed(rank)).to(topo.device)  # [T, H]

        def run() -> None:
            run_moe_layer(x, gate, bias, moe.router, local, placement, shared, dispatcher, experts, chunk_size,
                          router_bias=rbias)
            experts.release()  # the torch backend keeps dequantized copies of the zeros

        return cls(run, topo.device)

    def join(self, marks: dict[str, float]) -> None:
        """Wait for it; its error, if it failed; ``marks["rehearsed"]`` when it ended."""
        self._thread.join()
        marks["rehearsed"] = self.done_at
        if self.error is not None:
            raise self.error


def _moe_parts(sums: _Sums, name: str, moe, block, h: torch.Tensor, gate, bias, shared, router_bias=None) -> None:
    """The router and the shared expert alone, on the converted block's input ``h``: the
    shards' router through moetool's ``route`` against transformers' router module, as dense
    [T, E] routing weights; the shards' shared expert against transformers' (never quantized
    unless --include-shared-experts: a wrong one shows here whatever the experts' format)."""
    x = h.reshape(-1, h.shape[-1]).float()  # [T, H]
    dev = x.device
    gate = gate.to(dev)
    bias = None if bias is None else bias.to(dev)
    router_bias = None if router_bias is None else router_bias.to(dev)
    shared = None if shared is None else tuple(None if w is None else w.to(dev) for w in shared)
    router = getattr(block, "gate", None) if hasattr(block, "gate") else getattr(block, "router", None)
    out = router(x) if router is not None else None
    T, E = x.shape[0], gate.shape[0]
    ref_w = None  # [T, E] routing weights of transformers' router
    if isinstance(out, tuple):
        idx = next((t for t in out if isinstance(t, torch.Tensor) and not t.is_floating_point()), None)
        w = None if idx is None else next((t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()
                                           and t.shape == idx.shape), None)
        if w is not None:  # (logits, top-k weights, top-k ids)
            ref_w = torch.zeros(T, E, dtype=torch.float64, device=dev).scatter(1, idx.long(), w.double())
        elif isinstance(out[0], torch.Tensor) and tuple(out[0].shape) == (T, E):  # Llama-4: (scores [T, E], logits)
            ref_w = out[0].double()
    if ref_w is not None:
        ids, weights = route(x, gate, moe.router, bias, router_bias)
        conv_w = torch.zeros(T, E, dtype=torch.float64, device=dev).scatter(1, ids, weights.double())
        sums.add(f"{name}/router", conv_w, ref_w)
    ref_shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    if shared is not None and ref_shared is not None:
        y_ref = ref_shared(x)
        if getattr(block, "shared_expert_gate", None) is not None:
            y_ref = torch.sigmoid(block.shared_expert_gate(x)) * y_ref
        sums.add(f"{name}/shared", shared_forward(x, shared, act=moe.activation), y_ref)


def _returns_tuple(layer: torch.nn.Module) -> bool:
    """Whether the decoder layer's MoE block returns (hidden, router output): Llama-4's
    (``is_moe_layer``) and gpt-oss's ``GptOssMLP`` do, and the layer unpacks it."""
    return bool(getattr(layer, "is_moe_layer", False)) or type(layer).__name__.startswith("GptOss")


def _first(out):
    return out[0] if isinstance(out, tuple) else out


# ------------------------------------------------------------------------------------ parent


def check_options(opts: WholeModelOptions, shards: EPShards) -> None:
    check_timeout(opts.timeout_s)
    if opts.ep != shards.ep:
        raise MoetoolError(f"--ep {opts.ep}: the shards in {shards.root} were made for ep {shards.ep}")
    if opts.dp < 1 or opts.ep % opts.dp:
        raise MoetoolError(f"--dp {opts.dp} must be at least 1 and divide --ep {opts.ep}")
    if opts.dispatch not in ("allgather", "all2all"):
        raise MoetoolError(f"--all2all {opts.dispatch!r}: expected allgather or all2all")
    if opts.experts not in ("torch", "triton"):
        raise MoetoolError(f"--experts {opts.experts!r}: expected torch or triton")
    if opts.numerics not in NUMERICS:
        raise MoetoolError(f"--numerics {opts.numerics!r}: expected {' or '.join(NUMERICS)}")


def whole_model_backend(opts: WholeModelOptions) -> str:
    """As the MoE-only mode: NCCL with one GPU a rank when there are enough GPUs (every module,
    both sides, on the rank's GPU), else gloo on CPU."""
    return resolve_backend(opts)  # type: ignore[arg-type]


def verify_whole_model(shards_dir, ref, opts: WholeModelOptions, *, revision: str | None = None,
                       thresholds: dict | None = None) -> WholeModelReport:
    """Run the whole-model check; return the report (failures are in it: see ``.passed``)."""
    return verify_whole_model_many([(shards_dir, ref, opts)], revision=revision, thresholds=thresholds)[0]


def verify_whole_model_many(jobs: list[tuple], *, revision: str | None = None,
                            thresholds: dict | None = None) -> list[WholeModelReport]:
    """Several whole-model checks of the same ep and backend in one set of rank processes.
    ``jobs``: [(shards_dir, ref, WholeModelOptions)].

    That both checkpoints hold every tensor transformers' modules need (``Skeleton.check``:
    seconds of imports and module building at full size) is checked on a thread while the
    ranks start; a failed check stops them and is the error raised."""
    entered = time.time()
    require_transformers()
    prepared = []
    for shards_dir, ref, opts in jobs:
        shards = EPShards(Path(shards_dir), check=False)
        check_options(opts, shards)
        check_files_present(shards)
        with open_checkpoint(ref, revision) as ref_ckpt:
            spec = describe(ref_ckpt.config, ref_ckpt.tensors)
            check_reference(shards, ref_ckpt, spec, ref)
            vocab = int(text_config(ref_ckpt.config).get("vocab_size"))
            ids, source = make_token_ids(opts, vocab, ref_ckpt.root)
            ref_root = str(ref_ckpt.root)
        prepared.append((shards, ref_root, opts, whole_model_backend(opts), ids, source))
    eps, backends = {p[2].ep for p in prepared}, {p[3] for p in prepared}
    if len(eps) != 1 or len(backends) != 1:
        raise MoetoolError(f"verify_whole_model_many: jobs need one ep and backend, got {sorted(eps)} / {sorted(backends)}")
    rank_jobs = [{"shards": str(sh.root), "ref": ref, "revision": revision, "opts": o, "ids": ids}
                 for sh, ref, o, _, ids, _ in prepared]
    timeout = sum(p[2].timeout_s for p in prepared)
    timings: dict = {}
    t0, t0_epoch = time.perf_counter(), time.time()
    started = process_started()
    if started is not None:  # this process's start to here (its imports), and to the ranks' spawn (+ the checks)
        timings["imported_s"] = entered - started
        timings["startup_s"] = t0_epoch - started
    abort, reading_done = threading.Event(), threading.Event()
    ep, backend = eps.pop(), backends.pop()

    def read_ahead() -> None:
        # the disk reads both checkpoints in the order the ranks take them (layer by layer, the
        # shards then the reference) while the ranks build their modules and compile
        read_verify_inputs_ahead([(sh.root, Path(ref), None) for sh, ref, *_ in prepared], stop=reading_done,
                                 gpu=backend == "nccl")

    with ThreadPoolExecutor(1, thread_name_prefix="moetool-check") as pool:
        checked = pool.submit(_check_modules, [(p[0], p[1]) for p in prepared], revision, timings, t0,
                              _after_imports(read_ahead))
        checked.add_done_callback(lambda f: f.exception() is not None and abort.set())
        try:
            results = spawn_world(_rank_jobs, ep, backend, args=(rank_jobs,), timeout_s=timeout,
                                  abort=abort, preload=RANK_MODULES)
        except MoetoolError:
            if checked.exception() is not None:  # the checkpoint the modules cannot load: the cause
                raise checked.exception() from None
            raise
        finally:
            reading_done.set()
        checked.result()
    timings["ranks_s"] = time.perf_counter() - t0
    reports = []
    for j, (shards, ref_root, opts, backend, ids, source) in enumerate(prepared):
        fmt = shards.manifest["format"]
        th = {**thresholds_for(fmt), **(thresholds or {})}
        groups = [r[j] for r in results if r[j]["reporting"]]
        report = build_report(str(shards.root), ref_root, fmt, opts, backend, th, ids, source, groups)
        report.ranks = [{"rank": k, "timings_s": r[j]["timings_s"], "row_timings_s": r[j]["row_timings_s"],
                         "memory": r[j]["memory"]} for k, r in enumerate(results)]
        steps: dict[str, float] = {}  # the last rank's end of each step, seconds from the spawn
        for r in results:
            for step, at in r[j]["timeline"].items():
                steps[f"rank_{step}_s"] = max(steps.get(f"rank_{step}_s", 0.0), at - t0_epoch)
        report.timings_s = dict(timings, **steps, wall_s=time.perf_counter() - t0)
        reports.append(report)
    return reports


def _after_imports(read_ahead: Callable[[], None]) -> Callable[[], None]:
    """What the check thread calls once its imports are done: ``read_ahead`` (bulk reads
    starve a cold import's small reads), or nothing where this process read the imports' code
    into memory first (:func:`moetool.read.code_files.warm`): the read-ahead then starts at the
    spawn, once that is done. Not sooner: on the H100 hosts bulk reads slowed the parent's
    imports even with every file in memory (16 s alone, 23-26 s beside them)."""
    warm = code_files.warming()
    if warm is None:
        return read_ahead
    threading.Thread(target=lambda: (warm.wait(), read_ahead()), name="moetool-read-ahead", daemon=True).start()
    return lambda: None


def _check_modules(checkpoints: list[tuple[EPShards, str]], revision: str | None, timings: dict, t0: float,
                   imported: Callable[[], None] = lambda: None) -> None:
    """``Skeleton.check`` of each (shards, reference): the reference whole, the shards' rank 0
    but for the MoE blocks (moetool's forward runs them from tensors ``describe`` checked).
    ``timings``: gets "checked_s", seconds from ``t0``. ``imported`` is called once the
    families' modules are imported, before the checks: the checkpoints' reads start then, as
    they would starve the imports' small reads (seconds on a cold disk; the ranks, starting
    meanwhile, then import the same files from memory)."""
    for _, ref in checkpoints:
        with open_checkpoint(ref, revision) as ref_ckpt:
            causal_lm_class(hf_config(ref_ckpt.config))
    imported()
    for shards, ref in checkpoints:
        with open_checkpoint(ref, revision) as ref_ckpt:
            spec = describe(ref_ckpt.config, ref_ckpt.tensors)
            Skeleton(ref_ckpt.config, ref_ckpt, spec, ExpertReader(ref_ckpt, spec)).check()
        rank0, rank0_spec = shards.open_rank(0, check=False)
        with rank0:
            Skeleton(rank0.config, rank0, rank0_spec, ExpertReader(rank0, rank0_spec)).check(moe_blocks=False)
    timings["checked_s"] = time.perf_counter() - t0


def _rel(sums: list[dict], key: str) -> float | None:
    parts = [s[key] for s in sums if key in s]
    if not parts:
        return None
    noise, sig = sum(p[0] for p in parts), sum(p[1] for p in parts)
    if not math.isfinite(noise):
        return math.inf
    return math.sqrt(noise / sig) if sig > 0 else (0.0 if noise == 0 else math.inf)


def build_report(shards: str, ref: str, fmt: str, opts: WholeModelOptions, backend: str, th: dict,
                 ids: torch.Tensor, source: str, groups: list[dict]) -> WholeModelReport:
    sums = [g["sums"] for g in groups]
    kinds = groups[0]["kinds"]
    names = ["embed", *kinds, "head"]
    rows, failures = [], []
    for name in names:
        kind = kinds.get(name, name)
        token_max = [g[f"{name}/mlp_token"][0] for g in sums if f"{name}/mlp_token" in g]
        row = RowReport(name, kind, _rel(sums, f"{name}/stream"), _rel(sums, f"{name}/own"),
                        _rel(sums, f"{name}/attn"), _rel(sums, f"{name}/mlp"), max(token_max) if token_max else None,
                        _rel(sums, f"{name}/router"), _rel(sums, f"{name}/shared"))
        why = [w for g in groups for w in g["reasons"].get(name, [])]
        why = list(dict.fromkeys(why))
        exact = th["exact_rel_err"]
        if kind == "moe":
            shared_limit = th["moe_rel_err"] if groups[0]["shared_quantized"] else exact
            checks = [("own", row.layer_rel_err, th["layer_rel_err"]), ("attention", row.attn_rel_err, exact),
                      ("MoE block", row.mlp_rel_err, th["moe_rel_err"]),
                      ("MoE block worst token", row.moe_token_max_rel_err, th["moe_token_rel_err"]),
                      ("router", row.router_rel_err, exact), ("shared expert", row.shared_rel_err, shared_limit)]
        elif kind == "dense":
            checks = [("own", row.layer_rel_err, exact), ("attention", row.attn_rel_err, exact),
                      ("MLP", row.mlp_rel_err, exact)]
        else:
            checks = [("own", row.layer_rel_err, exact)]
        for what, v, limit in checks:
            if v is not None and not v <= limit:
                why.append(f"{what} rel err {v:.3g} > {limit:g}")
        if why:
            row.passed, row.reason = False, "; ".join(why)
            label = f"layer {name}" if name.isdigit() else name
            failures.append(f"{label}: {row.reason}")
        rows.append(row)
    kl = torch.cat([g["kl"] for g in groups]).double()
    n = sum(g["tokens"] for g in groups)
    logits = {"kl_mean": float(kl.mean()), "kl_p99": float(torch.quantile(kl, 0.99)), "kl_max": float(kl.max()),
              "top1": sum(g["top1"] for g in groups) / n, "ppl_reference": None, "ppl_converted": None}
    if opts.text is not None:
        nr, nc, cnt = (sum(g["nll"][j] for g in groups) for j in range(3))
        logits["ppl_reference"], logits["ppl_converted"] = math.exp(nr / cnt), math.exp(nc / cnt)
    for key, bad in (("kl_mean", not logits["kl_mean"] <= th["kl_mean"]), ("kl_max", not logits["kl_max"] <= th["kl_max"]),
                     ("top1", not logits["top1"] >= th["top1"])):
        if bad:
            op = ">=" if key == "top1" else "<="
            failures.append(f"logits {key} {logits[key]:.3g}, needs {op} {th[key]:g}")
    dp, B, S = ids.shape
    return WholeModelReport(shards, ref, fmt, {**asdict(opts), "backend": backend}, th,
                            {"source": source, "dp_groups": dp, "sequences": B, "seq_len": S}, rows, logits,
                            failures, mtp_layers=groups[0].get("mtp_layers", []))


def save_json(report: WholeModelReport, path: Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=2))
