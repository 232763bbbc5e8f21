"""``ptplan show``: write a plan's interactive, offline HTML report."""
from __future__ import annotations

import os

import click

from ptplan.planner.plan import load_plan
from ptplan.planner.viz import write_report


@click.command("show")
@click.argument("plan", type=click.Path(dir_okay=False, path_type=str))
@click.option("--out", "out", default="report.html", show_default=True, type=click.Path(dir_okay=False, path_type=str),
              help="HTML file to write (self-contained; opens without network).")
def show(plan: str, out: str) -> None:
    """Write PLAN (a plan.json from `ptplan plan`) as one interactive HTML report."""
    p = load_plan(plan)
    write_report(p, out)
    size = os.path.getsize(out)
    click.echo(f"wrote {out} ({size / 1e6:.1f} MB)")
