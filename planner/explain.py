"""Why a run and its plan disagree: for a phase whose measured iteration time is off by more than a threshold,
which term of the prediction differs most (compute, communication, bubble, overhead) and what in the profile's
provenance may explain it (its timer, the machine's load while profiling, the device, the repeats it could
afford). Read by ``ptplan compare``; pure (no torch)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from .compare import Comparison, PhaseComparison
from .plan import Plan

DEFAULT_THRESHOLD = 0.15
"""|predicted - measured| / measured above which ``ptplan compare`` explains a phase (the calibration target)."""


@dataclass(frozen=True, kw_only=True)
class Terms:
    """A phase's predicted iteration, term by term (seconds): they add up to ``iteration_s``."""

    compute: float
    """The slowest stage's forward and backward of all its micro-batches."""
    bubble: float
    """Idle pipeline time (the predicted bubble fraction of the pipelined part)."""
    communication: float
    """The exposed data-parallel all-reduce."""
    overhead: float
    """The rest: optimizer step, per-step and per-action host work, point-to-point transfers."""


def predicted_terms(plan: Plan, phase: int) -> Terms:
    """Split phase ``phase``'s predicted iteration time into compute, bubble, communication and overhead."""
    pred = plan.phases[phase].predicted
    comm = max(0.0, pred.allreduce_s)
    piped = max(0.0, pred.iteration_s - comm)
    bubble = min(piped, max(0.0, pred.bubble_fraction) * piped)
    compute = min(piped - bubble, max(pred.stage_compute_s, default=0.0))
    return Terms(compute=compute, bubble=bubble, communication=comm, overhead=max(0.0, piped - bubble - compute))


def fill_words(plan: Plan, row: PhaseComparison, steady: PhaseComparison | None) -> str:
    """Why a fill row (``PhaseComparison.kind`` fill: steps that computed the frozen prefix and wrote its rows) is
    off: its measured and predicted step, and the fill's extra over the phase's steady step, predicted (the plan's
    ``fill_iteration_s - iteration_s``, scaled by the share of rows computed) and measured (against the steady
    rows' median, where the run has them)."""
    pred = plan.phases[row.phase].predicted
    extra = row.fill_fraction * (pred.fill_iteration_s - pred.iteration_s)
    words = (f"its steps took {row.measured_iteration_s * 1e3:.1f} ms against {row.predicted_iteration_s * 1e3:.1f} ms "
             f"predicted ({row.fill_fraction:.0%} of the prefix rows computed and written); the fill's extra over a "
             f"steady step is predicted {extra * 1e3:.1f} ms")
    if steady is not None:
        words += f" and measured {(row.measured_iteration_s - steady.measured_iteration_s) * 1e3:.1f} ms"
    return words + (" (the prefix's no-grad forward and the rows' write to host memory: see the plan's note on the "
                    "AutoCache's host rates)")


def differing_term(plan: Plan, row: PhaseComparison) -> tuple[str, str]:
    """(term, words): the term of the prediction that differs most from the run, and the numbers that say so.

    A run logs each step's time, the all-reduce's, the time it took to make the batch (the input pipeline, which no
    prediction holds) and the time stage 0 spent serving the frozen prefix from the AutoCache, so communication,
    input and cache are compared directly; the rest of the gap belongs to compute, bubble or overhead, and is put
    on the largest of them in the prediction (a uniform error in the profile's times moves the largest term most)."""
    t = predicted_terms(plan, row.phase)
    comm_meas = row.measured_allreduce_s
    comm_gap = (comm_meas - t.communication) if comm_meas is not None else 0.0
    data = row.measured_data_s or 0.0
    cache_meas = row.measured_cache_s
    cache_gap = (cache_meas - row.predicted_cache_s) if cache_meas is not None else 0.0
    rest_pred = t.compute + t.bubble + t.overhead
    rest_gap = (row.measured_iteration_s - data - (comm_meas or t.communication)) - rest_pred - cache_gap
    within = f"the rest of the step is within {round(rest_gap * 1e3, 1) + 0.0:+.1f} ms of its prediction"  # no -0.0
    biggest = max(("input", data), ("communication", abs(comm_gap)), ("cache", abs(cache_gap)),
                  ("rest", abs(rest_gap)), key=lambda kv: kv[1])[0]
    if biggest == "input":
        return "input", (f"making the batch took {data * 1e3:.1f} ms of the {row.measured_iteration_s * 1e3:.1f} ms "
                         f"step ({data / row.measured_iteration_s:.0%}), and no plan prices the input pipeline (the "
                         f"data set's reading, collating or synthetic samples); {within}")
    if biggest == "communication" and comm_meas is not None:
        return "communication", (f"the data-parallel all-reduce took {comm_meas * 1e3:.1f} ms against "
                                 f"{t.communication * 1e3:.1f} ms predicted; {within}")
    if biggest == "cache" and cache_meas is not None:
        return "cache", (f"serving the frozen prefix from the AutoCache took {cache_meas * 1e3:.1f} ms against "
                         f"{row.predicted_cache_s * 1e3:.1f} ms predicted (reading its rows to the device); {within}")
    parts = {"compute": t.compute, "bubble": t.bubble, "overhead": t.overhead}
    term = max(parts, key=lambda k: parts[k])
    share = parts[term] / rest_pred if rest_pred > 0 else 0.0
    ratio = (rest_pred + rest_gap) / rest_pred if rest_pred > 0 else float("inf")
    return term, (f"outside the all-reduce{' and the input' if data else ''} the step took "
                  f"{(rest_pred + rest_gap) * 1e3:.1f} ms against "
                  f"{rest_pred * 1e3:.1f} ms predicted ({ratio:.2f}x), and {term} is {share:.0%} of that "
                  f"prediction (compute {t.compute * 1e3:.1f}, bubble {t.bubble * 1e3:.1f}, overhead "
                  f"{t.overhead * 1e3:.1f} ms)")


def profile_record(plan: Plan, plan_path: str | None = None) -> dict[str, Any] | None:
    """The plan's profile file as JSON (found where the plan recorded it, or beside the plan); None if gone."""
    recorded = plan.inputs.profile.path
    if not recorded:
        return None
    where = [recorded] + ([os.path.join(os.path.dirname(os.path.abspath(plan_path)), os.path.basename(recorded))]
                          if plan_path else [])
    for path in where:
        try:
            with open(path, encoding="utf-8") as fh:
                obj = json.load(fh)
            return obj if isinstance(obj, dict) else None
        except (OSError, ValueError):
            continue
    return None


def provenance_hints(plan: Plan, profile: dict[str, Any] | None, *, slower: bool) -> list[str]:
    """What in the profile's making may explain a prediction that is off: timer, load, device, repeats.
    ``slower``: the run took longer than predicted (else shorter)."""
    ref = plan.inputs.profile
    if ref.source != "measured":
        return [f"the profile is {ref.source}, not timed on a machine: its times come from "
                f"{'a device model' if ref.source == 'projected' else 'formulas'}"]
    if profile is None:
        return [f"the profile file {ref.path or '(not recorded)'} is not readable here, so its timer and the "
                f"machine's load while profiling are unknown"]
    meas: dict[str, Any] = _obj(profile.get("measurement"))
    dev: dict[str, Any] = _obj(profile.get("device"))
    timer = str(meas.get("timer", ""))
    load: dict[str, Any] | None = _obj(meas.get("load_average")) if "load_average" in meas else None
    worst = max((v for v in (load or {}).values() if isinstance(v, (int, float))), default=None)
    load_words = (f"1-minute load average {load.get('before')} before and {load.get('after')} after profiling"
                  if load is not None else "the load while profiling is not recorded (an older profile)")
    out = []
    if slower:
        out.append(f"the run was slower than its profile: other work on the machine during the run slows it "
                   f"(the run log does not record the load; {load_words})")
        if timer.startswith("process_time"):
            out.append("the profile was timed in CPU time (--timer cpu), which leaves out waiting for a core: a "
                       "run on a busy machine measures more than it predicts")
    elif "wall" in timer:
        busy = worst is not None and worst >= 1.0
        out.append(f"the profile was timed by the wall clock ({load_words})"
                   + (": on a busy machine its times include waiting for a core, so the plan predicts too slow"
                      if busy else ": other work then would make it predict too slow"))
    rounds = meas.get("rounds_per_size")
    few = [r.get("batch_size") for r in rounds if isinstance(r, dict) and r.get("repeats") == 1] \
        if isinstance(rounds, list) else []
    if few:
        out.append(f"--budget left one timed repeat at micro-batch sizes {few}: those times are single samples; "
                   f"profile again with a larger --budget")
    if dev.get("kind") == "cpu" and not plan.inputs.cluster.device_is_host:
        out.append(f"the profile was measured on {dev.get('name')} (a CPU) for the {plan.inputs.cluster.name} cluster")
    elif dev.get("name"):
        out.append(f"the profile was measured on {dev.get('name')} with {dev.get('threads') or '?'} thread(s) on "
                   f"{dev.get('date')}: a run on another machine, or with another thread count, differs as they do")
    return out


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def explain(plan: Plan, comparison: Comparison, profile: dict[str, Any] | None, *,
            threshold: float = DEFAULT_THRESHOLD) -> list[str]:
    """Lines for ``ptplan compare``: per phase off by more than ``threshold``, the term that differs most; then,
    once, what in the profile's provenance may explain it. Empty when every phase is within the threshold."""
    off = [r for r in comparison.phases + comparison.fills if abs(r.iteration_error) > threshold]
    if not off:
        return []
    lines = [f"phases off by more than {threshold:.0%}:"]
    steady = {r.phase: r for r in comparison.phases}
    for r in sorted(off, key=lambda r: (r.phase, r.kind != "steady")):
        if r.kind == "fill":
            lines.append(f"  phase {r.phase}f ({r.iteration_error:+.1%}): the AutoCache fill differs -- "
                         + fill_words(plan, r, steady.get(r.phase)))
            continue
        term, words = differing_term(plan, r)
        lines.append(f"  phase {r.phase} ({r.iteration_error:+.1%}): {term} differs most -- {words}")
    slower = sum(r.iteration_error < 0 for r in off) * 2 >= len(off)  # most phases: measured above predicted
    hints = provenance_hints(plan, profile, slower=slower)
    if hints:
        lines.append("what in the profile may explain it:")
        lines.extend(f"  - {h}" for h in hints)
    return lines
