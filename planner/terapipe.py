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
(K − 1)·τ alone reaches the best T found (no larger τ can win). The DP runs on many candidates at
once with numpy (one vectorised row per slice end). ``brute_force_slices`` enumerates every
composition of L (tests, L ≤ 16).

The cost model (``SliceCost``) is TeraPipe's: linear in b·s, b·c and b·s·c plus a constant, fitted by
least squares to measured (b, s, c, seconds) points (``fit_slice_cost``, with its relative error).
``square=True`` adds a b·s² term: the slice's attention over its own tokens (s·s/2 pairs), which
TeraPipe's form misses and which dominates long slices on a CPU (on the shipped gpt2 block: median
error 3-4 % with it, 17-25 % without; ``relative=True`` fits relative rather than absolute errors,
``nonnegative=True`` keeps every coefficient >= 0).
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


def fit_slice_cost(points: Sequence[tuple[int, int, int, float]], *, square: bool = False,
                   relative: bool = False, nonnegative: bool = False) -> SliceCost:
    """Least-squares fit of ``SliceCost`` to (b, s, c, seconds) points; b of the result is 1 (set it with
    ``dataclasses.replace``). Needs at least 4 points (5 with ``square``) that pin the coefficients.
    ``relative``: minimise the relative errors (rows weighted by 1 / seconds) instead of the absolute.
    ``nonnegative``: every coefficient >= 0 (scipy's NNLS), so no slice gets a negative time when the
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
        from scipy.optimize import nnls

        coef, _ = nnls(A * w[:, None], y * w)
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
        total = repeat * f[:, n] + (K - 1) * chunk
        k = int(np.argmin(total))
        if total[k] < best:
            best, best_tau = float(total[k]), float(chunk[k])
    assert best_tau is not None
    slices = _backtrack(t, n, best_tau)
    lat, slow = _latency(cost, [s * g for s in slices], K, repeat)
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


def sliced_phase(profile, *, L: int, K: int, M: int, b: int, D: int = 1, frozen_blocks: int = 0,
                 granularity: int = 16, slicing: str = "auto", allreduce_bandwidth: float | None = None,
                 link_bandwidth: float | None = None, cache: bool = False,
                 ranges: Sequence[tuple[int, int]] | None = None) -> SlicedPhase:
    """Token slicing for one phase: the active layers (after ``frozen_blocks`` frozen ones) split into K
    stages balanced at full length, TeraPipe's optimal slices for that pipeline (``optimal_slices`` on
    the slowest stage's slice cost, with ``repeat`` = M), and the simulated iteration with and without
    them (the ``terapipe`` schedule and ``SliceCosts``; ``slicing="auto"`` keeps the unsliced run where
    the simulator says it is faster, so the choice is never worse than not slicing; "off" never slices).

    The frozen prefix runs unsliced on stage 0 under no_grad, once per micro-batch (the executor's
    ``SlicedStage.run_prefix``): its blocks cost the forward fit at (L, 0) each — or nothing with
    ``cache`` (the AutoCache holds the prefix's output; reading it is not priced here). ``link_bandwidth``
    (bytes/s) prices the activations sent between stages (hidden · 4 bytes per token and sample; None:
    free); ``allreduce_bandwidth`` the ring all-reduce of a stage's gradients over D replicas (None:
    free). ``ranges``: the stages' layer ranges as given (a plan's partition) instead of the balanced
    split. Memory is not checked here."""
    from .simulate import SliceCosts, StageCost, simulate
    from .schedule import terapipe

    if slicing not in ("auto", "off"):
        raise PtplanError(f"token slicing must be auto or off, got {slicing!r}")
    if L % granularity:
        raise PtplanError(f"sequence length {L} is not a multiple of the slice granularity {granularity}")
    n0 = profile.frozen_boundary(frozen_blocks)
    fwd_full = profile_slice_cost(profile, b, "forward")
    both_full = profile_slice_cost(profile, b, "both")
    costs = []
    for r in profile.layers[n0:]:
        share = 1.0 if r.kind == "block" else 0.5 if r.kind in ("attention", "mlp") else 0.0
        tok = (profile.forward_s(r.index, b) + profile.backward_s(r.index, b)) / profile.model.seq_len
        costs.append(share * float(both_full(L, 0)) / 2 + (0.0 if share else tok * L))  # the attention's c ~ L/2
    if ranges is None:
        ranges = balanced_ranges(costs, n0, K)
    else:
        ranges = tuple((int(a), int(z)) for a, z in ranges)
        if len(ranges) != K or ranges[0][0] != n0 or ranges[-1][1] != profile.num_layers or any(
                a >= z or z != nxt for (a, z), (nxt, _) in zip(ranges, ranges[1:] + ((profile.num_layers, 0),))):
            raise PtplanError(f"stage ranges {list(ranges)} must be K={K} contiguous non-empty ranges covering the "
                              f"active layers [{n0}, {profile.num_layers})")
    model = stage_slice_model(profile, ranges, b)
    prefix = 0.0
    for r in ([] if cache else profile.layers[:n0]):
        share = 1.0 if r.kind == "block" else 0.5 if r.kind in ("attention", "mlp") else 0.0
        prefix += share * float(fwd_full(L, 0)) + (0.0 if share else
                                                 profile.nograd_forward_s(r.index, b) / profile.model.seq_len * L)
    hidden = int(profile.model.config.get("n_embd") or profile.model.config.get("hidden_size") or 0)
    send = 0.0 if link_bandwidth is None or K == 1 else b * L * hidden * 4 / link_bandwidth
    grad_bytes = [sum(r.grad_bytes for r in profile.layers[lo:hi]) for lo, hi in ranges]

    def simulated(slices: Sequence[int]) -> float:
        offs = np.cumsum([0, *slices[:-1]])
        f, bw = model.times(np.asarray(slices, dtype=float), offs.astype(float))
        stage = [StageCost(forward_s=float(np.sum(f[k])) / len(slices), backward_s=float(np.sum(bw[k])) / len(slices),
                           prefix_s=prefix if k == 0 else 0.0, send_forward_s=send, send_backward_s=send,
                           allreduce_s=0.0 if D == 1 or allreduce_bandwidth is None else
                           2 * (D - 1) / D * grad_bytes[k] / allreduce_bandwidth) for k in range(K)]
        sc = SliceCosts(tokens=tuple(slices), forward_s=tuple(map(tuple, f)), backward_s=tuple(map(tuple, bw)))
        return simulate(terapipe(K, M, len(slices)), stage, slice_costs=sc).iteration_s

    unsliced = simulated((L,))
    best = (L,)
    obj = _latency(model.slowest, best, K, M)[0]
    if slicing == "auto":
        opt = optimal_slices(model.slowest, L, K, granularity=granularity, repeat=M)
        t = simulated(opt.slices)
        if t < unsliced:
            return SlicedPhase(K=K, D=D, M=M, b=b, ranges=ranges, slices=opt.slices, iteration_s=t,
                               unsliced_s=unsliced, objective_s=opt.latency_s)
    return SlicedPhase(K=K, D=D, M=M, b=b, ranges=ranges, slices=best, iteration_s=unsliced, unsliced_s=unsliced,
                       objective_s=obj)


def search_sliced(profile, *, gpus: int, batch: int, L: int, frozen_blocks: int = 0, granularity: int = 16,
                  slicing: str = "auto", **kw) -> SlicedPhase:
    """The fastest (per sample) phase over K (dividing ``gpus``, D = gpus / K) and M (dividing the pipeline's
    batch batch / D, b = batch / (D·M)), each with its token slicing (``sliced_phase``)."""
    n_active = profile.num_layers - profile.frozen_boundary(frozen_blocks)
    best: SlicedPhase | None = None
    for K in range(1, gpus + 1):
        if gpus % K or K > n_active or batch % (gpus // K):
            continue
        D = gpus // K
        per = batch // D
        for M in range(1, per + 1):
            if per % M:
                continue
            ph = sliced_phase(profile, L=L, K=K, M=M, b=per // M, D=D, frozen_blocks=frozen_blocks,
                              granularity=granularity, slicing=slicing, **kw)
            if best is None or ph.iteration_s < best.iteration_s:
                best = ph
    if best is None:
        raise PtplanError(f"no pipeline of {gpus} GPUs splits a batch of {batch} evenly over D = GPUs / K replicas")
    return best


def slice_plan(plan, profile, *, L: int | None = None, granularity: int = 16, **kw) -> tuple[SlicedPhase, ...]:
    """Token slicing for every phase of a plan (``ptplan plan``'s output for a causal LM): each phase's K, D,
    M, micro-batch size, partition, frozen count and AutoCache choice, its slices chosen and simulated
    (``sliced_phase``; never worse than unsliced). L: tokens per sequence (default: the profile's).
    Phases with V > 1 chunks per position or tensor parallelism are refused (token slices run one
    stage per position here)."""
    if profile.model.family not in ("gpt2", "llama"):
        raise PtplanError(f"token slicing is for causal LMs (gpt2, llama), not {profile.model.name}")
    out = []
    for ph in plan.phases:
        if ph.V != 1 or getattr(ph, "tp", 1) != 1:
            raise PtplanError(f"phase with {ph.frozen_blocks} frozen blocks has V={ph.V}, tp={getattr(ph, 'tp', 1)}; "
                              f"token slices run one stage per position without tensor parallelism")
        out.append(sliced_phase(profile, L=L or profile.model.seq_len, K=ph.K, M=ph.M, b=ph.micro_batch_size,
                                D=ph.D, frozen_blocks=ph.frozen_blocks, granularity=granularity, cache=ph.cache,
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


def sliceable(phase) -> bool:
    """Whether the executor can run the phase token-sliced: one stage per position, no tensor parallelism,
    FSDP, recomputation or 2BW (executor/runtime/sliced.py's loop runs plain layers, GPipe-ordered)."""
    return phase.V == 1 and phase.tp == 1 and not phase.any_fsdp and not phase.any_recompute and phase.schedule != "2bw"


def token_slice_phase(search, choice, phase, *, keep_timeline: bool = False, max_events: int = 20_000):
    """``phase`` (the planner's, from ``choice``) with token slices where they pay, else unchanged.

    Slice costs per stage: the profile's fitted block slice cost (``stage_slice_model``) scaled so that one
    slice of the whole sequence costs what the planner charges the stage (``choice.costs``: the measured
    per-layer times at the profile's sequence length), i.e. the fit gives the shape of t(s, c), the
    measured layers its scale; a stage's slices are priced at least at its whole sequence (``priced``).
    Candidates: TeraPipe's optimum for the slowest stage (``optimal_slices``, repeat = M) and 2-8 even slices,
    the fastest in simulation kept. K = 1 phases stay unsliced (no bubble to fill). Each candidate is simulated with the ``terapipe`` schedule (GPipe order over slices) on the
    planner's own stage costs (messages, prefix, cache, all-reduce, optimizer, memory). It is taken only when
    its iteration is strictly faster than the phase's predicted one and its peak memory fits the device
    (every micro-batch in flight, as GPipe)."""
    from dataclasses import replace

    from .plan import Prediction
    from .schedule import terapipe
    from .simulate import SliceCosts, simulate

    profile = search.p
    if not sliceable(phase) or profile.token_slices is None:
        return phase
    L, K, M, b = profile.model.seq_len, phase.K, phase.M, phase.micro_batch_size
    model = stage_slice_model(profile, phase.partition, b)
    f_full, b_full = model.times(float(L), 0.0)
    costs = choice.costs
    scale_f = np.array([c.forward_s / f if f > 0 else 0.0 for c, f in zip(costs, f_full.tolist())])
    scale_b = np.array([c.backward_s / w if w > 0 else 0.0 for c, w in zip(costs, b_full.tolist())])

    def times(s, c):
        f, bw = model.times(s, c)
        shape = (-1,) + (1,) * (f.ndim - 1)
        return f * scale_f.reshape(shape), bw * scale_b.reshape(shape)

    def slowest(s, c):
        f, bw = times(s, c)
        return np.max(f + bw, axis=0)

    def priced(slices: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Per stage and slice (forward, backward) seconds, each stage's row raised where needed so that the
        slices together cost at least the whole sequence: slicing never removes work (a fit whose b·s·c and
        b·s² terms disagree would otherwise make many short slices look cheaper than the sequence)."""
        offs = np.cumsum([0, *slices[:-1]]).astype(float)
        f, bw = times(np.asarray(slices, dtype=float), offs)
        for row, full in ((f, f_full * scale_f), (bw, b_full * scale_b)):
            tot = row.sum(axis=1)
            row *= np.where((tot > 0) & (tot < full), full / np.where(tot > 0, tot, 1.0), 1.0)[:, None]
        return f, bw

    if K < 2:
        return phase  # one stage: no pipeline bubble for slices to fill
    overhead = search.c.step_overhead_s
    opt = optimal_slices(slowest, L, K, granularity=slice_granularity(L), repeat=M)
    tries = {opt.slices} | {tuple(L // n + (1 if i < L % n else 0) for i in range(n)) for n in (2, 3, 4, 6, 8)
                            if n <= L}
    best: tuple[float, tuple[int, ...]] | None = None
    for cand in sorted(tries, key=len):
        if len(cand) < 2:
            continue
        f, bw = priced(cand)
        sc = SliceCosts(tokens=cand, forward_s=tuple(map(tuple, f)), backward_s=tuple(map(tuple, bw)))
        t = simulate(terapipe(K, M, len(cand)), costs, step_overhead_s=overhead, slice_costs=sc).iteration_s
        if best is None or t < best[0]:
            best = (t, cand)
    if best is None:
        return phase
    slices = best[1]
    f, bw = priced(slices)
    sc = SliceCosts(tokens=slices, forward_s=tuple(map(tuple, f)), backward_s=tuple(map(tuple, bw)))
    sched = terapipe(K, M, len(slices))
    events = keep_timeline and K * M * len(slices) * 6 <= max_events
    sim = simulate(sched, costs, step_overhead_s=overhead, slice_costs=sc, events=events)
    if sim.iteration_s >= phase.predicted.iteration_s or max(sim.rank_peak_memory_bytes) > search.limit:
        return phase
    fill = simulate(sched, choice.fill_costs, step_overhead_s=overhead, slice_costs=sc) if choice.fill_costs else None
    memory = tuple(replace(m, inflight=int(n), activations=int(n) * int(c.activation_bytes_per_mb), total=int(t))
                   for m, n, c, t in zip(choice.memory, sim.peak_inflight, costs, sim.stage_peak_memory_bytes))
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
    return replace(phase, schedule="gpipe", slices=tuple(slices), predicted=pred,
                   actions=tuple(" ".join(map(str, acts)) for acts in sched.actions),
                   timeline=sim.events if events else (), notes=(*phase.notes, note))
