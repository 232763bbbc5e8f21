"""The plan contract's checks across fields, run by its one reader (``plan.plan_from_json``), so that every
command that reads a plan (show, compare, run, data --plan) refuses the same files: each phase's schedule runs
as written (sizes; action lists with every action known, every message sent and received once, no deadlock:
``schedule.check_schedule``), its micro-batches split the plan's batch, and its predicted memory fits the
cluster's devices. The executor adds what only it knows (its model, its world, torch's message order)."""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

from .errors import SchemaError
from .schedule import Schedule, ScheduleError, build_schedule, check_schedule, parse_action, terapipe

if TYPE_CHECKING:
    from .cluster import Cluster
    from .config import TrainingConfig
    from .plan import Phase

FIX = "Re-run `ptplan plan`"


@lru_cache(maxsize=256)
def _generated_text(name: str, K: int, M: int, V: int, slices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The generator's action lists for these sizes as plan text, and its stage placement."""
    sched = terapipe(K, M, slices) if slices else build_schedule(name, K, M, V)
    if slices:
        check_schedule(sched)
    return tuple(" ".join(map(str, acts)) for acts in sched.actions), sched.stage_to_rank


@lru_cache(maxsize=256)
def _schedule_problem(name: str, K: int, M: int, V: int, s2r: tuple[int, ...], actions: tuple[str, ...],
                      slices: int) -> str | None:
    """Why these action lists (or, with none, the generated ones) cannot run; None when they can."""
    try:
        want, where = _generated_text(name, K, M, V, slices)
    except ScheduleError as e:
        return str(e)
    if not actions:
        if where != s2r:
            return (f"schedule {name!r} places its stages {where}, but a phase without actions places chunk c on "
                    f"position c % K {s2r}")
        return None
    if actions == want:
        return None
    if slices or name == "2bw":
        what = "token-sliced phases run TeraPipe's lists" if slices else "2bw runs the continuous 1F1B"
        return f"{what} (planner.schedule), but this phase's action lists differ"
    if len(actions) != K:
        return f"{len(actions)} action lists for K={K} positions"
    try:
        lists = tuple(tuple(parse_action(tok) for tok in text.split()) for text in actions)
        sched = Schedule(name=name, K=K * V, M=M, stage_to_rank=s2r, actions=lists)
        check_schedule(sched)
    except ScheduleError as e:
        return str(e)
    if any(a.slice for acts in lists for a in acts):
        return "its actions name token slices but the phase has no slice lengths (slices)"
    return None


def check_phase_schedule(source: str, i: int, ph: "Phase") -> None:
    """Phase i's schedule runs as its plan writes it; SchemaError names ``phases[i].actions`` (or ``.M``)."""
    try:
        s2r = ph.stage_to_rank()
    except Exception as e:  # noqa: BLE001 - a placement that cannot be computed is the same error
        raise SchemaError(source, f"phases[{i}].schedule", f"has no stage placement for K={ph.K}, V={ph.V}: {e}",
                          FIX) from None
    why = _schedule_problem(ph.schedule, ph.K, ph.M, ph.V, s2r, tuple(ph.actions), len(ph.slices))
    if why is not None:
        field = f"phases[{i}].actions" if ph.actions else f"phases[{i}].M"
        raise SchemaError(source, field, f"schedule {ph.schedule!r} with K={ph.K}, V={ph.V}, M={ph.M} cannot run: "
                          f"{why}", FIX)


def check_batch_split(source: str, i: int, ph: "Phase", training: "TrainingConfig") -> None:
    """Phase i's D·M micro-batches of b samples are the plan's batch (global, or per pipeline)."""
    B = training.batch
    if training.batch_policy == "constant-global":
        if ph.D * ph.M * ph.micro_batch_size != B:
            raise SchemaError(source, f"phases[{i}].M", f"D*M*b = {ph.D}*{ph.M}*{ph.micro_batch_size} = "
                              f"{ph.D * ph.M * ph.micro_batch_size} samples per step but the plan's global batch is "
                              f"{B} (inputs.training.batch): M must split the batch into equal micro-batches", FIX)
    elif ph.M * ph.micro_batch_size != B:
        raise SchemaError(source, f"phases[{i}].M", f"M*b = {ph.M}*{ph.micro_batch_size} = "
                          f"{ph.M * ph.micro_batch_size} samples per pipeline but the plan's per-pipeline batch is "
                          f"{B} (inputs.training.batch)", FIX)


def check_memory(source: str, i: int, ph: "Phase", cluster: "Cluster") -> None:
    """Phase i's predicted peaks (per stage, per rank) within one device of the plan's cluster."""
    cap = cluster.gpu_memory_bytes
    pred = ph.predicted
    for key, values in (("stage_peak_memory_bytes", pred.stage_peak_memory_bytes),
                        ("rank_peak_memory_bytes", pred.rank_peak_memory_bytes)):
        for s, v in enumerate(values):
            if v > cap:
                raise SchemaError(source, f"phases[{i}].predicted.{key}[{s}]", f"{v:,} bytes exceeds one device's "
                                  f"{cap:,} bytes (inputs.cluster.gpu_memory_bytes): the plan predicts a phase that "
                                  f"does not fit", FIX)


def check_phases(source: str, phases: Sequence["Phase"], training: "TrainingConfig", cluster: "Cluster") -> None:
    """Every phase: schedule, batch split and memory (see the module's docstring)."""
    for i, ph in enumerate(phases):
        check_batch_split(source, i, ph, training)
        check_memory(source, i, ph, cluster)
        check_phase_schedule(source, i, ph)
