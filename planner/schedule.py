"""Pipeline schedules as data: typed actions per rank, the GPipe and 1F1B generators, and their checks.

Legend: K pipeline stages, M micro-batches per iteration, R ranks (R = K when each rank holds one
stage). An action prints like torch.distributed.pipelining's IR: ``2F0`` is stage 2's forward of
micro-batch 0, ``1SEND_F3`` stage 1 sending micro-batch 3's output to stage 2, ``0RECV_B3`` stage 0
receiving micro-batch 3's input gradient from stage 1, ``3ALLREDUCE`` stage 3's data-parallel
gradient all-reduce. A non-zero token slice (TeraPipe) prints after a dot: ``2F0.1``.

Send/receive naming follows torch: ``SEND_F``/``SEND_B`` carry the *sending* stage and ``RECV_F``/
``RECV_B`` the *receiving* stage, so ``sSEND_Fm`` pairs with ``(s+1)RECV_Fm`` and ``sSEND_Bm`` with
``(s-1)RECV_Bm``. Neighbouring stages on the same rank (interleaved "V" placements) exchange no
messages; their order is a plain list order on that rank.
"""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from .errors import PtplanError


class ScheduleError(PtplanError):
    """A schedule that cannot run: a missing or misordered action, an unmatched message, a deadlock."""


class ActionKind(str, Enum):
    """What an action does. B is the full backward, or only the input-gradient half where the same
    (stage, micro-batch) also has a W (zero-bubble schedules split the weight gradient off as W)."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W})
COMM_KINDS = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_VALID_KINDS = ", ".join(k.value for k in ActionKind)


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``kind`` for micro-batch ``mb`` (token slice ``slice``) on ``stage``."""

    stage: int
    kind: ActionKind
    mb: int
    """Micro-batch index; -1 for ALLREDUCE (it covers the whole iteration)."""
    slice: int = 0
    """Token slice within the micro-batch (TeraPipe); 0 when micro-batches are not sliced."""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            try:
                object.__setattr__(self, "kind", ActionKind(self.kind))
            except ValueError:
                raise ScheduleError(f"unknown action kind {self.kind!r}; valid kinds: {_VALID_KINDS}") from None
        if not (type(self.stage) is int and type(self.mb) is int and type(self.slice) is int):
            for name in ("stage", "mb", "slice"):  # numpy integers become plain ints
                v = getattr(self, name)
                if isinstance(v, numbers.Integral) and not isinstance(v, bool):
                    object.__setattr__(self, name, int(v))
        if type(self.stage) is not int or self.stage < 0:
            raise ScheduleError(f"action stage must be an integer >= 0, got {self.stage!r}")
        if self.kind is ActionKind.ALLREDUCE:
            if self.mb != -1:
                raise ScheduleError(f"an ALLREDUCE covers all micro-batches: give mb=-1, got {self.mb!r}")
        elif type(self.mb) is not int or self.mb < 0:
            raise ScheduleError(f"action {self.kind.value} needs a micro-batch index >= 0, got {self.mb!r}")
        if type(self.slice) is not int or self.slice < 0:
            raise ScheduleError(f"action slice must be an integer >= 0, got {self.slice!r}")

    def __str__(self) -> str:
        if self.kind is ActionKind.ALLREDUCE:
            return f"{self.stage}ALLREDUCE"
        text = f"{self.stage}{self.kind.value}{self.mb}"
        return f"{text}.{self.slice}" if self.slice else text


_ACTION_RE = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|ALLREDUCE|F|B|W)(\d*)(?:\.(\d+))?")


def parse_action(text: str) -> Action:
    """The inverse of ``str(Action)``: ``"2F0"``, ``"1SEND_F3"``, ``"0ALLREDUCE"``, ``"2F0.1"``."""
    m = _ACTION_RE.fullmatch(text.strip())
    if m is None:
        raise ScheduleError(f"cannot parse action {text!r}: expected [stage][kind][micro-batch], e.g. 2F0, "
                            f"1SEND_F3, 0ALLREDUCE; kinds: {_VALID_KINDS}")
    stage, kind, mb, sl = m.groups()
    if kind == "ALLREDUCE":
        if mb or sl:
            raise ScheduleError(f"cannot parse action {text!r}: ALLREDUCE takes no micro-batch (write e.g. 0ALLREDUCE)")
        return Action(int(stage), ActionKind.ALLREDUCE, -1)
    if not mb:
        raise ScheduleError(f"cannot parse action {text!r}: {kind} needs a micro-batch index, e.g. {stage}{kind}0")
    return Action(int(stage), ActionKind(kind), int(mb), int(sl) if sl else 0)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One training iteration of one pipeline, as per-rank action lists in execution order.

    How later schedules fit (only GPipe and 1F1B are generated today):
    interleaved / looped / V placements give a rank several stages via ``stage_to_rank``
    (K > R) and mix their actions in one list; zero-bubble schedules add one W per
    (stage, micro-batch) after its B; TeraPipe sets ``slices`` > 1 and gives every compute and
    message action its token ``slice``; PipeDream-2BW keeps 1F1B-shaped lists and will add a
    weight-version count for the memory model (a field added when a generator needs it).
    """

    name: str
    K: int
    """Number of pipeline stages."""
    M: int
    """Number of micro-batches in the iteration."""
    stage_to_rank: tuple[int, ...]
    """stage_to_rank[s] = the rank (position in the pipeline, 0..R-1) that holds stage s."""
    actions: tuple[tuple[Action, ...], ...]
    """actions[r] = rank r's actions in execution order, sends and receives included."""
    slices: int = 1
    """Token slices per micro-batch (TeraPipe); 1 = micro-batches are not sliced."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.K < 1 or self.M < 1 or self.slices < 1:
            raise ScheduleError(f"schedule {self.name!r}: K, M and slices must be >= 1, got K={self.K}, "
                                f"M={self.M}, slices={self.slices}")
        if len(self.stage_to_rank) != self.K:
            raise ScheduleError(f"schedule {self.name!r}: stage_to_rank has {len(self.stage_to_rank)} entries "
                                f"for K={self.K} stages")
        used = set(self.stage_to_rank)
        if used != set(range(len(used))):
            raise ScheduleError(f"schedule {self.name!r}: stage_to_rank {self.stage_to_rank} must use every "
                                f"rank 0..R-1 (R = number of distinct ranks)")
        if len(self.actions) != len(used):
            raise ScheduleError(f"schedule {self.name!r}: {len(self.actions)} action lists for {len(used)} ranks "
                                f"(stage_to_rank {self.stage_to_rank})")

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def __str__(self) -> str:
        head = f"{self.name} K={self.K} M={self.M}" + (f" slices={self.slices}" if self.slices > 1 else "")
        width = len(str(self.num_ranks - 1))
        lines = [f"rank {r:>{width}}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions)]
        return "\n".join([head, *lines])


# ---- generators ---------------------------------------------------------------------------
@lru_cache(maxsize=1 << 20)
def _act(stage: int, kind: ActionKind, mb: int) -> Action:
    """Actions are immutable, so generators share them (building a K=64, M=256 schedule creates
    ~65k actions; most are already cached from other (K, M) pairs)."""
    return Action(stage, kind, mb)


def _forward(s: int, m: int, K: int) -> list[Action]:
    out = [_act(s, ActionKind.RECV_F, m)] if s > 0 else []
    out.append(_act(s, ActionKind.F, m))
    if s < K - 1:
        out.append(_act(s, ActionKind.SEND_F, m))
    return out


def _backward(s: int, m: int, K: int) -> list[Action]:
    out = [_act(s, ActionKind.RECV_B, m)] if s < K - 1 else []
    out.append(_act(s, ActionKind.B, m))
    if s > 0:
        out.append(_act(s, ActionKind.SEND_B, m))
    return out


def _sizes(name: str, K: int, M: int) -> tuple[int, int]:
    """K and M as plain ints >= 1 (numpy integers accepted)."""
    out: list[int] = []
    for sym, v in (("K", K), ("M", M)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
            raise ScheduleError(f"{name}: {sym} must be an integer >= 1, got {v!r}")
        out.append(int(v))
    return out[0], out[1]


def gpipe(K: int, M: int, *, reverse_backward: bool = False) -> Schedule:
    """GPipe (fill-drain): every stage runs all M forwards, then all M backwards.

    Backwards run in micro-batch order 0..M-1 as torch's ScheduleGPipe does (torch 2.13);
    ``reverse_backward=True`` gives the GPipe paper's / torchgpipe's order M-1..0.
    """
    K, M = _sizes("gpipe", K, M)
    order = range(M - 1, -1, -1) if reverse_backward else range(M)
    ranks = []
    for s in range(K):
        acts: list[Action] = []
        for m in range(M):
            acts += _forward(s, m, K)
        for m in order:
            acts += _backward(s, m, K)
        acts.append(_act(s, ActionKind.ALLREDUCE, -1))
        ranks.append(tuple(acts))
    return _generated(Schedule(name="gpipe", K=K, M=M, stage_to_rank=tuple(range(K)), actions=tuple(ranks)))


def one_f_one_b(K: int, M: int) -> Schedule:
    """1F1B (PipeDream-flush): stage s warms up with K-s-1 forwards, then alternates one forward and
    one backward, then drains the remaining backwards — torch's Schedule1F1B order. Needs M >= K."""
    K, M = _sizes("1f1b", K, M)
    if M < K:
        raise ScheduleError(f"1F1B needs at least as many micro-batches as stages: M={M} < K={K} "
                            f"(torch's Schedule1F1B has the same rule); use M >= {K} or the 'gpipe' schedule")
    ranks = []
    for s in range(K):
        warm = K - s - 1
        acts: list[Action] = []
        for m in range(warm):
            acts += _forward(s, m, K)
        for i in range(M - warm):
            acts += _forward(s, warm + i, K)
            acts += _backward(s, i, K)
        for m in range(M - warm, M):
            acts += _backward(s, m, K)
        acts.append(_act(s, ActionKind.ALLREDUCE, -1))
        ranks.append(tuple(acts))
    return _generated(Schedule(name="1f1b", K=K, M=M, stage_to_rank=tuple(range(K)), actions=tuple(ranks)))


_GENERATED_ATTR = "_ptplan_generated"


def _generated(schedule: Schedule) -> Schedule:
    object.__setattr__(schedule, _GENERATED_ATTR, True)  # a marker beside the fields, not a field
    return schedule


def is_generated(schedule: Schedule) -> bool:
    """True for a schedule object made by this module's generators, whose output the tests run
    through ``check_schedule`` over grids of K and M; the simulator skips re-checking those. A copy
    (``dataclasses.replace``) or a hand-built schedule is not marked and gets checked."""
    return bool(schedule.__dict__.get(_GENERATED_ATTR, False))


_GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b}
SCHEDULE_NAMES = tuple(_GENERATORS)


def peak_inflight(name: str, K: int, M: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches in flight (F started, B not yet ended) in the named schedule:
    GPipe holds all M; 1F1B holds min(K - s, M) on stage s. The planner's memory model uses this
    before any schedule is built; ``tests/test_schedule.py`` checks it against the generated lists."""
    key = name.lower() if isinstance(name, str) else name
    if key not in _GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULE_NAMES)}")
    K, M = _sizes(key, K, M)
    if key == "gpipe":
        return (M,) * K
    return tuple(min(K - s, M) for s in range(K))


def build_schedule(name: str, K: int, M: int) -> Schedule:
    """The named schedule ("gpipe", "1f1b"; case-insensitive) for K stages and M micro-batches.

    Results are cached: the same (name, K, M) returns the same object, so the simulator's
    compiled form of it is reused across calls.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in _GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULE_NAMES)}")
    return _build_cached(key, *_sizes(key, K, M))


@lru_cache(maxsize=256)
def _build_cached(name: str, K: int, M: int) -> Schedule:
    return _GENERATORS[name](K, M)


# ---- checks -------------------------------------------------------------------------------
def check_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError unless the schedule can run as written.

    Checks: every action is known, on the rank that holds its stage, and within K, M and slices;
    every (stage, micro-batch, slice) has exactly one F and one B (at most one W, after its B);
    each stage has exactly one ALLREDUCE, after its last backward; a B never precedes its F;
    every message between stages on different ranks is sent exactly once after the compute that
    produces it and received exactly once before the compute that needs it (no messages between
    stages on the same rank, where list order decides); forwards follow stage order and backwards
    reverse stage order; and no deadlock: executing the lists in unit time with blocking receives
    (and buffered sends) finishes.
    """
    _checked_run(schedule)


def unit_time_steps(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Check the schedule (see ``check_schedule``) and return, per rank, the unit-time step at which
    each action runs when every action takes one step and a receive waits for its send to have run
    in an earlier step (sends are buffered: they never wait for the receiver)."""
    return _checked_run(schedule)[0]


def execution_order(schedule: Schedule) -> tuple[tuple[int, int], ...]:
    """Check the schedule and return every action as (rank, position) in unit-time execution order
    (by step, then rank): an order in which each receive comes after its send and each action after
    the actions before it on its rank."""
    return _checked_run(schedule)[1]


def _checked_run(schedule: Schedule) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, int], ...]]:
    where = _index_and_validate(schedule)
    _check_completeness(schedule, where)
    wait = _check_local_order_and_messages(schedule, where)
    steps, order = _run_unit_time(schedule, wait)
    _check_stage_order(schedule, where, steps)
    return steps, order


def _ctx(schedule: Schedule) -> str:
    return f"schedule {schedule.name!r} (K={schedule.K}, M={schedule.M})"


# Checks index actions by plain int tuples (stage, kind code, mb, slice): hashing those is far
# cheaper than hashing Action objects, and K=64, M=256 schedules hold ~65k actions.
_KINDS = tuple(ActionKind)
_CODE = {k: i for i, k in enumerate(_KINDS)}
_F, _B, _W, _SF, _RF, _SB, _RB, _AR = (_CODE[k] for k in (
    ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B,
    ActionKind.RECV_B, ActionKind.ALLREDUCE))
_Key = tuple[int, int, int, int]


def _name(key: _Key) -> str:
    s, c, m, sl = key
    return str(Action(s, _KINDS[c], m, sl))


def _index_and_validate(schedule: Schedule) -> dict[_Key, tuple[int, int]]:
    K, M, S = schedule.K, schedule.M, schedule.slices
    s2r = schedule.stage_to_rank
    where: dict[_Key, tuple[int, int]] = {}
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if not isinstance(a, Action) or not isinstance(a.kind, ActionKind):
                raise ScheduleError(f"{_ctx(schedule)}: rank {r} position {i} holds {a!r}, not a known action; "
                                    f"valid kinds: {_VALID_KINDS}")
            if a.stage >= K:
                raise ScheduleError(f"{_ctx(schedule)}: rank {r} position {i}: {a} names stage {a.stage}, but "
                                    f"stages are 0..{K - 1}")
            if s2r[a.stage] != r:
                raise ScheduleError(f"{_ctx(schedule)}: {a} is on rank {r}, but stage {a.stage} lives on rank "
                                    f"{s2r[a.stage]}; move it to rank {s2r[a.stage]}'s list")
            if a.mb >= M:
                raise ScheduleError(f"{_ctx(schedule)}: {a} names micro-batch {a.mb}, but M={M} (0..{M - 1})")
            if a.slice >= S:
                raise ScheduleError(f"{_ctx(schedule)}: {a} names token slice {a.slice}, but the schedule has "
                                    f"slices={S}")
            key = (a.stage, _CODE[a.kind], a.mb, a.slice)
            if key in where:
                r0, i0 = where[key]
                raise ScheduleError(f"{_ctx(schedule)}: {a} appears twice (rank {r0} position {i0} and rank {r} "
                                    f"position {i}); each action runs exactly once")
            where[key] = (r, i)
    return where


def _check_completeness(schedule: Schedule, where: dict[_Key, tuple[int, int]]) -> None:
    for s in range(schedule.K):
        for m in range(schedule.M):
            for sl in range(schedule.slices):
                for c in (_F, _B):
                    if (s, c, m, sl) not in where:
                        raise ScheduleError(f"{_ctx(schedule)}: {_name((s, c, m, sl))} is missing; every "
                                            f"(stage, micro-batch) needs exactly one F and one B")
        if (s, _AR, -1, 0) not in where:
            raise ScheduleError(f"{_ctx(schedule)}: {s}ALLREDUCE is missing; each stage needs one, after its "
                                f"last backward")


def _check_local_order_and_messages(schedule: Schedule,
                                    where: dict[_Key, tuple[int, int]]) -> list[list[tuple[int, int] | None]]:
    """Check same-rank orderings and message pairing; return, per action, the (rank, position) of the
    send a receive waits for (None for every other action)."""
    K = schedule.K
    s2r = schedule.stage_to_rank

    def before(first: _Key, then: _Key, why: str) -> None:
        (r1, i1), (r2, i2) = where[first], where[then]
        assert r1 == r2, (first, then)
        if i1 > i2:
            raise ScheduleError(f"{_ctx(schedule)}: rank {r1} runs {_name(then)} (position {i2}) before "
                                f"{_name(first)} (position {i1}); {why} — put {_name(first)} first")

    def missing(have: _Key, need: _Key, hint: str) -> ScheduleError:
        return ScheduleError(f"{_ctx(schedule)}: {_name(have)} on rank {s2r[have[0]]} has no matching "
                             f"{_name(need)} on rank {s2r[need[0]]}; {hint}")

    last_grad = [-1] * K  # per stage: latest list position of a B or W
    wait: list[list[tuple[int, int] | None]] = [[None] * len(acts) for acts in schedule.actions]
    for key, (r, i) in where.items():
        s, c, m, sl = key
        if c == _B:
            before((s, _F, m, sl), key, "a backward needs its forward's saved activations")
            last_grad[s] = max(last_grad[s], i)
        elif c == _W:
            before((s, _B, m, sl), key, "a weight gradient (W) follows its backward (B)")
            last_grad[s] = max(last_grad[s], i)
        elif c == _F:
            if s > 0 and s2r[s - 1] == r:
                before((s - 1, _F, m, sl), key, f"stage {s - 1} on the same rank produces this forward's input")
            elif s > 0 and (s, _RF, m, sl) not in where:
                raise ScheduleError(f"{_ctx(schedule)}: {_name(key)} on rank {r} needs data from stage {s - 1} on "
                                    f"rank {s2r[s - 1]} but there is no {_name((s, _RF, m, sl))}; add it before "
                                    f"{_name(key)}")
        if c == _B and s < K - 1:
            if s2r[s + 1] == r:
                before((s + 1, _B, m, sl), key, f"stage {s + 1} on the same rank produces this backward's input")
            elif (s, _RB, m, sl) not in where:
                raise ScheduleError(f"{_ctx(schedule)}: {_name(key)} on rank {r} needs data from stage {s + 1} on "
                                    f"rank {s2r[s + 1]} but there is no {_name((s, _RB, m, sl))}; add it before "
                                    f"{_name(key)}")
        if c in (_SF, _SB, _RF, _RB):
            send = c in (_SF, _SB)
            fwd = c in (_SF, _RF)
            peer = s + (1 if fwd else -1) * (1 if send else -1)
            verb = "sends to" if send else "receives from"
            if not 0 <= peer < K:
                raise ScheduleError(f"{_ctx(schedule)}: {_name(key)} {verb} stage {peer}, which does not exist "
                                    f"(stages 0..{K - 1}); remove it")
            if s2r[peer] == r:
                raise ScheduleError(f"{_ctx(schedule)}: {_name(key)} {verb} stage {peer} on the same rank {r}; "
                                    f"stages on one rank exchange no messages — remove it")
            compute = (s, _F if fwd else _B, m, sl)
            if send:
                before(compute, key, "a send follows the compute that produces its data")
                recv = (peer, _RF if fwd else _RB, m, sl)
                if recv not in where:
                    raise missing(key, recv, f"add it before {_name((peer, _F if fwd else _B, m, sl))}")
            else:
                before(key, compute, "a receive comes before the compute that needs its data")
                snd = (peer, _SF if fwd else _SB, m, sl)
                if snd not in where:
                    raise missing(key, snd, f"add it after {_name((peer, _F if fwd else _B, m, sl))}")
                wait[r][i] = where[snd]
    for s in range(K):
        r, i = where[(s, _AR, -1, 0)]
        if i < last_grad[s]:
            raise ScheduleError(f"{_ctx(schedule)}: rank {r} runs {s}ALLREDUCE (position {i}) before "
                                f"{schedule.actions[r][last_grad[s]]} (position {last_grad[s]}); the all-reduce "
                                f"needs every gradient of its stage — move it after its stage's last backward")
    return wait


def _run_unit_time(schedule: Schedule, wait: list[list[tuple[int, int] | None]]
                   ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, int], ...]]:
    lists = schedule.actions
    order: list[tuple[int, int]] = []
    R = len(lists)
    ptr = [0] * R
    steps = [[-1] * len(acts) for acts in lists]
    remaining = sum(len(acts) for acts in lists)
    t = 0
    while remaining:
        progressed = False
        for r in range(R):
            i = ptr[r]
            if i == len(lists[r]):
                continue
            w = wait[r][i]
            if w is not None:
                ps = steps[w[0]][w[1]]
                if ps < 0 or ps >= t:
                    continue
            steps[r][i] = t
            order.append((r, i))
            ptr[r] = i + 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise ScheduleError(f"{_ctx(schedule)}: deadlock after {t} unit steps — "
                                + "; ".join(_blocked(schedule, wait, ptr, r) for r in range(R)
                                            if ptr[r] < len(lists[r]))
                                + ". Reorder the receives so that each one's send can run first")
        t += 1
    return tuple(tuple(s) for s in steps), tuple(order)


def _blocked(schedule: Schedule, wait: list[list[tuple[int, int] | None]], ptr: list[int], r: int) -> str:
    a = schedule.actions[r][ptr[r]]
    w = wait[r][ptr[r]]
    assert w is not None, "a blocked action is always a receive"
    pr, pi = w
    behind = (f"which is behind {schedule.actions[pr][ptr[pr]]}" if ptr[pr] < len(schedule.actions[pr])
              else "which never runs")
    return f"rank {r} waits at {a} for {schedule.actions[pr][pi]} (rank {pr} position {pi}), {behind}"


def _check_stage_order(schedule: Schedule, where: dict[_Key, tuple[int, int]],
                       steps: tuple[tuple[int, ...], ...]) -> None:
    for s in range(1, schedule.K):
        for m in range(schedule.M):
            for sl in range(schedule.slices):
                for c, first, then in ((_F, s - 1, s), (_B, s, s - 1)):
                    (r1, i1), (r2, i2) = where[(first, c, m, sl)], where[(then, c, m, sl)]
                    if steps[r1][i1] >= steps[r2][i2]:
                        raise ScheduleError(f"{_ctx(schedule)}: {_name((then, c, m, sl))} can run before "
                                            f"{_name((first, c, m, sl))}; "
                                            f"{'forwards follow' if c == _F else 'backwards reverse'} stage order")
