"""``ptplan show``: write a plan's interactive, offline HTML report (with a run beside it, when given)."""
from __future__ import annotations

import os

import click


@click.command("show")
@click.argument("plan", type=click.Path(dir_okay=False, path_type=str))
@click.option("--out", "out", default="report.html", show_default=True,
              help="HTML file to write (self-contained; opens without network).")
@click.option("--run", "runlog", default=None, type=click.Path(dir_okay=False, path_type=str),
              help="A run log of this plan (ptplan run --log): adds the predicted-against-measured figure.")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="With --run: steps left out at the start of each phase visit.")
def show(plan: str, out: str, runlog: str | None, warmup: int) -> None:
    """Write PLAN (a plan.json from `ptplan plan`) as one interactive HTML report."""
    from ptplan.cli.main import check_outputs
    from ptplan.planner.plan import load_plan
    from ptplan.planner.report.viz import write_report  # plotly: imported only by the command that draws

    check_outputs([("plan", plan), ("run log", runlog)], [("--out", out)])
    p = load_plan(plan)
    comparison = None
    if runlog is not None:
        from ptplan.planner.compare import compare, read_run_log

        log = read_run_log(runlog)
        comparison = compare(p, log, warmup=warmup)
        for note in log.warnings:
            click.echo(f"warning: {note}", err=True)
    write_report(p, out, comparison=comparison)
    for w in p.warnings:
        click.echo(f"warning: {w.message}", err=True)
    size = os.path.getsize(out)
    click.echo(f"wrote {out} ({size / 1e6:.1f} MB)")
