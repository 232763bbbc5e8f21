"""``ptplan show``: write a plan's interactive, offline HTML report (with a run beside it, when given)."""
from __future__ import annotations

import os

import click

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import load_plan
from ptplan.planner.viz import write_report


def _same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (after links and relative parts), existing or not."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def check_out(out: str, plan: str, runlog: str | None) -> None:
    """Refuse an --out that would overwrite the plan or the run log the report is made from."""
    for what, path in (("plan", plan), ("run log", runlog)):
        if path is not None and _same_file(out, path):
            stem = os.path.splitext(os.path.basename(path))[0] or "report"
            raise PtplanError(f"--out {out} is the {what} itself; writing the report there would destroy the "
                              f"{what}. Give another file, e.g. --out {stem}.html")


@click.command("show")
@click.argument("plan", type=click.Path(dir_okay=False, path_type=str))
@click.option("--out", "out", default="report.html", show_default=True, type=click.Path(dir_okay=False, path_type=str),
              help="HTML file to write (self-contained; opens without network).")
@click.option("--run", "runlog", default=None, type=click.Path(dir_okay=False, path_type=str),
              help="A run log of this plan (ptplan run --log): adds the predicted-against-measured figure.")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="With --run: steps left out at the start of each phase visit.")
def show(plan: str, out: str, runlog: str | None, warmup: int) -> None:
    """Write PLAN (a plan.json from `ptplan plan`) as one interactive HTML report."""
    check_out(out, plan, runlog)
    p = load_plan(plan)
    comparison = None
    if runlog is not None:
        from ptplan.planner.compare import compare, read_run_log

        comparison = compare(p, read_run_log(runlog), warmup=warmup)
    write_report(p, out, comparison=comparison)
    for w in p.warnings:
        click.echo(f"warning: {w.message}", err=True)
    size = os.path.getsize(out)
    click.echo(f"wrote {out} ({size / 1e6:.1f} MB)")
