"""``ptplan plan``: parse flags, build the plan, write plan.json (and the report), print a table."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from ptplan.planner.config import SCHEDULE_CHOICES
from ptplan.planner.errors import PtplanError

DEFAULT_PROFILE = "vit-base_cpu_fp32"


def resolve_profile_path(name_or_path: str) -> Path:
    """A profile file path, or a shipped profile by stem (``vit-base_cpu_fp32``) or by model name
    (``bert-tiny`` finds ``bert-tiny_cpu_fp32``: the one measured profile of that model, when several
    are shipped beside projected ones)."""
    p = Path(name_or_path)
    if p.exists() or p.suffix == ".json" or os.sep in name_or_path:
        if not p.exists():
            raise PtplanError(f"profile file not found: {p}")
        return p
    from ptplan.profiles import PROFILE_DIR, shipped

    cand = shipped(name_or_path)
    if cand.exists():
        return cand
    names = sorted(x.stem for x in PROFILE_DIR.glob("*.json"))
    by_model = [n for n in names if n.split("_")[0] == name_or_path]
    measured = [n for n in by_model if _source(shipped(n)) == "measured"]
    if len(by_model) == 1 or len(measured) == 1:
        return shipped((measured or by_model)[0])
    if by_model:
        raise PtplanError(f"several shipped profiles are of model {name_or_path!r}: {', '.join(by_model)}; name one")
    raise PtplanError(f"no profile file {name_or_path!r} and no shipped profile of that name; "
                      f"shipped: {', '.join(names) or '(none)'}")


def _source(path: Path) -> str:
    """A shipped profile's provenance source without validating the whole file."""
    import json

    try:
        return str(json.loads(path.read_text()).get("provenance", {}).get("source", "measured"))
    except (OSError, ValueError):
        return "unknown"


def _parse_int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise PtplanError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


def _gib(x: float) -> str:
    """GiB with enough digits that small models do not show as 0.00."""
    g = x / 1024 ** 3
    return f"{g:.2f}" if g >= 0.1 else f"{g:.3g}"


def _secs(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def slices_text(slices: tuple[int, ...], width: int = 28) -> str:
    """A phase's token slices for the table: ``4 slices 10,7,5,2`` (cut with ... past ``width``), or ``—``."""
    if not slices:
        return "—"
    text = f"{len(slices)} slices " + ",".join(map(str, slices))
    return text if len(text) <= width else text[:width - 3] + "..."


def format_plan_table(plan) -> str:
    """A readable per-phase table plus the trajectory and the totals."""
    lines = []
    inp = plan.inputs
    prof, cl, tr = inp.profile, inp.cluster, inp.training
    unit = cl.device_noun_plural
    lines.append(f"model {prof.model} ({prof.num_blocks} blocks, {prof.num_layers} layers, profiled on {prof.device}, "
                 f"{prof.source}) on cluster {cl.name} ({plan.world_size} {unit}); schedule {tr.schedule}, "
                 f"batch policy {tr.batch_policy}, optimizer {tr.optimizer}, cache {tr.cache}")
    used = {t.phase for t in plan.trajectory}
    mixed = len({(p.schedule, p.V) for p in plan.phases}) > 1 or tr.schedule == "auto"
    strat = any(p.strategy_label != "dp" for p in plan.phases)
    sw = max([12] + [len(p.strategy_label) for p in plan.phases])  # a phase whose stages differ lists each
    sliced = any(p.slices for p in plan.phases)
    hdr = (f"{'phase':>5} {'frozen':>6} {'K':>4} {'D':>5} {'M':>4} {'b':>4}  {'layers per stage':<22} "
           f"{'iteration':>10} {'samples/s':>10} {'bubble':>6} {'peak GiB':>8} {'cache':>5}"
           + (f" {'schedule':<18}" if mixed else "") + (f" {'strategy':<{sw}} {'mesh K×D×tp':<12}" if strat else "")
           + (f" {'slices':<28}" if sliced else ""))
    lines.append(hdr)
    lines.append("-" * len(hdr))
    noted = []
    for i, ph in enumerate(plan.phases):
        if i not in used and len(plan.phases) > 16:
            continue
        sizes = "|".join(str(hi - lo) for lo, hi in ph.partition)
        if len(sizes) > 22:
            sizes = sizes[:19] + "..."
        mark = "*" if i in used else " "
        note = "!" if ph.notes else " "
        if ph.notes:
            noted.append(ph)
        peak = ph.predicted.peak_memory_bytes
        sched = ph.schedule + (f" V={ph.V}" if ph.V > 1 else "")
        lines.append(f"{i:>4}{mark} {ph.frozen_blocks:>6} {ph.K:>4} {ph.D:>5} {ph.M:>4} {ph.micro_batch_size:>4}  "
                     f"{sizes:<22} {_secs(ph.predicted.iteration_s):>10} {ph.predicted.samples_per_s:>10.2f} "
                     f"{ph.predicted.bubble_fraction:>6.1%} {_gib(peak):>8} {'on' if ph.cache else 'off':>5}{note}"
                     + (f" {sched:<18}" if mixed else "")
                     + (f" {ph.strategy_label:<{sw}} {f'{ph.K}×{ph.D}×{ph.tp}':<12}" if strat else "")
                     + (f" {slices_text(ph.slices):<28}" if sliced else ""))
    bang = "; ! after the cache column = the phase has notes, below" if noted else ""
    if len(plan.phases) > 16:
        lines.append(f"(* = on the predicted trajectory; {len(plan.phases) - len(used)} other phases are in the plan "
                     f"for adaptive freezing{bang})")
    else:
        lines.append(f"(* = on the predicted trajectory; the others serve adaptive freezing{bang})")
    for ph in noted[:8]:
        lines.append(f"! {ph.frozen_blocks} frozen blocks: " + "; ".join(ph.notes))
    if len(noted) > 8:
        lines.append(f"! ... and {len(noted) - 8} more phases with notes (plan.json: phases[].notes)")
    lines.append("")
    lines.append("epoch    step  frozen  phase  iterations  fill  seconds")
    shown = plan.trajectory if len(plan.trajectory) <= 40 else plan.trajectory[:20] + plan.trajectory[-20:]
    for j, t in enumerate(shown):
        if len(plan.trajectory) > 40 and j == 20:
            lines.append(f"  ... {len(plan.trajectory) - 40} more runs ...")
        lines.append(f"{t.epoch:>5} {t.step:>7} {t.frozen_blocks:>7} {t.phase:>6} {t.iterations:>11} "
                     f"{t.fill_iterations:>5} {t.seconds:>8.1f}")
    b, T = plan.baseline.phase, plan.totals
    lines.append("")
    fill = f" (AutoCache fills: +{T.fill_seconds:.1f} s)" if T.fill_seconds else ""
    lines.append(f"baseline (no freezing, static K={b.K}, D={b.D}, M={b.M}): {plan.baseline.seconds:.1f} s; "
                 f"plan: {T.seconds:.1f} s{fill}; predicted speedup {T.speedup:.2f}x")
    if (T.best_static_K, T.best_static_M) != (b.K, b.M):
        lines.append(f"best static configuration without freezing (K={T.best_static_K}, M={T.best_static_M}): "
                     f"{T.best_static_seconds:.1f} s; speedup over it {T.speedup_vs_best_static:.2f}x")
    return "\n".join(lines)


def format_warnings(plan) -> list[str]:
    return [f"warning: {w.message}" for w in plan.warnings]


def _presets_help() -> str:
    from ptplan.planner.cluster import PRESETS

    return ", ".join(PRESETS) + ", cpu:N"


class _PlanCommand(click.Command):
    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help(ctx, formatter)
        from ptplan.planner.cluster import PRESETS
        from ptplan.profiles import PROFILE_DIR

        with formatter.section("Cluster presets"):
            formatter.write_dl([(k, f"{c.nodes} x {c.gpus_per_node} {c.gpu_name}, "
                                    f"{c.gpu_memory_bytes / 2**30:.0f} GiB each") for k, c in PRESETS.items()]
                               + [("cpu:N", "this machine as N CPU processes")])
        by_model: dict[str, list[str]] = {}
        for x in sorted(PROFILE_DIR.glob("*.json")):
            model, _, rest = x.stem.partition("_")
            by_model.setdefault(model, []).append(rest + ("" if _source(x) == "measured" else " (projected)"))
        with formatter.section("Shipped profiles (MODEL_DEVICE_DTYPE; a model name alone picks its one measured "
                               "profile, and asks which where it has several)"):
            formatter.write_dl([(m, ", ".join(v)) for m, v in by_model.items()])


def _check_outputs(inputs: list[Path], outputs: list[str | Path], names: tuple[str, ...] = ("--out", "--report")) -> None:
    """The one output check (cli/outputs.py) for plan and ablate: outputs in existing writable folders, never an
    input, never each other, never empty or a folder."""
    from ptplan.cli.outputs import check_outputs

    check_outputs([("input", os.fspath(p)) for p in inputs],
                  [(name, os.fspath(p)) for name, p in zip(names, outputs)])


def shared_options(f: Any) -> Any:
    """The options ``plan`` and ``ablate`` share: cluster, training, freezing, memory, measured range."""
    for opt in reversed([
        click.option("--cluster", "cluster_name", default="paper", show_default=True,
                     help="A cluster preset (listed in `ptplan plan --help`) or a cluster JSON file."),
        click.option("--epochs", type=int, default=10, show_default=True, help="Training epochs."),
        click.option("--samples-per-epoch", type=int, default=50_000, show_default=True, help="Samples per epoch."),
        click.option("--batch", type=int, default=512, show_default=True,
                     help="Global batch (constant-global) or per-pipeline batch (constant-pipeline)."),
        click.option("--batch-policy", type=click.Choice(["constant-global", "constant-pipeline"]),
                     default="constant-global", show_default=True),
        click.option("--freeze", "freeze_policy", type=click.Choice(["geometric", "manual", "none"]),
                     default="geometric", show_default=True,
                     help="Freeze trajectory: the paper's geometric bound, a manual list, or none."),
        click.option("--alpha", type=float, default=1 / 3, show_default="1/3",
                     help="Freeze rate α in (0,1): each freeze step freezes at most α of the active blocks."),
        click.option("--manual", "manual", default=None,
                     help="Frozen blocks per freeze step, e.g. 0,4,7,9 (with --freeze manual)."),
        click.option("--freeze-every", type=int, default=None,
                     help="A freeze step every N optimizer steps instead of once per epoch."),
        click.option("--schedule", type=click.Choice(list(SCHEDULE_CHOICES)), default="1f1b", show_default=True,
                     help="Pipeline schedule, or auto: the search picks per phase among 1f1b, gpipe, "
                          "interleaved-1f1b (V chunks per GPU) and zb-h1 (with a profile that split the backward); "
                          "about 5-10x slower to plan."),
        click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw", show_default=True,
                     help="Sets the optimizer-state memory (AdamW two moments, SGD one momentum buffer per "
                          "parameter)."),
        click.option("--memory-fraction", type=float, default=0.9, show_default=True,
                     help="Share of device (and host) memory a plan may use."),
        click.option("--allow-extrapolation", is_flag=True,
                     help="Allow micro-batch sizes outside the profile's measured sizes (their times are "
                          "extrapolated)."),
    ]):
        f = opt(f)
    return f


def freeze_from_options(freeze_policy: str, alpha: float, manual: str | None, freeze_every: int | None,
                        adaptive: bool = False) -> Any:
    """The FreezePolicy the shared options describe."""
    from ptplan.planner.freeze import FreezePolicy

    manual_list = _parse_int_list(manual, "--manual") if manual else None
    if freeze_policy == "manual" and manual_list is None:
        raise PtplanError("--freeze manual needs --manual with the frozen blocks per freeze step, e.g. "
                          "--manual 0,4,7,9")
    return FreezePolicy(policy=freeze_policy, alpha=alpha, manual=tuple(manual_list or ()),
                        every=freeze_every if freeze_every is not None else "epoch", adaptive=adaptive)


@click.command("plan", cls=_PlanCommand)
@click.argument("profile", required=False, default=DEFAULT_PROFILE)
@shared_options
@click.option("--adaptive", is_flag=True,
              help="The run will decide from gradient norms (ptplan run --freeze adaptive).")
@click.option("-K", "--pipeline-length", "pin_k", type=int, default=None,
              help="Use this pipeline length K in every phase where it fits (the table marks the others).")
@click.option("--start-K", "start_k", type=int, default=None,
              help="Start from this pipeline length and only compress (the paper: one pipeline per node, K=8); "
                   "the baseline is then this static pipeline.")
@click.option("-M", "--micro-batches", "pin_m", type=int, default=None,
              help="Use this micro-batch count in every phase where it fits.")
@click.option("--cache", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="AutoCache of the frozen prefix's outputs: auto caches where it saves time (fills included).")
@click.option("--strategies", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="Parallel strategy: off = pipeline x data parallel; auto = also tensor parallel (one width "
                   "per phase, inside a node), and FSDP and activation recomputation per pipeline stage (each "
                   "stage the fastest that fits its memory, or one for every stage); `ptplan run` runs them.")
@click.option("--token-slices", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="Causal LMs (gpt2, llama): auto cuts each phase's sequences into TeraPipe token slices where the "
                   "slice-aware simulation says they pay (needs a profile made with `ptplan profile MODEL --slices`); "
                   "`ptplan run` runs them token-sliced.")
@click.option("--data", "data", default=None, metavar="FILE",
              help="The training file `ptplan data` wrote: --samples-per-epoch defaults to its sample count, "
                   "--batch to 32 (at most the samples), and its sequence length must be the profile's.")
@click.option("--out", "out", default="plan.json", show_default=True, help="Where to write the plan.")
@click.option("--report", default=None, help="Also write the interactive HTML report here.")
@click.option("--quiet", is_flag=True, help="Do not print the table (warnings are still printed).")
def plan(profile, cluster_name, epochs, samples_per_epoch, batch, batch_policy, freeze_policy, alpha, manual,
         freeze_every, adaptive, schedule, optimizer, pin_k, start_k, pin_m, cache, memory_fraction,
         allow_extrapolation, strategies, token_slices, out, report, quiet, data=None) -> None:
    """Plan elastic pipelined training for PROFILE (a profile file, a shipped profile name, or a model
    name with one shipped profile, e.g. bert-tiny).

    Default: the shipped ViT-B/16 profile measured on this project's CPU (vit-base_cpu_fp32) on the paper's
    cluster, α=1/3, 10 epochs.
    """
    from ptplan.planner.cluster import resolve_cluster
    from ptplan.planner.planner import TrainingConfig

    from ptplan.cli.flags import PLAN_RULES, refuse_inapplicable

    refuse_inapplicable(click.get_current_context(), PLAN_RULES)
    ppath, prof = _load_inputs(profile, cluster_name, data, out, report)
    if data is not None:
        samples_per_epoch, batch = _from_data(data, prof, samples_per_epoch, batch)
    cluster = resolve_cluster(cluster_name)
    freeze = freeze_from_options(freeze_policy, alpha, manual, freeze_every, adaptive)
    training = TrainingConfig(epochs=epochs, samples_per_epoch=samples_per_epoch, batch=batch,
                              batch_policy=batch_policy, schedule=schedule, optimizer=optimizer, pin_K=pin_k,
                              start_K=start_k, pin_M=pin_m, cache=cache, memory_fraction=memory_fraction,
                              allow_extrapolation=allow_extrapolation)
    _check_training(training, cluster, prof, freeze_policy, freeze_every)
    t0 = time.perf_counter()
    result = _search(prof, cluster, training, freeze, ppath, strategies, token_slices, quiet)
    dt = time.perf_counter() - t0
    _write_outputs(result, out, report)
    if not quiet:
        click.echo(format_plan_table(result))
    for w in format_warnings(result):
        click.echo(w, err=True)
    click.echo(f"planned {len(result.phases)} phases in {dt:.2f} s; wrote {out}"
               + (f" and {report}" if report else ""))


def _load_inputs(profile: str, cluster_name: str, data: str | None, out: str,
                 report: str | None) -> tuple[Path, Any]:
    """The profile's path and the profile, once every output is checked against every input."""
    from ptplan.planner.profile import load_profile

    ppath = resolve_profile_path(profile)
    inputs = [ppath] + ([Path(cluster_name)] if Path(cluster_name).is_file() else []) + ([Path(data)] if data else [])
    outputs: list[str | Path] = [out]
    if report is not None:
        outputs.append(report)
    _check_outputs(inputs, outputs)
    return ppath, load_profile(ppath)


def _check_training(training: Any, cluster: Any, prof: Any, freeze_policy: str, freeze_every: int | None) -> None:
    """Refuse a batch the cluster cannot reach, a freeze step past the end and an epoch order the hosts cannot
    hold; warn where the schedule's split backward cannot pay."""
    from ptplan.planner.config import check_batch_reach, epoch_order_problem

    from ptplan.cli.flags import check_freeze_every, twobw_warning

    check_batch_reach(training, cluster.world_size, max(prof.batch_sizes))
    epochs, samples_per_epoch, batch = training.epochs, training.samples_per_epoch, training.batch
    check_freeze_every("--freeze-every", freeze_every, epochs * (samples_per_epoch // batch),
                       f"{epochs} epochs of at most {samples_per_epoch:,} // {batch:,} steps")
    if (note := twobw_warning(training.schedule, freeze_policy, freeze_every)) is not None:
        click.echo(f"warning: {note}", err=True)
    if (why := epoch_order_problem(samples_per_epoch, cluster.gpus_per_node, cluster.host_memory_bytes)) is not None:
        raise PtplanError(why)


def _search(prof: Any, cluster: Any, training: Any, freeze: Any, ppath: Path, strategies: str, token_slices: str,
            quiet: bool) -> Any:
    """The plan, with a progress bar on a terminal's stderr unless --quiet."""
    from ptplan.planner.planner import make_plan

    bar = _Progress(enabled=not quiet and sys.stderr.isatty())
    try:
        return make_plan(prof, cluster, training, freeze, profile_path=str(ppath), progress=bar.update,
                         strategies=strategies, token_slices=token_slices)
    finally:
        bar.close()


def _write_outputs(result: Any, out: str, report: str | None) -> None:
    """plan.json and, with --report, the HTML report: all of them or none (the report is built first, and
    plan.json is removed when the report cannot be written)."""
    from ptplan.planner.plan import save_plan

    html = None
    if report:
        from ptplan.planner.report.viz import report_html

        html = report_html(result)  # built before anything is written: all outputs or none
    save_plan(result, out)
    if html is not None and report:
        from ptplan.planner.jsonio import write_atomic

        try:
            write_atomic(report, html)
        except BaseException:
            os.unlink(out)
            raise

DATA_BATCH = 32
"""``ptplan plan --data``'s global batch when --batch is not given: a common fine-tuning batch."""


def _from_data(data: str, prof: Any, samples_per_epoch: int, batch: int) -> tuple[int, int]:
    """--samples-per-epoch and --batch from the data file where not given on the command line; its sequence
    length checked against the profile's."""
    from click.core import ParameterSource

    from ptplan.cli.data_info import data_shape

    n, seq_len = data_shape(data)
    if seq_len is not None and prof.model.seq_len and seq_len != prof.model.seq_len:
        raise PtplanError(f"--data {data} has {seq_len} tokens per sample but the profile was measured at "
                          f"{prof.model.seq_len}; profile again with --seq-len {seq_len}, or write the data with "
                          f"`ptplan data ... --seq-len {prof.model.seq_len}`")
    ctx = click.get_current_context()
    given = {k for k in ("samples_per_epoch", "batch") if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
    if "samples_per_epoch" not in given:
        samples_per_epoch = n
    elif samples_per_epoch > n:
        raise PtplanError(f"--samples-per-epoch {samples_per_epoch:,} is more than the {n:,} samples in --data "
                          f"{data}; leave it out to use them all")
    if "batch" not in given:
        batch = min(DATA_BATCH, samples_per_epoch)
    return samples_per_epoch, batch


class _Progress:
    """A progress bar on stderr for long plans (phases searched out of all)."""

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        self.enabled = enabled

    def update(self, done: int, total: int) -> None:
        if not self.enabled or total < 50:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="planning phases", unit="phase", file=sys.stderr, leave=False)
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
