"""Token-level pipelining (TeraPipe): the optimal cut of one sequence into token slices for a pipeline.

Legend: L tokens per sequence, K pipeline stages, a slice of s tokens that starts after c earlier
tokens of the same sequence (its context: a causal model's slice attends to them), b samples per
micro-batch, g the slice-length granularity (slices are multiples of g tokens; L a multiple of g).

A stage's latency for one slice is ``t(s, c)``; with slices s_1 .. s_n (contexts c_i = s_1 + … +
s_{i-1}) flowing through K stages one after another, the pipeline's latency is TeraPipe's objective

    T = Σ_i t(s_i, c_i) + (K − 1) · max_i t(s_i, c_i)

(every slice passes every stage once; the slowest slice sets the fill and drain). A later slice
attends to more context, so the best slices are non-uniform: shorter towards the end.

``optimal_slices`` solves it exactly (TeraPipe's algorithm): for each candidate bound τ on the
slowest slice -- the distinct values t(s, c) takes -- a dynamic program over slice ends gives the
smallest Σ t with every slice ≤ τ, f(i) = min over j < i with t(i−j, j) ≤ τ of f(j) + t(i−j, j), and
T(τ) = f(L) + (K − 1)·τ. Candidates are taken in increasing τ and the search stops once
(K − 1)·τ alone reaches the best T found (no larger τ can win). The DP runs on many candidates at
once with numpy (one vectorised row per slice end). ``brute_force_slices`` enumerates every
composition of L (tests, L ≤ 16).

The cost model (``SliceCost``) is TeraPipe's: linear in b·s, b·c and b·s·c plus a constant, fitted by
least squares to measured (b, s, c, seconds) points (``fit_slice_cost``, with its relative error).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import PtplanError


@dataclass(frozen=True)
class SliceCost:
    """t(s, c) = const + per_token·b·s + per_context·b·c + per_pair·b·s·c seconds, for b samples."""

    const: float
    per_token: float
    per_context: float
    per_pair: float
    b: int = 1
    fit_error: float | None = None
    """Median relative error of the fit on its own points (None when not fitted)."""

    def __call__(self, s: np.ndarray | float, c: np.ndarray | float) -> np.ndarray | float:
        b = self.b
        return self.const + b * (self.per_token * s + self.per_context * c + self.per_pair * s * c)


def fit_slice_cost(points: Sequence[tuple[int, int, int, float]]) -> SliceCost:
    """Least-squares fit of ``SliceCost`` to (b, s, c, seconds) points; b of the result is 1 (set it with
    ``dataclasses.replace``). Needs at least 4 points that pin the 4 coefficients."""
    if len(points) < 4:
        raise PtplanError(f"fitting the slice cost needs at least 4 measured (b, s, c) points, got {len(points)}")
    A = np.array([[1.0, b * s, b * c, b * s * c] for b, s, c, _ in points], dtype=float)
    y = np.array([t for *_, t in points], dtype=float)
    if np.linalg.matrix_rank(A) < 4:
        raise PtplanError("the measured (b, s, c) points do not pin the slice cost's 4 coefficients; measure "
                          "several slice lengths s and contexts c")
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    pred = A @ coef
    err = float(np.median(np.abs(pred - y) / np.maximum(np.abs(y), 1e-12)))
    return SliceCost(const=float(coef[0]), per_token=float(coef[1]), per_context=float(coef[2]),
                     per_pair=float(coef[3]), b=1, fit_error=err)


@dataclass(frozen=True)
class Slicing:
    """The chosen slices and what the objective says of them."""

    slices: tuple[int, ...]
    """Slice lengths in tokens, in order (they sum to L)."""
    latency_s: float
    """T = Σ t + (K − 1)·max t."""
    slowest_s: float
    candidates: int = 0
    """Bounds τ the search evaluated (the rest were pruned)."""


def _latency(cost, slices: Sequence[int], K: int) -> tuple[float, float]:
    c, ts = 0, []
    for s in slices:
        ts.append(float(cost(s, c)))
        c += s
    return sum(ts) + (K - 1) * max(ts), max(ts)


def _table(cost, n: int, g: int) -> np.ndarray:
    """t[j, i] = the latency of the slice from unit j to unit i (tokens j·g .. i·g), inf where i <= j."""
    j = np.arange(n + 1)[:, None]
    i = np.arange(n + 1)[None, :]
    s, c = (i - j) * g, j * g
    t = np.where(i > j, np.asarray(cost(s.astype(float), np.broadcast_to(c, s.shape).astype(float)), dtype=float),
                 np.inf)
    if np.any(t[i > j] < 0) or not np.all(np.isfinite(t[i > j])):
        raise PtplanError("the slice cost gives a negative or non-finite latency; refit it on more points")
    return t


def optimal_slices(cost, L: int, K: int, *, granularity: int = 1, batch: int = 256, prune: bool = True) -> Slicing:
    """The slicing of L tokens (multiples of ``granularity``) minimising T for K stages (module docstring).
    ``prune=False`` evaluates every candidate bound (tests of the pruning)."""
    if L < 1 or K < 1:
        raise PtplanError(f"token slicing needs L >= 1 tokens and K >= 1 stages, got L={L}, K={K}")
    g = granularity
    if g < 1 or L % g:
        raise PtplanError(f"the sequence length {L} is not a multiple of the slice granularity {g}; use a divisor "
                          f"of {L}")
    n = L // g
    t = _table(cost, n, g)
    taus = np.unique(t[np.isfinite(t)])
    best, best_tau, used = math.inf, None, 0
    for a in range(0, len(taus), batch):
        chunk = taus[a:a + batch]
        if prune:
            chunk = chunk[(K - 1) * chunk < best]
        if len(chunk) == 0:
            break
        used += len(chunk)
        f = np.full((len(chunk), n + 1), np.inf)
        f[:, 0] = 0.0
        for i in range(1, n + 1):
            col = t[:i, i]  # slices ending at unit i, from every start j < i
            ok = col[None, :] <= chunk[:, None]
            f[:, i] = np.min(np.where(ok, f[:, :i] + col[None, :], np.inf), axis=1)
        total = f[:, n] + (K - 1) * chunk
        k = int(np.argmin(total))
        if total[k] < best:
            best, best_tau = float(total[k]), float(chunk[k])
    assert best_tau is not None
    slices = _backtrack(t, n, best_tau)
    lat, slow = _latency(cost, [s * g for s in slices], K)
    return Slicing(slices=tuple(s * g for s in slices), latency_s=lat, slowest_s=slow, candidates=used)


def _backtrack(t: np.ndarray, n: int, tau: float) -> list[int]:
    f = np.full(n + 1, np.inf)
    arg = np.zeros(n + 1, dtype=int)
    f[0] = 0.0
    for i in range(1, n + 1):
        col = t[:i, i]
        v = np.where(col <= tau, f[:i] + col, np.inf)
        arg[i] = int(np.argmin(v))
        f[i] = v[arg[i]]
    out, i = [], n
    while i > 0:
        out.append(i - arg[i])
        i = arg[i]
    return [int(s) for s in out[::-1]]


def brute_force_slices(cost, L: int, K: int) -> Slicing:
    """Every composition of L (2^(L-1) of them): the exact optimum by enumeration (tests; L <= 16)."""
    if L > 16:
        raise PtplanError(f"brute force over 2^{L - 1} slicings is for tests (L <= 16), not L={L}")
    best: tuple[float, float, tuple[int, ...]] | None = None
    for cuts in itertools.product((False, True), repeat=L - 1):
        slices, run = [], 1
        for cut in cuts:
            if cut:
                slices.append(run)
                run = 1
            else:
                run += 1
        slices.append(run)
        lat, slow = _latency(cost, slices, K)
        if best is None or lat < best[0]:
            best = (lat, slow, tuple(slices))
    assert best is not None
    return Slicing(slices=best[2], latency_s=best[0], slowest_s=best[1], candidates=2 ** (L - 1))


def uniform_slices(cost, L: int, K: int, n: int) -> Slicing:
    """n slices of (nearly) equal length: the baseline token slicing without the search."""
    q, r = divmod(L, n)
    slices = [q + (1 if i < r else 0) for i in range(n)]
    lat, slow = _latency(cost, slices, K)
    return Slicing(slices=tuple(slices), latency_s=lat, slowest_s=slow)
