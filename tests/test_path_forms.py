"""The proof of a split by the simulator's own chains (issue 22 item 4: the split must minimise the simulated
iteration, or be proven to): ``simulate.critical_path`` (the chain of actions that ends a split's iteration, as
counts of its stages' durations), ``simulate.rank_paths`` (each rank's own chain), ``bounds.path_tables`` /
``path_terms`` (those chains priced on every stage and range of layers), and ``resplit.under_forms`` /
``_by_forms`` (the splits under every chain, stage by stage). Before it, schedules with several stages a rank
(interleaved 1F1B, looped BFS, ZB-V) had no stage-by-stage bound that sums a rank's stages, and their
candidates with too many splits to score kept the descent's split unproven."""
from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from ptplan.planner import resplit
from ptplan.planner.cluster import get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.errors import PtplanError
from ptplan.planner.profile import load_profile
from ptplan.planner.schedule import ScheduleError, build_schedule, terapipe
from ptplan.planner.search import PhaseSearch, Visit, _Scorer
from ptplan.planner.stage import StageChoice
from ptplan.planner.simulate import StageTimes, critical_path, critical_paths, iterations, path_durations, rank_paths
from tests.test_search import _proofs, random_case

ROOT = Path(__file__).resolve().parents[1]
FLUSHED = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
           ("looped-bfs", 2), ("zb-v", 2)]


def _random_times(rng: np.random.Generator, N: int, S: int) -> StageTimes:
    f = {k: rng.uniform(0.0, 1.0, (N, S)) * rng.choice([0.0, 1.0, 5.0], (N, S), p=[0.1, 0.7, 0.2])
         for k in StageTimes._fields}
    f["backward_weight_s"] = f["backward_s"] * rng.uniform(0.0, 1.0, (N, S))
    f["prefix_s"][:, 1:] = f["setup_s"][:, 1:] = 0.0
    f["send_forward_s"][:, -1] = f["send_backward_s"][:, 0] = 0.0
    return StageTimes(**f)


@pytest.mark.parametrize("schedule,V", FLUSHED)
def test_the_critical_path_is_the_iteration_at_its_split_and_below_it_anywhere_else(schedule, V):
    """At the durations it was read from, the chain's sum plus the step overhead is the simulated iteration; at
    any other durations (200 random sets, some all-reduce-heavy, some zero) it is at most theirs, and so is
    every rank's own chain and every chain through a rank made slower (``critical_paths``)."""
    rng = np.random.default_rng(len(schedule) + V)
    checked = 0
    while checked < 25:
        K = int(rng.integers(1, 6))
        M = int(rng.integers(1, 3 * K + 1))
        try:
            sched = build_schedule(schedule, K, M, V)
        except ScheduleError:
            continue
        x, step = _random_times(rng, 1, sched.K), float(rng.uniform(0.0, 0.1))
        it = float(iterations(sched, x, step_overhead_s=step)[0])
        n = critical_path(sched, x)
        assert float((path_durations(x)[0] * n).sum()) + step == pytest.approx(it, rel=1e-12)
        y = _random_times(rng, 200, sched.K)
        its = iterations(sched, y, step_overhead_s=step)
        d = path_durations(y)
        assert ((d * n).sum(axis=(1, 2)) + step <= its * (1 + 1e-12)).all()
        ranks = np.einsum("nsf,rsf->nr", d, rank_paths(sched))
        assert (ranks.max(axis=1) + step <= its * (1 + 1e-12)).all()
        tilted = critical_paths(sched, x)  # the split's own chain first, then those through a slower rank
        assert np.array_equal(tilted[0], n) and len({t.tobytes() for t in tilted}) == len(tilted)
        assert len(tilted) <= 1 + sched.num_ranks
        for t in tilted:
            assert ((d * t).sum(axis=(1, 2)) + step <= its * (1 + 1e-12)).all()
        checked += 1


def test_the_chains_are_refused_where_there_is_no_flush_or_there_are_token_slices():
    x = _random_times(np.random.default_rng(0), 1, 4)
    for sched in (build_schedule("2bw", 4, 8), terapipe(4, 4, 2)):
        with pytest.raises(PtplanError, match="token slices or no flush"):
            critical_path(sched, x)
        with pytest.raises(PtplanError, match="token slices or no flush"):
            rank_paths(sched)


@pytest.mark.parametrize("pairs", [resplit.EXTEND_PAIRS, 1, 20])
@pytest.mark.parametrize("seed", range(4))
def test_under_forms_lists_exactly_the_splits_under_every_form_or_says_there_are_too_many(seed, pairs, monkeypatch):
    """On random terms (some stages not ``ok``): the rows are exactly the splits whose every form's sum is under
    the bar (every split summed and filtered); with a ``cap`` under their number the answer is None; the least
    split of a form's terms is the one of least sum. The same whether the partial splits are extended all at once
    (the default ``EXTEND_PAIRS`` is more pairs than these have), one at a time, or a few at a time."""
    monkeypatch.setattr(resplit, "EXTEND_PAIRS", pairs)
    rng = np.random.default_rng(seed)
    compared = 0
    for _ in range(40):
        S, m, Q = int(rng.integers(1, 5)), int(rng.integers(4, 10)), int(rng.integers(1, 4))
        if S > m:
            continue
        shape = (S, m + 1, m + 1)
        terms = [rng.uniform(0.0, 1.0, shape) for _ in range(Q)]
        ok = (rng.uniform(0.0, 1.0, shape) > 0.15) & np.triu(np.ones((m + 1, m + 1), dtype=bool), k=1)[None]
        X = resplit._every_cut(m, S)
        at = (np.arange(S)[None, :], X[:, :-1], X[:, 1:])
        sums = np.stack([g[at].sum(axis=1) for g in terms], axis=1)
        fine = ok[at].all(axis=1)
        u = np.unique(sums.max(axis=1)[fine])
        bar = float(rng.choice(u) + 1e-9) if len(u) else 1.0
        want = sorted(map(tuple, X[fine & (sums < bar).all(axis=1)].tolist()))
        got = resplit.under_forms(ok, resplit.Terms.of(terms), bar, 10**6)
        assert got is not None and sorted(map(tuple, got.tolist())) == want
        if want:
            assert resplit.under_forms(ok, resplit.Terms.of(terms), bar, len(want) - 1) is None
            least = resplit._least_split(ok, resplit.Terms.of(terms[:1]))
            assert least is not None
            assert terms[0][np.arange(S), least[:-1], least[1:]].sum() == pytest.approx(sums[fine, 0].min(), rel=1e-12)
        compared += 1
    assert compared >= 30


def _flushed_cases(seed: int, count: int):
    """(scorer, every split) of random searches' candidates (``tests/test_search.random_case``: random profiles,
    clusters, schedules, the AutoCache, squeezed memory) whose schedule has a flush and whose splits fit."""
    rng = random.Random(seed)
    found = 0
    while found < count:
        prof, cluster, cfg = random_case(rng)
        try:
            s = PhaseSearch(prof, cluster, cfg, strategies=rng.choice(["off", "auto"]))
        except PtplanError:
            continue
        f = rng.randint(0, prof.num_blocks - 1)
        n0 = prof.frozen_boundary(f)
        visit = Visit(samples=float(cfg.samples_per_epoch), fill_from=rng.choice([0, 1]))
        cands = [c for c in s.candidates(f, n0)[0] if c.schedule != "2bw" and 1 < c.S <= s.n - n0]
        if not cands:
            continue
        c = rng.choice(cands)
        model = s.model(c, n0, visit.fill_from if c.cache else 0)
        sc = _Scorer(s, c, model, s.schedule(c), visit, math.inf)
        if sc.proofs(s.batched(c))["forms"] is None:
            continue
        X = resplit._every_cut(s.n - n0, c.S)[:400] + n0
        yield sc, X
        found += 1


@pytest.mark.parametrize("seed", range(3))
def test_the_forms_never_exceed_a_splits_objective_and_meet_it_at_their_own_split(seed):
    """Every form (each rank's chain; a split's critical chains) summed over any split's stages, in the objective's
    units (the AutoCache's fill iteration weighted in, stages choosing their strategy), is at most that split's
    simulated objective; at the split it came from, the largest is its objective where one model prices every
    stage (not a choice among strategies: the tables hold each duration's least over the models) and the steady
    and fill iterations share their chain (always without the AutoCache)."""
    checked = exact = 0
    for sc, X in _flushed_cases(seed, 12):
        scores = sc.many(X)
        a = X[0, 0]
        finite = np.flatnonzero(np.isfinite(scores))
        for i in finite[:3].tolist() + [int(np.argmin(scores))]:
            if not np.isfinite(scores[i]):
                continue
            forms = sc.forms(None, 10**6) + sc.forms(tuple(X[i].tolist()), 10**6)
            sums = forms.sums(X - a).T
            ok = np.isfinite(scores)
            assert (sums[ok] <= scores[ok, None] * (1 + 1e-9)).all(), sc.c.tag
            if not sc.c.cache and not isinstance(sc.model, StageChoice):
                assert sums[i].max() == pytest.approx(scores[i], rel=1e-9), sc.c.tag
                exact += 1
            checked += 1
    assert checked >= 12 and exact >= 4, (checked, exact)


def _interleaved_bert_large(monkeypatch, forms: bool) -> list:
    """(K, M, proven by the forms, objective / least over every split) of bert-large's candidates of 4 stages with
    M <= 8 under interleaved 1F1B on dgx-a100 at batch 256, ``ENUMERATE_MANY`` at 1,000 against their 19,600
    splits; ``forms=False``: the search without the proof by forms (the descent's split where ``under`` fails)."""
    monkeypatch.setattr(resplit, "ENUMERATE_MANY", 1000)
    if not forms:
        proofs = _Scorer.proofs
        monkeypatch.setattr(_Scorer, "proofs", lambda self, batched: {**proofs(self, batched), "forms": None})
    prof = load_profile(ROOT / "profiles" / "bert-large_a100_bf16.json")
    cfg = TrainingConfig(epochs=2, samples_per_epoch=6400, batch=256, schedule="interleaved-1f1b")
    s = PhaseSearch(prof, get_preset("dgx-a100"), cfg)
    got = _proofs(monkeypatch, s, Visit(samples=6400.0), lambda c: c.S == 4 and c.M <= 8, record="under_forms")
    return [(c.K, c.M, proven, choice.objective / least) for c, choice, _, least, proven in got]


def test_where_a_rank_holds_several_stages_the_forms_prove_the_split(monkeypatch):
    """bert-large's 51 layers, interleaved 1F1B with V = 4 on K = 1 (every split ties: one rank runs all of it) and
    V = 2 on K = 2: the stage-by-stage bound proves none of the candidates (each of its terms is one stage's, a
    quarter or half of a rank's work); the forms prove every one, and each split is the least of every split's
    simulated objective. Without them the descent ends 0.27 % and 0.51 % above it at K = 2, M = 4 and M = 8."""
    got = _interleaved_bert_large(monkeypatch, forms=True)
    assert {(K, M) for K, M, *_ in got} >= {(1, 1), (1, 8), (2, 2), (2, 4), (2, 8)}
    for K, M, proven, ratio in got:
        assert proven and ratio <= 1 + resplit.FORM_TIE, (K, M, ratio)


def test_path_tables_are_the_same_priced_a_few_ranges_at_a_time(monkeypatch):
    """``bounds.path_tables`` prices ``TABLE_ROWS`` ranges of layers at a time: with 7 (every block short, the last
    shorter) the tables are the ones priced all at once, bit for bit (random searches' candidates: the AutoCache,
    per-stage strategies)."""
    from ptplan.planner import bounds

    checked = 0
    for sc, _ in _flushed_cases(5, 6):
        whole = bounds.path_tables(sc.c, sc.model, sc.limit, sc._weights)
        monkeypatch.setattr(bounds, "TABLE_ROWS", 7)
        part = bounds.path_tables(sc.c, sc.model, sc.limit, sc._weights)
        monkeypatch.undo()
        assert len(whole.i) > 7 and np.array_equal(whole.d, part.d) and np.array_equal(whole.fits, part.fits)
        checked += 1
    assert checked == 6


def test_terms_hold_each_range_once_and_sum_as_the_dense_arrays():
    """``resplit.Terms``: a form's term of stage s holding [i, j) is the dense array's [s, i, j]; every i >= j is
    the infinite slot; the sums over splits, the mean and the concatenation are the dense arrays'."""
    rng = np.random.default_rng(0)
    S, m = 3, 7
    dense = [rng.uniform(0.0, 1.0, (S, m + 1, m + 1)) for _ in range(3)]
    t = resplit.Terms.of(dense)
    assert t.v.shape == (3, S, m * (m + 1) // 2 + 1) and t.count == 3
    upper = np.triu(np.ones((m + 1, m + 1), dtype=bool), k=1)
    for s in range(S):
        got = t.dense(s)
        assert (got[:, upper] == np.stack([g[s][upper] for g in dense])).all()
        assert np.isinf(got[:, ~upper]).all()
    X = resplit._every_cut(m, S)
    at = (np.arange(S)[None, :], X[:, :-1], X[:, 1:])
    want = np.stack([g[at].sum(axis=1) for g in dense])
    assert np.allclose(t.sums(X), want, rtol=1e-12)
    assert np.allclose(t.mean().sums(X)[0], want.mean(axis=0), rtol=1e-12)
    both = t + t.first(1)
    assert both.count == 4 and (both.v[3] == t.v[0]).all()


def test_the_forms_held_fit_their_memory_and_a_proof_under_a_tight_budget_is_still_exact(monkeypatch):
    """``resplit.FORM_BYTES`` bounds the forms' terms each listing holds (here lowered to one form's bytes): the
    proof then has one chain at a time (the newest), proves fewer of bert-large's interleaved candidates, and every
    one it proves is still the least of every split's simulated objective."""
    monkeypatch.setattr(resplit, "FORM_BYTES", 1)
    held = []
    real = resplit.under_forms
    monkeypatch.setattr(resplit, "under_forms", lambda ok, terms, *a: held.append(terms.count) or real(ok, terms, *a))
    got = _interleaved_bert_large(monkeypatch, forms=True)
    assert held and max(held) == 1
    assert any(proven for *_, proven, _ in got)
    for K, M, proven, ratio in got:
        assert not proven or ratio <= 1 + resplit.FORM_TIE, (K, M, ratio)


def test_without_the_forms_the_descent_misses_the_best_split(monkeypatch):
    got = _interleaved_bert_large(monkeypatch, forms=False)
    assert not any(proven for *_, proven, _ in got)
    assert max(ratio for *_, ratio in got) > 1.002, got
