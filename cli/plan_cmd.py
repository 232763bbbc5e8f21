"""``ptplan plan``: parse flags, build the plan, write plan.json (and the report), print a table."""
from __future__ import annotations

import os
import time
from pathlib import Path

import click

from ptplan.planner.errors import PtplanError

DEFAULT_PROFILE = "vit-base_cpu_fp32"


def resolve_profile_path(name_or_path: str) -> Path:
    """A profile file path, or the stem of a shipped profile (``ls profiles/``)."""
    p = Path(name_or_path)
    if p.exists() or p.suffix == ".json" or os.sep in name_or_path:
        return p
    from ptplan.profiles import PROFILE_DIR, shipped

    cand = shipped(name_or_path)
    if cand.exists():
        return cand
    names = sorted(x.stem for x in PROFILE_DIR.glob("*.json"))
    raise PtplanError(f"no profile file {name_or_path!r} and no shipped profile of that name; "
                      f"shipped: {', '.join(names) or '(none)'}")


def _parse_int_list(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise PtplanError(f"{what} must be a comma-separated list of integers, got {text!r}") from None


def _fmt_bytes(x: float) -> str:
    return f"{x / 1024 ** 3:.2f}"


def format_plan_table(plan) -> str:
    """A readable per-phase table plus the trajectory and the totals."""
    lines = []
    inp = plan.inputs
    prof, cl, tr = inp["profile"], inp["cluster"], inp["training"]
    lines.append(f"model {prof['model']} ({prof['num_blocks']} blocks, {prof['num_layers']} layers, profiled on "
                 f"{prof['device']}) on cluster {cl['name']} ({plan.world_size} GPUs); schedule {tr['schedule']}, "
                 f"batch policy {tr['batch_policy']}")
    used = {t.phase for t in plan.trajectory}
    hdr = f"{'phase':>5} {'frozen':>6} {'K':>4} {'D':>5} {'M':>4} {'b':>4}  {'layers per stage':<24} " \
          f"{'samples/s':>10} {'bubble':>6} {'peak GiB':>8} {'cache':>5}"
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for i, ph in enumerate(plan.phases):
        if i not in used and len(plan.phases) > 16:
            continue
        sizes = "|".join(str(hi - lo) for lo, hi in ph.partition)
        if len(sizes) > 24:
            sizes = sizes[:21] + "..."
        mark = "*" if i in used else " "
        lines.append(f"{i:>4}{mark} {ph.frozen_blocks:>6} {ph.K:>4} {ph.D:>5} {ph.M:>4} {ph.micro_batch_size:>4}  "
                     f"{sizes:<24} {ph.predicted.samples_per_s:>10.2f} {ph.predicted.bubble_fraction:>6.1%} "
                     f"{_fmt_bytes(max(ph.predicted.stage_peak_memory_bytes)):>8} {'on' if ph.cache else 'off':>5}")
    if len(plan.phases) > 16:
        lines.append(f"(* = on the predicted trajectory; {len(plan.phases) - len(used)} other phases are in the plan "
                     f"for adaptive freezing)")
    else:
        lines.append("(* = on the predicted trajectory; the others serve adaptive freezing)")
    lines.append("")
    lines.append("epoch  frozen  phase  iterations  seconds")
    for t in plan.trajectory:
        lines.append(f"{t.epoch:>5} {t.frozen_blocks:>7} {t.phase:>6} {t.iterations:>11} {t.seconds:>8.1f}")
    b = plan.baseline.phase
    lines.append("")
    lines.append(f"baseline (no freezing, static K={b.K}, D={b.D}, M={b.M}): {plan.baseline.seconds:.1f} s; "
                 f"plan: {plan.totals['seconds']:.1f} s; predicted speedup {plan.totals['speedup']:.2f}x")
    if plan.totals.get("best_static_K") is not None and (plan.totals["best_static_K"], plan.totals["best_static_M"]) != (b.K, b.M):
        lines.append(f"best static configuration without freezing (K={int(plan.totals['best_static_K'])}, "
                     f"M={int(plan.totals['best_static_M'])}): {plan.totals['best_static_seconds']:.1f} s; "
                     f"speedup over it {plan.totals['speedup_vs_best_static']:.2f}x")
    if prof.get("device_kind") == "cpu" and "cpu" not in str(cl.get("gpu_name", "")).lower():
        lines.append(f"note: the profile was measured on {prof['device']} (CPU); predicted seconds use its compute "
                     f"speed with the cluster's links and memory. Profile on the target GPU for absolute numbers.")
    return "\n".join(lines)


@click.command("plan")
@click.argument("profile", required=False, default=DEFAULT_PROFILE)
@click.option("--cluster", "cluster_name", default="paper", show_default=True,
              help="Cluster preset (paper, dgx-h100, cpu:N for N processes on this machine, ...) or a cluster JSON file.")
@click.option("--epochs", type=int, default=10, show_default=True, help="Training epochs.")
@click.option("--samples-per-epoch", type=int, default=50_000, show_default=True, help="Samples per epoch.")
@click.option("--batch", type=int, default=512, show_default=True,
              help="Global batch (constant-global) or per-pipeline batch (constant-pipeline).")
@click.option("--batch-policy", type=click.Choice(["constant-global", "constant-pipeline"]),
              default="constant-global", show_default=True)
@click.option("--freeze", "freeze_policy", type=click.Choice(["geometric", "manual", "none"]), default="geometric",
              show_default=True, help="Freeze trajectory: the paper's geometric bound, a manual list, or none.")
@click.option("--alpha", type=float, default=1 / 3, show_default="1/3",
              help="Freeze rate α in (0,1): each epoch freezes at most α of the active blocks.")
@click.option("--manual", "manual", default=None, help="Frozen blocks per epoch, e.g. 0,4,7,9 (with --freeze manual).")
@click.option("--schedule", type=click.Choice(["1f1b", "gpipe"]), default="1f1b", show_default=True)
@click.option("-K", "--pipeline-length", "pin_k", type=int, default=None, help="Pin the pipeline length K.")
@click.option("--start-K", "start_k", type=int, default=None,
              help="Start from this pipeline length and only compress (the paper: one pipeline per node, K=8); "
                   "the baseline is then this static pipeline.")
@click.option("-M", "--micro-batches", "pin_m", type=int, default=None, help="Pin the micro-batch count M.")
@click.option("--cache", type=click.Choice(["off", "on", "auto"]), default="off", show_default=True,
              help="AutoCache of the frozen prefix's outputs.")
@click.option("--memory-fraction", type=float, default=0.9, show_default=True,
              help="Share of GPU memory a plan may use.")
@click.option("--out", "out", default="plan.json", show_default=True, help="Where to write the plan.")
@click.option("--report", default=None, help="Also write the interactive HTML report here.")
@click.option("--quiet", is_flag=True, help="Do not print the table.")
def plan(profile, cluster_name, epochs, samples_per_epoch, batch, batch_policy, freeze_policy, alpha, manual,
         schedule, pin_k, start_k, pin_m, cache, memory_fraction, out, report, quiet) -> None:
    """Plan elastic pipelined training for PROFILE (a profile file or a shipped profile name).

    Default: the shipped ViT-B/16 profile on the paper's cluster, α=1/3, 10 epochs.
    """
    from ptplan.planner.cluster import resolve_cluster
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.plan import save_plan
    from ptplan.planner.planner import TrainingConfig, make_plan
    from ptplan.planner.profile import load_profile

    for path in (out, report):
        if path and not Path(path).resolve().parent.exists():
            raise PtplanError(f"output folder does not exist: {Path(path).resolve().parent}")
    ppath = resolve_profile_path(profile)
    prof = load_profile(ppath)
    cluster = resolve_cluster(cluster_name)
    manual_list = _parse_int_list(manual, "--manual") if manual else None
    if freeze_policy == "manual" and manual_list is None:
        raise PtplanError("--freeze manual needs --manual with the frozen blocks per epoch, e.g. --manual 0,4,7,9")
    freeze = FreezePolicy(policy=freeze_policy, alpha=alpha, manual=tuple(manual_list or ()))
    training = TrainingConfig(epochs=epochs, samples_per_epoch=samples_per_epoch, batch=batch,
                              batch_policy=batch_policy, schedule=schedule, pin_K=pin_k, start_K=start_k, pin_M=pin_m, cache=cache,
                              memory_fraction=memory_fraction)
    t0 = time.perf_counter()
    result = make_plan(prof, cluster, training, freeze, profile_path=str(ppath))
    dt = time.perf_counter() - t0
    report_html = None
    if report:
        from ptplan.planner.viz import write_report

        report_html = report
    save_plan(result, out)
    if report_html:
        write_report(result, report_html)
    if not quiet:
        click.echo(format_plan_table(result))
    click.echo(f"planned {len(result.phases)} phases in {dt:.2f} s; wrote {out}"
               + (f" and {report}" if report else ""))
