"""PipeDream-2BW on one rank: flush-free 1F1B across mini-batches, two weight versions, one-step-stale updates.

Legend: K pipeline stages (one per rank, V = 1), M micro-batches per mini-batch, D data-parallel
replicas, s this rank's stage, w = K-s-1 its warm-up forwards; micro-batches are numbered g = t·M + m
across the phase (mini-batch t, micro-batch m).

Order: the plan's lists, run by the one step interpreter (``step.StepInterpreter``) under this module's
policy ``TwoBW``. The lists are ``planner.schedule.two_bw``'s continuous 1F1B over a window of N
mini-batches -- w warm-up forwards once, then forward g+w and backward g in turn, then the remaining
backwards (the drain). ``stretches`` cuts a position's list into N stretches and the drain: stretch t holds
the messages and forwards of mini-batch t's micro-batches t·M .. t·M+M-1 and the backwards (with their
messages) of micro-batches t·M-w .. t·M+M-1-w, in the list's order (each a contiguous run of it). Step t
(one call per mini-batch, the runtime's ``train_step``) runs stretch t; past the window, stretch N-1 shifted
by (t-N+1)·M micro-batches (the list is periodic there); ``drain`` runs the drain shifted to the last
mini-batch run. No stretch waits for a later one (stage s's backwards need stage s+1's, which runs them one
stretch earlier or in the same one), so the stretches end without a flush, and a gradient received in
stretch t may have been sent in stretch t-1 (sends are asynchronous; ``drain`` waits for them).

Weights (``Schedule.version``): micro-batch g runs forward and backward with version t = g // M.
The canonical parameter ``p`` (what the optimizer steps, the transitions move and checkpoints save)
always holds the newest version; a version is a set of leaf tensors aliasing a version's storage.
When mini-batch t's last backward ends, its gradient (the mean over its M micro-batches) starts its average
over the D replicas (an asynchronous all-reduce), and before mini-batch t+2's first forward (or the next
update, or the drain) the average updates the newest version, W(t+1), into W(t+2) -- the all-reduce runs
under mini-batch t+1's work, as the planner's simulator prices it:
W(t+2) = W(t+1) - lr · grad f(W(t)), i.e. W(t+1) = W(t) - lr · grad f(W(t-1)). The update writes
into version t's storage (free now: mini-batch t is done; at t = 0, whose version shares the initial
weights with version 1, into a new buffer), so a stage holds two copies of its active weights, as
``planner/stage.py`` counts them; frozen layers (the prefix) are used as they are, one copy.
A phase starts with W(0) = W(1) = the weights it receives; ``drain`` runs the outstanding backwards
and updates, so the canonical weights are then W(T+1) after T mini-batches, and the next phase (or
a checkpoint) starts from them. The runtime drains at every phase change, at every ``gather`` (a
snapshot or a checkpoint: it acts as a flush, so checkpointing every n steps changes the updates a
little; a run resumed from a checkpoint starts, like the run that wrote it, a fresh pipe from its
weights (not tested)) and at the end.

Not done here: V > 1 chunks per rank (the planner writes 2BW with one stage per position).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import torch
from torch import Tensor
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from ptplan.planner.errors import PtplanError
from ptplan.planner.schedule import Action, ActionKind, Schedule

RECORD: list[tuple[int, int, str]] | None = None
"""Tests: set to a list to have every 2BW position append (K, stage, action) as it runs it — ``F<g>``, ``B<g>``,
``A<t>`` (the all-reduce of mini-batch t's gradient launched), ``U<t>`` (the update with it applied)."""

_FORWARD_SIDE = (ActionKind.RECV_F, ActionKind.F, ActionKind.SEND_F)


def stretches(actions: Sequence[Action], M: int, N: int) -> tuple[list[list[Action]], list[Action]]:
    """A position's continuous 1F1B list over N mini-batches cut into its N stretches and its drain (see the
    module docstring); w, the warm-up forwards, is read from the list (forwards before its first backward)."""
    kinds = [a.kind for a in actions]
    first_b = kinds.index(ActionKind.B) if ActionKind.B in kinds else len(kinds)
    w = sum(1 for k in kinds[:first_b] if k is ActionKind.F)
    out: list[list[Action]] = [[] for _ in range(N)]
    tail: list[Action] = []
    for a in actions:
        if a.kind is ActionKind.ALLREDUCE:
            tail.append(a)
            continue
        g = a.mb if a.kind in _FORWARD_SIDE else a.mb + w
        (out[g // M] if g < N * M else tail).append(a)
    return out, tail


def _shift(actions: Sequence[Action], by: int) -> list[Action]:
    return [a if a.kind is ActionKind.ALLREDUCE or not by else Action(a.stage, a.kind, a.mb + by, a.slice)
            for a in actions]


class TwoBW:
    """The step interpreter's policy for PipeDream-2BW on one position (one chunk): which stretch of the plan's
    list a step runs, the weight version each micro-batch runs with, and the update after each mini-batch's
    last backward (``update``: sets the gradients, averages them over the replicas, steps the optimizer)."""

    stale = True

    def __init__(self, module: torch.nn.Module, schedule: Schedule, position: int,
                 update: Callable[[list[tuple[torch.nn.Parameter, Tensor | None]]], Callable[[], None]]) -> None:
        K, M, N = schedule.K, schedule.M, schedule.minibatches
        if schedule.stage_to_rank != tuple(range(K)):
            raise PtplanError(f"2BW runs one stage per position, but the schedule places its stages "
                              f"{schedule.stage_to_rank}; re-plan with --schedule 2bw")
        if M < K:
            raise PtplanError(f"2BW needs M >= K micro-batches per mini-batch, got M={M} < K={K}; re-plan with "
                              f"--schedule 2bw (the planner only makes M >= K)")
        if N < 2:
            raise PtplanError(f"2BW's lists must lay out at least 2 mini-batches (the steady stretch repeats), got "
                              f"{N}; re-run `ptplan plan` (it writes {K}x{M} lists over 8 mini-batches)")
        self.module, self.s, self.K, self.M, self.N = module, position, K, M, N
        self.update_fn = update
        self.parts, self.tail = stretches(schedule.actions[position], M, N)
        self.active = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        """This stage's trainable parameters: the ones with two versions."""
        self.recompute = bool(getattr(module, "recompute", False))
        """Activation recomputation (``Phase.recompute``): the whole functional call of a micro-batch is
        checkpointed, so the backward's rerun sees that micro-batch's weight version (the stage module's own
        checkpoint would rerun outside ``functional_call``, on the newest weights)."""
        if self.recompute:
            module.recompute = False  # type: ignore[assignment]
        for unit in module.modules():  # a stage recomputing its first layers (``stage.RecomputedLayers``): their
            if hasattr(unit, "bind_weights"):  # rerun binds the micro-batch's version, as this checkpoint does
                unit.bind_weights = True
        self.versions: dict[int, dict[str, Tensor]] = {}
        """Version t -> its leaf tensors (versions 0 and 1 share the weights the policy starts from)."""
        self.steps = 0
        """Mini-batches whose stretch has run (the next step is mini-batch ``steps``)."""
        self.done_b: dict[int, int] = {}
        """Mini-batch -> backwards done."""
        self.pending: tuple[int, Callable[[], None]] | None = None
        """(t, finish): mini-batch t's update, begun (its all-reduce in flight) and not yet applied."""
        self.restart()

    def restart(self) -> None:
        """Start from the canonical weights: W(0) = W(1) = them."""
        assert getattr(self, "pending", None) is None, "2BW: restarted with an update in flight"
        self.steps = 0
        self.done_b = {}
        self.versions = {0: {n: self._leaf(p) for n, p in self.active}, 1: {n: self._leaf(p) for n, p in self.active}}

    @staticmethod
    def _leaf(p: Tensor) -> Tensor:
        """A leaf tensor over p's storage, with its own autograd identity and version counter."""
        return p.data.requires_grad_(True)

    # ---- which actions ---------------------------------------------------------------------------
    @property
    def period(self) -> int:
        """Steps past the window run its last stretch shifted by M micro-batches a step."""
        return self.M

    def message_lists(self, schedule: Schedule) -> list[list[list[Action]]]:
        """Every position's stretch for each of the window's N steps (``step.StepInterpreter`` reads which
        messages arrived from them)."""
        cut = [stretches(acts, self.M, self.N)[0] for acts in schedule.actions]
        return [[parts[t] for parts in cut] for t in range(self.N)]

    def step_actions(self) -> list[Action]:
        t = self.steps
        self.steps += 1
        return self.parts[t] if t < self.N else _shift(self.parts[self.N - 1], (t - self.N + 1) * self.M)

    def drain_actions(self) -> list[Action]:
        return _shift(self.tail, (self.steps - self.N) * self.M) if self.steps else []

    def mb_key(self, g: int) -> int:
        return g % self.M

    def slot(self, key: tuple[str, int, int, int]) -> Hashable | None:
        """Each received input is its micro-batch's own until its backward (a new tensor); one gradient
        buffer (``planner/stage.py``'s 2BW buffers)."""
        return None if key[0] == "F" else ("B", key[1])

    # ---- the weight versions ---------------------------------------------------------------------
    def weight_tensors(self) -> list[Tensor]:
        """Every version's leaf tensors (``memory.StepMemory`` counts their storages and gradients)."""
        return [t for version in self.versions.values() for t in version.values()]

    def call(self, c: int, g: int, inp: Tensor, kw: dict[str, Tensor]) -> Tensor:
        """Micro-batch g's forward on weight version g // M (finishing the update that makes it, if in flight)."""
        if g // self.M not in self.versions:
            self._finish()
        params = self.versions[g // self.M]
        if self.recompute:
            return checkpoint(functional_call, self.module, params, (inp,), kw, use_reentrant=False)
        return functional_call(self.module, params, (inp,), kw)

    def after_forward(self, c: int, g: int) -> None:
        if RECORD is not None:
            RECORD.append((self.K, self.s, f"F{g}"))

    def after_backward(self, c: int, g: int) -> None:
        if RECORD is not None:
            RECORD.append((self.K, self.s, f"B{g}"))
        t = g // self.M
        self.done_b[t] = self.done_b.get(t, 0) + 1
        if self.done_b[t] == self.M:
            del self.done_b[t]
            self._update(t)

    def reduce(self, compute: Any, c: int) -> None:
        """The list's end-of-gradients (the drain): every mini-batch's update has begun (after its last backward);
        the last one is applied."""
        assert not self.done_b, f"2BW: mini-batches {sorted(self.done_b)} still have backwards to run"
        self._finish()

    def _update(self, t: int) -> None:
        """Mini-batch t's gradient (mean over its micro-batches) begins making version t+2 from version t+1: its
        data-parallel all-reduce is launched, and ``_finish`` applies it (the optimizer step) when mini-batch t+2's
        first forward needs version t+2, before the next update begins, or at the drain -- so the all-reduce runs
        under mini-batch t+1's work, where the planner's simulator puts it (``planner/simulate.py``)."""
        self._finish()  # the previous update first: this one copies the newest weights
        old = self.versions.pop(t)
        pairs = []
        for n, p in self.active:
            g = old[n].grad
            if g is not None:
                g = g.div_(self.M)
            if t + 1 in self.versions and self.versions[t + 1][n].data_ptr() != old[n].data_ptr():
                buf = old[n].detach()  # version t's storage is free: write the update there
                buf.copy_(p.data)
                p.data = buf
            else:  # version t shares its storage with version t+1 (t = 0) or the newest version: a new buffer
                p.data = p.data.clone()
            pairs.append((p, g))
        del old
        self.pending = (t, self.update_fn(pairs))  # sets p.grad and launches its average over the replicas
        if RECORD is not None:
            RECORD.append((self.K, self.s, f"A{t}"))

    def _finish(self) -> None:
        """Apply the update in flight, if any: wait for its average, step the optimizer (``twobw_update``); the
        newest weights are then version t+2."""
        if self.pending is None:
            return
        t, finish = self.pending
        self.pending = None
        finish()
        self.versions[t + 2] = {n: self._leaf(p) for n, p in self.active}
        if RECORD is not None:
            RECORD.append((self.K, self.s, f"U{t}"))
