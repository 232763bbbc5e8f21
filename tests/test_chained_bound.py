"""The split bound's chain of last backwards (``planner/bounds.py``: ``chain_counts``, ``last_backward``,
``chain_ends``; issue 22 item 4): every stage's all-reduce and optimizer step follow its own last backward (and the
W's its list holds back after it), which follows the later stages' last backwards. The bound must never exceed the
simulated iteration (random stage costs, messages, set-up, prefix; every flushed schedule), and on uniform stages
it is the iteration whichever stage's all-reduce ends it (GPipe, 1F1B, ZB-H1; before the chain only stage 0's
all-reduce was placed after the pipeline, so a middle stage's was bounded from far below, and the search could not
prove splits whose iteration such an all-reduce ends)."""
from __future__ import annotations

import random

import pytest

from ptplan.planner.bounds import split_bound
from ptplan.planner.candidate import Candidate
from ptplan.planner.schedule import ScheduleError, build_schedule
from ptplan.planner.simulate import StageCost, simulate


def _iteration(schedule: str, K: int, M: int, costs: list[StageCost], step: float = 0.0, V: int = 1) -> float:
    return simulate(build_schedule(schedule, K, M, V), costs, step_overhead_s=step).iteration_s


@pytest.mark.parametrize("schedule,V", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2),
                                        ("interleaved-1f1b", 3), ("looped-bfs", 2), ("zb-v", 2)])
def test_the_split_bound_never_exceeds_the_simulated_iteration(schedule, V):
    rng = random.Random(f"{schedule}{V}")
    checked = 0
    while checked < 150:
        K = rng.randint(2, 5)
        M = rng.randint(K, 3 * K) if schedule != "gpipe" else rng.randint(1, 3 * K)
        try:
            sched = build_schedule(schedule, K, M, V)
        except ScheduleError:  # (M against K: interleaved 1F1B wants M a multiple of K)
            continue
        costs = []
        for s in range(sched.K):
            b = rng.uniform(0.1, 3.0)
            costs.append(StageCost(
                forward_s=rng.uniform(0.05, 2.0), backward_s=b, backward_weight_s=rng.uniform(0.0, b),
                prefix_s=rng.uniform(0.0, 1.0) if s == 0 else 0.0, setup_s=rng.uniform(0.0, 3.0) if s == 0 else 0.0,
                send_forward_s=rng.uniform(0.0, 0.5) if s < sched.K - 1 else 0.0,
                send_backward_s=rng.uniform(0.0, 0.5) if s > 0 else 0.0,
                allreduce_s=rng.choice([0.0, rng.uniform(0.0, 5.0), rng.uniform(0.0, 40.0)]),
                optimizer_s=rng.uniform(0.0, 0.5)))
        c = Candidate(K=K, D=2, M=M, b=1, cache=False, schedule=schedule, V=V)
        step = rng.uniform(0.0, 0.2)
        sim = _iteration(schedule, K, M, costs, step, V)
        assert split_bound(c, costs, step) <= sim * (1 + 1e-12), (K, M, costs)
        checked += 1


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("K,M", [(4, 4), (4, 8), (8, 16), (6, 7)])
def test_on_uniform_stages_the_bound_is_the_iteration_whichever_stages_all_reduce_ends_it(schedule, K, M):
    f, b, w, ar = 1.0, 2.0, 1.0, 25.0
    c = Candidate(K=K, D=2, M=M, b=1, cache=False, schedule=schedule)
    for j in range(K):
        costs = [StageCost(forward_s=f, backward_s=b, backward_weight_s=w, allreduce_s=ar if s == j else 0.0)
                 for s in range(K)]
        sim = _iteration(schedule, K, M, costs)
        if schedule != "zb-h1":
            # every stage's last backward: the last stage's after its M forwards and backwards behind the others'
            # first forwards, then one backward a stage towards stage 0 (stage j's all-reduce (K - 1 - j) b later)
            last = (K - 1) * f + M * (f + b) if schedule == "1f1b" else (M + K - 1) * f + M * b
            assert sim == pytest.approx(last + (K - 1 - j) * b + ar, rel=1e-12), j
        assert split_bound(c, costs, 0.0) == pytest.approx(sim, rel=1e-12), j


def test_the_counts_are_read_from_the_action_lists():
    """``chain_counts``: 1F1B's stage s runs M - K + s backwards before its last forward; GPipe none, and every
    backward waits for the path (fill-drain); ZB-H1's stage s holds back s W's, so s + 1 follow its last B; several
    stages a rank (interleaved 1F1B: each stage's own actions in its rank's list) chain too; no flush (2BW) does not."""
    import numpy as np

    from ptplan.planner.bounds import chain_counts

    K, M = 4, 8
    one = chain_counts("1f1b", K, M)
    assert one is not None and one.b_before.tolist() == [M - K + s for s in range(K)] and not one.w_tail.any()
    gp = chain_counts("gpipe", K, M)
    assert gp is not None and not gp.b_before.any() and (gp.b_path == M).all()
    zb = chain_counts("zb-h1", K, M)
    assert zb is not None and zb.w_tail.tolist() == [s + 1 for s in range(K)]
    assert np.array_equal(zb.b_before, one.b_before) and (zb.w_before == M - K).all()
    inter = chain_counts("interleaved-1f1b", K, M, 2)
    assert inter is not None and len(inter.b_before) == 2 * K and chain_counts("2bw", K, M) is None
