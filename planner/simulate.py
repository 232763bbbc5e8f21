"""Discrete-event simulation of one training iteration of one pipeline, for a schedule given as data.

Legend: K stages, M micro-batches, R ranks (R = K for GPipe, 1F1B and ZB-H1; a rank holds V = K / R
stages in interleaved and looped schedules), f / b / w forward / backward / weight-gradient
seconds of one micro-batch on a stage (w is the part of b that a zero-bubble schedule runs as W).

Model (what the numbers mean):

- Each rank runs its action list in order, one compute action at a time, starting after its
  stages' ``setup_s`` (stage 0 reading or filling the AutoCache for the whole shard: a CACHE event).
  F costs ``forward_s`` (plus ``prefix_s`` on stage 0: the frozen prefix runs just before each
  forward and shows as a PREFIX event), B costs ``backward_s``. Where the schedule also has a W
  for the (stage, micro-batch) (zero-bubble schedules), B is only the input gradient and costs
  ``backward_s - backward_weight_s``, and W costs ``backward_weight_s``.
- Point-to-point messages do not block the sender's compute: a SEND occupies the directed link
  (sending rank → receiving rank) for ``send_forward_s`` / ``send_backward_s`` of the *sending*
  stage, starting when the sender reaches it in its list and the link is free (sends on one link
  go one at a time, in list order; the two directions are independent). A RECV blocks its rank
  until the data has arrived (the end of the matching send). In the timeline the transfer shows
  as SEND_x on the sending rank and RECV_x on the receiving rank, both over the transfer's interval.
- ALLREDUCE of stage s runs on a per-rank data-parallel channel, apart from compute, starting when
  the rank reaches it (after the stage's last backward, where the generators put it) for
  ``allreduce_s``; so one stage's all-reduce overlaps other stages' remaining backwards.
  iteration_s = max(makespan, every all-reduce's end) before the update (next item).
- UPDATE: each rank then steps its optimizer (``optimizer_s``, after both its compute and its
  all-reduce have ended), and every iteration pays ``step_overhead_s`` once (the runtime's fixed
  work per step: clearing gradients, the loss all-reduce over the world, the schedule's set-up).
  iteration_s = max over ranks of (max(compute end, all-reduce end) + optimizer_s) + step_overhead_s.
  Measured on this machine (``bench/calibrate.py``): without these the AdamW step alone, 2-4 % of a
  CPU step of bert-small, was missing from every prediction.
- Memory on stage s: ``peak_bytes(fixed_bytes, activation_bytes_per_mb, p, after_bytes)`` =
  fixed + max(p × per-micro-batch bytes, the after-pipeline transient), where p is the peak number
  of micro-batches in flight (from its F's start to the end of its last gradient action: its W
  where it has one, else its B). Since one rank computes one action at a time, p follows from list
  order alone. ``planner/stage.py`` fills these from the one stage model and uses the same
  ``peak_bytes`` for the partitioner's memory limit.
- Flush-free schedules (PipeDream-2BW: ``Schedule.minibatches`` = N >= 3 mini-batches back to back):
  each stage updates its weights once per mini-batch t. After the stage's last backward of t, the
  gradient's all-reduce (``allreduce_s``) starts on the data-parallel channel; the optimizer step
  that makes weight version t+2 (``optimizer_s``, a compute action) runs just before the stage's
  first receive or forward of mini-batch t+2, once that all-reduce has ended. (The last two
  mini-batches update after the lists, as above.) There is no per-iteration flush, so the
  iteration is the steady state's *period*: with S0[t] the start of stage 0's first forward of
  mini-batch t, period = max((S0[N-1] - S0[N-4]) / 3, every rank's work per mini-batch — Σ over its
  stages of setup + M·(forward + prefix + backward) + optimizer —, every rank's all-reduce seconds
  per mini-batch), since each rank repeats its work and its all-reduces once per period (the
  differences settle after a few mini-batches: ``schedule.TWOBW_WINDOW``); iteration_s =
  period + step_overhead_s, makespan_s = period, allreduce_s = 0 (an all-reduce that is not hidden
  lengthens the period). On K uniform stages with zero
  communication the period is M·(f+b) + optimizer_s against 1F1B's (M+K-1)·(f+b) + optimizer_s
  (``two_bw_closed_form``); a phase pays 1F1B's fill and drain once, not per mini-batch. Busy
  seconds and the bubble are per mini-batch of the window.
- Token slices (TeraPipe: ``Schedule.slices`` = S > 1, the ``terapipe`` schedule): each (stage, slice)
  has its own compute time (``SliceCosts``: a slice after c earlier tokens attends to c + s keys, so
  it costs more than its share); each slice's message pays the link's latency (``send_*_latency_s``) and
  carries the slice's share of the micro-batch's bytes (α + β·bytes·s/L); the frozen
  prefix runs once per micro-batch before its first slice. On K uniform stages with backward ∝ forward
  and no communication the iteration is TeraPipe's M·Σ t + (K−1)·max t. A micro-batch counts as in
  flight from its first slice's forward to its last slice's backward.
- Memory on rank r (``rank_peak_memory_bytes``): its stages' fixed bytes summed, plus the larger of
  (a) the most activation bytes its stages hold at once — at each point of its list, Σ over its
  stages of (micro-batches in flight × that stage's per-micro-batch bytes), the maximum over the
  list — and (b) its stages' after-pipeline transients summed (the executor all-reduces and steps
  after the whole schedule, when every stage of the rank has drained). With one stage per rank this
  is the stage's number.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from .errors import PtplanError
from .plan import TimelineEvent
from .schedule import Action, ActionKind, Schedule, ScheduleError, check_schedule, is_generated


_SECONDS_FIELDS = ("forward_s", "backward_s", "backward_weight_s", "prefix_s", "setup_s", "send_forward_s",
                   "send_backward_s", "allreduce_s", "optimizer_s", "send_forward_latency_s",
                   "send_backward_latency_s", "tp_comm_s", "tp_comm_latency_s", "overhead_s")
_BYTES_FIELDS = ("fixed_bytes", "activation_bytes_per_mb", "after_bytes")


@dataclass(frozen=True, kw_only=True)
class StageCost:
    """Costs of one pipeline stage for one micro-batch (seconds) and its memory (bytes)."""

    forward_s: float
    """One micro-batch forward on this stage (active layers)."""
    backward_s: float
    """One micro-batch backward on this stage (input and weight gradients)."""
    backward_weight_s: float = 0.0
    """The weight-gradient part of ``backward_s``: what a W action costs in a zero-bubble schedule (its
    B then costs the rest). Ignored by schedules without W."""
    prefix_s: float = 0.0
    """Stage 0 only: frozen-prefix no-grad forward per micro-batch, run before each F."""
    setup_s: float = 0.0
    """Once per iteration before the stage's first action (stage 0 with the AutoCache: reading or
    filling the cached prefix outputs of the whole shard)."""
    send_forward_s: float = 0.0
    """Time to send one micro-batch's output activation to the next stage."""
    send_backward_s: float = 0.0
    """Time to send one micro-batch's input gradient to the previous stage."""
    allreduce_s: float = 0.0
    """Data-parallel gradient all-reduce of this stage's trainable parameters (0 when D == 1)."""
    optimizer_s: float = 0.0
    """The optimizer step over this stage's trainable parameters, after its all-reduce."""
    fixed_bytes: int = 0
    """Held for the whole iteration: weights, gradients, optimizer state, receive buffers (and the
    frozen prefix's weights or the cached shard on stage 0)."""
    activation_bytes_per_mb: int = 0
    """Held per micro-batch in flight, from its F's start until its B ends: saved activations and
    the stage's output."""
    after_bytes: int = 0
    """The largest transient after the pipeline drained (all-reduce buffer, optimizer temporaries)."""
    # ---- what the totals above contain, for pricing token slices (each slice is its own message and action) ----
    send_forward_latency_s: float = 0.0
    """The per-message latency (α) inside ``send_forward_s`` (= α + bytes / bandwidth)."""
    send_backward_latency_s: float = 0.0
    """The per-message latency inside ``send_backward_s``."""
    tp_comm_s: float = 0.0
    """Tensor-parallel all-reduce seconds inside ``forward_s`` (and as many inside ``backward_s``)."""
    tp_comm_latency_s: float = 0.0
    """Their latencies (one α per all-reduce): what every token slice pays again."""
    overhead_s: float = 0.0
    """The per-action framework overhead inside ``forward_s`` and inside ``backward_s``."""

    def __post_init__(self) -> None:
        # plain floats and ints (what ``stage.StageModel.stage_costs`` gives, thousands of times per plan) are
        # checked without the numbers ABCs; anything else (numpy scalars, bools) takes the general path
        for name in _SECONDS_FIELDS:
            v = getattr(self, name)
            if type(v) is float:
                if not 0.0 <= v < math.inf:  # also rejects nan
                    raise PtplanError(f"StageCost.{name} must be a finite number of seconds >= 0, got {v!r}")
                continue
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise PtplanError(f"StageCost.{name} must be a finite number of seconds >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))  # numpy scalars become plain floats
        for name in _BYTES_FIELDS:
            v = getattr(self, name)
            if type(v) is int:
                if v < 0:
                    raise PtplanError(f"StageCost.{name} must be an integer number of bytes >= 0, got {v!r}")
                continue
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:
                raise PtplanError(f"StageCost.{name} must be an integer number of bytes >= 0, got {v!r}")
            object.__setattr__(self, name, int(v))
        for part, whole in (("send_forward_latency_s", "send_forward_s"), ("send_backward_latency_s", "send_backward_s"),
                            ("tp_comm_latency_s", "tp_comm_s")):
            if getattr(self, part) > getattr(self, whole) * (1 + 1e-9) + 1e-12:
                raise PtplanError(f"StageCost.{part}={getattr(self, part)} exceeds {whole}={getattr(self, whole)}; "
                                  f"it is a part of it")
        if self.backward_weight_s > self.backward_s * (1 + 1e-6) + 1e-9:
            raise PtplanError(f"StageCost.backward_weight_s={self.backward_weight_s} exceeds backward_s="
                              f"{self.backward_s}; it is the weight-gradient part of the backward")


@dataclass(frozen=True, kw_only=True)
class SimResult:
    iteration_s: float
    """Seconds for the iteration, the exposed all-reduce included."""
    bubble_fraction: float
    """1 - Σ busy compute / (R · makespan): the ranks' idle share before the all-reduce tail."""
    allreduce_s: float
    """Exposed all-reduce: how far the last all-reduce ends after the makespan."""
    makespan_s: float
    """The pipeline part (every compute and receive done), before the all-reduce tail."""
    stage_busy_s: tuple[float, ...]
    """Per stage: compute seconds (forwards, prefix and backwards)."""
    stage_peak_memory_bytes: tuple[int, ...]
    peak_inflight: tuple[int, ...]
    """Per stage: most micro-batches whose activations are held at once."""
    events: tuple[TimelineEvent, ...] = ()
    """The timeline, when ``simulate(..., events=True)``; sorted by (start, rank)."""
    update_s: float = 0.0
    """After the pipeline and the exposed all-reduce: the optimizer step (slowest rank) and the
    per-step overhead; iteration_s = makespan_s + allreduce_s + update_s."""
    rank_peak_memory_bytes: tuple[int, ...] = ()
    """Per rank: peak memory of all its stages together (the module docstring's rank rule); equal to
    ``stage_peak_memory_bytes`` when every rank holds one stage."""


def peak_bytes(fixed, per_mb, inflight, after):
    """A stage's peak memory: what it always holds plus the larger of its in-flight activations and
    its after-pipeline transient. Works on numbers and on numpy arrays (the partitioner's bands)."""
    return fixed + np.maximum(inflight * per_mb, after)


class ClosedForm(NamedTuple):
    makespan_s: float
    bubble_fraction: float


def gpipe_closed_form(K: int, M: int, f: float, b: float) -> ClosedForm:
    """GPipe on K uniform stages, zero communication: (M+K-1)(f+b), bubble (K-1)/(M+K-1)."""
    return ClosedForm((M + K - 1) * (f + b), (K - 1) / (M + K - 1))


def one_f_one_b_closed_form(K: int, M: int, f: float, b: float) -> ClosedForm:
    """1F1B on K uniform stages, zero communication, M >= K: the same makespan and bubble as GPipe
    (1F1B saves activation memory, not time)."""
    if M < K:
        raise ScheduleError(f"1F1B needs M >= K, got M={M} < K={K}")
    return gpipe_closed_form(K, M, f, b)


def interleaved_1f1b_closed_form(K: int, M: int, V: int, f: float, b: float) -> ClosedForm:
    """Interleaved 1F1B on K ranks of V uniform chunks each (a chunk: f/V forward, b/V backward; f and b
    are one micro-batch's forward and backward on a whole rank), zero communication, M a multiple
    of K: (V·M + K-1)·(f+b)/V, bubble (K-1)/(V·M + K-1) — 1F1B's warm-up and drain shrink by V.
    Looped BFS has the same on M >= K."""
    if M % K:
        raise ScheduleError(f"interleaved 1F1B needs M a multiple of K, got M={M}, K={K}")
    return ClosedForm((V * M + K - 1) * (f + b) / V, (K - 1) / (V * M + K - 1))


def two_bw_closed_form(K: int, M: int, f: float, b: float, optimizer_s: float = 0.0) -> ClosedForm:
    """PipeDream-2BW's steady state on K uniform stages, zero communication, M >= K: each stage's period
    is its own work, M·(f+b) + optimizer_s per mini-batch, and no rank idles — no bubble (1F1B pays
    (K-1)·(f+b) of fill and drain in every iteration; 2BW once per phase). ``bubble_fraction`` counts
    the optimizer step as work."""
    if M < K:
        raise ScheduleError(f"2BW needs M >= K, got M={M} < K={K}")
    return ClosedForm(M * (f + b) + optimizer_s, 0.0)


def zb_h1_closed_form(K: int, M: int, f: float, b: float, w: float) -> ClosedForm:
    """ZB-H1 on K uniform stages, zero communication, M >= K; ``b`` is the whole backward and ``w`` its
    weight-gradient part (StageCost's terms), so B takes b - w and W takes w. Each rank works
    M·(f+b) and waits (K-1)·max(f + (b-w) - w, f, b-w): the paper's bubble (p-1)(T_F + T_B - T_W)
    (Qi et al. 2024, Section 3.1, with T_B = b - w and T_W = w) wherever T_W <= min(T_F, T_B) —
    a third of 1F1B's (p-1)(T_F + T_B + T_W) at T_F = T_B = T_W; where W is longer, the warm-up's
    wait for the first forward or backward to cross the pipeline is what remains."""
    if M < K:
        raise ScheduleError(f"ZB-H1 needs M >= K, got M={M} < K={K}")
    bi = b - w
    idle = (K - 1) * max(f + bi - w, f, bi)
    work = M * (f + b)
    return ClosedForm(work + idle, idle / (work + idle) if work + idle > 0 else 0.0)


# ---- compiled program ---------------------------------------------------------------------
_COMPUTE, _SEND, _RECV, _ALLREDUCE, _UPDATE = range(5)
# duration slots per stage in the per-call table: F (+prefix), B (full), B (input gradient only:
# backward - weight part), W, SEND_F, SEND_B, ALLREDUCE, UPDATE (optimizer step; flush-free schedules)
_NSLOT = 8
_F, _B, _W, _AR = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.ALLREDUCE


@dataclass(frozen=True)
class _Program:
    """A schedule flattened, in a dependency-respecting order, to parallel integer tuples."""

    op: tuple[int, ...]
    rank: tuple[int, ...]
    slot: tuple[int, ...]
    """Index into the duration table (stage * _NSLOT + kind slot); -1 for receives."""
    chan: tuple[int, ...]
    """Sends: directed-link id. Receives and others: -1."""
    msg: tuple[int, ...]
    """Sends and receives: message id (shared by a send and its receive). A flush-free schedule's
    per-mini-batch all-reduce and the update that waits for it: the all-reduce's id. Others: -1."""
    actions: tuple[Action, ...]
    """The action at each program position (for events)."""
    num_msgs: int
    num_links: int
    count_f: tuple[int, ...]
    count_b: tuple[int, ...]
    """Per stage: full backwards (no W for the same micro-batch)."""
    count_bi: tuple[int, ...]
    """Per stage: input-gradient backwards (a W follows for the same micro-batch)."""
    count_w: tuple[int, ...]
    peak_inflight: tuple[int, ...]
    rank_stages: tuple[tuple[int, ...], ...]
    """Per rank: the stages it holds, ascending."""
    rank_live: tuple[tuple[tuple[int, ...], ...], ...]
    """Per rank: the in-flight counts of its stages (in ``rank_stages`` order) at the points of its
    list where the activations it holds can peak (just after a forward), only those not dominated
    by another point."""
    num_updates: int = 0
    """Flush-free schedules: per-mini-batch all-reduces inserted (each with an id in ``msg``)."""
    marks: tuple[int, ...] = ()
    """Flush-free schedules: per mini-batch t, the program position of stage 0's first forward of t."""


_PROGRAM_ATTR = "_ptplan_sim_program"


def _compile(schedule: Schedule) -> _Program:
    """Check the schedule (unless a generator made it) and flatten it; cached on the schedule object."""
    cached = schedule.__dict__.get(_PROGRAM_ATTR)
    if cached is not None:
        return cached
    if schedule.slices != 1 and schedule.minibatches != 1:
        raise ScheduleError(f"schedule {schedule.name!r}: token slices with flush-free mini-batches are not modelled")
    if not is_generated(schedule):
        check_schedule(schedule)  # raises ScheduleError on any problem, deadlocks included
    prog = _flatten(schedule)
    object.__setattr__(schedule, _PROGRAM_ATTR, prog)  # a cache beside the fields, not a field
    return prog


class _Flattener:
    """One greedy pass over a schedule's lists: sweep the ranks (alternating direction), each running its
    list until it meets a receive whose send has not run yet; record every action in the order it ran
    (as ``_Program``'s parallel tuples), counting actions and in-flight micro-batches on the way."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        K, R = schedule.K, len(schedule.actions)
        self.split = {(a.stage, a.mb, a.slice) for acts in schedule.actions for a in acts
                      if a.kind is ActionKind.W}
        self.rank_stages = tuple(tuple(s for s in range(K) if schedule.stage_to_rank[s] == r) for r in range(R))
        self.rank_rows: list[set[tuple[int, ...]]] = [set() for _ in range(R)]
        self.links: dict[tuple[int, int], int] = {}
        self.sent: dict[tuple[int, bool, int, int], int] = {}  # (receiving stage, forward?, mb, slice) -> msg id
        self.op: list[int] = []  # the program's parallel columns (``_Program``)
        self.rank: list[int] = []
        self.slot: list[int] = []
        self.chan: list[int] = []
        self.msg: list[int] = []
        self.acts: list[Action] = []
        self.count_f, self.count_b, self.count_bi, self.count_w = [0] * K, [0] * K, [0] * K, [0] * K
        self.live, self.peak = [0] * K, [0] * K
        self.N, self.Mb = schedule.minibatches, schedule.M
        self.S = schedule.slices  # duration slots per (stage, slice): (stage * S + slice) * _NSLOT + kind slot
        self.flush_free = self.N >= 3
        self.grads_done: dict[tuple[int, int], int] = {}  # (stage, mini-batch) -> micro-batches done
        self.ar_id: dict[tuple[int, int], int] = {}  # (stage, mini-batch) -> its all-reduce's id
        self.updated: set[tuple[int, int]] = set()  # (stage, mini-batch t) whose update is placed
        self.marks = [-1] * self.N if self.flush_free else []

    def run(self) -> _Program:
        lists = self.schedule.actions
        R = len(lists)
        ptr = [0] * R
        remaining = sum(map(len, lists))
        sweep = 0
        RF, RB, F, B, W = ActionKind.RECV_F, ActionKind.RECV_B, ActionKind.F, ActionKind.B, ActionKind.W
        flush_free, Mb, split, updated = self.flush_free, self.Mb, self.split, self.updated
        sent, place, links, s2r, S = self.sent, self._place, self.links, self.schedule.stage_to_rank, self.S
        SF, SB = ActionKind.SEND_F, ActionKind.SEND_B
        op, rank, slot, chan, msg, acts = (self.op.append, self.rank.append, self.slot.append, self.chan.append,
                                           self.msg.append, self.acts.append)
        while remaining:
            progressed = False
            for r in (range(R) if sweep % 2 == 0 else range(R - 1, -1, -1)):
                lst = lists[r]  # run rank r's list until it blocks or ends
                i0 = i = ptr[r]
                n = len(lst)
                while i < n:
                    a = lst[i]
                    k = a.kind
                    s = a.stage
                    if flush_free and (k is F or k is RF) and a.mb % Mb == 0 and a.mb // Mb >= 2 \
                            and (s, a.mb // Mb) not in updated:
                        # before mini-batch t's first receive or forward: the update that makes version t
                        t = a.mb // Mb
                        updated.add((s, t))
                        self._emit(_UPDATE, s * self.S * _NSLOT + 7, -1, self.ar_id[(s, t - 2)], r, a)
                    if k is RF or k is RB:
                        mid = sent.get((s, k is RF, a.mb, a.slice))
                        if mid is None:
                            break  # blocked: its send has not run yet
                        op(_RECV)
                        slot(-1)
                        chan(-1)
                    elif k is SF or k is SB:  # inline (as common as the computes): link and message ids
                        fwd = k is SF
                        dst = s + 1 if fwd else s - 1
                        op(_SEND)
                        slot((s * S + a.slice) * _NSLOT + (4 if fwd else 5))
                        chan(links.setdefault((r, s2r[dst]), len(links)))
                        mid = sent[(dst, fwd, a.mb, a.slice)] = len(sent)
                    else:
                        o, sl, mid, c = place(r, a)
                        op(o)
                        slot(sl)
                        chan(c)
                    msg(mid)
                    rank(r)
                    acts(a)
                    i += 1
                    if flush_free and (k is W or (k is B and (s, a.mb, a.slice) not in split)):
                        self._gradient_done(r, s, a.mb // Mb)
                if i != i0:
                    ptr[r] = i
                    remaining -= i - i0
                    progressed = True
            if not progressed:  # pragma: no cover - check_schedule finds deadlocks first
                raise ScheduleError(f"schedule {self.schedule.name!r} deadlocks; run check_schedule for details")
            sweep += 1
        return self._program()

    def _emit(self, o: int, sl: int, c: int, mid: int, r: int, a: Action) -> None:
        self.op.append(o)
        self.slot.append(sl)
        self.chan.append(c)
        self.msg.append(mid)
        self.rank.append(r)
        self.acts.append(a)

    def _place(self, r: int, a: Action) -> tuple[int, int, int, int]:
        """A compute or all-reduce action (``run`` places receives and sends): its (op, duration slot, message,
        link); counts it and the activations in flight."""
        k, s = a.kind, a.stage
        c = mid = -1
        base = (s * self.S + a.slice) * _NSLOT
        if k is _F:
            o, sl = _COMPUTE, base
            self.count_f[s] += 1
            live = self.live
            live[s] += 1
            if live[s] > self.peak[s]:
                self.peak[s] = live[s]
            self.rank_rows[r].add(tuple([live[x] for x in self.rank_stages[r]]))
        elif k is _B:
            if (s, a.mb, a.slice) in self.split:  # input gradient only; the W releases the activations
                o, sl = _COMPUTE, base + 2
                self.count_bi[s] += 1
            else:
                o, sl = _COMPUTE, base + 1
                self.count_b[s] += 1
                self.live[s] -= 1
        elif k is _W:
            o, sl = _COMPUTE, base + 3
            self.count_w[s] += 1
            self.live[s] -= 1
        elif k is _AR:
            o, sl = _ALLREDUCE, s * self.S * _NSLOT + 6
        else:  # pragma: no cover - every kind is handled above (Action rejects others)
            raise ScheduleError(f"the simulator cannot run {a}")
        if self.flush_free and k is _F and s == 0 and a.mb % self.Mb == 0:
            self.marks[a.mb // self.Mb] = len(self.op)
        return o, sl, mid, c

    def _gradient_done(self, r: int, s: int, t: int) -> None:
        """Flush-free: one more micro-batch of mini-batch t has its gradient on stage s; after the last,
        the mini-batch's all-reduce (none for the last mini-batch: it updates after the lists)."""
        n_done = self.grads_done[(s, t)] = self.grads_done.get((s, t), 0) + 1
        if n_done == self.Mb * self.S and t < self.N - 1:
            self.ar_id[(s, t)] = len(self.ar_id)
            self._emit(_ALLREDUCE, s * self.S * _NSLOT + 6, -1, self.ar_id[(s, t)], r, _act_allreduce(s))

    def _program(self) -> _Program:
        S, peak, rank_rows = self.S, self.peak, self.rank_rows
        if S > 1:  # in flight in whole micro-batches: a micro-batch's slices are held until its last backward
            peak = [-(-p // S) for p in peak]
            rank_rows = [{tuple(-(-x // S) for x in row) for row in rows} for rows in rank_rows]
        return _Program(op=tuple(self.op), rank=tuple(self.rank), slot=tuple(self.slot), chan=tuple(self.chan),
                        msg=tuple(self.msg), actions=tuple(self.acts), num_msgs=len(self.sent),
                        num_links=len(self.links), count_f=tuple(self.count_f), count_b=tuple(self.count_b),
                        count_bi=tuple(self.count_bi), count_w=tuple(self.count_w), peak_inflight=tuple(peak),
                        rank_stages=self.rank_stages,
                        rank_live=tuple(_undominated(rows) for rows in rank_rows),
                        num_updates=len(self.ar_id), marks=tuple(self.marks))


def _flatten(schedule: Schedule) -> _Program:
    """Flatten a schedule to a ``_Program`` (``_Flattener``)."""
    return _Flattener(schedule).run()


def _act_allreduce(stage: int) -> Action:
    return Action(stage, ActionKind.ALLREDUCE, -1)


def _undominated(rows: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The rows no other row beats or equals in every entry (the only candidates for a maximum of a
    weighted sum with weights >= 0), sorted."""
    out = sorted(rows, key=lambda x: (-sum(x), x))
    keep: list[tuple[int, ...]] = []
    for x in out:
        if not any(all(a >= b for a, b in zip(y, x)) for y in keep):
            keep.append(x)
    return tuple(sorted(keep))


# ---- simulation ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SliceCosts:
    """Token-sliced schedules (TeraPipe): what each token slice costs on each stage. A slice of s tokens after
    c earlier ones costs more than its share s/L of the micro-batch (its attention spans c + s keys), so
    the compute is given per (stage, slice); messages carry the slice's share of the micro-batch's
    activation (``send_*_s`` × s/L); the frozen prefix (``prefix_s``) runs unsliced, once per
    micro-batch, before its first slice."""

    tokens: tuple[int, ...]
    """Slice lengths, in order (L = their sum)."""
    forward_s: tuple[tuple[float, ...], ...]
    """forward_s[stage][slice]."""
    backward_s: tuple[tuple[float, ...], ...]
    """backward_s[stage][slice]."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "forward_s", tuple(tuple(float(x) for x in row) for row in self.forward_s))
        object.__setattr__(self, "backward_s", tuple(tuple(float(x) for x in row) for row in self.backward_s))
        if not self.tokens or min(self.tokens) < 1:
            raise PtplanError(f"SliceCosts.tokens must be slice lengths >= 1, got {list(self.tokens)}")
        for name in ("forward_s", "backward_s"):
            rows = getattr(self, name)
            if any(len(r) != len(self.tokens) for r in rows) or any(not math.isfinite(x) or x < 0 for r in rows
                                                                    for x in r):
                raise PtplanError(f"SliceCosts.{name} needs one finite time >= 0 per stage and slice "
                                  f"({len(self.tokens)} slices)")


def _check_inputs(schedule: Schedule, costs: Sequence[StageCost], step_overhead_s: float) -> None:
    K = schedule.K
    if len(costs) != K:
        raise PtplanError(f"simulate: {len(costs)} stage costs for a schedule with K={K} stages; give one "
                          f"StageCost per stage")
    for s, c in enumerate(costs):
        if s > 0 and (c.prefix_s > 0 or c.setup_s > 0):
            raise PtplanError(f"simulate: stage {s} has prefix_s={c.prefix_s}, setup_s={c.setup_s}, but only "
                              f"stage 0 runs or reads the frozen prefix; put its cost on stage 0")
    if not isinstance(step_overhead_s, numbers.Real) or not math.isfinite(step_overhead_s) or step_overhead_s < 0:
        raise PtplanError(f"simulate: step_overhead_s must be a finite number of seconds >= 0, got {step_overhead_s!r}")


def _durations(schedule: Schedule, costs: Sequence[StageCost], slice_costs: SliceCosts | None) -> list[float]:
    """The per-call duration table: _NSLOT seconds per (stage, slice), indexed by ``_Program.slot``."""
    dur: list[float] = []
    K, S = schedule.K, schedule.slices
    if S == 1 and slice_costs is None:
        for c in costs:
            w = min(c.backward_weight_s, c.backward_s)
            dur += (c.forward_s + c.prefix_s, c.backward_s, c.backward_s - w, w, c.send_forward_s, c.send_backward_s,
                    c.allreduce_s, c.optimizer_s)
        return dur
    if slice_costs is None or len(slice_costs.tokens) != S or len(slice_costs.forward_s) != K \
            or len(slice_costs.backward_s) != K:
        raise ScheduleError(f"simulate: schedule {schedule.name!r} has {S} token slices on {K} stages; give "
                            f"slice_costs with {S} slices and one row per stage")
    total = sum(slice_costs.tokens)
    for s, c in enumerate(costs):
        share = c.backward_weight_s / c.backward_s if c.backward_s > 0 else 0.0
        for j, n in enumerate(slice_costs.tokens):
            f, b = slice_costs.forward_s[s][j], slice_costs.backward_s[s][j]
            af, ab = c.send_forward_latency_s, c.send_backward_latency_s  # α per message, β per byte
            dur += (f + (c.prefix_s if j == 0 else 0.0), b, b * (1 - share), b * share,
                    af + (c.send_forward_s - af) * n / total, ab + (c.send_backward_s - ab) * n / total,
                    c.allreduce_s, c.optimizer_s)
    return dur


class _Clocks(NamedTuple):
    compute: list[float]
    """Per rank: when its compute ends (T)."""
    channel: list[float]
    """Per rank: when its all-reduce channel is free (D)."""
    start: list[float]
    """Per program position: when the action started."""


def _run_program(prog: _Program, dur: list[float], setup: list[float]) -> _Clocks:
    """The event loop: run the flattened program with the duration table; ``setup`` = each rank's start."""
    T = list(setup)                # each rank's compute clock
    D = [0.0] * len(T)             # each rank's all-reduce channel: free from
    L = [0.0] * prog.num_links     # each directed link: free from
    A = [0.0] * prog.num_msgs      # each message: arrival time
    U = [0.0] * prog.num_updates   # flush-free schedules: each per-mini-batch all-reduce's end
    start = [0.0] * len(prog.op)
    i = 0  # op codes as literals in the hot loop: 0 _COMPUTE, 1 _SEND, 2 _RECV, 3 _ALLREDUCE, 4 _UPDATE
    for o, r, d, ch, mg in zip(prog.op, prog.rank, prog.slot, prog.chan, prog.msg):
        if o == 0:  # compute
            t = T[r]
            start[i] = t
            T[r] = t + dur[d]
        elif o == 1:  # send: wait for the link, not for the receiver
            t = T[r]
            lf = L[ch]
            if lf > t:
                t = lf
            start[i] = t
            e = t + dur[d]
            L[ch] = e
            A[mg] = e
        elif o == 2:  # receive: block until the data has arrived
            a = A[mg]
            if a > T[r]:
                T[r] = a
        elif o == 3:  # all-reduce, on its own channel
            t = T[r]
            df = D[r]
            if df > t:
                t = df
            start[i] = t
            D[r] = t + dur[d]
            if mg >= 0:
                U[mg] = D[r]
        else:  # update (flush-free): the optimizer step, once its all-reduce has ended
            t = T[r]
            if U[mg] > t:
                t = U[mg]
            start[i] = t
            T[r] = t + dur[d]
        i += 1
    return _Clocks(T, D, start)


def _busy(prog: _Program, costs: Sequence[StageCost], dur: list[float], S: int) -> tuple[float, ...]:
    """Per stage: compute seconds (setup, forwards with the prefix, backwards, W)."""
    if S == 1:
        return tuple(costs[s].setup_s + prog.count_f[s] * dur[s * _NSLOT] + prog.count_b[s] * dur[s * _NSLOT + 1]
                     + prog.count_bi[s] * dur[s * _NSLOT + 2] + prog.count_w[s] * dur[s * _NSLOT + 3]
                     for s in range(len(costs)))
    acc = [c.setup_s for c in costs]
    for o, d, a in zip(prog.op, prog.slot, prog.actions):
        if o == _COMPUTE:
            acc[a.stage] += dur[d]
    return tuple(acc)


def _stage_memory(prog: _Program, costs: Sequence[StageCost]) -> tuple[int, ...]:
    return tuple(int(peak_bytes(c.fixed_bytes, c.activation_bytes_per_mb, p, c.after_bytes))
                 for c, p in zip(costs, prog.peak_inflight))


def _flush_free_result(schedule: Schedule, prog: _Program, costs: Sequence[StageCost], dur: list[float],
                       clocks: _Clocks, busy: tuple[float, ...], opt: list[float], step_overhead_s: float,
                       events: bool) -> SimResult:
    """A flush-free schedule's result: the steady state's period (module docstring)."""
    N, R, s2r = schedule.minibatches, schedule.num_ranks, schedule.stage_to_rank
    busy = tuple(costs[s].setup_s + (x - costs[s].setup_s) / N for s, x in enumerate(busy))
    work = [0.0] * R
    channel = [0.0] * R
    for s, c in enumerate(costs):
        work[s2r[s]] += busy[s] + c.optimizer_s
        channel[s2r[s]] += c.allreduce_s
    back = min(3, N - 2)  # mini-batches 0 and 1 are the fill; mean over the last three differences
    start = clocks.start
    slope = (start[prog.marks[-1]] - start[prog.marks[-1 - back]]) / back
    period = max(slope, max(work), max(channel))
    T, D = clocks.compute, clocks.channel
    return SimResult(iteration_s=period + step_overhead_s,
                     bubble_fraction=1.0 - sum(work) / (R * period) if period > 0 else 0.0,
                     allreduce_s=0.0, makespan_s=period, stage_busy_s=busy,
                     stage_peak_memory_bytes=_stage_memory(prog, costs),
                     peak_inflight=prog.peak_inflight, update_s=step_overhead_s,
                     rank_peak_memory_bytes=_rank_memory(prog, costs),
                     events=_events(schedule, prog, costs, dur, start, T, D, opt,
                                    max(max(t, d) + o for t, d, o in zip(T, D, opt))) if events else ())


def simulate(schedule: Schedule, costs: Sequence[StageCost], *, events: bool = False,
             step_overhead_s: float = 0.0, slice_costs: SliceCosts | None = None) -> SimResult:
    """Simulate one iteration of ``schedule`` with per-stage ``costs`` (see the module docstring).

    ``step_overhead_s``: fixed seconds per iteration added at the end (see UPDATE above).
    ``slice_costs``: for a token-sliced schedule (``schedule.slices`` > 1), each slice's compute per
    stage (``SliceCosts``); ``costs`` then give the rest (messages per micro-batch, prefix, setup,
    all-reduce, optimizer, memory: in-flight micro-batches count a micro-batch from its first slice's
    forward to its last slice's backward, rounded up from slices to whole micro-batches).

    The schedule is checked (``check_schedule``; skipped for the generators' own output, which the
    tests check) and flattened once per schedule object; later calls only run the event loop, and
    ``build_schedule`` returns the same object for the same (name, K, M).
    """
    _check_inputs(schedule, costs, step_overhead_s)
    prog = _compile(schedule)
    dur = _durations(schedule, costs, slice_costs)
    R, s2r = schedule.num_ranks, schedule.stage_to_rank
    setup = [0.0] * R
    opt = [0.0] * R
    for s, c in enumerate(costs):
        setup[s2r[s]] += c.setup_s
        opt[s2r[s]] += c.optimizer_s
    clocks = _run_program(prog, dur, setup)
    T, D = clocks.compute, clocks.channel
    makespan = max(T)
    synced = max(makespan, max(D))
    iteration = max(max(t, d) + o for t, d, o in zip(T, D, opt)) + step_overhead_s
    busy = _busy(prog, costs, dur, schedule.slices)
    if prog.marks:
        return _flush_free_result(schedule, prog, costs, dur, clocks, busy, opt, step_overhead_s, events)
    bubble = 1.0 - sum(busy) / (R * makespan) if makespan > 0 else 0.0
    return SimResult(iteration_s=iteration, bubble_fraction=bubble, allreduce_s=synced - makespan,
                     makespan_s=makespan, stage_busy_s=busy, stage_peak_memory_bytes=_stage_memory(prog, costs),
                     peak_inflight=prog.peak_inflight, update_s=iteration - synced,
                     rank_peak_memory_bytes=_rank_memory(prog, costs),
                     events=_events(schedule, prog, costs, dur, clocks.start, T, D, opt, iteration) if events else ())


class StageTimes(NamedTuple):
    """The seconds of ``StageCost`` for many splits at once: each field an array (N, K), row i one split's stages
    (``stage.stage_times`` makes them; ``iterations`` simulates them)."""

    forward_s: np.ndarray
    backward_s: np.ndarray
    backward_weight_s: np.ndarray
    prefix_s: np.ndarray
    setup_s: np.ndarray
    send_forward_s: np.ndarray
    send_backward_s: np.ndarray
    allreduce_s: np.ndarray
    optimizer_s: np.ndarray
    send_forward_latency_s: np.ndarray
    send_backward_latency_s: np.ndarray
    tp_comm_s: np.ndarray
    tp_comm_latency_s: np.ndarray


def iterations(schedule: Schedule, x: StageTimes, *, step_overhead_s: float = 0.0) -> np.ndarray:
    """``simulate(schedule, costs).iteration_s`` of N splits at once (``x``: their stages' seconds, (N, K)), for a
    schedule without token slices: ``_run_program``'s event loop with a numpy column per clock, and a flush-free
    schedule's period as ``_flush_free_result`` takes it, the same additions and maxima in the same order, so that
    every entry equals the one-split simulation's to the last bit (``tests/test_simulate.py``). One pass of the
    program costs what one simulation does, whatever N is: the search scores every split of a candidate this way
    (``resplit.best_split``)."""
    prog = _compile(schedule)
    if schedule.slices != 1:
        raise PtplanError(f"iterations: schedule {schedule.name!r} has token slices; use simulate")
    N, K = np.shape(x.forward_s)
    if K != schedule.K:
        raise PtplanError(f"iterations: costs of {K} stages for a schedule with K={schedule.K} stages")
    # the table ``_durations`` makes, one column per slot
    cols = path_durations(x)[..., :_NSLOT].reshape(N, K * _NSLOT).T.copy()
    R, s2r = schedule.num_ranks, schedule.stage_to_rank
    zero = np.zeros(N)
    T, opt = [zero] * R, [zero] * R
    for s in range(K):
        T[s2r[s]] = T[s2r[s]] + x.setup_s[:, s]
        opt[s2r[s]] = opt[s2r[s]] + x.optimizer_s[:, s]
    D, L, A, U = [zero] * R, [zero] * prog.num_links, [zero] * prog.num_msgs, [zero] * prog.num_updates
    marks, start = set(prog.marks), {}
    for i, (o, r, d, ch, mg) in enumerate(zip(prog.op, prog.rank, prog.slot, prog.chan, prog.msg)):
        if o == 0:  # compute
            if i in marks:
                start[i] = T[r]
            T[r] = T[r] + cols[d]
        elif o == 1:  # send: wait for the link, not for the receiver
            L[ch] = A[mg] = np.maximum(T[r], L[ch]) + cols[d]
        elif o == 2:  # receive: block until the data has arrived
            T[r] = np.maximum(T[r], A[mg])
            A[mg] = zero  # received once: its column is let go (memory: the messages in flight, not all of them)
        elif o == 3:  # all-reduce, on its own channel
            D[r] = np.maximum(T[r], D[r]) + cols[d]
            if mg >= 0:
                U[mg] = D[r]
        else:  # update (flush-free): the optimizer step, once its all-reduce has ended
            T[r] = np.maximum(T[r], U[mg]) + cols[d]
    if not prog.marks:
        return np.max([np.maximum(t, dd) + op for t, dd, op in zip(T, D, opt)], axis=0) + step_overhead_s
    M = schedule.minibatches  # ``_busy`` (no token slices) and ``_flush_free_result``
    work, channel = [zero] * R, [zero] * R
    for s in range(K):
        busy = x.setup_s[:, s] + prog.count_f[s] * cols[s * _NSLOT] + prog.count_b[s] * cols[s * _NSLOT + 1] \
            + prog.count_bi[s] * cols[s * _NSLOT + 2] + prog.count_w[s] * cols[s * _NSLOT + 3]
        work[s2r[s]] = work[s2r[s]] + (x.setup_s[:, s] + (busy - x.setup_s[:, s]) / M + x.optimizer_s[:, s])
        channel[s2r[s]] = channel[s2r[s]] + x.allreduce_s[:, s]
    back = min(3, M - 2)
    slope = (start[prog.marks[-1]] - start[prog.marks[-1 - back]]) / back
    return np.maximum(np.maximum(slope, np.max(work, axis=0)), np.max(channel, axis=0)) + step_overhead_s


PATH_FIELDS = ("forward", "backward", "backward_input", "backward_weight", "send_forward", "send_backward",
               "allreduce", "optimizer", "setup")
"""What ``critical_path`` counts on each stage: the duration table's eight slots (``_durations``: the forward with
the prefix, a whole backward, a split backward's input and weight parts, the two sends, the all-reduce, the
optimizer step), then the stage's set-up."""


def path_durations(x: StageTimes) -> np.ndarray:
    """(N, K, len(PATH_FIELDS)): each split's stages' seconds in ``critical_path``'s order."""
    w = np.minimum(x.backward_weight_s, x.backward_s)
    return np.stack((x.forward_s + x.prefix_s, x.backward_s, x.backward_s - w, w, x.send_forward_s,
                     x.send_backward_s, x.allreduce_s, x.optimizer_s, x.setup_s), axis=-1)


def _flushed(schedule: Schedule, who: str) -> _Program:
    """The schedule's program, for the chains (``critical_path``, ``rank_paths``): a flush and no token slices."""
    prog = _compile(schedule)
    if schedule.slices != 1 or prog.marks:
        raise PtplanError(f"{who}: schedule {schedule.name!r} has token slices or no flush")
    return prog


def critical_path(schedule: Schedule, x: StageTimes, row: int = 0) -> np.ndarray:
    """The simulated iteration of split ``row`` of ``x`` as a sum of its stages' durations: (K, len(PATH_FIELDS))
    counts C with Σ C · ``path_durations(x)[row]`` + the step overhead = ``iterations``' entry (a flushed
    schedule without token slices). The event loop is max-plus: every clock is the largest of sums of
    durations along chains of actions (a rank's list order, a message after its sender's action and the link's
    previous message, a receive after its message, the all-reduce channel, the update after both); C counts the
    chain that ends the iteration (ties: the first in the loop's order). The same chain exists whatever the
    durations, so for every split Σ C · its durations + the step overhead is at most its simulated iteration:
    a lower bound that is exact at ``row`` (``resplit.best_split``'s ``forms``)."""
    prog = _flushed(schedule, "critical_path")
    K, F = schedule.K, len(PATH_FIELDS)
    d = path_durations(x)[row].reshape(K * F)
    R, s2r = schedule.num_ranks, schedule.stage_to_rank
    none = (0.0, np.zeros(K * F))

    def plus(p: tuple[float, np.ndarray], slot: int) -> tuple[float, np.ndarray]:
        i = slot // _NSLOT * F + slot % _NSLOT  # the program's slot (stage * _NSLOT + kind) in C's layout
        c = p[1].copy()
        c[i] += 1.0
        return p[0] + d[i], c

    def later(p: tuple[float, np.ndarray], q: tuple[float, np.ndarray]) -> tuple[float, np.ndarray]:
        return q if q[0] > p[0] else p
    T = [none] * R
    for s in range(K):
        c = T[s2r[s]][1].copy()
        c[s * F + F - 1] += 1.0
        T[s2r[s]] = (T[s2r[s]][0] + d[s * F + F - 1], c)
    D, L, A = [none] * R, [none] * prog.num_links, [none] * prog.num_msgs
    for o, r, sl, ch, mg in zip(prog.op, prog.rank, prog.slot, prog.chan, prog.msg):
        if o == _COMPUTE:
            T[r] = plus(T[r], sl)
        elif o == _SEND:
            L[ch] = A[mg] = plus(later(T[r], L[ch]), sl)
        elif o == _RECV:
            T[r] = later(T[r], A[mg])
        else:  # all-reduce (a flushed schedule has no update action)
            D[r] = plus(later(T[r], D[r]), sl)
    ends = []
    for r in range(R):
        p = later(T[r], D[r])
        for s in range(K):
            if s2r[s] == r:
                p = plus(p, s * _NSLOT + 7)
        ends.append(p)
    return max(ends, key=lambda p: p[0])[1].reshape(K, F)


PATH_TILT = 0.1
"""How much heavier ``critical_paths`` makes one rank's compute to find the chain through it."""


def critical_paths(schedule: Schedule, x: StageTimes, row: int = 0) -> list[np.ndarray]:
    """``critical_path`` of split ``row``, then, for each rank, of the same durations with that rank's compute (its
    stages' forwards, prefix and backwards) ``PATH_TILT`` heavier: the chain that would end the iteration were that
    rank a little slower (its head and tail through the other ranks as this split has them). Each is a chain of
    the schedule, so a lower bound on every split as ``critical_path``'s is; the distinct ones, the split's own
    first. A split near the best is held by several such chains at once (each rank's work bounds it), which one
    chain alone does not say (``resplit._by_forms``)."""
    out = [critical_path(schedule, x, row)]
    one = StageTimes(*(np.asarray(v)[row:row + 1] for v in x))
    s2r = np.asarray(schedule.stage_to_rank)
    for r in range(schedule.num_ranks):
        k = np.where(s2r == r, 1.0 + PATH_TILT, 1.0)[None, :]
        tilted = one._replace(forward_s=one.forward_s * k, backward_s=one.backward_s * k,
                              backward_weight_s=one.backward_weight_s * k, prefix_s=one.prefix_s * k)
        n = critical_path(schedule, tilted)
        if not any(np.array_equal(n, m) for m in out):
            out.append(n)
    return out


def rank_paths(schedule: Schedule) -> np.ndarray:
    """(R, K, len(PATH_FIELDS)) counts (as ``critical_path``'s) of each rank's own chain: its stages' set-up, every
    compute action of its list one after another, the all-reduces its list runs after its last compute action
    (one after another on its channel), and its optimizer step. Every rank's is at most the simulated iteration,
    whatever the durations (a flushed schedule without token slices)."""
    prog = _flushed(schedule, "rank_paths")
    K, F, R = schedule.K, len(PATH_FIELDS), schedule.num_ranks
    out = np.zeros((R, K, F))
    last = {r: i for i, (o, r) in enumerate(zip(prog.op, prog.rank)) if o == _COMPUTE}
    for i, (o, r, sl) in enumerate(zip(prog.op, prog.rank, prog.slot)):
        if o == _COMPUTE or (o == _ALLREDUCE and i > last.get(r, -1)):
            out[r, sl // _NSLOT, sl % _NSLOT] += 1.0
    for s, r in enumerate(schedule.stage_to_rank):
        out[r, s, F - 1] += 1.0
        out[r, s, 7] += 1.0
    return out


def _rank_memory(prog: _Program, costs: Sequence[StageCost]) -> tuple[int, ...]:
    """Per rank: the module docstring's rank rule."""
    rank_memory = []
    for stages, rows in zip(prog.rank_stages, prog.rank_live):
        per_mb = [costs[s].activation_bytes_per_mb for s in stages]
        held = max((sum(n * b for n, b in zip(row, per_mb)) for row in rows), default=0)
        rank_memory.append(int(peak_bytes(sum(costs[s].fixed_bytes for s in stages), 1, held,
                                          sum(costs[s].after_bytes for s in stages))))
    return tuple(rank_memory)


_COMM_EVENT = {ActionKind.SEND_F: ("SEND_F", "RECV_F"), ActionKind.SEND_B: ("SEND_B", "RECV_B")}


def _events(schedule: Schedule, prog: _Program, costs: Sequence[StageCost], dur: list[float],
            start: list[float], T: list[float], D: list[float], opt: list[float], iteration: float
            ) -> tuple[TimelineEvent, ...]:
    s2r = schedule.stage_to_rank
    out: list[TimelineEvent] = []
    for r in range(len(T)):  # the optimizer step after compute and all-reduce, then the step's fixed overhead
        t0 = max(T[r], D[r])
        if iteration > t0:
            out.append(TimelineEvent(rank=r, stage=schedule.stage_to_rank.index(r), kind="UPDATE", mb=-1,
                                     start=t0, end=min(t0 + opt[r], iteration) if opt[r] > 0 else t0))
    out = [e for e in out if e.end > e.start]
    for s, c in enumerate(costs):
        if c.setup_s > 0:
            out.append(TimelineEvent(rank=s2r[s], stage=s, kind="CACHE", mb=-1, start=0.0, end=c.setup_s))
    for i, (o, r, a) in enumerate(zip(prog.op, prog.rank, prog.actions)):
        if o == _RECV:
            continue  # drawn from its send, on the receiving rank
        if o == _UPDATE:  # a flush-free schedule's optimizer step between mini-batches
            if dur[prog.slot[i]] > 0:
                out.append(TimelineEvent(rank=r, stage=a.stage, kind="UPDATE", mb=-1, start=start[i],
                                         end=start[i] + dur[prog.slot[i]]))
            continue
        t = start[i]
        d = dur[prog.slot[i]]
        if o == _COMPUTE:
            p = costs[a.stage].prefix_s if a.kind is ActionKind.F and a.slice == 0 else 0.0
            if p > 0:
                out.append(TimelineEvent(rank=r, stage=a.stage, kind="PREFIX", mb=a.mb, start=t, end=t + p))
            out.append(TimelineEvent(rank=r, stage=a.stage, kind=a.kind.value, mb=a.mb, start=t + p, end=t + d))
        elif d > 0 and o == _SEND:
            send_kind, recv_kind = _COMM_EVENT[a.kind]
            dst = a.stage + 1 if a.kind is ActionKind.SEND_F else a.stage - 1
            out.append(TimelineEvent(rank=r, stage=a.stage, kind=send_kind, mb=a.mb, start=t, end=t + d))
            out.append(TimelineEvent(rank=s2r[dst], stage=dst, kind=recv_kind, mb=a.mb, start=t, end=t + d))
        elif d > 0 and o == _ALLREDUCE:
            out.append(TimelineEvent(rank=r, stage=a.stage, kind="ALLREDUCE", mb=-1, start=t, end=t + d))
    out.sort(key=lambda e: (e.start, e.rank))
    return tuple(out)
