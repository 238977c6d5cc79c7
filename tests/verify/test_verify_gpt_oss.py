"""gpt-oss through ``moetool verify`` (issue 16, point 5): the router with its logit bias, the
experts' biases and clamped SwiGLU in the reference and the torch experts (served bf16 and
exact float32), MoE-only and ``--whole-model`` (transformers' GptOss modules as the reference:
attention sinks, sliding and full attention layers) on honest shards of every output format,
made from both gpt-oss layouts (dense, and the MXFP4 release); and the faults each must name
by layer: two experts swapped, a wrong expert bias, a clamp limit changed in the converted
config. The fused Triton experts refuse gpt-oss, naming ``--experts torch``.

One world per module: every MoE-only check runs in one set of gloo ranks (``verify_many``),
every whole-model check in another (``verify_whole_model_many``). The model: transformers'
own gpt-oss, hidden 32, N 32 (MXFP4 needs whole groups of 32), 4 experts top-2, 2 layers
(sliding window 4, then full attention), swiglu_limit 0.25 so that the clamp cuts (at 7 it
never does on these activations, nor at 1 on the MoE-only test tokens).
"""
from __future__ import annotations


import pytest
import torch

from moeutil import DEVICE, edited_copy, save_gpt_oss_mxfp4, save_hf_model, transformers_gpt_oss_reads_its_limit

transformers = pytest.importorskip("transformers")

from moetool.convert.quantize import quantize  # noqa: E402
from moetool.convert.shard import shard  # noqa: E402
from moetool.model.spec import LocalExperts  # noqa: E402
from moetool.read.checkpoint import open_checkpoint  # noqa: E402
from moetool.read.experts import ExpertReader  # noqa: E402
from moetool.verify.driver import VerifyOptions, verify_many  # noqa: E402
from moetool.verify.experts import TorchExperts, TritonExperts  # noqa: E402
from moetool.verify.numerics import numerics_for  # noqa: E402
from moetool.verify.reference import reference_moe_forward  # noqa: E402
from moetool.verify.router import route  # noqa: E402
from moetool.verify.whole_model import WholeModelOptions, verify_whole_model_many  # noqa: E402

GPT_OSS = dict(intermediate_size=32, swiglu_limit=0.25, sliding_window=4)
#: whether transformers' own gpt-oss experts can be the reference at this limit
TRANSFORMERS_REFERENCE = transformers_gpt_oss_reads_its_limit()
#: the tests whose reference is transformers' own gpt-oss experts
transformers_reference = pytest.mark.skipif(
    not TRANSFORMERS_REFERENCE,
    reason="this transformers' GptOssExperts clamps at 7 whatever swiglu_limit says (up to 5.18; 5.19 and later read it)")
FORMATS = {"dense": {}, "fp8-block": {}, "fp8-channel": {}, "int4-group": {"group_size": 32}, "nvfp4": {},
           "mxfp4": {}}
#: (input, output format) of the honest shards; "release": the MXFP4 release sharded as it is
HONEST = [(s, f) for s in ("dense", "mxfp4") for f in FORMATS if not (s == "mxfp4" and f == "dense")] + [
    ("mxfp4", "release")]
MOE = VerifyOptions(ep=2, dp=1, tokens=64)
WHOLE = WholeModelOptions(dp=1, ep=2, tokens=32, seq_len=16)


def _swap_experts(t: dict, layer: int, a: int, b: int) -> None:
    """Experts a and b of ``layer`` trade every tensor (weights or blocks and scales, biases)."""
    for name in [n for n in t if n.startswith(f"model.layers.{layer}.mlp.experts.")]:
        t[name] = t[name].clone()
        t[name][[a, b]] = t[name][[b, a]]


def _bias_fault(t: dict) -> None:
    name = "model.layers.0.mlp.experts.down_proj_bias"
    t[name] = t[name].clone()
    t[name][3] += 0.5


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The two inputs, their honest conversions' shards, the broken ones, and the reports."""
    root = tmp_path_factory.mktemp("gpt-oss-verify")
    model = save_hf_model("gpt_oss", root / "dense", **GPT_OSS)
    inputs = {"dense": model.path, "mxfp4": save_gpt_oss_mxfp4(model, root / "mxfp4")}

    def shards(src, fmt, name):
        quantize(src, root / name, fmt, progress=False, **FORMATS[fmt])
        shard(root / name, root / f"{name}-ep2", 2, progress=False)
        return root / f"{name}-ep2"

    honest = {(source, fmt): shards(inputs[source], fmt, f"{source}-{fmt}")
              for source in inputs for fmt in FORMATS if not (source == "mxfp4" and fmt == "dense")}
    shard(inputs["mxfp4"], root / "release-ep2", 2, progress=False)  # the release's own bytes, stacked
    honest[("mxfp4", "release")] = root / "release-ep2"
    swapped = edited_copy(inputs["mxfp4"], root / "swapped", lambda t: _swap_experts(t, 1, 1, 2))
    bias = edited_copy(inputs["dense"], root / "bias", _bias_fault)
    faults = {"swapped": (shards(swapped, "mxfp4", "swapped-q"), inputs["mxfp4"]),
              "bias": (shards(bias, "dense", "bias-q"), inputs["dense"])}
    limit = root / "limit-q"
    quantize(inputs["dense"], limit, "dense", progress=False)
    edited_copy(limit, root / "limit", config=lambda c: c.update(swiglu_limit=7.0))
    shard(root / "limit", root / "limit-ep2", 2, progress=False)
    faults["limit"] = (root / "limit-ep2", inputs["dense"])
    jobs = [(sh, inputs[source], MOE) for (source, _), sh in honest.items()] + [(sh, ref, MOE) for sh, ref in
                                                                                faults.values()]
    moe = verify_many(jobs)
    keys = [*honest, *faults]
    # the whole-model check's reference is transformers' own experts: refused where they ignore the limit
    whole = verify_whole_model_many([(sh, ref, WHOLE) for sh, ref, _ in jobs]) \
        if TRANSFORMERS_REFERENCE else [None] * len(keys)
    return {"model": model, "inputs": inputs, "moe": dict(zip(keys, moe)), "whole": dict(zip(keys, whole))}


# ------------------------------------------------------------------------------ the math


def _hf_mlp(model, layer: int):
    """transformers' GptOssMLP of ``layer`` filled with the model's weights (float32)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.AutoConfig.for_model("gpt_oss", **{k: v for k, v in model.config.items() if k != "model_type"})
    mlp = GptOssMLP(cfg)
    p = f"model.layers.{layer}.mlp."
    mlp.load_state_dict({k[len(p):]: v for k, v in model.state.items() if k.startswith(p)})
    return mlp


@transformers_reference
def test_router_and_reference_are_transformers(world):
    """route() with the logit bias picks transformers' experts with its weights; the reference
    MoE forward (biases, clamped SwiGLU, the down bias weighted) is GptOssMLP's."""
    model = world["model"]
    with open_checkpoint(model.path) as ck:
        reader = ExpertReader(ck)
        for layer in reader.spec.moe_layers:
            mlp = _hf_mlp(model, layer.index)
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(layer.index)) * 2
            gate, rbias = ck.get(layer.router_weight), ck.get(layer.router_bias)
            ids, weights = route(x, gate, layer.router, router_bias=rbias)
            _, hf_weights, hf_ids = mlp.router(x)
            assert torch.equal(ids, hf_ids) and torch.allclose(weights, hf_weights, atol=1e-6)
            experts = [reader.expert_fp32(layer, e) for e in range(layer.num_experts)]
            biases = [reader.biases(layer, e) for e in range(layer.num_experts)]
            y = reference_moe_forward(x, gate, None, layer.router, experts, router_bias=rbias, biases=biases,
                                      act=layer.activation)
            with torch.no_grad():
                want = mlp(x[None])[0][0]
            assert float((y - want).norm() / want.norm()) < 1e-6
            # the clamp is exercised: limit 1 on these activations
            g = x @ experts[0][0].t() + biases[0][0]
            assert bool((g > layer.activation.limit).any())


@transformers_reference  # where transformers reads the limit: its constant-holding versions refuse at once
def test_a_transformers_whose_experts_ignore_the_limit_is_refused_as_reference(world, monkeypatch):
    """transformers up to 5.18 has GptOssExperts hold limit 7.0 whatever swiglu_limit says (0.25 here):
    the reference check names that, instead of a FAIL blamed on the conversion."""
    from moetool.errors import MoetoolError
    from moetool.model.families import describe
    from moetool.verify import hf_layers

    real_init = hf_layers.Skeleton.__init__

    def constant_limit(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        for i in self.moe_index:
            getattr(self.layers[i], self.mlp_attr(self.layers[i])).experts.limit = 7.0

    with open_checkpoint(world["model"].path) as ck:
        spec = describe(ck.config, ck.tensors)
        hf_layers.Skeleton(ck.config, ck, spec, ExpertReader(ck, spec)).check()  # as it is: accepted
        monkeypatch.setattr(hf_layers.Skeleton, "__init__", constant_limit)
        with pytest.raises(MoetoolError, match=r"GptOssExperts computes the clamped SwiGLU with alpha 1\.702, limit 7 "
                                               r"whatever config\.json says \(alpha 1\.702, limit 0\.25\).*"
                                               r"install a transformers that reads them \(5\.19 or later\)"):
            hf_layers.Skeleton(ck.config, ck, spec, ExpertReader(ck, spec)).check()
        hf_layers.Skeleton(ck.config, ck, spec, ExpertReader(ck, spec)).check(moe_blocks=False)  # the converted side


def _local(model):
    ck = open_checkpoint(model.path)
    reader = ExpertReader(ck)
    layer = reader.spec.moe_layers[0]
    per = [reader.gate_up_down(layer, e) for e in range(layer.num_experts)]
    w13 = {"weight": torch.stack([torch.cat([g["weight"], u["weight"]]) for g, u, _ in per])}
    w2 = {"weight": torch.stack([d["weight"] for _, _, d in per])}
    b13, b2 = reader.stacked_biases(layer)
    local = LocalExperts(reader.fmt, w13, w2, list(range(layer.num_experts)), layer.intermediate, layer.hidden,
                         bias13=b13, bias2=b2, activation=layer.activation)
    return ck, reader, layer, local


def test_torch_experts_exact_and_served(world):
    """Exact: the reference's expert to float32 rounding. Served: bf16 weights, biases and
    intermediates, within bf16 error of exact, and not equal to it."""
    ck, reader, layer, local = _local(world["model"])
    with ck:
        x = torch.randn(48, 32, generator=torch.Generator().manual_seed(5))
        ids = torch.arange(48)[:, None] % layer.num_experts
        w = torch.full((48, 1), 0.75)
        counts = torch.bincount(ids[:, 0], minlength=layer.num_experts)
        from moetool.verify.reference import swiglu

        want = torch.stack([swiglu(x[t:t + 1], *reader.expert_fp32(layer, int(ids[t])),
                                   biases=reader.biases(layer, int(ids[t])), act=layer.activation)[0]
                            for t in range(48)]) * 0.75
        out = {}
        for mode in ("exact", "served"):
            experts = TorchExperts(numerics=numerics_for(mode, reader.fmt, torch.float32))
            experts.bind(local, torch.device("cpu"))
            out[mode] = experts.apply(x, None, ids, w, counts)
        assert float((out["exact"] - want).norm() / want.norm()) < 1e-6
        served = float((out["served"] - want).norm() / want.norm())
        assert 1e-4 < served < 0.01


#: Triton experts against the torch ones (relative norm): float32 rounding in the interpreter,
#: TF32 on a GPU
TRITON_RTOL = {"cpu": 1e-5, "cuda": 5e-3}


def test_triton_experts_run_gpt_oss(world):
    """The fused kernels run gpt-oss's experts too: clamped SwiGLU in the silu kernel, the
    expert biases in the GEMMs' epilogues (the down bias before the top-k weight). On the CPU
    (Triton's interpreter, float32): equal to the torch experts to float32 rounding; a bias
    changed on the Triton side alone moves the output (the check can fail). On a GPU both run
    there, the float32 dots in TF32 (10-bit mantissas)."""
    ck, _, layer, local = _local(world["model"])
    device = torch.device(DEVICE)
    with ck:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(24, 32, generator=gen)
        ids = torch.randint(0, layer.num_experts, (24, 2), generator=gen)
        ids[:, 1] = (ids[:, 0] + 1) % layer.num_experts
        w = torch.rand(24, 2, generator=gen)
        counts = torch.bincount(ids.flatten(), minlength=layer.num_experts)
        x, ids, w, counts = (t.to(device) for t in (x, ids, w, counts))
        exact = numerics_for("exact", local.fmt, torch.float32)
        ref, tri = TorchExperts(numerics=exact), TritonExperts(exact)
        ref.bind(local, device)
        tri.bind(local, device)
        want, got = ref.apply(x, None, ids, w, counts), tri.apply(x, None, ids, w, counts)
        assert float((got - want).norm() / want.norm()) < TRITON_RTOL[device.type]
        tri._bias["w2_bias"] = tri._bias["w2_bias"] + 0.5
        moved = tri.apply(x, None, ids, w, counts)
        assert float((moved - want).norm() / want.norm()) > 0.05


# ------------------------------------------------------------------------------ MoE-only



@pytest.mark.parametrize("source, fmt", HONEST)
def test_moe_only_honest(world, source, fmt):
    report = world["moe"][(source, fmt)]
    assert report.passed, report.render()
    assert [layer.layer for layer in report.layers] == [0, 1]


def test_moe_only_faults(world):
    swapped, bias, limit = (world["moe"][k] for k in ("swapped", "bias", "limit"))
    assert [layer.passed for layer in swapped.layers] == [True, False]
    assert "expert 1 on rank 0" in swapped.layers[1].reason or "expert 2 on rank 1" in swapped.layers[1].reason
    assert [layer.passed for layer in bias.layers] == [False, True]
    assert "expert 3 on rank 1" in bias.layers[0].reason
    for layer in limit.layers:  # the numbers say it, and the reason says why
        assert not layer.passed and layer.rel_err > 0.05
        assert layer.reason.startswith("the shards' config.json runs the experts with clamped SwiGLU (alpha 1.702, "
                                       "limit 7, up + 1), --ref with clamped SwiGLU (alpha 1.702, limit 0.25, up + 1); "
                                       "layer rel err")


# ------------------------------------------------------------------------------ whole model


@transformers_reference
@pytest.mark.parametrize("source, fmt", HONEST)
def test_whole_model_honest(world, source, fmt):
    report = world["whole"][(source, fmt)]
    assert report.passed, report.render()
    rows = {r.name: r for r in report.rows}
    assert [r.kind for r in report.rows] == ["embed", "moe", "moe", "head"]
    for i in ("0", "1"):  # transformers' attention (sinks; sliding, then full) filled from the shards
        assert rows[i].attn_rel_err == 0.0 and rows[i].router_rel_err < 1e-6


@transformers_reference
def test_whole_model_faults(world):
    swapped, bias, limit = (world["whole"][k] for k in ("swapped", "bias", "limit"))
    assert swapped.first_divergent == "1" and bias.first_divergent == "0" and limit.first_divergent == "0"
    assert "MoE block worst token" in swapped.failures[0]
    assert "MoE block" in bias.failures[0]
    assert "MoE block rel err" in limit.failures[0]
    assert "the shards' config.json runs the experts with clamped SwiGLU (alpha 1.702, limit 7" in limit.failures[0]
