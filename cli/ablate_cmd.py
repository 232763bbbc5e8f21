"""``ptplan ablate``: parse flags, predict every ablation row (planner/ablate.py), print the table, write --json."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ptplan.cli.plan_cmd import (DEFAULT_PROFILE, freeze_from_options, resolve_profile_path,
                                 shared_options)
from ptplan.planner.errors import PtplanError

if TYPE_CHECKING:  # the planner's ablation is imported by the command itself, not by every `ptplan` start
    from ptplan.planner.ablate import Ablation, AblationRow


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def baseline_lines(ab: Ablation) -> list[str]:
    """The baselines without freezing (planner/baselines.py) as table lines: layout, time, the full system's
    speedup over each, memory per GPU and whether it fits."""
    lines: list[str] = []
    if ab.baselines:
        lines += ["", f"{'baseline, no freezing':<50} {'K':>3} {'D':>4} {'tp':>3} {'M':>4} {'seconds':>11} "
                      f"{'full is':>8}  memory per GPU"]
        full_s = ab.row("full").seconds
        for b in ab.baselines:
            if b.seconds is None:
                lines.append(f"{b.label:<50} not possible: {b.error}")
                continue
            vs = f"{b.seconds / full_s:.2f}x" if full_s else "-"
            extra = "".join(f", {w}" for w, on in (("sp", b.sp), ("FSDP", b.fsdp), ("recompute", b.recompute)) if on)
            lines.append(f"{b.label:<50} {b.K:>3} {b.D:>4} {b.tp:>3} {b.M:>4} {b.seconds:>11,.1f} {vs:>8}  "
                         f"{b.peak_memory_bytes / 2**30:,.2f} GiB, {b.fit_text}{extra}"
                         + (f" ({b.note})" if b.note else ""))
        lines.append("full is: the baseline's seconds over the full system's (row 6)")
    return lines


def format_ablation(ab: Ablation) -> str:
    """The ablation as a table: row, what changed, seconds, speedups, the paper's bar, the K x D trajectory."""
    tr, fz = ab.training, ab.freeze
    how = {"geometric": f"geometric, alpha={fz.alpha:.4g}", "manual": "manual", "none": "none"}[fz.policy]
    every = "epoch" if fz.every == "epoch" else f"{fz.every} steps"
    lines = [
        f"ablation of {ab.model} (profiled on {ab.device}, {ab.profile_source}) on {ab.cluster} ({ab.world_size} "
        f"devices), starting K={ab.start_K} x D={ab.world_size // ab.start_K}; {tr.epochs} epochs x "
        f"{tr.samples_per_epoch:,} samples, batch {tr.batch} ({tr.batch_policy}), {tr.schedule}, {tr.optimizer}",
        f"freeze {how}, a step per {every}: frozen blocks per step {','.join(map(str, ab.freeze_steps))}",
        "",
    ]
    hdr = (f"{'row':>3}  {'what changed':<46} {'seconds':>11} {'speedup':>8} {'step':>13} {'paper':>6}  "
           f"K x D (epochs; +c: AutoCache on)")
    lines += [hdr, "-" * len(hdr)]
    flagged: list[tuple[AblationRow, str]] = []
    for r in ab.rows:
        step = "" if not r.versus else f"{_x(r.speedup_vs)} vs {r.versus}"
        secs = "-" if r.seconds is None else f"{r.seconds:,.1f}"
        mark = " "
        if r.error is not None:
            flagged.append((r, f"not priced: {r.error}"))
            mark = "!"
        for ph in r.phases:
            for n in ph.notes:
                flagged.append((r, f"{ph.frozen_blocks} frozen blocks (K={ph.K}, M={ph.M}): {n}"))
                mark = "!"
        for n in r.notes:
            flagged.append((r, n))
        lines.append(f"{r.number:>3}{mark} {r.label:<46} {secs:>11} {_x(r.speedup):>8} {step:>13} "
                     f"{_x(r.paper_speedup) if r.paper_speedup is not None else '':>6}  {r.summary()}")
    lines.append("")
    lines.append("speedup: over row 1; step: over the row it builds on; paper: PipeTransformer's published bars "
                 "(ViT-B/16 ImageNet, 2 x 8 Quadro RTX 5000)")
    for r, n in flagged[:16]:
        lines.append(f"! row {r.number}: {n}")
    if len(flagged) > 16:
        lines.append(f"! ... and {len(flagged) - 16} more notes (--json: rows[].phases[].notes)")
    lines += baseline_lines(ab)
    if ab.best_static_seconds < ab.baseline_seconds:
        full = ab.row("full").seconds
        vs = f"; the full system is {ab.best_static_seconds / full:.2f}x faster than it" if full else ""
        lines.append(f"the best static configuration without freezing is K={ab.best_static_K}, M={ab.best_static_M}: "
                     f"{ab.best_static_seconds:,.1f} s{vs}")
    return "\n".join(lines)


@click.command("ablate")
@click.argument("profile", required=False, default=DEFAULT_PROFILE)
@shared_options
@click.option("--start-K", "start_k", type=int, default=None,
              help="The baseline's pipeline length, from which every row only compresses "
                   "(default: one pipeline per node, as the paper).")
@click.option("--json", "json_out", default=None, help="Also write every row's numbers here (JSON).")
@click.option("--report", default=None, help="Also write the ablation as an offline HTML page (figure and table).")
def ablate(profile, cluster_name, epochs, samples_per_epoch, batch, batch_policy, freeze_policy, alpha, manual,
           freeze_every, schedule, optimizer, start_k, memory_fraction, allow_extrapolation, json_out,
           report) -> None:
    """The PipeTransformer ablation for PROFILE on a cluster: predicted training time and speedup of no
    freezing, freeze only, + AutoPipe, + AutoCache, + AutoDP, the full system, and the full system with
    the paper's greedy split, K halving only, or its hard-coded micro-batch table.

    Default: the shipped ViT-B/16 profile measured on this project's CPU (vit-base_cpu_fp32) on the paper's
    cluster, α=1/3, 10 epochs.
    """
    from ptplan.planner.ablate import ablate as run_ablation
    from ptplan.planner.cluster import resolve_cluster
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.jsonio import write_json
    from ptplan.planner.profile import load_profile

    from ptplan.cli.flags import PLAN_RULES, check_freeze_every, refuse_inapplicable

    refuse_inapplicable(click.get_current_context(), PLAN_RULES)
    ppath = resolve_profile_path(profile)
    from ptplan.cli.outputs import check_outputs

    check_outputs([("profile", os.fspath(ppath))] + ([("cluster file", cluster_name)] if Path(cluster_name).is_file()
                                                     else []), [("--json", json_out), ("--report", report)])
    prof = load_profile(ppath)
    cluster = resolve_cluster(cluster_name)
    freeze = freeze_from_options(freeze_policy, alpha, manual, freeze_every)
    training = TrainingConfig(epochs=epochs, samples_per_epoch=samples_per_epoch, batch=batch,
                              batch_policy=batch_policy, schedule=schedule, optimizer=optimizer, start_K=start_k,
                              memory_fraction=memory_fraction, allow_extrapolation=allow_extrapolation)
    from ptplan.planner.config import check_batch_reach

    check_batch_reach(training, cluster.world_size, max(prof.batch_sizes))
    check_freeze_every("--freeze-every", freeze_every, epochs * (samples_per_epoch // batch),
                       f"{epochs} epochs of at most {samples_per_epoch:,} // {batch:,} steps")
    from ptplan.planner.config import epoch_order_problem

    if (why := epoch_order_problem(samples_per_epoch, cluster.gpus_per_node, cluster.host_memory_bytes)) is not None:
        raise PtplanError(why)
    result = run_ablation(prof, cluster, training, freeze)
    table = format_ablation(result)
    page = None
    if report is not None:
        from ptplan.planner.report.viz import ablation_html

        page = ablation_html(result, table)  # built before anything is written
    if json_out is not None:
        write_json(json_out, result.to_json())
    if page is not None:
        from ptplan.planner.jsonio import write_atomic

        write_atomic(report, page)
    click.echo(table)
    for w in result.warnings:
        click.echo(f"warning: {w}", err=True)
    for path in (json_out, report):
        if path is not None:
            click.echo(f"wrote {path}")
