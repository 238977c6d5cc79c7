from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from moetool.cli import command_app
from moetool.cli.options import Json, Revision
from moetool.errors import MoetoolError
from moetool.lazy import import_module
from moetool.verify import fork_server
from moetool.verify.report import raise_if_failed


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """"1,3,5-7" -> (1, 3, 5, 6, 7). A range runs upwards (7-5 is refused, not read as none)."""
    if not text:
        return None
    out: list[int] = []
    for part in text.split(","):
        bounds = part.strip().split("-")
        if len(bounds) > 2 or not all(b.strip().isdigit() for b in bounds) or int(bounds[0]) > int(bounds[-1]):
            raise MoetoolError(f"--layers {text!r}: expected a list like 1,3,5-7 (layer numbers, ranges upwards)")
        out += range(int(bounds[0]), int(bounds[-1]) + 1)
    return tuple(dict.fromkeys(out))


def under_torchrun() -> bool:
    """Started by torchrun (or any launcher that sets the env:// variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


app = command_app()


@app.command("verify")
def verify_cmd(
    shards: Annotated[Path, typer.Argument(help="output of moetool shard", show_default=False)],
    ref: Annotated[str, typer.Option("--ref", help="the original (unquantized) checkpoint: folder or Hub id", show_default=False)],
    dp: Annotated[int, typer.Option("--dp", help="data-parallel groups (different tokens); must divide --ep")] = 1,
    ep: Annotated[int, typer.Option("--ep", help="ranks (world size); must match the shards")] = 2,
    dispatch: Annotated[str, typer.Option("--all2all", help="dispatch/combine backend: allgather or all2all")] = "allgather",
    transport: Annotated[str, typer.Option("--transport", help="all2all only: collectives (all_to_all_single), "
                                           "mapped (ranks store into each other's memory; one host), or auto "
                                           "(mapped on the GPUs of one host)")] = "auto",
    experts: Annotated[str, typer.Option("--experts", help="experts backend: torch or triton")] = "torch",
    numerics: Annotated[str, typer.Option("--numerics", help="served: the engine's math for the shards' format "
                                          "(bf16 activations, fp8 ones where the format declares them); exact: "
                                          "float32 with unquantized activations (the weights' error alone)")] = "served",
    tokens: Annotated[int, typer.Option("--tokens", help="test tokens per dp group, per layer")] = 256,
    layers: Annotated[Optional[str], typer.Option("--layers", help="MoE layers to check, e.g. 1,3,5-7 (default all)")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="nccl or gloo (default: nccl when enough GPUs)")] = None,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="tokens per chunk (bounded memory)")] = 4096,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    max_rel_err: Annotated[Optional[float], typer.Option("--max-rel-err", help="override the format's layer threshold")] = None,
    max_expert_rel_err: Annotated[Optional[float], typer.Option("--max-expert-rel-err", help="override the per-expert threshold")] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="untimed runs of each layer first (GPU timings)")] = 0,
    repeat: Annotated[int, typer.Option("--repeat", help="timed runs of each layer; phase times are their median")] = 1,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds the run may take until its first layer is in, then between "
                                                          "two layers (--whole-model: the whole run)")] = 900.0,
    whole_model: Annotated[bool, typer.Option("--whole-model", help="run the converted model end to end (every "
                                              "layer, MoE through the EP shards) against transformers running "
                                              "--ref; needs transformers")] = False,
    text: Annotated[Optional[Path], typer.Option("--text", help="--whole-model: a text file, tokenized with "
                                                 "--ref's tokenizer.json (default: seeded random token ids)")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="--whole-model: tokens per sequence (--tokens per dp "
                                         "group = sequences x seq-len)")] = 128,
    json_out: Json = False,
    revision: Revision = None,
) -> None:
    """Run the shards through dispatch -> experts -> combine on EP ranks and compare each layer
    with the unquantized reference. Exit status 1 when any layer fails.

    Single node: spawns one process per rank itself. Multi-node: run it under torchrun
    (`torchrun --nnodes ... --nproc-per-node ... -m moetool verify ...`)."""
    if whole_model and layers:
        raise MoetoolError("--layers: --whole-model runs every layer (the MoE-only mode takes --layers)")
    layer_ids = parse_layers(layers)
    if whole_model and under_torchrun():
        raise MoetoolError("--whole-model spawns its own ranks on one node; it does not run under torchrun yet")
    if not under_torchrun() and shards.is_dir():
        # the ranks' fork server imports what they need beside this process's imports, not after
        fork_server.start(fork_server.WHOLE_MODEL_MODULES if whole_model else fork_server.MOE_ONLY_MODULES)
    if whole_model:
        wm = import_module("moetool.verify.whole_model")
        wopts = wm.WholeModelOptions(dp=dp, ep=ep, tokens=tokens, seq_len=seq_len, text=None if text is None else str(text),
                                     seed=seed, backend=backend, dispatch=dispatch, experts=experts,
                                     transport=transport, chunk_size=chunk_size, timeout_s=timeout,
                                     numerics=numerics)
        report = wm.verify_whole_model(shards, ref, wopts, revision=revision,
                                       thresholds=None if max_rel_err is None else {"moe_rel_err": max_rel_err})
        typer.echo(json.dumps(report.to_json(), indent=2) if json_out else report.render())
        wm.raise_if_failed(report)
        return
    if text is not None:
        raise MoetoolError("--text is an option of --whole-model")
    driver = import_module("moetool.verify.driver")  # torch, once the arguments are parsed
    opts = driver.VerifyOptions(dp=dp, ep=ep, dispatch=dispatch, experts=experts, tokens=tokens, layers=layer_ids,
                         backend=backend, chunk_size=chunk_size, seed=seed, max_rel_err=max_rel_err,
                         max_expert_rel_err=max_expert_rel_err, timeout_s=timeout, warmup=warmup,
                         repeat=repeat, transport=transport, numerics=numerics)
    if under_torchrun():
        report = driver.verify_torchrun(shards, ref, opts, revision=revision)
        if report is None:  # not rank 0: rank 0 prints the report
            return
    else:
        report = driver.verify(shards, ref, opts, revision=revision)
    typer.echo(json.dumps(report.to_json(), indent=2) if json_out else report.render())
    raise_if_failed(report)
