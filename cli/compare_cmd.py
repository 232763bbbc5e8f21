"""``ptplan compare PLAN RUNLOG``: predicted versus measured, phase by phase (table and JSON)."""
from __future__ import annotations

import click


@click.command("compare")
@click.argument("plan_path", metavar="PLAN")
@click.argument("runlog", metavar="RUNLOG")
@click.option("--json", "json_out", default=None, help="Also write the comparison as JSON here.")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="Steps left out at the start of each phase visit (first-step set-up costs).")
def compare(plan_path: str, runlog: str, json_out: str | None, warmup: int) -> None:
    """Compare a plan's predictions with a run log written by `ptplan run --log`."""
    from ptplan.cli.main import check_outputs
    from ptplan.planner.compare import compare as do_compare, format_comparison, read_run_log
    from ptplan.planner.errors import PtplanError
    from ptplan.planner.jsonio import write_json
    from ptplan.planner.plan import load_plan

    if warmup < 0:
        raise PtplanError(f"--warmup must be 0 or more, got {warmup}")
    check_outputs([("plan", plan_path), ("run log", runlog)], [("--json", json_out)])
    log = read_run_log(runlog)
    result = do_compare(load_plan(plan_path), log, warmup=warmup)
    click.echo(format_comparison(result))
    if json_out:
        write_json(json_out, result.to_json())
        click.echo(f"wrote {json_out}")
