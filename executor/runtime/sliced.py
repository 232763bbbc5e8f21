"""Token-sliced pipelined training (TeraPipe) for causal LMs: slice-aware layers, a stage that keeps each
sequence's keys and values, and the step interpreter's compute for slices (``SliceCompute``: the one
interpreter, ``step.StepInterpreter``, runs a sliced schedule's actions, the slice index on each action).

Legend: L tokens per sequence, a slice of s tokens at offset c (the c earlier tokens of the same
sequence are its context), K stages, M micro-batches, S slices per micro-batch.

How gradients flow through the cached keys and values. Slice i of a micro-batch runs every attention
layer of the stage with its own keys/values k_i, v_i (outputs of its graph) and, as the context, the
earlier slices' k_<i, v_<i concatenated and *detached into a leaf* that requires grad. Backwards run
in reverse slice order (the schedule must say so; ``check_slice_order``): the backward of slice i
seeds autograd with the output's gradient and with the gradient its own k_i, v_i received from the
later slices' context leaves (already accumulated, as those slices ran first), then splits its
context leaves' gradients and adds them to the earlier slices' k/v gradients. Each slice's graph is
therefore used once and the whole sequence's gradient is exact; the loss is the whole sequence's
next-token cross-entropy (each slice adds its tokens' sum divided by the micro-batch's token count).

Supported layers: those of the families with token slices (GPT-2, Llama, Mistral, Qwen2: each family file's
``slice_forward``, through ``families.registry``) at either granularity (embedding, attention and MLP halves
or whole blocks, final norm, head). Dropout must be off (a
slice cannot replay the unsliced run's random masks; the parity tests build models with dropout 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.schedule import ActionKind, Schedule, ScheduleError

from ptplan.executor.families.registry import is_attention, slice_forward

KV = tuple[Tensor, Tensor]

RECORD: list[tuple[int, int, tuple[int, ...]]] | None = None
"""Tests: set to a list to have every step of a token-sliced phase in the elastic runtime (``sliced_compute``)
append (K, position, slices) as it runs."""


# ---- slice-aware layers --------------------------------------------------------------------------

def slice_loss(logits: Tensor, labels: Tensor, offset: int, count: int) -> Tensor:
    """The slice's share of the micro-batch's next-token loss: Σ cross-entropy over its positions p < L-1
    (target labels[:, p+1], -100 ignored) / ``count`` (valid targets of the whole micro-batch)."""
    L = labels.shape[1]
    s = logits.shape[1]
    n = min(s, L - 1 - offset)
    if n <= 0:
        return logits.sum() * 0.0
    lg = logits[:, :n].float()
    tgt = labels[:, offset + 1:offset + 1 + n]
    return F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), ignore_index=-100,
                           reduction="sum") / count


# ---- one stage ------------------------------------------------------------------------------------

@dataclass
class _Slice:
    x: Tensor | None
    """The received input (a leaf requiring grad; None on stage 0)."""
    out: Tensor
    kv: list[KV]
    """Per attention layer: this slice's keys and values (graph outputs)."""
    past: list[KV | None]
    """Per attention layer: the context leaves (earlier slices' k/v, detached, requiring grad)."""
    kv_grad: list[list[Tensor | None]] = field(default_factory=list)
    """Per attention layer: [k grad, v grad] accumulated from later slices."""


class SlicedStage:
    """The layers of one pipeline stage run slice by slice, keeping each micro-batch's keys and values.

    ``forward(mb, sl, x, offset)`` runs slice ``sl`` (in order 0, 1, ... per micro-batch);
    ``backward(mb, sl, grad)`` runs them in reverse order and returns the input's gradient (None on
    stage 0). On the last stage the output is the slice's loss (``labels`` and ``count`` given to
    ``forward``) and ``backward`` takes no gradient. ``prefix`` (stage 0 only): frozen layers before the
    active ones, run unsliced under no_grad on the whole micro-batch (``run_prefix``); the active layers
    then take slices of its output."""

    def __init__(self, layers: Sequence[nn.Module], *, first: bool, last: bool,
                 prefix: Sequence[nn.Module] = ()) -> None:
        if prefix and not first:
            raise PtplanError("only the first stage runs the frozen prefix")
        if not layers:
            raise PtplanError("a token-sliced stage needs at least one active layer")
        self.prefix = list(prefix)
        self.layers = list(layers)
        self.first, self.last = first, last
        self.attn = [i for i, m in enumerate(self.layers) if is_attention(m)]
        self.state: dict[tuple[int, int], _Slice] = {}

    def run_prefix(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """The frozen prefix on a whole micro-batch (no grad, unsliced): what the active layers slice."""
        with torch.no_grad():
            x = ids
            for layer in self.prefix:
                x = layer(x, attention_mask=attention_mask)
        return x

    def forward(self, mb: int, sl: int, x: Tensor, offset: int, attention_mask: Tensor | None = None,
                labels: Tensor | None = None, count: int = 1) -> Tensor:
        if (mb, sl) in self.state or (sl > 0 and (mb, sl - 1) not in self.state):
            raise ScheduleError(f"slice {sl} of micro-batch {mb} runs out of order on this stage (forwards go 0, 1, "
                                f"... per micro-batch, once each)")
        inp = None
        if not self.first:
            inp = x = x.detach().requires_grad_(True)
        kvs: list[KV] = []
        pasts: list[KV | None] = []
        j = 0
        for i, layer in enumerate(self.layers):
            past: KV | None = None
            if i in self.attn and sl > 0:
                prev = [self.state[(mb, t)].kv[j] for t in range(sl)]
                past = (torch.cat([p[0].detach() for p in prev], dim=2).requires_grad_(True),
                        torch.cat([p[1].detach() for p in prev], dim=2).requires_grad_(True))
            x, kv = slice_forward(layer, x, offset, past, attention_mask)
            if kv is not None:
                kvs.append(kv)
                pasts.append(past)
                j += 1
        if self.last:
            if labels is None:
                raise PtplanError("the last stage needs the labels to compute the slice's loss")
            x = slice_loss(x, labels, offset, count)
        self.state[(mb, sl)] = _Slice(x=inp, out=x, kv=kvs, past=pasts,
                                      kv_grad=[[None, None] for _ in kvs])
        return x

    def backward(self, mb: int, sl: int, grad: Tensor | None) -> Tensor | None:
        st = self.state.pop((mb, sl), None)
        if st is None or any(k[0] == mb and k[1] > sl for k in self.state):
            raise ScheduleError(f"backward of slice {sl} of micro-batch {mb} before its forward or before a later "
                                f"slice's backward (token slices run backward in reverse order)")
        outs: list[Tensor] = [st.out]
        grads: list[Tensor] = [torch.ones_like(st.out) if self.last else grad]  # type: ignore[list-item]
        for (k, v), (gk, gv) in zip(st.kv, st.kv_grad):
            for t, g in ((k, gk), (v, gv)):
                if g is not None:
                    outs.append(t)
                    grads.append(g)
        torch.autograd.backward(outs, grads)
        for j, past in enumerate(st.past):  # hand the context's gradient to the earlier slices' k/v
            if past is None:
                continue
            a = 0
            for u in range(sl):
                prev = self.state[(mb, u)]
                n = prev.kv[j][0].shape[2]
                for w in range(2):
                    g = past[w].grad
                    if g is None:
                        continue
                    part = g[:, :, a:a + n]
                    cur = prev.kv_grad[j][w]
                    prev.kv_grad[j][w] = part.clone() if cur is None else cur + part
                a += n
        return None if st.x is None else st.x.grad


def offsets(slices: Sequence[int]) -> list[int]:
    out, c = [], 0
    for s in slices:
        out.append(c)
        c += s
    return out


def check_slice_order(schedule: Schedule) -> None:
    """Raise ScheduleError unless, on every stage, each micro-batch's slices run forward in order 0..S-1 and
    backward in reverse order S-1..0 (the keys and values of earlier slices are needed, and their gradients
    complete, in that order)."""
    S = schedule.slices
    for acts in schedule.actions:
        fw: dict[tuple[int, int], int] = {}
        bw: dict[tuple[int, int], int] = {}
        for a in acts:
            if a.kind is ActionKind.F:
                want = fw.get((a.stage, a.mb), 0)
                if a.slice != want:
                    raise ScheduleError(f"{a}: stage {a.stage} runs slice {a.slice} of micro-batch {a.mb} forward "
                                        f"where slice {want} is due (slices go forward in order)")
                fw[(a.stage, a.mb)] = want + 1
            elif a.kind is ActionKind.B:
                want = bw.get((a.stage, a.mb), S - 1)
                if a.slice != want:
                    raise ScheduleError(f"{a}: stage {a.stage} runs slice {a.slice} of micro-batch {a.mb} backward "
                                        f"where slice {want} is due (slices go backward in reverse order)")
                bw[(a.stage, a.mb)] = want - 1
            elif a.kind is ActionKind.W:
                raise ScheduleError(f"{a}: token-sliced stages run whole backwards (no W)")


# ---- the slice compute of the step interpreter ---------------------------------------------------

class SliceCompute:
    """The step interpreter's compute for token slices (``step.StepInterpreter``): action (stage, micro-batch m,
    slice sl) runs slice sl of micro-batch m through this position's ``SlicedStage`` -- on position 0 the tokens
    ``[offset, offset + length)`` of the micro-batch (after the frozen prefix, run once per micro-batch), elsewhere
    the received slice. Each slice's loss is its share of the mean over micro-batches of each micro-batch's mean
    next-token loss, so ``reduce`` divides nothing; it averages the stage's gradients over ``dp_group`` when given
    (the elastic runtime averages them itself and gives none)."""

    def __init__(self, stage: SlicedStage, slices: Sequence[int], M: int, *,
                 dp_group: dist.ProcessGroup | None = None) -> None:
        if sum(slices) < 1:
            raise PtplanError(f"slice lengths {list(slices)} cover no token")
        self.stage, self.slices, self.M, self.dp_group = stage, list(slices), M, dp_group
        self.offs = offsets(slices)
        self.inputs: Sequence[Tensor] | None = None
        self.labels: Sequence[Tensor] | None = None
        self.masks: Sequence[Tensor] | None = None
        self.counts: list[int] = []
        self.prefix_out: dict[int, Tensor] = {}
        self.total = 0.0
        self.where: tuple[int, int] | None = None
        """(K, position) in the elastic runtime, for ``RECORD``."""

    def load(self, inputs: Sequence[Tensor] | None, labels: Sequence[Tensor] | None,
             masks: Sequence[Tensor] | None) -> None:
        """The step's micro-batches (``inputs`` on stage 0, ``labels`` on the last): per micro-batch, [b, L] ids."""
        if (inputs if self.stage.first else labels) is None:
            raise PtplanError("the token-sliced stage needs its inputs (position 0) or labels (last position)")
        self.inputs, self.labels, self.masks = inputs, labels, masks
        self.counts = [int((lab[:, 1:] != -100).sum()) for lab in labels] if labels is not None else [1] * self.M
        self.total = 0.0

    def begin(self, x: Tensor | None, y: Tensor | None, kw: dict[str, Tensor]) -> None:
        """The pipeline's batch, split into M micro-batches as torch's schedules split (``tensor_split``)."""
        ref = x if self.stage.first else y
        L = sum(self.slices)
        if ref is not None and ref.shape[1] != L:
            raise PtplanError(f"the phase cuts sequences of {L} tokens into slices {self.slices} but the batch has "
                              f"sequences of {ref.shape[1]}; plan with the data's sequence length")
        if RECORD is not None and self.where is not None:
            RECORD.append((*self.where, tuple(self.slices)))
        split = (lambda t: None if t is None else list(t.tensor_split(self.M)))
        self.load(split(x) if self.stage.first else None, split(y) if self.stage.last else None,
                  split(kw.get("attention_mask")))

    def end(self) -> None:
        self.inputs = self.labels = self.masks = None
        self.prefix_out = {}

    def in_flight(self) -> int:
        return len(self.stage.state)

    def forward(self, c: int, m: int, sl: int, inp: Tensor | None) -> Tensor:
        st, off, n = self.stage, self.offs[sl], self.slices[sl]
        mask = None if self.masks is None else self.masks[m]
        if st.first:
            assert self.inputs is not None
            src = self.inputs[m]
            if st.prefix:
                if sl == 0:
                    self.prefix_out[m] = st.run_prefix(src, mask)
                src = self.prefix_out[m] if sl < len(self.slices) - 1 else self.prefix_out.pop(m)
            inp = src[:, off:off + n]
        assert inp is not None
        out = st.forward(m, sl, inp, off, mask, labels=None if self.labels is None else self.labels[m],
                         count=self.counts[m] * self.M)
        if st.last:
            self.total += float(out.detach())
        return out

    def backward(self, c: int, m: int, sl: int, grad: Tensor | None, *, full: bool) -> Tensor | None:
        return self.stage.backward(m, sl, grad)

    def backward_weight(self, c: int, m: int, sl: int) -> None:
        raise ScheduleError(f"{c}W{m}.{sl}: token-sliced stages run whole backwards (no W)")

    def reduce(self, c: int) -> None:
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            n = dist.get_world_size(self.dp_group)
            for layer in self.stage.layers:
                for p in layer.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=self.dp_group)
                        p.grad.div_(n)

    def losses(self) -> list[Tensor]:
        """On the last position, the step's loss (one float64 tensor); elsewhere nothing."""
        return [torch.tensor(self.total, dtype=torch.float64)] if self.stage.last else []


def run_sliced_step(schedule: Schedule, stage: SlicedStage, *, position: int, ranks: Sequence[int],
                    slices: Sequence[int], inputs: Sequence[Tensor] | None, labels: Sequence[Tensor] | None,
                    hidden: int | None = None, dtype: torch.dtype | None = None,
                    group: dist.ProcessGroup | None = None, dp_group: dist.ProcessGroup | None = None,
                    attention_mask: Sequence[Tensor] | None = None, device: torch.device | str = "cpu") -> float:
    """Run position ``position``'s actions of a token-sliced schedule (one stage per position) with the step
    interpreter: forwards and backwards of each (micro-batch, slice), point-to-point messages with the
    neighbouring positions (global ranks ``ranks[k]``), and, at ALLREDUCE, the average of the stage's gradients
    over ``dp_group`` (skipped when None). Gradients accumulate in the stage's parameters; the caller steps the
    optimizer. ``inputs`` (stage 0) and ``labels`` (last stage): per micro-batch, ``[b, L]`` ids. Returns, on the
    last position, the mean over micro-batches of each micro-batch's mean next-token loss (0.0 elsewhere).
    ``hidden`` and ``dtype`` are not needed (a message's shape and dtype travel with its first send)."""
    from ptplan.executor.runtime.step import StepInterpreter

    if len(slices) != schedule.slices:
        raise PtplanError(f"{len(slices)} slice lengths {list(slices)} for a schedule with slices={schedule.slices}")
    check_slice_order(schedule)
    if schedule.stage_to_rank != tuple(range(schedule.K)):
        raise PtplanError("the token-sliced loop runs one stage per position (stage_to_rank = 0..K-1)")
    compute = SliceCompute(stage, slices, schedule.M, dp_group=dp_group)
    compute.load(inputs, labels, attention_mask)
    step = StepInterpreter(schedule, position, compute, group=group, device=torch.device(device), ranks=ranks)
    losses = step.run_loaded()
    return float(losses[0]) if losses else 0.0


def sliced_compute(model: Any, phase: Any, position: int, *, cached_prefix: bool) -> SliceCompute:
    """Position ``position``'s compute in a token-sliced phase (``Phase.slices``) of the elastic runtime, on the
    canonical model's layers (``model.layers[lo:hi]`` of the phase's partition, plus on position 0 the frozen
    prefix ``[0, frozen_layers)`` unless the AutoCache serves it), so a phase transition moves their weights and
    optimizer state as for any phase; each step runs the whole schedule and leaves the gradients in the
    parameters, for the runtime to average and step."""
    lo, hi = phase.partition[position]
    first, last = position == 0, position == phase.K - 1
    prefix = model.layers[:phase.frozen_layers] if first and not cached_prefix else []
    stage = SlicedStage(model.layers[lo:hi], first=first, last=last, prefix=prefix)
    compute = SliceCompute(stage, tuple(phase.slices), phase.M)
    compute.where = (phase.K, position)
    return compute
