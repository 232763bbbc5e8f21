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
  whose all-reduce runs under the next mini-batch's work (stage.py then adds it to the peak). On an FSDP-sharded
  stage, also the layers FSDP2 gathers, while their storages hold them (``_FsdpGathers``), and the flat buffers its
  all-gathers receive into (stage.py's FSDP transient).
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
import itertools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ptplan.executor.profiling.live_bytes import LiveCount, NewStorages, _storage

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
    references point at it, by kind (``activations`` or ``transient``), as births and deaths in ``count``'s log.
    Storages are told apart by the objects themselves (held weakly, as ``NewStorages`` does), never by their
    address: FSDP2 frees a gathered layer's bytes under the tensors autograd saved (``_FsdpGathers``), and the next
    storage made at that address is another one."""

    def __init__(self, exclude: "weakref.WeakSet[Any]", count: LiveCount) -> None:
        self.exclude = exclude
        self.count = count
        self.refs: dict[int, tuple[int, str, int]] = {}
        """Each counted storage's key -> (references alive, kind, bytes when it was first counted)."""
        self._keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._serial = itertools.count()

    def add(self, t: Tensor, kind: str = "activations") -> int | None:
        st = _storage(t)
        if st is None or st in self.exclude:
            return None
        key = self._keys.get(st)
        if key is None:
            key = self._keys[st] = next(self._serial)
        n, kind, nbytes = self.refs.get(key, (0, kind, st.nbytes()))
        self.refs[key] = (n + 1, kind, nbytes)
        if n == 0:
            self.count.born(("live", key), nbytes, kind)
        return key

    def release(self, key: int) -> None:
        n, kind, nbytes = self.refs.get(key, (0, "activations", 0))
        if n > 1:
            self.refs[key] = (n - 1, kind, nbytes)
        elif n == 1:
            del self.refs[key]
            self.count.died(("live", key), nbytes, kind)


def _sharded(module: Any) -> bool:
    """Whether any part of ``module`` is FSDP2-sharded (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


class _FsdpGathers:
    """FSDP2's gathered layers on a CPU rank (``hybrid.shard_layer``), logged in the live count as ``transient``.

    FSDP2 gathers a layer's parameters into storages it keeps and resizes in place: to their full size when it
    gathers them (before the layer's forward or backward), to nothing when it reshards (``alloc_storage`` and
    ``free_storage`` on ``FSDPParam.all_gather_outputs``). No operation makes those bytes and no reference's death
    frees them, so while measuring ``FSDPParam.alloc_all_gather_outputs`` and ``free_unsharded_param`` are wrapped
    to log each storage's bytes as they come and go, and the tensors autograd saves from them (the gathered weights
    a linear keeps for its backward) are left out of the activations (``storages``, the caller's exclusions). The
    flat buffer an all-gather receives into is made by FSDP's unshard: inside a backward action the backward's own
    count sees it; outside one (the gathers for a forward) the unshard runs under ``outside``, which logs it as it is
    made and as it dies."""

    def __init__(self, module: Any, count: LiveCount, storages: "weakref.WeakSet[Any]",
                 outside: NewStorages) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        self.count, self.storages, self.outside = count, storages, outside
        self.in_backward = False
        self._keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._serial = itertools.count()
        self._saved: list[tuple[type, str, Any]] = []
        for m in module.modules():
            if isinstance(m, FSDPModule):
                for group in m._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        for t in fp.all_gather_outputs:
                            st = t.untyped_storage()
                            self.storages.add(st)
                            if st.nbytes():  # gathered when the step begins: alive from the start
                                self.count.born(self._key(st), st.nbytes(), "transient")
        gathers = self

        def alloc(fp: Any, _orig: Any = FSDPParam.alloc_all_gather_outputs) -> None:
            before = [(t.untyped_storage(), t.untyped_storage().nbytes()) for t in fp.all_gather_outputs]
            _orig(fp)
            for st, n in before:
                gathers.storages.add(st)
                if st.nbytes() != n:
                    gathers.count.born(gathers._key(st), st.nbytes() - n, "transient")

        def free(fp: Any, _orig: Any = FSDPParam.free_unsharded_param) -> None:
            before = [(t.untyped_storage(), t.untyped_storage().nbytes()) for t in fp.all_gather_outputs]
            _orig(fp)
            for st, n in before:
                if st.nbytes() != n:
                    gathers.count.died(gathers._key(st), n - st.nbytes(), "transient")

        def outside_backward(orig: Any) -> Any:
            def run(group: Any, *args: Any, **kwargs: Any) -> Any:
                with contextlib.nullcontext() if gathers.in_backward else gathers.outside:
                    return orig(group, *args, **kwargs)
            return run

        for cls, name, fn in ((FSDPParam, "alloc_all_gather_outputs", alloc),
                              (FSDPParam, "free_unsharded_param", free),
                              (FSDPParamGroup, "unshard", outside_backward(FSDPParamGroup.unshard)),
                              (FSDPParamGroup, "wait_for_unshard", outside_backward(FSDPParamGroup.wait_for_unshard))):
            self._saved.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, fn)

    def _key(self, st: Any) -> tuple[str, int]:
        key = self._keys.get(st)
        if key is None:
            key = self._keys[st] = next(self._serial)
        return ("gathered", key)

    @contextlib.contextmanager
    def backward(self, scope: Any) -> Any:
        """A backward action's scope: the backward's own count sees the gathers' buffers there."""
        self.in_backward = True
        try:
            with scope:
                yield
        finally:
            self.in_backward = False

    def close(self) -> None:
        for cls, name, fn in reversed(self._saved):
            setattr(cls, name, fn)
        self._saved = []


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
        self._gathers: _FsdpGathers | None = None
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

    def _static(self) -> tuple[dict[str, int], "weakref.WeakSet[Any]"]:
        """Bytes of the weights, optimizer state and receive buffers, and their storages (never counted again)."""
        seen: set[int] = set()
        recv = list(self.rt.schedule.recv_buffers()) if self.rt.schedule is not None else []
        params = _sum_unique(self._weights(), seen)
        optimizer = _sum_unique(self._opt_tensors(), seen)
        buffers = _sum_unique(recv, seen)
        storages = (_storage(t) for t in self._weights() + self._opt_tensors() + recv if isinstance(t, Tensor))
        return ({"params": params, "optimizer": optimizer, "buffers": buffers},
                weakref.WeakSet(st for st in storages if st is not None))

    def _pack(self, t: Tensor) -> Any:
        if not isinstance(t, Tensor):
            return t
        # detached: a holder of the tensor itself closes a cycle autograd cannot free for a node's own saved output
        # (node -> saved variable -> holder -> tensor -> grad_fn -> node); a backward run with retain_graph (ZB's
        # input-gradient B) never releases the nodes only it traverses, so they lived on past their W
        h = _Holder(t.detach())
        if self._working.key_of(t) is not None:  # made by a backward (recomputation): counted there
            return h
        key = self._live.add(t)
        if key is not None:
            weakref.finalize(h, self._live.release, key)
        return h

    @staticmethod
    def _unpack(h: Any) -> Any:
        return h.t if isinstance(h, _Holder) else h

    def _track(self, t: Tensor, kind: str) -> None:
        key = self._live.add(t, kind)
        if key is not None:
            weakref.finalize(t, self._live.release, key)

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
                self._live.exclude.add(_storage(t))  # micro-batch views saved for backward: counted here
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
        self._gathers = (_FsdpGathers(self.module, self._count, exclude, NewStorages(self._count, "transient"))
                         if _sharded(self.module) else None)
        if self.rt.schedule is not None:
            gathers = self._gathers
            self.rt.schedule.backward_scope = ((lambda: self._working) if gathers is None
                                               else (lambda: gathers.backward(self._working)))
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
        if self._gathers is not None:
            self._gathers.close()
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
