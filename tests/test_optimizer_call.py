"""A stage's optimizer step is one call over its layers (``executor/runtime/optim.py``), not one call per layer.

The profiler times an AdamW step over each layer's parameters alone, so every layer's time holds an optimizer
call's fixed cost; a stage pays it once (``CostTable.optimizer_call_s``, ``optimizer_range_s``). Before, a stage
was priced the per-layer sum: on the lent H100, bert-base's 27 layers summed to 11.9 ms of optimizer per step
and the plan over-predicted the measured steady step by 21.7 % (``bench/gpu_replan.py``).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ptplan.planner.ablate import frozen_in_place_table
from ptplan.planner.cluster import Cluster
from ptplan.planner.costs import CostTable, optimizer_call_s
from ptplan.planner.strategy import Strategy, min_table, strategy_table
from ptplan.planner.synthetic import synthetic_profile

from test_stage import model_for

C, V = 2e-4, 3e-9  # a call's fixed seconds, seconds per parameter


def _profile(c: float = C, v: float = V):
    prof = synthetic_profile(num_blocks=3, hidden=64, seq_len=16, vocab=512)
    return replace(prof, layers=tuple(replace(r, optimizer_s=c + v * r.params) for r in prof.layers))


def test_the_fixed_part_is_the_intercept_of_the_layers_times():
    prof = _profile()
    t = CostTable(prof)
    p = np.array([r.params for r in prof.layers], dtype=float)
    assert t.optimizer_call_s == pytest.approx(C, rel=1e-9)
    for lo, hi in ((0, t.n), (1, 4), (2, 3), (3, 3)):
        want = (C + V * p[lo:hi].sum()) if hi > lo else 0.0  # one call, each layer's own part
        assert t.optimizer_range_s(lo, hi) == pytest.approx(want, rel=1e-9)
    assert t.optimizer_range_s(0, t.n) == pytest.approx(t.optimizer_s.sum() - (t.n - 1) * C, rel=1e-9)
    lo, hi = np.array([0, 3]), np.array([3, t.n])  # vectorised over stages, as the stage model calls it
    assert np.allclose(t.optimizer_range_s(lo, hi), [C + V * p[:3].sum(), C + V * p[3:].sum()], rtol=1e-9)


def test_the_fixed_part_stays_within_zero_and_the_smallest_layer():
    p = np.array([10.0, 1e6, 2e6, 4e6])
    assert optimizer_call_s(p, 1e-9 * p + 5e-4) == pytest.approx(5e-4)
    big = np.array([1e5, 1e6, 2e6, 4e6])
    assert optimizer_call_s(big, 1e-9 * big - 1e-5) == 0.0  # a negative intercept (a CPU's): no fixed part
    steep = np.array([1e-4, 1.2e-3, 1.3e-3, 1.5e-3])  # the line meets 0 parameters above the smallest time
    assert optimizer_call_s(p, steep) == pytest.approx(1e-4)
    assert optimizer_call_s(p[:2], 1e-9 * p[:2] + 5e-4) == 0.0  # two layers say nothing about the split
    assert optimizer_call_s(p, np.zeros(4)) == 0.0  # not measured
    assert CostTable(synthetic_profile(num_blocks=2)).optimizer_call_s == 0.0  # optimizer_s not in the profile


def test_frozen_layers_do_not_step_and_a_sharded_layer_divides_only_its_own_part():
    prof = _profile()
    t = CostTable(prof)
    p = np.array([r.params for r in prof.layers], dtype=float)
    frozen = frozen_in_place_table(t, 3)
    assert frozen.optimizer_range_s(0, 3) == 0.0
    assert frozen.optimizer_range_s(0, 5) == pytest.approx(C + V * p[3:5].sum(), rel=1e-9)
    tp = strategy_table(t, Strategy(tp=2), 1, (0.0, 0.0), (0.0, 0.0))
    assert tp.optimizer_call_s == t.optimizer_call_s == pytest.approx(C)
    assert tp.optimizer_range_s(1, 5) == pytest.approx(C + V * p[1:5].sum() / 2, rel=1e-9)
    both = min_table(t, tp)
    assert both.optimizer_range_s(1, 5) == pytest.approx(tp.optimizer_range_s(1, 5), rel=1e-9)


def test_each_stage_is_priced_one_call():
    prof = _profile()
    t = CostTable(prof)
    p = np.array([r.params for r in prof.layers], dtype=float)
    gpu = Cluster.uniform(nodes=1, gpus_per_node=2)
    ranges = [(0, 4), (4, t.n)]
    costs = model_for(prof, gpu, K=2, M=2, b=1, f=0).stage_costs(ranges)
    for (lo, hi), x in zip(ranges, costs):
        assert x.optimizer_s == pytest.approx(C + V * p[lo:hi].sum(), rel=1e-9)
    f = 1  # one frozen block: stage 0 steps only its active layers
    n0 = prof.frozen_boundary(f)
    ranges = [(n0, 5), (5, t.n)]
    costs = model_for(prof, gpu, K=2, M=2, b=1, f=f).stage_costs(ranges)
    assert costs[0].optimizer_s == pytest.approx(C + V * p[n0:5].sum(), rel=1e-9)


def test_a_rank_with_several_chunks_pays_one_call_and_one_all_reduce_latency():
    """Interleaved K = 2, V = 2, D = 2: each rank holds two chunks and steps one optimizer and one flat all-reduce
    over both (``executor/runtime/train_step.py``), so its second chunk pays neither the call's fixed part nor the
    all-reduce's latency again (found by an audit: both were charged per chunk)."""
    from ptplan.planner.candidate import Candidate
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.search import PhaseSearch

    prof = _profile()
    t = CostTable(prof)
    p = np.array([r.params for r in prof.layers], dtype=float)
    search = PhaseSearch(prof, Cluster.uniform(nodes=1, gpus_per_node=4),
                         TrainingConfig(epochs=1, samples_per_epoch=8, batch=8, schedule="interleaved-1f1b"))
    model = search.uniform_model(Candidate(K=2, D=2, M=2, b=2, cache=False, schedule="interleaved-1f1b", V=2), 0)
    ranges = [(0, 2), (2, 4), (4, 6), (6, t.n)]  # chunks 0, 1 on ranks 0, 1; chunks 2, 3 on ranks 0, 1 again
    costs = model.stage_costs(ranges)
    lat = model.links.ar_lat
    for i, (lo, hi) in enumerate(ranges):
        first = i < 2
        assert costs[i].optimizer_s == pytest.approx((C if first else 0.0) + V * p[lo:hi].sum(), rel=1e-9)
        own = float(t.cum_sync[hi] - t.cum_sync[lo]) * model.links.ar_per_byte[i]
        assert costs[i].allreduce_s == pytest.approx((lat[i] if first else 0.0) + own, rel=1e-9)
