"""Schedules as data: action text round-trips, GPipe / 1F1B generators, and check_schedule's rejections."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import SCHEDULES
from ptplan.planner.schedule import (
    Action,
    SCHEDULE_NAMES,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    check_schedule,
    execution_order,
    gpipe,
    is_generated,
    one_f_one_b,
    parse_action,
    unit_time_steps,
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
    assert SCHEDULE_NAMES == SCHEDULES  # the names a plan file may carry
    assert build_schedule("gpipe", np.int64(2), np.int32(3)) is build_schedule("gpipe", 2, 3)
    assert build_schedule("GPipe", 3, 5).name == "gpipe"
    assert build_schedule("1F1B", 3, 5) is build_schedule("1f1b", 3, 5)  # cached
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'.*gpipe, 1f1b"):
        build_schedule("zb", 3, 5)
    with pytest.raises(ScheduleError, match="K must be an integer >= 1"):
        build_schedule("gpipe", 0, 5)


@pytest.mark.parametrize("K", [1, 2, 3, 4, 6])
def test_generated_schedules_pass_check(K):
    for M in range(1, 2 * K + 3):
        check_schedule(gpipe(K, M))
        check_schedule(gpipe(K, M, reverse_backward=True))
        if M >= K:
            check_schedule(one_f_one_b(K, M))


def test_generated_large_pass_check():
    for s in (gpipe(16, 40), one_f_one_b(16, 40), one_f_one_b(32, 33)):
        check_schedule(s)
        assert is_generated(s)
    assert not is_generated(dataclasses.replace(one_f_one_b(2, 2)))


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
