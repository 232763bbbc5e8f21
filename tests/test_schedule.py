"""Schedules as data: action text round-trips, the generators (GPipe, 1F1B, interleaved 1F1B, looped BFS,
ZB-H1, ZB-V), their orders against torch.distributed.pipelining's, and check_schedule's rejections."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import SCHEDULES
from ptplan.planner.schedule import (
    LOOP_SCHEDULES,
    SCHEDULE_NAMES,
    TWOBW_WINDOW,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    check_schedule,
    check_sizes,
    compute_order as compute_actions,
    execution_order,
    gpipe,
    interleaved_1f1b,
    is_generated,
    looped_bfs,
    one_f_one_b,
    parse_action,
    two_bw,
    peak_inflight,
    stage_to_rank,
    torch_compute_order,
    unit_time_steps,
    zero_bubble_h1,
    zero_bubble_v,
)

Kd = ActionKind


def sched(lines: list[str], K: int, M: int, stage_to_rank: tuple[int, ...] | None = None) -> Schedule:
    """A hand-written schedule: one whitespace-separated line of actions per rank."""
    return Schedule(name="literal", K=K, M=M, stage_to_rank=stage_to_rank or tuple(range(K)),
                    actions=tuple(tuple(parse_action(t) for t in line.split()) for line in lines))


def compute_order(s: Schedule) -> list[list[str]]:
    return [[str(a) for a in acts if a.kind in (Kd.F, Kd.B)] for acts in s.actions]


# ---- actions ------------------------------------------------------------------------------
def test_action_text():
    assert str(Action(2, Kd.F, 0)) == "2F0"
    assert str(Action(1, Kd.SEND_F, 3)) == "1SEND_F3"
    assert str(Action(0, Kd.RECV_B, 12)) == "0RECV_B12"
    assert str(Action(3, Kd.ALLREDUCE, -1)) == "3ALLREDUCE"
    assert str(Action(2, Kd.F, 0, 1)) == "2F0.1"
    assert Action(2, "F", 0) == Action(2, Kd.F, 0)  # a kind given as text is converted


def test_parse_round_trip():
    acts = [Action(s, k, m, sl) for s, k, m, sl in itertools.product(
        (0, 3, 17), [k for k in Kd if k is not Kd.ALLREDUCE], (0, 1, 255), (0, 2))]
    acts += [Action(s, Kd.ALLREDUCE, -1) for s in (0, 11)]
    for a in acts:
        assert parse_action(str(a)) == a
    assert parse_action(" 1SEND_B4 ") == Action(1, Kd.SEND_B, 4)


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "0ALLREDUCE3", "2F0.", "2f0", "2F0 1B0"])
def test_parse_rejects(text):
    with pytest.raises(ScheduleError, match="cannot parse action"):
        parse_action(text)


def test_action_rejects_unknown_kind_and_bad_fields():
    with pytest.raises(ScheduleError, match="unknown action kind 'X'.*SEND_F"):
        Action(0, "X", 0)
    with pytest.raises(ScheduleError, match="micro-batch index >= 0"):
        Action(0, Kd.F, -1)
    with pytest.raises(ScheduleError, match="mb=-1"):
        Action(0, Kd.ALLREDUCE, 0)
    with pytest.raises(ScheduleError, match="stage"):
        Action(-1, Kd.F, 0)
    assert issubclass(ScheduleError, PtplanError)


# ---- generators ---------------------------------------------------------------------------
def test_gpipe_literal():
    s = gpipe(2, 2)
    assert str(s) == ("gpipe K=2 M=2\n"
                      "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0ALLREDUCE\n"
                      "rank 1: 1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1 1ALLREDUCE")
    assert compute_order(gpipe(2, 3, reverse_backward=True))[0] == ["0F0", "0F1", "0F2", "0B2", "0B1", "0B0"]


def test_one_f_one_b_literal():
    # the order torch's Schedule1F1B._step_microbatches runs (2.13): stage s does K-s forwards, then
    # alternates B, F; its _get_pipeline_order IR differs only by a bug on the last stage (F1, F2, ... no F0)
    s = one_f_one_b(3, 4)
    assert compute_order(s) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3".split(),
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3".split(),
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3".split(),
    ]
    assert " ".join(map(str, s.actions[1][:9])) == "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0"


def test_one_f_one_b_needs_m_at_least_k():
    with pytest.raises(ScheduleError, match=r"M=3 < K=4.*M >= 4.*gpipe"):
        one_f_one_b(4, 3)
    one_f_one_b(4, 4)


def test_build_schedule_names():
    assert set(SCHEDULES) <= set(SCHEDULE_NAMES)  # every name a plan file may carry can be built
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "looped-bfs", "zb-v", "2bw")
    assert build_schedule("gpipe", np.int64(2), np.int32(3)) is build_schedule("gpipe", 2, 3)
    assert build_schedule("GPipe", 3, 5).name == "gpipe"
    assert build_schedule("1F1B", 3, 5) is build_schedule("1f1b", 3, 5)  # cached
    assert build_schedule("interleaved-1f1b", 2, 4, np.int64(3)) is build_schedule("Interleaved-1F1B", 2, 4, 3)
    assert build_schedule("zb-h1", 3, 5, 1) is build_schedule("ZB-H1", 3, 5)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'.*gpipe, 1f1b, interleaved-1f1b, zb-h1"):
        build_schedule("zb", 3, 5)
    with pytest.raises(ScheduleError, match="K must be an integer >= 1"):
        build_schedule("gpipe", 0, 5)
    with pytest.raises(ScheduleError, match="V must be an integer >= 1"):
        build_schedule("looped-bfs", 2, 5, 0)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_splits_backward_is_what_the_lists_run(name):
    """``splits_backward`` (what the bounds, the profile check, the schedule set and the stash read) says exactly
    whether the generated lists run W actions, for every schedule at several shapes; ``peak_stashed`` of a schedule
    without W is all zeros without building it (a new schedule with W must join ``SPLIT_BACKWARD_SCHEDULES``)."""
    from ptplan.planner.schedule import peak_stashed, splits_backward

    for K, M in ((2, 4), (3, 6), (4, 8)):
        V = 2 if name in ("interleaved-1f1b", "looped-bfs", "zb-v") else 1
        sched = build_schedule(name, K, M, V)
        has_w = any(a.kind is ActionKind.W for acts in sched.actions for a in acts)
        assert splits_backward(name) == has_w, (name, K, M)
        stashed = peak_stashed(name, K, M, V)
        assert len(stashed) == len(sched.stage_to_rank)
        assert any(stashed) == has_w, (name, K, M, stashed)


@pytest.mark.parametrize("name, K, M, V, match", [
    ("gpipe", 2, 4, 2, r"gpipe holds one stage per rank: V must be 1, got V=2; use 'interleaved-1f1b'"),
    ("1f1b", 2, 4, 3, r"1f1b holds one stage per rank: V must be 1, got V=3"),
    ("zb-h1", 2, 4, 2, r"zb-h1 holds one stage per rank: V must be 1, got V=2"),
    ("1f1b", 4, 3, 1, r"M=3 < K=4.*use M >= 4"),
    ("zb-h1", 4, 3, 1, r"ZB-H1 needs at least as many micro-batches as stages: M=3 < K=4.*M >= 4"),
    ("interleaved-1f1b", 4, 8, 1, r"needs V >= 2 chunks per rank, got V=1; .*'1f1b'"),
    ("interleaved-1f1b", 4, 10, 2, r"needs M a multiple of K .*M=10, K=4; use M=8 or M=12"),
    ("interleaved-1f1b", 4, 3, 2, r"M=3, K=4; use M=4"),
    ("zb-v", 4, 8, 1, r"zb-v holds exactly 2 chunks per rank .*give V=2, got V=1"),
])
def test_schedule_rules_name_the_numbers(name, K, M, V, match):
    for fn in (build_schedule, check_sizes, peak_inflight):
        with pytest.raises(ScheduleError, match=match):
            fn(name, K, M, V)


def test_check_sizes_agrees_with_build_schedule():
    for name, K, M, V in itertools.product(SCHEDULE_NAMES, range(1, 5), range(1, 9), range(1, 4)):
        try:
            check_sizes(name, K, M, V)
        except ScheduleError:
            with pytest.raises(ScheduleError):
                build_schedule(name, K, M, V)
        else:
            s = build_schedule(name, K, M, V)
            assert (s.K, s.M, s.num_ranks) == (K * V, M, K)
            assert s.stage_to_rank == stage_to_rank(name, K, V)


def test_placements():
    assert stage_to_rank("interleaved-1f1b", 3, 2) == (0, 1, 2, 0, 1, 2)  # loop: as plan.Phase.stage_to_rank
    assert stage_to_rank("zb-v", 3, 2) == (0, 1, 2, 2, 1, 0)
    assert stage_to_rank("1f1b", 3) == (0, 1, 2)
    assert "zb-v" not in LOOP_SCHEDULES and set(LOOP_SCHEDULES) | {"zb-v"} == set(SCHEDULE_NAMES)
    for name in LOOP_SCHEDULES:
        V = 2 if name in ("interleaved-1f1b", "looped-bfs") else 1
        assert stage_to_rank(name, 4, V) == tuple(c % 4 for c in range(4 * V))


@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
def test_generated_schedules_pass_check(K):
    for M in range(1, 2 * K + 3):
        check_schedule(gpipe(K, M))
        check_schedule(gpipe(K, M, reverse_backward=True))
        if M >= K:
            check_schedule(one_f_one_b(K, M))


@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
def test_new_generators_pass_check(K):
    for M in range(1, 2 * K + 4):
        for V in (1, 2, 3):
            check_schedule(looped_bfs(K, M, V))
        check_schedule(zero_bubble_v(K, M))
        if M >= K:
            check_schedule(zero_bubble_h1(K, M))
    for V in (2, 3, 4):
        for M in range(K, 4 * K + 1, K):
            check_schedule(interleaved_1f1b(K, M, V))


def test_generated_large_pass_check():
    for s in (gpipe(16, 40), one_f_one_b(16, 40), one_f_one_b(32, 33)):
        check_schedule(s)
        assert is_generated(s)
    assert not is_generated(dataclasses.replace(one_f_one_b(2, 2)))


def test_interleaved_literal():
    # K=2 ranks, V=2 chunks (stages 0, 2 on rank 0; 1, 3 on rank 1), M=4: rank 0 warms up with
    # (V-1)K + 2(K-1) = 4 forwards, two per chunk; rank 1 with 2; messages cross between the ranks
    # at every stage boundary, stage 1 -> 2 included (rank 1 back to rank 0)
    s = interleaved_1f1b(2, 4, 2)
    assert (s.K, s.num_ranks, s.stage_to_rank) == (4, 2, (0, 1, 0, 1))
    assert [[str(a) for a in acts] for acts in compute_actions(s)] == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split(),
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3".split(),
    ]
    assert " ".join(map(str, s.actions[0][:6])) == "0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0"
    assert " ".join(map(str, s.actions[1][:9])) == "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3B0"
    assert [str(a) for a in s.actions[0][-2:]] == ["0ALLREDUCE", "2ALLREDUCE"]


def test_zero_bubble_h1_literal():
    # stage s holds back its first s W's: the last stage (s = 2) runs F B F B before its first W and
    # its last two W's at the end; stage 0 runs each W right after its B
    s = zero_bubble_h1(3, 4)
    assert [[str(a) for a in acts] for acts in compute_actions(s)] == [
        "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3".split(),
        "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3".split(),
        "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3".split(),
    ]
    assert torch_compute_order(s)[2][:3] == ("2F0", "2I0", "2F1")  # torch's name for the input-gradient B
    assert torch_compute_order(one_f_one_b(2, 2))[0] == ("0F0", "0F1", "0B0", "0B1")  # full backward stays B
    # W's send nothing: the messages are 1F1B's
    strip = [[str(a) for a in acts if a.kind is not Kd.W] for acts in s.actions]
    assert strip == [[str(a) for a in acts] for acts in one_f_one_b(3, 4).actions]


def test_zero_bubble_v_literal():
    # K=2: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; the turn (1 -> 2) stays on rank 1
    s = zero_bubble_v(2, 4)
    assert s.stage_to_rank == (0, 1, 1, 0)
    assert [[str(a) for a in acts] for acts in compute_actions(s)] == [
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3".split(),
        "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3".split(),
    ]
    turn = {"1SEND_F", "2RECV_F", "2SEND_B", "1RECV_B"}
    assert not [a for a in s.actions[1] if f"{a.stage}{a.kind.value}" in turn]
    assert "0SEND_F0" in map(str, s.actions[0]) and "3SEND_B0" in map(str, s.actions[0])


def test_looped_bfs_literal():
    s = looped_bfs(2, 3, 2)
    assert [[str(a) for a in acts] for acts in compute_actions(s)] == [
        "0F0 0F1 0F2 2F0 2F1 2F2 2B2 2B1 2B0 0B2 0B1 0B0".split(),
        "1F0 1F1 1F2 3F0 3F1 3F2 3B2 3B1 3B0 1B2 1B1 1B0".split(),
    ]


# ---- peak in flight: the closed forms against the lists ----------------------------------------
def count_inflight(s: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches between F and their last gradient action, from list order."""
    split = {(a.stage, a.mb) for acts in s.actions for a in acts if a.kind is Kd.W}
    live, peak = [0] * s.K, [0] * s.K
    for acts in s.actions:
        for a in acts:
            if a.kind is Kd.F:
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind is Kd.W or (a.kind is Kd.B and (a.stage, a.mb) not in split):
                live[a.stage] -= 1
    return tuple(peak)


def test_peak_inflight_closed_forms_match_the_lists():
    """Every schedule, on a grid of K, M, V (``tests/test_simulate.py`` checks the simulator's count too)."""
    n = 0
    for name, K, M, V in itertools.product(SCHEDULE_NAMES, range(1, 7), range(1, 25), range(1, 5)):
        try:
            check_sizes(name, K, M, V)
        except ScheduleError:
            continue
        assert peak_inflight(name, K, M, V) == count_inflight(build_schedule(name, K, M, V)), (name, K, M, V)
        n += 1
    assert n > 900
    assert peak_inflight("interleaved-1f1b", 4, 8, 2) == (8, 8, 7, 5, 4, 4, 3, 1)
    assert peak_inflight("interleaved-1f1b", 4, 4, 2) == (4, 4, 4, 4, 4, 4, 3, 1)
    assert peak_inflight("zb-h1", 4, 8) == (4, 4, 4, 4)  # 1F1B's stage-0 peak, on every stage
    assert peak_inflight("zb-v", 3, 9, 2) == (6, 5, 4, 3, 2, 1)


# ---- torch.distributed.pipelining's own orders ----------------------------------------------------
class _MockStage:
    """What torch's multi-stage schedule constructors read from a stage (no process group needed)."""

    def __init__(self, index: int, num_stages: int, group_size: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, group_size, 0
        self.is_first, self.is_last, self.submod = index == 0, index == num_stages - 1, None


def _torch_order(cls_name: str, stage_indices: list[int], K: int, M: int) -> tuple[tuple[str, ...], ...]:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    S = {"ScheduleZBVZeroBubble": 2 * K}.get(cls_name, K * len(stage_indices))
    sched = getattr(schedules, cls_name)([_MockStage(i, S, K) for i in stage_indices], M, loss_fn=lambda y, t: y)
    return tuple(tuple(str(a) for a in sched.pipeline_order[r] if a is not None) for r in range(K))


def test_interleaved_and_looped_bfs_equal_torch():
    """torch's ScheduleInterleaved1F1B and ScheduleLoopedBFS compute orders (rank r, loop placement), as
    the installed torch generates them."""
    for K, V in itertools.product(range(1, 6), range(2, 5)):
        for M in range(K, 4 * K + 1, K):
            mine = torch_compute_order(interleaved_1f1b(K, M, V))
            assert mine == _torch_order("ScheduleInterleaved1F1B", [v * K for v in range(V)], K, M), (K, M, V)
            bfs = torch_compute_order(looped_bfs(K, M, V))
            assert bfs == _torch_order("ScheduleLoopedBFS", [v * K for v in range(V)], K, M), (K, M, V)


def test_zero_bubble_h1_equals_torch_zero_bubble_with_one_stage_per_rank():
    """torch's ScheduleInterleavedZeroBubble with one stage per rank is ZB-H1 (torch names our split B
    ``I``). torch refuses some M (a multiple of M // K must divide M: a rule of its V > 1 grouping that
    a single chunk does not need), and those are skipped here; we accept every M >= K."""
    n = 0
    for K in range(1, 7):
        for M in range(K, 3 * K + 2):
            if M % max(1, M // K):
                continue
            theirs = _torch_order("ScheduleInterleavedZeroBubble", [0], K, M)
            assert torch_compute_order(zero_bubble_h1(K, M)) == theirs, (K, M)
            n += 1
    assert n >= 35


def test_zero_bubble_v_equals_torch():
    """torch's ScheduleZBVZeroBubble (rank r holds stages r and 2K-1-r), every M (torch pads M up to 2K-1
    internally and drops the extra micro-batches, as ``zero_bubble_v`` does)."""
    for K in range(1, 6):
        for M in range(1, 3 * K + 2):
            theirs = _torch_order("ScheduleZBVZeroBubble", [0, 2 * K - 1], K, M)
            assert torch_compute_order(zero_bubble_v(K, M)) == theirs, (K, M)


def test_unit_time_steps_and_order():
    s = one_f_one_b(2, 2)
    steps = unit_time_steps(s)
    order = execution_order(s)
    assert len(order) == sum(map(len, s.actions))
    seen = set()
    for r, i in order:  # each receive comes after its send, each rank in list order
        a = s.actions[r][i]
        if a.kind is Kd.RECV_F:
            assert str(Action(a.stage - 1, Kd.SEND_F, a.mb)) in seen
        seen.add(str(a))
    # rank 1 waits one step for 0SEND_F0 (steps 0: 0F0, 1: 0SEND_F0, 2: 1RECV_F0)
    assert steps[1][0] == 2


# ---- hand-built schedules: representation and checks --------------------------------------
V_SHAPE = [  # 4 stages on 2 ranks, "V" placement: rank 0 holds stages 0 and 3, rank 1 holds 1 and 2
    "0F0 0SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 0RECV_B0 0B0 0ALLREDUCE 3ALLREDUCE",
    "1RECV_F0 1F0 2F0 2SEND_F0 2RECV_B0 2B0 1B0 1SEND_B0 1ALLREDUCE 2ALLREDUCE",
]


def test_interleaved_placement_is_representable():
    s = sched(V_SHAPE, K=4, M=1, stage_to_rank=(0, 1, 1, 0))
    check_schedule(s)
    assert s.num_ranks == 2


def test_zero_bubble_w_actions_are_checked():
    ok = sched(["0F0 0B0 0W0 0ALLREDUCE"], K=1, M=1)
    check_schedule(ok)
    with pytest.raises(ScheduleError, match="runs 0W0.*before 0B0"):
        check_schedule(sched(["0F0 0W0 0B0 0ALLREDUCE"], K=1, M=1))
    with pytest.raises(ScheduleError, match="0ALLREDUCE.*before 0W0"):
        check_schedule(sched(["0F0 0B0 0ALLREDUCE 0W0"], K=1, M=1))


def test_token_slices_are_checked():
    s = Schedule(name="slices", K=1, M=1, stage_to_rank=(0,), slices=2,
                 actions=((parse_action("0F0"), parse_action("0F0.1"), parse_action("0B0.1"), parse_action("0B0"),
                           parse_action("0ALLREDUCE")),))
    check_schedule(s)
    with pytest.raises(ScheduleError, match="0B0.1 is missing"):
        check_schedule(dataclasses.replace(s, actions=((s.actions[0][0], s.actions[0][1], s.actions[0][3],
                                                         s.actions[0][4]),)))


def _mutate(s: Schedule, rank: int, fn) -> Schedule:
    acts = [list(a) for a in s.actions]
    acts[rank] = fn(acts[rank])
    return dataclasses.replace(s, actions=tuple(tuple(a) for a in acts))


def _swap(lst: list, x: str, y: str) -> list:
    names = [str(a) for a in lst]
    i, j = names.index(x), names.index(y)
    lst[i], lst[j] = lst[j], lst[i]
    return lst


def _drop(lst: list, x: str) -> list:
    return [a for a in lst if str(a) != x]


@pytest.mark.parametrize("rank, fn, match", [
    (2, lambda l: _swap(l, "2F1", "2B1"), r"runs 2B1 \(position \d+\) before 2F1"),
    (1, lambda l: _drop(l, "1RECV_F2"), r"0SEND_F2 on rank 0 has no matching 1RECV_F2 on rank 1"),
    (1, lambda l: _drop(l, "1SEND_B2"), r"0RECV_B2 on rank 0 has no matching 1SEND_B2 on rank 1"),
    (0, lambda l: _drop(l, "0SEND_F1"), r"1RECV_F1 on rank 1 has no matching 0SEND_F1 on rank 0"),
    (1, lambda l: _drop(l, "1B3"), r"1B3 is missing"),
    (1, lambda l: l + [parse_action("1F0")], r"1F0 appears twice"),
    (1, lambda l: l + [parse_action("2F0")], r"2F0 is on rank 1, but stage 2 lives on rank 2"),
    (1, lambda l: l + [parse_action("1F9")], r"micro-batch 9, but M=4"),
    (0, lambda l: _drop(l, "0ALLREDUCE"), r"0ALLREDUCE is missing"),
    (0, lambda l: [l[-1]] + l[:-1], r"0ALLREDUCE \(position 0\) before 0B3"),
    (1, lambda l: _swap(l, "1RECV_F1", "1F1"), r"runs 1F1 .* before 1RECV_F1.*receive comes before"),
    (1, lambda l: _swap(l, "1SEND_F0", "1F0"), r"runs 1SEND_F0 .* before 1F0.*send follows"),
    (0, lambda l: l + [parse_action("0SEND_B0")], r"0SEND_B0 sends to stage -1, which does not exist"),
    (0, lambda l: l + [parse_action("0RECV_F0")], r"0RECV_F0 receives from stage -1"),
    (0, lambda l: l + ["0F7"], r"rank 0 position \d+ holds '0F7', not a known action"),
])
def test_mutated_schedules_fail(rank, fn, match):
    base = one_f_one_b(3, 4)
    check_schedule(base)
    with pytest.raises(ScheduleError, match=match):
        check_schedule(_mutate(base, rank, fn))


def test_missing_receive_without_send_is_named():
    # rank 1 computes 1F0 with no receive at all, and rank 0 sends nothing
    s = sched(["0F0 0RECV_B0 0B0 0ALLREDUCE", "1F0 1B0 1SEND_B0 1ALLREDUCE"], K=2, M=1)
    with pytest.raises(ScheduleError, match="1F0 on rank 1 needs data from stage 0 on rank 0 but there is no 1RECV_F0"):
        check_schedule(s)


def test_same_rank_neighbours_need_no_messages():
    bad = sched(["0F0 0SEND_F0 1RECV_F0 1F0 1B0 0B0 0ALLREDUCE 1ALLREDUCE"], K=2, M=1, stage_to_rank=(0, 0))
    with pytest.raises(ScheduleError, match="same rank 0.*exchange no messages"):
        check_schedule(bad)
    out_of_order = sched(["1F0 0F0 1B0 0B0 0ALLREDUCE 1ALLREDUCE"], K=2, M=1, stage_to_rank=(0, 0))
    with pytest.raises(ScheduleError, match="runs 1F0 .* before 0F0.*stage 0 on the same rank"):
        check_schedule(out_of_order)
    with pytest.raises(ScheduleError, match="runs 0B0 .* before 1B0"):
        check_schedule(sched(["0F0 1F0 0B0 1B0 0ALLREDUCE 1ALLREDUCE"], K=2, M=1, stage_to_rank=(0, 0)))


def test_deadlock_is_detected():
    # rank 0 waits for the gradient before sending the activation the gradient depends on
    s = sched(["0F0 0RECV_B0 0SEND_F0 0B0 0ALLREDUCE",
               "1RECV_F0 1F0 1B0 1SEND_B0 1ALLREDUCE"], K=2, M=1)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 waits at 0RECV_B0 for 1SEND_B0.*"
                                            r"rank 1 waits at 1RECV_F0 for 0SEND_F0"):
        check_schedule(s)


def test_deadlock_three_ranks_cycle():
    # stage 1 holds back micro-batch 2's activation until after it has received micro-batch 2's gradient
    def delay_send(lst: list) -> list:
        send = next(a for a in lst if str(a) == "1SEND_F2")
        rest = [a for a in lst if a is not send]
        return rest[:-1] + [send, rest[-1]]

    bad = _mutate(one_f_one_b(3, 3), 1, delay_send)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 1 waits at 1RECV_B2 for 2SEND_B2.*"
                                            r"rank 2 waits at 2RECV_F2 for 1SEND_F2"):
        check_schedule(bad)


def test_schedule_shape_errors():
    with pytest.raises(ScheduleError, match="stage_to_rank has 1 entries for K=2"):
        Schedule(name="x", K=2, M=1, stage_to_rank=(0,), actions=((),))
    with pytest.raises(ScheduleError, match="must use every rank"):
        Schedule(name="x", K=2, M=1, stage_to_rank=(0, 2), actions=((), ()))
    with pytest.raises(ScheduleError, match="3 action lists for 2 ranks"):
        Schedule(name="x", K=2, M=1, stage_to_rank=(0, 1), actions=((), (), ()))


# ---- PipeDream-2BW ----------------------------------------------------------------------------
def test_two_bw_is_1f1b_across_minibatches_without_a_flush():
    """K=2, M=2, two mini-batches: the warm-up and the drain happen once, not per mini-batch."""
    s = two_bw(2, 2, minibatches=2)
    assert (s.K, s.M, s.minibatches, s.total_mb) == (2, 2, 2, 4)
    assert compute_order(s) == [["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
                                ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]]
    assert [s.version(m) for m in range(4)] == [0, 0, 1, 1]
    assert str(s).splitlines()[0] == "2bw K=2 M=2 minibatches=2"
    check_schedule(s)
    # the same lists as 1F1B over N·M micro-batches, one ALLREDUCE per stage at the end (the drain)
    assert s.actions == one_f_one_b(2, 4).actions
    assert build_schedule("2bw", 3, 4) is build_schedule("2BW", 3, 4)
    assert build_schedule("2bw", 3, 4).minibatches == TWOBW_WINDOW == 8


@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
def test_two_bw_passes_check_and_keeps_two_versions(K):
    for M in range(K, 2 * K + 2):
        for N in (1, 2, 3, 5):
            s = two_bw(K, M, minibatches=N)
            check_schedule(s)
            assert count_inflight(s) == peak_inflight("2bw", K, M) == tuple(K - st for st in range(K))
            # versions live on each stage at any point of its list: at most two
            for acts in compute_actions(s):
                live: dict[int, int] = {}
                for a in acts:
                    v = s.version(a.mb)
                    live[v] = live.get(v, 0) + (1 if a.kind is Kd.F else -1)
                    if not live[v]:
                        del live[v]
                    assert max(live, default=0) - min(live, default=0) <= 1, (K, M, N, str(a))


def test_two_bw_rules_name_the_numbers():
    for fn in (build_schedule, check_sizes, peak_inflight):
        with pytest.raises(ScheduleError, match=r"2BW needs at least as many micro-batches as stages: M=3 < K=4.*M >= 4"):
            fn("2bw", 4, 3)
        with pytest.raises(ScheduleError, match=r"2bw holds one stage per rank: V must be 1, got V=2"):
            fn("2bw", 2, 4, 2)


def test_check_refuses_a_third_weight_version():
    """1F1B's lists over 6 micro-batches read as six mini-batches of M=1 on K=3 stages: stage 0 runs
    mini-batch 2's forward before mini-batch 0's backward, which would need a third weight version."""
    base = one_f_one_b(3, 6)
    bad = Schedule(name="literal", K=3, M=1, minibatches=6, stage_to_rank=(0, 1, 2), actions=base.actions)
    with pytest.raises(ScheduleError, match=r"rank 0 starts mini-batch 2 \(0F2, position \d+\) before mini-batch "
                                            r"0's last backward \(0B0.*third weight version.*M >= K"):
        check_schedule(bad)
    ok = Schedule(name="literal", K=3, M=3, minibatches=2, stage_to_rank=(0, 1, 2), actions=base.actions)
    check_schedule(ok)
    with pytest.raises(ScheduleError, match=r"0F6 names micro-batch 6, but the lists hold 6 \(M=3 x 2 mini-batches\) \(0..5\)"):
        check_schedule(dataclasses.replace(ok, actions=((*ok.actions[0], Action(0, Kd.F, 6)), *ok.actions[1:])))


def test_memoised_size_checks_equal_the_plain_ones():
    """``check_sizes``, ``peak_inflight`` and ``stage_to_rank`` remember their answers for plain-int sizes (the search asks the
    same few tens of thousands of times per plan): every answer, error message included, is the one the
    unmemoised functions give, asked twice, and numpy sizes take the plain path."""
    from ptplan.planner import schedule as sch

    for name, K, M, V in itertools.product(list(SCHEDULE_NAMES) + ["1F1B", "nope"], (1, 2, 3, 4, 8),
                                           (1, 2, 3, 4, 8, 16), (0, 1, 2, 3)):
        try:
            sch._check_sizes(name, K, M, V)
            want: str | None = None
        except ScheduleError as e:
            want = str(e)
        for _ in range(2):
            for k in (K, np.int64(K)):
                if want is None:
                    check_sizes(name, k, M, V)
                    assert peak_inflight(name, k, M, V) == sch._peak_inflight(name, K, M, V)
                    assert stage_to_rank(name, k, V) == sch._stage_to_rank(name, K, V)
                else:
                    with pytest.raises(ScheduleError) as err:
                        check_sizes(name, k, M, V)
                    assert str(err.value) == want
                    with pytest.raises(ScheduleError):
                        peak_inflight(name, k, M, V)
