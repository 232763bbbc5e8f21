"""The plan contract's checks across fields, in one place: ``check_plan``, run by the one reader
(``plan.plan_from_json``) on the plan it built, so that every command that reads a plan (show, compare, run,
data --plan) refuses the same files, each with one SchemaError naming the field, the values and the fix.

What they hold, i.e. what the plan's readers rely on:

- the phases: one per frozen count (at most the model's blocks), a longer frozen prefix for more frozen blocks and
  none for none, the AutoCache only behind a frozen prefix, every phase and the baseline on the cluster's K·D·tp
  ranks, timelines and per-position peaks sized by K;
- each phase (and the baseline's): its schedule runs as written (sizes; action lists of known actions, each stage
  on one position, every message sent and received once, no deadlock: ``schedule.check_schedule``), its
  micro-batches split the plan's batch, its predicted memory fits the cluster's devices;
- the freeze steps: each count has a phase, never going down;
- the trajectory: the epochs 0..E-1 of ``inputs.training.epochs`` in order, steps contiguous from 0, each run's
  phase and frozen count those of the freeze step at its first step (``Plan.frozen_at``), AutoCache fills only in
  caching phases, each epoch's runs holding its samples (no more, and not a whole step less);
- the totals: seconds and fill seconds the trajectory's, baseline seconds the baseline's.

What the plan cannot tell is left to the commands that know it: the sequence length is recorded once
(``inputs.profile.seq_len``; the profile fingerprint hashes layer names, kinds, blocks and parameter counts, not
the length) except in token-sliced phases, whose slices must sum to it (``plan._slices``); the executor checks
its model, its world and torch's message order.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

from .config import epoch_order_problem
from .errors import SchemaError
from .schedule import Schedule, ScheduleError, build_schedule, check_schedule, parse_action, terapipe

if TYPE_CHECKING:
    from .cluster import Cluster
    from .config import TrainingConfig
    from .plan import Phase, Plan, TrajectoryPoint

FIX = "Re-run `ptplan plan`"


def check_plan(source: str, plan: "Plan") -> None:
    """Every relation in the module's docstring; the first broken one raises SchemaError naming its field."""
    inp = plan.inputs
    tr, cl = inp.training, inp.cluster
    why = epoch_order_problem(tr.samples_per_epoch, cl.gpus_per_node, cl.host_memory_bytes)
    if why is not None:
        raise SchemaError(source, "inputs.training.samples_per_epoch", why)
    check_phase_set(source, plan)
    for i, ph in enumerate(plan.phases):  # each phase whole before what reads its sizes (the trajectory)
        check_phase(source, f"phases[{i}]", ph, tr, cl)
    check_phase(source, "baseline.phase", plan.baseline.phase, tr, cl)
    check_freeze_steps(source, plan)
    check_trajectory(source, plan)
    check_totals(source, plan)


# ---- the phases together ------------------------------------------------------------------------------------
def check_phase_set(source: str, plan: "Plan") -> None:
    """One phase per frozen count within the model, each on the cluster's ranks (the baseline's too)."""
    phases, L, cl = plan.phases, plan.inputs.profile.num_blocks, plan.inputs.cluster
    if not phases:
        raise SchemaError(source, "phases", "is empty: the plan has no phase", FIX)
    for at, ph in [*((f"phases[{i}]", p) for i, p in enumerate(phases)), ("baseline.phase", plan.baseline.phase)]:
        if ph.world != cl.world_size:
            raise SchemaError(source, at, f"uses K*D*tp = {ph.K}*{ph.D}*{ph.tp} = {ph.world} ranks but the cluster "
                              f"has {cl.world_size} (inputs.cluster: {cl.nodes} x {cl.gpus_per_node})", FIX)
    counts = [p.frozen_blocks for p in phases]
    for i, c in enumerate(counts):
        if c > L:
            raise SchemaError(source, f"phases[{i}].frozen_blocks", f"{c} exceeds the model's {L} blocks "
                              f"(inputs.profile.num_blocks)", FIX)
    if len(set(counts)) != len(counts):
        raise SchemaError(source, "phases", f"frozen_blocks values repeat: {counts}; a plan holds one phase per frozen "
                          f"count", FIX)
    check_prefixes(source, plan)


def check_prefixes(source: str, plan: "Plan") -> None:
    """A longer frozen prefix for more frozen blocks and none for none; the AutoCache only behind one; the
    baseline's prefix that of the phase with its count."""
    phases = plan.phases
    prev: int | None = None
    for i in sorted(range(len(phases)), key=lambda k: phases[k].frozen_blocks):
        ph = phases[i]
        if (ph.frozen_blocks == 0) != (ph.frozen_layers == 0):
            raise SchemaError(source, f"phases[{i}].frozen_layers", f"is {ph.frozen_layers} with {ph.frozen_blocks} "
                              f"frozen blocks: the frozen prefix is empty exactly when no block is frozen", FIX)
        if prev is not None and ph.frozen_layers <= phases[prev].frozen_layers:
            raise SchemaError(source, f"phases[{i}].frozen_layers", f"is {ph.frozen_layers} with {ph.frozen_blocks} "
                              f"frozen blocks, but phases[{prev}] with {phases[prev].frozen_blocks} already freezes "
                              f"{phases[prev].frozen_layers} layers: each frozen block adds layers to the prefix", FIX)
        if ph.cache and ph.frozen_layers == 0:
            raise SchemaError(source, f"phases[{i}].cache", "is true but the phase has no frozen prefix (0 frozen "
                              "blocks): the AutoCache holds the frozen prefix's outputs", FIX)
        prev = i
    b = plan.baseline.phase
    same = next((p for p in phases if p.frozen_blocks == b.frozen_blocks), None)
    if same is None:
        raise SchemaError(source, "baseline.phase.frozen_blocks", f"is {b.frozen_blocks} but no phase has that many "
                          f"frozen blocks (phases: {[p.frozen_blocks for p in phases]})", FIX)
    if b.frozen_layers != same.frozen_layers:
        raise SchemaError(source, "baseline.phase.frozen_layers", f"is {b.frozen_layers} with {b.frozen_blocks} "
                          f"frozen blocks, but the plan's phase with {b.frozen_blocks} frozen blocks freezes "
                          f"{same.frozen_layers} layers", FIX)


def check_freeze_steps(source: str, plan: "Plan") -> None:
    """Each freeze step's count has a phase, and counts never go down."""
    steps, counts = plan.freeze_steps, [p.frozen_blocks for p in plan.phases]
    if not steps:
        raise SchemaError(source, "freeze_steps", "is empty", FIX)
    for T, c in enumerate(steps):
        if c not in counts:
            raise SchemaError(source, f"freeze_steps[{T}]", f"{c} frozen blocks has no phase (phases: {counts})", FIX)
        if T and c < steps[T - 1]:
            raise SchemaError(source, f"freeze_steps[{T}]", f"goes down from {steps[T - 1]} to {c}; frozen blocks "
                              f"never thaw", FIX)


# ---- the trajectory -----------------------------------------------------------------------------------------
def check_trajectory(source: str, plan: "Plan") -> None:
    """Epochs 0..E-1 in order, steps contiguous from 0, each run on its freeze step's phase, each epoch's samples."""
    traj, E = plan.trajectory, plan.inputs.training.epochs
    if not traj:
        raise SchemaError(source, "trajectory", f"is empty, but the plan trains {E} epoch(s) "
                          f"(inputs.training.epochs): the trajectory holds each epoch's runs of steps", FIX)
    step = used = 0  # the next run's first step; samples the current epoch's runs take so far
    for j, t in enumerate(traj):
        at = f"trajectory[{j}]"
        _check_point(source, at, t, plan)
        if j == 0 and t.epoch != 0:
            raise SchemaError(source, f"{at}.epoch", f"is {t.epoch}; the trajectory starts at epoch 0", FIX)
        if j and t.epoch != traj[j - 1].epoch:
            if t.epoch != traj[j - 1].epoch + 1:
                raise SchemaError(source, f"{at}.epoch", f"is {t.epoch} after epoch {traj[j - 1].epoch} "
                                  f"(trajectory[{j - 1}]): epochs follow one another", FIX)
            _check_epoch_end(source, j - 1, plan, used, step)
            used = 0
        if t.step != step:
            before = ("the trajectory starts at step 0" if j == 0 else f"the runs before it end at step {step} "
                      f"(trajectory[{j - 1}]: step {traj[j - 1].step} + {traj[j - 1].iterations} iterations)")
            raise SchemaError(source, f"{at}.step", f"is {t.step} but {before}", FIX)
        _check_freeze_step(source, at, t, plan)
        step += t.iterations
        used += t.iterations * plan.phases[t.phase].global_batch
        N = plan.inputs.training.samples_per_epoch
        if used > N:
            raise SchemaError(source, f"{at}.iterations", f"is {t.iterations}: epoch {t.epoch}'s runs up to here "
                              f"take {used:,} samples (iterations x each phase's global batch) but an epoch has "
                              f"{N:,} (inputs.training.samples_per_epoch)", FIX)
    _check_epoch_end(source, len(traj) - 1, plan, used, step)
    last = traj[-1].epoch
    if last + 1 != E:
        raise SchemaError(source, "inputs.training.epochs", f"is {E} but the trajectory covers {last + 1} epochs "
                          f"(0..{last}): a run trains inputs.training.epochs epochs, and the trajectory predicts "
                          f"each of them", FIX)


def _check_point(source: str, at: str, t: "TrajectoryPoint", plan: "Plan") -> None:
    """One run's own fields against its phase: the index, the frozen count, fills only where it caches."""
    phases = plan.phases
    if t.phase >= len(phases):
        raise SchemaError(source, f"{at}.phase", f"{t.phase} but the plan has {len(phases)} phases", FIX)
    ph = phases[t.phase]
    if ph.frozen_blocks != t.frozen_blocks:
        raise SchemaError(source, f"{at}.frozen_blocks", f"is {t.frozen_blocks} but phase {t.phase} has "
                          f"{ph.frozen_blocks}", FIX)
    if t.fill_iterations > t.iterations:
        raise SchemaError(source, f"{at}.fill_iterations", f"{t.fill_iterations} exceeds the run's {t.iterations} "
                          f"iterations", FIX)
    if t.fill_iterations and not ph.cache:
        raise SchemaError(source, f"{at}.fill_iterations", f"is {t.fill_iterations} but phase {t.phase} does not use "
                          f"the AutoCache (phases[{t.phase}].cache is false): only a caching phase fills it", FIX)


def _freeze_step_at(plan: "Plan", epoch: int, step: int) -> tuple[int, str]:
    """(T, how it was found): the freeze step in force at this epoch and optimizer step (as a run counts it)."""
    every = plan.inputs.freeze.every
    if every == "epoch":
        return epoch, f"epoch {epoch}"
    return step // int(every), f"step {step} // {every} (inputs.freeze.every)"


def _check_freeze_step(source: str, at: str, t: "TrajectoryPoint", plan: "Plan") -> None:
    """A run's frozen count is the freeze steps' at its first step (what a run following the plan freezes)."""
    T, how = _freeze_step_at(plan, t.epoch, t.step)
    want = plan.frozen_at(T)
    if t.frozen_blocks != want:
        last = len(plan.freeze_steps) - 1
        raise SchemaError(source, f"{at}.frozen_blocks", f"is {t.frozen_blocks} but at its first step the freeze step "
                          f"is T = {how} = {T}, whose frozen count is {want} (freeze_steps[{min(T, last)}])", FIX)


def _check_epoch_end(source: str, j: int, plan: "Plan", used: int, step: int) -> None:
    """trajectory[j] ends its epoch having used ``used`` samples: less than a whole step of the phase in force at
    ``step`` may be left (the epoch ends when the next step does not fit)."""
    t, N = plan.trajectory[j], plan.inputs.training.samples_per_epoch
    T, _ = _freeze_step_at(plan, t.epoch, step)
    B = plan.phase_for(plan.frozen_at(T)).global_batch
    if N - used >= B:
        raise SchemaError(source, f"trajectory[{j}].iterations", f"is {t.iterations}: epoch {t.epoch}'s runs take "
                          f"{used:,} of its {N:,} samples (inputs.training.samples_per_epoch), leaving {N - used:,}: "
                          f"room for another step of {B:,}", FIX)


def check_totals(source: str, plan: "Plan") -> None:
    """The totals the report prints are the trajectory's and the baseline's."""
    t, phases = plan.totals, plan.phases
    seconds = sum(p.seconds for p in plan.trajectory)
    fill = sum(p.fill_iterations * phases[p.phase].predicted.fill_extra_s for p in plan.trajectory)
    for key, have, want, what in (
            ("seconds", t.seconds, seconds, "the trajectory's seconds add up to {}"),
            ("fill_seconds", t.fill_seconds, fill, "the trajectory's fill iterations add {} (fill_iterations x "
                                                   "max(fill_iteration_s - iteration_s, 0) of their phase)"),
            ("baseline_seconds", t.baseline_seconds, plan.baseline.seconds, "baseline.seconds is {}")):
        if not math.isclose(have, want, rel_tol=1e-6, abs_tol=1e-9):
            raise SchemaError(source, f"totals.{key}", f"is {have:.6g} but {what.format(f'{want:.6g}')}", FIX)


# ---- one phase ----------------------------------------------------------------------------------------------
def check_phase(source: str, at: str, ph: "Phase", training: "TrainingConfig", cluster: "Cluster") -> None:
    """One phase (``at``: ``phases[i]`` or ``baseline.phase``): its records, batch split, memory and schedule."""
    check_records(source, at, ph)
    check_batch_split(source, at, ph, training)
    check_memory(source, at, ph, cluster)
    check_phase_schedule(source, at, ph)


def check_records(source: str, at: str, ph: "Phase") -> None:
    """The per-position peaks and the timeline's events fit the phase's K positions and K·V stages."""
    K, S = ph.K, ph.K * ph.V
    peaks = ph.predicted.rank_peak_memory_bytes
    if peaks and len(peaks) != K:
        raise SchemaError(source, f"{at}.predicted.rank_peak_memory_bytes", f"has {len(peaks)} entries for K={K} "
                          f"pipeline positions (one per device)", FIX)
    for k, e in enumerate(ph.timeline):
        if e.rank >= K:
            raise SchemaError(source, f"{at}.timeline[{k}].rank", f"is {e.rank} but the phase has K={K} pipeline "
                              f"positions (0..{K - 1})", FIX)
        if e.stage >= S:
            raise SchemaError(source, f"{at}.timeline[{k}].stage", f"is {e.stage} but the phase has K*V={S} stages "
                              f"(0..{S - 1})", FIX)
        if e.end < e.start:
            raise SchemaError(source, f"{at}.timeline[{k}].end", f"is {e.end} s, before the event's start "
                              f"{e.start} s", FIX)


@lru_cache(maxsize=256)
def _generated_text(name: str, K: int, M: int, V: int, slices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The generator's action lists for these sizes as plan text, and its stage placement."""
    sched = terapipe(K, M, slices) if slices else build_schedule(name, K, M, V)
    if slices:
        check_schedule(sched)
    return tuple(" ".join(map(str, acts)) for acts in sched.actions), sched.stage_to_rank


@lru_cache(maxsize=256)
def _action_problem(actions: tuple[str, ...], S: int) -> str | None:
    """Why these per-position lists are not lists of actions of S stages, each stage on one position; None if
    they are."""
    home: dict[int, tuple[int, str]] = {}
    for pos, text in enumerate(actions):
        for tok in text.split():
            try:
                a = parse_action(tok)
            except ScheduleError as e:
                return f"position {pos}: {e}"
            if a.stage >= S:
                return f"position {pos}: action {tok!r} names stage {a.stage} but the phase has K*V = {S} stages " \
                       f"(0..{S - 1})"
            p0, t0 = home.setdefault(a.stage, (pos, tok))
            if p0 != pos:
                return f"position {pos}: stage {a.stage} has actions on position {p0} ({t0!r}) and on position " \
                       f"{pos} ({tok!r}); a stage lives on one position"
    return None


def check_actions(source: str, at: str, ph: "Phase") -> None:
    """Phase ``at``'s stored action lists are actions (``schedule.parse_action``) of its K·V stages, each stage
    on one position -- what ``Phase.stage_to_rank`` reads. SchemaError names ``{at}.actions``."""
    if not ph.actions:
        return
    try:
        if tuple(ph.actions) == _generated_text(ph.schedule, ph.K, ph.M, ph.V, len(ph.slices))[0]:
            return  # the generator's own text
    except ScheduleError:
        pass  # sizes the generator refuses: check_phase_schedule says why
    why = _action_problem(tuple(ph.actions), ph.K * ph.V)
    if why is not None:
        raise SchemaError(source, f"{at}.actions", why, FIX)


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


def check_phase_schedule(source: str, at: str, ph: "Phase") -> None:
    """Phase ``at``'s schedule runs as its plan writes it; SchemaError names ``{at}.actions`` (or ``.M``)."""
    check_actions(source, at, ph)
    why = _schedule_problem(ph.schedule, ph.K, ph.M, ph.V, ph.stage_to_rank(), tuple(ph.actions), len(ph.slices))
    if why is not None:
        field = f"{at}.actions" if ph.actions else f"{at}.M"
        raise SchemaError(source, field, f"schedule {ph.schedule!r} with K={ph.K}, V={ph.V}, M={ph.M} cannot run: "
                          f"{why}", FIX)


def check_batch_split(source: str, at: str, ph: "Phase", training: "TrainingConfig") -> None:
    """Phase ``at``'s D·M micro-batches of b samples are the plan's batch (global, or per pipeline)."""
    B = training.batch
    if training.batch_policy == "constant-global":
        if ph.D * ph.M * ph.micro_batch_size != B:
            raise SchemaError(source, f"{at}.M", f"D*M*b = {ph.D}*{ph.M}*{ph.micro_batch_size} = "
                              f"{ph.D * ph.M * ph.micro_batch_size} samples per step but the plan's global batch is "
                              f"{B} (inputs.training.batch): M must split the batch into equal micro-batches", FIX)
    elif ph.M * ph.micro_batch_size != B:
        raise SchemaError(source, f"{at}.M", f"M*b = {ph.M}*{ph.micro_batch_size} = "
                          f"{ph.M * ph.micro_batch_size} samples per pipeline but the plan's per-pipeline batch is "
                          f"{B} (inputs.training.batch)", FIX)


def check_memory(source: str, at: str, ph: "Phase", cluster: "Cluster") -> None:
    """Phase ``at``'s predicted peaks (per stage, per rank) within one device of the plan's cluster."""
    cap = cluster.gpu_memory_bytes
    pred = ph.predicted
    for key, values in (("stage_peak_memory_bytes", pred.stage_peak_memory_bytes),
                        ("rank_peak_memory_bytes", pred.rank_peak_memory_bytes)):
        for s, v in enumerate(values):
            if v > cap:
                raise SchemaError(source, f"{at}.predicted.{key}[{s}]", f"{v:,} bytes exceeds one device's "
                                  f"{cap:,} bytes (inputs.cluster.gpu_memory_bytes): the plan predicts a phase that "
                                  f"does not fit", FIX)
