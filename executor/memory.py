"""Peak memory of one sampled training step, measured as the plan predicts it: one rank's stage working set.

What the plan predicts per stage (``planner.planner``): weights + gradients + optimizer state of the
stage's active layers, the frozen prefix's weights on stage 0, the pipelining receive buffers, and
the activations held for backward by the micro-batches in flight. What is measured, per rank, on a
sampled step (``MemorySampler``: the second step of every phase visit, so the first step's set-up
is over and the receive buffers exist; the sampled step's time carries the hooks' overhead, so its
record says ``memory_sampled`` and ``ptplan compare`` leaves it out of the timing medians):

- **params**: bytes of the stage module's parameters (active layers, and the frozen prefix on
  stage 0), from the tensors.
- **grads**: bytes of the ``.grad`` tensors of those parameters after the step.
- **optimizer**: bytes of the optimizer state tensors of those parameters (AdamW: two moments and
  a step counter each), from ``optimizer.state``.
- **buffers**: the ``torch.distributed.pipelining`` stage's receive buffers (one activation buffer
  and one gradient buffer per micro-batch, allocated for the phase and kept), from the stage's
  receive infos.
- **activations**: the peak, over the step, of the bytes saved for backward and still alive,
  tracked with ``torch.autograd.graph.saved_tensors_hooks``: every packed tensor's storage is
  counted once while at least one saved reference to it is alive (a weakref finalizer on the packed
  holder releases it when autograd frees it after its backward), plus the stage module's outputs
  while they are alive (held by the schedule until their backward). Storages that are parameters,
  optimizer state or receive buffers are not counted twice.

``total = params + grads + optimizer + buffers + activations``. Framework allocations outside
tensors (the Python heap, gloo's send copies, the allocator's slack) and transient tensors that
autograd does not keep (temporaries inside one layer) are not counted, on purpose: the plan does
not model them either. The runtime keeps the whole canonical model on every rank; the other
stages' weights are not part of a stage's working set and are left out.

On CUDA the allocator's peak (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``) minus the bytes of the parameters this rank holds but its stage does
not use is reported as ``total``; the CPU break-down is reported beside it.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

FIELDS = ("total", "params", "grads", "optimizer", "buffers", "activations")
METHOD_CPU = "cpu: stage tensors + live saved-for-backward storages (saved_tensors_hooks), deduplicated"
METHOD_CUDA = "cuda: max_memory_allocated minus other stages' weights"


def _key(t: Tensor) -> tuple[int, int]:
    """(storage address, storage bytes) of a tensor; views share their base's storage."""
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


def _recv_buffers(schedule: Any) -> list[Tensor]:
    """The receive buffers of a torch.distributed.pipelining schedule's stage (private attributes, read only)."""
    stage = getattr(schedule, "_stage", None)
    out: list[Tensor] = []
    for name in ("args_recv_info", "grad_recv_info"):
        infos = getattr(stage, name, None) or {}
        for recv in infos.values():
            for info in recv or ():
                buf = getattr(info, "buffer", None)
                if isinstance(buf, Tensor):
                    out.append(buf)
    return out


class _Holder:
    """What a pack hook hands to autograd: the saved tensor, in an object whose death we can observe."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: Tensor) -> None:
        self.t = t


class _LiveBytes:
    """Bytes of storages alive now, each counted once however many saved references point at it."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def add(self, t: Tensor) -> int | None:
        ptr, nbytes = _key(t)
        if ptr in self.exclude:
            return None
        n = self.refs.get(ptr, 0)
        self.refs[ptr] = n + 1
        if n == 0:
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        return ptr

    def release(self, ptr: int, nbytes: int) -> None:
        n = self.refs.get(ptr, 0) - 1
        if n > 0:
            self.refs[ptr] = n
            return
        if n == 0:
            del self.refs[ptr]
            self.live -= nbytes


class StepMemory:
    """Measures one ``ElasticRuntime.train_step``: ``start()`` before it, ``stop()`` after, then ``record()``
    (collective). Also a context manager (``with StepMemory(rt): rt.train_step(...)``)."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.cuda = runtime.device.type == "cuda"
        self.module = runtime.module
        self.params = [p for p in self.module.parameters()]
        self._hooks: Any = None
        self._handle = None
        self.result: dict[str, int] = {}

    # -- CPU bookkeeping ------------------------------------------------------------------------
    def _static(self) -> tuple[dict[str, int], set[int]]:
        seen: set[int] = set()
        params = _sum_unique(self.params, seen)
        opt_tensors = [v for p in self.params for v in self.rt.opt.state.get(p, {}).values()
                       if isinstance(v, Tensor)]
        optimizer = _sum_unique(opt_tensors, seen)
        buffers = _sum_unique(_recv_buffers(self.rt.schedule), seen) if self.rt.schedule is not None else 0
        return {"params": params, "optimizer": optimizer, "buffers": buffers}, seen

    def _pack(self, t: Tensor) -> Any:
        if not isinstance(t, Tensor):
            return t
        h = _Holder(t)
        ptr = self._live.add(t)
        if ptr is not None:
            weakref.finalize(h, self._live.release, ptr, _key(t)[1])
        return h

    @staticmethod
    def _unpack(h: Any) -> Any:
        return h.t if isinstance(h, _Holder) else h

    def _on_output(self, _module, _args, out) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, Tensor):
                ptr = self._live.add(t)
                if ptr is not None:
                    weakref.finalize(t, self._live.release, ptr, _key(t)[1])

    def __enter__(self) -> "StepMemory":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "StepMemory":
        """Begin measuring (call right before the step)."""
        if self.cuda:
            torch.cuda.synchronize(self.rt.device)
            torch.cuda.reset_peak_memory_stats(self.rt.device)
            return self
        self._static_bytes, exclude = self._static()
        self._live = _LiveBytes(exclude)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._handle = self.module.register_forward_hook(self._on_output)
        return self

    def stop(self) -> None:
        """End measuring (call right after the step); the result is in ``self.result``."""
        seen: set[int] = set()
        grads = _sum_unique([p.grad for p in self.params], seen)
        if self.cuda:
            torch.cuda.synchronize(self.rt.device)
            stage_ids = {id(p) for p in self.params}
            others = sum(p.numel() * p.element_size() for p in self.rt.model.parameters() if id(p) not in stage_ids)
            static, _ = self._static()
            peak = int(torch.cuda.max_memory_allocated(self.rt.device)) - others
            self.result = {"total": peak, **static, "grads": grads,
                           "activations": max(peak - sum(static.values()) - grads, 0)}
            return
        self._hooks.__exit__(None, None, None)
        self._handle.remove()
        static = self._static_bytes
        acts = self._live.peak
        self.result = {"total": sum(static.values()) + grads + acts, **static, "grads": grads, "activations": acts}

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
    """Decides which steps to measure: step ``at`` (1-based) of every visit to a phase (same on every rank)."""

    def __init__(self, at: int = 2) -> None:
        self.at = at
        self._phase: int | None = None
        self._n = 0

    def want(self, phase_index: int) -> bool:
        if phase_index != self._phase:
            self._phase, self._n = phase_index, 0
        self._n += 1
        return self._n == self.at
