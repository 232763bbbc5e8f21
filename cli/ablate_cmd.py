"""``ptplan ablate``: parse flags, predict every ablation row (planner/ablate.py), print the table, write --json."""
from __future__ import annotations

from pathlib import Path

import click

from ptplan.cli.plan_cmd import DEFAULT_PROFILE, _check_outputs, _parse_int_list, resolve_profile_path
from ptplan.planner.ablate import Ablation, AblationRow
from ptplan.planner.errors import PtplanError


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


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
    if ab.best_static_seconds < ab.baseline_seconds:
        full = ab.row("full").seconds
        vs = f"; the full system is {ab.best_static_seconds / full:.2f}x faster than it" if full else ""
        lines.append(f"the best static configuration without freezing is K={ab.best_static_K}, M={ab.best_static_M}: "
                     f"{ab.best_static_seconds:,.1f} s{vs}")
    return "\n".join(lines)


@click.command("ablate")
@click.argument("profile", required=False, default=DEFAULT_PROFILE)
@click.option("--cluster", "cluster_name", default="paper", show_default=True,
              help="A cluster preset or a cluster JSON file (as for ptplan plan).")
@click.option("--epochs", type=int, default=10, show_default=True, help="Training epochs.")
@click.option("--samples-per-epoch", type=int, default=50_000, show_default=True, help="Samples per epoch.")
@click.option("--batch", type=int, default=512, show_default=True,
              help="Global batch (constant-global) or per-pipeline batch (constant-pipeline).")
@click.option("--batch-policy", type=click.Choice(["constant-global", "constant-pipeline"]),
              default="constant-global", show_default=True)
@click.option("--freeze", "freeze_policy", type=click.Choice(["geometric", "manual", "none"]), default="geometric",
              show_default=True, help="Freeze trajectory: the paper's geometric bound, a manual list, or none.")
@click.option("--alpha", type=float, default=1 / 3, show_default="1/3",
              help="Freeze rate α in (0,1): each freeze step freezes at most α of the active blocks.")
@click.option("--manual", "manual", default=None,
              help="Frozen blocks per freeze step, e.g. 0,4,7,9 (with --freeze manual).")
@click.option("--freeze-every", type=int, default=None,
              help="A freeze step every N optimizer steps instead of once per epoch.")
@click.option("--schedule", type=click.Choice(["1f1b", "gpipe"]), default="1f1b", show_default=True)
@click.option("--optimizer", type=click.Choice(["adamw", "sgd"]), default="adamw", show_default=True)
@click.option("--start-K", "start_k", type=int, default=None,
              help="The baseline's pipeline length, from which every row only compresses "
                   "(default: one pipeline per node, as the paper).")
@click.option("--memory-fraction", type=float, default=0.9, show_default=True,
              help="Share of device (and host) memory a plan may use.")
@click.option("--allow-extrapolation", is_flag=True,
              help="Allow micro-batch sizes outside the profile's measured sizes (their times are extrapolated).")
@click.option("--json", "json_out", default=None, help="Also write every row's numbers here (JSON).")
@click.option("--report", default=None, help="Also write the ablation as an offline HTML page (figure and table).")
def ablate(profile, cluster_name, epochs, samples_per_epoch, batch, batch_policy, freeze_policy, alpha, manual,
           freeze_every, schedule, optimizer, start_k, memory_fraction, allow_extrapolation, json_out,
           report) -> None:
    """The PipeTransformer ablation for PROFILE on a cluster: predicted training time and speedup of no
    freezing, freeze only, + AutoPipe, + AutoCache, + AutoDP, the full system, and the full system with
    the paper's greedy split, K halving only, or its hard-coded micro-batch table.

    Default: the shipped ViT-B/16 profile on the paper's cluster, α=1/3, 10 epochs.
    """
    from ptplan.planner.ablate import ablate as run_ablation
    from ptplan.planner.cluster import resolve_cluster
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.jsonio import write_json
    from ptplan.planner.profile import load_profile

    ppath = resolve_profile_path(profile)
    outs = [Path(p) for p in (json_out, report) if p is not None]
    if outs:
        _check_outputs([ppath] + ([Path(cluster_name)] if Path(cluster_name).is_file() else []), outs)
    prof = load_profile(ppath)
    cluster = resolve_cluster(cluster_name)
    manual_list = _parse_int_list(manual, "--manual") if manual else None
    if freeze_policy == "manual" and manual_list is None:
        raise PtplanError("--freeze manual needs --manual with the frozen blocks per epoch, e.g. --manual 0,4,7,9")
    freeze = FreezePolicy(policy=freeze_policy, alpha=alpha, manual=tuple(manual_list or ()),
                          every=freeze_every if freeze_every is not None else "epoch")
    training = TrainingConfig(epochs=epochs, samples_per_epoch=samples_per_epoch, batch=batch,
                              batch_policy=batch_policy, schedule=schedule, optimizer=optimizer, start_K=start_k,
                              memory_fraction=memory_fraction, allow_extrapolation=allow_extrapolation)
    result = run_ablation(prof, cluster, training, freeze)
    table = format_ablation(result)
    page = None
    if report is not None:
        from ptplan.planner.viz import ablation_html

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
