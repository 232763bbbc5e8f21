"""The split by simulated time (planner/resplit.py): the search's phase equals the best of every split x K x M x
cache, each scored by the simulator (not by the partitioner's proxy)."""
from __future__ import annotations

import itertools
import math
from dataclasses import replace
import random

import numpy as np
import pytest

from ptplan.planner import resplit
import ptplan.planner.search as search_mod
from ptplan.planner.cluster import get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.profile import load_profile
from ptplan.planner.search import PhaseSearch, Visit, _seconds_per_sample
from ptplan.planner.simulate import simulate
from ptplan.planner.stage import StageChoice
from tests.test_search import random_case


def brute_force(s: PhaseSearch, f: int, visit: Visit, max_stages: int | None = None
                ) -> tuple[float, object, tuple] | None:
    """Every candidate (K, M, cache, schedule, strategy; at most ``max_stages`` stages) x every split of its active
    layers x, where stages choose their strategy, every assignment of strategies to its stages, that fits, scored
    by the simulator with the search's own objective; (objective, candidate, ranges) of the best, None if none
    fits."""
    n0 = s.p.frozen_boundary(f)
    cands, _, _ = s.candidates(f, n0)
    best = None
    for c in cands:
        if max_stages is not None and c.S > max_stages:
            continue
        ff = visit.fill_from if c.cache else 0
        if not s.host_fits(c, n0, ff)[0]:
            continue
        model = s.model(c, n0, ff)
        limit = s.stage_limit(c, n0, ff) * (1 + 1e-12)
        sched = s.schedule(c)
        for inner in itertools.combinations(range(n0 + 1, s.n), c.S - 1):
            ranges = tuple(zip([n0, *inner], [*inner, s.n]))
            for costs, fill_costs in assignments(model, ranges, limit, fill=c.cache):
                steady = simulate(sched, costs, step_overhead_s=s.c.step_overhead_s).iteration_s
                fill = steady if not c.cache else simulate(sched, fill_costs,
                                                           step_overhead_s=s.c.step_overhead_s).iteration_s
                obj = _seconds_per_sample(c, steady, fill, visit, s.cfg.samples_per_epoch)
                if best is None or obj < best[0]:
                    best = (obj, c, ranges)
    return best


def assignments(model, ranges, limit: float, *, fill: bool):
    """(stage costs, fill-iteration stage costs or None) of every assignment of models to the split's stages that
    fits: one for a ``StageModel``; for a ``StageChoice``, every model that fits each stage, each stage priced by
    its model alone."""
    models = model.models if isinstance(model, StageChoice) else (model,)
    each = [(m.peaks(ranges), m.stage_costs(ranges), m.stage_costs(ranges, fill=True) if fill else None)
            for m in models]
    fits = [[p for p, e in enumerate(each) if e[0][s] <= limit] for s in range(len(ranges))]
    for pick in itertools.product(*fits):
        yield ([each[p][1][s] for s, p in enumerate(pick)],
               [each[p][2][s] for s, p in enumerate(pick)] if fill else None)


def _compare(seed: int, cases: int) -> list[float]:
    """The search's objective over the brute force's, per feasible phase of random small cases."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(cases):
        prof, cluster, cfg = random_case(rng)
        for f in sorted({0, rng.randint(0, prof.num_blocks), prof.num_blocks}):
            visit = Visit(samples=rng.choice([1.0, float(cfg.samples_per_epoch), 5.0 * cfg.samples_per_epoch]))
            ref = brute_force(PhaseSearch(prof, cluster, cfg), f, visit)
            if ref is None:
                continue
            got = PhaseSearch(prof, cluster, cfg).search(f, visit)
            assert got.objective >= ref[0] * (1 - 1e-9), "the brute force missed a split"
            ratios.append(got.objective / ref[0])
    return ratios


@pytest.mark.parametrize("seed", range(4))
def test_chosen_phase_is_the_best_simulated_one(seed):
    """Randomised brute force: every split x K x M x cache x schedule scored by the simulator; the search's
    chosen phase is as fast as the best of them (its simulated objective, not the proxy)."""
    ratios = _compare(seed, 8)
    assert len(ratios) >= 10
    assert max(ratios) <= 1 + 1e-9, ratios


@pytest.mark.parametrize("seed", range(2))
def test_descent_alone_is_near_the_best(seed, monkeypatch):
    """With the exact enumeration off (as on large models past ``resplit.ENUMERATE_MANY`` splits, or with strategies
    chosen per stage: the descent from AutoPipe's split, only for candidates
    whose AutoPipe split is within ``resplit.GIVE_UP`` of the best): the brute force's best on most phases.
    Measured (seeds 100-101, 37 phases): 1 phase off, by 1.142x on seed 100, where K=4 is chosen and K=8's best
    split is ahead but K=8's AutoPipe split is too far behind to be descended from (``GIVE_UP``: the descent
    itself is not at fault there). Before the descent took moves of 2, 4, 8, ... layers and sideways moves across
    a plateau, 4 phases were off (1.143x, 1.040x, 1.001x; 1.024x). Over seeds 100-111 (237 phases):
    23 off, at most 1.176x, before; 14 off, at most 1.176x, now (of the 6 over 1.05x, 5 are a K or M that is not
    descended from, one an interleaved split the descent does not reach, 1.074x). A local descent, so the bound
    is on how far and how often, not zero."""
    monkeypatch.setattr(resplit, "ENUMERATE_UP_TO", 0)
    monkeypatch.setattr(resplit, "ENUMERATE_MANY", 0)
    ratios = _compare(100 + seed, 8)
    assert max(ratios) <= 1.25, ratios
    assert sum(r > 1 + 1e-9 for r in ratios) <= len(ratios) // 10, ratios




def _random_searches(rng: random.Random, count: int):
    """``count`` random cases (``random_case``), strategies off and auto in turn: (search, frozen blocks, first
    active layer) of each."""
    for i in range(count):
        prof, cluster, cfg = random_case(rng)
        s = PhaseSearch(prof, cluster, cfg, strategies=("off", "auto")[i % 2])
        f = rng.randint(0, prof.num_blocks)
        yield s, f, prof.frozen_boundary(f)

@pytest.mark.parametrize("seed", range(2))
def test_the_descent_scoring_each_rounds_moves_at_once_takes_the_same_moves(seed, monkeypatch):
    """The descent with ``many`` (each round's moves whose bound may improve or tie, scored in one
    ``simulate.iterations`` call, with ``split_bounds`` for the hopeless) ends where the descent scoring one move at a
    time ends, with the same score, on random profiles, clusters, schedules, the AutoCache and strategies uniform and
    per stage: the scores are equal to the last bit, so every move, tie and sideways step is the same."""
    from ptplan.planner.partition import split_stages
    from ptplan.planner.search import _Scorer

    monkeypatch.setattr(resplit, "ENUMERATE_MANY", 0)
    rng = random.Random(300 + seed)
    compared = moved = 0
    for s, f, n0 in _random_searches(rng, 8):
        visit = Visit(samples=float(s.cfg.samples_per_epoch), fill_from=rng.randint(0, n0))
        cands = [c for c in s.candidates(f, n0)[0] if s.batched(c) and s.n - n0 > c.S > 1]
        for c in rng.sample(cands, min(5, len(cands))):
            model = s.model(c, n0, visit.fill_from if c.cache else 0)
            sc = _Scorer(s, c, model, s.schedule(c), visit, math.inf)
            try:
                part = split_stages(model, c.S, s.stage_limit(c, n0, visit.fill_from if c.cache else 0))
            except Exception:
                continue
            first = (part.ranges[0][0], *(hi for _, hi in part.ranges))
            one = resplit.best_split(first, sc, bounds=sc.bounds, enumerate_up_to=0, give_up=math.inf)
            batched = resplit.best_split(first, sc, bounds=sc.bounds, many=sc.many, give_up=math.inf)
            assert batched == one, (c.tag, first, one, batched)
            compared += 1
            moved += one[0] != first
    assert compared >= 20 and moved >= 5, (compared, moved)

def test_neighbours_keep_every_stage():
    cuts = (3, 4, 6, 9)
    got = resplit.neighbours(cuts, radius=2)
    assert got and len(set(got)) == len(got)
    for x in got:
        assert x[0] == 3 and x[-1] == 9 and all(a < b for a, b in zip(x, x[1:]))
    assert (3, 5, 6, 9) in got and (3, 4, 8, 9) in got and (3, 5, 7, 9) in got and (3, 5, 5, 9) not in got


def test_descent_takes_the_best_split_of_a_convex_score():
    """A score with one minimum: the descent reaches it from far away; the enumeration finds it too."""
    target = (0, 7, 13, 20, 30)

    def score(c, best):
        return float(sum((a - b) ** 2 for a, b in zip(c, target)))
    for up_to in (0, 10**6):
        cuts, v = resplit.best_split((0, 1, 2, 3, 30), score, enumerate_up_to=up_to)
        assert cuts == target and v == 0.0


def test_descent_crosses_a_plateau():
    """A score flat around the start, with its minimum 3 layers away (no move of 1, 2, 4 or 8 layers from the
    start reaches it): a sideways move onto the plateau, then a move of 2, reach it; with ``max_flat=0`` the
    descent stops where it started. The score returned is the returned split's."""
    def score(c, best):
        return 1.0 if c[1] == 6 else 2.0

    cuts, v = resplit.best_split((0, 9, 20), score, enumerate_up_to=0)
    assert cuts == (0, 6, 20) and v == 1.0, (cuts, v)
    stuck, v0 = resplit.best_split((0, 9, 20), score, enumerate_up_to=0, max_flat=0)
    assert stuck == (0, 9, 20) and v0 == 2.0


def test_descent_jumps_a_wall():
    """A score whose moves of one layer all lose (a wall either side) and whose minimum is 4 layers away: the
    moves by 2, then 4 layers find it; 3 layers away, no move reaches it and the descent stays."""
    def score(c, best, low=5):
        return {9: 2.0, low: 1.0}.get(c[1], 3.0)

    cuts, v = resplit.best_split((0, 9, 20), score, enumerate_up_to=0)
    assert cuts == (0, 5, 20) and v == 1.0, (cuts, v)
    cuts, v = resplit.best_split((0, 9, 20), lambda c, b: score(c, b, low=6), enumerate_up_to=0)
    assert cuts == (0, 9, 20) and v == 2.0, (cuts, v)


def test_a_narrow_descent_takes_one_layer_moves_only():
    """``wide=False`` (the token-slice split search): the wall that the wide descent jumps (4 layers away) stops
    it, it takes no sideways move across a plateau, and every split it scores is one layer-move from a split it
    stood on; a one-layer slope it still descends to the bottom."""
    scored = []

    def wall(c, best):
        scored.append(c)
        return {9: 2.0, 5: 1.0}.get(c[1], 3.0)

    cuts, v = resplit.best_split((0, 9, 20), wall, enumerate_up_to=0, wide=False)
    assert cuts == (0, 9, 20) and v == 2.0, (cuts, v)
    assert all(abs(c[1] - 9) <= resplit.RADIUS for c in scored), scored
    def plateau(c, best):  # test_descent_crosses_a_plateau's: the wide descent walks it to 6
        return 1.0 if c[1] == 6 else 2.0

    assert resplit.best_split((0, 9, 20), plateau, enumerate_up_to=0) == ((0, 6, 20), 1.0)
    assert resplit.best_split((0, 9, 20), plateau, enumerate_up_to=0, wide=False) == ((0, 9, 20), 2.0)
    slope = resplit.best_split((0, 9, 20), lambda c, b: abs(c[1] - 15), enumerate_up_to=0, wide=False)
    assert slope == ((0, 15, 20), 0)


def test_far_moves_keep_every_stage():
    got = resplit.far((0, 3, 6, 9), 2)
    assert {(0, 1, 6, 9), (0, 5, 6, 9), (0, 3, 4, 9), (0, 5, 8, 9), (0, 1, 4, 9), (0, 3, 8, 9)} <= set(got)
    assert not {(0, 6, 6, 9), (0, 3, 9, 9)} & set(resplit.far((0, 3, 6, 9), 3))
    for x in got:
        assert x[0] == 0 and x[-1] == 9 and all(a < b for a, b in zip(x, x[1:]))


def test_infeasible_start_is_left_where_it_is():
    cuts, v = resplit.best_split((0, 5, 10), lambda c, b: math.inf, enumerate_up_to=0)
    assert cuts == (0, 5, 10) and v == math.inf


def test_bert_large_on_cpu4_takes_the_faster_split():
    """Issue 22's shipped example: bert-large (A100 bf16 profile) on cpu:4 at 17 frozen blocks, K=2: the proxy's
    (35,36)|(36,51) simulated 1.25x slower than the best split (1.34x on the profile projected again with fused
    attention); the search returns the split whose simulated iteration is the least of every K=2 split
    ((35,42)|(42,51) now)."""
    prof = load_profile("profiles/bert-large_a100_bf16.json")
    s = PhaseSearch(prof, get_preset("cpu:4"), TrainingConfig(epochs=10, samples_per_epoch=50000, batch=512))
    ch = s.search(17, Visit(samples=50000.0))
    assert ch.cand.K == 2

    def simulated(cut: int) -> float:
        return simulate(s.schedule(ch.cand), s.model(ch.cand, 35).stage_costs(((35, cut), (cut, 51))),
                        step_overhead_s=s.c.step_overhead_s).iteration_s
    best = min(range(36, 51), key=simulated)
    assert ch.ranges == ((35, best), (best, 51)), (ch.ranges, best)
    slow = simulate(s.schedule(ch.cand), s.model(ch.cand, 35).stage_costs(((35, 36), (36, 51))),
                    step_overhead_s=s.c.step_overhead_s).iteration_s
    assert slow > 1.2 * ch.sim.iteration_s


@pytest.mark.parametrize("seed", range(3))
def test_cheap_bounds_never_exceed_the_score(seed):
    """``_Scorer.bounds`` (numpy, many splits at once) is a lower bound of the simulated objective of every split,
    infinite exactly where a stage breaks the memory limit: the enumeration and the descent skip splits on it.
    Strategies uniform and chosen per stage: there each stage's terms are the least over the models that fit it."""
    from ptplan.planner.search import _Scorer
    rng = random.Random(200 + seed)
    checked = per_stage = 0
    for s, f, n0 in _random_searches(rng, 12):
        visit = Visit(samples=rng.choice([0.5, 1.0, 3.0 * s.cfg.samples_per_epoch]), fill_from=rng.randint(0, n0))
        cands, _, _ = s.candidates(f, n0)
        per, uniform = [c for c in cands if c.per_stage], [c for c in cands if not c.per_stage]
        for c in rng.sample(per, min(5, len(per))) + rng.sample(uniform, min(3, len(uniform))):
            model = s.model(c, n0, visit.fill_from if c.cache else 0)
            sc = _Scorer(s, c, model, s.schedule(c), visit, math.inf)
            X = np.array([(n0, *i, s.n) for i in itertools.combinations(range(n0 + 1, s.n), c.S - 1)][:40])
            for x, lb in zip(X, sc.bounds(X)):
                v = sc(tuple(x.tolist()), math.inf)
                assert lb <= v * (1 + 1e-9), (c, x, lb, v)
                assert math.isinf(lb) == math.isinf(v), (c, x)
                checked += 1
                per_stage += c.per_stage
    assert checked >= 100 and per_stage >= 40


@pytest.mark.parametrize("seed", range(2))
def test_per_stage_strategies_take_the_best_simulated_split(seed, monkeypatch):
    """With ``strategies="auto"`` (FSDP and recomputation uniform or chosen per stage): every split x candidate of at
    most 3 stages x assignment of the 4 whole-stage strategies to its stages, scored by the simulator: the search's
    phase is as fast as the best."""
    monkeypatch.setattr(search_mod, "LAYERWISE", ())  # 4 strategies a stage: at most 4^3 assignments of a split
    rng = random.Random(300 + seed)
    compared = 0
    for _ in range(4):
        prof, cluster, cfg = random_case(rng)
        cfg = replace(cfg, schedule=rng.choice(["1f1b", "gpipe"]))
        for f in sorted({0, rng.randint(0, prof.num_blocks)}):
            visit = Visit(samples=float(cfg.samples_per_epoch))
            ref = brute_force(PhaseSearch(prof, cluster, cfg, strategies="auto"), f, visit, max_stages=3)
            if ref is None:
                continue
            got = PhaseSearch(prof, cluster, cfg, strategies="auto").search(f, visit)
            assert got.objective <= ref[0] * (1 + 1e-9), (got.cand, got.ranges, ref)
            compared += 1
    assert compared >= 3


@pytest.mark.parametrize("seed", range(4))
def test_under_with_pairs_finds_exactly_the_splits_below_the_bar_or_says_there_are_more_than_cap(seed):
    """``resplit.under`` with pairs (``StageTerms`` A, B: a stage's term with every later stage's) on random terms,
    some infinite: the rows are exactly the splits whose ``stage_bound`` is below the bar (every split listed and
    filtered), and with ``cap`` one under their number it answers None, at their number the rows."""
    rng = np.random.default_rng(seed)
    compared = 0
    for _ in range(40):
        S, m = int(rng.integers(2, 5)), int(rng.integers(4, 10))
        if S > m:
            continue
        shape = (S, m + 1, m + 1)
        G, A, B = rng.uniform(0, 1, shape), rng.uniform(0, 1, shape), rng.uniform(-0.5, 0.5, shape)
        G[rng.uniform(0, 1, shape) < 0.1] = np.inf
        G[:, ~np.triu(np.ones((m + 1, m + 1), dtype=bool), k=1)] = np.inf  # (the contract: no stage of no layers)
        P = resplit.StageTerms(G, A, B)
        X = resplit._every_cut(m, S)
        bound = resplit.stage_bound(P, X)
        u = np.unique(bound[np.isfinite(bound)])  # the bar between two bounds (at one, rounding may go either way)
        k = int(rng.integers(0, len(u))) if len(u) else 0
        bar = float((u[k] + u[k + 1]) / 2) if k + 1 < len(u) else float(u[-1] + 1.0) if len(u) else 1.0
        want = sorted(map(tuple, X[bound < bar].tolist()))
        got = resplit.under(P, bar, 10**6)
        assert got is not None and sorted(map(tuple, got.tolist())) == want
        if want:
            assert resplit.under(P, bar, len(want) - 1) is None
            assert len(resplit.under(P, bar, len(want))) == len(want)
        compared += 1
    assert compared >= 30
