"""Each stage's strategy by the simulated iteration (issue 22, item 4): the assignment of a ``stage.StageChoice``'s
models to the stages of given splits that minimises the objective, found by branch and bound over the stages.

Legend: P models (strategies) a stage may take, N splits (rows), S stages; a model *fits* a stage where its peak is
within the limit. An *assignment* picks one fitting model per stage.

A stage's strategy changes its forward and backward (FSDP's all-gathers and reduce-scatters, recomputation) and
what comes after its last backward (FSDP has no all-reduce and a sharded optimizer step). The fastest busy time
that fits (``StageChoice``'s choice for the partitioner) leaves the second part out: stage 0's all-reduce and step
end the iteration of a flushed schedule, so FSDP there can win what it loses in busy time. The objective is a
max-plus program of the actions' durations (``simulate.iterations``), so it never decreases when a duration grows:

- a model whose every duration on a stage is at most another's (steady and fill) is never worse there: each stage
  keeps the *front* of its fitting models (the first of equals);
- a stage given, per duration, the least over its front (the *ideal*, not itself a model) bounds from below every
  assignment of it. With stages 0..j-1 fixed and the rest ideal, one simulation bounds every completion.

``best_assignments`` starts from a given assignment per split (the caller's busy-time choice) and drops the splits
whose bound (every stage ideal) does not beat the best of them or the caller's bar (one split alone: only where
its fronts have more than ``MAX_COLUMNS`` assignments; else one call costs what two would). Where the assignments
left are at most ``MAX_COLUMNS``, it simulates them all at once (one column each of one ``simulate.iterations``
call); otherwise it fixes the next stage in every way its front allows, bounds each partial assignment the same
way (one call), drops those that do not beat the bar, and so on. What it returns for the best split is that
split's least objective over every assignment (proven, to within ``SLACK``); for another split, a value reached by
one of its assignments and not below the best split's. PipeDream-2BW's period (a difference of two start times) is
not monotone, and the search offers 2BW no per-stage strategies (``candidates.py``): refused.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from .errors import PtplanError
from .schedule import Schedule
from .simulate import StageTimes, iterations

MAX_COLUMNS = 1 << 14
"""Partial assignments simulated in one step at most; past it the search keeps the best found (not proven)."""

SLACK = 1e-12
"""An assignment counts as better than the bar only by more than this, relatively (as ``resplit`` compares
splits): a partial assignment whose bound is within it of the bar is dropped (the bound, whose ideal backward
is B + W summed again, may round a little above the assignments it bounds)."""

Objective = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""Seconds per sample from the steady and the fill iterations (arrays of one length)."""


def _durations(x: StageTimes) -> np.ndarray:
    """(N, S, 8): every duration ``iterations`` reads of a stage, each on its own (the B and W halves apart, as
    zero-bubble schedules run them; the full backward is their sum)."""
    w = np.minimum(x.backward_weight_s, x.backward_s)
    return np.stack(np.broadcast_arrays(x.forward_s + x.prefix_s, x.backward_s - w, w, x.send_forward_s,
                                        x.send_backward_s, x.allreduce_s, x.optimizer_s, x.setup_s), axis=-1)


def _times(d: np.ndarray) -> StageTimes:
    """Stage times whose durations are d, as ``iterations`` reads them (``_durations``' inverse, the prefix folded
    into the forward; the latencies, which only token slices read, left at 0)."""
    z = np.zeros(d.shape[:-1])
    return StageTimes(forward_s=d[..., 0], backward_s=d[..., 1] + d[..., 2], backward_weight_s=d[..., 2],
                      prefix_s=z, setup_s=d[..., 7], send_forward_s=d[..., 3], send_backward_s=d[..., 4],
                      allreduce_s=d[..., 5], optimizer_s=d[..., 6], send_forward_latency_s=z,
                      send_backward_latency_s=z, tp_comm_s=z, tp_comm_latency_s=z)


class Options(NamedTuple):
    """The models N splits' stages may take (``options`` makes it, ``best_assignments`` searches it)."""

    steady: np.ndarray
    """(P, N, S, fields): each model's stage times (``StageTimes``' fields, last) of the splits."""
    fill: np.ndarray | None
    """The same in an iteration that fills the AutoCache; None without it."""
    fits: np.ndarray
    """(P, N, S) bool: where each model's peak is within the limit."""
    durations: np.ndarray
    """(P, N, S, 8 or 16): ``_durations`` of ``steady``, then of ``fill``."""
    keep: np.ndarray
    """(P, N, S) bool: each stage's *front*: the fitting models that no other fitting model matches or beats in every
    duration; of equals, the first."""

    def take(self, rows: np.ndarray) -> "Options":
        """The splits ``rows`` (an index or a mask over N) only."""
        return Options(self.steady[:, rows], None if self.fill is None else self.fill[:, rows], self.fits[:, rows],
                       self.durations[:, rows], self.keep[:, rows])

    def ideal(self) -> tuple[StageTimes, StageTimes | None]:
        """The ideal stages (steady, fill): per duration the least over each stage's front (not a model: below every
        assignment's stage, so whatever is monotone in the durations bounds every assignment from below)."""
        d = np.where(self.keep[..., None], self.durations, np.inf).min(axis=0)
        return _times(d[..., :8]), None if self.fill is None else _times(d[..., 8:])


def options(steady: Sequence[StageTimes], fill: Sequence[StageTimes] | None, fits: np.ndarray) -> Options:
    """``Options`` from each model's stage times of N splits (steady and, with the AutoCache, fill) and where each
    fits."""
    def stacked(xs: Sequence[StageTimes]) -> np.ndarray:
        shape = np.shape(fits)[1:]
        return np.stack([np.stack([np.broadcast_to(a, shape) for a in x], axis=-1) for x in xs])
    ts, tf = stacked(steady), None if fill is None else stacked(fill)
    d = _durations(StageTimes(*np.moveaxis(ts, -1, 0)))
    if tf is not None:
        d = np.concatenate((d, _durations(StageTimes(*np.moveaxis(tf, -1, 0)))), axis=-1)
    P = len(d)
    le = np.all(d[:, None] <= d[None, :], axis=-1)                     # [p, q]: p matches or beats q everywhere
    lt = np.any(d[:, None] < d[None, :], axis=-1)
    first = (np.arange(P)[:, None] < np.arange(P)[None, :])[..., None, None]
    beaten = fits[:, None] & le & (lt | first) & ~np.eye(P, dtype=bool)[..., None, None]
    return Options(ts, tf, fits, d, fits & ~beaten.any(axis=0))


def best_assignments(schedule: Schedule, o: Options, start: np.ndarray, objective: Objective, *,
                     step_overhead_s: float = 0.0, bar: float = np.inf) -> tuple[np.ndarray, np.ndarray, bool]:
    """(objective (N,), assignment (N, S), proven) over the N splits of ``o``, each of whose stages some model fits.

    ``start``: a fitting assignment per split, the incumbent; ``bar``: a score the caller already has (nothing that
    does not beat it is searched). The least entry is the least objective of every split and assignment to within
    ``SLACK`` (or nothing beats ``bar``); ``proven`` is False only where more than ``MAX_COLUMNS`` partial
    assignments were left to simulate at one stage (then the given assignments' values)."""
    if schedule.name == "2bw":
        raise PtplanError("assign: 2BW's period is not monotone in the stage times; it has no per-stage choice")
    P, N, S = o.fits.shape
    if not np.all(o.fits.any(axis=0)):
        raise PtplanError("assign: every stage of every split needs a model that fits")
    keep, stages = o.keep, np.arange(S)[None, :]
    ideal = o.ideal()
    # index P is the ideal stage, so that a partial assignment's -1 reads it
    ts = np.concatenate((o.steady, np.stack(ideal[0], axis=-1)[None]))
    tf = None if o.fill is None or ideal[1] is None else np.concatenate((o.fill, np.stack(ideal[1], axis=-1)[None]))

    def score(r: np.ndarray, pick: np.ndarray) -> np.ndarray:  # each model's times as given: a complete
        p = np.where(pick < 0, P, pick)                         # assignment's score is the simulation's to the bit
        st = iterations(schedule, StageTimes(*np.moveaxis(ts[p, r[:, None], stages], -1, 0)),
                        step_overhead_s=step_overhead_s)
        fl = st if tf is None else iterations(schedule, StageTimes(*np.moveaxis(tf[p, r[:, None], stages], -1, 0)),
                                              step_overhead_s=step_overhead_s)
        return objective(st, fl)

    def expand(r: np.ndarray, pick: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:  # stage s's front
        q, p = np.nonzero(keep[:, r, s].T)
        pick = pick[q].copy()
        pick[:, s] = p
        return r[q], pick

    best, best_pick = np.full(N, np.inf), np.array(start, dtype=np.int64)
    r, pick = np.arange(N), np.full((N, S), -1, dtype=np.int64)
    sizes = keep.sum(axis=0).astype(float)                      # (N, S): each stage's front
    if N > 1 or sizes.prod() > MAX_COLUMNS:  # the given assignments and the ideal stages, at once
        v = score(np.concatenate((r, r)), np.concatenate((best_pick, pick)))
        best = v[:N]
        bar = min(bar, float(best.min()))
        live = v[N:] < bar * (1 - SLACK)
        r, pick = r[live], pick[live]
    for s in range(S):  # the live partial assignments fix stages 0..s-1
        if not len(r):
            break
        if sizes[r, s:].prod(axis=1).sum() <= MAX_COLUMNS:  # every completion of what is left, simulated at once
            for t in range(s, S):
                r, pick = expand(r, pick, t)
            v = score(r, pick)
            order = np.lexsort((np.arange(len(v)), v))  # each split's least, the first of equals
            first = order[np.unique(r[order], return_index=True)[1]]
            better = v[first] < best[r[first]]
            best[r[first][better]] = v[first][better]
            best_pick[r[first][better]] = pick[first][better]
            break
        if sizes[r, s].sum() > MAX_COLUMNS:
            return best, best_pick, False
        r, pick = expand(r, pick, s)
        live = score(r, pick) < bar * (1 - SLACK)
        r, pick = r[live], pick[live]
    return best, best_pick, True
