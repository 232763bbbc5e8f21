"""The discrete-event simulator: closed forms on uniform stages, literal grids, comm, all-reduce, memory."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import EVENT_KINDS
from ptplan.planner.schedule import Schedule, ScheduleError, build_schedule, gpipe, one_f_one_b, parse_action
from ptplan.planner.simulate import (
    SimResult,
    StageCost,
    gpipe_closed_form,
    one_f_one_b_closed_form,
    simulate,
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


def test_unsupported_actions_raise():
    with pytest.raises(ScheduleError, match="weight-gradient \\(W\\).*zero-bubble"):
        simulate(sched(["0F0 0B0 0W0 0ALLREDUCE"], K=1, M=1), uniform(1, 1, 1))
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


# ---- event consistency -------------------------------------------------------------------
@pytest.mark.parametrize("name, K, M", [("gpipe", 3, 5), ("1f1b", 4, 6), ("1f1b", 5, 5), ("gpipe", 4, 2)])
def test_events_are_consistent(name, K, M):
    rng = random.Random(K * 100 + M)
    costs = [StageCost(forward_s=rng.uniform(0.1, 2), backward_s=rng.uniform(0.1, 3),
                       prefix_s=rng.uniform(0, 1) if s == 0 else 0.0,
                       send_forward_s=rng.uniform(0, 1), send_backward_s=rng.uniform(0, 1),
                       allreduce_s=rng.uniform(0, 2)) for s in range(K)]
    r = simulate(build_schedule(name, K, M), costs, events=True)
    assert all(e.kind in EVENT_KINDS and e.end >= e.start >= 0 for e in r.events)
    compute = {"F", "B", "PREFIX"}
    for rank in range(K):
        iv = sorted((e.start, e.end) for e in r.events if e.rank == rank and e.kind in compute)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(iv, iv[1:])), f"overlapping compute on rank {rank}"
    at = {(e.kind, e.stage, e.mb): e for e in r.events}
    assert sum(e.kind == "F" for e in r.events) == K * M == sum(e.kind == "B" for e in r.events)
    for s in range(K):
        for m in range(M):
            assert at["F", s, m].end <= at["B", s, m].start
            if s + 1 < K:
                assert at["F", s, m].end + costs[s].send_forward_s <= at["F", s + 1, m].start + 1e-12
                assert at["B", s + 1, m].end + costs[s + 1].send_backward_s <= at["B", s, m].start + 1e-12
    busy = sum(e.end - e.start for e in r.events if e.kind in compute)
    assert busy == pytest.approx(sum(r.stage_busy_s))
    assert r.bubble_fraction == pytest.approx(1 - busy / (K * r.makespan_s))
    assert r.makespan_s == pytest.approx(max(e.end for e in r.events if e.kind in compute))
    assert r.iteration_s == pytest.approx(max(e.end for e in r.events))


# ---- speed -------------------------------------------------------------------------------
def test_simulate_is_fast():
    """Loose bounds (the CPU is shared); typical: K=8 M=32 about 0.2 ms per call once compiled."""
    s = build_schedule("1f1b", 8, 32)
    costs = uniform(8, 1e-3, 2e-3, send_forward_s=1e-4, send_backward_s=1e-4, allreduce_s=1e-3)
    simulate(s, costs)
    t = time.perf_counter()
    for _ in range(50):
        simulate(s, costs)
    assert (time.perf_counter() - t) / 50 < 0.01
    big = build_schedule("1f1b", 64, 256)
    costs = uniform(64, 1e-3, 2e-3)
    simulate(big, costs)
    t = time.perf_counter()
    simulate(big, costs)
    assert time.perf_counter() - t < 0.5


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
