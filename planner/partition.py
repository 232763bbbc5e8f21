"""AutoPipe: the optimal contiguous split of the active layers into K pipeline stages, under memory.

Legend: layers ``[start, n)`` are split (the active layers of a phase); K = number of stages
(pipeline length); a stage is a half-open layer range [lo, hi) on pipeline position s; T = a bound
on the slowest stage's seconds.

``split_stages(model, K, memory_limit)`` takes the cost model as an object: for stage index s and a
band of candidate stages it gives their busy seconds and peak bytes (``planner.stage.StageModel``,
the one stage model the search and the simulator use too), plus per-layer lower bounds of both as
prefix sums. Every stage's cost may depend on its position s (stage 0 runs the frozen prefix; 1F1B
keeps K - s micro-batches in flight; the links differ), so the search evaluates each position on
its own.

It minimises, lexicographically: (1) the slowest stage's cost, then (2) the sum of squared stage
costs among the splits that reach (1) (balance, and cheaper cuts: each cut adds its communication
to the two stages it joins), subject to every stage's peak bytes <= the limit. Remaining ties go to
the split whose cuts lie as late as possible, from the last cut backwards (deterministic). (2) is
additive over stages, so the second DP is exact without comparing floats for equality.

The algorithm is exact: a dynamic program over (stages used, layers covered) that stores the least
slowest-stage cost T*, then a second one that minimises (2) over splits whose every stage is <= T*.
Costs are not monotone in the range once boundary communication is counted (a longer stage can be
cheaper if it ends at a cheap cut), so no greedy feasibility test is used. Speed comes from a band:
a stage costs at least the sum of its layers' lower bounds (time and memory), and a quick split
gives an upper bound on T* (one that balances stage 0, which carries the frozen prefix, against an
even split of the rest), so only stages within both bounds are considered; stage k's ends and starts
lie in ranges those bounds give, so each DP step (a few numpy operations) covers only that
parallelogram of the band.

``optimal_partition(costs, K, ...)`` is the same search for plain per-layer numbers:

    cost([lo, hi)) = sum(costs[lo:hi])
                     + boundary_s[lo-1]   if lo > 0   (receive the input; its gradient goes back)
                     + boundary_s[hi-1]   if hi < n   (send the output; receive its gradient)
                     + stage0_extra_s     if lo == 0  (the frozen prefix's no-grad forward)

with stage memory sum(memory[lo:hi]) (+ stage0_extra_memory on stage 0) <= memory_limit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .errors import InfeasibleError, PtplanError

GiB = float(2**30)
_TOL = 1e-12


@dataclass(frozen=True, kw_only=True)
class Partition:
    """A split of n layers into K contiguous non-empty stages."""

    ranges: tuple[tuple[int, int], ...]
    """K half-open layer ranges [lo, hi), contiguous (from 0 for ``optimal_partition``; from the first
    active layer for ``split_stages``)."""
    stage_costs: tuple[float, ...]
    """Per stage: its cost under the model above (same unit as the costs given)."""
    bottleneck: float
    """The largest stage cost."""
    stage_memory: tuple[float, ...] = ()
    """Per stage: its memory (bytes), when memory was given; empty otherwise."""

    def __post_init__(self) -> None:
        assert self.ranges, self.ranges
        for a, b in zip(self.ranges, self.ranges[1:]):
            assert a[1] == b[0], self.ranges
        assert all(lo < hi for lo, hi in self.ranges), self.ranges
        assert len(self.stage_costs) == len(self.ranges)
        assert not self.stage_memory or len(self.stage_memory) == len(self.ranges)

    @property
    def K(self) -> int:
        """Number of stages."""
        return len(self.ranges)

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(hi - lo for lo, hi in self.ranges)

    def shifted(self, offset: int) -> tuple[tuple[int, int], ...]:
        """The ranges moved by ``offset`` (e.g. the frozen prefix length, for a plan's partition)."""
        return tuple((lo + offset, hi + offset) for lo, hi in self.ranges)


def _vector(name: str, values: Sequence[float], n: int | None = None) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    if a.ndim != 1:
        raise PtplanError(f"{name} must be a flat list of numbers")
    if n is not None and len(a) != n:
        raise PtplanError(f"{name} has {len(a)} entries for {n} layers")
    if a.size and not (a.min() >= 0 and math.isfinite(a.sum())):
        bad = int(np.flatnonzero(~np.isfinite(a) | (a < 0))[0])
        raise PtplanError(f"{name}[{bad}] is {a[bad]}; values must be finite and >= 0")
    return a


def _scalar(name: str, v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v) \
            or v < 0:
        raise PtplanError(f"{name} is {v!r}; it must be a finite number >= 0")
    return float(v)


def stage_cost(costs: Sequence[float], lo: int, hi: int, *, boundary_s: Sequence[float] | None = None,
               stage0_extra_s: float = 0.0) -> float:
    """Cost of stage [lo, hi) under the model in the module docstring (a reference for tests and reports)."""
    n = len(costs)
    c = float(sum(costs[lo:hi]))
    if boundary_s is not None:
        if lo > 0:
            c += boundary_s[lo - 1]
        if hi < n:
            c += boundary_s[hi - 1]
    if lo == 0:
        c += stage0_extra_s
    return c


class _StageFamily(Protocol):
    """What ``split_stages`` needs of a cost model (``planner.stage.StageModel`` is the product's one).

    Layers are absolute indices; the stages split ``[start, n)``. ``cum_time_lb`` and ``cum_state``
    are prefix sums (length n + 1) of per-layer lower bounds of a stage's time and memory (the
    search band is cut with them). ``prepare(I, J)`` computes what does not depend on the stage
    index for candidate stages [I, J) (arrays of any equal shape); ``evaluate(s, terms, cols)`` gives
    their exact (busy seconds, peak bytes) as stage s, for the columns ``cols`` of those arrays.
    """

    start: int
    n: int
    cum_time_lb: np.ndarray
    cum_state: np.ndarray

    def prepare(self, I: Any, J: np.ndarray) -> Any: ...
    def evaluate(self, s: int, terms: Any, cols: slice = ...) -> tuple[np.ndarray, np.ndarray]: ...


def _one(model: _StageFamily, s: int, lo: int, hi: int) -> tuple[float, float]:
    """(busy seconds, peak bytes) of the single stage [lo, hi) as stage s."""
    t, m = model.evaluate(s, model.prepare(np.array([lo]), np.array([hi])))
    return float(np.asarray(t).reshape(-1)[0]), float(np.asarray(m).reshape(-1)[0])


def split_stages(model: _StageFamily, K: int, memory_limit: float | None = None) -> Partition:
    """The exact min-bottleneck split of the model's layers ``[start, n)`` into K stages whose every
    stage fits ``memory_limit`` (see the module docstring). Ranges are absolute layer indices.

    Raises InfeasibleError with the numbers when no split fits.
    """
    K, lim = _checked_split(model, K, memory_limit)
    a, n = int(model.start), int(model.n)
    reach = _position_reach(model, K, lim)
    first, first_ok = _first_stage(model, lim)
    if K == 1:
        if not first_ok[n]:
            raise MemoryInfeasibleError(model, K, lim)
        return _result(model, [a, n])
    band = _band_limits(model, K, lim, first, first_ok, reach)
    T, costs = _min_max_pass(model, band, lim, first, first_ok)
    return _result(model, _least_squares_cuts(band, costs, first, first_ok, T))


def _checked_split(model: _StageFamily, K: int, memory_limit: float | None) -> tuple[int, float]:
    """(K, the memory limit with its tolerance, inf for none), or the error that names the bad input."""
    if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1:
        raise PtplanError(f"number of stages K is {K!r}; it must be an integer >= 1")
    K = int(K)
    m = int(model.n) - int(model.start)
    if m <= 0:
        raise PtplanError("nothing to partition: no layers")
    if K > m:
        raise InfeasibleError(f"cannot split {m} layers into K={K} stages: every stage needs at least one "
                              f"layer; use K <= {m}")
    lim = math.inf
    if memory_limit is not None:
        if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float, np.number)) \
                or not math.isfinite(memory_limit) or memory_limit <= 0:
            raise PtplanError(f"memory_limit is {memory_limit!r}; it must be a positive number of bytes")
        lim = float(memory_limit) * (1 + _TOL)
    return K, lim


def refusal_by_bound(rows: np.ndarray, start: int, memory_limit: float,
                     build: Callable[[], _StageFamily]) -> "MemoryInfeasibleError | None":
    """The error ``split_stages`` would raise where a stage family's per-position memory lower bound (``rows``: its
    ``position_state``) already fits no split of layers [start, n) into ``len(rows)`` stages, found without the
    family (``build`` makes it, only if the message is read); None where a split may fit."""
    lim = memory_limit * (1 + _TOL)
    return None if _chain_end(rows, start, lim) >= rows.shape[1] - 1 else MemoryInfeasibleError(build, len(rows), lim)


def _chain_end(A: np.ndarray, a: int, lim: float) -> int:
    """How far stages at positions 0, 1, ... in turn reach from layer a, each as far as the lower bound ``A[s]``
    (prefix sums, non-decreasing) lets it within ``lim``: every split's cut after position s is at most this
    walk's (by induction, as each reach is non-decreasing in the start), so a split exists only if it ends at n."""
    n = A.shape[1] - 1
    i = a
    for row in A:
        i = min(int(np.searchsorted(row, row[i] + lim, side="right")) - 1, n)
    return i


def _position_reach(model: _StageFamily, K: int, lim: float) -> np.ndarray:
    """(K, n + 1): ``[s, i]`` the last end j of a stage [i, j) at position s >= 1 within the memory lower bound (the
    family's ``position_state`` where it has one, else ``cum_state`` at every position; row 0 is not made: stage 0
    is evaluated exactly for every end). MemoryInfeasibleError where even that bound fits no split
    (``_chain_end``)."""
    a, n = int(model.start), int(model.n)
    rows = getattr(model, "position_state", None)
    A = np.broadcast_to(model.cum_state, (K, n + 1)) if rows is None else rows
    assert A.shape == (K, n + 1), f"position_state is {A.shape}, K={K}, n={n}"
    reach = np.full((K, n + 1), n)
    if not math.isfinite(lim):
        return reach
    if _chain_end(A, a, lim) < n:
        raise MemoryInfeasibleError(model, K, lim)
    for s in range(1, K):
        np.minimum(np.searchsorted(A[s], A[s] + lim, side="right") - 1, n, out=reach[s])
    return reach


def _first_stage(model: _StageFamily, lim: float) -> tuple[np.ndarray, np.ndarray]:
    """Stage 0 = [a, j) evaluated exactly for every end j: (its cost, whether it fits), indexed by j (inf and
    False for j <= a)."""
    a, n = int(model.start), int(model.n)
    t0, m0 = model.evaluate(0, model.prepare(np.full(n - a, a), np.arange(n + 1)[a + 1:]))
    first = np.full(n + 1, np.inf)
    first[a + 1:] = t0
    first_ok = np.zeros(n + 1, dtype=bool)
    first_ok[a + 1:] = m0 <= lim
    return first, first_ok


@dataclass(frozen=True)
class _BandLimits:
    """Where the DP looks. ``reach[i]``: the last end j of a stage [i, j) within the memory lower bound and the
    time band (below the quick split's bottleneck); stage k (k stages cover [a, j)) ends at j in
    [lo_k[k], hi_k[k]) and starts at i in [lo_k[k-1], hi_k[k-1]); in the band's layout (column j, row d is the
    stage [i, j) with i = j - 1 - d, w rows) only rows d in [d0[k], d1[k]] matter for stage k."""

    a: int
    n: int
    w: int
    reach: np.ndarray
    lo_k: list[int]
    hi_k: list[int]
    d0: list[int]
    d1: list[int]

    @property
    def K(self) -> int:
        return len(self.lo_k) - 1


def _band_limits(model: _StageFamily, K: int, lim: float, first: np.ndarray, first_ok: np.ndarray,
                 memory_reach: np.ndarray) -> _BandLimits:
    """Stages from i: the memory lower bound at each position (``_position_reach``), then the time band below the
    quick split's bottleneck UB; each stage's ends and starts, and its rows of the band (``_BandLimits``; its
    ``reach`` is the farthest over positions 1..K-1, the band's). MemoryInfeasibleError where no stage 0 or no
    chain of stages remains."""
    a, n = int(model.start), int(model.n)
    S = model.cum_time_lb
    js = np.arange(n + 1)
    reach = memory_reach
    UB = _quick_bound(model, K, lim, first, first_ok)
    if math.isfinite(UB):
        reach = np.minimum(reach, np.searchsorted(S, S + UB * (1 + 1e-9), side="right") - 1)
    reach = np.maximum(reach, js)
    ok0 = first_ok & (first <= UB * (1 + 1e-9)) if math.isfinite(UB) else first_ok
    if not ok0.any():
        raise MemoryInfeasibleError(model, K, lim)
    at = reach  # at[s]: position s's reach (s >= 1), non-decreasing in the start
    reach = reach[1:].max(axis=0)
    w = max(1, int((reach[a + 1:n] - js[a + 1:n]).max(initial=1)))
    top, bot = [0] * (K + 1), [0] * (K + 1)
    top[1] = int(np.flatnonzero(ok0).max())
    for k in range(2, K + 1):  # stage k (of 1..K) is at position k - 1
        top[k] = int(at[k - 1, top[k - 1]])
    bot[K] = n
    for k in range(K - 1, 0, -1):  # the first start in [a + 1, n) from which position k reaches bot[k + 1]
        bot[k] = a + 1 + int(np.searchsorted(at[k, a + 1:n], bot[k + 1], side="left"))
    lo_k = [max(bot[k], a + k) for k in range(K + 1)]
    hi_k = [min(top[k], n - K + k) + 1 for k in range(K + 1)]    # exclusive
    if any(lo_k[k] >= hi_k[k] for k in range(1, K + 1)):
        raise MemoryInfeasibleError(model, K, lim)
    # elsewhere the previous stage's entry is inf or the stage breaks a bound
    d0 = [0] * (K + 1)
    d1 = [0] * (K + 1)
    for k in range(2, K + 1):
        d0[k] = max(0, lo_k[k] - hi_k[k - 1])
        d1[k] = min(w - 1, hi_k[k] - 2 - lo_k[k - 1])
    return _BandLimits(a=a, n=n, w=w, reach=reach, lo_k=lo_k, hi_k=hi_k, d0=d0, d1=d1)


def _min_max_pass(model: _StageFamily, band: _BandLimits, lim: float, first: np.ndarray, first_ok: np.ndarray
                  ) -> tuple[float, list[np.ndarray]]:
    """Pass 1: T*, the least slowest-stage cost of any split, and each stage k's costs over its rows and columns
    of the band (inf where a stage breaks the memory limit or the band). One sub-band, the rows any stage
    needs, is prepared, and each stage reads its own rows and columns of it."""
    K, a, n, w = band.K, band.a, band.n, band.w
    lo_k, hi_k, d0, d1 = band.lo_k, band.hi_k, band.d0, band.d1
    F = np.full((K + 1, w + n + 1), np.inf)
    F[1, w:] = np.where(first_ok, first, np.inf)
    prev = _lagged(F, w)
    # F[k, j] = least slowest-stage cost covering [a, j) with k stages, at column w + j; prev[k, d, j]
    # views F[k, j - 1 - d]; costs[k][d - d0[k], j - lo_k[k]] is stage [j - 1 - d, j) as stage k - 1
    costs: list[np.ndarray] = [np.empty(0)] * (K + 1)
    c_lo, c_hi = lo_k[2], hi_k[K]
    r_lo, r_hi = min(d0[2:]), max(d1[2:]) + 1
    if r_lo >= r_hi:
        r_lo, r_hi = 0, 1
    jj = np.arange(n + 1)[None, c_lo:c_hi]
    Id = _Diagonal(c_lo - r_lo, r_hi - r_lo, c_hi - c_lo, a, n)
    I = jj - 1 - np.arange(r_lo, r_hi)[:, None]
    valid = (I >= a + 1) & (jj <= Id.take_from(band.reach))
    terms = model.prepare(Id, jj)
    for k in range(2, K + 1):
        lo, hi = lo_k[k], hi_k[k]
        if d0[k] > d1[k]:       # no start can precede this end: the stage is unreachable
            costs[k] = np.full((0, hi - lo), np.inf)
            continue
        rows, cols = slice(d0[k] - r_lo, d1[k] + 1 - r_lo), slice(lo - c_lo, hi - c_lo)
        t, mem = model.evaluate(k - 1, tuple(x[rows if x.shape[0] > 1 else slice(None), cols] for x in terms))
        cost = np.where(valid[rows, cols] & (mem <= lim), t, np.inf)
        costs[k] = cost
        np.minimum.reduce(np.maximum(prev[k - 1, d0[k]:d1[k] + 1, lo:hi], cost), axis=0, initial=np.inf,
                          out=F[k, w + lo:w + hi])
    T = float(F[K, w + n])
    if not math.isfinite(T):
        raise MemoryInfeasibleError(model, K, lim)
    return T, costs


def _least_squares_cuts(band: _BandLimits, costs: list[np.ndarray], first: np.ndarray, first_ok: np.ndarray,
                        T: float) -> list[int]:
    """Pass 2: among splits whose every stage is <= T, the least sum of squared stage costs; then the walk back
    to its cuts (the first d, the latest cut, that attains each optimum; the same float sums as the pass)."""
    K, a, n, w = band.K, band.a, band.n, band.w
    lo_k, hi_k, d0, d1 = band.lo_k, band.hi_k, band.d0, band.d1
    Q = np.full((K + 1, w + n + 1), np.inf)
    Q[1, w:] = np.where(first_ok & (first <= T), first * first, np.inf)
    qprev = _lagged(Q, w)
    sq: list[np.ndarray] = [np.empty(0)] * (K + 1)
    for k in range(2, K + 1):
        lo, hi = lo_k[k], hi_k[k]
        c = costs[k]
        sq[k] = np.where(c <= T, c * c, np.inf)
        np.minimum.reduce(qprev[k - 1, d0[k]:d1[k] + 1, lo:hi] + sq[k], axis=0, initial=np.inf,
                          out=Q[k, w + lo:w + hi])
    assert math.isfinite(Q[K, w + n]), "pass 2 lost the optimum"
    cuts = [n]
    j = n
    for k in range(K, 1, -1):
        j = j - 1 - d0[k] - int((qprev[k - 1, d0[k]:d1[k] + 1, j] + sq[k][:, j - lo_k[k]]).argmin())
        cuts.append(j)
    cuts.append(a)
    cuts.reverse()
    return cuts


def _at(arr: np.ndarray, I: Any) -> np.ndarray:
    """``arr[I]`` for an index array, or through a ``_Diagonal``'s strided view."""
    return I.take_from(arr) if isinstance(I, _Diagonal) else arr[I]


class _Diagonal:
    """The band's start indices I[d, j] = clip(c0 + j - 1 - d, a, n) without materialising gathers:
    ``take_from(arr)`` is ``arr[I]`` as a strided view (each row is a shifted slice of ``arr``)."""

    def __init__(self, c0: int, w: int, ncols: int, a: int, n: int) -> None:
        self.c0, self.w, self.ncols, self.a, self.n = c0, w, ncols, a, n
        self.idx = np.clip(np.arange(c0 - w, c0 + ncols - 1), a, n)
        self.shape = (w, ncols)

    def take_from(self, arr: np.ndarray) -> np.ndarray:
        seg = arr[self.idx]
        st = seg.strides[0]
        view = np.ndarray(self.shape, dtype=seg.dtype, buffer=seg, offset=(self.w - 1) * st, strides=(-st, st))
        view.flags.writeable = False
        return view


def _lagged(A: np.ndarray, w: int) -> np.ndarray:
    """A view V of the C-contiguous (rows, w + n + 1) array A with V[k, d, j] = A[k, w + j - 1 - d]."""
    rows, cols = A.shape
    return np.ndarray((rows, w, cols - w), dtype=A.dtype, buffer=A, offset=(w - 1) * A.itemsize,
                      strides=(A.strides[0], -A.itemsize, A.itemsize))


def _evaluate(model: _StageFamily, cuts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(busy seconds, peak bytes) of every stage of the split with boundaries ``cuts``."""
    c = np.asarray(cuts)
    terms = model.prepare(c[:-1], c[1:])
    fast = getattr(model, "evaluate_split", None)
    if fast is not None:
        t, mem = fast(terms)
        return np.asarray(t, dtype=float), np.asarray(mem, dtype=float)
    K = len(cuts) - 1
    t, mem = np.empty(K), np.empty(K)
    for s in range(K):
        ts, ms = model.evaluate(s, terms, slice(s, s + 1))
        t[s], mem[s] = float(ts[0]), float(ms[0])
    return t, mem


def _result(model: _StageFamily, cuts: list[int]) -> Partition:
    t, mem = _evaluate(model, cuts)
    return Partition(ranges=tuple(zip(cuts[:-1], cuts[1:])), stage_costs=tuple(t.tolist()),
                     bottleneck=float(t.max()), stage_memory=tuple(mem.tolist()))


def _even_cuts(S: np.ndarray, a: int, n: int, K: int) -> list[int]:
    """The K - 1 inner cuts of [a, n) nearest to k/K of the prefix sums S, strictly increasing."""
    targets = S[a] + (S[n] - S[a]) * np.arange(1, K) / K
    cuts = np.minimum(np.maximum(np.searchsorted(S, targets, side="left"), a + 1), n)
    cuts -= (targets - S[cuts - 1]) < (S[cuts] - targets)        # the nearer of the two prefix sums
    idx = np.arange(1, K)
    cuts = np.minimum(np.maximum(cuts, a + idx), n - K + idx)
    cuts = np.maximum.accumulate(cuts - idx) + idx      # strictly increasing, still room for the rest
    return cuts.tolist()


def _bottleneck(model: _StageFamily, cuts: list[int], lim: float) -> float:
    """The slowest stage of the split with boundaries ``cuts``; inf if a stage breaks the memory limit."""
    t, mem = _evaluate(model, cuts)
    return math.inf if (mem > lim).any() else float(t.max())


def _quick_bound(model: _StageFamily, K: int, lim: float, first: np.ndarray | None = None,
                 first_ok: np.ndarray | None = None) -> float:
    """An upper bound on the optimal bottleneck T*: the slowest stage of a heuristic split that fits
    (inf if it does not fit the memory limit; then only memory narrows the search). Given stage 0's
    exact cost for every end (``first``, ``first_ok``: stage 0 carries the frozen prefix, which the
    layers' lower bounds leave out), the split whose stage 0 best balances it against an even split of
    the rest, the rest split evenly; otherwise, or if that one does not fit, the cuts nearest to k/K of
    the layers' time lower bound. Any feasible split's bottleneck is >= T*, so the band it gives contains
    every stage of cost <= T*."""
    a, n, S = model.start, model.n, model.cum_time_lb
    if first is not None and first_ok is not None and K >= 2:
        j = np.arange(a + 1, n - K + 2)             # stage 0 = [a, j), room for K - 1 more stages
        ok = first_ok[j]
        if ok.any():
            score = np.maximum(first[j], (S[n] - S[j]) / (K - 1))
            j0 = int(j[np.flatnonzero(ok)[np.argmin(score[ok])]])
            ub = _bottleneck(model, [a, j0, *(_even_cuts(S, j0, n, K - 1) if K > 2 else []), n], lim)
            if math.isfinite(ub):
                return ub
    return _bottleneck(model, [a, *_even_cuts(S, a, n, K), n], lim)


class _Additive:
    """``optimal_partition``'s cost model: additive layer costs, boundary terms charged to both
    stages, stage 0's extra time and memory."""

    def __init__(self, costs: np.ndarray, beta: np.ndarray, extra: float, memory: np.ndarray | None,
                 extra_mem: float) -> None:
        self.start, self.n = 0, len(costs)
        self.cum_time_lb = np.concatenate(([0.0], np.cumsum(costs)))
        self.cum_state = np.concatenate(([0.0], np.cumsum(memory))) if memory is not None else np.zeros(self.n + 1)
        self.beta, self.extra, self.extra_mem = beta, extra, extra_mem
        self.stage0_static = extra_mem
        self.has_memory = memory is not None

    def prepare(self, I: Any, J: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        S, b = self.cum_time_lb, self.beta
        return S[J] - _at(S, I) + _at(b, I) + b[J], self.cum_state[J] - _at(self.cum_state, I)

    def evaluate(self, s: int, terms: tuple[np.ndarray, np.ndarray], cols: slice = slice(None)
                 ) -> tuple[np.ndarray, np.ndarray]:
        t, m = terms[0][..., cols], terms[1][..., cols]
        return (t + self.extra, m + self.extra_mem) if s == 0 else (t, m)


def optimal_partition(costs: Sequence[float], K: int, *, boundary_s: Sequence[float] | None = None,
                      stage0_extra_s: float = 0.0, memory: Sequence[float] | None = None,
                      stage0_extra_memory: float = 0.0, memory_limit: float | None = None) -> Partition:
    """The exact min-bottleneck split of additive ``costs`` into K stages (see the module docstring).

    ``boundary_s``: seconds to move layer i's output to the next stage (length n, or n-1: the last
    layer's output never crosses a cut). ``memory``: bytes per layer; with ``memory_limit`` every
    stage must fit. Raises InfeasibleError with the numbers when no split fits. The planner uses
    ``split_stages`` with the one stage model (``planner/stage.py``); this is the same search for
    plain per-layer numbers.
    """
    c = _vector("costs", costs)
    n = len(c)
    if n == 0:
        raise PtplanError("nothing to partition: the list of layer costs is empty")
    if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1:
        raise PtplanError(f"number of stages K is {K!r}; it must be an integer >= 1")
    beta = np.zeros(n + 1)
    if boundary_s is not None:
        b = _vector("boundary_s", boundary_s)
        if len(b) not in (n, n - 1):
            raise PtplanError(f"boundary_s has {len(b)} entries for {n} layers; give {n} (or {n - 1})")
        beta[1:n] = b[:n - 1]
    extra = _scalar("stage0_extra_s", stage0_extra_s)
    mem = None
    mextra = 0.0
    if memory is not None:
        mem = _vector("memory", memory, n)
        mextra = _scalar("stage0_extra_memory", stage0_extra_memory)
    elif memory_limit is not None:
        raise PtplanError("memory_limit was given without per-layer memory")
    model = _Additive(c, beta, extra, mem, mextra)
    part = split_stages(model, K, memory_limit if mem is not None else None)
    if mem is None:
        part = replace(part, stage_memory=())
    return part


class MemoryInfeasibleError(InfeasibleError):
    """No K-stage split fits in memory.

    The message names the smallest peak any split's fullest stage can have, which costs one more
    search to find, so it is computed only when the message is read: a planner that catches this
    and tries another configuration pays nothing for it.
    """

    def __init__(self, model: "_StageFamily | Callable[[], _StageFamily]", K: int, limit: float) -> None:
        """``model``: the stage family, or a function that builds it (for a candidate rejected before it was
        built: ``refusal_by_bound``); ``limit`` with its tolerance."""
        super().__init__()
        self.model, self.K, self.limit = model, K, limit
        self._msg: str | None = None

    def __str__(self) -> str:
        if self._msg is None:
            model = self.model() if callable(self.model) else self.model
            self._msg = _memory_message(model, self.K, self.limit / (1 + _TOL))
        return self._msg


class _MemoryAsTime:
    """A stage family whose 'time' is the other family's peak memory: its min-max split is the split
    whose fullest stage is least full."""

    def __init__(self, model: _StageFamily) -> None:
        self.m = model
        self.start, self.n = model.start, model.n
        self.cum_time_lb = model.cum_state
        self.cum_state = np.zeros(model.n + 1)

    def prepare(self, I: np.ndarray, J: np.ndarray) -> Any:
        return self.m.prepare(I, J)

    def evaluate(self, s: int, terms: Any, cols: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        _, mem = self.m.evaluate(s, terms, cols)
        return mem, np.zeros(np.shape(mem))


def _layer_floors(model: _StageFamily, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Per layer i of ``[start, n)``: the least peak of any stage that can hold it in a K-stage split (the minimum
    over every stage index s and every range [lo, hi) that contains i and can be stage s: stage 0 starts at
    ``start``, the last ends at n, and each stage before or after has a layer), and the least peak of i alone at a
    position it can have alone (inf where it has none). A stage's peak is not the sum of its layers' (a range pays
    its first layer's input and its last layer's output, and those depend on s), so a layer alone at one position
    is no floor; the first array is: a layer whose floor is over the limit fits in no split."""
    a, n = int(model.start), int(model.n)
    m = n - a
    lo, hi = np.triu_indices(m + 1, k=1)
    terms = model.prepare(lo + a, hi + a)
    floor, alone = np.full(m, np.inf), np.full(m, np.inf)
    diag = np.arange(m)
    for s in range(K):
        ok = (lo >= s) & (hi <= m - (K - 1 - s)) & ((lo == 0) == (s == 0)) & ((hi == m) == (s == K - 1))
        if not ok.any():
            continue
        mem = np.broadcast_to(np.asarray(model.evaluate(s, terms)[1], dtype=float), lo.shape)
        grid = np.full((m + 1, m + 1), np.inf)
        grid[lo[ok], hi[ok]] = mem[ok]
        alone = np.minimum(alone, grid[diag, diag + 1])
        ends_after = np.minimum.accumulate(grid[:, ::-1], axis=1)[:, ::-1][:, 1:]  # [l, i]: min over hi > i
        floor = np.minimum(floor, np.minimum.accumulate(ends_after[:m], axis=0)[diag, diag])  # and lo <= i
    return floor, alone


def _memory_message(model: _StageFamily, K: int, limit: float) -> str:
    """Why no K-stage split fits, each number a true floor: the whole model (K = 1); stage 0's least peak where
    its first layer alone is the least stage 0 there is; a layer alone where no stage holding it needs less; else
    the split whose largest stage is least (``_MemoryAsTime``)."""
    a, n = model.start, model.n
    if K == 1:
        whole = _one(model, 0, a, n)[1]
        return (f"the whole model as one stage needs {whole / GiB:.2f} GiB but one device has {limit / GiB:.2f} GiB; "
                "use a longer pipeline (larger K), a smaller micro-batch, or GPUs with more memory")
    floors, alone = _layer_floors(model, K)
    first = _one(model, 0, a, a + 1)[1]
    if floors[0] > limit and math.isclose(floors[0], first, rel_tol=1e-9):
        held = getattr(model, "stage0_static", None)  # the stage model's frozen weights or cached shard
        what = (f", with the {held / GiB:.2f} GiB that stage 0 always holds: the frozen prefix's weights or the "
                f"cached shard" if held else "")
        return (f"stage 0 needs at least {first / GiB:.2f} GiB (layer {a} alone as stage 0{what}) but one device "
                f"has {limit / GiB:.2f} GiB; use a smaller micro-batch, cache the frozen prefix, or GPUs with more "
                f"memory")
    big = int(np.argmax(floors))
    if floors[big] > limit and math.isclose(alone[big], floors[big], rel_tol=1e-9):
        return (f"layer {a + big} alone needs {floors[big] / GiB:.2f} GiB (the least of any stage that can hold it) "
                f"but one device has {limit / GiB:.2f} GiB; use a smaller micro-batch or GPUs with more memory")
    need = split_stages(_MemoryAsTime(model), K).bottleneck
    return (f"no split of {n - a} layers into K={K} stages fits: the best split's largest stage needs "
            f"{need / GiB:.2f} GiB but one device has {limit / GiB:.2f} GiB; use a longer pipeline (larger K), a "
            f"smaller micro-batch, or GPUs with more memory")


def greedy_param_partition(params: Sequence[float], K: int, *, unit: float = 1e6) -> Partition:
    """PipeTransformer's greedy parameter-size balancer (``generate_parameter_size_wise_balance``).

    Kept for comparison. Stage s (0..K-1) takes layers in order while its size plus the next layer
    stays below mean + variance, where mean = (unassigned size) / (K - s) and variance =
    var(sizes of the unassigned layers) / (K - s); the last stage takes the rest. Sizes are parameter
    counts divided by ``unit`` (the paper's code used millions, and the threshold adds a variance to
    a mean, so the unit changes the result). As in the released code, frozen layers are not
    included (it always passed 0 frozen layers). ``stage_costs`` are the stage sizes in ``unit``.
    Raises InfeasibleError if the rule leaves a stage empty (the paper's code would build it empty).
    """
    p = _vector("params", params) / unit
    n = len(p)
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise PtplanError(f"number of stages K is {K!r}; it must be an integer >= 1")
    if K > n:
        raise InfeasibleError(f"cannot split {n} layers into K={K} stages; use K <= {n}")
    remaining = float(p.sum())
    sizes, counts = [], []
    i = 0
    for s in range(K):
        mean = remaining / (K - s)
        variance = float(np.var(p[i:])) / (K - s) if i < n else 0.0
        size, cnt = 0.0, 0
        while i < n and (s == K - 1 or size + p[i] < mean + variance):
            size += float(p[i])
            remaining -= float(p[i])
            cnt += 1
            i += 1
        sizes.append(size)
        counts.append(cnt)
    if 0 in counts:
        raise InfeasibleError(f"the paper's greedy balancer left stage {counts.index(0)} empty "
                              f"(layer counts {counts}); use optimal_partition")
    bounds = np.concatenate(([0], np.cumsum(counts)))
    ranges = tuple((int(bounds[s]), int(bounds[s + 1])) for s in range(K))
    return Partition(ranges=ranges, stage_costs=tuple(sizes), bottleneck=max(sizes))
