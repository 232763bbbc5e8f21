"""``ptplan profile``: measure every layer of a model on a device and write a profile JSON."""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from ptplan.planner.errors import PtplanError

DTYPES = ("float32", "bfloat16", "float16")
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPE_ALIASES = {short: full for full, short in _SHORT.items()}
"""``--dtype bf16`` means bfloat16, and so on."""


def dtype_name(text: str) -> str:
    """``bf16`` / ``bfloat16`` -> ``bfloat16`` (and fp16, fp32); anything else is a PtplanError."""
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPES:
        raise PtplanError(f"--dtype {text!r} is not one of {', '.join(DTYPES)} (or {', '.join(DTYPE_ALIASES)})")
    return name


def default_out(label: str, dev_kind: str, dtype: str) -> Path:
    """``bert-base_cpu_fp32.json``; a hub name's ``/`` becomes ``--`` (``nreimers--MiniLM-L6-H384-uncased_...``)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in label.replace("/", "--")).strip(".") or "model"
    return Path(f"{safe}_{dev_kind}_{_SHORT[dtype]}.json")


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; anything else is a PtplanError."""
    parts = [p.strip() for p in text.split(",")]
    out = []
    for p in parts:
        try:
            b = int(p)
        except ValueError:
            raise PtplanError(f"--batch-sizes must be a comma-separated list of positive integers, "
                              f"e.g. 1,2,4; got {text!r}") from None
        if b <= 0:
            raise PtplanError(f"--batch-sizes must be positive, got {b} in {text!r}")
        out.append(b)
    return out


@click.command("profile")
@click.argument("model_name", metavar="MODEL")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--dtype", default="float32", show_default=True, metavar="[float32|bfloat16|float16|fp32|bf16|fp16]",
              help="Parameter and activation dtype.")
@click.option("--seq-len", type=int, default=None, help="Tokens per sample (text models; default 128).")
@click.option("--image-size", type=int, default=None, help="ViT image side in pixels (default 224; tiny 32).")
@click.option("--batch-sizes", default=None,
              help="Micro-batch sizes, comma-separated [default: 1, 2, 4, ... up to 64, stopping at the memory "
                   "limit (CUDA: the device's memory; CPU: the available RAM), estimated after each size].")
@click.option("--num-labels", type=int, default=None,
              help="Classes of the classification head (bert, roberta, distilbert, vit) [default: 2; vit 1000 "
                   "(ImageNet-1k)]; the causal LMs (gpt2, llama, mistral, qwen2) have an LM head and take none.")
@click.option("--granularity", type=click.Choice(("half", "block")), default="half", show_default=True,
              help="half: attention and MLP halves of each block; block: one layer per block.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed repeats per batch size.")
@click.option("--repeats", type=int, default=5, show_default=True,
              help="Timed repeats (median) per batch size; fewer where --budget needs it.")
@click.option("--budget", type=float, default=2.0, show_default=True, metavar="MINUTES",
              help="Target time for the whole profile: every micro-batch size is measured, with fewer repeats "
                   "where the time would not fit (recorded in the profile). 0: exactly --warmup and --repeats "
                   "(also the default when either is given).")
@click.option("--threads", type=int, default=None,
              help="torch intra-op threads [default on CPU: 1, as each torchrun process runs "
                   "(OMP_NUM_THREADS=1); on CUDA: torch's].")
@click.option("--timer", type=click.Choice(("wall", "cpu")), default="wall", show_default=True,
              help="CPU only: wall clock, or process CPU time (needs --threads 1; robust on a shared machine).")
@click.option("--dropout", type=float, default=None, help="Set every dropout probability (default: the config's).")
@click.option("--weights", type=click.Path(), default=None,
              help="Local Hugging Face model folder whose weights to load (its config.json sets the sizes).")
@click.option("--out", default=None,
              help="Output file [default: NAME_DEVICE_DTYPE.json, e.g. bert-base_cpu_fp32.json; NAME is the "
                   "model's name, a folder's Hugging Face name with / as --].")
@click.option("--project", "project", default=None, metavar="DEVICE",
              help="Do not measure: project the times for a GPU you do not have from its datasheet (h100, h200, a100, "
                   "v100, rtx5000, l4) by counting every operation on the meta device; memory fields stay exact. "
                   "The profile is marked projected and every plan made from it says so.")
@click.option("--slices", is_flag=True,
              help="Causal LMs: also time a decoder block on token slices (s tokens after c cached ones, a (b, s, c) "
                   "grid) and store TeraPipe's fitted slice cost in the profile (executor/profiling/slices.py); "
                   "with --project the slices' operations are counted and timed on the same roofline.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def profile(model_name: str, device: str, dtype: str, seq_len: int | None, image_size: int | None,
            batch_sizes: str | None, num_labels: int | None, granularity: str, warmup: int, repeats: int,
            threads: int | None, timer: str, dropout: float | None, weights: str | None, out: str | None,
            project: str | None, quiet: bool, slices: bool = False, budget: float = 2.0) -> None:
    """Measure every layer of MODEL (forward, backward, no-grad forward, memory) -> profile JSON.

    \b
    MODEL: a local Hugging Face model folder (its config.json picks the adapter and is
           enough: weights are loaded when the folder has them), or a name:
      tests  bert-tiny bert-small roberta-tiny distilbert-tiny vit-tiny vit-small
             gpt2-tiny llama-tiny mistral-tiny qwen2-tiny
      sizes  bert-base(-uncased) bert-large(-uncased) bert-base-cased roberta-base
             roberta-large distilroberta-base distilbert-base-uncased
             vit-base(-patch16-224) vit-large(-patch16-224) vit-huge-patch14-224
             gpt2 gpt2-medium gpt2-large gpt2-xl llama-2-7b llama-3.2-1b llama-3.1-8b
             mistral-7b qwen2.5-0.5b qwen2.5-7b
      for --project (which allocates no weights): gpt3-175b llama-3.1-70b llama-3.1-405b
    Example: ptplan profile bert-base --device cpu --out p.json   (sizes 1, 2, 4, ... 64 as memory allows)
             ptplan profile ./my-model --seq-len 64   (a local folder: its own name and family)
             ptplan profile bert-base --project h100 --dtype bf16   (projected, in seconds)
             ptplan profile gpt3-175b --project v100 --dtype fp16 --seq-len 2048 --slices   (any size)
    """
    dtype = dtype_name(dtype)
    sizes = None if batch_sizes is None else parse_batch_sizes(batch_sizes)
    _check_counts(warmup, repeats, budget, threads)
    dev_model = None if project is None else _projection_device(project, dtype)
    dev_kind = device.split(":")[0] if dev_model is None else dev_model.key
    _out_path(out, weights)  # checked before any work; the default name once the model is built
    model = _build(model_name, device, dev_kind, sizes, threads, num_labels, projecting=dev_model is not None,
                   granularity=granularity, seq_len=seq_len, image_size=image_size, dtype=dtype, dropout=dropout,
                   weights=weights)
    path = _out_path(out, weights, default_out(model.name, dev_kind, dtype))
    if dev_model is not None:
        return _projected(model, dev_model, sizes, path, slices)
    _measured(model, model_name, weights, path, device=device, dev_kind=dev_kind, sizes=sizes, warmup=warmup,
              repeats=repeats, timer=timer, quiet=quiet, budget=budget, slices=slices)


def _projection_device(project: str, dtype: str) -> Any:
    """``--project``'s datasheet device, once the dtype is known to exist on it."""
    from ptplan.planner.devices import get_device

    dev_model = get_device(project)
    dev_model.matmul_peak(dtype)  # the dtype exists on that device
    return dev_model


def _build(model_name: str, device: str, dev_kind: str, sizes: list[int] | None, threads: int | None,
           num_labels: int | None, *, projecting: bool, granularity: str, seq_len: int | None,
           image_size: int | None, dtype: str, dropout: float | None, weights: str | None) -> Any:
    """The model to profile, once the device, the sizes and the head are checked and torch's threads are set
    (CPU default 1); projecting, every weight is on meta, and measuring, the largest size must fit memory."""
    import torch  # torch only when profiling: the other commands stay fast

    from ptplan.executor.families import build_model
    from ptplan.executor.profiling.profiler import check_batch_sizes, head_num_labels, resolve_device

    labels = head_num_labels(model_name, num_labels)
    resolve_device(device)  # fail on a missing GPU before building a large model
    if sizes is not None:
        check_batch_sizes(sizes)
    threads = 1 if threads is None and dev_kind == "cpu" else threads
    if threads is not None:
        torch.set_num_threads(threads)
    model = build_model(model_name, granularity=granularity, seq_len=seq_len, image_size=image_size,
                        dtype=getattr(torch, dtype), dropout=dropout, weights=weights,
                        num_labels=2 if labels is None else labels,  # build_model's own default when not given
                        layers=[] if projecting else None)  # projecting: every weight on meta
    if sizes is not None and not projecting:
        check_sizes_fit(model, resolve_device(device), sizes)
    return model


def _measured(model: Any, model_name: str, weights: str | None, path: Path, *, device: str, dev_kind: str,
              sizes: list[int] | None, warmup: int, repeats: int, timer: str, quiet: bool, budget: float,
              slices: bool) -> None:
    """The measured profile (with ``slices``, its token-slice costs too) written to ``path``, and its summary."""
    from ptplan.executor.profiling.profiler import agreement, profile_model
    from ptplan.planner.profile import save_profile

    _warn_if_busy(dev_kind, timer)  # after every refusal: a refused call prints its one error line only
    prof = profile_model(model, device=device, batch_sizes=sizes, warmup=warmup, repeats=repeats,
                         progress=not quiet, timer=timer, command=command_line(click.get_current_context()),
                         budget_s=_budget_seconds(click.get_current_context(), budget))
    prof.measurement.update(model_arg(model_name, weights))
    if slices:
        from ptplan.executor.profiling.slices import profile_slices, with_slices

        prof = with_slices(prof, profile_slices(model, device=device, warmup=warmup, repeats=repeats, timer=timer,
                                                command=prof.provenance.command))
    save_profile(prof, path)
    _print_summary(prof, agreement(prof))
    if prof.measurement.get("skipped_reason"):
        click.echo(f"note: {prof.measurement['skipped_reason']}")
    click.echo(f"wrote {path}")


def _projected(model, dev_model, sizes: list[int] | None, path: Path, slices: bool = False) -> None:
    """``--project``: the profile projected for a datasheet device (with ``slices``, its token-slice costs counted
    the same way), written to ``path``. The model's weights are on the meta device: nothing is allocated."""
    import datetime

    from ptplan.executor.profiling.profiler import powers_of_two
    from ptplan.executor.profiling.project import project_profile
    from ptplan.executor.profiling.slices import project_slices, with_slices
    from ptplan.planner.profile import save_profile

    prof = project_profile(model, dev_model, batch_sizes=sizes or powers_of_two(64),
                           command=command_line(click.get_current_context()),
                           date=datetime.date.today().isoformat())
    if slices:
        prof = with_slices(prof, project_slices(model, dev_model, command=prof.provenance.command,
                                                date=prof.device.date))
    save_profile(prof, path)
    step_ms = prof.whole_model.forward_backward_s[-1] * 1e3
    click.echo(f"{prof.model.name}: projected for {dev_model.name} ({prof.model.dtype}); whole step at "
               f"micro-batch {prof.batch_sizes[-1]}: {step_ms:.2f} ms (datasheet peaks, efficiency ASSUMED: "
               f"planner/devices.py)")
    if prof.token_slices is not None:
        f = prof.token_slices.forward
        click.echo(f"token slices (one block, projected): forward {f.const:.3e} + {f.per_token:.3e} b·s + "
                   f"{f.per_context:.3e} b·c + {f.per_pair:.3e} b·s·c + {f.per_square:.3e} b·s² s "
                   f"(fit error median {100 * f.fit_error:.1f} %)")
    click.echo(f"wrote {path}")


def _check_counts(warmup: int, repeats: int, budget: float, threads: int | None) -> None:
    if warmup < 0:
        raise PtplanError(f"--warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise PtplanError(f"--repeats must be >= 1, got {repeats}")
    if not 0 <= budget < float("inf"):  # NaN fails too
        raise PtplanError(f"--budget must be a finite number of minutes >= 0 (0: no budget), got {budget}")
    if threads is not None and threads < 1:
        raise PtplanError(f"--threads must be >= 1, got {threads}")


def _out_path(out: str | None, weights: str | None, default: Path | None = None) -> Path:
    """--out (or, once the model is built, ``default``) through the one output check (cli/outputs.py); before
    the model is built (no ``default``) an absent --out is not checked yet."""
    from ptplan.cli.outputs import check_outputs

    given = out if out is not None else None if default is None else os.fspath(default)
    check_outputs([("--weights folder", weights)] if weights else [],
                  [("--out" if out is not None else "the default --out", given)])
    return Path(given if given is not None else ".")


def check_sizes_fit(model, dev, sizes: list[int]) -> None:
    """Refuse --batch-sizes whose largest would not fit the device's memory (CPU: the available RAM), before
    allocating it: the profiler's own estimate (parameters, gradients, optimizer state, and the bytes saved for
    backward plus the largest backward working set per sample, measured in one step of a single sample, times b,
    with its margin)."""
    import torch

    from ptplan.executor.profiling.live_bytes import memory_pass
    from ptplan.executor.profiling.profiler import (MEMORY_MARGIN, estimate_peak_bytes, memory_limit,
                                                    static_bytes)

    limit, limit_name = memory_limit(dev, model)
    if limit is None:
        return
    model.to(dev)
    x, labels, mask = model.make_batch(1, torch.Generator().manual_seed(0))
    to = (lambda t: None if t is None else t.to(dev))
    mem = memory_pass(model, to(x), to(labels), to(mask), 1)
    saved = sum(mem.saved) + max(mem.working)  # every layer's stash, and the largest backward's working set
    for p in model.parameters():
        p.grad = None
    static = static_bytes(model)
    b = max(sizes)
    need = estimate_peak_bytes(static=static, saved_per_sample=saved, batch_size=b)
    if need > limit:
        fit = max(1, int((limit / MEMORY_MARGIN - static) // max(saved, 1)))
        raise PtplanError(f"--batch-sizes: micro-batch {b:,} would need about {need / 2**30:,.1f} GiB (parameters, "
                          f"gradients and optimizer state {static / 2**30:,.2f} GiB + {saved / 2**20:,.2f} MiB saved "
                          f"for backward per sample x {b:,}, x {MEMORY_MARGIN:g}) but {limit_name} is "
                          f"{limit / 2**30:,.1f} GiB; give sizes up to about {fit:,}, or leave --batch-sizes out "
                          f"(the default stops at the memory limit)")


def _budget_seconds(ctx: click.Context, minutes: float) -> float | None:
    """--budget in seconds; None (exact counts) for --budget 0, or when --warmup/--repeats were given and
    --budget was not."""
    given = {n for n in ("warmup", "repeats", "budget") if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE}
    if minutes == 0 or ("budget" not in given and given & {"warmup", "repeats"}):
        return None
    return minutes * 60.0


def model_arg(model_name: str, weights: str | None) -> dict[str, str | None]:
    """The MODEL and --weights this profile was made with (folders absolute), so ``ptplan run`` can default
    to them: ``measurement["model_arg"]``, ``measurement["weights_arg"]``."""
    folder = os.path.isdir(model_name)
    return {"model_arg": os.path.abspath(model_name) if folder else model_name,
            "weights_arg": os.path.abspath(weights) if weights else None}


def command_line(ctx: click.Context) -> str:
    """``ptplan profile ...`` with the argument and every option given, from click's parse (so it is the
    same whether ptplan ran as a script, with ``python -m`` or inside a test), for the profile's provenance."""
    parts = ["ptplan", ctx.info_name or "profile"]
    for param in ctx.command.params:
        name = param.name or ""
        if ctx.get_parameter_source(name) not in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            continue
        value = ctx.params[name]
        if isinstance(param, click.Argument):
            parts.append(str(value))
        elif isinstance(param, click.Option) and param.is_flag:
            if value:
                parts.append(param.opts[0])
        else:
            parts += [param.opts[0], str(value)]
    return shlex.join(parts)


def _warn_if_busy(dev_kind: str, timer: str) -> None:
    """On CPU with the wall timer, say so when other work is already running (timings will be noisy)."""
    if dev_kind != "cpu" or timer != "wall" or not hasattr(os, "getloadavg"):
        return
    load = os.getloadavg()[0]
    if load >= 1.0:
        click.echo(f"note: this machine is busy (load average {load:.1f} on {os.cpu_count()} cores), so wall-clock "
                   "timings will be noisy; --timer cpu (with one thread) measures CPU time instead", err=True)


def _print_summary(prof, agree) -> None:
    j = len(prof.batch_sizes) - 1
    b = prof.batch_sizes[j]
    m, d = prof.model, prof.device
    click.echo(f"{m.name}: {m.num_blocks} blocks, {prof.num_layers} layers ({m.granularity}), seq {m.seq_len}, "
               f"{m.dtype} on {d.kind} ({d.name}, {d.threads} threads)")
    click.echo(f"per layer at micro-batch {b} (ms; saved = activation bytes kept for backward per sample):")
    click.echo(f"{'#':>3} {'layer':<14} {'kind':<9} {'params':>11} {'fwd':>9} {'bwd':>9} {'nograd':>9} "
               f"{'saved MB':>9}")
    for r in prof.layers:
        click.echo(f"{r.index:>3} {r.name:<14} {r.kind:<9} {r.params:>11,} {1e3 * r.forward_s[j]:>9.2f} "
                   f"{1e3 * r.backward_s[j]:>9.2f} {1e3 * r.nograd_forward_s[j]:>9.2f} "
                   f"{r.saved_bytes_per_sample / 2**20:>9.2f}")
    for bsz, s, w, rel in agree:
        click.echo(f"batch {bsz}: per-layer sum {s:.4f} s vs whole-model step {w:.4f} s ({100 * rel:+.1f}%)")
