"""`moetool verify --whole-model` on a GPU at full DeepSeek-V3 size: time per phase, per layer,
and the extrapolation to the 61-layer model.

    python bench/whole_model_gpu.py --workdir /tmp/wm            # 1 dense + 1 MoE layer
    python bench/whole_model_gpu.py --moe-layers 2 --workdir ...  # needs ~90 GB of disk

1. writes a DeepSeek-V3 checkpoint of real dimensions (hidden 7168, MLA attention with 128
   heads, q/kv LoRA ranks 1536/512, 256 routed experts of intermediate 2048 + 1 shared, top-8
   of 8 groups, vocab 129280), ``--dense-layers`` dense layers then ``--moe-layers`` MoE
   layers, bf16, tensor names from transformers' own DeepseekV3 module (per-expert on disk),
   values N(0, 1/fan_in) made on the GPU; times `cp` of it to a second folder (the disk's
   read+write floor) and a plain read of it (the read floor);
2. `moetool quantize --format fp8-block --device cuda` and `moetool shard --ep 1`;
3. `moetool verify --whole-model --ep 1 --experts triton` (served numerics) with --json, and
   prints the report's per-phase seconds, the MoE block's own phases, memory, and per layer;
4. with ``--moe-only-tokens T``: MoE-only `moetool verify --ep 1 --all2all all2all --experts
   triton --tokens T`, page cache dropped first, wall time and peak RSS of its process tree,
   against the read floor (`cat` of the model and the shards, cold); ``--old DIR...`` runs the
   same (and the whole-model check, wall time) with the moetool of other checkouts
   (PYTHONPATH=DIR) in the same call, for a before/after.

Extrapolation to 61 layers (3 dense + 58 MoE) is printed from the measured per-layer times:
the reference side reads the whole bf16 layer on the reporting rank, the converted side
its 1/ep share of the experts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_timeline import DiskSampler, whole_disks  # noqa: E402

DSV3 = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168,
            intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
            n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
            vocab_size=129280, rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=10000.0,
            hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16")


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor as DeepSeek-V3 stores them: transformers' module
    on the meta device gives the names and shapes; fused experts become per-expert linears."""
    import transformers

    conf = transformers.DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures",
                                                                                      "torch_dtype")})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(conf)
    out = []
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2N, H]
            E, two_n, H = t.shape
            base = name[: -len("gate_up_proj")]
            for e in range(E):
                out += [(f"{base}{e}.gate_proj.weight", (two_n // 2, H), torch.bfloat16),
                        (f"{base}{e}.up_proj.weight", (two_n // 2, H), torch.bfloat16)]
        elif name.endswith("experts.down_proj"):  # [E, H, N]
            E, H, N = t.shape
            base = name[: -len("down_proj")]
            out += [(f"{base}{e}.down_proj.weight", (H, N), torch.bfloat16) for e in range(E)]
        else:
            dtype = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
            out.append((name, tuple(t.shape), dtype))
    return out


#: --small: the same structure at toy size, to try the script on a CPU
SMALL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, vocab_size=512)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_value(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    dev = DEV
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("e_score_correction_bias"):
        return (torch.randn(shape, generator=gen, device=dev) * 0.1).to(dtype).cpu()
    scale = 1.0 if "embed_tokens" in name else 1 / math.sqrt(shape[-1])
    if name.endswith("mlp.gate.weight"):
        scale *= 4  # a decisive router, as trained ones are
    return (torch.randn(shape, generator=gen, device=dev) * scale).to(dtype).cpu()


def write_model(path: Path, cfg: dict, shard_bytes: float) -> float:
    """Stream the checkpoint to ``path`` (files of about ``shard_bytes``); returns GB written."""
    from moetool.convert.output import OutputDir
    from moetool.read.safetensors import SAFETENSORS_METADATA, TensorSpec

    specs = tensor_specs(cfg)
    files: list[list] = [[]]
    size = 0
    for s in specs:
        n = math.prod(s[1]) * s[2].itemsize
        if files[-1] and size + n > shard_bytes:
            files.append([])
            size = 0
        files[-1].append(s)
        size += n
    out = OutputDir(path, force=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    weight_map, total = {}, 0
    for i, part in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tspecs = [TensorSpec(n, d, sh) for n, sh, d in part]
        out.write_safetensors(fname, tspecs, ((n, make_value(n, sh, d, gen)) for n, sh, d in part),
                              metadata=SAFETENSORS_METADATA)
        weight_map.update({n: fname for n, _, _ in part})
        total += sum(math.prod(sh) * d.itemsize for _, sh, d in part)
    out.write_json("model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    out.write_json("config.json", cfg)
    out.finish({"kind": "checkpoint"})
    (path / "manifest.json").unlink()  # an input checkpoint, not a moetool output
    return total / 1e9


def timed(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Run ``cmd``, stdout to ``log`` and stderr to ``log``.err; seconds of wall time."""
    t0 = time.perf_counter()
    with open(log, "w") as f, open(f"{log}.err", "w") as e:
        p = subprocess.run(cmd, stdout=f, stderr=e, env=env)
    dt = time.perf_counter() - t0
    if p.returncode not in (0, 1):  # 1: verify ran and some check failed; the report says which
        print(Path(f"{log}.err").read_text()[-3000:], file=sys.stderr)
        raise SystemExit(f"{' '.join(cmd[:4])}... exited {p.returncode}")
    return dt


class DiskReads:
    """Bytes read from the host's whole disks (/proc/diskstats), sampled every ``every`` seconds
    on a thread (:class:`disk_timeline.DiskSampler`): where in a run the disk was busy and where
    it idled."""

    def __init__(self, every: float = 0.5):
        self._sampler = DiskSampler(whole_disks(), every)

    def stop(self, bucket: float = 2.0) -> list[tuple[float, float]]:
        """[(bucket start s, GB/s read in it)]."""
        raw = self._sampler.stop()
        samples = [(t - raw[0][0], read) for t, read, *_ in raw]
        out, k = [], 0
        base = samples[0][1] if samples else 0
        while samples and k * bucket <= samples[-1][0]:
            inside = [(t, b) for t, b in samples if k * bucket <= t < (k + 1) * bucket]
            if inside:
                prev = max((b for t, b in samples if t < k * bucket), default=base)
                out.append((k * bucket, (inside[-1][1] - prev) / 1e9 / bucket))
            k += 1
        return out


def disk_line(rates: list[tuple[float, float]]) -> str:
    """'0:1.2 2:1.4 ... (total 44.6 GB)' (bucket start s: GB/s)."""
    total = sum(r for _, r in rates) * (rates[1][0] - rates[0][0] if len(rates) > 1 else 0)
    return " ".join(f"{t:.0f}:{r:.2f}" for t, r in rates) + f" (total {total:.1f} GB)"


def new_env(args) -> dict:
    """``--env NAME=VALUE ...``: the environment of this checkout's runs (not the --old ones)."""
    return dict(kv.split("=", 1) for kv in args.env)


def code_list_size(env: dict) -> dict:
    """This checkout's list of code files (moetool.read.code_files): entries, and the bytes its
    warm-up reads (libraries' touched ranges, modules whole)."""
    out = subprocess.run([sys.executable, "-c", "from moetool.read import code_files as c; p = c.list_path(); "
                          "f = c.read_list(p) if p else {}; import os; "
                          "print(p, len(f), sum(sum(n for _, n in r) if r else os.path.getsize(x) "
                          "for x, r in f.items() if os.path.isfile(x)))"],
                         capture_output=True, text=True, env=env)
    path, n, size = (out.stdout.split() + ["?", "0", "0"])[:3]
    return {"path": path, "files": int(n), "bytes": int(size)}


def drop_caches() -> None:
    subprocess.run(["sync"])
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def moe_only_command(moetool: list[str], sh: Path, src: Path, args) -> list[str]:
    return moetool + ["verify", str(sh), "--ref", str(src), "--ep", "1", "--dp", "1", "--all2all", "all2all",
                      "--experts", "triton" if DEV == "cuda" else "torch", "--tokens", str(args.moe_only_tokens),
                      "--chunk-size", str(args.moe_only_tokens), "--json"]


def moe_only(moetool: list[str], sh: Path, src: Path, args, w: Path, res: dict) -> dict:
    """MoE-only verify, cold, with this checkout's moetool and (``--old``) another's: wall
    seconds, peak RSS of the process tree, the report's phases, against the read floor."""
    from convert import TreeRSS  # bench/ is on sys.path (this script's folder)

    floor = res["read_floor_s"] + res["shards_read_s"]
    out = {"read_floor_s": floor, "tokens": args.moe_only_tokens}
    for name, path in [*((p.name, p) for p in args.old), ("new", None)]:
        env = dict(os.environ, **(new_env(args) if path is None else {}))
        if path is not None:
            env["PYTHONPATH"] = str(path)
        drop_caches()
        log = w / f"moe-only-{name}.json"
        t0 = time.perf_counter()
        with open(log, "w") as f, open(f"{log}.err", "w") as e:
            proc = subprocess.Popen(moe_only_command(moetool, sh, src, args), stdout=f, stderr=e, env=env,
                                    cwd=path)  # python -m puts the cwd first on sys.path
            rss, disk = TreeRSS(proc.pid), DiskReads()
            code = proc.wait()
        wall = time.perf_counter() - t0
        peak, rates = rss.stop(), disk.stop()
        row = {"wall_s": wall, "peak_rss_gb": peak / 1e9, "exit": code, "x_read_floor": floor / wall,
               "disk_gbps": rates}
        try:
            rep = json.loads(log.read_text())
            row.update(passed=rep["passed"], timings_s=rep.get("timings_s", {}),
                       layers=[{k: l[k] for k in ("layer", "rel_err", "worst_expert_rel_err", "timings_ms")}
                               for l in rep["layers"]])
        except (OSError, ValueError, KeyError) as err:
            row["error"] = f"{err}: {Path(f'{log}.err').read_text()[-1500:]}"
        out[name] = row
        print(f"MoE-only verify ({name}): {wall:.1f} s wall, peak RSS {peak / 1e9:.1f} GB, "
              f"{floor / wall:.2f}x the read floor {floor:.1f} s; {row.get('timings_s')}; "
              f"{row.get('layers', row.get('error'))}\n  disk GB/s by 2 s: {disk_line(rates)}", flush=True)
    return out


def layer_bytes(folder: Path) -> dict[int, int]:
    """{layer index: bytes of its tensors} over the folder's safetensors files (headers only)."""
    out: dict[int, int] = {}
    for f in folder.rglob("*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            m = re.search(r"layers\.(\d+)\.", name) if name != "__metadata__" else None
            if m:
                lo, hi = meta["data_offsets"]
                out[int(m.group(1))] = out.get(int(m.group(1)), 0) + hi - lo
    return out


def steady_layers(timings: dict[str, float], moe_layers: list[int], nbytes: dict[int, int], gbps: float) -> list[dict]:
    """The MoE layers after the first (its kernels compiled, the read-ahead in its stride): the
    seconds from the previous layer's end to this one's (the report's ``rank_layer_{i}_s``)
    against the seconds the disk takes to read the layer's bytes (reference + shards) at the
    measured cold rate ``gbps``: ``x_read_floor`` >= 1 when the run keeps up with the disk."""
    out = []
    for i in moe_layers[1:]:
        end, before = timings.get(f"rank_layer_{i}_s"), timings.get(f"rank_layer_{i - 1}_s")
        if end is None or before is None or end <= before:
            continue
        floor = nbytes.get(i, 0) / 1e9 / gbps
        out.append({"layer": i, "s": end - before, "read_floor_s": floor, "x_read_floor": floor / (end - before)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/wm"))
    ap.add_argument("--dense-layers", type=int, default=1)
    ap.add_argument("--moe-layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048, help="per dp group: sequences x --seq-len")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--format", default="fp8-block")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--small", action="store_true", help="toy dimensions (try the script on a CPU)")
    ap.add_argument("--moe-only-tokens", type=int, default=0, help="also time MoE-only verify with T tokens")
    ap.add_argument("--old", type=Path, nargs="*", default=[],
                    help="checkouts whose moetool to time too (MoE-only and whole-model), each before this one")
    ap.add_argument("--skip-whole-model", action="store_true")
    ap.add_argument("--prime", action="store_true",
                    help="run this checkout's verify runs once each, untimed, before the timed ones: the code its "
                         "processes import is then recorded (moetool.read.code_files), as for a user's second "
                         "run, and Triton's kernels are compiled for every timed run alike")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="environment of this checkout's verify runs only (an A/B of a setting against --old)")
    args = ap.parse_args()
    w = args.workdir.resolve()  # the older checkouts run from their own folders
    w.mkdir(parents=True, exist_ok=True)
    cfg = dict(DSV3, **(SMALL if args.small else {}), num_hidden_layers=args.dense_layers + args.moe_layers, first_k_dense_replace=args.dense_layers,
               n_routed_experts=args.experts)
    src, q, sh = w / "model", w / f"model-{args.format}", w / f"model-{args.format}-ep1"
    moetool = [sys.executable, "-m", "moetool"]
    res: dict = {"config": {k: cfg[k] for k in ("hidden_size", "n_routed_experts", "moe_intermediate_size",
                                                 "num_hidden_layers", "first_k_dense_replace")},
                 "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"}
    t0 = time.perf_counter()
    res["model_gb"] = write_model(src, cfg, 5e9)
    res["write_s"] = time.perf_counter() - t0
    drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["sh", "-c", f"cat {src}/*.safetensors > /dev/null"], check=True)
    res["read_floor_s"] = time.perf_counter() - t0
    res["read_floor_gbps"] = res["model_gb"] / res["read_floor_s"]
    drop_caches()
    res["quantize_s"] = timed(moetool + ["quantize", str(src), str(q), "--format", args.format, "--device", DEV,
                                         "--force"], w / "quantize.log")
    res["shard_s"] = timed(moetool + ["shard", str(q), str(sh), "--ep", "1", "--force"], w / "shard.log")
    shutil.rmtree(q)  # the disk holds the model and the shards, not three copies
    res["shards_gb"] = sum(f.stat().st_size for f in sh.rglob("*.safetensors")) / 1e9
    drop_caches()
    t0 = time.perf_counter()
    subprocess.run(["sh", "-c", f"find {sh} -name '*.safetensors' -exec cat {{}} + > /dev/null"], check=True)
    res["shards_read_s"] = time.perf_counter() - t0
    whole = [moetool + ["verify", str(sh), "--ref", str(src), "--whole-model", "--ep", "1", "--dp", "1", "--experts",
                        "triton" if DEV == "cuda" else "torch", "--tokens", str(args.tokens), "--seq-len",
                        str(args.seq_len), "--json"]]
    if args.prime:  # untimed: the code list recorded, Triton's kernels compiled (else the first timed run pays)
        for name, cmd in (("whole-model", whole[0]), ("moe-only", moe_only_command(moetool, sh, src, args))):
            if name == "moe-only" and not args.moe_only_tokens:
                continue
            t0 = time.perf_counter()
            code = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env=dict(os.environ, **new_env(args))).returncode
            res[f"prime_{name}_s"] = time.perf_counter() - t0
            print(f"prime run, {name} (untimed): {res[f'prime_{name}_s']:.1f} s, exit {code}", flush=True)
    if args.moe_only_tokens:
        res["moe_only"] = moe_only(moetool, sh, src, args, w, res)
    if args.skip_whole_model:
        if args.json:
            args.json.write_text(json.dumps(res, indent=2))
        return
    res["code_list"] = code_list_size(dict(os.environ, **new_env(args)))
    print(f"code list: {res['code_list']}", flush=True)
    res["whole_model_old"] = {}
    for path in args.old:  # the same run with the moetool of other checkouts, for a before/after
        drop_caches()
        log = w / f"report-{path.name}.json"
        env = dict(os.environ, PYTHONPATH=str(path))
        t0, disk = time.perf_counter(), DiskReads()
        with open(log, "w") as f, open(f"{log}.err", "w") as e:
            code = subprocess.run(whole[0], stdout=f, stderr=e, env=env, cwd=path).returncode
        wall, rates = time.perf_counter() - t0, disk.stop()
        try:
            parent = json.loads(log.read_text()).get("timings_s", {})
        except (OSError, ValueError):
            parent = {}
        res["whole_model_old"][path.name] = {"wall_s": wall, "exit": code, "passed": code == 0, "parent_s": parent,
                                             "disk_gbps": rates}
        print(f"verify --whole-model ({path.name}): {wall:.1f} s wall, "
              f"{'PASSED' if code == 0 else f'exit {code}: not a comparable run'}; "
              + ", ".join(f"{k} {v:.1f}" for k, v in parent.items()) + f"\n  disk GB/s by 2 s: {disk_line(rates)}",
              flush=True)
    drop_caches()
    report_path = w / "report.json"
    disk = DiskReads()
    res["verify_wall_s"] = timed(whole[0], report_path, env=dict(os.environ, **new_env(args)))
    res["disk_gbps"] = disk.stop()
    text = report_path.read_text()
    report = json.loads(text)
    rank = report["ranks"][0]
    res["phases_s"] = rank["timings_s"]
    res["parent_s"] = report.get("timings_s", {})  # startup, modules checked, ranks, wall
    res["row_phases_s"] = rank["row_timings_s"]
    res["memory"] = rank["memory"]
    res["rows"] = [{k: r[k] for k in ("name", "kind", "stream_rel_err", "layer_rel_err", "mlp_rel_err")}
                   for r in report["rows"]]
    res["logits"] = report["logits"]
    res["passed"] = report["passed"]
    moe_ref_gb = 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"] * args.experts * 2 / 1e9
    res["moe_layer_reference_gb"] = moe_ref_gb

    ph = res["phases_s"]
    print(f"\n{res['gpu']}: DeepSeek-V3 dims, {args.dense_layers} dense + {args.moe_layers} MoE layers, "
          f"{args.experts} experts; model {res['model_gb']:.1f} GB bf16, shards {res['shards_gb']:.1f} GB {args.format}")
    print(f"write {res['write_s']:.1f} s; read floor (cat, cold) {res['read_floor_s']:.1f} s = "
          f"{res['read_floor_gbps']:.2f} GB/s; quantize {res['quantize_s']:.1f} s; shard {res['shard_s']:.1f} s")
    print(f"verify --whole-model wall {res['verify_wall_s']:.1f} s ({'PASSED' if res['passed'] else 'FAILED'}), "
          f"{args.tokens} tokens x {args.seq_len}:")
    print("parent:", ", ".join(f"{k} {v:.1f}" for k, v in res["parent_s"].items()))
    print(f"disk GB/s by 2 s: {disk_line(res['disk_gbps'])}")
    print(f"{'phase':<22} {'seconds':>8}")
    for k, v in ph.items():
        print(f"{k:<22} {v:>8.3f}")
    print("memory:", ", ".join(f"{k} {v:.0f}" for k, v in res["memory"].items()))
    for r in res["rows"]:
        print(f"  row {r['name']:>5} {r['kind']:>5} stream {r['stream_rel_err']:.2e} own {r['layer_rel_err']:.2e} "
              f"mlp {r['mlp_rel_err'] if r['mlp_rel_err'] is None else format(r['mlp_rel_err'], '.2e')}")
    print("logits:", {k: v for k, v in res["logits"].items() if v is not None})
    rows = res["row_phases_s"]

    def total(row: dict) -> float:  # moe_* phases are parts of converted_forward
        return sum(v for k, v in row.items() if not k.startswith("moe_"))

    per = {kind: [total(rows[r["name"]]) for r in res["rows"] if r["kind"] == kind and r["name"] in rows]
           for kind in ("dense", "moe")}
    print(f"{'row':<6} " + " ".join(f"{p:>17}" for p in ph))
    for name, t in rows.items():
        print(f"{name:<6} " + " ".join(f"{t.get(p, 0.0):>17.3f}" for p in ph))
    if per["moe"]:
        moe = sum(per["moe"]) / len(per["moe"])
        dense = sum(per["dense"]) / len(per["dense"]) if per["dense"] else 0.0
        ends = sum(total(rows.get(r, {})) for r in ("embed", "head"))  # build is in the embed row
        one_gpu = ends + 3 * dense + 58 * moe
        mo = rows[next(r["name"] for r in res["rows"] if r["kind"] == "moe")]
        ref_side = mo.get("read_reference", 0.0) + mo.get("reference_forward", 0.0)
        conv_side = moe - ref_side
        # 8 GPUs, ep 8: the converted side's expert reads and compute split 8 ways; the reporting
        # rank still reads and runs the whole bf16 reference layer
        node = ends + 3 * dense + 58 * (ref_side + conv_side / 8)
        res["extrapolation_61_layers_s"] = {"one_gpu": one_gpu, "8_gpus_ep8_estimate": node,
                                            "per_moe_layer_s": moe, "per_dense_layer_s": dense}
        print(f"per MoE layer {moe:.1f} s (reference side {ref_side:.1f} s), per dense layer {dense:.1f} s; "
              f"61 layers (3 dense + 58 MoE): {one_gpu / 60:.1f} min on this GPU, ~{node / 60:.1f} min on an "
              f"8-GPU node at ep 8 (estimate: the reference side does not split)")
    gbps = (res["model_gb"] + res["shards_gb"]) / (res["read_floor_s"] + res["shards_read_s"])
    nbytes = {i: layer_bytes(src).get(i, 0) + layer_bytes(sh).get(i, 0) for i in range(cfg["num_hidden_layers"])}
    steady = steady_layers(res["parent_s"], [int(r["name"]) for r in res["rows"] if r["kind"] == "moe"], nbytes, gbps)
    res["steady_moe_layers"] = steady
    if steady:
        total_floor, total_s = sum(r["read_floor_s"] for r in steady), sum(r["s"] for r in steady)
        print(f"steady state (MoE layers after the first), disk {gbps:.2f} GB/s cold: " + "; ".join(
            f"layer {r['layer']} {r['s']:.1f} s vs read floor {r['read_floor_s']:.1f} s ({r['x_read_floor']:.2f}x)"
            for r in steady) + f"; together {total_floor / total_s:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
