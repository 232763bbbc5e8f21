"""Token-sliced pipelined training (TeraPipe) for causal LMs: slice-aware layers, a stage that keeps each
sequence's keys and values, and a point-to-point loop that runs a sliced schedule's actions.

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
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.schedule import ActionKind, Schedule, ScheduleError

from ptplan.executor.families.registry import is_attention, slice_forward

KV = tuple[Tensor, Tensor]

RECORD: list[tuple[int, int, tuple[int, ...]]] | None = None
"""Tests: set to a list to have every ``SlicedPipe.step`` append (K, position, slices) as it runs."""


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
            for t in range(sl):
                prev = self.state[(mb, t)]
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


# ---- the point-to-point loop ----------------------------------------------------------------------

def run_sliced_step(schedule: Schedule, stage: SlicedStage, *, position: int, ranks: Sequence[int],
                    slices: Sequence[int], inputs: Sequence[Tensor] | None, labels: Sequence[Tensor] | None,
                    hidden: int, dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None,
                    dp_group: dist.ProcessGroup | None = None, attention_mask: Sequence[Tensor] | None = None,
                    device: torch.device | str = "cpu") -> float:
    """Run position ``position``'s actions of a token-sliced schedule (one stage per position): forwards and
    backwards of each (micro-batch, slice), point-to-point sends and receives with the neighbouring
    positions (global ranks ``ranks[k]``), and, at ALLREDUCE, the average of the stage's gradients over
    ``dp_group`` (skipped when None; the elastic runtime averages them itself). Receive buffers go on
    ``device``. Gradients accumulate in the stage's parameters; the caller steps
    the optimizer. ``inputs`` (stage 0) and ``labels`` (last stage): per micro-batch, ``[b, L]`` ids.
    The gradient is that of the mean over micro-batches of each micro-batch's mean next-token loss.
    Returns that loss on the last position (0.0 elsewhere)."""
    if sum(slices) < 1 or len(slices) != schedule.slices:
        raise PtplanError(f"{len(slices)} slice lengths {list(slices)} for a schedule with slices={schedule.slices}")
    check_slice_order(schedule)
    M = schedule.M
    offs = offsets(slices)
    K = schedule.K
    if schedule.stage_to_rank != tuple(range(K)):
        raise PtplanError("the token-sliced loop runs one stage per position (stage_to_rank = 0..K-1)")
    ref = labels if labels is not None else inputs
    if ref is None:
        raise PtplanError("give the inputs (stage 0) or the labels (last stage) so the micro-batch size is known")
    b = ref[0].shape[0]
    counts = [int((lab[:, 1:] != -100).sum()) for lab in labels] if labels is not None else [1] * M
    received: dict[tuple[bool, int, int], Tensor] = {}
    grads_in: dict[tuple[int, int], Tensor | None] = {}
    outputs: dict[tuple[int, int], Tensor] = {}
    pending: list[dist.Work] = []
    prefix_out: dict[int, Tensor] = {}
    loss = 0.0
    for a in schedule.actions[position]:
        k, m, sl = a.kind, a.mb, a.slice
        shape = (b, slices[sl], hidden)
        mask = None if attention_mask is None else attention_mask[m]
        if k is ActionKind.RECV_F or k is ActionKind.RECV_B:
            fwd = k is ActionKind.RECV_F
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src=ranks[a.stage - 1 if fwd else a.stage + 1], group=group)
            received[(fwd, m, sl)] = buf
        elif k is ActionKind.F:
            if stage.first:
                assert inputs is not None
                src = inputs[m]
                if stage.prefix:
                    if sl == 0:
                        prefix_out[m] = stage.run_prefix(inputs[m], mask)
                    src = prefix_out[m] if sl < len(slices) - 1 else prefix_out.pop(m)
                x = src[:, offs[sl]:offs[sl] + slices[sl]]
            else:
                x = received.pop((True, m, sl))
            out = stage.forward(m, sl, x, offs[sl], mask, labels=None if labels is None else labels[m],
                                count=counts[m] * M)
            if stage.last:
                loss += float(out.detach())
            outputs[(m, sl)] = out.detach()
        elif k is ActionKind.SEND_F:
            pending.append(dist.isend(outputs.pop((m, sl)).contiguous(), dst=ranks[a.stage + 1], group=group))
        elif k is ActionKind.B:
            outputs.pop((m, sl), None)
            g = None if stage.last else received.pop((False, m, sl))
            grads_in[(m, sl)] = stage.backward(m, sl, g)
        elif k is ActionKind.SEND_B:
            g_in = grads_in.pop((m, sl))
            assert g_in is not None
            pending.append(dist.isend(g_in.contiguous(), dst=ranks[a.stage - 1], group=group))
        elif k is ActionKind.ALLREDUCE:
            if dp_group is not None and dist.get_world_size(dp_group) > 1:
                n = dist.get_world_size(dp_group)
                for layer in stage.layers:
                    for p in layer.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad, group=dp_group)
                            p.grad.div_(n)
        else:
            raise ScheduleError(f"the token-sliced loop cannot run {a}")
    for w in pending:
        w.wait()
    if stage.state:
        raise ScheduleError(f"{len(stage.state)} slices ran forward without a backward on position {position}")
    return loss


# ---- in the elastic runtime ------------------------------------------------------------------------

class SlicedPipe:
    """One rank's stage of a token-sliced phase (``Phase.slices``) in the elastic runtime: what
    ``runtime.ElasticRuntime`` runs instead of torch's schedule, as it runs ``twobw.TwoBWPipe`` for 2BW.

    The stage's layers are the canonical model's (``model.layers[lo:hi]`` of the phase's partition, plus on
    position 0 the frozen prefix ``[0, frozen_layers)`` unless the AutoCache serves it), so a phase
    transition moves their weights and optimizer state as for any phase and nothing outlives a ``step``:
    each step runs the whole schedule (every slice's forward and backward) and leaves the gradients in the
    parameters; the runtime averages them over the data-parallel group and steps the optimizer. There is
    nothing to drain."""

    def __init__(self, model: nn.Module, phase, schedule: Schedule, *, position: int, row: Sequence[int],
                 cached_prefix: bool, group: dist.ProcessGroup | None, device: torch.device) -> None:
        K = phase.K
        lo, hi = phase.partition[position]
        first, last = position == 0, position == K - 1
        prefix = model.layers[:phase.frozen_layers] if first and not cached_prefix else []
        self.stage = SlicedStage(model.layers[lo:hi], first=first, last=last, prefix=prefix)
        self.schedule, self.position, self.ranks = schedule, position, list(row)
        self.slices, self.M, self.group, self.device = tuple(phase.slices), phase.M, group, device
        self.hidden = int(model.config.hidden_size)
        self.first, self.last = first, last

    def step(self, x: Tensor | None, y: Tensor | None, mask: Tensor | None) -> list[Tensor]:
        """One iteration on this rank's shard of the batch (``x``: ids, or the cached prefix's output, on
        position 0; ``y``: labels on the last): split into M micro-batches as torch's schedules split
        (``tensor_split``), each sequence cut into the phase's slices. Returns, on the last position, the
        mean over micro-batches of each micro-batch's mean loss (one tensor); elsewhere nothing."""
        ref = x if self.first else y
        if ref is None:
            raise PtplanError("the token-sliced stage needs its inputs (position 0) or labels (last position)")
        L = sum(self.slices)
        if ref.shape[1] != L:
            raise PtplanError(f"the phase cuts sequences of {L} tokens into slices {list(self.slices)} but the batch "
                              f"has sequences of {ref.shape[1]}; plan with the data's sequence length")
        M = self.M
        if RECORD is not None:
            RECORD.append((self.schedule.K, self.position, self.slices))
        split = (lambda t: None if t is None else list(t.tensor_split(M)))
        dtype = next((p.dtype for m in self.stage.layers for p in m.parameters()), torch.float32)
        loss = run_sliced_step(self.schedule, self.stage, position=self.position, ranks=self.ranks,
                               slices=self.slices, inputs=split(x) if self.first else None,
                               labels=split(y) if self.last else None, hidden=self.hidden, dtype=dtype,
                               group=self.group, dp_group=None, attention_mask=split(mask), device=self.device)
        return [torch.tensor(loss, dtype=torch.float64)] if self.last else []
