"""Lower bounds on a candidate's simulated iteration (step 2 of ``search.py``): one that needs no split
(``iteration_lower_bound``), and one from a split's stage costs (``split_bound``, ``split_bounds``)."""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from .candidate import Candidate
from .schedule import COMPUTE_KINDS, ActionKind, build_schedule, splits_backward, stage_to_rank
from .simulate import PATH_FIELDS, StageCost, StageTimes, path_durations
from .stage import StageChoice, StageModel, cache_setup_s, stage_times

if TYPE_CHECKING:
    from .search import PhaseSearch


def iteration_lower_bound(search: PhaseSearch, c: Candidate, n0: int, *, fill_from: int | None = None) -> float:
    """Seconds that the simulated iteration of any split of this candidate is at least (a fill
    iteration's with ``fill_from``, a steady one's without). It does not read recomputation (the
    recomputed forward is left out: still a lower bound), so ``search._branch_and_bound`` shares it between candidates
    that differ only there.

    With f_s, b_s a stage's forward and backward per micro-batch (overheads and the stage-0
    prefix included), F = Σ f_s, B = Σ b_s, and T = F + B + the cache set-up + every link's
    latency both ways (one micro-batch's path through the pipeline):

    - pipeline: GPipe's makespan is at least T + (M-1)·max_s(f_s + b_s) >= T + (M-1)(F+B)/K; in
      1F1B stage s runs (M-1) forwards and M-K+s backwards before its last forward, whose
      micro-batch then takes the whole path: T + (M-1)f_s + (M-K+s)b_s, and the largest over s is
      at least the average, T + (M-1)F/K + (M-K)B/K;
    - head and tail (any schedule): stage s starts only after the stages before it ran micro-batch
      0 forward and ends only before they run the last one backward, so the makespan is at least
      H_s = Σ_{s'<s} t_s' + M·t_s (t = f + b) for every s. Weights w_s with M·w_j + Σ_{s>j} w_s
      equal for every j make Σ w_s·H_s independent of the split: max_s H_s >= c·Σ t with
      c = 1 / (1 - (1 - 1/M)^K) (exact for K = 1 and for M = 1);
    - the largest layer: its stage runs it M times;
    - the tail: every stage finishes its compute, then its all-reduce and optimizer step, and
      the slowest of those is at least their average over the K stages;
    - stage 0's last backward is the last compute of the iteration, so its all-reduce and
      optimizer step (at least those of the first active layer, which it always holds) follow
      the makespan bounds above;
    plus the per-step overhead.

    PipeDream-2BW (no flush; the iteration is the steady state's period per mini-batch): every rank
    repeats its work — setup + M·(f_s + b_s) + optimizer step — once per period, so the period
    is at least the ranks' total work over K, the largest layer's M forwards and backwards, and
    stage 0's prefix and first layer with its optimizer step (``simulate``'s floor is the slowest
    rank's work itself).
    """
    t = search.table_for(c)
    tm = t.at(c.b)
    K, M, S = c.K, c.M, c.S
    zb = splits_backward(c.schedule)
    ovh = search.c.action_overhead_s if K > 1 else 0.0
    n = search.n
    prefix = 0.0 if c.cache else float(tm.cum_nograd[n0])
    setup = cache_setup_s(search.t, n0, M, c.b, search.io, device_is_host=search.c.device_is_host,
                          fill_from=fill_from) if c.cache else 0.0  # the cached prefix is whole
    L = search.links(K, c.schedule, c.V, c.tp)
    sf = float(tm.cum_fwd[n] - tm.cum_fwd[n0])
    sb = float(tm.cum_bwd[n] - tm.cum_bwd[n0])
    sw = float(tm.cum_bwd_weight[n] - tm.cum_bwd_weight[n0]) if zb else 0.0
    F = sf + S * ovh + prefix
    Bw = sb + S * ovh
    # one micro-batch's path: forwards, then the backwards that pass the gradient on (not W)
    T = F + Bw - sw + setup + 2.0 * float(L.send_lat.sum())
    pipe = max(T, M * (F + Bw) / K + setup / K)  # the path; the ranks' total work over K
    if c.schedule == "gpipe":
        pipe = max(pipe, T + (M - 1) * (F + Bw) / K)
    elif c.schedule == "1f1b":
        pipe = max(pipe, T + (M - 1) * F / K + max(0, M - K) * Bw / K)
    if M > 1 and not zb:  # head and tail over the S stages (a W may end a zero-bubble stage's work)
        pipe = max(pipe, setup + (F + Bw) / -math.expm1(S * math.log1p(-1.0 / M)))
    fb_max = float(search.fb_suffix_max(c.b, t)[n0])
    big = M * (fb_max + 2 * ovh)
    if c.schedule == "2bw":
        work = M * (F + Bw) + setup + float(t.optimizer_range_s(n0, n))  # one call: no more than K stages pay
        first = setup + M * (prefix + float(tm.fwd[n0] + tm.bwd[n0]) + 2 * ovh) + float(t.optimizer_s[n0])
        return max(work / K, big, first) + search.c.step_overhead_s
    x_sum = M * (sf + sb) + float(t.optimizer_range_s(n0, n))  # per layer (one call); overheads are per stage
    lat = 0.0
    # FSDP reduce-scatters in the backward instead (``strategy.py``); a stage choosing FSDP may too
    sync = c.D > 1 and not c.fsdp and not c.fsdp_per_stage
    if sync:
        x_sum += float(t.cum_sync[n] - t.cum_sync[n0]) * float(L.ar_per_byte.min())
        lat = float(L.ar_lat.min())
    tail = max((x_sum + M * (prefix + 2 * ovh * S) + setup) / K, big) + lat
    stage0 = setup + M * (prefix + float(tm.fwd[n0] + tm.bwd[n0]) + 2 * ovh)  # the prefix and its first layer
    last0 = float(t.optimizer_s[n0])
    if sync:
        last0 += float(L.ar_lat[0] + (t.cum_sync[n0 + 1] - t.cum_sync[n0]) * L.ar_per_byte[0])
    if zb:  # stage 0's all-reduce follows its own work (its last W), not necessarily the makespan
        return max(pipe, big, stage0 + last0, tail) + search.c.step_overhead_s
    return max(max(pipe, big, stage0) + last0, tail) + search.c.step_overhead_s


class Counts(NamedTuple):
    """What a schedule's action lists say of each stage's last actions (``chain_counts``), arrays (S,)."""
    b_before: np.ndarray
    """Backwards (B) before the stage's last forward."""
    w_before: np.ndarray
    """Weight-gradient actions (W) before the stage's last forward."""
    b_path: np.ndarray
    """Backwards bounded after the path of a micro-batch through the later stages and back: 1 (its last forward's
    micro-batch's), or, where every stage runs all its forwards before any backward and begins its backwards with
    the same micro-batch (fill-drain, GPipe), every backward (the first waits for that path, the rest follow)."""
    w_tail: np.ndarray
    """W's after the stage's last B."""


@functools.lru_cache(maxsize=4096)
def chain_counts(name: str, K: int, M: int, V: int = 1) -> Counts | None:
    """``Counts`` of the named schedule's K·V stages, read from their actions in the ranks' lists; None where the
    stages' last backwards do not chain (``chain_ends``): token slices, or no flush (PipeDream-2BW)."""
    if name in ("2bw", "terapipe"):
        return None
    sched = build_schedule(name, K, M, V)
    if sched.slices != 1 or sched.minibatches != 1:
        return None
    rows, first = [], []
    for s, r in enumerate(sched.stage_to_rank):
        acts = [(a.kind, a.mb) for a in sched.actions[r] if a.stage == s and a.kind in COMPUTE_KINDS]
        kinds = [k for k, _ in acts]
        last_f = max(i for i, k in enumerate(kinds) if k is ActionKind.F)
        last_b = max(i for i, k in enumerate(kinds) if k is ActionKind.B)
        rows.append((kinds[:last_f].count(ActionKind.B), kinds[:last_f].count(ActionKind.W),
                     kinds[last_b:].count(ActionKind.W)))
        first.append(next(m for k, m in acts[last_f:] if k is ActionKind.B))
    b_before, w_before, w_tail = (np.array(v, dtype=float) for v in zip(*rows))
    fill_drain = not b_before.any() and len(set(first)) == 1
    return Counts(b_before, w_before, np.full(len(rows), float(M) if fill_drain else 1.0), w_tail)


def last_backward(n: Counts, M: int, head: np.ndarray, fwd: np.ndarray, path: np.ndarray, weight: np.ndarray,
                  after: np.ndarray, busy: np.ndarray | None = None) -> np.ndarray:
    """A lower bound on the end of each stage's last backward (B), from ``chain_counts``: micro-batch 0 arrives at
    ``head``; the stage runs its M forwards (``fwd`` each), the B's (``path``: the backward, less its W part where
    the schedule splits it) and W's (``weight``) its list has before its last forward; that forward's micro-batch
    then goes through the later stages and back (``after``: their forwards and B's and the messages between)
    before its B on this stage, and (fill-drain) the other B's follow. Arrays of one shape, stages on the last
    axis (``n``'s arrays broadcast along it). ``busy`` (optional, where the backward is not split): a lower bound on
    a forward and a B together, at least fwd + path where one model's, so k of the M forwards may take it."""
    k = n.b_before + n.b_path
    out = head + after + M * fwd + count_times(k, path) + count_times(n.w_before, weight)
    if busy is not None:
        out = np.maximum(out, head + after + count_times(k, busy) + count_times(M - k, fwd))
    return out


def count_times(count: np.ndarray, v: np.ndarray) -> np.ndarray:
    """count x v, 0 where count is 0 (0 x inf is not a bound: where a stage fits nothing)."""
    return count * np.where(count > 0, v, 0.0)


def chain_ends(ends: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Lower bounds on every stage's last B (rows of (N, S)) from each stage's own (``last_backward``) and ``step``, a
    lower bound on stage s's B plus the message into it from stage s + 1: where the last B's chain
    (``chain_counts``), the micro-batch of stage s + 1's last B then still runs its B on stage s, so E_s >= E_{s+1}
    + step_s (and so E_s >= E_p + the steps of s..p-1 for every later p)."""
    out = np.array(ends, dtype=float, copy=True)
    for s in range(out.shape[-1] - 2, -1, -1):
        out[..., s] = np.maximum(out[..., s], out[..., s + 1] + step[..., s])
    return out


def split_bound(c: Candidate, costs: Sequence[StageCost], step_overhead_s: float) -> float:
    """A lower bound on the simulated iteration once the split is known (the same arguments as
    ``PhaseSearch.lower_bound`` with each stage's own times), to skip simulating hopeless candidates:
    ``split_bounds`` of one split."""
    x = StageTimes(*(np.array([[getattr(st, f) for st in costs]], dtype=float) for f in StageTimes._fields))
    return float(split_bounds(c, x, step_overhead_s)[0])


def split_bounds(c: Candidate, x: StageTimes, step_overhead_s: float) -> np.ndarray:
    """``split_bound`` of many splits at once (rows of ``x``'s (N, S) arrays). It never decreases when a duration
    the simulator reads grows (forward, backward and its B and W parts, messages, set-up, all-reduce, step), so a
    stage given each duration's least over several models bounds every choice among them (``assign.py``)."""
    M, K = c.M, c.K
    S = np.shape(x.forward_s)[-1]
    zb = splits_backward(c.schedule)
    f = x.forward_s + x.prefix_s
    b = x.backward_s
    w = np.minimum(x.backward_weight_s, b) if zb else np.zeros_like(b)  # a W's seconds, as the simulator takes them
    path_b = b - w
    T = f.sum(-1) + path_b.sum(-1) + x.setup_s[:, 0] + (x.send_forward_s + x.send_backward_s).sum(-1)
    s2r = np.asarray(stage_to_rank(c.schedule, K, c.V))
    rank = (s2r[:, None] == np.arange(K)[None, :]).astype(float)   # (S, K): each stage's rank
    load = (x.setup_s + M * (f + b)) @ rank
    if c.schedule == "2bw":  # the steady state: each rank's work (and all-reduces) once per period
        return np.maximum((load + x.optimizer_s @ rank).max(-1), (x.allreduce_s @ rank).max(-1)) + step_overhead_s
    done = (x.allreduce_s + x.optimizer_s) @ rank
    pipe = np.maximum(T, load.max(-1))
    if c.schedule == "gpipe":
        pipe = np.maximum(pipe, T + (M - 1) * (f + b).max(-1))
    elif c.schedule == "1f1b":
        pipe = np.maximum(pipe, T + ((M - 1) * f + np.maximum(0, M - S + np.arange(S)) * b).max(-1))
    if not zb:  # head and tail of every stage
        head, tail_b = np.cumsum(f, -1) - f, np.cumsum(b, -1) - b
        pipe = np.maximum(pipe, (x.setup_s[:, :1] + head + M * (f + b) + tail_b).max(-1))
    tail = (load + done).max(-1)
    n = chain_counts(c.schedule, K, M, c.V)
    if n is not None:  # each stage's all-reduce and step after its own last B and W's, and the later stages' B's
        one = c.V == 1  # (several stages a rank: a message may stay on the rank, unsent; none counted)
        sf, sb = (x.send_forward_s, x.send_backward_s) if one else (np.zeros_like(f), np.zeros_like(f))
        head = x.setup_s[:, :1] + np.cumsum(f + sf, -1) - (f + sf)
        later = np.cumsum((f + path_b + sb)[:, ::-1], -1)[:, ::-1] - (f + path_b + sb)  # Σ_{i>s}
        after = later + np.cumsum(sf[:, ::-1], -1)[:, ::-1]  # and the forward messages from stage s on
        step = path_b + np.concatenate((sb[:, 1:], np.zeros_like(sb[:, :1])), axis=-1)
        ends = chain_ends(last_backward(n, M, head, f, path_b, w, after), step) + count_times(n.w_tail, w)
        tail = np.maximum(tail, (ends + x.allreduce_s + x.optimizer_s).max(-1))
    if zb:
        return np.maximum(pipe, tail) + step_overhead_s
    return np.maximum(pipe + x.allreduce_s[:, 0] + x.optimizer_s[:, 0], tail) + step_overhead_s


class Least(NamedTuple):
    """A stage's durations, each the least over the models that fit the stage at its position (infinite where none
    fits): what ``_Scorer.bounds`` and ``_Scorer.stage_bounds`` (``search.py``) read of a stage."""
    busy: np.ndarray
    """One micro-batch's forward and backward (``StageModel.cum_time_lb``), both actions' overheads, stage 0's
    prefix."""
    done: np.ndarray
    """The all-reduce (with a flush) and the optimizer step after the stage's last backward."""
    forward: np.ndarray
    """One forward, its overhead and stage 0's prefix."""
    path: np.ndarray
    """One B: the backward and its overhead, less its W part where the schedule splits the backward (0 where the
    caller reads no chain: ``least_terms``' ``chain``)."""
    weight: np.ndarray
    """One W (0 where the schedule does not split the backward, or as ``path``)."""


class Chain(NamedTuple):
    """What ``_Scorer``'s bounds (``search.py``) read of the active layers besides each stage's ``Least``, each its
    least over the models."""
    ovh: float
    """The per-action overhead."""
    prefix: float
    """Stage 0's frozen prefix per micro-batch."""
    cum_fwd: np.ndarray
    """Prefix sums of the layers' forwards."""
    cum_path: np.ndarray
    """Prefix sums of the layers' B's (backwards, less their W parts where the schedule splits the backward)."""
    link: np.ndarray
    """(S,): each link's least message, stage s to s + 1 (0 after the last stage)."""
    sent: np.ndarray
    """(S + 1,): prefix sums of ``link``."""


def least_terms(c: Candidate, model: StageModel | StageChoice, limit: float, lo: np.ndarray, hi: np.ndarray,
                k: int, *, chain: bool = True) -> Least:
    """``Least`` of the stages [lo, hi) (arrays of one shape) at stage index k, under the memory ``limit``. A stage
    runs one of its models, one that fits it, so each of its durations is at least that duration's least over
    the models that fit; not over every model: where memory rules out the fastest models of a stage (its
    recomputation-free ones), those would bound it from far below (issue 22: Llama 3.1 70B's 8-stage candidates'
    best splits up to 6.6 % above the bound, too loose to prove them). ``chain``: also each stage's B and W
    (``Least.path``, ``Least.weight``, what the chain of last B's reads: ``last_backward``; without it 0)."""
    ms = model.models if isinstance(model, StageChoice) else (model,)
    flush, zb = c.schedule != "2bw", splits_backward(c.schedule)
    out = np.full((5,) + np.shape(lo), np.inf)
    memo: dict = {}
    for m in ms:
        fits = np.asarray(m.evaluate(k, m.prepare(lo, hi, memo))[1]) <= limit
        if not fits.any():
            continue
        pre, sync = (k == 0) * m.prefix_s, m.sync and flush
        busy = m.cum_time_lb[hi] - m.cum_time_lb[lo] + 2 * m.ovh + pre
        done = m.t.optimizer_range_s(lo, hi) + ((m.links.ar_lat[k] + (m.t.cum_sync[hi] - m.t.cum_sync[lo])
                                                  * m.links.ar_per_byte[k]) if sync else 0.0)
        forward = m.times.cum_fwd[hi] - m.times.cum_fwd[lo] + m.ovh + pre
        if chain:  # (0, a bound all the same, where the caller reads no chain)
            bwd = m.times.cum_bwd[hi] - m.times.cum_bwd[lo] + m.ovh  # (recomputation's forward left out: still below)
            weight = np.minimum(m.times.cum_bwd_weight[hi] - m.times.cum_bwd_weight[lo], bwd) if zb else 0.0 * bwd
        else:
            bwd = weight = 0.0 * busy
        for i, v in enumerate((busy, done, forward, bwd - weight, weight)):
            out[i] = np.where(fits, np.minimum(out[i], v), out[i])
    return Least(*out)


FORM_CELLS = 2_000_000
"""Stage positions x ranges of layers ((S, m + 1, m + 1) cells) at most for which the search builds ``path_tables``:
at this size the tables hold 9 durations of each of the half of the cells that are ranges (72 MB of float64) and
each form 8 MB (``resplit.Terms``; ``resplit.FORM_BYTES`` bounds how many are held); a 96-block model's 32 stages
are 1.2 million cells. Measured (``/usr/bin/time``, ``make_plan`` of the synthetic 96-block plan on 4,096 GPUs):
interleaved 1F1B peaked at 383,320 KiB against 248,588 KiB without the forms (2e3265b), ZB-V at 350,120 KiB."""


class PathTables(NamedTuple):
    """Each stage position's least durations (``simulate.PATH_FIELDS``) over the models that fit it, for every
    range of active layers: what ``path_terms`` prices a chain of the simulator's (``simulate.critical_path``)
    with, for every split at once."""
    d: np.ndarray
    """(S, P, len(PATH_FIELDS)) seconds (0 where no model fits the stage) ..."""
    fits: np.ndarray
    """(S, P): ... whether one does."""
    i: np.ndarray
    """(P,) each range's first layer, counted from the first active one ..."""
    j: np.ndarray
    """(P,) ... and its end."""
    m: int
    """Active layers."""


def path_tables(c: Candidate, model: StageModel | StageChoice, limit: float, weights: tuple[float, float]
                ) -> PathTables:
    """``PathTables`` of a candidate's stages under the memory ``limit``. ``weights``: the objective's weights of a
    steady and a fill iteration (``search._seconds_per_sample``), which differ only in stage 0's set-up: the
    set-up is their weighted mean (so ``path_terms`` times their sum bounds the objective)."""
    ms = model.models if isinstance(model, StageChoice) else (model,)
    a, n, S = model.start, model.n, c.S
    i, j = np.triu_indices(n - a + 1, k=1)
    lo, hi = i + a, j + a
    out = np.full((S, len(lo), len(PATH_FIELDS)), np.inf)
    ws, wf = weights
    for m in ms:
        memo: dict = {}
        fits = np.array([np.asarray(m.evaluate(k, m.prepare(lo, hi, memo))[1]) <= limit for k in range(S)])
        for at in range(0, len(lo), TABLE_ROWS):  # (a block of ranges at a time: its durations are 9 x S columns)
            r = slice(at, at + TABLE_ROWS)
            LO, HI = np.repeat(lo[r, None], S, axis=1), np.repeat(hi[r, None], S, axis=1)
            d = path_durations(stage_times(m, LO, HI))  # each stage position holding each range
            if c.cache:
                d[..., -1] = (ws * d[..., -1] + wf * stage_times(m, LO, HI, fill=True).setup_s) / (ws + wf)
            np.copyto(out[:, r], np.minimum(out[:, r], d.transpose(1, 0, 2)), where=fits[:, r, None])
    fits = np.isfinite(out[..., 0])
    out[~fits] = 0.0
    return PathTables(out, fits, i, j, n - a)


TABLE_ROWS = 1024
"""Ranges of layers ``path_tables`` prices at a time (its stage times' columns are held for these only)."""


def path_terms(t: PathTables, counts: np.ndarray) -> np.ndarray:
    """(S, P + 1): stage s's share, holding range p of layers (``t.i``, ``t.j``; ``resplit.Terms``' layout), of a
    chain that runs counts[s, field] of each of its durations (``simulate.critical_path``); infinite where the
    stage fits nothing, and in the last slot (``resplit.Terms.index``' for i >= j)."""
    v = np.matmul(t.d, counts[:, :, None])[..., 0]
    return np.concatenate((np.where(t.fits, v, np.inf), np.full((len(counts), 1), np.inf)), axis=1)
