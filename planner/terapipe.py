"""Token-level pipelining (TeraPipe): the optimal cut of one sequence into token slices for a pipeline.

Legend: L tokens per sequence, K pipeline stages, a slice of s tokens that starts after c earlier
tokens of the same sequence (its context: a causal model's slice attends to them), b samples per
micro-batch, g the slice-length granularity (slices are multiples of g tokens; L a multiple of g).

A stage's latency for one slice is ``t(s, c)``; with slices s_1 .. s_n (contexts c_i = s_1 + … +
s_{i-1}) flowing through K stages one after another, the pipeline's latency is TeraPipe's objective

    T = Σ_i t(s_i, c_i) + (K − 1) · max_i t(s_i, c_i)

(every slice passes every stage once; the slowest slice sets the fill and drain). With M micro-batches
whose slices all flow through one after another (``repeat`` = M) it is M·Σ t + (K − 1)·max t. A later slice
attends to more context, so the best slices are non-uniform: shorter towards the end.

``optimal_slices`` solves it exactly (TeraPipe's algorithm): for each candidate bound τ on the
slowest slice -- the distinct values t(s, c) takes -- a dynamic program over slice ends gives the
smallest Σ t with every slice ≤ τ, f(i) = min over j < i with t(i−j, j) ≤ τ of f(j) + t(i−j, j), and
T(τ) = f(L) + (K − 1)·τ. Candidates are taken in increasing τ and the search stops once
M·f∞(L) + (K − 1)·τ reaches the best T found, f∞ being the DP with no bound (no larger τ can win: a bound
only removes slicings, so f(L) ≥ f∞(L)). The DP runs on many candidates at
once with numpy (one vectorised row per slice end). ``brute_force_slices`` enumerates every
composition of L (tests, L ≤ 16).

The cost model (``SliceCost``) is TeraPipe's: linear in b·s, b·c and b·s·c plus a constant, fitted by
least squares to measured (b, s, c, seconds) points (``fit_slice_cost``, with its relative error).
In a plan (``token_slice_phase``) and in ``sliced_phase`` the fit gives only the *shape* of t(s, c): the stage's
compute is the one stage model's (``stage.StageModel.stage_costs``, the profile's measured layers), cut into
slices by ``slice_costs``, where every slice also pays the per-action overhead, the latency of its own
tensor-parallel all-reduces and of its messages again (α + β·bytes·s/L).

``square=True`` adds a b·s² term: the slice's attention over its own tokens (s·s/2 pairs), which
TeraPipe's form misses and which dominates long slices on a CPU (on the shipped gpt2 block: median
error 3-4 % with it, 17-25 % without; ``relative=True`` fits relative rather than absolute errors,
``nonnegative=True`` keeps every coefficient >= 0).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .errors import InfeasibleError, PtplanError
from .simulate import SliceCosts, StageCost


@dataclass(frozen=True)
class SliceCost:
    """t(s, c) = const + per_token·b·s + per_context·b·c + per_pair·b·s·c (+ per_square·b·s²) seconds, for b
    samples."""

    const: float
    per_token: float
    per_context: float
    per_pair: float
    b: int = 1
    fit_error: float | None = None
    """Median relative error of the fit on its own points (None when not fitted)."""
    per_square: float = 0.0
    """The b·s² term (0 in TeraPipe's form)."""

    def __call__(self, s: np.ndarray | float, c: np.ndarray | float) -> np.ndarray | float:
        b = self.b
        return self.const + b * (self.per_token * s + self.per_context * c + self.per_pair * s * c
                                 + self.per_square * s * s)


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares, exactly, for a few columns (here 4 or 5) of full column rank: the optimum
    is the unconstrained least-squares solution on its own support, so it is the best of the supports whose
    least-squares solution is >= 0 (2^n of them; the empty support, x = 0, is always feasible)."""
    n = A.shape[1]
    best, best_res = np.zeros(n), float(y @ y)
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sub, *_ = np.linalg.lstsq(A[:, cols], y, rcond=None)
        if (sub < 0).any():
            continue
        x = np.zeros(n)
        x[cols] = sub
        r = y - A @ x
        res = float(r @ r)
        if res < best_res:
            best, best_res = x, res
    return best


def fit_slice_cost(points: Sequence[tuple[int, int, int, float]], *, square: bool = False,
                   relative: bool = False, nonnegative: bool = False) -> SliceCost:
    """Least-squares fit of ``SliceCost`` to (b, s, c, seconds) points; b of the result is 1 (set it with
    ``dataclasses.replace``). Needs at least 4 points (5 with ``square``) that pin the coefficients.
    ``relative``: minimise the relative errors (rows weighted by 1 / seconds) instead of the absolute.
    ``nonnegative``: every coefficient >= 0 (``_nnls``), so no slice gets a negative time when the
    fit is used beyond its points."""
    n = 5 if square else 4
    if len(points) < n:
        raise PtplanError(f"fitting the slice cost needs at least {n} measured (b, s, c) points, got {len(points)}")
    A = np.array([[1.0, b * s, b * c, b * s * c] + ([b * s * s] if square else []) for b, s, c, _ in points],
                 dtype=float)
    y = np.array([t for *_, t in points], dtype=float)
    if np.linalg.matrix_rank(A) < n:
        raise PtplanError(f"the measured (b, s, c) points do not pin the slice cost's {n} coefficients; measure "
                          "several slice lengths s and contexts c")
    w = 1.0 / np.maximum(np.abs(y), 1e-12) if relative else np.ones_like(y)
    if nonnegative:
        coef = _nnls(A * w[:, None], y * w)
    else:
        coef, *_ = np.linalg.lstsq(A * w[:, None], y * w, rcond=None)
    pred = A @ coef
    err = float(np.median(np.abs(pred - y) / np.maximum(np.abs(y), 1e-12)))
    return SliceCost(const=float(coef[0]), per_token=float(coef[1]), per_context=float(coef[2]),
                     per_pair=float(coef[3]), b=1, fit_error=err, per_square=float(coef[4]) if square else 0.0)


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


def _latency(cost, slices: Sequence[int], K: int, repeat: int = 1) -> tuple[float, float]:
    c, ts = 0, []
    for s in slices:
        ts.append(float(cost(s, c)))
        c += s
    return repeat * sum(ts) + (K - 1) * max(ts), max(ts)


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


def optimal_slices(cost, L: int, K: int, *, granularity: int = 1, batch: int = 256, prune: bool = True,
                   repeat: int = 1) -> Slicing:
    """The slicing of L tokens (multiples of ``granularity``) minimising T for K stages (module docstring).
    ``prune=False`` evaluates every candidate bound (tests of the pruning). ``repeat``: M, the number of
    micro-batches sliced alike (T = M·Σ t + (K − 1)·max t; ``latency_s`` is that T)."""
    if L < 1 or K < 1 or repeat < 1:
        raise PtplanError(f"token slicing needs L >= 1 tokens, K >= 1 stages and M >= 1 micro-batches, got L={L}, "
                          f"K={K}, M={repeat}")
    g = granularity
    if g < 1 or L % g:
        raise PtplanError(f"the sequence length {L} is not a multiple of the slice granularity {g}; use a divisor "
                          f"of {L}")
    n = L // g
    t = _table(cost, n, g)
    taus = np.unique(t[np.isfinite(t)])
    floor = repeat * _min_sum(t, n) if prune else 0.0  # T(τ) >= M·f∞(L) + (K − 1)·τ for every τ
    best, best_tau, used = math.inf, None, 0
    for a in range(0, len(taus), batch):
        chunk = taus[a:a + batch]
        if prune:
            chunk = chunk[floor + (K - 1) * chunk < best]
        if len(chunk) == 0:
            break
        used += len(chunk)
        f = np.full((len(chunk), n + 1), np.inf)
        f[:, 0] = 0.0
        for i in range(1, n + 1):
            col = t[:i, i]  # slices ending at unit i, from every start j < i
            ok = col[None, :] <= chunk[:, None]
            f[:, i] = np.min(np.where(ok, f[:, :i] + col[None, :], np.inf), axis=1)
        total = repeat * f[:, n] + (K - 1) * chunk
        k = int(np.argmin(total))
        if total[k] < best:
            best, best_tau = float(total[k]), float(chunk[k])
    assert best_tau is not None
    slices = _backtrack(t, n, best_tau)
    lat, slow = _latency(cost, [s * g for s in slices], K, repeat)
    return Slicing(slices=tuple(s * g for s in slices), latency_s=lat, slowest_s=slow, candidates=used)


def _min_sum(t: np.ndarray, n: int) -> float:
    """f∞(n): the least Σ t over every slicing of the n units, no bound on a slice."""
    f = np.full(n + 1, np.inf)
    f[0] = 0.0
    for i in range(1, n + 1):
        f[i] = np.min(f[:i] + t[:i, i])
    return float(f[n])


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


def brute_force_slices(cost, L: int, K: int, repeat: int = 1) -> Slicing:
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
        lat, slow = _latency(cost, slices, K, repeat)
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


# ---- from a profile to a pipeline's token slicing ---------------------------------------------------

def profile_slice_cost(profile, b: int = 1, part: str = "both") -> SliceCost:
    """The profile's measured block slice cost (``Profile.token_slices``) for b samples: the forward, the
    backward or both (TeraPipe's t is a slice's forward plus backward), with the fit's error."""
    sp = profile.token_slices
    if sp is None:
        raise PtplanError(f"profile {profile.model.name} has no token-slice costs; measure them with `ptplan profile "
                          f"{profile.model.name} --slices` (or python -m ptplan.executor.profiling.slices)")
    fits = {"forward": (sp.forward,), "backward": (sp.backward,), "both": (sp.forward, sp.backward)}
    if part not in fits:
        raise PtplanError(f"part must be forward, backward or both, got {part!r}")
    fs = fits[part]
    return SliceCost(const=sum(f.const for f in fs), per_token=sum(f.per_token for f in fs),
                     per_context=sum(f.per_context for f in fs), per_pair=sum(f.per_pair for f in fs), b=b,
                     fit_error=max(f.fit_error for f in fs), per_square=sum(f.per_square for f in fs))


@dataclass(frozen=True)
class StageSliceModel:
    """Per stage k of a token-sliced pipeline: forward_k(s, c) = blocks_k · F(s, c) + token_fwd_k · s and
    backward_k likewise, with F, B the profile's block slice fits (for b samples) and token_* the
    per-token seconds of the stage's token-wise layers (embedding, norm, head: the profile's time at
    its sequence length, divided by it). Attention and MLP halves count half a block each."""

    blocks: tuple[float, ...]
    token_forward_s: tuple[float, ...]
    token_backward_s: tuple[float, ...]
    forward: SliceCost
    backward: SliceCost

    def times(self, s, c) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds, shape [K, *broadcast(s, c)]."""
        s, c = np.asarray(s, dtype=float), np.asarray(c, dtype=float)
        nb = np.asarray(self.blocks).reshape((-1,) + (1,) * np.broadcast(s, c).ndim)
        tf = np.asarray(self.token_forward_s).reshape(nb.shape)
        tb = np.asarray(self.token_backward_s).reshape(nb.shape)
        return nb * self.forward(s, c) + tf * s, nb * self.backward(s, c) + tb * s

    def slowest(self, s, c):
        """TeraPipe's t(s, c): the slowest stage's forward + backward of the slice."""
        f, b = self.times(s, c)
        return np.max(f + b, axis=0)


def stage_slice_model(profile, ranges: Sequence[tuple[int, int]], b: int) -> StageSliceModel:
    """``StageSliceModel`` of the stages covering layer ranges [lo, hi) of the profile, for b samples."""
    blocks, tf, tb = [], [], []
    for lo, hi in ranges:
        nb, f, bw = 0.0, 0.0, 0.0
        for r in profile.layers[lo:hi]:
            if r.kind == "block":
                nb += 1.0
            elif r.kind in ("attention", "mlp"):
                nb += 0.5
            else:
                f += profile.forward_s(r.index, b) / profile.model.seq_len
                bw += profile.backward_s(r.index, b) / profile.model.seq_len
        blocks.append(nb)
        tf.append(f)
        tb.append(bw)
    return StageSliceModel(blocks=tuple(blocks), token_forward_s=tuple(tf), token_backward_s=tuple(tb),
                           forward=profile_slice_cost(profile, b, "forward"),
                           backward=profile_slice_cost(profile, b, "backward"))


def balanced_ranges(costs: Sequence[float], lo: int, K: int) -> tuple[tuple[int, int], ...]:
    """The contiguous split of layers lo .. lo+len(costs)-1 into K stages minimising the slowest stage's
    summed cost (an O(n²K) dynamic program; n is a few dozen layers)."""
    n = len(costs)
    if not 1 <= K <= n:
        raise PtplanError(f"{n} active layers cannot fill K={K} stages; use K <= {n}")
    pre = np.concatenate(([0.0], np.cumsum(costs)))
    best = np.full((K + 1, n + 1), np.inf)
    arg = np.zeros((K + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, K + 1):
        for i in range(k, n + 1):
            js = np.arange(k - 1, i)
            v = np.maximum(best[k - 1, js], pre[i] - pre[js])
            a = int(np.argmin(v))
            best[k, i], arg[k, i] = v[a], js[a]
    out: list[tuple[int, int]] = []
    end = n
    for k in range(K, 0, -1):
        start = int(arg[k, end])
        out.append((lo + start, lo + end))
        end = start
    return tuple(out[::-1])


@dataclass(frozen=True)
class SlicedPhase:
    """One pipeline's token slicing for a phase and what the simulator predicts for it."""

    K: int
    D: int
    M: int
    b: int
    """Samples per micro-batch."""
    ranges: tuple[tuple[int, int], ...]
    """Per stage, its active layers [lo, hi)."""
    slices: tuple[int, ...]
    """The chosen token slices (``(L,)``: unsliced)."""
    iteration_s: float
    """Simulated iteration with the chosen slices (terapipe schedule)."""
    unsliced_s: float
    """Simulated iteration of the same phase without token slicing (GPipe)."""
    objective_s: float
    """TeraPipe's objective for the chosen slices: M·Σ t + (K − 1)·max t."""
    peak_memory_bytes: int = 0
    """The simulated peak of the busiest rank with the chosen slices (``StageModel``'s memory terms)."""
    fits: bool = True
    """Whether that peak fits the cluster's device memory (``TrainingConfig.memory_fraction`` of it); slices that
    do not fit are never chosen, and an unsliced phase that does not fit says so here."""


def slice_costs(model: StageSliceModel, costs: Sequence[StageCost], L: int, slices: Sequence[int]) -> SliceCosts:
    """THE per-slice costs of a pipeline: the one stage model's per-micro-batch costs (``costs``, from
    ``StageModel.stage_costs``) cut into token slices. Per stage k and slice j of s_j tokens after c_j:

        compute_k = forward_s − tp_comm_s − overhead_s           (the stage's measured layers, whole sequence)
        forward_kj = compute_k · F_k(s_j, c_j) / F_k(L, 0)       (the slice fit's shape, the profile's scale)
                   + overhead_s                                   (every slice is one more action)
                   + tp_comm_latency_s + (tp_comm_s − tp_comm_latency_s) · s_j / L
                                                                  (every slice all-reduces its own rows over tp)

    and the backward alike (``backward_s`` holds as many all-reduces). Each stage's compute row is raised where
    needed so that its slices cost at least the whole sequence: slicing never removes work (a fit whose b·s·c and
    b·s² terms disagree would otherwise make many short slices look cheaper than the sequence). Messages pay
    α + β·bytes·s/L per slice in the simulator (``StageCost.send_*_latency_s``)."""
    slices = tuple(int(x) for x in slices)
    offs = np.cumsum([0, *slices[:-1]]).astype(float)
    sl = np.asarray(slices, dtype=float)
    f, bw = model.times(sl, offs)
    f_full, b_full = model.times(float(L), 0.0)
    rows = []
    for shape, full, attr in ((f, f_full, "forward_s"), (bw, b_full, "backward_s")):
        comp = np.array([max(getattr(c, attr) - c.tp_comm_s - c.overhead_s, 0.0) for c in costs])
        scaled = shape * np.where(full > 0, comp / np.where(full > 0, full, 1.0), 0.0)[:, None]
        tot = scaled.sum(axis=1)
        scaled *= np.where((tot > 0) & (tot < comp), comp / np.where(tot > 0, tot, 1.0), 1.0)[:, None]
        extra = np.array([[c.overhead_s + c.tp_comm_latency_s + (c.tp_comm_s - c.tp_comm_latency_s) * n / L
                           for n in slices] for c in costs])
        rows.append(scaled + extra)
    return SliceCosts(tokens=slices, forward_s=tuple(map(tuple, rows[0])), backward_s=tuple(map(tuple, rows[1])))


def _slice_candidates(model: StageSliceModel, costs: Sequence[StageCost], L: int, K: int, M: int,
                      granularity: int) -> tuple[int, ...]:
    """Candidate slicings: TeraPipe's optimum for the slowest stage's slice cost (``optimal_slices`` on the priced
    costs, repeat = M) and 2-8 even slices, each simulated by the caller."""
    def slowest(s, c):
        s_arr, c_arr = np.broadcast_arrays(np.asarray(s, dtype=float), np.asarray(c, dtype=float))
        flat_s, flat_c = s_arr.ravel(), c_arr.ravel()
        f, bw = model.times(flat_s, flat_c)
        f_full, b_full = model.times(float(L), 0.0)
        out = np.zeros_like(flat_s)
        for k, c0 in enumerate(costs):
            tf = c0.forward_s - c0.tp_comm_s - c0.overhead_s
            tb = c0.backward_s - c0.tp_comm_s - c0.overhead_s
            t = (f[k] * (tf / f_full[k] if f_full[k] > 0 else 0.0) + bw[k] * (tb / b_full[k] if b_full[k] > 0 else 0.0)
                 + 2 * (c0.overhead_s + c0.tp_comm_latency_s) + 2 * (c0.tp_comm_s - c0.tp_comm_latency_s) * flat_s / L)
            out = np.maximum(out, t)
        return out.reshape(s_arr.shape)

    opt = optimal_slices(slowest, L, K, granularity=granularity, repeat=M)
    return opt.slices


def _sliced_length(profile, L: int | None, granularity: int, slicing: str) -> int:
    """The sequence length ``sliced_phase`` slices (the profile's); PtplanError for any other or a bad setting."""
    if slicing not in ("auto", "off"):
        raise PtplanError(f"token slicing must be auto or off, got {slicing!r}")
    L0 = profile.model.seq_len
    if L is not None and L != L0:
        raise PtplanError(f"sliced_phase prices the profile's measured layers at their sequence length {L0}, not "
                          f"L={L}; profile the model at seq_len {L} (ptplan profile ... --seq-len {L} --slices)")
    if L0 % granularity:
        raise PtplanError(f"sequence length {L0} is not a multiple of the slice granularity {granularity}")
    return L0


def _checked_ranges(ranges: Sequence[tuple[int, int]], K: int, n0: int, n: int) -> tuple[tuple[int, int], ...]:
    out = tuple((int(x), int(z)) for x, z in ranges)
    if len(out) != K or out[0][0] != n0 or out[-1][1] != n or any(
            x >= z or z != nxt for (x, z), (nxt, _) in zip(out, out[1:] + ((n, 0),))):
        raise PtplanError(f"stage ranges {list(out)} must be K={K} contiguous non-empty ranges covering the "
                          f"active layers [{n0}, {n})")
    return out


def sliced_phase(profile, *, K: int, M: int, b: int, D: int = 1, frozen_blocks: int = 0, granularity: int = 16,
                 slicing: str = "auto", cluster=None, cache: bool = False,
                 ranges: Sequence[tuple[int, int]] | None = None, L: int | None = None,
                 optimizer: str = "adamw", tp: int = 1) -> SlicedPhase:
    """Token slicing for one phase, priced by the one stage model (``stage.StageModel``, GPipe order on
    ``cluster``: default ``cpu:K·D``, this machine) and ``slice_costs``: the active layers (after
    ``frozen_blocks`` frozen ones) split into K stages balanced at full length (or ``ranges``, a plan's
    partition), TeraPipe's optimal slices for that pipeline and 2-8 even ones, each simulated with the
    ``terapipe`` schedule; ``slicing="auto"`` keeps the unsliced run where the simulator says it is faster or the
    slices do not fit the memory, so the choice is never worse than not slicing; "off" never slices. Messages,
    the frozen prefix (or the AutoCache with ``cache``), the data-parallel all-reduce, the optimizer step, the
    per-action overhead and the memory are the stage model's. L: the profile's sequence length (the stage model
    prices its measured layers at that length). ``tp``: every stage split over tp GPUs of a node (Megatron; the
    stage model's shard costs, each slice paying its own all-reduces) -- planned here, but not run by the executor
    (``slice_refusal``)."""
    from .cluster import charged_overheads, cpu_cluster, measured_host_io
    from .config import TrainingConfig
    from .costs import CostTable
    from .schedule import gpipe, peak_inflight, terapipe
    from .simulate import simulate
    from .stage import PhaseShape, StageModel, links_for
    from .strategy import tp_allreduce_coeffs
    from .tp_split import tp_refusal

    L = _sliced_length(profile, L, granularity, slicing)
    cl = charged_overheads(cluster if cluster is not None else cpu_cluster(K * D * tp), profile)
    if cl.world_size < K * D * tp:
        raise PtplanError(f"K·D·tp = {K}·{D}·{tp} = {K * D * tp} GPUs do not fit cluster {cl.name} "
                          f"({cl.world_size}); use a larger cluster or smaller K, D or tp")
    if tp > 1 and (why := tp_refusal(profile.model.family, profile.model.config, tp)):
        raise PtplanError(f"tp={tp} cannot split {profile.model.name}: {why}")
    cfg = TrainingConfig(epochs=1, samples_per_epoch=K * D * M * b, batch=D * M * b)  # its defaults: memory, host reads
    n0 = profile.frozen_boundary(frozen_blocks)
    table = CostTable(profile, time_scale=cl.concurrency_slowdown)
    shape = PhaseShape(K=K, M=M, b=b, D=D, frozen=n0, cache=cache, inflight=peak_inflight("gpipe", K, M, 1),
                       optimizer=optimizer, device_is_host=cl.device_is_host, action_overhead_s=cl.action_overhead_s,
                       host_io=measured_host_io(cl, profile, cfg.host_read_bandwidth), tp=tp, tp_ar=tp_allreduce_coeffs(cl, tp))
    sm = StageModel(table, shape, links_for(cl if tp == 1 else replace(cl, gpus_per_node=cl.gpus_per_node // tp), K))
    if ranges is None:
        tm = table.at(b)
        ranges = balanced_ranges((tm.fwd + tm.bwd)[n0:].tolist(), n0, K)
    ranges = _checked_ranges(ranges, K, n0, profile.num_layers)
    costs = sm.stage_costs(ranges)
    model = stage_slice_model(profile, ranges, b)
    limit = cl.gpu_memory_bytes * cfg.memory_fraction
    over = cl.step_overhead_s

    def run(slices: tuple[int, ...]) -> tuple[float, int]:
        if len(slices) == 1:
            sim = simulate(gpipe(K, M), costs, step_overhead_s=over)
        else:
            sim = simulate(terapipe(K, M, len(slices)), costs, step_overhead_s=over,
                           slice_costs=slice_costs(model, costs, L, slices))
        return sim.iteration_s, int(max(sim.rank_peak_memory_bytes))

    unsliced, peak0 = run((L,))
    best: tuple[int, ...] = (L,)
    best_t, best_peak = unsliced, peak0
    if slicing == "auto" and K > 1:
        opt = _slice_candidates(model, costs, L, K, M, granularity)
        for cand in sorted({opt} | {tuple(L // n + (1 if i < L % n else 0) for i in range(n))
                                    for n in (2, 3, 4, 6, 8) if n <= L // granularity}, key=len):
            if len(cand) < 2:
                continue
            t, peak = run(cand)
            if t < best_t and peak <= limit:
                best, best_t, best_peak = cand, t, peak
    sc = slice_costs(model, costs, L, best)
    ts = [float(np.max(np.asarray(sc.forward_s)[:, j] + np.asarray(sc.backward_s)[:, j])) for j in range(len(best))]
    return SlicedPhase(K=K, D=D, M=M, b=b, ranges=ranges, slices=best, iteration_s=best_t, unsliced_s=unsliced,
                       objective_s=M * sum(ts) + (K - 1) * max(ts), peak_memory_bytes=best_peak,
                       fits=best_peak <= limit)


def search_sliced(profile, *, gpus: int, batch: int, frozen_blocks: int = 0, granularity: int = 16,
                  slicing: str = "auto", tp: int = 1, **kw) -> SlicedPhase:
    """The fastest phase that fits the memory (else the fastest) over K (dividing ``gpus`` / tp, D = gpus / (K·tp))
    and M (dividing the pipeline's batch batch / D, b = batch / (D·M)), each with its token slicing
    (``sliced_phase``)."""
    n_active = profile.num_layers - profile.frozen_boundary(frozen_blocks)
    if tp < 1 or gpus % tp:
        raise PtplanError(f"tp={tp} must divide the {gpus} GPUs")
    g = gpus // tp
    best: SlicedPhase | None = None
    for K in range(1, g + 1):
        if g % K or K > n_active or batch % (g // K):
            continue
        D = g // K
        per = batch // D
        for M in range(1, per + 1):
            if per % M:
                continue
            ph = sliced_phase(profile, K=K, M=M, b=per // M, D=D, frozen_blocks=frozen_blocks,
                              granularity=granularity, slicing=slicing, tp=tp, **kw)
            if best is None or (ph.fits, -ph.iteration_s) > (best.fits, -best.iteration_s):
                best = ph
    if best is None:
        raise PtplanError(f"no pipeline of {gpus} GPUs splits a batch of {batch} evenly over D = GPUs / (K·tp) "
                          f"replicas")
    return best


def slice_plan(plan, profile, *, granularity: int = 16, **kw) -> tuple[SlicedPhase, ...]:
    """Token slicing for every phase of a plan (``ptplan plan``'s output for a causal LM): each phase's K, D,
    M, micro-batch size, tp, partition, frozen count and AutoCache choice, its slices chosen and simulated
    (``sliced_phase``; never worse than unsliced). Phases with V > 1 chunks per position are refused (token
    slices run one stage per position)."""
    from .families import TOKEN_SLICE_FAMILIES

    if profile.model.family not in TOKEN_SLICE_FAMILIES:
        raise PtplanError(f"token slicing is for causal LMs ({', '.join(TOKEN_SLICE_FAMILIES)}), not "
                          f"{profile.model.name}")
    out = []
    for ph in plan.phases:
        if ph.V != 1:
            raise PtplanError(f"phase with {ph.frozen_blocks} frozen blocks has V={ph.V}; token slices run one stage "
                              f"per position")
        out.append(sliced_phase(profile, K=ph.K, M=ph.M, b=ph.micro_batch_size, D=ph.D, tp=ph.tp,
                                frozen_blocks=ph.frozen_blocks, granularity=granularity, cache=ph.cache,
                                ranges=ph.partition, **kw))
    return tuple(out)


# ---- token slices in `ptplan plan` (--token-slices auto) ----------------------------------------------

def slice_granularity(L: int, units: int = 64) -> int:
    """The smallest divisor g of L with at most ``units`` slice units (L / g): the DP's resolution."""
    return next(g for g in range(1, L + 1) if L % g == 0 and L // g <= units)


def require_slice_costs(profile) -> None:
    """Refuse ``--token-slices auto`` for a model that is not a causal LM or a profile without slice costs."""
    from .plan import CAUSAL_SLICE_FAMILIES

    name = profile.model.name
    if profile.model.family not in CAUSAL_SLICE_FAMILIES:
        raise PtplanError(f"--token-slices auto is for causal LMs ({', '.join(CAUSAL_SLICE_FAMILIES)}), but "
                          f"{name} is a {profile.model.family} model; plan it with --token-slices off")
    if profile.token_slices is None:
        raise PtplanError(f"--token-slices auto needs the profile's token-slice costs, and profile {name} has none; "
                          f"measure them with `ptplan profile {name} --slices` (then plan with that profile), or "
                          f"plan with --token-slices off")


def slice_refusal(phase) -> str | None:
    """Why the executor cannot run ``phase`` token-sliced (None when it can): executor/runtime/sliced.py's loop runs
    the canonical (unsplit, unsharded) layers of one stage per position, GPipe-ordered, with its own point-to-point
    messages. The planner can price slices with tensor parallelism (``sliced_phase(tp=...)``, TeraPipe's own
    setting), but ``ptplan plan`` adds slices only where the runtime can run them."""
    why = []
    if phase.V != 1:
        why.append(f"V={phase.V} chunks per position (the loop runs one stage per position)")
    if phase.tp > 1:
        why.append(f"tp={phase.tp} (the loop runs the canonical layers, not their tensor-parallel twins)")
    if phase.any_fsdp:
        why.append("FSDP (its hooks are not wired into the loop)")
    if phase.any_recompute:
        why.append("recomputation (the loop keeps every slice's activations)")
    if phase.schedule == "2bw":
        why.append("2bw (flush-free weight versions; the simulator does not model slices across mini-batches)")
    return "; ".join(why) or None


def sliceable(phase) -> bool:
    """Whether the executor can run the phase token-sliced (``slice_refusal`` says why not)."""
    return slice_refusal(phase) is None


def _best_slicing(search, ranges, costs, K: int, M: int, b: int) -> tuple[float, tuple[int, ...]] | None:
    """(iteration, slices) of the fastest slicing of one split (TeraPipe's optimum and 2-8 even slices, each
    simulated with the ``terapipe`` schedule); None where no slicing fits the device's memory."""
    from .schedule import terapipe
    from .simulate import simulate

    profile = search.p
    L = profile.model.seq_len
    model = stage_slice_model(profile, ranges, b)
    opt = _slice_candidates(model, costs, L, K, M, slice_granularity(L))
    tries = {opt} | {tuple(L // n + (1 if i < L % n else 0) for i in range(n)) for n in (2, 3, 4, 6, 8) if n <= L}
    best: tuple[float, tuple[int, ...]] | None = None
    for cand in sorted(tries, key=len):
        if len(cand) < 2:
            continue
        sim = simulate(terapipe(K, M, len(cand)), costs, step_overhead_s=search.c.step_overhead_s,
                       slice_costs=slice_costs(model, costs, L, cand))
        if max(sim.rank_peak_memory_bytes) > search.limit:
            continue
        if best is None or sim.iteration_s < best[0]:
            best = (sim.iteration_s, cand)
    return best


def _sliced_split(search, choice, phase):
    """(ranges, their stage costs, their stage memory, (iteration, slices)) of the split whose best slicing is fastest. The search chose
    the split for the unsliced schedule; slices change what is best (a stage's bubble is filled differently), so
    the split is searched again on the sliced objective (``resplit.best_split``'s descent, from the better of the
    chosen split and AutoPipe's busy-time split; a local refinement by one-layer moves, ``wide=False``: each score
    here is a slice search and simulations with no bound to skip them, and the far and sideways moves doubled a
    sliced plan's time without changing a phase where measured). A phase with the AutoCache keeps its split (its
    fill iteration has costs of its own)."""
    from .partition import split_stages
    from .resplit import best_split

    K, M, b = phase.K, phase.M, phase.micro_batch_size
    if choice.cand.cache:
        return choice.ranges, choice.costs, choice.memory, _best_slicing(search, choice.ranges, choice.costs, K, M, b)
    # the phase's one strategy on every stage (slices run with neither FSDP nor recomputation): a candidate whose
    # stages chose theirs would choose again on another split, under costs its strategies would not name
    model = search.uniform_model(replace(choice.cand, fsdp_per_stage=False, recompute_per_stage=False),
                                 choice.ranges[0][0])
    limit = search.stage_limit(choice.cand) * (1 + 1e-12)
    scored: dict[tuple[int, ...], tuple[float, tuple[int, ...]] | None] = {}

    def score(cuts: tuple[int, ...], _best: float) -> float:  # memory: the sliced simulation's, in _best_slicing
        if cuts not in scored:  # the start is scored twice (choosing it, then by best_split)
            ranges = tuple(zip(cuts[:-1], cuts[1:]))
            scored[cuts] = _best_slicing(search, ranges, tuple(model.stage_costs(ranges)), K, M, b)
        got = scored[cuts]
        return got[0] if got is not None else math.inf

    def cuts_of(ranges) -> tuple[int, ...]:
        return (ranges[0][0], *(hi for _, hi in ranges))

    starts = [cuts_of(choice.ranges)]
    try:
        starts.append(cuts_of(split_stages(model, len(choice.ranges), limit).ranges))
    except InfeasibleError:
        pass
    start = min(dict.fromkeys(starts), key=lambda c: score(c, math.inf))
    cuts, t = best_split(start, score, enumerate_up_to=0, wide=False)
    if not math.isfinite(t):
        return choice.ranges, choice.costs, choice.memory, None
    ranges = tuple(zip(cuts[:-1], cuts[1:]))
    return ranges, tuple(model.stage_costs(ranges)), tuple(model.stage_memory(ranges)), scored[cuts]



def token_slice_phase(search, choice, phase, *, keep_timeline: bool = False, max_events: int = 20_000):
    """``phase`` (the planner's, from ``choice``) with token slices where they pay, else unchanged.

    Slice costs per stage: ``slice_costs`` -- the one stage model's costs of the phase (``choice.costs``) cut into
    slices along the profile's fitted block slice cost (``stage_slice_model``: its shape; the measured layers
    its scale), every slice paying the per-action overhead, its own tensor-parallel all-reduces and its messages'
    latency again. Candidates: TeraPipe's optimum for the slowest stage (``optimal_slices``, repeat = M) and 2-8
    even slices, the fastest in simulation kept. K = 1 phases stay unsliced (no bubble to fill). Each candidate
    is simulated with the ``terapipe`` schedule (GPipe order over slices) on the planner's own stage costs
    (messages, prefix, cache, all-reduce, optimizer, memory). It is taken only when its iteration is strictly
    faster than the phase's predicted one and its peak memory fits the device (every micro-batch in flight, as
    GPipe)."""
    from .plan import Prediction
    from .schedule import terapipe
    from .simulate import simulate

    profile = search.p
    if profile.token_slices is None or phase.K < 2:
        return phase
    if (why := slice_refusal(phase)) is not None:
        return replace(phase, notes=(*phase.notes, f"token slices not planned: the executor cannot run them with {why}"))
    K, M = phase.K, phase.M
    ranges, costs, stage_memory, best = _sliced_split(search, choice, phase)
    if best is None:
        return phase
    slices = best[1]
    L, overhead = profile.model.seq_len, search.c.step_overhead_s
    sc = slice_costs(stage_slice_model(profile, ranges, phase.micro_batch_size), costs, L, slices)
    f, bw = np.asarray(sc.forward_s), np.asarray(sc.backward_s)
    sched = terapipe(K, M, len(slices))
    events = keep_timeline and K * M * len(slices) * 6 <= max_events
    sim = simulate(sched, costs, step_overhead_s=overhead, slice_costs=sc, events=events)
    if sim.iteration_s >= phase.predicted.iteration_s or max(sim.rank_peak_memory_bytes) > search.limit:
        return phase
    fill = simulate(sched, choice.fill_costs, step_overhead_s=overhead, slice_costs=sc) if choice.fill_costs else None
    memory = tuple(replace(m, inflight=int(n), activations=int(n) * int(c.activation_bytes_per_mb), total=int(t))
                   for m, n, c, t in zip(stage_memory, sim.peak_inflight, costs, sim.stage_peak_memory_bytes))
    B = phase.global_batch
    pred = replace(phase.predicted, iteration_s=sim.iteration_s,
                   samples_per_s=B / sim.iteration_s if sim.iteration_s > 0 else 0.0,
                   bubble_fraction=min(max(sim.bubble_fraction, 0.0), 1.0), allreduce_s=sim.allreduce_s,
                   stage_compute_s=tuple(c.setup_s + M * c.prefix_s + M * float(np.sum(f[k]) + np.sum(bw[k]))
                                         for k, c in enumerate(costs)),
                   stage_peak_memory_bytes=tuple(int(x) for x in sim.stage_peak_memory_bytes), stage_memory=memory,
                   rank_peak_memory_bytes=tuple(int(x) for x in sim.rank_peak_memory_bytes),
                   fill_iteration_s=fill.iteration_s if fill is not None else 0.0)
    assert isinstance(pred, Prediction)
    note = (f"token slices {','.join(map(str, slices))} (TeraPipe): {phase.predicted.iteration_s:.4g} s -> "
            f"{sim.iteration_s:.4g} s per iteration (was {phase.schedule})")
    return replace(phase, schedule="gpipe", slices=tuple(slices), predicted=pred, partition=tuple(ranges),
                   actions=tuple(" ".join(map(str, acts)) for acts in sched.actions),
                   timeline=sim.events if events else (), notes=(*phase.notes, note))
