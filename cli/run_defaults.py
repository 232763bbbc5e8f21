"""What ``ptplan run`` takes from the plan when it is not given: the model (and its weights folder) the plan's
profile was measured on, and the single-node world size."""
from __future__ import annotations

import json
import os
from typing import Any

from ptplan.planner.errors import PtplanError


def plan_profile_measurement(plan: Any, plan_path: str) -> dict[str, Any]:
    """The ``measurement`` record of the plan's profile file (found as recorded, or beside the plan); {} when the
    file is gone or unreadable."""
    recorded = plan.inputs.profile.path
    if not recorded:
        return {}
    for path in (recorded, os.path.join(os.path.dirname(os.path.abspath(plan_path)), os.path.basename(recorded))):
        try:
            with open(path, encoding="utf-8") as fh:
                meas = json.load(fh).get("measurement")
            return meas if isinstance(meas, dict) else {}
        except (OSError, ValueError, AttributeError):
            continue
    return {}


def model_from_plan(plan: Any, plan_path: str) -> tuple[str, str | None]:
    """(--model, --weights) the plan's profile was made with: the MODEL and --weights its ``ptplan profile``
    recorded (a folder must still exist), else the profile's model name when that is a name ptplan knows."""
    from ptplan.executor.families import model_source

    meas = plan_profile_measurement(plan, plan_path)
    model, weights = meas.get("model_arg"), meas.get("weights_arg")
    name = plan.inputs.profile.model
    if isinstance(model, str) and (not os.path.isabs(model) or os.path.isdir(model)) \
            and (weights is None or (isinstance(weights, str) and os.path.isdir(weights))):
        return model, weights
    try:
        model_source(name)
    except PtplanError:
        where = f" (profiled from {model}, which is gone)" if isinstance(model, str) else ""
        raise PtplanError(f"the plan's model {name!r}{where} is not a name ptplan knows and its profile does not say "
                          f"which folder it came from; pass --model NAME_OR_FOLDER (and --weights DIR)") from None
    return name, None


def nproc_from_plan(plan: Any, nnodes: str) -> int:
    """The plan's world size, K*D of its phases, when the job has one node; several nodes must say how many
    processes each runs."""
    if str(nnodes).strip() != "1":
        raise PtplanError(f"--nproc-per-node is needed with --nnodes {nnodes}: the plan needs {plan.world_size} "
                          f"processes in all (nodes x processes per node)")
    c = plan.inputs.cluster
    if c.nodes > 1:
        import click

        click.echo(f"note: the plan is for {c.nodes} nodes x {c.gpus_per_node} ({c.name}); this job runs all "
                   f"{plan.world_size} processes on this machine. To run it on its nodes, start ptplan run on each "
                   f"with --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} and a rendezvous (docs/running.md)",
                   err=True)
    return int(plan.world_size)
