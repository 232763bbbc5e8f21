"""The discrete-event simulator: closed forms on uniform stages (GPipe, 1F1B, interleaved 1F1B, looped BFS,
ZB-H1, ZB-V), literal grids, comm, all-reduce, W actions, memory per stage and per rank."""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import EVENT_KINDS
from ptplan.planner.schedule import (
    SCHEDULE_NAMES,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    check_sizes,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    parse_action,
    peak_inflight,
    two_bw,
    zero_bubble_h1,
    zero_bubble_v,
)
from ptplan.planner.simulate import (
    SimResult,
    StageCost,
    StageTimes,
    gpipe_closed_form,
    interleaved_1f1b_closed_form,
    iterations,
    one_f_one_b_closed_form,
    simulate,
    two_bw_closed_form,
    zb_h1_closed_form,
)


def uniform(K: int, f: float, b: float, **kw) -> list[StageCost]:
    return [StageCost(forward_s=f, backward_s=b, **kw) for _ in range(K)]


def spans(r: SimResult, kind: str) -> list[tuple[int, int, float, float]]:
    return [(e.rank, e.mb, e.start, e.end) for e in r.events if e.kind == kind]


def sched(lines: list[str], K: int, M: int, stage_to_rank: tuple[int, ...] | None = None) -> Schedule:
    return Schedule(name="literal", K=K, M=M, stage_to_rank=stage_to_rank or tuple(range(K)),
                    actions=tuple(tuple(parse_action(t) for t in line.split()) for line in lines))


# ---- closed forms -------------------------------------------------------------------------
@pytest.mark.parametrize("K, M", [(1, 1), (1, 5), (2, 2), (2, 7), (3, 3), (4, 4), (4, 9), (8, 8), (8, 32), (5, 16)])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (0.3, 0.3), (2.5, 1.0)])
def test_uniform_equals_closed_form(K, M, f, b):
    want = gpipe_closed_form(K, M, f, b)
    assert want.makespan_s == pytest.approx((M + K - 1) * (f + b))
    assert want.bubble_fraction == pytest.approx((K - 1) / (M + K - 1))
    assert one_f_one_b_closed_form(K, M, f, b) == want
    for s in (gpipe(K, M), gpipe(K, M, reverse_backward=True), one_f_one_b(K, M)):
        r = simulate(s, uniform(K, f, b))
        assert r.makespan_s == pytest.approx(want.makespan_s), s.name
        assert r.iteration_s == pytest.approx(want.makespan_s)
        assert r.allreduce_s == 0
        assert r.bubble_fraction == pytest.approx(want.bubble_fraction), s.name
        assert r.stage_busy_s == pytest.approx([M * (f + b)] * K)


@pytest.mark.parametrize("K, V", [(1, 2), (2, 2), (2, 3), (3, 2), (4, 2), (4, 4), (6, 3), (8, 2)])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (0.3, 0.3), (2.5, 1.0)])
def test_interleaved_and_looped_bfs_equal_the_closed_form(K, V, f, b):
    """Chunks of f/V, b/V: (V·M + K-1)(f+b)/V, bubble (K-1)/(V·M + K-1) (Narayanan et al. 2021);
    e.g. K=4, V=2, M=8: 19/2 (f+b), bubble 3/19 = 15.8 % against 1F1B's 3/11 = 27.3 %."""
    for M in (K, 2 * K, 5 * K):
        want = interleaved_1f1b_closed_form(K, M, V, f, b)
        assert want.makespan_s == pytest.approx((V * M + K - 1) * (f + b) / V)
        assert want.bubble_fraction == pytest.approx((K - 1) / (V * M + K - 1))
        for s in (interleaved_1f1b(K, M, V), looped_bfs(K, M, V)):
            r = simulate(s, uniform(K * V, f / V, b / V))
            assert r.makespan_s == pytest.approx(want.makespan_s), (s.name, M)
            assert r.bubble_fraction == pytest.approx(want.bubble_fraction), (s.name, M)
            assert r.stage_busy_s == pytest.approx([M * (f + b) / V] * (K * V))
    assert interleaved_1f1b_closed_form(4, 8, 2, 1, 2).bubble_fraction == pytest.approx(3 / 19)
    assert one_f_one_b_closed_form(4, 8, 1, 2).bubble_fraction == pytest.approx(3 / 11)
    with pytest.raises(ScheduleError, match="multiple of K"):
        interleaved_1f1b_closed_form(4, 6, 2, 1, 2)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 6, 8])
def test_zb_h1_has_the_published_bubble(K):
    """ZB-H1's bubble (p-1)(T_F + T_B - T_W) (Qi et al. 2024, Section 3.1) with T_B the input gradient
    and T_W the weight gradient: at T_F = T_B = T_W = t a third of 1F1B's (p-1)(T_F + T_B + T_W), at
    the same peak in flight (K on every stage, 1F1B's stage-0 peak)."""
    for M in (K, K + 1, 2 * K, 4 * K):
        t = 0.5
        r = simulate(zero_bubble_h1(K, M), uniform(K, t, 2 * t, backward_weight_s=t))
        assert r.makespan_s == pytest.approx(3 * M * t + (K - 1) * t)
        one = simulate(one_f_one_b(K, M), uniform(K, t, 2 * t))
        assert one.makespan_s == pytest.approx(3 * M * t + (K - 1) * 3 * t)
        assert r.makespan_s - 3 * M * t == pytest.approx((one.makespan_s - 3 * M * t) / 3)
        assert r.bubble_fraction == pytest.approx(zb_h1_closed_form(K, M, t, 2 * t, t).bubble_fraction)
        assert r.bubble_fraction == pytest.approx((K - 1) / (3 * M + K - 1))
        # the paper's bubble rate (idle / work): (p-1)/3m against 1F1B's (p-1)/m
        assert (r.makespan_s - 3 * M * t) / (3 * M * t) == pytest.approx((K - 1) / (3 * M))
        assert (one.makespan_s - 3 * M * t) / (3 * M * t) == pytest.approx((K - 1) / M)
        assert max(r.peak_inflight) == max(one.peak_inflight) == K
        # T_W <= min(T_F, T_B): the paper's formula holds for unequal times too
        for f, bi, w in ((1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.5, 1.0, 0.25)):
            r = simulate(zero_bubble_h1(K, M), uniform(K, f, bi + w, backward_weight_s=w))
            assert r.makespan_s == pytest.approx(M * (f + bi + w) + (K - 1) * (f + bi - w)), (f, bi, w)


def test_zb_h1_closed_form_beyond_the_papers_regime():
    """Where W is longer than F or B the warm-up's wait, (K-1)·max(T_F, T_B), is what remains."""
    rng = random.Random(7)
    for _ in range(300):
        K = rng.randint(1, 7)
        M = rng.randint(K, 3 * K)
        f, bi, w = (rng.choice([0.25, 0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(3))
        r = simulate(zero_bubble_h1(K, M), uniform(K, f, bi + w, backward_weight_s=w))
        want = zb_h1_closed_form(K, M, f, bi + w, w)
        assert r.makespan_s == pytest.approx(want.makespan_s), (K, M, f, bi, w)
        assert r.bubble_fraction == pytest.approx(want.bubble_fraction)
    with pytest.raises(ScheduleError, match="M >= K"):
        zb_h1_closed_form(4, 3, 1, 2, 1)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
def test_zb_v_uniform(K):
    """ZB-V, chunks with f = b = w = t, M >= 2K-1: each rank works 6·M·t and the makespan adds (K-1)·t,
    the forward's first trip down the V (the paper's "zero" bubble counts each rank from its own first
    action); every rank holds at most 2K chunk-sized micro-batches, i.e. K whole ones: 1F1B's peak."""
    t = 0.5
    for M in (2 * K - 1, 2 * K, 4 * K):
        r = simulate(zero_bubble_v(K, M), uniform(2 * K, t, 2 * t, backward_weight_s=t, activation_bytes_per_mb=10))
        assert r.makespan_s == pytest.approx(6 * M * t + (K - 1) * t)
        assert r.rank_peak_memory_bytes == (2 * K * 10,) * K


def test_gpipe_with_fewer_microbatches_than_stages():
    r = simulate(gpipe(6, 2), uniform(6, 1.0, 2.0))
    assert r.makespan_s == pytest.approx(gpipe_closed_form(6, 2, 1.0, 2.0).makespan_s)
    with pytest.raises(ScheduleError, match="M >= K"):
        one_f_one_b_closed_form(6, 2, 1.0, 2.0)


# ---- non-uniform literal grids ------------------------------------------------------------
NONUNIFORM = [StageCost(forward_s=1, backward_s=2), StageCost(forward_s=3, backward_s=4)]


def test_gpipe_nonuniform_k2_m2():
    # stage 0: F0 [0,1] F1 [1,2]; stage 1: F0 [1,4] F1 [4,7] B0 [7,11] B1 [11,15];
    # stage 0: B0 [11,13] B1 [15,17]
    r = simulate(gpipe(2, 2), NONUNIFORM, events=True)
    assert r.makespan_s == 17 and r.iteration_s == 17
    assert spans(r, "F") == [(0, 0, 0, 1), (0, 1, 1, 2), (1, 0, 1, 4), (1, 1, 4, 7)]
    assert spans(r, "B") == [(1, 0, 7, 11), (0, 0, 11, 13), (1, 1, 11, 15), (0, 1, 15, 17)]
    assert r.stage_busy_s == (6, 14)
    assert r.bubble_fraction == pytest.approx(1 - 20 / 34)


def test_one_f_one_b_nonuniform_k2_m2():
    # stage 0: F0 [0,1] F1 [1,2]; stage 1: F0 [1,4] B0 [4,8] F1 [8,11] B1 [11,15]; stage 0: B0 [8,10] B1 [15,17]
    r = simulate(one_f_one_b(2, 2), NONUNIFORM, events=True)
    assert r.makespan_s == 17
    assert spans(r, "F") == [(0, 0, 0, 1), (0, 1, 1, 2), (1, 0, 1, 4), (1, 1, 8, 11)]
    assert spans(r, "B") == [(1, 0, 4, 8), (0, 0, 8, 10), (1, 1, 11, 15), (0, 1, 15, 17)]


def test_one_f_one_b_nonuniform_k3_m3():
    # f = (1, 2, 1), b = (1, 1, 3); lists: s0 F0 F1 F2 B0 B1 B2, s1 F0 F1 B0 F2 B1 B2, s2 F0 B0 F1 B1 F2 B2
    # s0: F0 [0,1] F1 [1,2] F2 [2,3]          s1: F0 [1,3] F1 [3,5]         s2: F0 [3,4] B0 [4,7] F1 [7,8] B1 [8,11]
    # s1: B0 [7,8] F2 [8,10] B1 [11,12]       s2: F2 [11,12] B2 [12,15]     s1: B2 [15,16]
    # s0: B0 [8,9] B1 [12,13] B2 [16,17]
    costs = [StageCost(forward_s=1, backward_s=1), StageCost(forward_s=2, backward_s=1),
             StageCost(forward_s=1, backward_s=3)]
    r = simulate(one_f_one_b(3, 3), costs, events=True)
    assert r.makespan_s == 17
    assert [x for x in spans(r, "B") if x[0] == 0] == [(0, 0, 8, 9), (0, 1, 12, 13), (0, 2, 16, 17)]
    assert [x for x in spans(r, "F") if x[0] == 2] == [(2, 0, 3, 4), (2, 1, 7, 8), (2, 2, 11, 12)]


# ---- communication -----------------------------------------------------------------------
def test_comm_delays_add_on_tiny_case():
    # F0 [0,1], send [1,1.5], F0' [1.5,2.5], B0' [2.5,3.5], send back [3.5,3.75], B0 [3.75,4.75]
    costs = [StageCost(forward_s=1, backward_s=1, send_forward_s=0.5),
             StageCost(forward_s=1, backward_s=1, send_backward_s=0.25)]
    r = simulate(gpipe(2, 1), costs, events=True)
    assert r.makespan_s == pytest.approx(4.75)
    assert spans(r, "SEND_F") == [(0, 0, 1, 1.5)] and spans(r, "RECV_F") == [(1, 0, 1, 1.5)]
    assert spans(r, "SEND_B") == [(1, 0, 3.5, 3.75)] and spans(r, "RECV_B") == [(0, 0, 3.5, 3.75)]
    assert r.bubble_fraction == pytest.approx(1 - 4 / (2 * 4.75))
    # 1F1B, M=2: s0 F0 [0,1] F1 [1,2], sends [1,1.5] [2,2.5]; s1 F0 [1.5,2.5] B0 [2.5,3.5] F1 [3.5,4.5]
    # B1 [4.5,5.5], sends back [3.5,3.75] [5.5,5.75]; s0 B0 [3.75,4.75] B1 [5.75,6.75]
    r = simulate(one_f_one_b(2, 2), costs, events=True)
    assert r.makespan_s == pytest.approx(6.75)
    assert spans(r, "B") == [(1, 0, 2.5, 3.5), (0, 0, 3.75, 4.75), (1, 1, 4.5, 5.5), (0, 1, 5.75, 6.75)]


def test_sends_share_a_link_but_not_the_senders_compute():
    # sends take 2 s, forwards 1 s: stage 0 keeps computing while its link carries one message at a time
    costs = [StageCost(forward_s=1, backward_s=1, send_forward_s=2), StageCost(forward_s=1, backward_s=1)]
    r = simulate(gpipe(2, 2), costs, events=True)
    assert spans(r, "F") == [(0, 0, 0, 1), (0, 1, 1, 2), (1, 0, 3, 4), (1, 1, 5, 6)]
    assert spans(r, "SEND_F") == [(0, 0, 1, 3), (0, 1, 3, 5)]
    assert r.makespan_s == 9  # stage 1: B0 [6,7] B1 [7,8]; stage 0: B0 [7,8] B1 [8,9]


@pytest.mark.parametrize("K, M", [(2, 3), (4, 4), (4, 10)])
def test_gpipe_uniform_with_comm(K, M):
    # comm shorter than compute never queues: each hop adds its latency once per direction
    f, b, cf, cb = 1.0, 2.0, 0.25, 0.5
    r = simulate(gpipe(K, M), uniform(K, f, b, send_forward_s=cf, send_backward_s=cb))
    assert r.makespan_s == pytest.approx((M + K - 1) * (f + b) + (K - 1) * (cf + cb))


# ---- all-reduce --------------------------------------------------------------------------
def test_allreduce_overlaps_other_stages_backwards():
    # GPipe K=2 M=2, f=b=1: stage 1's last B ends at 5, stage 0's at 6 (makespan 6).
    costs = [StageCost(forward_s=1, backward_s=1, allreduce_s=0.5), StageCost(forward_s=1, backward_s=1, allreduce_s=1)]
    r = simulate(gpipe(2, 2), costs, events=True)
    assert r.makespan_s == 6
    assert spans(r, "ALLREDUCE") == [(1, -1, 5, 6), (0, -1, 6, 6.5)]  # stage 1's hides under stage 0's B1
    assert r.iteration_s == 6.5 and r.allreduce_s == pytest.approx(0.5)
    # a long all-reduce on the last stage sticks out past stage 0's: 5 + 3 = 8
    costs[1] = dataclasses.replace(costs[1], allreduce_s=3)
    r = simulate(gpipe(2, 2), costs)
    assert r.iteration_s == 8 and r.allreduce_s == 2 and r.makespan_s == 6


def test_bubble_excludes_allreduce_tail():
    base = simulate(one_f_one_b(4, 8), uniform(4, 1, 2))
    with_ar = simulate(one_f_one_b(4, 8), uniform(4, 1, 2, allreduce_s=5))
    assert with_ar.bubble_fraction == pytest.approx(base.bubble_fraction)
    assert with_ar.iteration_s == pytest.approx(base.makespan_s + 5)


# ---- memory ------------------------------------------------------------------------------
@pytest.mark.parametrize("K, M", [(1, 3), (2, 2), (3, 7), (4, 4), (6, 13)])
def test_peak_inflight_and_memory(K, M):
    costs = uniform(K, 1, 1, fixed_bytes=1000, activation_bytes_per_mb=11)
    r1 = simulate(one_f_one_b(K, M), costs)
    assert r1.peak_inflight == tuple(min(K - s, M) for s in range(K))
    assert r1.stage_peak_memory_bytes == tuple(1000 + 11 * min(K - s, M) for s in range(K))
    rg = simulate(gpipe(K, M), costs)
    assert rg.peak_inflight == (M,) * K
    assert rg.stage_peak_memory_bytes == (1000 + 11 * M,) * K
    # the after-pipeline transient (all-reduce buffer) counts only where it beats the activations
    big = simulate(gpipe(K, M), uniform(K, 1, 1, fixed_bytes=1000, activation_bytes_per_mb=11, after_bytes=11 * M + 5))
    assert big.stage_peak_memory_bytes == (1000 + 11 * M + 5,) * K


def test_setup_delays_stage0_and_shows_as_a_cache_event():
    costs = [StageCost(forward_s=1, backward_s=2, setup_s=0.5), StageCost(forward_s=1, backward_s=2)]
    base = simulate(gpipe(2, 2), [StageCost(forward_s=1, backward_s=2)] * 2)
    r = simulate(gpipe(2, 2), costs, events=True)
    assert r.makespan_s == pytest.approx(base.makespan_s + 0.5)
    assert [(e.rank, e.start, e.end) for e in r.events if e.kind == "CACHE"] == [(0, 0.0, 0.5)]
    with pytest.raises(PtplanError, match="setup_s=0.5.*only stage 0"):
        simulate(gpipe(2, 2), list(reversed(costs)))


# ---- prefix, inputs ----------------------------------------------------------------------
def test_prefix_runs_before_each_stage0_forward():
    costs = [StageCost(forward_s=1, backward_s=2, prefix_s=0.5)]
    r = simulate(gpipe(1, 2), costs, events=True)
    assert r.makespan_s == pytest.approx(2 * (0.5 + 1 + 2))
    assert spans(r, "PREFIX") == [(0, 0, 0, 0.5), (0, 1, 1.5, 2.0)]
    assert spans(r, "F") == [(0, 0, 0.5, 1.5), (0, 1, 2.0, 3.0)]
    assert r.stage_busy_s == (7.0,) and r.bubble_fraction == pytest.approx(0)
    with pytest.raises(PtplanError, match="stage 1 has prefix_s=0.5.*only stage 0"):
        simulate(gpipe(2, 2), [StageCost(forward_s=1, backward_s=1)] + costs)


def test_input_errors():
    with pytest.raises(PtplanError, match="3 stage costs for a schedule with K=2"):
        simulate(gpipe(2, 2), uniform(3, 1, 1))
    with pytest.raises(PtplanError, match="forward_s must be a finite number of seconds >= 0"):
        StageCost(forward_s=-1, backward_s=1)
    with pytest.raises(PtplanError, match="backward_s"):
        StageCost(forward_s=1, backward_s=float("nan"))
    with pytest.raises(PtplanError, match="fixed_bytes must be an integer"):
        StageCost(forward_s=1, backward_s=1, fixed_bytes=1.5)
    # plain floats and ints take a fast path: the same rules, the same messages
    for bad in (-1.0, float("nan"), float("inf"), -1e-300):
        with pytest.raises(PtplanError, match="send_forward_s must be a finite number of seconds >= 0"):
            StageCost(forward_s=1.0, backward_s=1.0, send_forward_s=bad)
    with pytest.raises(PtplanError, match="after_bytes must be an integer number of bytes >= 0"):
        StageCost(forward_s=1.0, backward_s=1.0, after_bytes=-1)
    for bad in (True, "1", None):
        with pytest.raises(PtplanError, match="allreduce_s must be a finite"):
            StageCost(forward_s=1.0, backward_s=1.0, allreduce_s=bad)
        with pytest.raises(PtplanError, match="fixed_bytes must be an integer"):
            StageCost(forward_s=1.0, backward_s=1.0, fixed_bytes=bad)
    import numpy as np

    c = StageCost(forward_s=np.float64(2.0), backward_s=-0.0, fixed_bytes=np.int64(3), after_bytes=4)
    assert (type(c.forward_s), type(c.backward_s), type(c.fixed_bytes), c.fixed_bytes) == (float, float, int, 3)


def test_unsupported_actions_raise():
    sliced = Schedule(name="s", K=1, M=1, stage_to_rank=(0,), slices=2, actions=((
        parse_action("0F0"), parse_action("0F0.1"), parse_action("0B0.1"), parse_action("0B0"),
        parse_action("0ALLREDUCE")),))
    with pytest.raises(ScheduleError, match="token slices"):
        simulate(sliced, uniform(1, 1, 1))


def test_hand_built_schedules_are_checked_and_simulated():
    dead = sched(["0F0 0RECV_B0 0SEND_F0 0B0 0ALLREDUCE", "1RECV_F0 1F0 1B0 1SEND_B0 1ALLREDUCE"], K=2, M=1)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(dead, uniform(2, 1, 1))
    # a "V" placement: 4 stages on 2 ranks (rank 0: stages 0, 3; rank 1: stages 1, 2); f = b = 1
    v = sched(["0F0 0SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 0RECV_B0 0B0 0ALLREDUCE 3ALLREDUCE",
               "1RECV_F0 1F0 2F0 2SEND_F0 2RECV_B0 2B0 1B0 1SEND_B0 1ALLREDUCE 2ALLREDUCE"],
              K=4, M=1, stage_to_rank=(0, 1, 1, 0))
    r = simulate(v, uniform(4, 1, 1), events=True)
    assert r.makespan_s == 8 and r.bubble_fraction == pytest.approx(0.5)
    assert [(e.rank, e.stage, e.kind) for e in r.events] == [
        (0, 0, "F"), (1, 1, "F"), (1, 2, "F"), (0, 3, "F"), (0, 3, "B"), (1, 2, "B"), (1, 1, "B"), (0, 0, "B")]
    # a copy of a generated schedule is not marked as generated, so it is checked, and simulates the same
    g = one_f_one_b(3, 5)
    assert simulate(dataclasses.replace(g), uniform(3, 1, 2)) == simulate(g, uniform(3, 1, 2))


# ---- weight-gradient (W) actions --------------------------------------------------------
def test_w_splits_the_backward():
    # one stage, M=2, f=1, b=3 of which w=1: F0 [0,1] B0 [1,3] W0 [3,4] F1 [4,5] B1 [5,7] W1 [7,8]
    s = sched(["0F0 0B0 0W0 0F1 0B1 0W1 0ALLREDUCE"], K=1, M=2)
    r = simulate(s, [StageCost(forward_s=1, backward_s=3, backward_weight_s=1)], events=True)
    assert spans(r, "B") == [(0, 0, 1, 3), (0, 1, 5, 7)]
    assert spans(r, "W") == [(0, 0, 3, 4), (0, 1, 7, 8)]
    assert r.makespan_s == 8 and r.stage_busy_s == (8,) and r.bubble_fraction == 0
    # a micro-batch holds its activations until its W: deferring both W's keeps two in flight
    late = sched(["0F0 0B0 0F1 0B1 0W0 0W1 0ALLREDUCE"], K=1, M=2)
    assert simulate(late, [StageCost(forward_s=1, backward_s=3, backward_weight_s=1)]).peak_inflight == (2,)
    assert simulate(s, [StageCost(forward_s=1, backward_s=3, backward_weight_s=1)]).peak_inflight == (1,)


def test_w_only_where_the_schedule_has_one():
    # without W actions the whole backward runs as B, backward_weight_s or not
    costs = uniform(3, 1, 2, backward_weight_s=0.5)
    assert simulate(one_f_one_b(3, 5), costs) == simulate(one_f_one_b(3, 5), uniform(3, 1, 2))
    # a B with a W for its own (stage, micro-batch) is the input gradient only; the others stay full
    mixed = sched(["0F0 0B0 0F1 0B1 0W1 0ALLREDUCE"], K=1, M=2)
    r = simulate(mixed, [StageCost(forward_s=1, backward_s=3, backward_weight_s=1)], events=True)
    assert spans(r, "B") == [(0, 0, 1, 4), (0, 1, 5, 7)] and spans(r, "W") == [(0, 1, 7, 8)]
    with pytest.raises(PtplanError, match="backward_weight_s=2.5 exceeds backward_s=2"):
        StageCost(forward_s=1, backward_s=2, backward_weight_s=2.5)
    with pytest.raises(PtplanError, match="backward_weight_s must be a finite number"):
        StageCost(forward_s=1, backward_s=2, backward_weight_s=-1)


def test_zb_h1_nonuniform_k2_m2():
    # f = (1, 2), b = (3, 3), w = (1, 2); lists: s0 F0 F1 B0 W0 B1 W1, s1 F0 B0 F1 B1 W0 W1
    # s0: F0 [0,1] F1 [1,2]            s1: F0 [1,3] B0 [3,4] F1 [4,6] B1 [6,7] W0 [7,9] W1 [9,11]
    # s0: B0 [4,6] W0 [6,7] B1 [7,9] W1 [9,10]
    costs = [StageCost(forward_s=1, backward_s=3, backward_weight_s=1),
             StageCost(forward_s=2, backward_s=3, backward_weight_s=2)]
    r = simulate(zero_bubble_h1(2, 2), costs, events=True)
    assert spans(r, "B") == [(1, 0, 3, 4), (0, 0, 4, 6), (1, 1, 6, 7), (0, 1, 7, 9)]
    assert spans(r, "W") == [(0, 0, 6, 7), (1, 0, 7, 9), (0, 1, 9, 10), (1, 1, 9, 11)]
    assert r.makespan_s == 11 and r.stage_busy_s == (8, 10)


# ---- peak in flight and memory per rank ------------------------------------------------------
def test_peak_inflight_closed_form_is_what_the_simulator_counts():
    """For every schedule on a grid of K, M, V: ``peak_inflight`` (used before any schedule exists) equals
    the simulator's count from the lists, W's included."""
    n = 0
    for name, K, M, V in itertools.product(SCHEDULE_NAMES, range(1, 6), range(1, 13), range(1, 4)):
        try:
            check_sizes(name, K, M, V)
        except ScheduleError:
            continue
        r = simulate(build_schedule(name, K, M, V), uniform(K * V, 1.0, 2.0, backward_weight_s=0.5))
        assert r.peak_inflight == peak_inflight(name, K, M, V), (name, K, M, V)
        n += 1
    assert n > 300


def rank_peak_by_hand(s: Schedule, costs: list[StageCost]) -> list[int]:
    """The rank rule written out: walk each rank's list, Σ live × per-micro-batch bytes at every point."""
    split = {(a.stage, a.mb) for acts in s.actions for a in acts if a.kind is ActionKind.W}
    out = []
    for r, acts in enumerate(s.actions):
        mine = [c for c in range(s.K) if s.stage_to_rank[c] == r]
        live = dict.fromkeys(mine, 0)
        held = 0
        for a in acts:
            if a.kind is ActionKind.F:
                live[a.stage] += 1
            elif a.kind is ActionKind.W or (a.kind is ActionKind.B and (a.stage, a.mb) not in split):
                live[a.stage] -= 1
            held = max(held, sum(live[c] * costs[c].activation_bytes_per_mb for c in mine))
        out.append(sum(costs[c].fixed_bytes for c in mine) + max(held, sum(costs[c].after_bytes for c in mine)))
    return out


@pytest.mark.parametrize("name, K, M, V", [
    ("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("zb-h1", 4, 6, 1), ("1f1b", 1, 3, 1),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 3, 6, 3),
    ("looped-bfs", 3, 4, 2), ("zb-v", 3, 7, 2), ("zb-v", 2, 2, 2),
])
def test_rank_peak_memory(name, K, M, V):
    rng = random.Random(K * 1000 + M * 10 + V)
    S = K * V
    for after in (0, 1):
        costs = [StageCost(forward_s=1, backward_s=2, backward_weight_s=0.5, fixed_bytes=rng.randint(100, 999),
                           activation_bytes_per_mb=rng.randint(1, 50),
                           after_bytes=rng.randint(0, 400) * after) for _ in range(S)]
        sc = build_schedule(name, K, M, V)
        r = simulate(sc, costs)
        assert list(r.rank_peak_memory_bytes) == rank_peak_by_hand(sc, costs)
        if V == 1:  # one stage per rank: the rank's number is the stage's
            assert r.rank_peak_memory_bytes == r.stage_peak_memory_bytes
        else:  # several chunks peak at different times: never more than the sum of their own peaks
            for rank in range(K):
                mine = [c for c in range(S) if sc.stage_to_rank[c] == rank]
                assert r.rank_peak_memory_bytes[rank] <= sum(r.stage_peak_memory_bytes[c] for c in mine)


def test_interleaved_rank_memory_is_below_the_sum_of_its_chunks():
    # K=4, V=2, M=8, every chunk 10 bytes per micro-batch: chunk peaks 8 8 7 5 | 4 4 3 1, yet rank 0 never
    # holds 12 at once: its warm-up is (V-1)K + 2(K-1) = 10 forwards, then one more before the first backward
    r = simulate(interleaved_1f1b(4, 8, 2), uniform(8, 1, 2, activation_bytes_per_mb=10))
    assert r.peak_inflight == (8, 8, 7, 5, 4, 4, 3, 1)
    assert r.rank_peak_memory_bytes == (110, 90, 70, 50)
    # 1F1B on the same 4 ranks with whole-rank stages (20 bytes per micro-batch): 4·20 = 80 on rank 0
    assert simulate(one_f_one_b(4, 8), uniform(4, 1, 2, activation_bytes_per_mb=20)).rank_peak_memory_bytes[0] == 80


# ---- event consistency -------------------------------------------------------------------
@pytest.mark.parametrize("name, K, M, V", [
    ("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("1f1b", 5, 5, 1), ("gpipe", 4, 2, 1), ("zb-h1", 4, 6, 1),
    ("interleaved-1f1b", 3, 6, 2), ("interleaved-1f1b", 1, 3, 3), ("looped-bfs", 3, 4, 2), ("zb-v", 3, 7, 2),
])
def test_events_are_consistent(name, K, M, V):
    rng = random.Random(K * 100 + M)
    S = K * V
    costs = []
    for s in range(S):
        b = rng.uniform(0.1, 3)
        costs.append(StageCost(forward_s=rng.uniform(0.1, 2), backward_s=b, backward_weight_s=rng.uniform(0, b),
                               prefix_s=rng.uniform(0, 1) if s == 0 else 0.0,
                               send_forward_s=rng.uniform(0, 1), send_backward_s=rng.uniform(0, 1),
                               allreduce_s=rng.uniform(0, 2)))
    sc = build_schedule(name, K, M, V)
    s2r = sc.stage_to_rank
    r = simulate(sc, costs, events=True)
    assert all(e.kind in EVENT_KINDS and e.end >= e.start >= 0 for e in r.events)
    assert all(e.rank == s2r[e.stage] for e in r.events if e.kind != "RECV_F" and e.kind != "RECV_B")
    compute = {"F", "B", "W", "PREFIX"}
    for rank in range(K):
        iv = sorted((e.start, e.end) for e in r.events if e.rank == rank and e.kind in compute)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(iv, iv[1:])), f"overlapping compute on rank {rank}"
    at = {(e.kind, e.stage, e.mb): e for e in r.events}
    n_w = sum(e.kind == "W" for e in r.events)
    assert sum(e.kind == "F" for e in r.events) == S * M == sum(e.kind == "B" for e in r.events)
    assert n_w == (S * M if name.startswith("zb") else 0)
    for s in range(S):
        for m in range(M):
            assert at["F", s, m].end <= at["B", s, m].start
            if n_w:
                assert at["B", s, m].end <= at["W", s, m].start + 1e-12
                assert at["W", s, m].end - at["W", s, m].start == pytest.approx(costs[s].backward_weight_s)
                assert at["B", s, m].end - at["B", s, m].start == pytest.approx(
                    costs[s].backward_s - costs[s].backward_weight_s)
            if s + 1 < S:
                hop_f = costs[s].send_forward_s if s2r[s] != s2r[s + 1] else 0.0
                hop_b = costs[s + 1].send_backward_s if s2r[s] != s2r[s + 1] else 0.0
                assert at["F", s, m].end + hop_f <= at["F", s + 1, m].start + 1e-12
                assert at["B", s + 1, m].end + hop_b <= at["B", s, m].start + 1e-12
    busy = sum(e.end - e.start for e in r.events if e.kind in compute)
    assert busy == pytest.approx(sum(r.stage_busy_s))
    assert r.bubble_fraction == pytest.approx(1 - busy / (K * r.makespan_s))
    assert r.makespan_s == pytest.approx(max(e.end for e in r.events if e.kind in compute))
    assert r.iteration_s == pytest.approx(max(e.end for e in r.events))


# ---- speed -------------------------------------------------------------------------------
# ---- the update after the pipeline: optimizer step and per-step overhead ------------------------
@pytest.mark.parametrize("K, M", [(1, 3), (2, 4), (4, 8)])
def test_optimizer_step_and_step_overhead_end_the_iteration(K, M):
    base = simulate(one_f_one_b(K, M), uniform(K, 1, 2), events=True)
    opt = [StageCost(forward_s=1, backward_s=2, optimizer_s=0.1 + 2.5 * s) for s in range(K)]
    r = simulate(one_f_one_b(K, M), opt, step_overhead_s=0.05)
    # every rank steps after its own last backward (stage s ends s backwards before stage 0)
    ends = [max(e.end for e in base.events if e.rank == s and e.kind == "B") for s in range(K)]
    assert ends == [base.makespan_s - 2 * s for s in range(K)]
    assert r.makespan_s == pytest.approx(base.makespan_s)
    assert r.iteration_s == pytest.approx(max(e + 0.1 + 2.5 * s for s, e in enumerate(ends)) + 0.05)
    assert r.update_s == pytest.approx(r.iteration_s - r.makespan_s - r.allreduce_s)
    assert r.bubble_fraction == pytest.approx(base.bubble_fraction)  # the update is not a bubble


def test_optimizer_step_waits_for_the_stage_allreduce():
    costs = [StageCost(forward_s=1, backward_s=1, allreduce_s=3, optimizer_s=0.5),
             StageCost(forward_s=1, backward_s=1, allreduce_s=0, optimizer_s=2)]
    r = simulate(gpipe(2, 1), costs)
    # stage 0's last backward ends at 4, its all-reduce at 7, its step at 7.5; stage 1 ends at 3 + 2 = 5
    assert r.makespan_s == 4 and r.allreduce_s == 3 and r.iteration_s == 7.5 and r.update_s == 0.5
    with pytest.raises(PtplanError, match="optimizer_s"):
        StageCost(forward_s=1, backward_s=1, optimizer_s=-1)
    with pytest.raises(PtplanError, match="step_overhead_s"):
        simulate(gpipe(2, 1), costs, step_overhead_s=float("nan"))


# ---- PipeDream-2BW: the flush-free steady state ---------------------------------------------------
@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
def test_two_bw_steady_state_is_the_closed_form(K):
    """Uniform stages, zero communication: one mini-batch every M·(f+b) + optimizer seconds, no bubble;
    1F1B pays its (K-1)·(f+b) fill and drain on top in every iteration."""
    f, b, opt = 1.0, 2.0, 0.5
    for M in range(K, 2 * K + 3):
        r = simulate(build_schedule("2bw", K, M), uniform(K, f, b, optimizer_s=opt), step_overhead_s=0.25)
        cf = two_bw_closed_form(K, M, f, b, opt)
        assert r.iteration_s == pytest.approx(cf.makespan_s + 0.25), (K, M)
        assert r.makespan_s == pytest.approx(cf.makespan_s) and r.allreduce_s == 0 and r.update_s == 0.25
        assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12)
        assert r.stage_busy_s == pytest.approx((M * (f + b),) * K)  # per mini-batch of the window
        flushed = simulate(build_schedule("1f1b", K, M), uniform(K, f, b, optimizer_s=opt), step_overhead_s=0.25)
        assert flushed.iteration_s - r.iteration_s == pytest.approx((K - 1) * (f + b))
        assert r.stage_peak_memory_bytes == flushed.stage_peak_memory_bytes  # K-s in flight, as 1F1B
    with pytest.raises(ScheduleError, match="2BW needs M >= K"):
        two_bw_closed_form(4, 3, f, b)


def test_two_bw_hides_the_all_reduce_until_it_is_the_bottleneck():
    """The gradient all-reduce of mini-batch t runs while t+1 computes; only the update making version
    t+2 waits for it. Short all-reduces cost nothing; one longer than the whole mini-batch sets the period."""
    K, M, f, b = 4, 8, 1.0, 2.0
    base = simulate(build_schedule("2bw", K, M), uniform(K, f, b)).iteration_s
    assert base == pytest.approx(M * (f + b))
    # stage 0 has the least room: M-K+1 forward-backward pairs between mini-batch t's last backward
    # and mini-batch t+2's first forward
    room = (M - K + 1) * (f + b)
    hidden = simulate(build_schedule("2bw", K, M), uniform(K, f, b, allreduce_s=room))
    assert hidden.iteration_s == pytest.approx(base)
    assert simulate(build_schedule("2bw", K, M), uniform(K, f, b, allreduce_s=room + 1)).iteration_s > base + 0.5
    slow = simulate(build_schedule("2bw", K, M), uniform(K, f, b, allreduce_s=3 * M * (f + b)))
    assert slow.iteration_s >= 3 * M * (f + b) - 1e-9


def test_two_bw_window_reaches_the_steady_state():
    """The period read from the last three mini-batches of the N = 8 window is within 1 % of a 30-mini-batch run's,
    on random non-uniform stages with sends, optimizer steps and all-reduces."""
    rng = random.Random(3)
    for _ in range(40):
        K = rng.choice([2, 3, 4, 6])
        M = rng.choice([m for m in (2, 4, 6, 8, 12) if m >= K])
        costs = [StageCost(forward_s=rng.uniform(0.5, 2), backward_s=rng.uniform(1, 4), optimizer_s=rng.uniform(0, 1),
                           send_forward_s=rng.uniform(0, 1) if s < K - 1 else 0.0,
                           send_backward_s=rng.uniform(0, 1) if s > 0 else 0.0,
                           allreduce_s=rng.uniform(0, rng.choice([0, 1, 10, 40]))) for s in range(K)]
        short = simulate(build_schedule("2bw", K, M), costs)
        long = simulate(two_bw(K, M, 30), costs)
        assert short.iteration_s == pytest.approx(long.iteration_s, rel=1e-2), (K, M)  # measured: <= 0.6 %
        work = max(M * (c.forward_s + c.backward_s) + c.optimizer_s for c in costs)
        assert short.iteration_s >= work - 1e-9


def test_two_bw_timeline_shows_the_updates_between_mini_batches():
    K, M = 3, 3
    r = simulate(build_schedule("2bw", K, M), uniform(K, 1.0, 2.0, optimizer_s=0.5), events=True)
    ups = [e for e in r.events if e.kind == "UPDATE" and e.rank == 0]
    # the updates making versions 2..N-1 sit between mini-batches, and one after the lists (the drain's)
    N = build_schedule("2bw", K, M).minibatches
    assert len(ups) == N - 1 and all(e.end - e.start == pytest.approx(0.5) for e in ups)
    first_f = {e.mb: e.start for e in r.events if e.kind == "F" and e.rank == 0}
    assert ups[0].end <= first_f[2 * M] + 1e-12 and ups[0].start >= first_f[2 * M - 1]


@pytest.mark.parametrize("name,K,M,V", [
    ("gpipe", 3, 5, 1), ("gpipe", 4, 2, 1), ("1f1b", 4, 6, 1), ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 3, 6, 3), ("zb-h1", 4, 8, 1), ("looped-bfs", 3, 4, 2), ("zb-v", 3, 7, 2),
    ("2bw", 3, 5, 1), ("2bw", 4, 4, 1), ("2bw", 2, 8, 1),
])
def test_iterations_of_many_splits_equal_the_simulation_of_each(name, K, M, V):
    """``iterations`` (every split of a candidate at once, as the search scores them) gives each row's
    ``simulate(...).iteration_s`` to the last bit: random seconds in every field the event loop reads (the cache's
    set-up and the prefix on stage 0, sends, all-reduces, optimizer steps, a W part), on every schedule (PipeDream-2BW's
    period among them); costs of another number of stages are refused."""
    import numpy as np

    rng = random.Random(K * 100 + M * 10 + V)
    S, N = K * V, 40
    rows = []
    for _ in range(N):
        rows.append([StageCost(forward_s=rng.uniform(0.1, 2), backward_s=(b := rng.uniform(0.1, 4)),
                               backward_weight_s=rng.uniform(0, b), prefix_s=rng.uniform(0, 1) * (s == 0),
                               setup_s=rng.uniform(0, 3) * (s == 0), send_forward_s=rng.uniform(0, 0.5) * (s < S - 1),
                               send_backward_s=rng.uniform(0, 0.5) * (s > 0), allreduce_s=rng.uniform(0, 2),
                               optimizer_s=rng.uniform(0, 0.3)) for s in range(S)])
    x = StageTimes(**{f: np.array([[getattr(c, f) for c in row] for row in rows]) for f in StageTimes._fields})
    sc = build_schedule(name, K, M, V)
    got = iterations(sc, x, step_overhead_s=0.25)
    want = [simulate(sc, row, step_overhead_s=0.25).iteration_s for row in rows]
    assert got.tolist() == want
    with pytest.raises(PtplanError, match="stages"):
        iterations(build_schedule("gpipe", S + 1, 2), x)
