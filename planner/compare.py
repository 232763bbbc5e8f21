"""Prediction against reality: read a run log (run.jsonl) and set it beside the plan, phase by phase."""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from .errors import PtplanError
from .plan import Phase, Plan
from .runlog import RunLog, Step, read_run_log

__all__ = ["Comparison", "PhaseComparison", "compare", "fill_fractions", "format_comparison", "match_run",
           "read_run_log"]


INPUT_NOTE_SHARE = 0.05
"""A phase's row notes its input time (``measured_data_s``) when it is at least this share of the measured step."""
MEMORY_NOTE_SHARE = 0.05
"""A pipeline position measured above its predicted peak by more than this share is noted (``format_comparison``)."""


@dataclass(frozen=True, kw_only=True)
class PhaseComparison:
    phase: int
    frozen_blocks: int
    K: int
    D: int
    M: int
    steps: int
    """Steps timed (the first ``warmup`` steps of each visit and the memory-sampled steps left out)."""
    predicted_iteration_s: float
    measured_iteration_s: float
    """Median measured step time."""
    iteration_error: float
    """(predicted − measured) / measured."""
    predicted_samples_per_s: float
    measured_samples_per_s: float
    predicted_peak_memory_bytes: int
    """The fullest stage's predicted peak."""
    measured_peak_memory_bytes: int | None
    """The fullest rank's measured peak (``executor/runtime/memory.py``), None when not measured."""
    memory_error: float | None
    predicted_stage_memory_bytes: tuple[int, ...] = ()
    """Per device (pipeline position), its predicted peak (``Predicted.device_peak_memory_bytes``)."""
    measured_stage_memory_bytes: tuple[int, ...] = ()
    """Per pipeline position, the largest of its data-parallel replicas (empty when not measured per rank)."""
    measured_allreduce_s: float | None = None
    """Median seconds rank 0 spent in the data-parallel gradient all-reduce."""
    predicted_allreduce_s: float = 0.0
    """Exposed all-reduce the simulator predicts."""
    timed_with_memory_hooks: bool = False
    """The phase had no other step after the warm-up, so its memory-sampled step was timed (slower)."""
    kind: str = "steady"
    """``steady``: steps that read every row of the frozen prefix from the AutoCache (or a phase without it),
    compared with ``predicted.iteration_s``; ``fill``: steps that computed rows of it (a cache fill or refresh,
    or rows the budget could not keep), compared with ``predicted.fill_iteration_s`` weighted by the share of rows
    computed (``fill_fraction``)."""
    fill_fraction: float = 0.0
    """Mean share of the steps' prefix rows that were computed (missed or refreshed) rather than read."""
    measured_data_s: float | None = None
    """Median seconds rank 0 spent producing its batch (``data_seconds``: the input pipeline, inside the measured
    step and in no prediction); None for logs that do not record it."""
    measured_cache_s: float | None = None
    """Median seconds rank 0 spent serving the frozen prefix's output from the AutoCache (``cache_seconds``); None
    where the phase does not cache or the log does not record it."""
    predicted_cache_s: float = 0.0
    """The plan's seconds for that (``cache_setup_s``, or for fill rows ``fill_cache_setup_s`` weighted by the share
    of rows computed, as the step's prediction is)."""

    @property
    def stage_memory_errors(self) -> tuple[float, ...]:
        """Per pipeline position, (predicted - measured) / measured of its peak; empty unless both are per position.
        The phase's ``memory_error`` compares the fullest device of each side, which can hide a position the plan
        under-predicts behind another that holds more (a ZB or 2BW last stage behind stage 0)."""
        pred, meas = self.predicted_stage_memory_bytes, self.measured_stage_memory_bytes
        if len(pred) != len(meas) or not all(meas):
            return ()
        return tuple((p - m) / m for p, m in zip(pred, meas))

    def under_predicted_positions(self, share: float) -> list[tuple[int, int, int, float]]:
        """(position, measured, predicted bytes, error) of each position measured above its prediction by more than
        ``share`` of the measurement."""
        return [(s, self.measured_stage_memory_bytes[s], self.predicted_stage_memory_bytes[s], e)
                for s, e in enumerate(self.stage_memory_errors) if e < -share]


@dataclass(frozen=True, kw_only=True)
class Comparison:
    phases: tuple[PhaseComparison, ...]
    transitions: tuple[dict[str, Any], ...]
    median_abs_iteration_error: float
    median_abs_memory_error: float | None
    warnings: tuple[str, ...] = ()
    """What the reader left out of the log (e.g. a torn last line)."""
    evals: tuple[dict[str, Any], ...] = ()
    """The run's held-out evaluations (``eval`` records: epoch, step, phase, loss, accuracy or perplexity,
    samples, seconds), in order; empty when the run had no ``--eval-data``."""
    resumes: tuple[dict[str, Any], ...] = ()
    """Where the run resumed from a checkpoint (``RunLog.resumes``: step, line, ``replaced_steps``): each step
    is counted once, from the resumed run, and its first step after a resume is a warm-up step."""
    memberships: tuple[dict[str, Any], ...] = ()
    """Where an elastic job's world changed (``RunLog.memberships``: step, line, from, to): the steps after one
    ran the re-planned plan; only the steps of the plan compared are in ``phases``."""
    other_plan_steps: int = 0
    """Steps the run took under another plan of its membership changes (left out; compare them with that plan)."""
    mismatches: tuple[str, ...] = ()
    """Where the run did not run what the plan priced (``model_mismatches``: the parameters' or the AutoCache rows'
    dtype), said with the numbers: every row's error then includes it."""
    fills: tuple[PhaseComparison, ...] = ()
    """Per phase, its AutoCache fill/refresh steps (``kind == "fill"``), apart from ``phases`` (steady steps); a
    phase's memory is compared on its steady row, on its fill row only when it has no steady step."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


RAN = ("frozen_blocks", "K", "D", "tp", "M", "b", "schedule")
"""What a run log records of how a phase ran: its header's ``phases`` hold all but tp, a membership's sides all (the
run's ``layout``); each is compared with the plan's phase where the record has it, the first four always (logs from
before b and schedule were recorded). V and the partition are not recorded; the AutoCache's phases are in the
``cache_setup`` record, a step's global batch in its ``samples``."""
_ALWAYS = ("frozen_blocks", "K", "D", "M")


def phase_as_run(p: Phase) -> dict[str, Any]:
    """A plan phase as a run log records it (``RAN``)."""
    return dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, tp=p.tp, M=p.M, b=p.micro_batch_size, schedule=p.schedule)


def _values(f: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``k=v, ...`` of ``keys`` in ``f``, with the global batch (D x M x b) after b or M when all three are known."""
    out = ", ".join(f"{k}={f.get(k)!r}" for k in keys)
    sizes = [v for v in (f.get("D"), f.get("M"), f.get("b")) if isinstance(v, int) and not isinstance(v, bool)]
    if ("b" in keys or "M" in keys) and len(sizes) == 3:
        out += f" (global batch {sizes[0] * sizes[1] * sizes[2]})"
    return out


def _differ(got: Mapping[str, Any], want: Mapping[str, Any], what: str, always: Sequence[str] = _ALWAYS
            ) -> str | None:
    """Where a recorded phase (``got``) is not the plan's (``want``, ``what``): "ran with k=v where {what} has k=v" over
    the keys that differ (``always`` and those ``got`` records), None where they agree."""
    diff = [k for k in want if (k in always or k in got) and got.get(k) != want[k]]
    return f"ran with {_values(got, diff)} where {what} has {_values(want, diff)}" if diff else None


def _phases_differ(world: Any, phases: Any, plan: Plan) -> str | None:
    """Where a run's recorded world and phases (its header's, or a membership's side) are not ``plan``'s: words with
    the numbers (the world size, the phase count, the first phase that differs); None where they agree."""
    out = [] if world == plan.world_size else [f"the run had {world} processes and this plan has {plan.world_size}"]
    got = list(phases) if isinstance(phases, (list, tuple)) else []
    if len(got) != len(plan.phases):
        out.append(f"the run's plan has {len(got)} phases and this plan {len(plan.phases)}")
    for i, (g, p) in enumerate(zip(got, plan.phases)):
        why = _differ(g, phase_as_run(p), f"this plan's phase {i}") if isinstance(g, dict) else \
            f"is recorded as {g!r}"
        if why:
            out.append(f"phase {i} {why}")
            break
    return "; ".join(out) or None


def _fix(log: RunLog) -> str:
    """The fix every refusal ends with (naming the plan file the run was given, where its header records it)."""
    ran = log.header.plan if log.header is not None else None
    return "; compare the run with the plan it ran" + (f" ({ran}, as its header says)" if ran else "")


Segments = Sequence[tuple[int, bool]]
"""(first step, whether the plan compared ran from there), for the run's start and each membership change."""


def _owner(segments: Segments, step: int) -> bool:
    """Whether the plan compared ran ``step`` (the last segment that starts at or before it)."""
    return [ran for at, ran in segments if at <= step][-1]


def match_run(plan: Plan, log: RunLog) -> list[tuple[int, bool]]:
    """The one place a run log is matched to a plan (``compare``, so ``ptplan compare`` and ``ptplan show --run``):
    everything the log records of what ran is compared with the plan, and PtplanError names the first that differs,
    with the numbers and the fix. Returns the ``Segments``: an elastic job's steps under another plan are left out,
    not refused, but one segment at least must be this plan's.

    Compared: the profile fingerprint; the world size and every phase's ``RAN`` fields, of the header and of each
    membership's new side; every step of this plan's segments (``_match_steps``); every transition's, evaluation's
    and resume's phase indices and a transition's recorded shapes (``_match_phase_refs``); and, in a run without
    membership changes, the AutoCache's phases and frozen-layer counts (``_match_cache``)."""
    h, fix = log.header, _fix(log)
    fp, want = (h.plan_fingerprint if h is not None else None), plan.inputs.profile.fingerprint
    if fp and want and fp != want:
        raise PtplanError(f"the run log {log.path} was made with a plan for profile fingerprint {fp}, but this "
                          f"plan's is {want}{fix}")
    start = None if h is None else _phases_differ(h.world_size, h.phases, plan)
    segments = [(-1, start is None)] + [(m["step"], _phases_differ(m["to"].get("world_size"), m["to"].get("phases"),
                                                                   plan) is None) for m in log.memberships]
    if not any(ran for _, ran in segments):
        also = (f" (nor did the plan of any of its {len(log.memberships)} membership change(s))"
                if log.memberships else "")
        raise PtplanError(f"the run log {log.path} is not a run of this plan: {start}{also}{fix}")
    _match_steps(plan, log, segments, fix)
    _match_phase_refs(plan, log, segments, fix)
    _match_cache(plan, log, fix)
    return segments


def _match_steps(plan: Plan, log: RunLog, segments: Segments, fix: str) -> None:
    """Every step of this plan's segments: its phase index within the plan, and its frozen_blocks, K, D and
    ``samples`` (the global batch, D x M x b) those of that phase."""
    lines = {r.fields["step"]: r.line for r in log.records if r.type == "step"}
    for s in log.steps:
        if not _owner(segments, s.step):
            continue
        where = f"run log {log.path} step {s.step} (line {lines.get(s.step)})"
        if not 0 <= s.phase < len(plan.phases):
            raise PtplanError(f"{where} refers to phase {s.phase} but the plan has {len(plan.phases)} phases{fix}")
        p = plan.phases[s.phase]
        got = dict(frozen_blocks=s.frozen_blocks, K=s.K, D=s.D, samples=s.samples)
        ours = dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, samples=p.global_batch)
        diff = [k for k in ours if got[k] != ours[k]]
        if diff:
            batch = f" (D={p.D} x M={p.M} x b={p.micro_batch_size})" if "samples" in diff else ""
            raise PtplanError(f"{where} ran phase {s.phase} with {_values(got, diff)} but the plan's phase {s.phase} "
                              f"has {_values(ours, diff)}{batch}{fix}")


def _match_phase_refs(plan: Plan, log: RunLog, segments: Segments, fix: str) -> None:
    """Every transition, evaluation and resume of this plan's segments: the phases it names are the plan's, and a
    transition's ``from``/``to`` (frozen_blocks, K, D) are those phases'."""
    for r in log.records:
        f = r.fields
        if r.type not in ("transition", "eval", "resume") or not _owner(segments, f["step"]):
            continue
        where = f"run log {log.path} line {r.line} ({r.type} at step {f['step']})"
        for key, side in (("phase", ""), ("from_phase", "from"), ("to_phase", "to")):
            ph = f.get(key)
            if ph is None:
                continue
            if not 0 <= ph < len(plan.phases):
                raise PtplanError(f"{where} refers to phase {ph} but the plan has {len(plan.phases)} phases{fix}")
            shape = f.get(side) if side else None
            why = _differ(shape, phase_as_run(plan.phases[ph]), f"the plan's phase {ph}", ()) \
                if isinstance(shape, dict) else None
            if why:
                raise PtplanError(f"{where}: its {side} phase {ph} {why}{fix}")


def _match_cache(plan: Plan, log: RunLog, fix: str) -> None:
    """The AutoCache's phases and frozen-layer counts as the run set it up (``cache_setup``) against the plan's
    caching phases (``Phase.cache`` with a frozen prefix), in a run without membership changes (whose set-ups are
    each its own plan's)."""
    if log.memberships:
        return
    want = plan.caching_phases()
    layers = sorted({plan.phases[i].frozen_layers for i in want})
    for r in log.records:
        if r.type == "cache_setup" and (r.fields["phases"] != want or r.fields["frozen_layers"] != layers):
            raise PtplanError(f"run log {log.path} line {r.line}: the run's AutoCache cached the frozen prefix in "
                              f"phases {r.fields['phases']} (frozen layers {r.fields['frozen_layers']}), but this plan "
                              f"caches it in phases {want} (frozen layers {layers}){fix}")


def _stage_memory(phase, rec: Step) -> tuple[int, ...]:
    rows = (rec.memory or {}).get("per_rank")
    if not isinstance(rows, list):
        return ()
    out = []
    for s in range(phase.K):
        vals = [int(rows[row[s]]["total"]) for row in phase.ranks if row[s] < len(rows)]
        if not vals:
            return ()
        out.append(max(vals))
    return tuple(out)


def fill_fractions(log: RunLog) -> dict[int, float]:
    """Per step, the share of its frozen-prefix rows the AutoCache computed (missed or refreshed) instead of read:
    exact from the step's ``cache_hits``/``cache_refreshes``/``cache_misses`` (rank 0's rows), else (older logs,
    or rank 0 served none) the epoch's share from its ``cache`` record (summed over ranks); steps of an epoch
    without one are absent (no cache, or a phase that does not cache)."""
    epoch: dict[int, float] = {}
    for r in log.records:
        f = r.fields
        if r.type == "cache" and f["phase_caches"]:
            rows = f["hits"] + f["refreshes"] + f["misses"]
            if rows:
                epoch[f["epoch"]] = (f["refreshes"] + f["misses"]) / rows
    out = {}
    for s in log.steps:
        frac = s.fill_fraction
        frac = epoch.get(s.epoch) if frac is None else frac
        if frac is not None:
            out[s.step] = frac
    return out


def _params_ratio(plan: Plan, r: Step) -> tuple[float, int, int, int] | None:
    """(measured / planned, measured, planned, phase) parameter bytes of the step's first pipeline, from its per-rank
    ``params`` against the plan's per-stage ``weights`` (plain stages only: K entries, no tp or FSDP)."""
    p = plan.phases[r.phase]
    rows = (r.memory or {}).get("per_rank")
    mem = p.predicted.stage_memory
    if not isinstance(rows, list) or len(mem) != p.K or p.tp != 1 or p.fsdp or not p.ranks:
        return None
    got = [rows[rank].get("params") for rank in p.ranks[0] if rank < len(rows)]
    want = sum(int(m.weights) for m in mem)
    if len(got) != p.K or not all(isinstance(g, int) for g in got) or want <= 0:
        return None
    return sum(got) / want, sum(got), want, r.phase


def model_mismatches(plan: Plan, log: RunLog, segments: Segments | None = None) -> tuple[str, ...]:
    """The run's model against the plan's: the AutoCache rows' dtype (``cache_setup``) against the profile's, a run
    without the AutoCache in phases the plan caches (``--cache off``), and the measured parameter bytes against the
    plan's weights (a float32 run of a bfloat16 profile's plan holds 2x), from a step this plan ran (``segments``,
    ``match_run``'s: around a membership change another plan's step has other stages; default ``match_run``)."""
    segments = match_run(plan, log) if segments is None else segments
    want = plan.inputs.profile.dtype
    out = []
    setup = next((r.fields for r in log.records if r.type == "cache_setup"), None)
    if setup and want and setup["dtype"] != want:
        out.append(f"the AutoCache stored {setup['dtype']} rows ({setup['need_bytes']:,} bytes per node) where the "
                   f"plan priced {want}, its profile's dtype ({setup['plan_bytes_per_node']:,} bytes with the frozen "
                   f"weights; the run's same sum: {setup.get('host_bytes_per_node') or 'not logged'})")
    caching = sorted({s.phase for s in log.steps if 0 <= s.phase < len(plan.phases)
                      and plan.phases[s.phase].caches_prefix})
    served = setup or any(r.type == "cache" for r in log.records) or any(s.cache_hits is not None for s in log.steps)
    if caching and not served and not log.memberships:
        out.append(f"the plan caches the frozen prefix in phases {caching}, which the run reached, but the run set up "
                   f"no AutoCache (no cache_setup record: `ptplan run --cache off`), so their steps computed the "
                   f"prefix the plan prices as read from the cache; run with --cache auto (the default) to compare "
                   f"them")
    sampled = next((r for r in log.steps if r.memory and _owner(segments, r.step) and 0 <= r.phase < len(plan.phases)),
                   None)
    got = _params_ratio(plan, sampled) if sampled is not None else None
    if got is not None and not 0.8 <= got[0] <= 1.25:
        out.append(f"the run's parameters take {got[0]:.2f}x the plan's weights (phase {got[3]}: "
                   f"{got[1]:,} vs {got[2]:,} bytes): the run's model is not in the profile's dtype {want} (`ptplan "
                   f"run --precision fp32` trains float32 weights, and --precision bf16 autocasts the forward passes "
                   f"but keeps float32 weights, gradients and optimizer state), so memory and time differ from the "
                   f"plan by that too; run with --precision plan (the default) to train in the profile's dtype")
    return tuple(out)


def _predicted_s(phase: Any, frac: float) -> float:
    """The plan's time for a step that computed ``frac`` of its prefix rows: ``iteration_s`` plus that share of
    the fill's extra (``fill_iteration_s``: every row computed); ``iteration_s`` when the plan prices no fill."""
    pr = phase.predicted
    return pr.iteration_s + frac * (pr.fill_iteration_s - pr.iteration_s) if frac and pr.fill_iteration_s else \
        pr.iteration_s


_Key = tuple[int, str]  # (phase, "steady" | "fill")


def _bucket(plan: Plan, log: RunLog, warmup: int, segments: Segments
            ) -> tuple[dict[_Key, list[Step]], dict[_Key, list[Step]], dict[int, list[Step]], int]:
    """The steps compared, by (phase, kind): timed (after the warm-up of each visit, not memory-sampled) and
    hooked (memory-sampled, after the warm-up); every memory-sampled step by phase; steps of another plan
    (``segments``: ``match_run``'s, which checked every step of this plan's)."""
    timed: dict[_Key, list[Step]] = {}
    hooked: dict[_Key, list[Step]] = {}
    sampled: dict[int, list[Step]] = {}
    seen_in_visit: dict[int, int] = {}
    last_phase = None
    resumed_at = {r["step"] for r in log.resumes}  # a resumed run rebuilds its stage: a new visit
    # an evaluation, a checkpoint or an export drains the stage before step ``step`` (``ElasticRuntime.drain``:
    # 2BW's outstanding updates run, tp/FSDP shards are gathered and rebuilt by that step): a new visit too
    resumed_at |= {r.fields["step"] for r in log.records if r.type in ("eval", "checkpoint", "export")}
    fills = fill_fractions(log)
    other = 0
    for r in log.steps:
        if not _owner(segments, r.step):
            other += 1  # a step of another plan of the run's membership changes
            continue
        ph = r.phase
        p = plan.phases[ph]
        if r.peak_memory_bytes is not None:
            sampled.setdefault(ph, []).append(r)
        if ph != last_phase or r.step in resumed_at:
            seen_in_visit[ph] = 0
            last_phase = ph
        seen_in_visit[ph] += 1
        if seen_in_visit[ph] <= warmup:
            continue
        kind = "fill" if p.cache and fills.get(r.step, 0.0) > 0 else "steady"
        (hooked if r.memory_sampled else timed).setdefault((ph, kind), []).append(r)
    return timed, hooked, sampled, other


def _row(plan: Plan, key: _Key, recs: list[Step], mem_recs: list[Step], fills: dict[int, float],
         hooks: bool) -> PhaseComparison:
    ph, kind = key
    p = plan.phases[ph]
    meas = statistics.median(r.seconds for r in recs)
    fracs = [fills.get(r.step, 0.0) if kind == "fill" else 0.0 for r in recs]
    pred = statistics.fmean(_predicted_s(p, f) for f in fracs)
    samples = statistics.median(float(r.samples) for r in recs)
    ar = [r.allreduce_seconds for r in recs if r.allreduce_seconds is not None]
    data = [r.data_seconds for r in recs if r.data_seconds is not None]
    cache = [r.cache_seconds for r in recs if r.cache_seconds is not None]
    pr = p.predicted
    pred_cache = statistics.fmean(pr.cache_setup_s + f * (pr.fill_cache_setup_s - pr.cache_setup_s) for f in fracs)
    pred_mem = p.predicted.peak_memory_bytes
    meas_mem = max(int(r.peak_memory_bytes or 0) for r in mem_recs) if mem_recs else None
    stage_mem: tuple[int, ...] = ()
    for r in mem_recs:
        got = _stage_memory(p, r)
        stage_mem = tuple(max(a, b) for a, b in zip(stage_mem, got)) if stage_mem and got else (got or stage_mem)
    return PhaseComparison(
        phase=ph, frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M, steps=len(recs),
        predicted_iteration_s=pred, measured_iteration_s=meas,
        iteration_error=(pred - meas) / meas if meas > 0 else float("nan"),
        predicted_samples_per_s=samples / pred if kind == "fill" and pred > 0 else p.predicted.samples_per_s,
        measured_samples_per_s=samples / meas if meas > 0 else 0.0,
        predicted_peak_memory_bytes=pred_mem, measured_peak_memory_bytes=meas_mem,
        memory_error=(pred_mem - meas_mem) / meas_mem if meas_mem else None,
        predicted_stage_memory_bytes=tuple(int(x) for x in p.predicted.device_peak_memory_bytes),
        measured_stage_memory_bytes=stage_mem,
        measured_allreduce_s=statistics.median(ar) if ar else None,
        predicted_allreduce_s=p.predicted.allreduce_s, timed_with_memory_hooks=hooks, kind=kind,
        fill_fraction=statistics.fmean(fracs), measured_data_s=statistics.median(data) if data else None,
        measured_cache_s=statistics.median(cache) if cache else None, predicted_cache_s=pred_cache)


def compare(plan: Plan, log: RunLog, *, warmup: int = 1) -> Comparison:
    """Median measured step time and the sampled peak memory per phase, against the plan's prediction.

    Timing: the median over the phase's steps, leaving out the first ``warmup`` steps of each visit
    to the phase (set-up: receive buffers, shape inference; a resume from a checkpoint, and the step after an
    evaluation, checkpoint or export (a drained stage), start a new visit; a transition's first step is a visit's
    first) and the steps that measured memory (their hooks slow them
    down) -- unless a phase has no other step, then its memory-sampled steps are timed and the row says so.
    Steps that filled or refreshed the AutoCache (``fill_fractions``) are compared apart (``Comparison.fills``)
    with the plan's fill price. Memory: the largest sampled ``peak_memory_bytes`` of the phase.
    """
    if warmup < 0:
        raise PtplanError(f"warmup must be 0 or more, got {warmup}")
    segments = match_run(plan, log)
    timed, hooked, sampled, other = _bucket(plan, log, warmup, segments)
    fills = fill_fractions(log)
    rows: dict[str, list[PhaseComparison]] = {"steady": [], "fill": []}
    for key in sorted(set(timed) | set(hooked)):
        ph, kind = key
        has_steady = kind == "fill" and ((ph, "steady") in timed or (ph, "steady") in hooked)
        recs = timed.get(key) or hooked[key]  # only memory-sampled steps after the warm-up: time them anyway
        rows[kind].append(_row(plan, key, recs, [] if has_steady else sampled.get(ph, []), fills,
                               key not in timed))
    every = rows["steady"] + rows["fill"]
    if not every:
        raise PtplanError(f"no phase has a step after leaving out the first {warmup} step(s) of each visit; "
                          f"run more steps per phase (e.g. --steps-per-epoch 6)")
    mem_errs = [abs(r.memory_error) for r in every if r.memory_error is not None]
    return Comparison(
        phases=tuple(rows["steady"]), fills=tuple(rows["fill"]),
        transitions=tuple(r.to_json() for r in log.transitions),
        warnings=log.warnings, evals=tuple(r.fields for r in log.records if r.type == "eval"), resumes=log.resumes,
        memberships=log.memberships, other_plan_steps=other, mismatches=model_mismatches(plan, log, segments),
        median_abs_iteration_error=statistics.median(abs(r.iteration_error) for r in every),
        median_abs_memory_error=statistics.median(mem_errs) if mem_errs else None)


def _members(side: dict[str, Any]) -> str:
    """One side of a membership change: world size, plan id and file, K x D per phase."""
    layout = " ".join(f"{p.get('K')}x{p.get('D')}" for p in side.get("phases") or () if isinstance(p, dict))
    n = side.get("world_size")
    return (f"{n} process{'' if n == 1 else 'es'}, plan {side.get('plan_id')}"
            + (f" ({side['plan']})" if side.get("plan") else "") + (f" [K x D per phase: {layout}]" if layout else ""))


def format_comparison(c: Comparison) -> str:
    hdr = (f"{'phase':>5} {'frozen':>6} {'K':>3} {'D':>3} {'M':>3} {'steps':>5} {'pred s/it':>10} {'meas s/it':>10} "
           f"{'it err':>7} {'pred smp/s':>10} {'meas smp/s':>10} {'pred MiB':>9} {'meas MiB':>9} {'mem err':>7}")
    lines = [hdr, "-" * len(hdr)]
    for r in sorted(c.phases + c.fills, key=lambda r: (r.phase, r.kind != "steady")):
        mm = f"{r.measured_peak_memory_bytes / 2**20:>9.1f}" if r.measured_peak_memory_bytes else f"{'-':>9}"
        me = f"{r.memory_error:>+7.1%}" if r.memory_error is not None else f"{'-':>7}"
        pm = f"{r.predicted_peak_memory_bytes / 2**20:>9.1f}" if r.kind == "steady" or mm.strip() != "-" else \
            f"{'-':>9}"
        notes = (["timed on the memory-sampled step"] if r.timed_with_memory_hooks else []) + (
            [f"input: {r.measured_data_s * 1e3:.1f} ms of the step made the batch, which no plan prices"]
            if r.measured_data_s is not None and r.measured_data_s >= INPUT_NOTE_SHARE * r.measured_iteration_s
            else []) + (
            [f"AutoCache: {r.measured_cache_s * 1e3:.1f} ms serving the prefix, {r.predicted_cache_s * 1e3:.1f} ms "
             f"predicted"] if r.measured_cache_s is not None else []) + (
            [f"cache fill: {r.fill_fraction:.0%} of the prefix rows computed, priced from the plan's fill step"]
            if r.kind == "fill" else [])
        lines.append(f"{r.phase if r.kind == 'steady' else f'{r.phase}f':>5} {r.frozen_blocks:>6} {r.K:>3} {r.D:>3} "
                     f"{r.M:>3} {r.steps:>5} "
                     f"{r.predicted_iteration_s:>10.4f} {r.measured_iteration_s:>10.4f} {r.iteration_error:>+7.1%} "
                     f"{r.predicted_samples_per_s:>10.1f} {r.measured_samples_per_s:>10.1f} "
                     f"{pm} {mm} {me}" + (f"  ({'; '.join(notes)})" if notes else ""))
    if c.fills:
        lines.append("(Nf: phase N's AutoCache fill steps, which computed the frozen prefix and wrote its rows, "
                     "compared with the plan's fill step apart from its steady steps; err: (predicted - measured) / "
                     "measured)")
    for r in sorted(c.phases + c.fills, key=lambda r: (r.phase, r.kind != "steady")):
        for pos, got, want, err in r.under_predicted_positions(MEMORY_NOTE_SHARE):
            lines.append(f"note: phase {r.phase if r.kind == 'steady' else f'{r.phase}f'}, pipeline position {pos}: "
                         f"measured {got / 2**20:.2f} MiB against {want / 2**20:.2f} MiB predicted ({err:+.1%}); the "
                         f"mem err column compares each side's fullest device")
    lines.extend(f"note: {w}" for w in c.warnings + c.mismatches)
    lines.extend(f"note: resumed from step {r['step']} (line {r['line']}): {r['replaced_steps']} step record(s) the "
                 f"stopped run logged from there were replaced by the resumed run's (each step counted once)"
                 for r in c.resumes if r["replaced_steps"])
    for m in c.memberships:
        lines.append(f"membership changed at step {m['step']} (line {m['line']}): {_members(m['from'])} -> "
                     f"{_members(m['to'])}")
    if c.other_plan_steps:
        lines.append(f"note: {c.other_plan_steps} step(s) ran another plan of the run's membership changes and are "
                     f"left out; compare them with that plan (ptplan compare PLAN RUNLOG)")
    lines.append(f"median |error|: iteration time {c.median_abs_iteration_error:.1%}"
                 + (f", peak memory {c.median_abs_memory_error:.1%}" if c.median_abs_memory_error is not None else
                    ", peak memory not measured"))
    for e in c.evals:
        metric = (f", accuracy {e['accuracy']:.1%}" if e.get("accuracy") is not None else
                  f", perplexity {e['perplexity']:.4g}" if e.get("perplexity") is not None else "")
        lines.append(f"held-out at step {e['step']} (epoch {e['epoch']}, phase {e['phase']}): loss {e['loss']:.4f}"
                     f"{metric} on {e['samples']} samples ({e['seconds']:.2f} s)")
    for t in c.transitions:
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in (t.get("parts") or {}).items())
        lines.append(f"transition at step {t.get('step')}: {t.get('from_phase')} -> {t.get('to_phase')} in "
                     f"{float(t.get('seconds', 0)):.3f} s ({parts})")
    return "\n".join(lines)
