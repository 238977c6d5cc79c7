"""``moetool demo``: the whole chain on a built-in tiny model, no download.

tiny DeepSeek-V3-style model (bf16, MLA attention, 16 experts, top-4, grouped sigmoid routing
with correction bias, a shared expert) -> inspect -> quantize --fp8-block -> shard --ep 4 ->
verify --dp 2 --ep 4 (CPU, gloo: every MoE block) -> verify --whole-model (the converted model
end to end against transformers running the original; skipped, saying what to install, when
transformers is missing) with a final verdict, then the commands with their real paths and
options, to re-run by hand. The files go to ``workdir`` (kept) or to a temporary folder
removed at the end.
"""
from __future__ import annotations

import importlib.util
import shlex
import tempfile
import time
from pathlib import Path
from typing import Callable

from moetool.convert.quantize import quantize
from moetool.convert.shard import shard
from moetool.demo.tiny import make_tiny_checkpoint
from moetool.errors import MoetoolError
from moetool.formats.registry import FORMATS, quantize_targets
from moetool.read.checkpoint import open_checkpoint
from moetool.read.inspect import inspect_checkpoint, render
from moetool.verify.driver import VerifyOptions, verify
from moetool.verify.whole_model import WholeModelOptions, verify_whole_model

#: the parameters the demo gives a format that takes them: int4's group size must divide the
#: tiny model's K of every linear (hidden 256, expert intermediate 192), and quantize's default
#: 128 does not divide 192
DEMO_PARAMS = {"group_size": 64}


def format_options(name: str) -> tuple[list[str], dict]:
    """The ``moetool quantize`` options of format ``name`` as the demo runs it, and its
    parameters (from the registry: the format's own CLI options)."""
    cls = FORMATS[name]
    params = {k: v for k, v in DEMO_PARAMS.items() if k in cls.cli_params}
    options = ["--format", name]
    for key, value in params.items():
        options += [cls.cli_params[key].flag.split("/")[0], str(value)]
    return options, params


def resolve_format(name: str) -> str:
    """A format the demo can write, by its name or its quantize flag without dashes ("int4")."""
    targets = {cls.name: cls for cls in quantize_targets()}
    aliases = {flag.lstrip("-"): cls.name for cls in targets.values() for flag in cls.cli_flags}
    name = aliases.get(name, name)
    if name not in targets:
        raise MoetoolError(f"--format {name!r}: expected one of {', '.join(targets)}")
    return name


#: the whole-model check's tokens per dp group and their sequence length (seeded random ids)
WHOLE_MODEL_TOKENS = 128
WHOLE_MODEL_SEQ_LEN = 32

#: the names the demo writes in its folder (a previous demo's, rewritten by the next one)
DEMO_PREFIX = "tiny-moe"


def run_demo(workdir: Path | None = None, *, echo: Callable[[str], None] = print, ep: int = 4, dp: int = 2,
             fmt: str = "fp8-block", dispatch: str = "all2all") -> bool:
    """Run the chain; returns True when verification passed."""
    fmt = resolve_format(fmt)
    if workdir is not None:
        workdir = Path(workdir).absolute()
        _check_workdir(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        echo(f"moetool demo: writing in {workdir} (kept)")
        passed = _run(workdir, echo, ep=ep, dp=dp, fmt=fmt, dispatch=dispatch)
        echo(f"the files are kept in {workdir}")
        return passed
    with tempfile.TemporaryDirectory(prefix="moetool-demo-") as tmp:
        echo(f"moetool demo: writing in the temporary folder {tmp} (removed at the end; --workdir DIR keeps the files)")
        passed = _run(Path(tmp), echo, ep=ep, dp=dp, fmt=fmt, dispatch=dispatch)
    echo(f"the files were in a temporary folder, removed now ({tmp}): run `moetool demo --workdir DIR` to keep them")
    return passed


def _run(root: Path, echo: Callable[[str], None], *, ep: int, dp: int, fmt: str, dispatch: str) -> bool:
    t0 = time.perf_counter()
    model, quant = root / DEMO_PREFIX, root / f"{DEMO_PREFIX}-{fmt}"
    shards = root / f"{DEMO_PREFIX}-{fmt}-ep{ep}"
    # the commands the steps below run, with what they really use (the library calls take the
    # same values; a re-run of the demo in the same folder rewrites its outputs, hence force)
    commands = [
        ["moetool", "inspect", model],
        ["moetool", "quantize", model, quant, *format_options(fmt)[0]],
        ["moetool", "shard", quant, shards, "--ep", ep],
        ["moetool", "verify", shards, "--ref", model, "--dp", dp, "--ep", ep, "--all2all", dispatch],
        ["moetool", "verify", shards, "--ref", model, "--dp", dp, "--ep", ep, "--all2all", dispatch, "--whole-model",
         "--tokens", WHOLE_MODEL_TOKENS, "--seq-len", WHOLE_MODEL_SEQ_LEN],
    ]
    inspect_cmd, quantize_cmd, shard_cmd, verify_cmd, whole_cmd = (_shell(c) for c in commands)

    echo(f"[1/5] writing a tiny DeepSeek-V3-style MoE checkpoint to {model}; {inspect_cmd}")
    make_tiny_checkpoint(model, "deepseek_v3")
    with open_checkpoint(model) as ckpt:
        echo(_indent(render(inspect_checkpoint(ckpt))))
    echo(f"[2/5] {quantize_cmd}")
    echo(_indent(quantize(model, quant, fmt, progress=False, force=True, **format_options(fmt)[1]).render()))
    echo(f"[3/5] {shard_cmd}")
    echo(_indent(shard(quant, shards, ep, progress=False, force=True).render()))
    echo(f"[4/5] {verify_cmd}  (one process per rank; gloo on CPU)")
    report = verify(shards, model, VerifyOptions(dp=dp, ep=ep, dispatch=dispatch))
    echo(_indent(report.render()))
    ran = [inspect_cmd, quantize_cmd, shard_cmd, verify_cmd]
    passed, whole = report.passed, None
    if importlib.util.find_spec("transformers") is None:
        echo("[5/5] skipped: the whole-model check runs transformers' modules as the reference; "
             "pip install 'moetool[model]' and run the demo again")
    else:
        echo(f"[5/5] {whole_cmd}")
        whole = verify_whole_model(shards, model, WholeModelOptions(
            dp=dp, ep=ep, dispatch=dispatch, tokens=WHOLE_MODEL_TOKENS, seq_len=WHOLE_MODEL_SEQ_LEN))
        echo(_indent(whole.render()))
        ran.append(whole_cmd)
        passed = passed and whole.passed

    took = f"({time.perf_counter() - t0:.1f} s)"
    if passed:
        echo(f"demo PASSED: quantized to {fmt}, split over {ep} EP ranks; the distributed forward matches the "
             f"unquantized model on every MoE layer" + (", and the whole converted model runs within the "
                                                        f"thresholds of {fmt} against transformers {took}"
                                                        if whole is not None else f" {took}"))
    else:
        echo("demo FAILED: see the tables above")
    echo("the commands it ran, to re-run by hand (quantize and shard need --force to write over their output):")
    echo(_indent("\n".join(ran), 2))
    return passed


def _check_workdir(workdir: Path) -> None:
    """A new or empty folder, or one that holds only a previous demo's folders (rewritten)."""
    if workdir.exists() and not workdir.is_dir():
        raise MoetoolError(f"--workdir {workdir}: not a folder")
    if workdir.is_dir():
        others = sorted(p.name for p in workdir.iterdir()
                        if not (p.is_dir() and (p.name == DEMO_PREFIX or p.name.startswith(DEMO_PREFIX + "-"))))
        if others:
            raise MoetoolError(f"--workdir {workdir}: holds files the demo did not write ({others[0]}); "
                               "give it a new or empty folder")


def _shell(argv: list) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


def _indent(text: str, width: int = 6) -> str:
    return "\n".join(" " * width + line for line in text.splitlines())
