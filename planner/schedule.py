"""Pipeline schedules as data: typed actions per rank, their generators (GPipe, 1F1B, interleaved 1F1B,
looped BFS, ZB-H1, ZB-V, PipeDream-2BW, TeraPipe's token slices), and their checks.

Legend: K pipeline stages, M micro-batches per iteration, R ranks (R = K when each rank holds one
stage). The generators take K as the number of *ranks* and V chunks per rank, and return a
Schedule with K·V stages (``Schedule.K``) on K ranks (``Schedule.num_ranks``).

An action prints like torch.distributed.pipelining's IR: ``2F0`` is stage 2's forward of
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
from typing import Sequence

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
    t = text.strip()
    m = _ACTION_RE.fullmatch(t) if t.isascii() else None  # \d alone would take any script's digits
    if m is None:
        stage = t[:len(t) - len(t.lstrip("0123456789"))]
        why = ("it is empty" if not t else "it holds spaces: one action per token" if len(t.split()) > 1 else
               "it is not plain ASCII" if not t.isascii() else "it does not start with a stage number" if not stage
               else f"{t[len(stage):]!r} after stage {stage} is not a kind with its micro-batch")
        raise ScheduleError(f"cannot parse action {text!r}: {why}; an action is [stage][kind][micro-batch][.slice], "
                            f"e.g. 2F0, 1SEND_F3, 0ALLREDUCE, 2F0.1; kinds: {_VALID_KINDS}")
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

    Interleaved, looped and V placements give a rank several stages via ``stage_to_rank`` (K > R)
    and mix their actions in one list; zero-bubble schedules add one W per (stage, micro-batch)
    after its B (the B is then only the input gradient). TeraPipe (``terapipe``) sets ``slices``
    > 1 and gives every compute and message action its token ``slice``. PipeDream-2BW (no flush
    between mini-batches) sets ``minibatches`` = N > 1: the lists then run N consecutive
    mini-batches of M micro-batches each, micro-batch m (0..N·M-1) belonging to mini-batch m // M
    and running with weight version m // M (``version``).
    """

    name: str
    K: int
    """Number of pipeline stages (K·V for a generator called with K ranks and V chunks per rank)."""
    M: int
    """Number of micro-batches in the iteration."""
    stage_to_rank: tuple[int, ...]
    """stage_to_rank[s] = the rank (position in the pipeline, 0..R-1) that holds stage s."""
    actions: tuple[tuple[Action, ...], ...]
    """actions[r] = rank r's actions in execution order, sends and receives included."""
    slices: int = 1
    """Token slices per micro-batch (TeraPipe); 1 = micro-batches are not sliced."""
    minibatches: int = 1
    """N mini-batches the lists run back to back without a flush (PipeDream-2BW; 1 = one iteration
    ending in a flush). Micro-batches are numbered 0..N·M-1; each stage updates its weights once per
    mini-batch, and the one ALLREDUCE per stage at the end of its list is the last mini-batch's (the
    drain). See ``version`` and ``two_bw``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.K < 1 or self.M < 1 or self.slices < 1 or self.minibatches < 1:
            raise ScheduleError(f"schedule {self.name!r}: K, M, slices and minibatches must be >= 1, got K={self.K}, "
                                f"M={self.M}, slices={self.slices}, minibatches={self.minibatches}")
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

    @property
    def total_mb(self) -> int:
        """Micro-batches the lists run: M·minibatches (indices 0..total_mb-1)."""
        return self.M * self.minibatches

    def version(self, mb: int) -> int:
        """The weight version micro-batch ``mb`` runs with, forward and backward (PipeDream-2BW's weight
        stashing): its mini-batch index t = mb // M. Version t is made by the update with mini-batch
        t-2's gradient, W(t) = W(t-1) - nu * grad f(W(t-2)) (W(0) = W(1) = the initial weights), so a
        stage holds at most two versions when mini-batch t's last backward ends before mini-batch
        t+2's first forward starts (``check_schedule`` checks it). 0 for a flushed schedule."""
        return mb // self.M

    def __str__(self) -> str:
        head = f"{self.name} K={self.K} M={self.M}" + (f" slices={self.slices}" if self.slices > 1 else "") \
            + (f" minibatches={self.minibatches}" if self.minibatches > 1 else "")
        width = len(str(self.num_ranks - 1))
        lines = [f"rank {r:>{width}}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions)]
        return "\n".join([head, *lines])


# ---- generators ---------------------------------------------------------------------------
@lru_cache(maxsize=1 << 20)
def _act(stage: int, kind: ActionKind, mb: int, sl: int = 0) -> Action:
    """Actions are immutable, so generators share them (building a K=64, M=256 schedule creates
    ~65k actions; most are already cached from other (K, M) pairs)."""
    return Action(stage, kind, mb, sl)


def _lower(name: str, M: int, s2r: tuple[int, ...], compute: list[list[Action]], minibatches: int = 1,
           slices: int = 1, *, send_order: bool = False) -> Schedule:
    """A schedule from per-rank compute orders (F, B, W only): each F gets the receive of its input
    just before it and the send of its output just after it, each B likewise for gradients, where
    the neighbouring stage lives on another rank (neighbours on the same rank exchange nothing);
    then each stage's ALLREDUCE, in stage order, at the end of its rank's list (the executor
    all-reduces after the schedule's step). ``send_order``: then move the receives into the peers' send order
    (``_in_send_order``), for a generator whose compute order does not give it (ZB-V); every other generator's
    lists are in that order already, which ``check_schedule`` (``check_message_order``) holds them to in the
    tests' grids, so they skip the pass."""
    S = len(s2r)
    ranks = []
    for r, order in enumerate(compute):
        acts: list[Action] = []
        for a in order:
            s, k, m, sl = a.stage, a.kind, a.mb, a.slice
            if k is ActionKind.F:
                if s > 0 and s2r[s - 1] != r:
                    acts.append(_act(s, ActionKind.RECV_F, m, sl))
                acts.append(a)
                if s < S - 1 and s2r[s + 1] != r:
                    acts.append(_act(s, ActionKind.SEND_F, m, sl))
            elif k is ActionKind.B:
                if s < S - 1 and s2r[s + 1] != r:
                    acts.append(_act(s, ActionKind.RECV_B, m, sl))
                acts.append(a)
                if s > 0 and s2r[s - 1] != r:
                    acts.append(_act(s, ActionKind.SEND_B, m, sl))
            else:
                acts.append(a)
        acts += [_act(s, ActionKind.ALLREDUCE, -1) for s in range(S) if s2r[s] == r]
        ranks.append(acts)
    actions = _in_send_order(ranks, s2r) if send_order else tuple(tuple(a) for a in ranks)
    return _generated(Schedule(name=name, K=S, M=M, stage_to_rank=s2r, actions=actions, minibatches=minibatches,
                               slices=slices))


def _in_send_order(ranks: list[list[Action]], s2r: tuple[int, ...]) -> tuple[tuple[Action, ...], ...]:
    """The lists with each rank's receives from another rank moved into the order that rank sends them (the
    runtime pairs the messages between two ranks by order alone: ``check_message_order``). Each receive goes
    as late as it can: right before the compute that needs it, or before the next receive from the same rank.
    Lists already in order come back unchanged (one pass over the actions, on plain tuples); ZB-V's are not
    (rank r's two chunks receive from rank r + 1 both forwards and backwards, in the compute order rather than the
    peer's send order)."""
    RF, RB, SF, SB = ActionKind.RECV_F, ActionKind.RECV_B, ActionKind.SEND_F, ActionKind.SEND_B
    sent: dict[tuple[int, int], list[tuple[int, ActionKind, int, int]]] = {}  # (src, dst) -> receives, send order
    got: dict[tuple[int, int], list[tuple[int, ActionKind, int, int]]] = {}  # (src, dst) -> receives, list order
    for r, acts in enumerate(ranks):
        for a in acts:
            k = a.kind
            if k is SF or k is SB:
                to = a.stage + 1 if k is SF else a.stage - 1
                sent.setdefault((r, s2r[to]), []).append((to, RF if k is SF else RB, a.mb, a.slice))
            elif k is RF or k is RB:
                src = s2r[a.stage - 1 if k is RF else a.stage + 1]
                got.setdefault((src, r), []).append((a.stage, k, a.mb, a.slice))
    out = [list(acts) for acts in ranks]
    for (src, r), msgs in sent.items():
        if got.get((src, r)) == msgs:
            continue
        moved = set(msgs)
        acts = [a for a in out[r] if (a.stage, a.kind, a.mb, a.slice) not in moved]
        at = {(a.stage, a.kind, a.mb, a.slice): i for i, a in enumerate(acts)}
        before: dict[int, list[Action]] = {}  # position in acts -> the receives that go right before it, in order
        limit = len(acts)
        for st, kind, mb, sl in reversed(msgs):  # the last sent first: each before its compute and the next receive
            limit = min(at[(st, ActionKind.F if kind is RF else ActionKind.B, mb, sl)], limit)
            before.setdefault(limit, []).insert(0, _act(st, kind, mb, sl))
        out[r] = [x for i in range(len(acts) + 1) for x in (*before.get(i, ()), *acts[i:i + 1])]
    return tuple(tuple(acts) for acts in out)


def _sizes(name: str, K: int, M: int, V: int = 1) -> tuple[int, int, int]:
    """K, M and V as plain ints >= 1 (numpy integers accepted)."""
    out: list[int] = []
    for sym, v in (("K", K), ("M", M), ("V", V)):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
            raise ScheduleError(f"{name}: {sym} must be an integer >= 1, got {v!r}")
        out.append(int(v))
    return out[0], out[1], out[2]


MICRO_BATCHES_PER_STAGE = 1024
"""M is at most this many times the stage count K·V. There a flush schedule's bubble (K·V−1)/(M+K·V−1) is
already below 1/1025 (0.1 %), so a larger M buys nothing but per-micro-batch overhead, while every action list
(and the simulation, the plan file and the executor's step) grows with M: a bound from K, V and M, checked before
anything is built, so a huge batch is refused in closed form instead of materialising millions of actions."""


def max_micro_batches(K: int, V: int = 1) -> int:
    """The largest M a schedule of K positions with V chunks each is built for (``MICRO_BATCHES_PER_STAGE``)."""
    return MICRO_BATCHES_PER_STAGE * K * V


def _bounded_m(name: str, K: int, M: int, V: int) -> None:
    if M > max_micro_batches(K, V):
        raise ScheduleError(f"{name}: M={M:,} micro-batches on K*V={K * V} stages is above "
                            f"{MICRO_BATCHES_PER_STAGE}*K*V = {max_micro_batches(K, V):,}, where the bubble is already "
                            f"below 0.1 %; use larger micro-batches (fewer of them) or a smaller batch")


def _one_chunk(name: str, V: int) -> None:
    if V != 1:
        raise ScheduleError(f"{name} holds one stage per rank: V must be 1, got V={V}; use 'interleaved-1f1b' "
                            f"or 'looped-bfs' for V > 1 chunks per rank")


def _m_at_least_k(name: str, K: int, M: int) -> None:
    if M < K:
        raise ScheduleError(f"{name} needs at least as many micro-batches as stages: M={M} < K={K} "
                            f"(torch's Schedule1F1B has the same rule); use M >= {K} or the 'gpipe' schedule")


def gpipe(K: int, M: int, *, reverse_backward: bool = False) -> Schedule:
    """GPipe (fill-drain): every stage runs all M forwards, then all M backwards.

    Backwards run in micro-batch order 0..M-1 as torch's ScheduleGPipe does (torch 2.13);
    ``reverse_backward=True`` gives the GPipe paper's / torchgpipe's order M-1..0.
    """
    K, M, _ = _sizes("gpipe", K, M)
    order = range(M - 1, -1, -1) if reverse_backward else range(M)
    compute = [[_act(s, ActionKind.F, m) for m in range(M)] + [_act(s, ActionKind.B, m) for m in order]
               for s in range(K)]
    return _lower("gpipe", M, tuple(range(K)), compute)


def terapipe(K: int, M: int, slices: int) -> Schedule:
    """TeraPipe's token-sliced GPipe: each micro-batch's sequence is cut into ``slices`` token slices that
    flow through the K stages one after another. Every stage runs the forwards of (micro-batch 0, slice
    0), (0, 1), ... (M-1, S-1), then the backwards micro-batch by micro-batch (0..M-1, as ``gpipe``),
    each micro-batch's slices in reverse order S-1..0 (a slice's keys and values feed the later slices,
    whose backwards give their gradient first). Actions carry the slice (``2F0.1``); slice lengths are
    the plan's (``Phase.token_slices``), not the schedule's. With S = 1 it is ``gpipe``'s lists."""
    K, M, _ = _sizes("terapipe", K, M)
    if not isinstance(slices, numbers.Integral) or isinstance(slices, bool) or slices < 1:
        raise ScheduleError(f"terapipe: slices must be an integer >= 1, got {slices!r}")
    S = int(slices)
    F, B = ActionKind.F, ActionKind.B
    compute = [[_act(s, F, m, sl) for m in range(M) for sl in range(S)]
               + [_act(s, B, m, sl) for m in range(M) for sl in range(S - 1, -1, -1)] for s in range(K)]
    return _lower("terapipe", M, tuple(range(K)), compute, slices=S)


def _one_f_one_b_order(K: int, M: int, r: int, *, defer_w: int | None = None) -> list[Action]:
    """Rank r's compute order in 1F1B: K-r-1 warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards. ``defer_w`` (zero-bubble): each B is followed by a W,
    the first ``defer_w`` of them held back — the W after the i-th B is then that of backward
    i - defer_w, and the held-back ones run at the end."""
    warm = K - r - 1
    F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
    out = [_act(r, F, m) for m in range(warm)]
    w_next = 0
    for i in range(M):
        if warm + i < M:
            out.append(_act(r, F, warm + i))
        out.append(_act(r, B, i))
        if defer_w is not None and i >= defer_w:
            out.append(_act(r, W, w_next))
            w_next += 1
    if defer_w is not None:
        out += [_act(r, W, m) for m in range(w_next, M)]
    return out


def one_f_one_b(K: int, M: int) -> Schedule:
    """1F1B (PipeDream-flush): stage s warms up with K-s-1 forwards, then alternates one forward and
    one backward, then drains the remaining backwards — torch's Schedule1F1B order. Needs M >= K."""
    K, M, _ = _sizes("1f1b", K, M)
    _m_at_least_k("1F1B", K, M)
    return _lower("1f1b", M, tuple(range(K)), [_one_f_one_b_order(K, M, s) for s in range(K)])


def zero_bubble_h1(K: int, M: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward split
    into B (input gradient, on the critical path) and W (weight gradient, off it). Stage s runs
    1F1B's order of F and B; after each B comes a W, except that stage s holds back its first s
    W's (the last stage K-1 holds back K-1) and runs them at the end, where 1F1B's drain leaves
    later stages idle. Every stage then keeps at most K micro-batches in flight (until their W
    ends), 1F1B's peak on stage 0: 1F1B's memory. On uniform stages with forward f, input
    gradient b and weight gradient w the idle time per rank is (K-1)(f+b-w) where w <= min(f, b)
    (the paper's (p-1)(T_F+T_B-T_W); at f = b = w a third of 1F1B's (K-1)(f+b+w), bubble rate
    (K-1)/3M against (K-1)/M), and (K-1)·max(f, b) beyond (``simulate.zb_h1_closed_form``).

    The order is torch's ScheduleInterleavedZeroBubble with one stage per rank (torch 2.13; torch's
    docstring calls the class the paper's ZB1P), which defers W's as the paper's handcrafted ZB-H1
    does: by the warm-up, so that every stage holds the same number in flight. Needs M >= K, like
    1F1B (torch also refuses some M >= K that this generator accepts: see the tests).
    """
    K, M, _ = _sizes("zb-h1", K, M)
    _m_at_least_k("ZB-H1", K, M)
    return _lower("zb-h1", M, tuple(range(K)), [_one_f_one_b_order(K, M, s, defer_w=s) for s in range(K)])


TWOBW_WINDOW = 8
"""Mini-batches ``two_bw`` lays out back to back (N): the simulator reads the steady state's period
from the last three (``simulate``). On 230 random cases (K 2..16, M K..32, non-uniform stages,
sends, optimizer steps, all-reduces up to 40x a micro-batch's work) that period was within 0.07 %
of the mean period over mini-batches 39..59 of a 60-mini-batch run (``python bench/twobw_bench.py
--window-check``); the first mini-batches are not yet periodic, so short windows read less."""


def two_bw(K: int, M: int, minibatches: int = TWOBW_WINDOW) -> Schedule:
    """PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021):
    1F1B run across N = ``minibatches`` mini-batches of M micro-batches without a flush between them —
    stage s warms up with K-s-1 forwards once, alternates one forward and one backward through all
    N·M micro-batches, and drains once at the end. Micro-batch m runs with weight version m // M
    (``Schedule.version``); each stage updates once per mini-batch with the gradient coalesced over
    its M micro-batches, W(t+1) = W(t) - nu * grad f(W(t-1)), so it keeps two weight versions.

    Needs M >= K (PipeDream-2BW's m >= d): then stage s starts mini-batch t+2 only after mini-batch
    t's last backward (its K-s-1 warm-up forwards lead by fewer than M), which the version check of
    ``check_schedule`` verifies. In flight: K-s micro-batches on stage s, like 1F1B. The lists are
    one window of a phase that runs many mini-batches; the planner prices its steady state
    (``simulate``: no per-iteration bubble) and a phase's ends pay one fill and one drain.
    """
    K, M, _ = _sizes("2bw", K, M)
    _m_at_least_k("2BW", K, M)
    if not isinstance(minibatches, numbers.Integral) or isinstance(minibatches, bool) or minibatches < 1:
        raise ScheduleError(f"2bw: minibatches must be an integer >= 1, got {minibatches!r}")
    N = int(minibatches)
    return _lower("2bw", M, tuple(range(K)), [_one_f_one_b_order(K, N * M, s) for s in range(K)], minibatches=N)


def _interleaved_rules(name: str, K: int, M: int, V: int) -> None:
    if V < 2:
        raise ScheduleError(f"{name} needs V >= 2 chunks per rank, got V={V}; with one chunk per rank use "
                            f"'1f1b' (or 'gpipe')")
    if M % K:
        lo = M // K * K
        near = f"M={lo} or M={lo + K}" if lo else f"M={K}"
        raise ScheduleError(f"{name} needs M a multiple of K (micro-batches go round the K ranks in groups of K): "
                            f"M={M}, K={K}; use {near}")


def interleaved_1f1b(K: int, M: int, V: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21, Megatron-LM's virtual pipeline): K ranks hold V
    chunks each, K·V stages in loop placement (stage c on rank c % K). Micro-batches run in groups
    of K: rank r first runs (V-1)·K + 2·(K-1-r) warm-up forwards (all V·M when fewer), going through
    its chunks in order with K micro-batches per chunk (0..K-1 on chunk 0, then 0..K-1 on chunk 1,
    ..., then K..2K-1 on chunk 0, ...); then one forward and one backward in turn, backwards going
    through its chunks in reverse order with the same grouping; then the remaining backwards.

    On uniform stages (each chunk f/V forward and b/V backward) and free communication the
    makespan is (V·M + K-1)·(f+b)/V and the bubble (K-1)/(V·M + K-1): the 1F1B bubble cut by V,
    for more messages (every micro-batch crosses the K ranks V times) and more activations in
    flight (``peak_inflight``).

    Rules: V >= 2 (V = 1 is plain 1F1B) and M a multiple of K. The order is torch's
    ScheduleInterleaved1F1B (torch 2.13) and current Megatron-LM's (microbatch_group_size_per_vp_stage
    = K, its default). Not followed: older Megatron-LM releases ran all forwards first when M == K
    (a special case torch does not make; it holds more in flight for no shorter makespan); and
    torch also accepts an M that is not a multiple of K when M // K divides it (groups of
    M / (M // K) micro-batches), which this generator refuses so that the grouping, the bubble
    and the memory follow one rule.
    """
    K, M, V = _sizes("interleaved-1f1b", K, M, V)
    _interleaved_rules("interleaved-1f1b", K, M, V)
    F, B = ActionKind.F, ActionKind.B
    total = V * M
    compute = []
    for r in range(K):
        warm = min((V - 1) * K + 2 * (K - 1 - r), total)
        nf = [0] * V
        nb = [0] * V
        out: list[Action] = []

        def fwd(i: int) -> None:
            v = (i // K) % V
            out.append(_act(v * K + r, F, nf[v]))
            nf[v] += 1

        def bwd(i: int) -> None:
            v = V - 1 - (i // K) % V
            out.append(_act(v * K + r, B, nb[v]))
            nb[v] += 1

        for i in range(warm):
            fwd(i)
        for i in range(total - warm):
            fwd(warm + i)
            bwd(i)
        for i in range(total - warm, total):
            bwd(i)
        compute.append(out)
    return _lower("interleaved-1f1b", M, tuple(c % K for c in range(K * V)), compute)


def looped_bfs(K: int, M: int, V: int) -> Schedule:
    """Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023): K ranks hold V
    chunks each in loop placement (stage c on rank c % K), like interleaved 1F1B; rank r runs all M
    forwards of its first chunk, then of its next, ..., then all backwards of its last chunk in
    micro-batch order M-1..0, then of the chunk before, ... — GPipe per chunk, so every stage keeps
    all M micro-batches in flight. On uniform stages with M >= K its makespan and bubble equal
    interleaved 1F1B's. torch's ScheduleLoopedBFS order (torch 2.13). Any M >= 1 and V >= 1 (V = 1
    is GPipe with backwards in reverse micro-batch order).
    """
    K, M, V = _sizes("looped-bfs", K, M, V)
    F, B = ActionKind.F, ActionKind.B
    compute = []
    for r in range(K):
        chunks = [v * K + r for v in range(V)]
        compute.append([_act(c, F, m) for c in chunks for m in range(M)]
                       + [_act(c, B, m) for c in reversed(chunks) for m in range(M - 1, -1, -1)])
    return _lower("looped-bfs", M, tuple(c % K for c in range(K * V)), compute)


def zero_bubble_v(K: int, M: int) -> Schedule:
    """ZB-V (Qi et al., ICLR 2024, Section 6): K ranks hold 2 chunks each in a "V": stage r and stage
    2K-1-r on rank r, so the model goes down the ranks and back up (the turn, stages K-1 and K on
    rank K-1, needs no message). Backwards are split into B and W like ZB-H1. Rank r runs 2(K-r)-1
    forwards of its first chunk; then r times a forward of each chunk (second chunk first); then
    K-r times F, B, W of its second chunk; then, while forwards remain, F (first chunk), B, W (first
    chunk) and F, B, W (second chunk); then r times B of each chunk; then K-r times B and W of the
    first chunk; then the W's left (second chunk, then first). Micro-batches past M drop out.

    In flight: stage s holds min(2K - s, M) (chunk-sized micro-batches), so a rank holds at most
    2K half-size ones: 1F1B's memory. On uniform chunks with f = b = w and M >= 2K-1 the bubble
    is (K-1) chunk-steps of a 6M-step iteration (the paper's "zero" counts each rank from its own
    first action). The order is torch's ScheduleZBVZeroBubble (torch 2.13). Any M >= 1.
    """
    K, M, _ = _sizes("zb-v", K, M)
    F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
    compute = []
    for r in range(K):
        lo, hi = r, 2 * K - 1 - r
        n = max(2 * K - 1, M)  # the pattern assumes enough micro-batches; the extra ones are dropped
        nxt = {(lo, F): 0, (hi, F): 0, (lo, B): 0, (hi, B): 0, (lo, W): 0, (hi, W): 0}
        out: list[tuple[int, ActionKind, int]] = []

        def run(*steps: tuple[int, ActionKind]) -> None:
            for st, k in steps:
                out.append((st, k, nxt[(st, k)]))
                nxt[(st, k)] += 1

        run(*[(lo, F)] * (2 * (K - r) - 1))
        for _ in range(r):
            run((hi, F), (lo, F))
        for _ in range(K - r):
            run((hi, F), (hi, B), (hi, W))
        while nxt[(hi, F)] < nxt[(lo, F)] or nxt[(lo, F)] < n:
            if nxt[(lo, F)] < n:
                run((lo, F))
            run((lo, B), (lo, W), (hi, F), (hi, B), (hi, W))
        for _ in range(r):
            run((lo, B), (hi, B))
        for _ in range(K - r):
            run((lo, B), (lo, W))
        run(*[(hi, W)] * (nxt[(hi, B)] - nxt[(hi, W)]))
        run(*[(lo, W)] * (nxt[(lo, B)] - nxt[(lo, W)]))
        compute.append([_act(st, k, m) for st, k, m in out if m < M])
    return _lower("zb-v", M, _v_placement(K), compute, send_order=True)


def _v_placement(K: int) -> tuple[int, ...]:
    return tuple(range(K)) + tuple(range(K - 1, -1, -1))


_GENERATED_ATTR = "_ptplan_generated"


def _generated(schedule: Schedule) -> Schedule:
    object.__setattr__(schedule, _GENERATED_ATTR, True)  # a marker beside the fields, not a field
    return schedule


def is_generated(schedule: Schedule) -> bool:
    """True for a schedule object made by this module's generators, whose output the tests run
    through ``check_schedule`` over grids of K and M; the simulator skips re-checking those. A copy
    (``dataclasses.replace``) or a hand-built schedule is not marked and gets checked."""
    return bool(schedule.__dict__.get(_GENERATED_ATTR, False))


def compute_order(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Per rank, its compute actions (F, B, W) in list order, without messages or all-reduces."""
    return tuple(tuple(a for a in acts if a.kind in COMPUTE_KINDS) for acts in schedule.actions)


def torch_compute_order(schedule: Schedule) -> tuple[tuple[str, ...], ...]:
    """``compute_order`` in torch.distributed.pipelining's action text (``_Action.from_str``): F is
    ``F``; a B whose (stage, micro-batch) also has a W is the input-gradient backward ``I``, any
    other B the full backward ``B``; W is ``W`` — e.g. ``0F0 0I0 0W0``. Token slices have no torch
    form and raise."""
    if schedule.slices != 1:
        raise ScheduleError(f"schedule {schedule.name!r} uses {schedule.slices} token slices, which torch's "
                            f"action text cannot express")
    split = {(a.stage, a.mb) for acts in schedule.actions for a in acts if a.kind is ActionKind.W}
    out = []
    for acts in compute_order(schedule):
        out.append(tuple(f"{a.stage}I{a.mb}" if a.kind is ActionKind.B and (a.stage, a.mb) in split else str(a)
                         for a in acts))
    return tuple(out)


def _gpipe_v(K: int, M: int, V: int) -> Schedule:
    _one_chunk("gpipe", V)
    return gpipe(K, M)


def _one_f_one_b_v(K: int, M: int, V: int) -> Schedule:
    _one_chunk("1f1b", V)
    return one_f_one_b(K, M)


def _zb_h1_v(K: int, M: int, V: int) -> Schedule:
    _one_chunk("zb-h1", V)
    return zero_bubble_h1(K, M)


def _two_bw_v(K: int, M: int, V: int) -> Schedule:
    _one_chunk("2bw", V)
    return two_bw(K, M)


def _zb_v_v(K: int, M: int, V: int) -> Schedule:
    _two_chunks(V)
    return zero_bubble_v(K, M)


def _two_chunks(V: int) -> None:
    if V != 2:
        raise ScheduleError(f"zb-v holds exactly 2 chunks per rank (a V: stages r and 2K-1-r on rank r): give V=2, "
                            f"got V={V}")


_GENERATORS = {"gpipe": _gpipe_v, "1f1b": _one_f_one_b_v, "interleaved-1f1b": interleaved_1f1b,
               "zb-h1": _zb_h1_v, "looped-bfs": looped_bfs, "zb-v": _zb_v_v, "2bw": _two_bw_v}
SCHEDULE_NAMES = tuple(_GENERATORS)
"""Every schedule ``build_schedule`` makes (``stage_to_rank`` gives each one's placement)."""
SPLIT_BACKWARD_SCHEDULES = frozenset({"zb-h1", "zb-v"})
"""The schedules whose lists split a backward into B (input gradient) and W (weight gradient) actions: they need the
profile's weight-gradient share, their critical path carries only B, and their stages hold what B keeps for W
(``splits_backward``; ``tests/test_schedule.py`` holds every generated list to this set)."""


def splits_backward(name: str) -> bool:
    """Whether the named schedule's lists run W actions (``SPLIT_BACKWARD_SCHEDULES``)."""
    return name in SPLIT_BACKWARD_SCHEDULES


LOOP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "looped-bfs", "2bw")
"""The schedules that place chunk c on rank c % K; "zb-v" folds back (rank r holds stages r and 2K-1-r).
``stage.links_for`` and ``plan.Phase.stage_to_rank`` take the placement from ``stage_to_rank`` / the
actions, not from this list."""


def stage_to_rank(name: str, K: int, V: int = 1) -> tuple[int, ...]:
    """Where the named schedule puts each of its K·V stages: loop placement (stage c on rank c % K)
    for every schedule but "zb-v", whose rank r holds stages r and 2K-1-r."""
    if type(name) is str and type(K) is int and type(V) is int:
        return _stage_to_rank_cached(name, K, V)
    return _stage_to_rank(name, K, V)


@lru_cache(maxsize=4096)
def _stage_to_rank_cached(name: str, K: int, V: int) -> tuple[int, ...]:
    return _stage_to_rank(name, K, V)


def _stage_to_rank(name: str, K: int, V: int) -> tuple[int, ...]:
    key = _key(name)
    K, _, V = _sizes(key, K, 1, V)
    if key == "zb-v":
        _two_chunks(V)
        return _v_placement(K)
    return tuple(c % K for c in range(K * V))


def _key(name: str) -> str:
    key = name.lower() if isinstance(name, str) else name
    if key not in _GENERATORS:
        raise ScheduleError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULE_NAMES)}")
    return key


_CHECKED: dict[tuple[str, int, int, int], str | None] = {}
"""``check_sizes``' answers for plain-int sizes: None (the schedule exists) or the error message (the
search asks about the same few (name, K, M, V) tens of thousands of times per plan)."""


def check_sizes(name: str, K: int, M: int, V: int = 1) -> None:
    """Raise ScheduleError (with the numbers and the fix) unless the named schedule exists for K
    ranks, M micro-batches and V chunks per rank — without building it."""
    if type(name) is str and type(K) is int and type(M) is int and type(V) is int:
        memo = (name, K, M, V)
        if memo not in _CHECKED:
            if len(_CHECKED) >= 1 << 16:
                _CHECKED.clear()
            try:
                _check_sizes(name, K, M, V)
                _CHECKED[memo] = None
            except ScheduleError as e:
                _CHECKED[memo] = str(e)
        why = _CHECKED[memo]
        if why is not None:
            raise ScheduleError(why)
        return
    _check_sizes(name, K, M, V)


def _check_sizes(name: str, K: int, M: int, V: int = 1) -> None:
    key = _key(name)
    K, M, V = _sizes(key, K, M, V)
    _bounded_m(key, K, M, V)
    if key in ("gpipe", "1f1b", "zb-h1", "2bw"):
        _one_chunk(key, V)
    if key in ("1f1b", "zb-h1", "2bw"):
        _m_at_least_k({"1f1b": "1F1B", "zb-h1": "ZB-H1", "2bw": "2BW"}[key], K, M)
    if key == "interleaved-1f1b":
        _interleaved_rules(key, K, M, V)
    if key == "zb-v":
        _two_chunks(V)


def peak_inflight(name: str, K: int, M: int, V: int = 1) -> tuple[int, ...]:
    """Per stage (K·V of them, placed as ``stage_to_rank`` says), the most micro-batches in flight (F
    started, last gradient — B, or W where there is one — not yet ended) in the named schedule:

    - gpipe, looped-bfs: all M on every stage;
    - 1f1b: min(K - s, M) on stage s;
    - 2bw: K - s on stage s (M >= K; the same across mini-batch boundaries: no flush);
    - zb-h1: K on every stage (a micro-batch waits for its W; M >= K);
    - zb-v: min(2K - s, M) on stage s (V = 2; chunk-sized micro-batches);
    - interleaved-1f1b: stage c = v·K + r (chunk v of rank r) holds min(M, q·K + min(K, D mod V·K))
      with D = 2·(V-1-v)·K + 2·(K-1-r) + 1 and q = D // (V·K) (``_interleaved_inflight``); e.g.
      K=4, V=2: 8 8 7 5 on chunk 0, 4 4 3 1 on chunk 1 when M >= 2K.

    The planner's memory model uses this before any schedule is built; ``tests/test_schedule.py``
    checks it against the generated lists.
    """
    if type(name) is str and type(K) is int and type(M) is int and type(V) is int:
        return _peak_inflight_cached(name, K, M, V)
    return _peak_inflight(name, K, M, V)


@lru_cache(maxsize=4096)
def peak_stashed(name: str, K: int, M: int, V: int = 1) -> tuple[int, ...]:
    """Per stage (K·V), the most micro-batches at once whose B (the input gradient) has run and whose W (the weight
    gradient) has not, in the named schedule's lists: each holds what its B left for its W (the stage model's
    stash). 0 on every stage of a schedule without W, and on stage 0, whose whole backward the runtime runs in its
    W (its input needs no gradient: B only keeps the received gradient)."""
    if not splits_backward(name):  # no W: nothing to build
        return (0,) * len(stage_to_rank(name, int(K), int(V)))
    sched = build_schedule(name, int(K), int(M), int(V))
    out = [0] * len(sched.stage_to_rank)
    for acts in sched.actions:
        split = {(a.stage, a.mb) for a in acts if a.kind is ActionKind.W}
        held: dict[int, int] = {}
        for a in acts:
            if a.kind is ActionKind.B and a.stage > 0 and (a.stage, a.mb) in split:
                held[a.stage] = held.get(a.stage, 0) + 1
                out[a.stage] = max(out[a.stage], held[a.stage])
            elif a.kind is ActionKind.W and a.stage > 0:
                held[a.stage] = held.get(a.stage, 0) - 1
    return tuple(out)


@lru_cache(maxsize=4096)
def _peak_inflight_cached(name: str, K: int, M: int, V: int) -> tuple[int, ...]:
    return _peak_inflight(name, K, M, V)


def _peak_inflight(name: str, K: int, M: int, V: int) -> tuple[int, ...]:
    key = _key(name)
    check_sizes(key, K, M, V)
    K, M, V = _sizes(key, K, M, V)
    if key in ("gpipe", "looped-bfs"):
        return (M,) * (K * V)
    if key in ("1f1b", "2bw"):
        return tuple(min(K - s, M) for s in range(K))
    if key == "zb-h1":
        return (K,) * K
    if key == "zb-v":
        return tuple(min(2 * K - s, M) for s in range(2 * K))
    return tuple(_interleaved_inflight(K, M, V, c) for c in range(K * V))


def _interleaved_inflight(K: int, M: int, V: int, c: int) -> int:
    """Interleaved 1F1B's peak in flight on stage c = v·K + r. Rank r's i-th forward is on chunk
    (i // K) % V and its j-th backward on chunk V-1 - (j // K) % V; the forwards lead the backwards
    by its warm-up (V-1)·K + 2·(K-1-r), plus the one forward of each 1F1B step. So chunk v's count
    in flight is the number of its forwards in a window of D = 2·(V-1-v)·K + 2·(K-1-r) + 1
    consecutive forward slots, a pattern of K of them in every V·K: at most q·K + min(K, D mod V·K)
    with q = D // (V·K) — and never more than its M micro-batches."""
    v, r = divmod(c, K)
    q, rest = divmod(2 * (V - 1 - v) * K + 2 * (K - 1 - r) + 1, V * K)
    return min(M, q * K + min(K, rest))


def build_schedule(name: str, K: int, M: int, V: int = 1) -> Schedule:
    """The named schedule (one of SCHEDULE_NAMES; case-insensitive) for K ranks, M micro-batches and
    V chunks per rank (K·V stages, placed as ``stage_to_rank`` says; V = 1 except for "interleaved-1f1b"
    (V >= 2), "looped-bfs" (any V) and "zb-v" (V = 2)).

    Results are cached: the same (name, K, M, V) returns the same object, so the simulator's
    compiled form of it is reused across calls.
    """
    key = _key(name)
    K, M, V = _sizes(key, K, M, V)
    _bounded_m(key, K, M, V)
    return _build_cached(key, K, M, V)


@lru_cache(maxsize=256)
def _build_cached(name: str, K: int, M: int, V: int) -> Schedule:
    return _GENERATORS[name](K, M, V)


# ---- checks -------------------------------------------------------------------------------
def check_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError unless the schedule can run as written.

    Checks: every action is known, on the rank that holds its stage, and within K, M and slices;
    every (stage, micro-batch, slice) has exactly one F and one B (at most one W, after its B);
    each stage has exactly one ALLREDUCE, after its last backward; a B never precedes its F;
    every message between stages on different ranks is sent exactly once after the compute that
    produces it and received exactly once before the compute that needs it (no messages between
    stages on the same rank, where list order decides); forwards follow stage order and backwards
    reverse stage order; no deadlock: executing the lists in unit time with blocking receives
    (and buffered sends) finishes; and each rank receives from another in the order that one sends
    (``check_message_order``: the runtime pairs messages by order alone).
    """
    _checked_run(schedule)
    check_message_order(schedule)


Message = tuple[str, int, int, int]
"""A message between two positions: (``F`` activation or ``B`` gradient, the sending stage, micro-batch, slice)."""


def message_of(a: Action, stage_to_rank: Sequence[int]) -> tuple[int, int, Message] | None:
    """(sending position, receiving position, the message) of a send or a receive; None for any other action."""
    s2r = stage_to_rank
    if a.kind is ActionKind.SEND_F or a.kind is ActionKind.SEND_B:
        fwd = a.kind is ActionKind.SEND_F
        return s2r[a.stage], s2r[a.stage + (1 if fwd else -1)], ("F" if fwd else "B", a.stage, a.mb, a.slice)
    if a.kind is ActionKind.RECV_F or a.kind is ActionKind.RECV_B:
        fwd = a.kind is ActionKind.RECV_F
        src = a.stage - 1 if fwd else a.stage + 1
        return s2r[src], s2r[a.stage], ("F" if fwd else "B", src, a.mb, a.slice)
    return None


def check_message_order(schedule: Schedule) -> None:
    """Raise ScheduleError unless, for every pair of ranks (a, b), b's receives from a come in the order
    a sends them (torch pairs messages between two ranks in order, without tags; so does the executor's step
    interpreter). Part of ``check_schedule``: a schedule the planner accepts is one the runtime can run."""
    sends: dict[tuple[int, int], list[Message]] = {}
    recvs: dict[tuple[int, int], list[Message]] = {}
    for acts in schedule.actions:
        for a in acts:
            m = message_of(a, schedule.stage_to_rank)
            if m is not None:
                src, dst, msg = m
                (recvs if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B) else sends).setdefault(
                    (src, dst), []).append(msg)
    for (a_rank, b_rank), sent in sorted(sends.items()):
        got = recvs.get((a_rank, b_rank), [])
        if got != sent:
            i = next(i for i, (x, y) in enumerate(zip(sent + [None], got + [None])) if x != y)

            def text(m: tuple[str, int, int, int] | None, recv: bool) -> str:
                if m is None:
                    return "nothing"
                kind, stage, mb, sl = m
                peer = stage + (1 if kind == "F" else -1)
                return f"{peer if recv else stage}{'RECV' if recv else 'SEND'}_{kind}{mb}" + (f".{sl}" if sl else "")

            raise ScheduleError(f"rank {b_rank} receives from rank {a_rank} in another order than rank {a_rank} "
                                f"sends: message {i} is {text(sent[i] if i < len(sent) else None, False)} on rank "
                                f"{a_rank} but {text(got[i] if i < len(got) else None, True)} on rank {b_rank}; torch "
                                f"pairs the messages between two ranks in order, so reorder rank {b_rank}'s receives")


def delivered_by(lists: Sequence[Sequence[Action]], stage_to_rank: Sequence[int]) -> dict[Message, Message]:
    """What each message proves delivered, read from one step's lists (position by position): message X -> the
    last message its receiver had sent to X's sender that X's sender received before sending X (a message whose
    sender had received nothing from its receiver yet is not in the result).

    A receive blocks, and two positions' messages arrive in the order they are sent (``check_message_order``);
    so a position holding X knows that every message it sent to X's sender, up to that one, has arrived: the
    executor's step interpreter then releases those sends' tensors (``step.Messages.release``) instead of
    holding every message of a step until its end (M activations and M gradients a stage, which the stage
    model does not price)."""
    out: dict[Message, Message] = {}
    for acts in lists:
        last: dict[int, Message] = {}
        """Peer position -> the last message received from it so far in this list."""
        for a in acts:
            m = message_of(a, stage_to_rank)
            if m is None:
                continue
            src, dst, msg = m
            if a.kind is ActionKind.RECV_F or a.kind is ActionKind.RECV_B:
                last[src] = msg
            elif dst in last:
                out[msg] = last[dst]
    return out


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
    _check_two_versions(schedule, where)
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
    K, M, S = schedule.K, schedule.total_mb, schedule.slices
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
                held = (f"M={M}" if schedule.minibatches == 1 else
                        f"the lists hold {M} (M={schedule.M} x {schedule.minibatches} mini-batches)")
                raise ScheduleError(f"{_ctx(schedule)}: {a} names micro-batch {a.mb}, but {held} (0..{M - 1})")
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
        for m in range(schedule.total_mb):
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


def _check_two_versions(schedule: Schedule, where: dict[_Key, tuple[int, int]]) -> None:
    """Flush-free schedules (``minibatches`` > 1): each stage holds at most two weight versions, i.e.
    mini-batch t's last gradient action (B, or W where there is one) comes before mini-batch t+2's
    first forward in the stage's list (the update with mini-batch t's gradient makes version t+2)."""
    M, N = schedule.M, schedule.minibatches
    if N < 3:
        return
    for s in range(schedule.K):
        for t in range(N - 2):
            last = max(where.get((s, c, m, sl), (0, -1))[1] for c in (_B, _W) for m in range(t * M, (t + 1) * M)
                       for sl in range(schedule.slices))
            first = min(where[(s, _F, m, sl)][1] for m in range((t + 2) * M, (t + 3) * M)
                        for sl in range(schedule.slices))
            if first < last:
                r = schedule.stage_to_rank[s]
                raise ScheduleError(f"{_ctx(schedule)}: rank {r} starts mini-batch {t + 2} ({schedule.actions[r][first]}, "
                                    f"position {first}) before mini-batch {t}'s last backward "
                                    f"({schedule.actions[r][last]}, position {last}); stage {s} would need a third "
                                    f"weight version — use M >= K micro-batches per mini-batch")


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
        for m in range(schedule.total_mb):
            for sl in range(schedule.slices):
                for c, first, then in ((_F, s - 1, s), (_B, s, s - 1)):
                    (r1, i1), (r2, i2) = where[(first, c, m, sl)], where[(then, c, m, sl)]
                    if steps[r1][i1] >= steps[r2][i2]:
                        raise ScheduleError(f"{_ctx(schedule)}: {_name((then, c, m, sl))} can run before "
                                            f"{_name((first, c, m, sl))}; "
                                            f"{'forwards follow' if c == _F else 'backwards reverse'} stage order")
