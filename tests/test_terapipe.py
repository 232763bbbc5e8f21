"""TeraPipe's token slicing (``planner/terapipe.py``): the search equals brute force, beats uniform slices,
and the cost fit recovers known coefficients."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ptplan.planner.errors import PtplanError
from ptplan.planner.terapipe import (SliceCost, brute_force_slices, fit_slice_cost, optimal_slices,
                                     uniform_slices)


def _random_cost(rng: random.Random) -> SliceCost:
    return SliceCost(const=rng.uniform(0, 2), per_token=rng.uniform(0.1, 1), per_context=rng.uniform(0, 0.3),
                     per_pair=rng.uniform(0, 0.2), b=rng.choice([1, 2, 4]))


def test_search_equals_brute_force_on_random_small_cases():
    rng = random.Random(0)
    for _ in range(120):
        cost = _random_cost(rng)
        L, K = rng.randint(1, 12), rng.randint(1, 9)
        got, want = optimal_slices(cost, L, K), brute_force_slices(cost, L, K)
        assert sum(got.slices) == L
        assert got.latency_s == pytest.approx(want.latency_s, rel=1e-12), (cost, L, K, got, want)


def test_later_slices_are_shorter_and_beat_uniform_slicing():
    cost = SliceCost(const=0.5, per_token=1.0, per_context=0.05, per_pair=0.01)
    best = optimal_slices(cost, 64, 8)
    assert best.slices[0] > best.slices[-1]  # more context, shorter slice
    for n in (1, 2, 4, 8, 16, 32, 64):
        assert best.latency_s <= uniform_slices(cost, 64, 8, n).latency_s + 1e-12


def test_granularity_restricts_slices_to_multiples():
    cost = SliceCost(const=0.1, per_token=1.0, per_context=0.02, per_pair=0.001)
    coarse, fine = optimal_slices(cost, 64, 4, granularity=8), optimal_slices(cost, 64, 4)
    assert all(s % 8 == 0 for s in coarse.slices) and sum(coarse.slices) == 64
    assert fine.latency_s <= coarse.latency_s + 1e-12
    with pytest.raises(PtplanError, match="not a multiple of the slice granularity 7"):
        optimal_slices(cost, 64, 4, granularity=7)


def test_fit_recovers_the_coefficients_and_states_its_error():
    truth = SliceCost(const=0.002, per_token=3e-5, per_context=4e-6, per_pair=2e-9)
    pts = [(b, s, c, float(replace(truth, b=b)(s, c))) for b in (1, 4) for s in (16, 64, 256) for c in (0, 512, 1024)]
    fit = fit_slice_cost(pts)
    for k in ("const", "per_token", "per_context", "per_pair"):
        assert getattr(fit, k) == pytest.approx(getattr(truth, k), rel=1e-6)
    assert fit.fit_error is not None and fit.fit_error < 1e-9
    with pytest.raises(PtplanError, match="do not pin"):
        fit_slice_cost([(1, 16, 0, 1.0)] * 5)


def test_seq_2048_on_48_stages_at_16_token_granularity():
    """The issue's size (bench/terapipe_bench.py times it): the pruned search agrees with the DP run at
    every candidate bound (no pruning) and beats every uniform slicing."""
    cost = SliceCost(const=1e-4, per_token=2e-5, per_context=1e-6, per_pair=1e-9, b=1)
    got = optimal_slices(cost, 2048, 48, granularity=16)
    assert sum(got.slices) == 2048 and all(s % 16 == 0 for s in got.slices)
    assert 0 < got.candidates < 128 * 129 // 2  # pruned
    unpruned = optimal_slices(cost, 2048, 48, granularity=16, prune=False)
    assert got.latency_s == pytest.approx(unpruned.latency_s, rel=1e-12)
    assert all(got.latency_s <= uniform_slices(cost, 2048, 48, n).latency_s for n in (1, 2, 4, 8, 16, 32, 64, 128))


def test_square_term_relative_and_nonnegative_fits():
    truth = SliceCost(const=0.002, per_token=3e-5, per_context=0.0, per_pair=2e-9, per_square=5e-9)
    pts = [(b, s, c, float(replace(truth, b=b)(s, c))) for b in (1, 2) for s in (16, 64, 256) for c in (0, 512, 1024)]
    fit = fit_slice_cost(pts, square=True, relative=True)
    for k in ("const", "per_token", "per_pair", "per_square"):
        assert getattr(fit, k) == pytest.approx(getattr(truth, k), rel=1e-6)
    assert fit_slice_cost(pts).fit_error > 1e-3  # TeraPipe's form cannot express the s² term
    noisy = [(b, s, c, t * (1.1 if (s + c) % 3 else 0.9)) for b, s, c, t in pts]
    nn = fit_slice_cost(noisy, square=True, relative=True, nonnegative=True)
    assert min(nn.const, nn.per_token, nn.per_context, nn.per_pair, nn.per_square) >= 0
    with pytest.raises(PtplanError, match="at least 5"):
        fit_slice_cost(pts[:4], square=True)
