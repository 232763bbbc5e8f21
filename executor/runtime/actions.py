"""A phase's schedule as data: its action lists read from the plan, checked, and written in torch's schedule IR.

Legend: K pipeline positions (ranks of one pipeline), V chunks (model stages) per position, S = K·V
stages, M micro-batches. ``Phase.actions[k]`` is position k's list in ``planner.schedule``'s text
(``2F0 2SEND_F0 1RECV_B0 ...``); chunk c lives on position ``Phase.stage_to_rank()[c]``.

The executor runs exactly those lists: ``phase_schedule`` parses and checks them (every action
known, every forward before its backward, every message matched, no deadlock: ``check_schedule``),
and the one step interpreter (``step.StepInterpreter``) runs them action by action, for every schedule.
``torch_text``/``torch_actions`` write them in torch.distributed.pipelining's schedule IR (``_Action``,
through ``torch_adapter``), the text torch's custom-schedule runtime and torchtitan's CSV schedules read,
for reports and for comparing with torch's own orders. Token by token:

- ``F`` -> ``F``; ``W`` -> ``W``;
- ``B`` -> ``B`` (full backward), or ``I`` (input gradient only) where the same (stage, micro-batch)
  also has a ``W`` (zero-bubble schedules);
- ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B`` -> the same (torch names stages the same way: a send
  by its sending stage, a receive by its receiving stage);
- ``ALLREDUCE`` -> ``REDUCE_GRAD``, torch's end-of-gradients action for that stage at the same place:
  it divides the stage's gradients by M (the loss is a mean per micro-batch). The data-parallel
  all-reduce itself runs after the schedule's step (``runtime.ElasticRuntime``), never inside it.

Messages between two ranks are matched by order alone (no tags: the interpreter's, as torch's), so the
receives one rank posts from another must come in the order that rank sends them;
``planner.schedule.check_message_order`` (part of ``check_schedule``) refuses lists where they do not (a
transformer's activations and gradients have the same shape: a mismatch would silently swap them). Plans written before phases stored actions (``Phase.actions`` empty) get the
lists ``planner.schedule.build_schedule`` generates for the phase's schedule name, so every phase runs
through the same path. Two kinds of phase must hold the generator's lists, run by the same interpreter
under their own policy: PipeDream-2BW (``twobw.TwoBW``: a step is one mini-batch's stretch of the list)
and token-sliced phases (``Phase.slices``: ``sliced_schedule``, ``planner.schedule.terapipe``'s lists, the
slice index on each action: ``sliced.SliceCompute``).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Phase
from ptplan.planner.schedule import (Action, ActionKind, Schedule, ScheduleError, build_schedule, check_schedule,
                                     parse_action, terapipe)

_TORCH_KIND = {ActionKind.F: "F", ActionKind.W: "W", ActionKind.SEND_F: "SEND_F", ActionKind.RECV_F: "RECV_F",
               ActionKind.SEND_B: "SEND_B", ActionKind.RECV_B: "RECV_B", ActionKind.ALLREDUCE: "REDUCE_GRAD"}


def _where(index: int | None, phase: Phase) -> str:
    name = "plan phase" if index is None else f"plan phase {index}"
    return (f"{name} ({phase.frozen_blocks} frozen blocks, schedule {phase.schedule!r}, K={phase.K}, V={phase.V}, "
            f"M={phase.M})")


def phase_schedule(phase: Phase, index: int | None = None) -> Schedule:
    """The phase's schedule, checked: ``Phase.actions`` parsed, or, for a plan without actions, the lists
    ``build_schedule`` generates for ``phase.schedule``. Raises PtplanError naming the phase and the
    action at fault."""
    fix = "re-run `ptplan plan`, or plan with another schedule if it writes the same lists again"
    if phase.slices:  # token slices (TeraPipe): GPipe order over slices, a slice index on each action
        return sliced_schedule(phase, index)
    if phase.schedule == "2bw":  # the continuous 1F1B the planner generates, cut into steps by twobw.TwoBW
        try:
            want = build_schedule("2bw", phase.K, phase.M, phase.V)
        except ScheduleError as e:
            raise PtplanError(f"{_where(index, phase)}: the executor cannot run its schedule: {e}; {fix}") from None
        if not _stored_lists_are(phase, want):
            raise PtplanError(f"{_where(index, phase)}: the executor runs PipeDream-2BW as the continuous 1F1B that "
                              f"`ptplan plan` writes (planner.schedule.two_bw), but this phase's action lists differ; "
                              f"{fix}")
        return want
    try:
        return _checked(phase.schedule, phase.K, phase.M, phase.V, phase.stage_to_rank(), phase.actions)
    except ScheduleError as e:
        raise PtplanError(f"{_where(index, phase)}: the executor cannot run its schedule: {e}; {fix}") from None


def _stored_lists_are(phase: Phase, want: Schedule) -> bool:
    """Whether the phase's stored action lists (if it has any) are ``want``'s, as the plan writes them."""
    return not phase.actions or tuple(phase.actions) == tuple(" ".join(map(str, a)) for a in want.actions)


def sliced_schedule(phase: Phase, index: int | None = None) -> Schedule:
    """A token-sliced phase's schedule: ``planner.schedule.terapipe`` for its K, M and slice count (what
    ``ptplan plan --token-slices auto`` writes and the step interpreter runs with sliced.py's compute), checked (sizes, messages,
    slice order); the phase's stored action lists must be those."""
    from ptplan.executor.runtime.sliced import check_slice_order

    where = _where(index, phase)
    if phase.V != 1 or phase.tp != 1 or phase.any_fsdp or phase.any_recompute or phase.schedule == "2bw":
        raise PtplanError(f"{where}: token slices run one stage per position with plain layers, but the phase has "
                          f"V={phase.V}, {phase.strategy_label}, schedule {phase.schedule!r}; re-run `ptplan plan "
                          f"--token-slices auto` (it slices only such phases) or plan with --token-slices off")
    try:
        want = terapipe(phase.K, phase.M, len(phase.slices))
        check_schedule(want)
        check_slice_order(want)
    except ScheduleError as e:
        raise PtplanError(f"{where}: the executor cannot run its token-sliced schedule: {e}") from None
    if not _stored_lists_are(phase, want):
        raise PtplanError(f"{where}: a token-sliced phase runs TeraPipe's schedule (planner.schedule.terapipe: every "
                          f"slice forward in order, then each micro-batch's slices backward in reverse), but this "
                          f"phase's action lists differ; re-run `ptplan plan --token-slices auto`")
    return want


@lru_cache(maxsize=64)
def _checked(name: str, K: int, M: int, V: int, stage_to_rank: tuple[int, ...], actions: tuple[str, ...]) -> Schedule:
    """``phase_schedule``'s work, once per distinct schedule (phases of a plan often share one)."""
    if not actions:
        sched = build_schedule(name, K, M, V)
        if sched.stage_to_rank != stage_to_rank:
            raise ScheduleError(f"schedule {name!r} places its stages {sched.stage_to_rank}, but a phase without "
                                f"actions places chunk c on position c % K {stage_to_rank}")
    else:
        if len(actions) != K:
            raise ScheduleError(f"{len(actions)} action lists for K={K} positions")
        lists = tuple(tuple(parse_action(tok) for tok in text.split()) for text in actions)
        sched = Schedule(name=name, K=K * V, M=M, stage_to_rank=stage_to_rank, actions=lists)
    check_schedule(sched)  # the message order too (``check_message_order``: torch pairs messages in order)
    if sched.slices != 1 or any(a.slice for acts in sched.actions for a in acts):
        raise ScheduleError("its actions name token slices but the phase has no slice lengths (Phase.slices); "
                            "token-sliced phases come from `ptplan plan --token-slices auto`")
    return sched


def torch_token(action: Action, split: frozenset[tuple[int, int]]) -> str:
    """One action in torch's text (``_Action.from_str``): ``B`` becomes ``I`` where ``split`` (the (stage,
    micro-batch) pairs that have a W) holds it; ``ALLREDUCE`` becomes ``REDUCE_GRAD``."""
    if action.kind is ActionKind.B:
        kind = "I" if (action.stage, action.mb) in split else "B"
    else:
        kind = _TORCH_KIND[action.kind]
    return f"{action.stage}{kind}" + ("" if action.kind is ActionKind.ALLREDUCE else str(action.mb))


def split_backwards(schedule: Schedule) -> frozenset[tuple[int, int]]:
    """The (stage, micro-batch) pairs whose backward is split into B (input gradient) and W (weights)."""
    return frozenset((a.stage, a.mb) for acts in schedule.actions for a in acts if a.kind is ActionKind.W)


def torch_text(schedule: Schedule) -> tuple[tuple[str, ...], ...]:
    """Per position, its actions in torch's text, messages and REDUCE_GRAD included."""
    split = split_backwards(schedule)
    return tuple(tuple(torch_token(a, split) for a in acts) for acts in schedule.actions)


def torch_actions(schedule: Schedule) -> dict[int, list[Any]]:
    """Per position, its actions as torch ``_Action`` objects (``torch_adapter``): what torch's custom-schedule
    runtime's ``_prepare_schedule_with_comms`` takes."""
    from ptplan.executor.runtime.torch_adapter import torch_action

    return {r: [torch_action(tok) for tok in toks] for r, toks in enumerate(torch_text(schedule))}
