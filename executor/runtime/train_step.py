"""One rank's training step in a phase: forward, backward, gradient average and optimizer step.

``train_step`` is ``elastic.ElasticRuntime.train_step``'s body: it feeds stage 0 the shard (or, in a caching
phase, the AutoCache's prefix output), runs the phase's step (``step.StepInterpreter``), averages the
gradients (``gradients``), clips, steps the optimizer, and sums the loss and the per-block gradient norms
over the world in one all-reduce. A PipeDream-2BW phase (``twobw``) updates the weights inside its step.
Legend: D pipelines (the data-parallel width), L blocks.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from ptplan.executor.cache.autocache import prefix_forward
from ptplan.executor.runtime.collective import agree
from ptplan.executor.runtime.gradients import add_block_norms, allreduce_grads, clip

if TYPE_CHECKING:
    from ptplan.executor.runtime.elastic import ElasticRuntime

Batch = tuple[Tensor, Tensor, Tensor | None]


def train_step(rt: ElasticRuntime, batch: Batch, *, want_norms: bool, ids: Tensor | None = None
               ) -> tuple[float, list[float]]:
    """Forward, backward, data-parallel gradient average and optimizer step on this rank's shard.

    ``ids``: the shard's sample ids (needed when the phase caches the frozen prefix). Returns the
    global mean loss and, with ``want_norms``, the per-block gradient norms (every rank gets the
    same numbers: one all-reduce over the world).
    """
    rt._reshard()  # after an evaluation (``drain``)
    ph, place = rt.phase, rt.groups.place
    first, last = 0 in rt.chunks, ph.stages - 1 in rt.chunks
    x, y, mask = (None if t is None else t.to(rt.device) for t in batch)
    rt.last_cache_s = None
    if first and rt._caches(ph):  # the shard's prefix output, micro-batch by micro-batch
        assert ids is not None, "a caching phase needs the shard's sample ids"
        t0 = time.perf_counter()
        x = prefix_forward(rt.model, x, mask, ids, ph.frozen_layers, rt.cache,
                           micro_batch_size=ph.micro_batch_size)
        rt.last_cache_s = time.perf_counter() - t0
        if rt.memory_hook is not None:
            rt.memory_hook("buffers", x)
    kw = {} if mask is None else {"attention_mask": mask}
    x, y = (x if first else None), (y if last else None)
    assert rt.schedule is not None, "train_step before the first switch"
    if rt.schedule.stale:  # 2BW: the step updates the weights itself
        return _train_step_2bw(rt, x, y, kw, want_norms=want_norms)
    rt.opt.zero_grad(set_to_none=True)
    losses = rt.schedule.run(x, y, kw)  # gradients left in the parameters
    t0 = time.perf_counter()
    allreduce_grads(rt)  # all but the FSDP layers' (reduce-scattered in the backward)
    rt.last_allreduce_s = time.perf_counter() - t0
    if rt.clip_grad_norm is not None:
        clip(rt)
    rt.opt.step()
    L = rt.model.num_blocks
    vec = torch.zeros(2 + (L if want_norms else 0), dtype=torch.float64, device=rt.device)
    if last and place.tp == 0:  # a tensor-parallel group's ranks compute the same loss
        vec[0] = torch.stack([loss.double() for loss in losses]).mean()
    if want_norms:  # one replica per stage counts its (averaged) gradients (``gradients.grad_sq``)
        add_block_norms(rt, vec)
    return _reduce(rt, vec)


def _reduce(rt: ElasticRuntime, vec: Tensor) -> tuple[float, list[float]]:
    """The step's one all-reduce: [loss, block norms squared ..., stop]; the last entry is ``rt.stop_reason``'s flag,
    so that a problem one rank found (rank 0's run log on a full disk) stops every rank here, with its message."""
    vec[-1] = 1.0 if rt.stop_reason else 0.0
    dist.all_reduce(vec)
    vec = vec.cpu()
    if vec[-1].item() > 0:
        agree(rt.stop_reason)
    return vec[0].item() / rt.phase.D, [math.sqrt(v) for v in vec[1:-1].tolist()]


def _train_step_2bw(rt: ElasticRuntime, x: Tensor | None, y: Tensor | None, kw: dict[str, Tensor], *,
                    want_norms: bool) -> tuple[float, list[float]]:
    """``train_step`` in a 2BW phase: one mini-batch's stretch (``twobw``); the loss is the mean over
    the mini-batch's micro-batches at its weight version; the norms are those of the gradients that
    updated this rank's stage during the stretch (zero where none did)."""
    pipe = rt.schedule
    assert pipe is not None
    L = rt.model.num_blocks
    rt._norms = [0.0] * L if want_norms else None
    rt.last_allreduce_s = 0.0
    losses = pipe.run(x, y, kw)
    vec = torch.zeros(2 + (L if want_norms else 0), dtype=torch.float64, device=rt.device)
    if losses:
        vec[0] = torch.stack([loss.double() for loss in losses]).mean()
    if want_norms:
        vec[1:-1] = torch.tensor(rt._norms, dtype=torch.float64)
    rt._norms = None
    return _reduce(rt, vec)
