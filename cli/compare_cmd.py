"""``ptplan compare PLAN RUNLOG``: predicted versus measured, phase by phase (table and JSON)."""
from __future__ import annotations

import click


@click.command("compare")
@click.argument("plan_path", metavar="PLAN")
@click.argument("runlog", metavar="RUNLOG")
@click.option("--json", "json_out", default=None, help="Also write the comparison as JSON here.")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="Steps left out at the start of each phase visit (first-step set-up costs).")
@click.option("--threshold", type=float, default=15.0, show_default=True, metavar="PERCENT",
              help="Explain each phase whose iteration time is off by more than this: the term that differs most "
                   "and what in the profile's making (timer, load, device) may explain it.")
def compare(plan_path: str, runlog: str, json_out: str | None, warmup: int, threshold: float = 15.0) -> None:
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
    if not threshold >= 0:
        raise PtplanError(f"--threshold must be a percentage >= 0, got {threshold}")
    plan = load_plan(plan_path)
    result = do_compare(plan, log, warmup=warmup)
    click.echo(format_comparison(result))
    from ptplan.planner.explain import explain, profile_record

    for line in explain(plan, result, profile_record(plan, plan_path), threshold=threshold / 100):
        click.echo(line)
    if json_out:
        write_json(json_out, result.to_json())
        click.echo(f"wrote {json_out}")
