"""The split by simulated time: AutoPipe's min-max split, then cut moves scored by the simulator.

Legend: a split of the active layers [n0, n) into S stages is its S + 1 boundaries ``cuts`` (n0 first, n
last); K, M, D as in ``search.py``.

``partition.split_stages`` minimises a proxy, the slowest stage's busy time (its compute, both its
messages and, on stage 0, the frozen prefix), then the sum of squares. The simulated iteration is not
that: messages do not block the sender, a stage's all-reduce and optimizer step land after its own
last backward (stage 0's after the whole pipeline), and a stage's position sets when it starts and
ends. So the proxy's optimum can be slower than another split (issue 22: bert-large on cpu:4, 17 frozen,
K=2: (35,36)|(36,51) 1.25x slower than (35,41)|(41,51)).

``best_split`` scores every split (exact) where the caller can score many at once (``many``: the search does for
every candidate without token slices, ``simulate.iterations``, one pass of the event loop over numpy columns) and
there are at most ``ENUMERATE_MANY``; else where there are at most
``ENUMERATE_UP_TO`` and at most ``ENUMERATE_LAYERS`` active layers. In both, splits go in ascending order of
their lower bounds and stop at the first that cannot win. Where there are more, the search's lower bound taken
stage by stage (``Proof``: the bound is a maximum of per-stage terms and of sums of a stage's and a later stage's
terms, so whether a partial split has a completion under a bar is a dynamic programme over the stages) finds
every split that can still beat AutoPipe's split, or failing that the descent's, without listing the others
(``under``); where they are at most
``ENUMERATE_MANY`` they are scored as above, and the split is proven the best. Where the bound leaves too many
with the descent's split to beat, the simulator's own chains prove it (``Forms``, ``_by_forms``): the chain of
actions that ends a scored split's iteration is a sum of its stages' durations, exact there and a lower bound on
every other split, so the splits under every such chain are found stage by stage and scored; a schedule with
several stages a rank needs it, since no one stage's term holds a rank's work. Otherwise (too many splits under
the bounds, or no ``many``) the split is the descent's: it
starts from the proxy's optimum and descends on the simulated objective: every move of one
cut by up to ``RADIUS`` layers, every shift of two neighbouring cuts together by one, every move of
one layer across a stage (a cut moved one way, the next the other way), and every shift by one of all the
cuts before, or all the cuts after, a stage, or of every cut (moving weight towards the pipeline's ends,
where all-reduces land at different times). Where none of those improves, the same moves by 2, 4, 8, ...
layers (``far``); where still none improves but one ties (a plateau: with one micro-batch the stages run one
after another, and a layer moved between two middle stages changes nothing), a sideways move to it, at most
``MAX_FLAT`` in a row, never back to a split already scored. Each split is scored by ``score``
(the simulator; infinite where a stage does not fit); the best move is taken while one improves, and the best
split reached is returned. Scores are memoised by cuts, and ``score`` may return infinity early for a split
whose lower bound already loses (``PhaseSearch.split_bound``), so most moves cost a bound, not a
simulation. Randomised brute force (``tests/test_resplit.py``: every split x K x M x cache scored by the
simulator) holds the search's chosen phase to the best simulated one.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

RADIUS = 1
"""How many layers one cut moves in one step."""
GIVE_UP = 0.6
"""The search does not descend from a split whose score is over (1 + GIVE_UP) x the best candidate's so far (the
issue's audit found the proxy's split at most 1.55x the best split's simulated time; a candidate that far behind
the best is not refined). It was 0.05 until an audit (2026-11-28) found bert-large on cpu:4 (batch 64, 1F1B,
nothing frozen) choosing K=4, M=8 over K=4, M=4, whose AutoPipe split was 9 % behind and 5 % ahead once refined
(``tests/test_search.py``)."""
MAX_ROUNDS = 64
"""Descent steps at most per split (each takes the best improving move)."""
TIE = 1e-9
"""Relative difference under which two splits' scores tie (a sideways move)."""
MAX_FLAT = 4
"""Sideways moves in a row at most, across a plateau of tied scores, before the descent stops."""
ENUMERATE_UP_TO = 1024
"""Where a candidate has at most this many splits, every one is scored (exact) instead of the descent ..."""
ENUMERATE_LAYERS = 16
"""... and at most this many active layers (a large model's K = 2 would otherwise score every cut of it)."""
ENUMERATE_MANY = 50_000
"""Where the caller scores many splits at once (``many``: one simulation pass for all of them), every split is scored
up to this many splits, whatever the number of layers."""
CHUNK = 2048
"""Splits scored per ``many`` call (in ascending order of their bounds: a chunk whose bounds lose to the best so far
ends the enumeration)."""


def neighbours(cuts: Sequence[int], radius: int = RADIUS) -> list[tuple[int, ...]]:
    """Splits one move away (module docstring): valid boundaries only (every stage keeps a layer)."""
    c = list(cuts)
    S = len(c) - 1
    out: list[tuple[int, ...]] = []

    def add(x: list[int]) -> None:
        if all(a < b for a, b in zip(x, x[1:])):
            out.append(tuple(x))

    for i in range(1, S):
        for d in range(1, radius + 1):
            for sgn in (-d, d):
                x = c.copy()
                x[i] += sgn
                add(x)
    for i in range(1, S - 1):
        for sgn in (-1, 1):
            x = c.copy()
            x[i] += sgn
            x[i + 1] += sgn
            add(x)
            y = c.copy()
            y[i] += sgn
            y[i + 1] -= sgn
            add(y)
    for i in range(1, S):  # every cut from the i-th on, or up to the (i-1)-th, shifted by one layer
        for sgn in (-1, 1):
            add(c[:i] + [x + sgn for x in c[i:S]] + c[S:])
            add(c[:1] + [x + sgn for x in c[1:i]] + c[i:])
    return list(dict.fromkeys(out))


def enumerable(a: int, n: int, S: int, up_to: int | None = None, *, batched: bool = False) -> bool:
    """Whether ``best_split`` scores every split of layers [a, n) into S stages (instead of the descent);
    ``up_to`` default ``ENUMERATE_UP_TO``, or with ``batched`` (the caller scores many splits at once)
    ``ENUMERATE_MANY`` and any number of layers."""
    count = math.comb(n - a - 1, S - 1)
    if batched:
        return count <= (ENUMERATE_MANY if up_to is None else up_to)
    return n - a <= ENUMERATE_LAYERS and count <= (ENUMERATE_UP_TO if up_to is None else up_to)


Bounds = Callable[[np.ndarray], np.ndarray]
"""Lower bounds of the scores of many splits at once (rows of cuts), cheap (numpy): infinite where one does not fit."""
Many = Callable[..., np.ndarray]
"""``many(X, bar=inf)``: the scores of many splits at once (rows of cuts): what ``score`` gives each, infinite where
one does not fit; with a finite ``bar``, as ``score``'s ``best``: any number not below it where a split cannot beat
it."""
class StageTerms(NamedTuple):
    """Lower bounds of a candidate's splits stage by stage, over its m active layers, arrays (S, m + 1, m + 1)
    indexed [s, i, j] for stage s holding layers [a + i, a + j) of them: the bound of a split with cuts c is
    max over s of G[s, c_s, c_s+1], and with ``A`` and ``B`` also max over s <= p of A[p, c_p, c_p+1] + B[s, c_s,
    c_s+1] (a stage's term paired with every later stage's). At most the split's ``Bounds``; infinite where i >= j
    or the stage does not fit."""
    G: np.ndarray
    A: np.ndarray | None = None
    B: np.ndarray | None = None


Proof = Callable[[], StageTerms]
"""The stage-by-stage bounds (``StageTerms``) of a candidate's splits."""
PROOF_SLACK = 1e-9
"""Relative room ``under`` leaves over the score to beat: G's prefix sums round apart from the bound's own."""
@dataclass(frozen=True)
class Terms:
    """Forms' per-stage terms over a candidate's m active layers, each range of layers once: ``v[q, s,
    index[i, j]]`` is form q's term of stage s holding layers [a + i, a + j) (as ``StageTerms``' [s, i, j]); the
    last slot of every row is infinite, and ``index`` sends every i >= j there (so do the stages that do not fit).
    Half the cells of a dense (S, m + 1, m + 1) array a form: their memory is ``_by_forms``' to bound."""
    v: np.ndarray
    """(F, S, m (m + 1) / 2 + 1) ..."""
    index: np.ndarray
    """(m + 1, m + 1) int: the slot of range (i, j)."""

    @staticmethod
    def slots(m: int) -> np.ndarray:
        """``index`` for m layers: ranges in ``np.triu_indices(m + 1, k=1)``'s order, then the infinite slot."""
        i, j = np.triu_indices(m + 1, k=1)
        index = np.full((m + 1, m + 1), len(i))
        index[i, j] = np.arange(len(i))
        return index

    @classmethod
    def of(cls, dense: Sequence[np.ndarray]) -> Terms:
        """From dense (S, m + 1, m + 1) arrays, one a form (their entries at i >= j are not read)."""
        S, m1 = np.shape(dense[0])[:2]
        i, j = np.triu_indices(m1, k=1)
        v = np.full((len(dense), S, len(i) + 1), np.inf)
        for q, g in enumerate(dense):
            v[q, :, :-1] = np.asarray(g)[:, i, j]
        return cls(v, cls.slots(m1 - 1))

    @property
    def count(self) -> int:
        return self.v.shape[0]

    def __add__(self, other: Terms) -> Terms:
        return Terms(np.concatenate((self.v, other.v)), self.index)

    def first(self, n: int) -> Terms:
        return Terms(self.v[:n], self.index)

    def dense(self, s: int) -> np.ndarray:
        """(F, m + 1, m + 1): every form's terms of stage s."""
        return self.v[:, s][:, self.index]

    def sums(self, rows: np.ndarray) -> np.ndarray:
        """(F, N): every form's sum over the stages of the splits in ``rows`` (cuts from 0 to m)."""
        at = (np.arange(rows.shape[1] - 1)[None, :], self.index[rows[:, :-1], rows[:, 1:]])
        return np.array([v[at].sum(axis=1) for v in self.v]).reshape(self.count, len(rows))

    def mean(self) -> Terms:
        """One form: their mean (a lower bound wherever every one is)."""
        return Terms(self.v.mean(axis=0, keepdims=True), self.index)


Forms = Callable[["tuple[int, ...] | None", int], Terms]
"""``forms(cuts, at_most)``: at most ``at_most`` lower bounds of every split's score that the scored split ``cuts``
gives, each a sum of per-stage terms (``Terms``): the simulator's chain of actions that ends ``cuts``' iteration,
priced on every split (``simulate.critical_path``), exact at ``cuts``; ``forms(None, at_most)``: those no split
gives (each rank's own chain, ``simulate.rank_paths``). Every split's score is at least the sum of its stages'
terms in each."""
FORM_BYTES = 64 << 20
"""Memory the proof by forms holds its forms' terms in, at most (``_by_forms`` keeps as many forms as fit, the newest
first). The synthetic 96-block plan's interleaved 1F1B candidates on 4,096 GPUs (32 stages x 19,110 ranges, 4.9 MB a
form) held up to 27 forms; at 64 MiB, 13: the same candidates proven under interleaved 1F1B, looped BFS and ZB-V on
that grid and the 24-block one as at 128 MiB, where 32 MiB left one more ZB-V candidate to the descent (2026-11-28:
the outcomes ``bench/split_proofs.py`` counts, counted by a ``/tmp`` script with this constant patched). At
``bounds.FORM_CELLS`` a form is 8 MB."""
FORM_ROUNDS = 2
"""Splits the proof by forms scores to gain more forms (``_by_forms``) before it gives up."""
EXTEND_PAIRS = 1 << 18
"""(partial split, next cut) pairs ``under_forms`` filters at a time."""
FORM_TIE = 1e-9
"""The proof by forms shows that no split scores more than this (relative) below the best: a sum of terms rounds
apart from the simulator's own sum, so a tie cannot be told from a win below it."""


def best_split(cuts: Sequence[int], score: Callable[[tuple[int, ...], float], float], *, bounds: Bounds | None = None,
               many: Many | None = None, proof: Proof | None = None, radius: int = RADIUS,
               max_rounds: int = MAX_ROUNDS, enumerate_up_to: int | None = None, give_up: float = math.inf,
               cutoff: float = math.inf, max_flat: int = MAX_FLAT, wide: bool = True, start: float | None = None,
               forms: Forms | None = None) -> tuple[tuple[int, ...], float]:
    """(cuts, score) of the best split: every split scored where there are at most ``enumerate_up_to``, else the
    descent from ``cuts`` (module docstring). ``score(cuts, best)`` gives the split's objective; ``math.inf``
    where it does not fit; or any number not below ``best`` where it cannot beat ``best``. ``bounds`` (optional)
    lower-bounds scores, so that splits whose bound loses are not scored: the enumeration scores splits in
    ascending order of their bounds and stops at the first that cannot win: whose bound is not below the best
    score so far, or is over ``cutoff`` (a score the caller already has elsewhere: a split over it is of no use
    to the caller, one equal to it still is). ``many`` (optional) scores many splits at once: the enumeration then
    reaches ``ENUMERATE_MANY`` splits of any number of layers and scores them ``CHUNK`` at a time. With ``many``,
    ``proof`` (optional) gives per-stage lower bounds (``Proof``): where more splits than that exist, those whose
    bound can still win are found stage by stage (``under``) and, if there are at most ``ENUMERATE_MANY``, scored
    as the enumeration scores all of them: exact, before the descent (with ``cuts``' score to beat) or after it
    (with the descent's). Where there are still too many, ``forms`` (optional, with ``proof``): the proof by the
    simulator's own chains (``_by_forms``). The descent is not started where ``cuts`` scores above ``give_up``.
    ``wide=False``: moves of one layer only (no ``far`` moves, no sideways ones): a local refinement, for a caller
    whose every score is a full search and simulation with no bound to skip it. ``start`` (optional): a score that
    some configuration of ``cuts`` reaches (not below its ``score``), cheaper than ``score``: the enumeration with
    ``many`` starts from it, and scores ``cuts`` with the rest; elsewhere ``cuts`` is scored first, with ``cutoff``
    (``give_up`` where the descent would start from it) as its ``best``: over that its bound may stand for its
    score."""
    cur = tuple(cuts)
    a, n, S = cur[0], cur[-1], len(cur) - 1
    listed = S > 1 and enumerable(a, n, S, enumerate_up_to, batched=many is not None)
    if start is not None and listed and many is not None:
        best = start
    else:  # a score over the cutoff (enumerated) or over ``give_up`` (descended) is of no use: its bound will do
        best = score(cur, cutoff if listed or S <= 1 else max(give_up, cutoff))
    if S <= 1:
        return cur, best
    if listed:
        X = _every_cut(n - a, S) + a
        return _score_rows(cur, best, X, score, bounds, many, cutoff)
    if not best <= give_up:
        return cur, best
    P = proof() if proof is not None and many is not None else None
    for attempt in range(2):  # the stage-by-stage bound with AutoPipe's split to beat, then with the descent's
        rows = under(P, min(best, cutoff) * (1 + PROOF_SLACK), ENUMERATE_MANY) if P is not None else None
        if rows is not None:  # every split that may win: none, or the best of them
            return _score_rows(cur, best, rows + a, score, bounds, many, cutoff) if len(rows) else (cur, best)
        if attempt == 0:
            cur, best = _descend(cur, best, score, bounds, radius, max_rounds, max_flat, wide, many)
    if P is not None and forms is not None and many is not None:
        return _by_forms(cur, best, P, forms, score, bounds, many, cutoff)
    return cur, best


def _by_forms(cur: tuple[int, ...], best: float, P: StageTerms, forms: Forms,
              score: Callable[[tuple[int, ...], float], float], bounds: Bounds | None, many: Many, cutoff: float
              ) -> tuple[tuple[int, ...], float]:
    """``best_split``'s last proof: every split whose score may be under (1 - ``FORM_TIE``) x the best so far is
    under it in every form (``Forms``) and in the stage-by-stage bound; where those are at most ``ENUMERATE_MANY``
    (``under_forms``), they are scored and the best is proven. Else a cutting-plane step: the split least in the
    forms' mean (``_least_split``), which they do not rule out, is scored (it may win) and its own forms join, at
    most ``FORM_ROUNDS`` times; then the best split reached, unproven. At most ``FORM_BYTES`` of forms are held
    (twice that while new ones are joined to them), the newest first: each round's chains are exact near the split
    it scored."""
    a = cur[0]
    S, m1 = P.G.shape[:2]
    room = max(1, FORM_BYTES // (S * (m1 * (m1 - 1) // 2 + 1) * 8))
    terms = forms(cur, room)  # (``under_forms`` applies them in order: the chains exact near here first)
    terms = terms + forms(None, room - terms.count) if terms.count < room else terms
    for rnd in range(FORM_ROUNDS + 1):
        bar = min(best, cutoff) * (1 - FORM_TIE)
        ok = P.G < bar
        rows = under_forms(ok, terms, bar, ENUMERATE_MANY)
        if rows is not None:  # scored in ascending order of the forms' bound, until it cannot win
            lower = terms.sums(rows).max(axis=0) if len(rows) else None
            return _score_rows(cur, best, rows + a, score, bounds, many, cutoff, lower) if len(rows) else (cur, best)
        w = _least_split(ok, terms.mean())
        if w is None or rnd == FORM_ROUNDS:
            break
        x = tuple((w + a).tolist())
        v = float(many(np.array([x]))[0])
        if v < best * (1 - 1e-12):
            cur, best = x, v
        new = forms(x, room)
        terms = new + terms.first(room - new.count)
    return cur, best


def _completions(ok: np.ndarray, terms: Terms) -> np.ndarray:
    """(F, S + 1, m + 1): each form's least sum of terms over stages s.. from cut lo to the end (infinite where no
    completion is ``ok``)."""
    S, m1 = ok.shape[0], ok.shape[1]
    out = np.full((terms.count, S + 1, m1), np.inf)
    out[:, S, m1 - 1] = 0.0
    for s in range(S - 1, -1, -1):
        out[:, s] = np.min(np.where(ok[s][None], terms.dense(s) + out[:, s + 1][:, None, :], np.inf), axis=2)
    return out


def under_forms(ok: np.ndarray, terms: Terms, bar: float, cap: int) -> np.ndarray | None:
    """Every split (rows of cuts from 0 to m) whose stages are all ``ok`` and whose sum of terms is below ``bar`` in
    every form of ``terms``, or None where more than ``cap`` partial splits remain at some stage. Stage by stage,
    each partial split (carrying its sums) is extended by every next cut from which the least completion
    (``_completions``) keeps every sum below ``bar`` (so a partial split kept may still have no completion under
    every form at once: then the count may exceed ``cap`` where the splits do not). The partial splits are
    extended ``EXTEND_PAIRS`` (partial, cut) pairs at a time, so a stage that will exceed ``cap`` stops there
    rather than extending all of them (the answer is the same)."""
    S, m1 = ok.shape[0], ok.shape[1]
    comp = _completions(ok, terms)
    paths, sums = np.zeros((1, 1), dtype=np.int64), np.zeros((1, terms.count))
    step = max(1, EXTEND_PAIRS // m1)
    for s in range(S):
        v = terms.v[:, s]
        rows, his, kept = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], 0
        for at in range(0, len(paths), step):
            lo = paths[at:at + step, -1]
            row, hi = np.nonzero(ok[s][lo])
            slot = terms.index[lo[row], hi]
            for q in range(terms.count):  # each form filters what the ones before kept
                keep = sums[at + row, q] + v[q, slot] + comp[q, s + 1, hi] < bar
                row, hi, slot = row[keep], hi[keep], slot[keep]
            kept += len(row)
            if kept > cap:
                return None
            rows.append(at + row)
            his.append(hi)
        row, hi = np.concatenate(rows), np.concatenate(his)
        sums = sums[row] + v[:, terms.index[paths[row, -1], hi]].T
        paths = np.column_stack((paths[row], hi))
    return paths


def _least_split(ok: np.ndarray, terms: Terms) -> np.ndarray | None:
    """The split (cuts from 0 to m) whose stages are all ``ok`` with the least sum of the (one) form's terms, or
    None."""
    comp = _completions(ok, terms)[0]
    if not np.isfinite(comp[0, 0]):
        return None
    cuts = [0]
    for s in range(ok.shape[0]):
        lo = cuts[-1]
        g = terms.v[0, s][terms.index[lo]]
        cuts.append(int(np.argmin(np.where(ok[s][lo], g + comp[s + 1], np.inf))))
    return np.array(cuts)


def _descend(cur: tuple[int, ...], best: float, score: Callable[[tuple[int, ...], float], float],
             bounds: Bounds | None, radius: int, max_rounds: int, max_flat: int, wide: bool, many: Many | None = None
             ) -> tuple[tuple[int, ...], float]:
    """``best_split``'s descent from ``cur`` (score ``best``): the module docstring's moves. With ``many``, each
    round's moves whose bound may still improve on or tie ``best`` are scored in one call (the same scores as
    ``score``'s, to the last bit, so the same moves are taken), not one by one."""
    a, n = cur[0], cur[-1]
    seen: dict[tuple[int, ...], float] = {cur: best}

    def best_of(nb: list[tuple[int, ...]], base: float) -> tuple[tuple[int, ...] | None, float, tuple | None]:
        """The best unseen split of ``nb`` under ``base`` (None if none), and one that ties ``base``."""
        nb = [x for x in nb if x not in seen]
        X = np.array(nb, dtype=np.int64)
        lbs = bounds(X).tolist() if bounds is not None and nb else [0.0] * len(nb)
        got: dict[int, float] = {}
        if many is not None and nb:  # every move that may improve or tie, in one call
            go = np.flatnonzero(np.array(lbs) <= base * (1 + TIE))
            got = dict(zip(go.tolist(), many(X[go], base * (1 + TIE)).tolist())) if len(go) else {}
        step, step_score, tie = None, base, None
        for k, (x, lo) in enumerate(zip(nb, lbs)):
            bar = (base if step is None else step_score) * (1 + TIE)
            v = seen[x] = lo if lo > bar else got[k] if many is not None else score(x, bar)
            if v < step_score * (1 - 1e-12):
                step, step_score = x, v
            elif tie is None and v <= base * (1 + TIE) and v < math.inf:
                tie = x
        return step, step_score, tie

    flat = 0
    home = cur  # the best split reached (``best`` its score); a sideways move may leave it
    for _ in range(max_rounds):
        step, step_score, tie = best_of(neighbours(cur, radius), best)
        d = 2 * radius
        while wide and step is None and d < n - a:  # no move of one layer improves: moves of 2, 4, 8, ... layers
            step, step_score, t = best_of(far(cur, d), best)
            tie = tie or t
            d *= 2
        if step is None:  # none improves: across the plateau, if there is one
            if tie is None or flat >= max_flat or not wide:
                break
            flat += 1
            cur = tie
            continue
        flat = 0
        cur = home = step
        best = step_score
    return home, best


def under(P: StageTerms, bar: float, cap: int) -> np.ndarray | None:
    """Every split whose stage-by-stage bound (``StageTerms``) is below ``bar``, as rows of cuts from 0 to m, or None
    where there are more than ``cap``. Without pairs: their number first, by dynamic programming from the last
    stage (the splits below ``bar`` of stages s.. from each cut); then stage by stage, each partial split extended
    by every next cut that some completion below ``bar`` follows. With pairs (``_under_pairs``) the same, the
    partial splits carrying the largest B of their stages."""
    if P.A is not None and P.B is not None:
        return _under_pairs(P.G < bar, bar - P.A, P.B, cap)
    ok = P.G < bar
    S, m1 = ok.shape[0], ok.shape[1]
    ways = np.zeros((S + 1, m1))
    ways[S, m1 - 1] = 1.0
    for s in range(S - 1, -1, -1):  # float counts: exact up to 2**53, and only compared with cap beyond
        ways[s] = ok[s] @ ways[s + 1]
    if ways[0, 0] > cap:
        return None
    paths = np.zeros((1, 1), dtype=np.int64)
    for s in range(S):
        row, hi = np.nonzero(ok[s][paths[:, -1]] & (ways[s + 1] > 0)[None, :])
        paths = np.column_stack((paths[row], hi))
    return paths


def stage_bound(P: StageTerms, X: np.ndarray) -> np.ndarray:
    """The stage-by-stage bound (``StageTerms``) of the splits in the rows of X (cuts from 0 to m): what ``under``
    compares with its bar."""
    S = X.shape[1] - 1
    at = (np.arange(S)[None, :], X[:, :-1], X[:, 1:])
    out = np.max(P.G[at], axis=1)
    if P.A is not None and P.B is not None:  # max over s <= p of A_p + B_s: A_p plus the largest B up to p
        out = np.maximum(out, np.max(P.A[at] + np.maximum.accumulate(P.B[at], axis=1), axis=1))
    return out


def _under_pairs(ok: np.ndarray, room: np.ndarray, B: np.ndarray, cap: int) -> np.ndarray | None:
    """``under`` with pairs: a split is below the bar where every stage is (``ok``) and max over s <= p of
    B[s] < room[p] (room = bar - A). A partial split of stages ..s-1 carrying beta (the largest B of its stages)
    extends by stage s = [lo, hi) where max(beta, B[s, lo, hi]) < C[s, lo, hi] = min(room[s, lo, hi], top[s + 1,
    hi]), top[s, lo] being the largest beta from which stages s.. can still be completed from lo (a larger beta
    only removes completions): top[S, m] = inf, top[s, lo] = max of C[s, lo, hi] over the hi that stage s may
    take (B[s, lo, hi] < C). Every partial split kept has a completion, so more than ``cap`` of them at any stage
    means more than ``cap`` splits: None, without listing the rest."""
    S, m1 = ok.shape[0], ok.shape[1]
    top = np.full((S + 1, m1), -np.inf)
    top[S, m1 - 1] = np.inf

    def room_at(s: int, lo: np.ndarray) -> np.ndarray:
        return np.where(ok[s][lo], np.minimum(room[s][lo], top[s + 1][None, :]), -np.inf)
    every = np.arange(m1)
    for s in range(S - 1, -1, -1):
        C = room_at(s, every)
        top[s] = np.where(B[s] < C, C, -np.inf).max(axis=1)
    paths, beta = np.zeros((1, 1), dtype=np.int64), np.full(1, -np.inf)
    if not top[0, 0] > -np.inf:
        return np.zeros((0, S + 1), dtype=np.int64)
    for s in range(S):
        lo = paths[:, -1]
        C, b = room_at(s, lo), B[s][lo]
        row, hi = np.nonzero((b < C) & (beta[:, None] < C))
        if len(row) > cap:
            return None
        paths, beta = np.column_stack((paths[row], hi)), np.maximum(beta[row], b[row, hi])
    return paths


def far(cuts: Sequence[int], d: int) -> list[tuple[int, ...]]:
    """Splits d layers away: one cut moved by d, or all the cuts after (before) a stage shifted by d."""
    c = list(cuts)
    S = len(c) - 1
    out = []
    for i in range(1, S):
        for sgn in (-d, d):
            out.append(c[:i] + [c[i] + sgn] + c[i + 1:])
            out.append(c[:i] + [v + sgn for v in c[i:S]] + c[S:])
            out.append(c[:1] + [v + sgn for v in c[1:i + 1]] + c[i + 1:])
    return list(dict.fromkeys(tuple(x) for x in out if all(p < q for p, q in zip(x, x[1:]))))


def _score_rows(cur: tuple[int, ...], best: float, X: np.ndarray, score: Callable[[tuple[int, ...], float], float],
                bounds: Bounds | None, many: Many | None, cutoff: float, lower: np.ndarray | None = None
                ) -> tuple[tuple[int, ...], float]:
    """``best_split``'s enumeration: the splits in the rows of X (all of them, or all that may win) scored in
    ascending order of their bounds (with ``lower``, the larger of it and ``bounds``' for each row) until the next
    bound cannot win (one at a time by ``score``, or ``CHUNK`` at a time by ``many``); ``cur`` (score ``best``)
    where none beats it."""
    lb = bounds(X) if bounds is not None else np.zeros(len(X))
    if lower is not None:
        lb = np.maximum(lb, lower)
    stop = cutoff * (1 + 1e-12)
    order = np.argsort(lb, kind="stable")
    if many is not None:
        for at in range(0, len(order), CHUNK):
            idx = order[at:at + CHUNK]
            idx = idx[(lb[idx] < best * (1 - 1e-12)) & (lb[idx] <= stop)]
            if not len(idx):  # the bounds ascend: no later chunk can win either
                break
            scores = many(X[idx])
            j = int(np.argmin(scores))
            if scores[j] < best * (1 - 1e-12):
                cur, best = tuple(X[idx[j]].tolist()), float(scores[j])
        return cur, best
    for i in order.tolist():
        if not (lb[i] < best * (1 - 1e-12) and lb[i] <= stop):
            break
        x = tuple(X[i].tolist())
        if x != cur:
            v = score(x, best)
            if v < best * (1 - 1e-12):
                cur, best = x, v
    return cur, best


@functools.lru_cache(maxsize=32)
def _every_cut(m: int, S: int) -> np.ndarray:
    """Every split of m layers into S stages, as rows of cuts from 0 to m (kept: phases and candidates share them)."""
    X = np.array([(0, *inner, m) for inner in itertools.combinations(range(1, m), S - 1)], dtype=np.int64)
    X.flags.writeable = False
    return X
