"""Expert placement and ``moetool shard`` / ``--merge``.

Structured checks: every rank folder's experts are compared with the source's expert at the
global id the manifest assigns to that slot, so a misplaced expert shows up by its id.
"""
from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
import warm_python

from moetool.convert.merge import merge
from moetool.convert.shard import shard
from moetool.read.checkpoint import open_checkpoint
from moetool.errors import MoetoolError
from moetool.read.experts import ExpertReader
from moetool.model.placement import add_redundant, linear_placement, make_placement, round_robin_placement
from moetool.read.manifest import rank_dir
from moetool.read.shards import EPShards
from moetool.read.manifest import JOURNAL_NAME, MANIFEST_NAME, sha256_file
from moeutil import bit_equal, read_tensors, tensor_files, tree_hashes

# ------------------------------------------------------------------------------ placement tables


def test_linear_remainder_on_last_rank():
    p = linear_placement(8, 3)
    assert p.slots == [[0, 1], [2, 3], [4, 5, 6, 7]]
    assert p.replicas[6] == [(2, 2)]
    # vLLM determine_expert_map: global -> local slot on this rank, -1 elsewhere
    assert p.expert_map(0).tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert p.expert_map(2).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]


def test_linear_256_experts_8_ranks():
    p = linear_placement(256, 8)
    assert p.slots == [list(range(32 * r, 32 * (r + 1))) for r in range(8)]
    assert all(p.replicas[e] == [(e // 32, e % 32)] for e in range(256))


@pytest.mark.parametrize("E, ep, expected", [
    (8, 1, [list(range(8))]),
    (4, 4, [[0], [1], [2], [3]]),
    (10, 4, [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9]]),
])
def test_linear_edges(E, ep, expected):
    assert linear_placement(E, ep).slots == expected


def test_round_robin():
    p = round_robin_placement(8, 3)
    assert p.slots == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert p.replicas[7] == [(1, 2)]
    assert p.expert_map(1).tolist() == [-1, 0, -1, -1, 1, -1, -1, 2]


def test_redundant_hottest_on_least_loaded_rank():
    # ranks (linear 8/4): r0 {0,1}=10, r1 {2,3}=0, r2 {4,5}=0, r3 {6,7}=90
    p = add_redundant(linear_placement(8, 4), [10, 0, 0, 0, 0, 0, 0, 90], 1)
    assert p.replicas[7] == [(3, 1), (1, 2)]  # least loaded ranks r1 = r2 = 0: the lower id
    assert p.slots == [[0, 1], [2, 3, 7], [4, 5], [6, 7]]
    assert p.expert_map(1)[7] == 2 and p.expert_map(3)[7] == 1


def test_redundant_several_replicas_never_two_on_one_rank():
    load = [100, 1, 1, 1, 1, 1, 1, 50]
    p = add_redundant(linear_placement(8, 4), load, 2)
    # 1st: expert 0 (100) -> r1 (load 2; r2 ties, lower id). 2nd: expert 0 (50 per copy, tie
    # with expert 7 -> lower id) -> r2, the least loaded rank without a copy of it.
    assert p.replicas[0] == [(0, 0), (1, 2), (2, 2)]
    p = add_redundant(linear_placement(8, 4), load, 3)
    assert p.replicas[7] == [(3, 1), (0, 2)]  # then expert 7 (50): r0 at 51 beats r1/r2 at 52, r3 holds it
    for e, places in p.replicas.items():
        assert len({r for r, _ in places}) == len(places)
    # per-rank slots are dense 0..n-1
    for r, slots in enumerate(p.slots):
        assert sorted(s for e in p.replicas for rr, s in p.replicas[e] if rr == r) == list(range(len(slots)))


def test_redundant_cannot_exceed_one_copy_per_rank():
    with pytest.raises(MoetoolError, match=r"^--redundant-experts 2: expert 0 already has a copy on every rank$"):
        add_redundant(linear_placement(4, 2), [1000, 1, 1, 1], 2)


@pytest.mark.parametrize("kind, E, ep, message", [
    ("linear", 8, 0, "--ep 0: must be at least 1"),
    ("linear", 8, -2, "--ep -2: must be at least 1"),
    ("round-robin", 8, 9, "--ep 9: more ranks than experts (8); every rank needs an expert"),
    ("striped", 8, 2, "--placement 'striped': expected one of linear, round-robin"),
])
def test_placement_errors(kind, E, ep, message):
    with pytest.raises(MoetoolError) as err:
        make_placement(kind, E, ep)
    assert str(err.value) == message


# ------------------------------------------------------------------------------ shard outputs


@pytest.fixture(scope="module")
def sources(tiny, tmp_path_factory):
    """DeepSeek-V3 layout (dense layer 0, MoE layers 1-2, 8 experts): bf16, fp8-block, int4
    (asymmetric: zero points packed along N), each per-expert and stacked."""
    from moetool.convert.quantize import quantize
    from moetool.convert.repack import repack

    bf16 = tiny("deepseek_v3")
    root = tmp_path_factory.mktemp("shard_sources")
    out = {"bf16": bf16}
    quantize(bf16, root / "fp8-block", "fp8-block", progress=False)
    quantize(bf16, root / "int4", "int4-group", group_size=64, symmetric=False, progress=False)
    out["fp8-block"], out["int4"] = root / "fp8-block", root / "int4"
    for k in ("bf16", "fp8-block", "int4"):
        repack(out[k], root / f"{k}-stacked", "stacked", progress=False)
        out[f"{k}-stacked"] = root / f"{k}-stacked"
    return out


def check_shards(src: Path, out: Path, ep: int, layout: str, extra_copies: int = 0) -> dict:
    """Rank folders hold exactly the manifest's experts (by global id) plus every non-expert
    tensor; the manifest lists every file with its sha256 and size."""
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["kind"] == "ep-shards" and manifest["ep"] == ep and manifest["layout"] == layout
    assert manifest["ranks"] == [rank_dir(r, ep) for r in range(ep)]
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert set(manifest["files"]) == files
    for name, rec in manifest["files"].items():
        assert rec == {"sha256": sha256_file(out / name), "size": (out / name).stat().st_size}, name
    assert not (out / JOURNAL_NAME).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST_NAME] + manifest["ranks"])

    src_t = read_tensors(src)
    with open_checkpoint(src) as ck:
        reader = ExpertReader(ck)
        spec, fmt = reader.spec, reader.fmt
        src_experts = {}
        for layer in spec.moe_layers:
            for e in range(layer.num_experts):
                src_experts[layer.index, e] = (reader.w13(layer, e), reader.down(layer, e))
    shards = EPShards(out)
    copies = {}
    for r in range(ep):
        ck, rspec = shards.open_rank(r)
        with ck:
            assert ck.config["moetool_ep"]["rank"] == r and ck.config["moetool_ep"]["layout"] == layout
            rreader = ExpertReader(ck, rspec)
            assert rreader.fmt == fmt
            rank_t = read_tensors(ck.root)
            for layer in rspec.moe_layers:
                slots = shards.placements[layer.index].slots[r]
                assert layer.n_stored == len(slots)
                assert layer.storage.kind == layout
                for slot, e in enumerate(slots):
                    w13, w2 = rreader.w13(layer, slot), rreader.down(layer, slot)
                    want13, want2 = src_experts[layer.index, e]
                    assert set(w13) == set(want13)
                    for s in want13:
                        assert bit_equal(w13[s], want13[s]), (r, layer.index, slot, e, s)
                    for s in want2:
                        assert bit_equal(w2[s], want2[s]), (r, layer.index, slot, e, s)
                    copies[layer.index, e] = copies.get((layer.index, e), 0) + 1
                # nothing else of this layer's experts on the rank
                n_expert_tensors = sum(1 for n in rank_t if n.startswith(f"{layer.prefix}.experts."))
                per = len(fmt.suffixes) if layout == "stacked" else len(fmt.suffixes) * 3 * len(slots)
                assert n_expert_tensors == (2 * per if layout == "stacked" else per)
            for name, t in src_t.items():  # every non-expert tensor, bit-identical
                if ".experts." not in name:
                    assert bit_equal(rank_t[name], t), (r, name)
    # every expert exactly once, plus the replicas
    assert set(copies) == set(src_experts)
    assert sum(copies.values()) == len(src_experts) + extra_copies
    for layer in manifest["layers"]:
        for e, places in layer["replicas"].items():
            assert copies[layer["layer"], int(e)] == len(places)
    return manifest


@pytest.mark.parametrize("src_id", ["bf16", "fp8-block", "int4", "int4-stacked"])
@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_shard_and_merge(sources, cli, tmp_path, src_id, layout):
    src = sources[src_id]
    before = tree_hashes(src)
    out = tmp_path / "shards"
    r = cli("shard", src, out, "--ep", "3", "--layout", layout, "--quiet")
    assert r.code == 0, r.err
    m = check_shards(src, out, 3, layout)
    assert m["placement"] == "linear" and m["layers"][0]["slots"] == [[0, 1], [2, 3], [4, 5, 6, 7]]
    merged = tmp_path / "merged"
    r = cli("shard", "--merge", out, merged, "--quiet")
    assert r.code == 0, r.err
    assert tree_hashes(src) == before
    # merge rebuilds the source: same tensors, bit for bit, in the same files
    a, b = read_tensors(src), read_tensors(merged)
    assert set(a) == set(b)
    assert all(bit_equal(a[n], b[n]) for n in a)
    assert tensor_files(src) == tensor_files(merged)
    assert json.loads((merged / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    if src_id != "bf16":  # written by moetool: the very same bytes
        want = {k: v for k, v in tree_hashes(src).items() if k != MANIFEST_NAME}
        got = {k: v for k, v in tree_hashes(merged).items() if k != MANIFEST_NAME}
        assert got == want


def test_side_files_go_to_every_rank_and_back_through_merge(sources, cli, tmp_path):
    """The tokenizer, generation config and chat template: each rank folder gets them (it loads
    on its own), and ``shard --merge`` gives them back, so the merged folder is the source's,
    file for file (the shards dropped them: a merged model had no tokenizer)."""
    from moetool.read.manifest import verify_manifest

    src = shutil.copytree(sources["fp8-block"], tmp_path / "src")
    (src / MANIFEST_NAME).unlink()
    side = {"tokenizer.json": '{"model": {"type": "BPE"}}', "tokenizer_config.json": '{"model_max_length": 64}',
            "generation_config.json": '{"do_sample": false}', "chat_template.jinja": "{{ messages }}",
            "tokenizer.model": "\x00sentencepiece"}
    for name, text in side.items():
        (src / name).write_text(text)
    out = tmp_path / "shards"
    assert cli("shard", src, out, "--ep", "2", "--quiet").code == 0
    listed = verify_manifest(out)["files"]
    for rank in ("rank-00000-of-00002", "rank-00001-of-00002"):
        for name, text in side.items():
            assert (out / rank / name).read_text() == text and f"{rank}/{name}" in listed
    merged = tmp_path / "merged"
    assert cli("shard", "--merge", out, merged, "--quiet").code == 0
    want = {k: v for k, v in tree_hashes(src).items()}
    got = {k: v for k, v in tree_hashes(merged).items() if k != MANIFEST_NAME}
    assert got == want


def test_round_robin_with_redundant_experts(sources, cli, tmp_path):
    load = tmp_path / "load.json"
    counts = {"1": [5, 900, 3, 0, 7, 1, 2, 400], "2": [0, 0, 0, 0, 0, 0, 0, 1]}
    load.write_text(json.dumps({"layers": counts}))
    out = tmp_path / "shards"
    r = cli("shard", sources["fp8-block"], out, "--ep", "4", "--placement", "round-robin",
            "--redundant-experts", "2", "--expert-load", load, "--quiet")
    assert r.code == 0, r.err
    m = check_shards(sources["fp8-block"], out, 4, "stacked", extra_copies=2 * 2)
    assert m["placement"] == "round-robin" and m["redundant_experts"] == 2
    layers = {l["layer"]: l for l in m["layers"]}
    # layer 1 (round-robin 8/4): r0 {0,4}=12, r1 {1,5}=901, r2 {2,6}=5, r3 {3,7}=400
    # expert 1 (900) -> r2 (5); then expert 1 (450/copy) again -> r0 (12)
    assert layers[1]["replicas"]["1"] == [[1, 0], [2, 2], [0, 2]]
    assert layers[1]["replicas"]["7"] == [[3, 1]]
    # layer 2: only expert 7 is hot: copies on r0 (0, lowest id), then r1
    assert layers[2]["replicas"]["7"] == [[3, 1], [0, 2], [1, 2]]
    merged = tmp_path / "merged"
    assert cli("shard", "--merge", out, merged, "--quiet").code == 0
    a, b = read_tensors(sources["fp8-block"]), read_tensors(merged)
    assert set(a) == set(b) and all(bit_equal(a[n], b[n]) for n in a)


def test_one_rank_per_expert_and_single_rank(sources, cli, tmp_path):
    for ep in (1, 8):
        out = tmp_path / f"ep{ep}"
        assert cli("shard", sources["bf16"], out, "--ep", ep, "--quiet").code == 0
        check_shards(sources["bf16"], out, ep, "stacked")


def test_shard_is_resumable(sources, cli, tmp_path):
    """SIGKILL in the middle of the run, then re-run: finished files are skipped and the
    output is identical to an uninterrupted run."""
    src = sources["int4"]
    ref = tmp_path / "ref"
    assert cli("shard", src, ref, "--ep", "2", "--quiet").code == 0
    out = tmp_path / "out"
    killer = (
        "import os, signal, sys\n"
        "os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # one file at a time, as on 2 cores\n"
        "from moetool.convert import torch_executor as convert\n"
        "orig = convert.Executor.chunks\n"
        "n = [0]\n"
        "def chunks(self, pf):\n"
        "    n[0] += 1\n"
        "    for i, item in enumerate(orig(self, pf)):\n"
        "        if n[0] == 3 and i == 2:\n"
        "            os.kill(os.getpid(), signal.SIGKILL)\n"
        "        yield item\n"
        "convert.Executor.chunks = chunks\n"
        "from moetool.cli import main\n"
        "main(sys.argv[1:])\n"
    )
    p = warm_python.run([sys.executable, "-c", killer, "shard", str(src), str(out), "--ep", "2", "--quiet"], timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert not (out / MANIFEST_NAME).exists() and (out / JOURNAL_NAME).exists()
    finished = json.loads((out / JOURNAL_NAME).read_text())["files"]
    assert len(finished) == 2  # rank 0's model-common and first expert file
    r = cli("shard", src, out, "--ep", "2", "--quiet")
    assert r.code == 0, r.err
    assert "2 resumed" in r.out
    assert tree_hashes(out) == tree_hashes(ref)


@pytest.mark.parametrize("byte_copy", [True, False])
def test_ranks_share_one_common_file(sources, cli, tmp_path, byte_copy):
    """The non-expert tensors are written once: every rank's model-common file is a hard link
    to rank 0's (one inode); with --no-links each rank has its own copy of the same bytes.
    Either way the manifest, the other files and every rank's tensors are the same."""
    from moetool.convert.shard import shard

    src = sources["bf16"]
    linked, copied = tmp_path / "linked", tmp_path / "copied"
    shard(src, linked, 4, progress=False, byte_copy=byte_copy)
    if byte_copy:
        r = cli("shard", src, copied, "--ep", "4", "--no-links", "--quiet")
        assert r.code == 0 and ("GB of it the non-expert tensors every rank repeats: hard links to rank 0's files, "
                                "or copies with --no-links) in") in r.out
    else:
        shard(src, copied, 4, progress=False, byte_copy=False, links=False)
    assert tree_hashes(linked) == tree_hashes(copied)
    commons = sorted(p.name for p in (linked / rank_dir(0, 4)).glob("model-common*.safetensors"))
    assert commons == ["model-common-00001-of-00002.safetensors", "model-common-00002-of-00002.safetensors"]  # as the input
    man = json.loads((linked / MANIFEST_NAME).read_text())["files"]
    for common in commons:
        assert len({(linked / rank_dir(r, 4) / common).stat().st_ino for r in range(4)}) == 1
        assert (linked / rank_dir(0, 4) / common).stat().st_nlink == 4
        assert len({(copied / rank_dir(r, 4) / common).stat().st_ino for r in range(4)}) == 4
        assert len({man[f"{rank_dir(r, 4)}/{common}"]["sha256"] for r in range(4)}) == 1
    check_shards(src, linked, 4, "stacked")


def test_common_file_copied_where_links_are_refused(sources, tmp_path, monkeypatch):
    """A file system without hard links (or a refused link): the rank files are copies."""
    import moetool.convert.output as writer
    from moetool.convert.shard import shard

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted (test)")

    monkeypatch.setattr(writer.os, "link", no_links)
    out = tmp_path / "o"
    shard(sources["bf16"], out, 2, progress=False)
    a, b = (out / rank_dir(r, 2) / "model-common-00001-of-00002.safetensors" for r in range(2))
    assert a.stat().st_ino != b.stat().st_ino and a.read_bytes() == b.read_bytes()
    assert not list(out.rglob("*.incomplete"))
    check_shards(sources["bf16"], out, 2, "stacked")


def test_resumed_links_are_not_hashed_again_nor_written_through(sources, tmp_path, monkeypatch):
    """Resuming: a rank's model-common file that is still a hard link to rank 0's finished
    one takes its record without being read again, and a leftover ``.incomplete`` that is a
    hard link to a finished file is replaced, never written through."""
    import os

    import moetool.convert.output as writer
    from moetool.convert.shard import shard

    src = sources["bf16"]
    ref = tmp_path / "ref"
    shard(src, ref, 4, progress=False)
    out = tmp_path / "out"
    with monkeypatch.context() as m:  # stop before the manifest: everything journaled
        m.setattr(writer.OutputDir, "finish", lambda self, extra=None: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            shard(src, out, 4, progress=False)
    common0 = out / rank_dir(0, 4) / "model-common-00001-of-00002.safetensors"
    before = common0.read_bytes()
    stray = out / rank_dir(1, 4) / f"model-common-00001-of-00002.safetensors{writer.INCOMPLETE}"
    (out / rank_dir(1, 4) / "model-common-00001-of-00002.safetensors").unlink()  # rank 1's link to redo
    os.link(common0, stray)
    hashed = []
    orig = writer.sha256_file
    monkeypatch.setattr(writer, "sha256_file", lambda p: hashed.append(Path(p).name) or orig(p))
    summary = shard(src, out, 4, progress=False)
    assert summary.files_written == 1  # rank 1's model-common-00001 link
    assert common0.read_bytes() == before and not stray.exists()
    assert hashed.count("model-common-00001-of-00002.safetensors") == 1  # rank 0's only
    assert hashed.count("model-common-00002-of-00002.safetensors") == 1
    assert tree_hashes(out) == tree_hashes(ref)


def test_plan_version_is_in_the_plan_id(sources, monkeypatch):
    """Another version's plan (other file names for the same options) never resumes this one's journal."""
    import moetool.convert.planning as plan

    with open_checkpoint(sources["bf16"]) as ck:
        a = plan.plan_id(ck, ep=2)
        monkeypatch.setattr(plan, "PLAN_VERSION", plan.PLAN_VERSION + 1)
        assert plan.plan_id(ck, ep=2) != a


def test_dry_run(sources, cli, tmp_path):
    r = cli("shard", sources["bf16"], tmp_path / "o", "--ep", "2", "--dry-run")
    assert r.code == 0 and r.out.startswith("plan: 8 file(s)")
    assert "rank-00001-of-00002/model-00002-of-00002.safetensors" in r.out
    line = next(l for l in r.out.splitlines() if "rank-00001-of-00002/model-common-00002-of-00002" in l)
    assert line.endswith("(the same as rank-00000-of-00002/model-common-00002-of-00002.safetensors: a hard link to it, "
                         "or a copy with --no-links)")
    assert not (tmp_path / "o").exists()


def test_merge_checks_the_manifest(sources, cli, tmp_path):
    out = tmp_path / "shards"
    assert cli("shard", sources["bf16"], out, "--ep", "2", "--quiet").code == 0
    victim = out / rank_dir(1, 2) / "model-00002-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 1
    victim.write_bytes(bytes(data))
    r = cli("shard", "--merge", out, tmp_path / "m", "--quiet")
    assert r.code == 2
    assert r.error_line == f"{victim}: sha256 does not match manifest.json (file modified or corrupt)"
    victim.unlink()
    r = cli("shard", "--merge", out, tmp_path / "m", "--quiet")
    assert r.code == 2 and r.error_line == f"{victim}: missing (listed in manifest.json)"


# ------------------------------------------------------------------------------ errors


def _load_file(tmp_path, layers) -> Path:
    p = tmp_path / "load.json"
    p.write_text(json.dumps({"layers": layers}))
    return p


@pytest.mark.parametrize("case", ["ep0", "ep_too_big", "load_layers", "load_counts", "load_negative", "load_json",
                                  "no_load", "load_no_redundant", "merge_with_ep", "no_ep", "load_missing",
                                  "placement"])
def test_shard_errors(sources, cli, tmp_path, case):
    src = sources["bf16"]
    ok = [1] * 8
    args, message = {
        "ep0": (["--ep", "0"], "--ep 0: must be at least 1"),
        "ep_too_big": (["--ep", "9"], "--ep 9: more ranks than experts (8); every rank needs an expert"),
        "load_layers": (["--ep", "2", "--redundant-experts", "1", "--expert-load", {"0": ok, "1": ok}],
                        f"--expert-load {tmp_path / 'load.json'}: layers do not match the model's MoE layers "
                        "(missing [2], not MoE layers [0])"),
        "load_counts": (["--ep", "2", "--redundant-experts", "1", "--expert-load", {"1": ok, "2": [1] * 7}],
                        f"--expert-load {tmp_path / 'load.json'}: layer 2 has 7 counts for 8 experts"),
        "load_negative": (["--ep", "2", "--redundant-experts", "1",
                           "--expert-load", {"1": ok, "2": [1, -1] * 4}],
                          f"--expert-load {tmp_path / 'load.json'}: layer 2 expert 1: -1 is not a count (a finite "
                          "number >= 0)"),
        "load_json": (["--ep", "2", "--redundant-experts", "1", "--expert-load", tmp_path / "bad.json"], None),
        "no_load": (["--ep", "2", "--redundant-experts", "1"],
                    "--redundant-experts needs --expert-load FILE (per-layer token counts per expert)"),
        "load_no_redundant": (["--ep", "2", "--expert-load", {"1": ok, "2": ok}],
                              "--expert-load is only used with --redundant-experts R (R > 0)"),
        "merge_with_ep": (["--merge", "--ep", "2"], "--merge takes the rank count from the manifest; drop --ep"),
        "no_ep": ([], "--ep N is required (or --merge)"),
        "load_missing": (["--ep", "2", "--redundant-experts", "1", "--expert-load", tmp_path / "nope.json"],
                         f"--expert-load {tmp_path / 'nope.json'}: no such file"),
        "placement": (["--ep", "2", "--placement", "random"], "--placement 'random': expected one of linear, round-robin"),
    }[case]
    if case == "load_json":
        (tmp_path / "bad.json").write_text("{not json")
    args = [_load_file(tmp_path, a) if isinstance(a, dict) else a for a in args]
    r = cli("shard", src, tmp_path / "out", *args, "--quiet")
    assert r.code == 2
    if message is None:
        assert r.error_line.startswith(f"--expert-load {tmp_path / 'bad.json'}: invalid JSON (")
    else:
        assert r.error_line == message
    assert not (tmp_path / "out").exists()


#: load files that parse as JSON (Python's reading of it) but hold no counts: each once gave a
#: placement (NaN sums put every replica on expert 0) or a traceback
BAD_LOADS = {
    "nan": ('{"1": [NaN, 1, 1, 1, 1, 1, 1, 1], "2": [1, 1, 1, 1, 1, 1, 1, 1]}', "invalid JSON (NaN is not a count)"),
    "infinity": ('{"1": [Infinity, 1, 1, 1, 1, 1, 1, 1]}', "invalid JSON (Infinity is not a count)"),
    "overflow": ('{"1": [1e400, 1, 1, 1, 1, 1, 1, 1], "2": [1, 1, 1, 1, 1, 1, 1, 1]}',
                 "layer 1 expert 0: Infinity is not a count (a finite number >= 0)"),
    "bool": ('{"1": [true, 1, 1, 1, 1, 1, 1, 1], "2": [1, 1, 1, 1, 1, 1, 1, 1]}',
             "layer 1 expert 0: true is not a count (a finite number >= 0)"),
    "string": ('{"1": ["1e3", 1, 1, 1, 1, 1, 1, 1], "2": [1, 1, 1, 1, 1, 1, 1, 1]}',
               'layer 1 expert 0: "1e3" is not a count (a finite number >= 0)'),
    "digits": ('{"1": "12345678", "2": [1, 1, 1, 1, 1, 1, 1, 1]}', "layer 1 needs a list of counts, one per expert"),
    "twice": ('{"1": [1, 1, 1, 1, 1, 1, 1, 1], "2": [1, 1, 1, 1, 1, 1, 1, 1], "2": [9, 1, 1, 1, 1, 1, 1, 1]}',
              'invalid JSON (key "2" appears twice)'),
    "leading-zero": ('{"1": [1, 1, 1, 1, 1, 1, 1, 1], "02": [1, 1, 1, 1, 1, 1, 1, 1]}',
                     'layer key "02" is not a layer index'),
    "huge-int": ('{"1": [' + "9" * 5000 + ']}', "invalid JSON (Exceeds the limit (4300 digits)"),
    "past-float": ('{"1": [' + "9" * 400 + ', 1, 1, 1, 1, 1, 1, 1], "2": [1, 1, 1, 1, 1, 1, 1, 1]}',
                   "layer 1 expert 0: " + "9" * 40 + " is not a count (a finite number >= 0)"),
    "deep": ("[" * 100000 + "]" * 100000, "invalid JSON (maximum recursion depth exceeded"),
}


@pytest.mark.parametrize("case", BAD_LOADS)
def test_a_load_file_of_no_counts_is_refused(sources, cli, tmp_path, case):
    text, message = BAD_LOADS[case]
    (tmp_path / "load.json").write_text(text)
    r = cli("shard", sources["bf16"], tmp_path / "out", "--ep", "2", "--redundant-experts", "1",
            "--expert-load", tmp_path / "load.json", "--quiet")
    assert r.code == 2 and r.error_line.startswith(f"--expert-load {tmp_path / 'load.json'}: {message}"), r
    assert not (tmp_path / "out").exists()


def test_shard_output_inside_input(sources, cli, copy_ckpt):
    src = copy_ckpt(sources["bf16"])
    before = tree_hashes(src)
    r = cli("shard", src, src / "shards", "--ep", "2", "--quiet")
    assert r.code == 2
    assert r.error_line == f"output {src / 'shards'} is inside the input {src}; the input folder is never written"
    assert tree_hashes(src) == before


def test_shard_refuses_a_rank_folder_and_merge_a_checkpoint(sources, cli, tmp_path):
    out = tmp_path / "shards"
    assert cli("shard", sources["bf16"], out, "--ep", "2", "--quiet").code == 0
    rank = out / rank_dir(0, 2)
    r = cli("shard", rank, tmp_path / "again", "--ep", "2", "--quiet")
    assert r.code == 2
    assert r.error_line == (f"{rank}: is one rank folder (rank 0 of 2) of a moetool shard output, not a model: it "
                            "holds only that rank's experts, renumbered from 0; `moetool verify` and "
                            f"`moetool shard --merge` take the shard folder ({out})")
    r = cli("shard", "--merge", sources["bf16"], tmp_path / "m", "--quiet")
    assert r.code == 2
    assert r.error_line == f"{sources['bf16']}: no manifest.json (output unfinished or not made by moetool)"
    done = tmp_path / "q"
    assert cli("quantize", sources["bf16"], done, "--fp8-block", "--quiet").code == 0
    r = cli("shard", "--merge", done, tmp_path / "m", "--quiet")
    assert r.code == 2
    assert r.error_line == f"{done}: manifest.json is not from moetool shard (kind 'checkpoint')"


def test_complete_shard_output_refused_without_force(sources, cli, tmp_path):
    out = tmp_path / "shards"
    assert cli("shard", sources["bf16"], out, "--ep", "2", "--quiet").code == 0
    r = cli("shard", sources["bf16"], out, "--ep", "2", "--quiet")
    assert r.code == 2 and r.error_line.endswith("already holds a complete output (manifest.json); use --force to overwrite")
    assert cli("shard", sources["bf16"], out, "--ep", "2", "--quiet", "--force").code == 0


def test_library_errors_are_moetool_errors(sources, tmp_path):
    from moetool.convert.shard import shard

    with pytest.raises(MoetoolError):
        shard(sources["bf16"], tmp_path / "o", 0, progress=False)
    assert torch.is_tensor(linear_placement(4, 2).expert_map(0))


def test_redundant_per_expert_layout(sources, cli, tmp_path):
    load = _load_file(tmp_path, {"1": [0, 0, 0, 0, 0, 0, 50, 10], "2": [9, 0, 0, 0, 0, 0, 0, 0]})
    out = tmp_path / "shards"
    r = cli("shard", sources["int4"], out, "--ep", "3", "--layout", "per-expert", "--redundant-experts", "1",
            "--expert-load", load, "--quiet")
    assert r.code == 0, r.err
    m = check_shards(sources["int4"], out, 3, "per-expert", extra_copies=2)
    # linear 8/3: r2 holds 4..7 (load 60) -> expert 6 goes to r0 (0 < r1's 0? tie: lower id)
    assert m["layers"][0]["replicas"]["6"] == [[2, 2], [0, 2]]
    assert m["layers"][1]["replicas"]["0"] == [[0, 0], [1, 2]]
    rank0 = read_tensors(out / rank_dir(0, 3))
    assert "model.layers.1.mlp.experts.2.down_proj.weight_packed" in rank0  # slot 2 = global expert 6
    merged = tmp_path / "merged"
    assert cli("shard", "--merge", out, merged, "--quiet").code == 0
    a, b = read_tensors(sources["int4"]), read_tensors(merged)
    assert set(a) == set(b) and all(bit_equal(a[n], b[n]) for n in a)


def test_rank_folder_is_a_checkpoint_of_its_own(sources, cli, tmp_path):
    out = tmp_path / "shards"
    assert cli("shard", sources["fp8-block"], out, "--ep", "3", "--layout", "per-expert", "--quiet").code == 0
    r = cli("inspect", out / rank_dir(2, 3), "--json")
    assert r.code == 0, r.err
    info = json.loads(r.out)
    assert info["weight_format"] == "fp8-block" and info["expert_storage"] == "per-expert"


@pytest.mark.parametrize("family, layout", [("llama4", "original"), ("qwen3_moe", "v5"), ("mixtral", "v5")])
def test_fused_source_merges_back_fused(tiny, cli, tmp_path, family, layout):
    """Fused experts (Llama-4 input-first, transformers v5): shard -> merge gives back the
    same tensor names, bit for bit, in the same files (the guide's promise); merged per-expert
    on request, the same experts."""
    src = tiny(family, layout=layout)
    out, merged = tmp_path / "shards", tmp_path / "merged"
    assert cli("shard", src, out, "--ep", "2", "--quiet").code == 0
    assert cli("shard", "--merge", out, merged, "--quiet").code == 0
    assert tensor_files(merged) == tensor_files(src)
    a, b = read_tensors(src), read_tensors(merged)
    assert all(bit_equal(b[name], t) for name, t in a.items())
    assert json.loads((merged / MANIFEST_NAME).read_text())["layout"] == "fused"

    per_expert = tmp_path / "per-expert"
    merge(out, per_expert, layout="per-expert", progress=False)
    c = read_tensors(per_expert)
    with open_checkpoint(src) as ck:
        reader = ExpertReader(ck)
        for layer in reader.spec.moe_layers:
            for e in range(layer.num_experts):
                want = [x["weight"] for x in reader.gate_up_down(layer, e)]
                bases = [f"{layer.prefix}.experts.{e}.{lin}" for lin in reader.spec.family.expert_linears]
                assert all(torch.equal(c[f"{b}.weight"], w) for b, w in zip(bases, want))


def test_merge_to_fused_needs_a_fused_source(sources, tmp_path):
    out = tmp_path / "shards"
    shard(sources["bf16"], out, 2, progress=False)
    with pytest.raises(MoetoolError, match=r"--layout fused needs a source stored fused; this one was per-expert$"):
        merge(out, tmp_path / "m", layout="fused", progress=False)


def test_small_rank_files_merge_back(sources, cli, tmp_path):
    """--max-shard-size splits each rank folder into more files; merge still restores the
    source's own file layout."""
    out, merged = tmp_path / "shards", tmp_path / "merged"
    assert cli("shard", sources["int4"], out, "--ep", "2", "--max-shard-size", "300KB", "--quiet").code == 0
    assert len(list((out / rank_dir(0, 2)).glob("*.safetensors"))) > 2
    check_shards(sources["int4"], out, 2, "stacked")
    assert cli("shard", "--merge", out, merged, "--quiet").code == 0
    assert tensor_files(merged) == tensor_files(sources["int4"])


def _stopped_before_its_manifest(*args) -> None:
    """``moetool ARGS`` killed just before it writes its manifest (tests/hostile/faults.py):
    every file written and in the journal, no manifest."""
    faults = Path(__file__).parents[1] / "hostile" / "faults.py"
    p = warm_python.run([sys.executable, str(faults), "before-manifest", "1", "--", *map(str, args), "--quiet"],
                        timeout=300)
    assert p.returncode == 9, p.stderr


def test_an_edited_expert_load_is_not_resumed_into_the_old_placement(sources, cli, tmp_path):
    """The journal's fingerprint holds the placements the load file gives, not its name: the
    same file edited so that the replica goes to another expert must not resume the rank
    files of the old placement (they were kept, and the manifest named the new one); an edit
    that places every copy where it was resumes."""
    src, out, load = sources["bf16"], tmp_path / "out", tmp_path / "load.json"
    args = ["shard", src, out, "--ep", "2", "--redundant-experts", "1", "--expert-load", load]
    hot = lambda e: json.dumps({"layers": {str(i): [100 if x == e else 1 for x in range(8)] for i in (1, 2)}})
    load.write_text(hot(2))
    _stopped_before_its_manifest(*args)
    load.write_text(hot(5))
    r = cli(*args, "--quiet")
    assert r.code == 2 and "holds the unfinished output of another moetool run" in r.error_line, r.err
    load.write_text(hot(2).replace("100", "90"))  # the same placement
    r = cli(*args, "--quiet")
    assert r.code == 0 and "0 file(s) written, 8 resumed" in r.out, r.out + r.err


@pytest.mark.parametrize("change", ["other-shards", "max-shard-size"])
def test_a_merge_resumes_only_its_own_shards_and_options(sources, tiny, cli, tmp_path, change):
    """A merge's fingerprint is the shards' whole manifest and its options: re-sharding
    another model (same config) into the same folder, or another --max-shard-size, must not
    resume the merged files of the first run."""
    shards, merged = tmp_path / "shards", tmp_path / "merged"
    assert cli("shard", sources["bf16"], shards, "--ep", "2", "--quiet").code == 0
    _stopped_before_its_manifest("shard", "--merge", shards, merged)
    extra = []
    if change == "other-shards":
        other = tiny("deepseek_v3", seed=1)  # the same config, other weights
        assert cli("shard", other, shards, "--ep", "2", "--force", "--quiet").code == 0
    else:
        extra = ["--max-shard-size", "300KB"]
    r = cli("shard", "--merge", shards, merged, *extra, "--quiet")
    assert r.code == 2 and "holds the unfinished output of another moetool run" in r.error_line, r.err


def test_force_with_another_ep_leaves_no_stale_ranks(sources, cli, tmp_path):
    out = tmp_path / "shards"
    assert cli("shard", sources["bf16"], out, "--ep", "4", "--quiet").code == 0
    assert cli("shard", sources["bf16"], out, "--ep", "2", "--force", "--quiet").code == 0
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, rank_dir(0, 2), rank_dir(1, 2)]
    check_shards(sources["bf16"], out, 2, "stacked")


def test_a_load_file_may_leave_out_the_mtp_layer(tmp_path):
    """An engine's load statistics cover the decoder's MoE layers: DeepSeek-V3's MTP layer,
    left out, gets no replicas; a decoder layer left out is still refused."""
    from moetool.convert.planning import plan_placements
    from moetool.demo.tiny import make_tiny_checkpoint
    from moetool.model.families import describe
    from moetool.read.checkpoint import open_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", "deepseek_v3", hidden=64, intermediate=32, experts=8, top_k=2,
                                layers=2, shards=1, mtp=1)
    with open_checkpoint(path) as ck:
        spec = describe(ck.config, ck.tensors)
    load = tmp_path / "load.json"
    load.write_text(json.dumps({"layers": {"1": [9, 1, 1, 1, 1, 1, 1, 1]}}))
    placements = plan_placements(spec, 2, "linear", 1, load)
    assert sum(map(len, placements[1].slots)) == 9 and sum(map(len, placements[2].slots)) == 8
    assert len(placements[1].replicas[0]) == 2
    load.write_text(json.dumps({"layers": {"2": [9, 1, 1, 1, 1, 1, 1, 1]}}))
    with pytest.raises(MoetoolError, match=r"layers do not match the model's MoE layers \(missing \[1\], "):
        plan_placements(spec, 2, "linear", 1, load)
