"""Prediction against reality: read a run log (run.jsonl) and set it beside the plan, phase by phase."""
from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from .errors import PtplanError
from .plan import Plan
from .runlog import RunLog, Step, read_run_log

__all__ = ["Comparison", "PhaseComparison", "compare", "fill_fractions", "format_comparison", "read_run_log"]


INPUT_NOTE_SHARE = 0.05
"""A phase's row notes its input time (``measured_data_s``) when it is at least this share of the measured step."""


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
    measured_stage_memory_bytes: tuple[int, ...] = ()
    """Per stage, the largest of its data-parallel replicas (empty when not measured per rank)."""
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


def _shape(phases: Any) -> list[dict[str, Any]]:
    return [{k: s.get(k) for k in ("frozen_blocks", "K", "D", "M")} for s in phases or () if isinstance(s, dict)]


def _segments(plan: Plan, log: RunLog) -> list[tuple[int, bool]]:
    """(first step, whether ``plan`` ran from there) for the run's start and each membership change."""
    ours = _shape([dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M) for p in plan.phases])
    start = log.header is None or (log.header.world_size == plan.world_size and _shape(log.header.phases) == ours)
    return [(-1, start)] + [(m["step"], m["to"].get("world_size") == plan.world_size and _shape(m["to"].get("phases"))
                             == ours) for m in log.memberships]


def _check_same_plan(plan: Plan, log: RunLog) -> None:
    """Refuse a run log written for another plan: profile fingerprint and phase shapes must agree (with the
    run's start or, after a membership change, with the plan it went on with)."""
    header = log.header
    if header is None or any(ran for at, ran in _segments(plan, log) if at >= 0):
        return
    fp, want = header.plan_fingerprint, plan.inputs.profile.fingerprint
    if fp and want and fp != want:
        raise PtplanError(f"the run log was made with a plan for profile fingerprint {fp}, but this plan's is "
                          f"{want}; compare the run with the plan it ran")
    ours = [dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M) for p in plan.phases]
    theirs = [{k: s.get(k) for k in ("frozen_blocks", "K", "D", "M")} for s in header.phases if isinstance(s, dict)]
    if theirs != ours:
        diff = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        got = theirs[diff] if diff < len(theirs) else "none"
        exp = ours[diff] if diff < len(ours) else "none"
        raise PtplanError(f"the run log's plan has {len(theirs)} phases and this plan {len(ours)}; phase {diff} "
                          f"is {got} in the run and {exp} in this plan; compare the run with the plan it ran")


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


def model_mismatches(plan: Plan, log: RunLog) -> tuple[str, ...]:
    """The run's model against the plan's: the AutoCache rows' dtype (``cache_setup``) against the profile's, and the
    measured parameter bytes against the plan's weights (a float32 run of a bfloat16 profile's plan holds 2x)."""
    want = plan.inputs.profile.dtype
    out = []
    setup = next((r.fields for r in log.records if r.type == "cache_setup"), None)
    if setup and want and setup["dtype"] != want:
        out.append(f"the AutoCache stored {setup['dtype']} rows ({setup['need_bytes']:,} bytes per node) where the "
                   f"plan priced {want}, its profile's dtype ({setup['plan_bytes_per_node']:,} bytes with the frozen "
                   f"weights; the run's same sum: {setup.get('host_bytes_per_node') or 'not logged'})")
    sampled = next((r for r in log.steps if r.memory and 0 <= r.phase < len(plan.phases)), None)
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


def _bucket(plan: Plan, log: RunLog, warmup: int
            ) -> tuple[dict[_Key, list[Step]], dict[_Key, list[Step]], dict[int, list[Step]], int]:
    """The steps compared, by (phase, kind): timed (after the warm-up of each visit, not memory-sampled) and
    hooked (memory-sampled, after the warm-up); every memory-sampled step by phase; steps of another plan."""
    timed: dict[_Key, list[Step]] = {}
    hooked: dict[_Key, list[Step]] = {}
    sampled: dict[int, list[Step]] = {}
    seen_in_visit: dict[int, int] = {}
    last_phase = None
    resumed_at = {r["step"] for r in log.resumes}  # a resumed run rebuilds its stage: a new visit
    # an evaluation, a checkpoint or an export drains the stage before step ``step`` (``ElasticRuntime.drain``:
    # 2BW's outstanding updates run, tp/FSDP shards are gathered and rebuilt by that step): a new visit too
    resumed_at |= {r.fields["step"] for r in log.records if r.type in ("eval", "checkpoint", "export")}
    segments = _segments(plan, log)
    fills = fill_fractions(log)
    other = 0
    for r in log.steps:
        if not [ran for at, ran in segments if at <= r.step][-1]:
            other += 1  # a step of another plan of the run's membership changes
            continue
        ph = r.phase
        if not 0 <= ph < len(plan.phases):
            raise PtplanError(f"run log refers to phase {ph} but the plan has {len(plan.phases)} phases; "
                              f"compare the run with the plan it ran")
        p = plan.phases[ph]
        if r.K != p.K or r.D != p.D:
            raise PtplanError(f"run log step {r.step} ran phase {ph} with K={r.K}, D={r.D} but the plan's phase "
                              f"{ph} has K={p.K}, D={p.D}; compare the run with the plan it ran")
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
    _check_same_plan(plan, log)
    timed, hooked, sampled, other = _bucket(plan, log, warmup)
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
        memberships=log.memberships, other_plan_steps=other, mismatches=model_mismatches(plan, log),
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
           f"{'err':>7} {'pred smp/s':>10} {'meas smp/s':>10} {'pred MiB':>9} {'meas MiB':>9} {'err':>7}")
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
