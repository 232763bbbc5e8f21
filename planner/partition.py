"""AutoPipe: the optimal contiguous split of the active layers into K pipeline stages.

Legend: n = number of layers to split (the active layers of a phase, indexed 0..n-1 here; the caller
shifts ranges by the frozen prefix); K = number of stages (pipeline length); a stage is a half-open
layer range [lo, hi); T = a bound on the slowest stage's seconds.

Stage cost model (seconds per micro-batch, forward + backward, or whatever unit ``costs`` uses):

    cost([lo, hi)) = sum(costs[lo:hi])
                     + boundary_s[lo-1]   if lo > 0   (receive the input; its gradient goes back)
                     + boundary_s[hi-1]   if hi < n   (send the output; receive its gradient)
                     + stage0_extra_s     if lo == 0  (the frozen prefix's no-grad forward)

A boundary's communication is charged to both stages it joins: with blocking point-to-point
transfers both ends are busy for it. Stage memory is sum(memory[lo:hi]) (+ stage0_extra_memory on
stage 0) and must be <= memory_limit.

``optimal_partition`` minimises, lexicographically: (1) the slowest stage's cost, then (2) the sum
of squared stage costs among the splits that reach (1): balance, and since each cut adds its
communication to the two stages it joins, cheaper cuts too. Remaining ties go to the split whose cuts
lie as late as possible, from the last cut backwards (deterministic). (2) is additive over stages, so
the DP for it is exact without comparing floats for equality.

The algorithm is exact: a dynamic program over (stages used, layers covered) that stores the least
slowest-stage cost T*, then a second one that minimises (2) over splits whose every stage is <= T*.
Costs are not monotone in the range once boundary communication is counted (a longer stage can be
cheaper if it ends at a cheap cut), so no greedy feasibility test is used. Speed comes from a band:
a stage costs at least the sum of its layers, and a quick prefix-sum split gives an upper bound on
T*, so only stages whose layer sum is within that bound are considered; each DP step is two numpy
operations over that band. On the shared 2-core dev box a call costs about 0.2 ms plus 15 us per
stage (n=200: K=8 0.3 ms, K=64 1 ms).
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import InfeasibleError, PtplanError

GiB = float(2**30)
_TOL = 1e-12


@dataclass(frozen=True, kw_only=True)
class Partition:
    """A split of n layers into K contiguous non-empty stages."""

    ranges: tuple[tuple[int, int], ...]
    """K half-open layer ranges [lo, hi), contiguous, starting at 0."""
    stage_costs: tuple[float, ...]
    """Per stage: its cost under the model above (same unit as the costs given)."""
    bottleneck: float
    """The largest stage cost."""
    stage_memory: tuple[float, ...] = ()
    """Per stage: its memory (bytes), when memory was given; empty otherwise."""

    def __post_init__(self) -> None:
        assert self.ranges and self.ranges[0][0] == 0, self.ranges
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


def optimal_partition(costs: Sequence[float], K: int, *, boundary_s: Sequence[float] | None = None,
                      stage0_extra_s: float = 0.0, memory: Sequence[float] | None = None,
                      stage0_extra_memory: float = 0.0, memory_limit: float | None = None) -> Partition:
    """The exact min-bottleneck split of ``costs`` into K stages (see the module docstring).

    ``boundary_s``: seconds to move layer i's output to the next stage (length n, or n-1: the last
    layer's output never crosses a cut). ``memory``: bytes per layer; with ``memory_limit`` every
    stage must fit. Raises InfeasibleError with the numbers when no split fits.
    """
    c = _vector("costs", costs)
    n = len(c)
    if n == 0:
        raise PtplanError("nothing to partition: the list of layer costs is empty")
    if isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1:
        raise PtplanError(f"number of stages K is {K!r}; it must be an integer >= 1")
    K = int(K)
    if K > n:
        raise InfeasibleError(f"cannot split {n} layers into K={K} stages: every stage needs at least one "
                              f"layer; use K <= {n}")
    beta = np.zeros(n + 1)
    if boundary_s is not None:
        b = _vector("boundary_s", boundary_s)
        if len(b) not in (n, n - 1):
            raise PtplanError(f"boundary_s has {len(b)} entries for {n} layers; give {n} (or {n - 1})")
        beta[1:n] = b[:n - 1]
    extra = _scalar("stage0_extra_s", stage0_extra_s)
    S = np.concatenate(([0.0], np.cumsum(c)))

    mem_reach = np.full(n + 1, n, dtype=np.int64)   # largest j with [i, j) within memory
    Mp = None
    if memory is not None:
        m = _vector("memory", memory, n)
        mextra = _scalar("stage0_extra_memory", stage0_extra_memory)
        Mp = np.concatenate(([0.0], np.cumsum(m)))
        if memory_limit is not None:
            if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float, np.number)) \
                    or not math.isfinite(memory_limit) or memory_limit <= 0:
                raise PtplanError(f"memory_limit is {memory_limit!r}; it must be a positive number of bytes")
            lim = float(memory_limit) * (1 + _TOL)
            mem_reach = np.searchsorted(Mp, Mp + lim, side="right") - 1
            mem_reach[0] = np.searchsorted(Mp, lim - mextra, side="right") - 1 if mextra <= lim else 0
            if (mem_reach[:n] <= np.arange(n)).any() or Mp[n] + mextra > K * lim:
                _raise_memory(m, mextra, float(memory_limit), K)
    elif memory_limit is not None:
        raise PtplanError("memory_limit was given without per-layer memory")

    if K == 1:
        if mem_reach[0] < n:
            _raise_memory(np.diff(Mp), float(stage0_extra_memory), float(memory_limit), K)
        return _result([0, n], S, beta, extra, Mp, float(stage0_extra_memory))

    # stage 0 = [0, j) for every j
    js = np.arange(n + 1)
    first = S + beta + extra
    first_ok = (js >= 1) & (js <= mem_reach[0])

    # An upper bound UB on T* from a prefix-sum split. A stage [i, j) costs at least S[j] - S[i], so
    # only stages with S[j] - S[i] <= UB matter: reach[i] = last such j (and within memory).
    UB = _quick_bound(S, beta, extra, K, mem_reach)
    reach = mem_reach.copy()
    if math.isfinite(UB):
        reach = np.minimum(reach, np.searchsorted(S, S + UB * (1 + 1e-9), side="right") - 1)
        reach[0] = min(reach[0], int(np.searchsorted(S, UB * (1 + 1e-9) - extra, side="right")) - 1)
    reach = np.maximum(reach, js)
    w = max(1, int((reach[1:n] - js[1:n]).max(initial=1)))

    # Rows j that k stages can cover and still leave a split of the rest: reach is non-decreasing
    # for i >= 1, so the farthest prefix after k stages is reach applied k times, and the nearest is
    # the least j from which K - k more stages still reach n.
    rl = reach.tolist()
    top, bot = [0] * (K + 1), [0] * (K + 1)
    top[1] = rl[0]
    for k in range(2, K + 1):
        top[k] = rl[top[k - 1]]
    bot[K] = n
    for k in range(K - 1, 0, -1):
        bot[k] = bisect_left(rl, bot[k + 1], 1, n)
    lo_k = [max(bot[k], k) for k in range(K + 1)]
    hi_k = [min(top[k], n - K + k) + 1 for k in range(K + 1)]    # exclusive
    if any(lo_k[k] >= hi_k[k] for k in range(1, K + 1)):
        assert Mp is not None and memory_limit is not None, "no rows left without a memory limit"
        _raise_memory(np.diff(Mp), float(stage0_extra_memory), float(memory_limit), K)
    c0 = min(lo_k[2:])

    # band[d, j - c0] = cost of the stage [i, j) with i = j - 1 - d >= 1 (inf where not allowed), for
    # the columns j >= c0 that some row window uses
    jj = js[None, c0:]
    I = jj - 1 - np.arange(w)[:, None]
    Ic = np.maximum(I, 0)
    band = np.where((I >= 1) & (jj <= reach[Ic]), S[jj] - S[Ic] + beta[Ic] + beta[jj], np.inf)

    # F[k, j] = least slowest-stage cost covering [0, j) with k stages, stored at column w + j;
    # prev[k, d, j] views F[k, j - 1 - d] without copying
    F = np.full((K + 1, w + n + 1), np.inf)
    F[1, w:] = np.where(first_ok, first, np.inf)
    prev = _lagged(F, w)
    buf = np.empty((w, n + 1 - c0))
    for k in range(2, K + 1):
        lo, hi = lo_k[k], hi_k[k]
        out = buf[:, lo - c0:hi - c0]
        np.maximum(prev[k - 1, :, lo:hi], band[:, lo - c0:hi - c0], out=out)
        np.minimum.reduce(out, axis=0, out=F[k, w + lo:w + hi])
    T = float(F[K, w + n])
    if not math.isfinite(T):
        assert Mp is not None and memory_limit is not None, "no split found without a memory limit"
        _raise_memory(np.diff(Mp), float(stage0_extra_memory), float(memory_limit), K)

    # pass 2: among splits whose every stage is <= T, the least sum of squared stage costs
    Q = np.full((K + 1, w + n + 1), np.inf)
    Q[1, w:] = np.where(first_ok & (first <= T), first * first, np.inf)
    qprev = _lagged(Q, w)
    band_sq = np.where(band <= T, band * band, np.inf)
    for k in range(2, K + 1):
        lo, hi = lo_k[k], hi_k[k]
        out = buf[:, lo - c0:hi - c0]
        np.add(qprev[k - 1, :, lo:hi], band_sq[:, lo - c0:hi - c0], out=out)
        np.minimum.reduce(out, axis=0, out=Q[k, w + lo:w + hi])
    assert math.isfinite(Q[K, w + n]), "pass 2 lost the optimum"

    # walk back: the first d (latest cut) that attains each optimum; same float sums as above
    cuts = [n]
    j = n
    for k in range(K, 1, -1):
        j = j - 1 - int((qprev[k - 1, :, j] + band_sq[:, j - c0]).argmin())
        cuts.append(j)
    cuts.append(0)
    cuts.reverse()
    return _result(cuts, S, beta, extra, Mp, float(stage0_extra_memory))


def _lagged(A: np.ndarray, w: int) -> np.ndarray:
    """A view V of the C-contiguous (rows, w + n + 1) array A with V[k, d, j] = A[k, w + j - 1 - d]."""
    rows, cols = A.shape
    return np.ndarray((rows, w, cols - w), dtype=A.dtype, buffer=A, offset=(w - 1) * A.itemsize,
                      strides=(A.strides[0], -A.itemsize, A.itemsize))


def _result(cuts: list[int], S: np.ndarray, beta: np.ndarray, extra: float, Mp: np.ndarray | None,
            mextra: float) -> Partition:
    """The Partition for stage boundaries ``cuts`` (0, ..., n), with its costs and memory."""
    b = np.array(cuts)
    lo, hi = b[:-1], b[1:]
    ranges = tuple(zip(cuts[:-1], cuts[1:]))
    costs = S[hi] - S[lo] + beta[lo] + beta[hi]
    costs[0] += extra
    mem: tuple[float, ...] = ()
    if Mp is not None:
        m = Mp[hi] - Mp[lo]
        m[0] += mextra
        mem = tuple(m.tolist())
    return Partition(ranges=ranges, stage_costs=tuple(costs.tolist()), bottleneck=float(costs.max()),
                     stage_memory=mem)


def _quick_bound(S: np.ndarray, beta: np.ndarray, extra: float, K: int, reach: np.ndarray) -> float:
    """Bottleneck of the split that cuts nearest to k/K of the total work (stage 0's extra included).

    inf if that split breaks the memory limit (then only memory narrows the search).
    """
    n = len(S) - 1
    targets = (S[n] + extra) * np.arange(1, K) / K - extra
    cuts = np.minimum(np.maximum(np.searchsorted(S, targets, side="left"), 1), n)
    cuts -= (targets - S[cuts - 1]) < (S[cuts] - targets)        # the nearer of the two prefix sums
    idx = np.arange(1, K)
    cuts = np.minimum(np.maximum(cuts, idx), n - K + idx)
    cuts = np.maximum.accumulate(cuts - idx) + idx      # strictly increasing, still room for the rest
    b = np.concatenate(([0], cuts, [n]))
    if (reach[b[:-1]] < b[1:]).any():
        return math.inf
    costs = S[b[1:]] - S[b[:-1]] + beta[b[1:]] + beta[b[:-1]]
    costs[0] += extra
    return float(costs.max())


class MemoryInfeasibleError(InfeasibleError):
    """No K-stage split fits in GPU memory.

    The message names the best split's largest stage, which costs one more partition to find, so it
    is computed only when the message is read: a planner that catches this and tries another K
    pays nothing for it.
    """

    def __init__(self, memory: np.ndarray, extra: float, limit: float, K: int) -> None:
        super().__init__()
        self.memory, self.extra, self.limit, self.K = memory, extra, limit, K
        self._msg: str | None = None

    def __str__(self) -> str:
        if self._msg is None:
            m, extra, limit, K = self.memory, self.extra, self.limit, self.K
            need = optimal_partition(m, K, stage0_extra_s=extra).bottleneck
            self._msg = (
                f"no split of {len(m)} layers into K={K} stages fits: the best split's largest stage needs "
                f"{need / GiB:.2f} GiB but a GPU has {limit / GiB:.2f} GiB (all layers together: "
                f"{(m.sum() + extra) / GiB:.2f} GiB); use a longer pipeline (larger K), a smaller micro-batch, "
                "or GPUs with more memory")
        return self._msg


def _raise_memory(m: np.ndarray, extra: float, limit: float, K: int) -> None:
    if extra + m[0] > limit:
        raise InfeasibleError(
            f"stage 0 needs at least {(extra + m[0]) / GiB:.2f} GiB (frozen prefix {extra / GiB:.2f} GiB + "
            f"layer 0 {m[0] / GiB:.2f} GiB) but a GPU has {limit / GiB:.2f} GiB; use a smaller micro-batch, "
            "cache the frozen prefix, or GPUs with more memory")
    big = int(np.argmax(m))
    if m[big] > limit:
        raise InfeasibleError(
            f"layer {big} alone needs {m[big] / GiB:.2f} GiB but a GPU has {limit / GiB:.2f} GiB; use a smaller "
            "micro-batch or GPUs with more memory")
    raise MemoryInfeasibleError(m, extra, limit, K)


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
