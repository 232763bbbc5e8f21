"""Peak memory of one sampled training step, measured term by term as ``planner/stage.py`` predicts it.

A rank holds only its stage (``runtime``), so what it holds is what is measured. Per rank, on a
sampled step (``MemorySampler``: the second step of every phase visit, so the first step's set-up
is over and the receive buffers exist; 2BW's fourth, its first with both weight versions and the
optimizer state; the sampled step's time carries the hooks' overhead, so its
record says ``memory_sampled`` and ``ptplan compare`` leaves it out of the timing medians), with
stage.py's term in brackets:

- **params** [weights]: bytes of the stage module's parameters (its active layers, and the frozen
  prefix on stage 0 when it recomputes it), from the tensors: a split or sharded layer's local shard
  (``hybrid``: active layers and, under tp or FSDP on stage 0, the prefix's twins); under PipeDream-2BW
  also every weight version's storage (``TwoBW.weight_tensors``: two copies of the active layers).
- **grads** [gradients]: bytes of the ``.grad`` tensors of those parameters (2BW: and of the versions') after
  the step.
- **optimizer** [optimizer]: bytes of the optimizer state tensors of those parameters (AdamW: two
  moments and a 4-byte step counter per parameter tensor, the counters being what stage.py leaves
  out), from ``optimizer.state``.
- **buffers** [buffers]: the step interpreter's receive buffers (``step.Messages``: one activation
  buffer and one gradient buffer per micro-batch, allocated at the phase's first step and kept, as
  torch.distributed.pipelining keeps them; 2BW keeps one gradient buffer), from
  ``StepInterpreter.recv_buffers``; on stage 0 of a phase that caches the prefix, also the shard's prefix
  output (``ElasticRuntime.train_step`` reports it through ``memory_hook``).
- **activations** [activations]: the peak, over the step, of the bytes saved for backward and still
  alive, tracked with ``torch.autograd.graph.saved_tensors_hooks``: every packed tensor's storage is
  counted once while at least one saved reference to it is alive (a weakref finalizer on the packed
  holder releases it when autograd frees it after its backward), plus the stage module's outputs
  while they are alive (held by the schedule until their backward), plus every storage a backward
  action makes while it lives (the backward's working set, stage.py's w: ``live_bytes.NewStorages``
  around each of the step interpreter's backward actions; a first weight gradient that becomes the
  parameter's ``.grad`` is left out: it is the gradients' term). Storages that are parameters,
  optimizer state or buffers are not counted twice.
- **transient** [transient]: the flat gradient all-reduce buffer (``gradients.start_allreduce_grads``,
  D > 1: the stage's gradients in one tensor), tracked in the same live-bytes count as the
  activations while it exists; it is made after the activations are freed, except under PipeDream-2BW,
  whose all-reduce runs under the next mini-batch's work (stage.py then adds it to the peak).
- **host_params** (not in ``total``): the frozen prefix's weights a cached phase's stage 0 keeps in
  host memory (stage.py leaves them out of the device's memory).

``total = params + grads + optimizer + buffers + peak(activations + transient alive together)``.
Framework allocations outside tensors (the Python heap, gloo's send copies, the allocator's slack),
a forward's temporaries that autograd does not keep and the AutoCache fill's per-micro-batch layer
outputs are not counted, on purpose: the plan does not model them either.

On CUDA the allocator's peak (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``) is ``total``, directly: the rank holds nothing but its stage. The
break-down beside it is read from the tensors as on CPU, except ``activations``, which is what the
peak leaves after the static terms and the gradients.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ptplan.executor.profiling.live_bytes import LiveCount, NewStorages

FIELDS = ("total", "params", "grads", "optimizer", "buffers", "activations", "transient", "host_params")
METHOD_CPU = ("cpu: stage tensors + live saved-for-backward storages (saved_tensors_hooks) + the backward's working "
              "set (storages made by backward actions) + all-reduce buffer")
METHOD_CUDA = "cuda: max_memory_allocated (the rank holds only its stage)"


def _key(t: Tensor) -> tuple[int, int]:
    """(storage address, storage bytes) of a tensor; views share their base's storage. A DTensor (FSDP, tensor
    parallel: ``hybrid``) counts as this rank's local shard."""
    t = getattr(t, "_local_tensor", t)
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without a plain storage
        return id(t), t.numel() * t.element_size()


def _sum_unique(tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, Tensor):
            continue
        ptr, nbytes = _key(t)
        if ptr in seen:
            continue
        seen.add(ptr)
        total += nbytes
    return total


class _Holder:
    """What a pack hook hands to autograd: the saved tensor, in an object whose death we can observe."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: Tensor) -> None:
        self.t = t


class _LiveBytes:
    """Storages kept for backward (packed by autograd) or held by the schedule, each counted once however many
    references point at it, by kind (``activations`` or ``transient``), as births and deaths in ``count``'s log."""

    def __init__(self, exclude: set[int], count: LiveCount) -> None:
        self.exclude = exclude
        self.count = count
        self.refs: dict[int, tuple[int, str]] = {}

    def add(self, t: Tensor, kind: str = "activations") -> int | None:
        ptr, nbytes = _key(t)
        if ptr in self.exclude:
            return None
        n, kind = self.refs.get(ptr, (0, kind))
        self.refs[ptr] = (n + 1, kind)
        if n == 0:
            self.count.born(("ptr", ptr), nbytes, kind)
        return ptr

    def release(self, ptr: int, nbytes: int) -> None:
        n, kind = self.refs.get(ptr, (0, "activations"))
        if n > 1:
            self.refs[ptr] = (n - 1, kind)
            return
        if n == 1:
            del self.refs[ptr]
            self.count.died(("ptr", ptr), nbytes, kind)


class StepMemory:
    """Measures one ``ElasticRuntime.train_step``: ``start()`` before it, ``stop()`` after, then ``record()``
    (collective). Also a context manager (``with StepMemory(rt): rt.train_step(...)``)."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.cuda = runtime.device.type == "cuda"
        self.module = runtime.module
        self.params = [p for p in self.module.parameters()]
        self._hooks: Any = None
        self._handle: Any = None
        self._shard_input = 0
        self._transient = 0
        self.result: dict[str, int] = {}

    # -- CPU bookkeeping ------------------------------------------------------------------------
    def _weights(self) -> list[Tensor]:
        """The stage's weights: its parameters and, under PipeDream-2BW, every weight version's leaf tensors (the
        second copy stage.py counts; the gradients accumulate on the versions), read now (updates make new ones)."""
        policy = getattr(self.rt.schedule, "policy", None)
        versions = getattr(policy, "weight_tensors", None)
        return self.params + (list(versions()) if versions is not None else [])

    def _opt_tensors(self) -> list[Tensor]:
        return [v for p in self.params for v in self.rt.opt.state.get(p, {}).values() if isinstance(v, Tensor)]

    def _static(self) -> tuple[dict[str, int], set[int]]:
        seen: set[int] = set()
        params = _sum_unique(self._weights(), seen)
        optimizer = _sum_unique(self._opt_tensors(), seen)
        buffers = _sum_unique(self.rt.schedule.recv_buffers(), seen) if self.rt.schedule is not None else 0
        return {"params": params, "optimizer": optimizer, "buffers": buffers}, seen

    def _pack(self, t: Tensor) -> Any:
        if not isinstance(t, Tensor):
            return t
        # detached: a holder of the tensor itself closes a cycle autograd cannot free for a node's own saved output
        # (node -> saved variable -> holder -> tensor -> grad_fn -> node); a backward run with retain_graph (ZB's
        # input-gradient B) never releases the nodes only it traverses, so they lived on past their W
        h = _Holder(t.detach())
        if self._working.key_of(t) is not None:  # made by a backward (recomputation): counted there
            return h
        ptr = self._live.add(t)
        if ptr is not None:
            weakref.finalize(h, self._live.release, ptr, _key(t)[1])
        return h

    @staticmethod
    def _unpack(h: Any) -> Any:
        return h.t if isinstance(h, _Holder) else h

    def _track(self, t: Tensor, kind: str) -> None:
        ptr = self._live.add(t, kind)
        if ptr is not None:
            weakref.finalize(t, self._live.release, ptr, _key(t)[1])

    def _on_output(self, _module, _args, out) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, Tensor):
                self._track(t, "activations")

    def _on_runtime(self, kind: str, t: Tensor) -> None:
        """``ElasticRuntime.memory_hook``: the cached stage 0's shard input, or the all-reduce buffer."""
        nbytes = _key(t)[1]
        if kind == "buffers":
            self._shard_input += nbytes
            if not self.cuda:
                self._live.exclude.add(_key(t)[0])  # micro-batch views saved for backward: counted here
        else:
            self._transient = max(self._transient, nbytes)
            if not self.cuda:
                self._track(t, "transient")

    def __enter__(self) -> "StepMemory":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "StepMemory":
        """Begin measuring (call right before the step)."""
        self.rt.memory_hook = self._on_runtime
        if self.cuda:
            torch.cuda.synchronize(self.rt.device)
            torch.cuda.reset_peak_memory_stats(self.rt.device)
            return self
        self._static_bytes, exclude = self._static()
        self._count = LiveCount()
        self._live = _LiveBytes(exclude, self._count)
        self._working = NewStorages(self._count, "working", ignore=self._weights() + self._opt_tensors())
        if self.rt.schedule is not None:
            self.rt.schedule.backward_scope = lambda: self._working
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._handle = self.module.register_forward_hook(self._on_output)
        return self

    def stop(self) -> None:
        """End measuring (call right after the step); the result is in ``self.result``."""
        self.rt.memory_hook = None
        seen: set[int] = set()
        grads = _sum_unique([p.grad for p in self._weights()], seen)
        host = self.rt.held_bytes()["host"]
        if self.cuda:
            torch.cuda.synchronize(self.rt.device)
            static, _ = self._static()
            static["buffers"] += self._shard_input
            peak = int(torch.cuda.max_memory_allocated(self.rt.device))
            self.result = {"total": peak, **static, "grads": grads, "transient": self._transient,
                           "activations": max(peak - sum(static.values()) - grads, 0), "host_params": host}
            return
        self._hooks.__exit__(None, None, None)
        self._handle.remove()
        if self.rt.schedule is not None:
            self.rt.schedule.backward_scope = contextlib.nullcontext
        static = dict(self._static_bytes)
        static["buffers"] += self._shard_input
        # a first weight gradient that AccumulateGrad kept as .grad is the gradients' term, not working memory
        kept = {self._working.key_of(p.grad) for p in self._weights() if p.grad is not None} - {None}
        peak, _ = self._count.peaks(skip=kept)
        acts, _ = self._count.peaks(skip=kept, kinds={"activations", "working"})
        _, of = self._count.peaks(skip=kept, kinds={"transient"})
        self.result = {"total": sum(static.values()) + grads + peak, **static, "grads": grads,
                       "activations": acts, "transient": of.get("transient", 0), "host_params": host}

    def record(self) -> dict[str, Any]:
        """Every rank's numbers (an all-gather; every rank must call it) as run-log fields."""
        mine = torch.tensor([self.result.get(k, 0) for k in FIELDS], dtype=torch.int64)
        if self.rt.backend == "nccl":
            mine = mine.to(self.rt.device)
        allv = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(allv, mine)
        rows = [dict(zip(FIELDS, (int(x) for x in v.cpu().tolist()))) for v in allv]
        return {"memory_sampled": True, "peak_memory_bytes": max(r["total"] for r in rows),
                "memory": {"method": METHOD_CUDA if self.cuda else METHOD_CPU, "per_rank": rows}}


class MemorySampler:
    """Decides which steps to measure: step ``at`` (1-based) of every visit to a phase (same on every rank); under
    PipeDream-2BW (a stale step) step ``stale_at``: its first update, which makes the optimizer state and the
    newest weight version, is applied in its third step, so the fourth is the first that holds all a steady step
    holds."""

    def __init__(self, at: int = 2, stale_at: int = 4) -> None:
        self.at, self.stale_at = at, stale_at
        self._phase: int | None = None
        self._n = 0

    def want(self, phase_index: int, *, stale: bool = False) -> bool:
        if phase_index != self._phase:
            self._phase, self._n = phase_index, 0
        self._n += 1
        return self._n == (self.stale_at if stale else self.at)
