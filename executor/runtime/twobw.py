"""PipeDream-2BW on one rank: flush-free 1F1B across mini-batches, two weight versions, one-step-stale updates.

Legend: K pipeline stages (one per rank, V = 1), M micro-batches per mini-batch, D data-parallel
replicas, s this rank's stage, w = K-s-1 its warm-up forwards; micro-batches are numbered g = t·M + m
across the phase (mini-batch t, micro-batch m).

Order: the continuous 1F1B of ``planner.schedule.two_bw`` — w warm-up forwards once, then forward
g+w and backward g in turn, and the remaining backwards only when the phase ends (``drain``).
``step`` (one call per mini-batch t, the runtime's ``train_step``) runs that order's stretch whose
forwards are mini-batch t's: forwards t·M .. t·M+M-1, each followed by the backward w behind it. No
stretch waits for a later one (stage s's backwards need stage s+1's, which runs them one stretch
earlier or in the same one), so the stretches end without a flush, and a gradient received in
stretch t may have been sent in stretch t-1 (sends are asynchronous; ``drain`` waits for them).

Weights (``Schedule.version``): micro-batch g runs forward and backward with version t = g // M.
The canonical parameter ``p`` (what the optimizer steps, the transitions move and checkpoints save)
always holds the newest version; a version is a set of leaf tensors aliasing a version's storage.
When mini-batch t's last backward ends, its gradient (the mean over its M micro-batches, averaged
over the D replicas) updates the newest version, W(t+1), into W(t+2):
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

Not done here: activation recomputation (the planner's stage model has it; the search does not
choose it) and V > 1 chunks per rank.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from ptplan.planner.errors import PtplanError

RECORD: list[tuple[int, int, str]] | None = None
"""Tests: set to a list to have every pipe append (K, stage, action) as it runs it — ``F<g>``, ``B<g>``,
``U<t>`` (the update with mini-batch t's gradient)."""


class TwoBWPipe:
    """One rank's stage of a 2BW pipeline (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, *, stage: int, K: int, M: int, prev_rank: int | None,
                 next_rank: int | None, loss_fn: Callable[[Tensor, Tensor], Tensor], device: torch.device,
                 update: Callable[[list[tuple[torch.nn.Parameter, Tensor | None]]], None]) -> None:
        if M < K:
            raise PtplanError(f"2BW needs M >= K micro-batches per mini-batch, got M={M} < K={K}; re-plan with "
                              f"--schedule 2bw (the planner only makes M >= K)")
        self.module, self.s, self.K, self.M = module, stage, K, M
        self.prev, self.next = prev_rank, next_rank
        self.loss_fn, self.device, self.update_fn = loss_fn, device, update
        self.warm = K - stage - 1
        self.active = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        """This stage's trainable parameters: the ones with two versions."""
        self.recompute = bool(getattr(module, "recompute", False))
        """Activation recomputation (``Phase.recompute``): the pipe checkpoints the whole functional call
        of a micro-batch, so the backward's rerun sees that micro-batch's weight version (the stage
        module's own checkpoint would rerun outside ``functional_call``, on the newest weights)."""
        if self.recompute:
            module.recompute = False
        self.versions: dict[int, dict[str, Tensor]] = {}
        """Version t -> its leaf tensors (versions 0 and 1 share the weights the pipe starts from)."""
        self._restart()
        self.steps = 0
        """Mini-batches whose forwards have run (the next ``step`` is mini-batch ``steps``)."""
        self.next_b = 0
        """The next micro-batch to run backward."""
        self.saved: dict[int, tuple[Tensor | None, Tensor]] = {}
        """Micro-batch -> (its input if it needs a gradient, its output or loss) until its backward."""
        self.done_b: dict[int, int] = {}
        """Mini-batch -> backwards done."""
        self.sends: list[tuple[dist.Work, Tensor]] = []
        self.losses: list[Tensor] = []

    def _restart(self) -> None:
        """Start from the canonical weights: W(0) = W(1) = them."""
        self.versions = {0: {n: self._leaf(p) for n, p in self.active}, 1: {n: self._leaf(p) for n, p in self.active}}

    @staticmethod
    def _leaf(p: Tensor) -> Tensor:
        """A leaf tensor over p's storage, with its own autograd identity and version counter."""
        return p.data.requires_grad_(True)

    # ---- messages ----------------------------------------------------------------------------
    def _send(self, t: Tensor, dst: int) -> None:
        head = torch.zeros(8, dtype=torch.int64, device=self.device)
        head[0] = t.dim()
        head[1:1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        t = t.detach().contiguous()
        self.sends += [(dist.isend(head, dst), head), (dist.isend(t, dst), t)]

    def _recv(self, src: int, dtype: torch.dtype) -> Tensor:
        head = torch.empty(8, dtype=torch.int64, device=self.device)
        dist.recv(head, src)
        shape = head[1:1 + int(head[0])].tolist()
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src)
        return out

    def _reap(self, wait: bool = False) -> None:
        if wait:
            for work, _ in self.sends:
                work.wait()
            self.sends = []
        else:
            self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, g: int, x: Tensor | None, y: Tensor | None, kw: dict[str, Tensor]) -> None:
        if self.prev is None:
            inp, keep = x, None
        else:
            inp = self._recv(self.prev, self.dtype).requires_grad_(True)
            keep = inp
        params = self.versions[g // self.M]
        if self.recompute:
            out = checkpoint(functional_call, self.module, params, (inp,), kw, use_reentrant=False)
        else:
            out = functional_call(self.module, params, (inp,), kw)
        if self.next is None:
            out = self.loss_fn(out, y)
            self.losses.append(out.detach())
        else:
            self._send(out, self.next)
        self.saved[g] = (keep, out)
        if RECORD is not None:
            RECORD.append((self.K, self.s, f"F{g}"))

    def _backward(self, g: int) -> None:
        inp, out = self.saved.pop(g)
        grad = None if self.next is None else self._recv(self.next, out.dtype)
        torch.autograd.backward(out, grad_tensors=grad)
        if self.prev is not None:
            assert inp is not None and inp.grad is not None, "a received input keeps its gradient"
            self._send(inp.grad, self.prev)
        if RECORD is not None:
            RECORD.append((self.K, self.s, f"B{g}"))
        t = g // self.M
        self.done_b[t] = self.done_b.get(t, 0) + 1
        if self.done_b[t] == self.M:
            del self.done_b[t]
            self._update(t)
        self._reap()

    def _update(self, t: int) -> None:
        """Mini-batch t's gradient (mean over its micro-batches) makes version t+2 from version t+1."""
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
        self.update_fn(pairs)  # sets p.grad, averages it over the replicas, steps the optimizer, clears it
        self.versions[t + 2] = {n: self._leaf(p) for n, p in self.active}
        if RECORD is not None:
            RECORD.append((self.K, self.s, f"U{t}"))

    @property
    def dtype(self) -> torch.dtype:
        return next((p.dtype for _, p in self.active), torch.float32)

    def step(self, x: Tensor | None, y: Tensor | None, kw: dict[str, Tensor]) -> list[Tensor]:
        """Mini-batch t = ``steps``: its M forwards, each followed by the backward w behind it (from the
        second mini-batch on; the first starts with the warm-up). ``x``, ``y`` and ``kw`` hold the
        pipeline's whole mini-batch (split here into M micro-batches). Returns the last stage's M
        losses (empty elsewhere)."""
        M, t = self.M, self.steps
        xs = torch.tensor_split(x, M) if x is not None else [None] * M
        ys = torch.tensor_split(y, M) if y is not None else [None] * M
        kws = [dict(zip(kw, parts)) for parts in zip(*(torch.tensor_split(v, M) for v in kw.values()))] \
            if kw else [{}] * M
        self.losses = []
        for m in range(M):
            g = t * M + m
            self._forward(g, xs[m], ys[m], kws[m])
            if g - self.warm >= 0:
                assert self.next_b == g - self.warm, (self.next_b, g, self.warm)
                self._backward(self.next_b)
                self.next_b += 1
        self.steps += 1
        return self.losses

    def drain(self) -> None:
        """Run the outstanding backwards and updates (the phase ends, or a checkpoint or snapshot gathers the
        weights): the canonical weights are then the newest version, every gradient applied; wait for
        every send; and start again from them (W(0) = W(1) = them) should more mini-batches follow."""
        end = self.steps * self.M
        while self.next_b < end:
            self._backward(self.next_b)
            self.next_b += 1
        self._reap(wait=True)
        self.steps = self.next_b = 0
        self._restart()
