"""One step interpreter: a phase's training step is this rank's action list, run action by action.

Legend: K·V stages (chunks) over K positions, M micro-batches, S token slices; chunk c lives on position
``schedule.stage_to_rank[c]``. The plan's lists (``actions.phase_schedule``) are the program; one class,
``StepInterpreter``, runs them for every schedule the planner writes -- GPipe, 1F1B, interleaved (V chunks a
position), looped BFS, ZB-H1 (a B whose (stage, micro-batch) also has a W is the input gradient only), 2BW and
token slices -- at any K, K = 1 included (then the lists hold no messages and nothing is communicated):

- ``F``: the chunk's forward on its input (the batch's micro-batch on chunk 0, the previous chunk's output when
  it lives here, else the received activation); the last chunk adds the loss.
- ``B``: the backward (full, or the input gradient only where the plan has a W), seeded with the loss on the
  last chunk, else the next chunk's input gradient (local) or the received gradient. ``W``: the weight
  gradient (``torch_adapter``; on chunk 0, whose input needs no gradient, the whole backward).
- ``SEND_F``/``SEND_B``: an asynchronous send to the neighbouring chunk's position; ``RECV_F``/``RECV_B``: a
  blocking receive (``check_schedule`` proves the lists finish with blocking receives and buffered sends). A
  sent tensor is held until a message received from its receiver proves it arrived
  (``planner.schedule.delivered_by``; ``Messages.release``), then freed -- not at the step's end, which held M
  activations and M gradients a stage (and, under 2BW on gloo, every send of the phase) beyond what the stage
  model prices (``tests/test_send_release.py``).
  The first message of each (kind, receiving chunk, micro-batch, slice) carries its shape and dtype in a
  header; after that the receive lands in a buffer kept for the phase (one per message key, as
  torch.distributed.pipelining keeps them: ``memory`` counts them as the planner's "buffers").
- ``ALLREDUCE``: the end of a chunk's gradients: divided by M (the loss is a mean per micro-batch).

What differs between schedules is data (the lists) and two policies: the *compute* (``ChunkCompute`` for
whole micro-batches; ``sliced.SliceCompute`` for token slices: the action's slice index picks the tokens) and
the *step policy* (``Flushed``: a step runs the whole list and waits for its sends; ``twobw.TwoBW``: a step
runs one mini-batch's stretch of the plan's continuous list with two weight versions, ``drain`` runs the
rest). The compute entry points are ``_forward``, ``_backward`` and ``_backward_weight`` (tests record them).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Hashable, Mapping, NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.schedule import Action, ActionKind, Message, Schedule, delivered_by, message_of

from ptplan.executor.runtime import torch_adapter

Key = tuple[str, int, int, int]
"""A message: (``F`` activation or ``B`` gradient, receiving chunk, micro-batch key, slice)."""

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool, torch.int8, torch.int16)
_HEAD = 8  # ndim, dtype code, up to 6 sizes


def encode_head(t: Tensor, device: torch.device) -> Tensor:
    """The header a tensor's first message between two ranks carries (its rank, dtype and sizes); the one codec of
    the pipeline's messages and the evaluation's (``decode_head``)."""
    if t.dim() > _HEAD - 2 or t.dtype not in _DTYPES:
        raise PtplanError(f"cannot send a {t.dim()}-d {t.dtype} tensor between stages (up to {_HEAD - 2} "
                          f"dimensions of {', '.join(map(str, _DTYPES))})")
    head = torch.zeros(_HEAD, dtype=torch.int64, device=device)
    head[0], head[1] = t.dim(), _DTYPES.index(t.dtype)
    head[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return head


def empty_head(device: torch.device) -> Tensor:
    """A buffer to receive ``encode_head``'s header into."""
    return torch.empty(_HEAD, dtype=torch.int64, device=device)


def decode_head(head: Tensor) -> tuple[list[int], torch.dtype]:
    """(shape, dtype) of ``encode_head``'s header."""
    n, code = int(head[0]), int(head[1])
    return [int(x) for x in head[2:2 + n].tolist()], _DTYPES[code]


TRACE: list[tuple[int, str]] | None = None
"""Tests: set to a list to have every interpreter append (position, action) for each action it runs, in order."""


class PipelineStep(Protocol):
    """One optimizer step of a phase on this rank, from its position's action lists."""

    stale: bool
    """True when the step updates the weights itself (2BW's one-step-stale updates); else the caller
    averages the gradients the step leaves and steps the optimizer."""

    def run(self, x: Tensor | None, y: Tensor | None, kw: dict[str, Tensor]) -> list[Tensor]:
        """Run the step on the pipeline's batch (``x`` on the first position, ``y`` on the last); the last
        position's losses (empty elsewhere)."""
        ...

    def drain(self) -> None:
        """Finish the work a step left in flight (2BW's outstanding backwards and updates); else nothing."""
        ...

    def recv_buffers(self) -> list[Tensor]:
        """The receive buffers kept for the phase."""
        ...


class Messages:
    """One position's point-to-point messages over the pipeline group (group rank = position)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 ranks: Sequence[int] | None = None) -> None:
        self.group, self.device = group, device
        self.ranks = None if ranks is None else list(ranks)
        """Global rank per position (default: the group's ranks in order)."""
        self.sent: set[Key] = set()
        """Keys whose header went out (the receiver expects one exactly then)."""
        self.known: dict[Key, tuple[list[int], torch.dtype]] = {}
        self.buffers: dict[Hashable, Tensor] = {}
        self.pending: list[tuple[int, Message, Any, Tensor]] = []
        """Sends not yet known to have arrived: (receiving global rank, the message, its work, its tensor), in the
        order sent; each holds its tensor until ``release`` or ``reap``."""

    def _peer(self, position: int) -> int:
        if self.ranks is not None:
            return self.ranks[position]
        if self.group is None:
            raise PtplanError(f"a message to position {position} but this pipeline has no process group (K = 1)")
        return dist.get_global_rank(self.group, position)

    def send(self, t: Tensor, key: Key, position: int, msg: Message) -> None:
        """Send ``t`` as message ``msg`` (``planner.schedule.message_of``'s identity) under ``key``."""
        dst = self._peer(position)
        t = t.detach().contiguous()
        if key not in self.sent:
            self.sent.add(key)
            head = encode_head(t, self.device)
            self.pending.append((dst, msg, dist.isend(head, dst, group=self.group), head))
        self.pending.append((dst, msg, dist.isend(t, dst, group=self.group), t))

    def recv(self, key: Key, position: int, slot: Hashable | None) -> Tensor:
        """The message ``key`` from ``position``, into the buffer kept at ``slot`` (None: a new tensor)."""
        src = self._peer(position)
        buf = None if slot is None else self.buffers.get(slot)
        if key not in self.known:
            head = empty_head(self.device)
            dist.recv(head, src, group=self.group)
            self.known[key] = decode_head(head)
        shape, dtype = self.known[key]
        if buf is None or list(buf.shape) != shape or buf.dtype != dtype:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            if slot is not None:
                self.buffers[slot] = buf
        dist.recv(buf, src, group=self.group)
        return buf

    def release(self, position: int, msg: Message) -> None:
        """Position ``position`` has received ``msg`` (``planner.schedule.delivered_by`` proves it): finish that
        send and every earlier one to it (they arrive in order), so their tensors can be freed. The waits return
        at once (the data is there); gloo's sends report completion only to ``wait``."""
        dst = self._peer(position)
        upto = max((i for i, (d, m, _, _) in enumerate(self.pending) if d == dst and m == msg), default=-1)
        if upto < 0:
            return
        keep = []
        for i, (d, m, work, t) in enumerate(self.pending):
            if i <= upto and d == dst:
                work.wait()
            else:
                keep.append((d, m, work, t))
        self.pending = keep

    def reap(self, *, wait: bool) -> None:
        """Wait for every send (``wait``), or forget the completed ones."""
        if wait:
            for _, _, work, _ in self.pending:
                work.wait()
            self.pending = []
        else:
            self.pending = [p for p in self.pending if not p[2].is_completed()]


class Recomputed(NamedTuple):
    """How a chunk that recomputes its activations runs under a split backward (``ChunkCompute``'s ``rebuild``):
    ``head(x, kw)`` runs its recomputed layers without a checkpoint (the whole chunk, or its first r layers:
    ``Phase.recompute_layers``), ``head_params`` are their parameters; ``tail(h, kw)`` runs the layers after them with
    autograd (None: the head is the whole chunk), ``tail_params`` are theirs."""
    head: Callable[[Tensor, dict[str, Tensor]], Tensor]
    head_params: Sequence[nn.Parameter]
    tail: Callable[[Tensor, dict[str, Tensor]], Tensor] | None = None
    tail_params: Sequence[nn.Parameter] = ()


class ChunkCompute:
    """Forward and backward of whole micro-batches on this position's chunks (modules by chunk index).

    ``call(c, m, input, kwargs)`` runs chunk c (default: the module; 2BW: on micro-batch m's weight version).

    ``rebuild``: chunks that recompute their activations under a split backward (chunk index -> ``Recomputed``). A
    checkpointed graph recomputes the forward in every backward pass that reaches it, and a split backward makes one
    pass for B and one per parameter group for W (a bert-tiny stage of 6 layers ran 20 forwards per micro-batch where
    the plan prices 2). So such a chunk's F runs its recomputed layers (the head: the whole chunk, or its first r
    layers) under ``no_grad``, keeping, as recomputation does, only their input and output, and the layers after
    them (the tail) with autograd; its B takes the tail's input gradient, then rebuilds the head's graph -- its
    forward once more, on the random-number state the F began with -- and takes the chunk's input gradient
    through it; W reads both graphs (``planner/stage.py``: the rebuilt activations are held from B to W).

    ``whole``: chunks whose backward is never split: under a split backward their B runs the whole backward and
    their W nothing (FSDP-sharded chunks with D > 1: torch's weight-gradient pass does not run FSDP's gradient
    hooks, so the reduce-scatter would never happen; ``planner/strategy.strategy_table`` prices such a layer's
    weight-gradient part as 0 and its stash as none).
    """

    def __init__(self, chunks: Mapping[int, nn.Module], loss_fn: Callable[[Tensor, Tensor], Tensor], *, M: int,
                 last: int, call: Callable[[int, int, Tensor, dict[str, Tensor]], Tensor] | None = None,
                 rebuild: Mapping[int, Recomputed] | None = None, whole: frozenset[int] = frozenset()) -> None:
        self.chunks, self.loss_fn, self.M, self.last = chunks, loss_fn, M, last
        self.call = call or (lambda c, m, inp, kw: self.chunks[c](inp, **kw))
        self.rebuild = dict(rebuild or {})
        self.whole = whole
        if 0 in self.rebuild:
            raise PtplanError("chunk 0 runs its whole backward in W: it recomputes through its checkpoint")
        if self.whole & set(self.rebuild):
            raise PtplanError(f"chunks {sorted(self.whole & set(self.rebuild))} run their backward whole: they "
                              f"recompute through their checkpoint, not a rebuild")
        self._rng: dict[tuple[int, int], tuple[Tensor, Tensor | None]] = {}
        """(chunk, micro-batch) -> the random-number state its forward began with (``rebuild`` chunks)."""
        self._mid: dict[tuple[int, int], Tensor] = {}
        """(chunk, micro-batch) -> the head's output, the tail's input leaf (``rebuild`` chunks with a tail)."""
        self.fwd: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        """(chunk, micro-batch) -> (its input, its output; the loss on the last chunk) until its backward."""
        self.pending: dict[tuple[int, int], Any] = {}
        """(chunk, micro-batch) -> what its W needs, from its input-gradient B."""
        self._losses: dict[int, Tensor] = {}
        self._xs: Sequence[Tensor | None] = ()
        self._ys: Sequence[Tensor | None] = ()
        self._kw: list[dict[str, Tensor]] = []

    def begin(self, x: Tensor | None, y: Tensor | None, kw: dict[str, Tensor]) -> None:
        """The step's micro-batches, split as torch's schedules split them (``tensor_split``)."""
        M = self.M
        self._xs = torch.tensor_split(x, M) if x is not None else [None] * M
        self._ys = torch.tensor_split(y, M) if y is not None else [None] * M
        parts = {k: torch.tensor_split(t, M) for k, t in kw.items()}
        self._kw = [{k: v[m] for k, v in parts.items()} for m in range(M)]

    def end(self) -> None:
        self._xs, self._ys, self._kw = (), (), []

    def in_flight(self) -> int:
        return len(self.fwd) + len(self.pending)

    def forward(self, c: int, m: int, sl: int, inp: Tensor | None) -> Tensor:
        i = m % self.M
        if c == 0:
            inp = self._xs[i]
            if inp is None:
                raise PtplanError("the first stage needs the batch's inputs")
        else:
            assert inp is not None, f"chunk {c}'s input for micro-batch {m}"
            inp = inp.detach().requires_grad_(True)
        rc = self.rebuild.get(c)
        if rc is None:
            out = self._loss(c, m, self.call(c, m, inp, self._kw[i]))
        else:
            self._rng[(c, m)] = _rng_state(inp.device)
            with torch.no_grad():
                h = rc.head(inp, self._kw[i])
                out = self._loss(c, m, h) if rc.tail is None else h
            if rc.tail is not None:
                self._mid[(c, m)] = h = h.detach().requires_grad_(True)
                out = self._loss(c, m, rc.tail(h, self._kw[i]))
        if c == self.last:
            self._losses[m] = out.detach()
        self.fwd[(c, m)] = (inp if c > 0 else None, out)
        return out

    def _loss(self, c: int, m: int, out: Tensor) -> Tensor:
        """Chunk c's output of micro-batch m, or on the last chunk its loss."""
        if c != self.last:
            return out
        y = self._ys[m % self.M]
        if y is None:
            raise PtplanError("the last stage needs the batch's targets")
        return self.loss_fn(out, y)

    def _rebuilt(self, c: int, m: int, inp: Tensor, rc: Recomputed) -> Tensor:
        """A ``rebuild`` chunk's head run again with autograd on micro-batch m's input, on the random-number state its
        forward began with (and, where the head is the whole last chunk, its loss)."""
        cpu, dev = self._rng.pop((c, m))
        devices = [inp.device] if dev is not None else []
        with torch.random.fork_rng(devices=devices, device_type=inp.device.type), torch.enable_grad():
            torch.set_rng_state(cpu)
            if dev is not None:
                torch.cuda.set_rng_state(dev, inp.device)
            h = rc.head(inp, self._kw[m % self.M])
            return self._loss(c, m, h) if rc.tail is None else h

    def backward(self, c: int, m: int, sl: int, grad: Tensor | None, *, full: bool) -> Tensor | None:
        """Chunk c's backward of micro-batch m; its input's gradient (None on chunk 0)."""
        if c in self.rebuild:
            return self._backward_rebuilt(c, m, grad, full=full)
        if full or c in self.whole:
            inp, out = self.fwd.pop((c, m))
            torch.autograd.backward(out, grad_tensors=grad)
            return None if inp is None else inp.grad
        if c == 0:  # torch's first stage: the input needs no gradient, so W runs the whole backward
            self.pending[(c, m)] = grad
            return None
        inp, out = self.fwd.pop((c, m))
        assert inp is not None, f"chunk {c} > 0 keeps its input"
        dinputs, groups = torch_adapter.backward_input([out], None if grad is None else [grad], [inp],
                                                       self.chunks[c].parameters())
        self.pending[(c, m)] = groups
        return dinputs[0]

    def _backward_rebuilt(self, c: int, m: int, grad: Tensor | None, *, full: bool) -> Tensor | None:
        """``backward`` of a ``rebuild`` chunk: the tail's input gradient (where it has a tail), then the head
        rebuilt and the chunk's input gradient through it; W's groups of both kept (``full``: the whole backward)."""
        rc = self.rebuild[c]
        inp, out = self.fwd.pop((c, m))
        assert inp is not None, f"chunk {c} > 0 keeps its input"
        seed, tail_groups = grad, None
        if rc.tail is not None:
            h = self._mid.pop((c, m))
            if full:
                torch.autograd.backward(out, grad_tensors=grad)
                seed = h.grad
            else:
                (seed,), tail_groups = torch_adapter.backward_input([out], None if grad is None else [grad], [h],
                                                                   iter(rc.tail_params))
        del out
        rebuilt = self._rebuilt(c, m, inp, rc)
        if full:
            torch.autograd.backward(rebuilt, grad_tensors=seed)
            return inp.grad
        (dinput,), head_groups = torch_adapter.backward_input([rebuilt], None if seed is None else [seed], [inp],
                                                             iter(rc.head_params))
        self.pending[(c, m)] = (head_groups, tail_groups)
        return dinput

    def backward_weight(self, c: int, m: int, sl: int) -> None:
        if c in self.whole:  # its B ran the whole backward
            return
        pending = self.pending.pop((c, m))
        if c == 0:
            _, out = self.fwd.pop((c, m))
            torch.autograd.backward(out, grad_tensors=pending)
        elif c in self.rebuild:
            rc, (head_groups, tail_groups) = self.rebuild[c], pending
            if tail_groups is not None:
                torch_adapter.backward_weight(iter(rc.tail_params), tail_groups)
            torch_adapter.backward_weight(iter(rc.head_params), head_groups)
        else:
            torch_adapter.backward_weight(self.chunks[c].parameters(), pending)

    def reduce(self, c: int) -> None:
        """Chunk c's gradients are complete: divide them by M (torch's ``scale_grads``)."""
        for p in self.chunks[c].parameters():
            if p.grad is not None:
                p.grad.div_(self.M)

    def losses(self) -> list[Tensor]:
        out = [self._losses[m] for m in sorted(self._losses)]
        self._losses = {}
        return out


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    """The CPU random-number state and, on a CUDA device, the device's (what ``torch.utils.checkpoint`` keeps)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


class Flushed:
    """The step policy of flushed schedules: a step runs the whole list, ends with every send done and every
    micro-batch's backward run, and keeps one receive buffer per message."""

    stale = False

    period: int | None = None
    """Steps past the lists' window repeat its last stretch shifted by this many micro-batches (None: every step
    runs the same list)."""

    def __init__(self, schedule: Schedule, position: int) -> None:
        self.actions = schedule.actions[position]

    @staticmethod
    def message_lists(schedule: Schedule) -> list[Sequence[Sequence[Action]]]:
        """Every position's list for each distinct step (one here): what ``planner.schedule.delivered_by`` reads."""
        return [schedule.actions]

    def step_actions(self) -> Sequence[Action]:
        return self.actions

    def drain_actions(self) -> Sequence[Action]:
        return ()

    def mb_key(self, m: int) -> int:
        return m

    def slot(self, key: Key) -> Hashable | None:
        return key

    def after_forward(self, c: int, m: int) -> None:
        pass

    def after_backward(self, c: int, m: int) -> None:
        pass

    def reduce(self, compute: Any, c: int) -> None:
        compute.reduce(c)

    def restart(self) -> None:
        pass


class StepInterpreter:
    """Runs this position's actions (see the module docstring); the one ``PipelineStep``."""

    def __init__(self, schedule: Schedule, position: int, compute: Any, *, group: dist.ProcessGroup | None,
                 device: torch.device, policy: Any = None, ranks: Sequence[int] | None = None) -> None:
        self.schedule, self.position, self.compute = schedule, position, compute
        self.policy = policy if policy is not None else Flushed(schedule, position)
        self.stale: bool = self.policy.stale
        self.s2r = schedule.stage_to_rank
        self.last = schedule.K - 1
        self.split = frozenset((a.stage, a.mb) for acts in schedule.actions for a in acts if a.kind is ActionKind.W)
        self.msgs = Messages(group, device, ranks)
        self._got: dict[Key, Tensor] = {}
        self._outs: dict[tuple[int, int, int], Tensor] = {}
        """(chunk, micro-batch, slice) -> its output, until sent or taken by the next chunk here."""
        self._grads: dict[tuple[int, int, int], Tensor | None] = {}
        """(chunk, micro-batch, slice) -> its input's gradient, until sent or used by the previous chunk here."""
        self.backward_scope: Callable[[], ContextManager[Any]] = contextlib.nullcontext
        """Entered around every backward action (``memory.StepMemory`` counts the backward's working set in it)."""
        self._proves: dict[Message, Message] = {}
        """A message received -> the last message sent to its sender known to have arrived with it."""
        steps = self.policy.message_lists(schedule)
        for lists in steps:
            self._proves.update(delivered_by(lists, self.s2r))
        self._last_mb: dict[tuple[str, int, int], int] = {}
        """(kind, sending stage, slice) -> the largest micro-batch of such a message in the last step's lists."""
        for acts in steps[-1]:
            for a in acts:
                if (m := message_of(a, self.s2r)) is not None:
                    kind, stage, mb, sl = m[2]
                    self._last_mb[(kind, stage, sl)] = max(mb, self._last_mb.get((kind, stage, sl), mb))
        self._draining = False

    # ---- the protocol ---------------------------------------------------------------------------
    def run(self, x: Tensor | None, y: Tensor | None, kw: dict[str, Tensor]) -> list[Tensor]:
        self.compute.begin(x, y, kw)
        return self.run_loaded()

    def run_loaded(self) -> list[Tensor]:
        """The step on the batch the compute holds (``compute.begin`` or the sliced loop's ``load``)."""
        try:
            self._execute(self.policy.step_actions())
            losses = self.compute.losses()
        finally:
            self.compute.end()
        if not self.stale:
            self.msgs.reap(wait=True)
            if self.compute.in_flight() or self._got or self._outs or self._grads:
                raise PtplanError(f"position {self.position}'s step ended with work in flight: "
                                  f"{self.compute.in_flight()} micro-batches, {len(self._got)} received, "
                                  f"{len(self._outs)} outputs and {len(self._grads)} gradients unused")
        else:
            self.msgs.reap(wait=False)
        return losses

    def drain(self) -> None:
        self._draining = True
        try:
            self._execute(self.policy.drain_actions())
        finally:
            self._draining = False
        self.msgs.reap(wait=True)
        self.policy.restart()

    def recv_buffers(self) -> list[Tensor]:
        return list(self.msgs.buffers.values())

    # ---- actions --------------------------------------------------------------------------------
    def _execute(self, actions: Sequence[Action]) -> None:
        for a in actions:
            if TRACE is not None:
                TRACE.append((self.position, str(a)))
            k, c, m, sl = a.kind, a.stage, a.mb, a.slice
            if k is ActionKind.F:
                self._forward(c, m, sl)
            elif k is ActionKind.B:
                self._backward(c, m, sl, full=(c, m) not in self.split)
            elif k is ActionKind.W:
                self._backward_weight(c, m, sl)
            elif k is ActionKind.RECV_F or k is ActionKind.RECV_B:
                src, _, msg = message_of(a, self.s2r)  # type: ignore[misc]  # a receive is a message
                key = (msg[0], c, self.policy.mb_key(m), sl)
                self._got[key] = self.msgs.recv(key, src, self.policy.slot(key))
                arrived = self._arrived(msg)
                if arrived is not None:
                    self.msgs.release(src, arrived)
            elif k is ActionKind.SEND_F:
                _, dst, msg = message_of(a, self.s2r)  # type: ignore[misc]
                self.msgs.send(self._outs.pop((c, m, sl)), ("F", c + 1, self.policy.mb_key(m), sl), dst, msg)
            elif k is ActionKind.SEND_B:
                g = self._grads.pop((c, m, sl))
                if g is None:
                    raise PtplanError(f"{a}: stage {c}'s input got no gradient to send")
                _, dst, msg = message_of(a, self.s2r)  # type: ignore[misc]
                self.msgs.send(g, ("B", c - 1, self.policy.mb_key(m), sl), dst, msg)
            elif k is ActionKind.ALLREDUCE:
                self.policy.reduce(self.compute, c)
            else:
                raise PtplanError(f"the step interpreter cannot run {a}")

    def _arrived(self, msg: Message) -> Message | None:
        """The last message this position sent to ``msg``'s sender that ``msg`` proves arrived, or None. Past the
        lists' window (2BW's periodic steps) the proof is the last stretch's, shifted by whole periods."""
        if self._draining:  # the drain's lists are not the window's: its sends wait for its end
            return None
        got = self._proves.get(msg)
        period, kind, stage, mb, sl = self.policy.period, *msg
        if got is None and period:
            hi = self._last_mb.get((kind, stage, sl))
            if hi is not None and mb > hi:
                k = -(-(mb - hi) // period)
                base = self._proves.get((kind, stage, mb - k * period, sl))
                if base is not None:
                    got = (base[0], base[1], base[2] + k * period, base[3])
        return got

    def _here(self, c: int) -> bool:
        return self.s2r[c] == self.position

    def _forward(self, c: int, m: int, sl: int = 0) -> None:
        if c == 0:
            inp = None
        elif self._here(c - 1):
            inp = self._outs.pop((c - 1, m, sl))
        else:
            inp = self._got.pop(("F", c, self.policy.mb_key(m), sl))
        out = self.compute.forward(c, m, sl, inp)
        if c < self.last:
            self._outs[(c, m, sl)] = out.detach()
        self.policy.after_forward(c, m)

    def _backward(self, c: int, m: int, sl: int = 0, *, full: bool) -> None:
        if c == self.last:
            grad = None
        elif self._here(c + 1):
            grad = self._grads.pop((c + 1, m, sl))
        else:
            grad = self._got.pop(("B", c, self.policy.mb_key(m), sl))
        with self.backward_scope():
            g_in = self.compute.backward(c, m, sl, grad, full=full)
        if c > 0:
            self._grads[(c, m, sl)] = g_in
        self.policy.after_backward(c, m)

    def _backward_weight(self, c: int, m: int, sl: int = 0) -> None:
        with self.backward_scope():
            self.compute.backward_weight(c, m, sl)
