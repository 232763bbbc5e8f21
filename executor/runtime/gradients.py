"""One rank's gradient work after a step's backward: the data-parallel average, clipping and per-block norms.

Functions of an ``elastic.ElasticRuntime`` (its phase, groups, owned layers and sharded stage): the flat
all-reduce of the gradients over the position's data-parallel group (never DDP around a stage; FSDP layers
are left out, their gradients reduce-scattered in the backward), the global-norm clip, each rank's share of
a whole-model squared norm (each stage counted once), and PipeDream-2BW's per-stage update.
Legend: D pipelines (the data-parallel width), tp the tensor-parallel width.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ptplan.executor.runtime.hybrid import local, tp_split

if TYPE_CHECKING:
    from ptplan.executor.runtime.elastic import ElasticRuntime


def live_params(rt: ElasticRuntime, i: int) -> list[torch.nn.Parameter]:
    """Layer i's parameters as they train now (FSDP: the sharded ones)."""
    return rt.layer_params[i] if rt.sharded is None else rt.sharded.params(i)


def fsdp_layer(rt: ElasticRuntime, i: int) -> bool:
    """Whether layer i trains FSDP-sharded now (its gradient reduce-scattered, a shard per replica)."""
    return rt.sharded is not None and i in rt.sharded.fsdp_layers


def grad_sq(rt: ElasticRuntime, g: Tensor, i: int) -> Tensor:
    """This rank's share of the squared norm of layer i's gradient ``g`` in a whole-model norm summed over
    the world: each stage counted once -- on pipeline 0, or for an FSDP layer on every replica (each its
    shard); a tensor-parallel shard on every tp rank, a replicated tensor on tp index 0 only."""
    place = rt.groups.place
    zero = torch.zeros((), dtype=torch.float64, device=rt.device)
    if not (place.pipeline == 0 or fsdp_layer(rt, i)):
        return zero
    if place.tp != 0 and not tp_split(g):
        return zero
    return local(g).double().pow(2).sum()


def owned_grads(rt: ElasticRuntime) -> list[tuple[int, Tensor]]:
    """(layer, gradient) of every owned layer's parameters that have one."""
    return [(i, p.grad) for i in rt.owned for p in live_params(rt, i) if p.grad is not None]


def allreduce_grads(rt: ElasticRuntime) -> None:
    """Average the gradients over the data-parallel group with one flat all-reduce (per dtype), leaving
    out the FSDP layers' (reduce-scattered in the backward). Every rank of the group holds the same
    chunks, so all of them leave out the same layers."""
    start_allreduce_grads(rt)()


def start_allreduce_grads(rt: ElasticRuntime) -> Callable[[], None]:
    """``allreduce_grads`` begun: the flat all-reduces are launched (asynchronous) and the returned call waits
    for them and writes the averages back into the gradients, which must not change in between (PipeDream-2BW
    overlaps it with the next mini-batch's work: ``twobw_update``)."""
    ph = rt.phase
    if ph.D == 1:
        return lambda: None
    # tensor parallel: each rank its shards
    grads = [local(g) for i, g in owned_grads(rt) if not fsdp_layer(rt, i)]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    launched = []
    for _, gs in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([g.reshape(-1) for g in gs])  # the stage's one transient (planner/stage.py's "after")
        if rt.memory_hook is not None:
            rt.memory_hook("transient", flat)
        launched.append((gs, flat, dist.all_reduce(flat, group=rt.groups.dp_group, async_op=True)))

    def finish() -> None:
        for gs, flat, work in launched:
            work.wait()
            flat.div_(ph.D)
            off = 0
            for g in gs:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
        launched.clear()

    return finish


def clip(rt: ElasticRuntime) -> None:
    """Scale every gradient by min(1, c / (norm + 1e-6)), norm the global norm of the whole model's
    gradients after the data-parallel average: each stage's squares counted once (on pipeline 0's
    replica), summed over the world -- ``clip_grad_norm_``'s rule on the whole model, in one all-reduce."""
    assert rt.clip_grad_norm is not None
    grads = owned_grads(rt)
    sq = torch.zeros(1, dtype=torch.float64, device=rt.device)
    for i, g in grads:
        sq += grad_sq(rt, g, i)
    dist.all_reduce(sq)
    norm = math.sqrt(float(sq.item()))
    rt.last_grad_norm = norm
    coef = rt.clip_grad_norm / (norm + 1e-6)
    if coef < 1.0:
        for _, g in grads:
            g.mul_(coef)


def add_block_norms(rt: ElasticRuntime, vec: Tensor) -> None:
    """Add this rank's share of each block's squared gradient norm to ``vec[1 + block]`` (one replica per
    stage counts its averaged gradients: ``grad_sq``)."""
    for i in rt.owned:
        b = rt.block_of[i]
        if b is None:
            continue
        for p in live_params(rt, i):
            if p.grad is not None:
                vec[1 + b] += grad_sq(rt, p.grad, i)


def twobw_update(rt: ElasticRuntime, pairs: list[tuple[torch.nn.Parameter, Tensor | None]]) -> Callable[[], None]:
    """2BW's update of one stage, begun: the mini-batch's gradients set and their data-parallel all-reduce
    launched. The returned call finishes it -- waits for the average, adds (for adaptive freezing) the per-block
    norms into ``rt._norms`` while a step asks, steps the optimizer and clears the gradients -- and the policy
    makes it no later than the next mini-batch but one needs the new weights (``twobw.TwoBW``), so the all-reduce
    runs under the next mini-batch's work, as the planner prices it (``planner/simulate.py``)."""
    for p, g in pairs:
        p.grad = g
    t0 = time.perf_counter()
    averaged = start_allreduce_grads(rt)
    rt.last_allreduce_s += time.perf_counter() - t0

    def finish() -> None:
        t1 = time.perf_counter()
        averaged()
        rt.last_allreduce_s += time.perf_counter() - t1
        norms = rt._norms
        if norms is not None and rt.groups.place.pipeline == 0:
            for p, _ in pairs:
                b = rt.block_of[rt.layer_of[id(p)]]
                if b is not None and p.grad is not None:
                    norms[b] += p.grad.double().pow(2).sum().item()
        rt.opt.step()
        for p, _ in pairs:
            p.grad = None

    return finish
