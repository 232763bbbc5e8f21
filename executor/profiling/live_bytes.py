"""Bytes of tensor storages alive, counted as they are made and freed: the backward's working set.

A stage's peak is what its in-flight micro-batches keep for backward (``saved_bytes_per_sample``) plus, while a
layer runs its backward, what that backward makes on top: the gradient of its input, the gradient it receives, a
weight gradient being accumulated into ``.grad``, and its kernels' temporaries (GPT-2's head upcasts the logits
to float32 for the loss; its log-softmax backward makes two more tensors of that size). That second part is the
layer's **backward working set** (``LayerRecord.backward_working_bytes_per_sample``), measured here the same way
by the profiler, the projection (on fake tensors) and the CPU run's memory count (``executor/runtime/memory.py``):

- ``LiveCount``: storages alive by kind, each counted once however many tensors view it, as a log of
  (storage, ±bytes, kind) events; peaks are read by replaying the log, so storages found out afterwards (a
  weight gradient that ``AccumulateGrad`` kept as the parameter's ``.grad``: the plan's gradients, not working
  memory) can be left out of them;
- ``NewStorages``: a dispatch mode that adds to a ``LiveCount`` the storage of every tensor an operation returns,
  unless it is one of the operation's inputs' (a view, an in-place result), and subtracts it when the storage
  dies (a weakref on it). It works on any device and under ``FakeTensorMode``;
- ``memory_pass``: per layer, the output, saved-for-backward and backward-working bytes per sample, and what a
  split backward's input-gradient half (ZB's B) leaves for its weight-gradient half (its W): the **stash**.

On a CUDA device the allocator also sees the kernels' own workspaces, which no operation returns:
``bench/backward_working.py`` measured the live count at 35-100 % of ``max_memory_allocated``'s rise for the
attention and MLP halves of five models at batch 32 on an H100 (16-100 % at batch 8), and equal to it for the GPT-2
and Llama heads, which decide the peak.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(t: Tensor) -> Any:
    """A tensor's storage object (one per storage, shared by its views; a DTensor's local shard's), or None."""
    t = getattr(t, "_local_tensor", t)
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without a plain storage
        return None


class LiveCount:
    """Bytes alive by kind, as a log of (key, +bytes when a storage became alive / -bytes when it died, kind) in
    order; peaks are read by replaying the log, leaving out any keys found out afterwards."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, int, str]] = []

    def born(self, key: Any, nbytes: int, kind: str) -> None:
        self.log.append((key, nbytes, kind))

    def died(self, key: Any, nbytes: int, kind: str) -> None:
        self.log.append((key, -nbytes, kind))

    def mark(self) -> int:
        """A position in the log, for ``peaks(since=...)``."""
        return len(self.log)

    def peaks(self, *, since: int = 0, skip: frozenset[Any] | set[Any] = frozenset(),
              kinds: frozenset[str] | set[str] | None = None) -> tuple[int, dict[str, int]]:
        """(peak of all kinds together, peak of each kind) over the log from ``since``, each as the rise over what
        was alive at ``since`` (so from the start: the peaks), the keys in ``skip`` and kinds not in ``kinds``
        (None: all) left out."""
        live: dict[str, int] = {}
        for key, n, kind in self.log[:since]:
            if key not in skip and (kinds is None or kind in kinds):
                live[kind] = live.get(kind, 0) + n
        base = dict(live)
        total = start = top = sum(live.values())
        top_of = dict(live)
        for key, n, kind in self.log[since:]:
            if key in skip or (kinds is not None and kind not in kinds):
                continue
            live[kind] = live.get(kind, 0) + n
            total += n
            top = max(top, total)
            top_of[kind] = max(top_of.get(kind, 0), live[kind])
        return top - start, {k: v - base.get(k, 0) for k, v in top_of.items()}


class NewStorages(TorchDispatchMode):
    """Logs in ``count``, as ``kind``, the storage of every tensor an operation makes (not one of its inputs': a
    view or an in-place result) and, through a weakref, its death. ``ignore``: storages never counted (parameters,
    optimizer state, buffers the caller counts itself). Storages are told apart by the objects themselves (held
    weakly), never by an address a freed storage hands on to the next one."""

    def __init__(self, count: LiveCount, kind: str, ignore: Iterable[Tensor] = ()) -> None:
        super().__init__()
        self.count, self.kind = count, kind
        self.keys: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """Each tracked storage alive -> its key in the log (a serial number)."""
        self._ignore: weakref.WeakSet[Any] = weakref.WeakSet(st for st in map(_storage, ignore) if st is not None)
        self._serial = itertools.count()

    def key_of(self, t: Tensor) -> int | None:
        """The log key of ``t``'s storage while it is alive and tracked, else None."""
        st = _storage(t)
        return None if st is None else self.keys.get(st)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(st) for st in map(_storage, (t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)))}
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                st = _storage(t)
                if st is not None and id(st) not in inputs and st not in self.keys and st not in self._ignore:
                    self._track(st)
        return out

    def _track(self, st: Any) -> None:
        key, nbytes = next(self._serial), st.nbytes()
        self.keys[st] = key
        self.count.born(key, nbytes, self.kind)
        weakref.finalize(st, self.count.died, key, nbytes, self.kind)


@dataclass(frozen=True)
class LayerBytes:
    """Per layer, bytes of one forward and backward of b samples (per sample: rounded up)."""

    output: list[int]
    """The layer's output, per sample."""
    saved: list[int]
    """Saved for its backward (parameters not counted), per sample."""
    working: list[int]
    """Its backward's working set per sample: the peak rise of the live count during its backward over the count
    when it starts, with no ``.grad`` yet (the first micro-batch's; the gradients it leaves, which
    ``AccumulateGrad`` keeps as ``.grad``, left out)."""
    accumulate: list[int]
    """Bytes more when the backward adds into existing ``.grad`` (a later micro-batch's: each weight gradient is
    made apart first), per layer (not per sample)."""
    stash: list[int]
    """Per sample, the bytes a split backward's B (``torch_adapter.backward_input``: the input gradient alone, the
    graph kept) made and leaves alive for its W, the input's gradient not counted (it is sent on): the gradients
    of the weight operations' outputs, which W reads. 0 for the first layer, whose B the runtime defers whole to
    its W."""


def layer_step(model: Any, i: int, xin: Tensor, labels: Tensor, mask: Tensor | None, own: set[int],
               params: list[Tensor], probe: Callable[[], ContextManager[Any]] = contextlib.nullcontext
               ) -> tuple[Tensor, int, int]:
    """Layer i's forward (the loss too on the last) and backward under a live count: (its output, the bytes it saves
    for backward, its backward's peak rise with the gradients it leaves as ``.grad`` not counted). ``own``: the ids
    of the parameters' storages (not counted as saved); ``probe``: entered around the backward and its seed
    (``bench/backward_working.py`` reads the CUDA allocator there)."""
    layer = model.layers[i]
    count = LiveCount()
    packed: set[int] = set()
    saved = [0]

    def pack(t: Tensor) -> Tensor:
        st = _storage(t)
        if st is not None and id(st) not in own and id(st) not in packed:
            packed.add(id(st))  # saved tensors stay alive until the backward: their ids are not reused
            saved[0] += st.nbytes()
        return t

    with NewStorages(count, "working", ignore=params) as mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(xin, attention_mask=mask)
            loss = model.loss(y, labels) if i == len(model.layers) - 1 else None
        since = count.mark()
        with probe():
            grad = None if loss is not None else torch.ones_like(y)
            root = loss if loss is not None else y
            if root.requires_grad:
                torch.autograd.backward(root, grad)
            del grad, root, loss
        kept = {mode.key_of(p.grad) for p in layer.parameters() if p.grad is not None}
    rise, _ = count.peaks(since=since, skip=kept)
    return y, saved[0], rise


def stash_step(model: Any, i: int, xin: Tensor, labels: Tensor, mask: Tensor | None, params: list[Tensor]) -> int:
    """Layer i's forward (the loss too on the last), then its split backward under a live count: the bytes its B
    made that are still alive when its W starts and that W frees (what B left for W), the input's gradient left
    out; W runs, so the layer ends as after a whole backward."""
    from ptplan.executor.runtime import torch_adapter

    layer = model.layers[i]
    count = LiveCount()
    with NewStorages(count, "working", ignore=params) as mode:
        y = layer(xin, attention_mask=mask)
        loss = model.loss(y, labels) if i == len(model.layers) - 1 else None
        since = count.mark()
        root = loss if loss is not None else y
        seed = None if loss is not None else [torch.ones_like(y)]
        dinputs, groups = torch_adapter.backward_input([root], seed, [xin], iter(list(layer.parameters())))
        del seed, root, loss, y
        alive: dict[Any, int] = {}  # storages made since B began, still alive
        for key, n, _ in count.log[since:]:
            if n > 0:
                alive[key] = n
            else:
                alive.pop(key, None)
        if dinputs and dinputs[0] is not None:
            alive.pop(mode.key_of(dinputs[0]), None)
        del dinputs
        xin.grad = None
        w_began = count.mark()
        torch_adapter.backward_weight(iter(list(layer.parameters())), groups)
        del groups
    # what W used up: a storage B made that lives on after W too (a constant some kernel caches on its first call,
    # once per process) is not the stash, and counting it would make the number depend on what ran before
    freed = {key for key, n, _ in count.log[w_began:] if n < 0}
    return sum(n for key, n in alive.items() if key in freed)


def memory_pass(model: Any, x: Tensor, labels: Tensor, mask: Tensor | None, b: int) -> LayerBytes:
    """``LayerBytes`` of ``model``'s layers (a ``LayeredModel``) for the batch ``x`` of b samples, each layer run
    on the previous one's output detached (the last with the loss): once with no ``.grad``, once more adding into
    the gradients the first left; gradients cleared before and after. Works on real tensors on any device and on
    fake ones (the projection's ``fake_memory_pass``)."""
    params = list(model.parameters())
    own = {id(st) for st in map(_storage, params)}
    res = LayerBytes(output=[], saved=[], working=[], accumulate=[], stash=[])
    h = x
    for p in params:
        p.grad = None
    for i, layer in enumerate(model.layers):
        xin = h if i == 0 else h.detach().requires_grad_(True)
        y, saved, first = layer_step(model, i, xin, labels, mask, own, params)
        xin = h if i == 0 else h.detach().requires_grad_(True)
        _, _, again = layer_step(model, i, xin, labels, mask, own, params)
        res.output.append(-(-y.numel() * y.element_size() // b))
        res.saved.append(-(-saved // b))
        res.working.append(math.ceil(first / b))
        res.accumulate.append(max(again - first, 0))
        for p in layer.parameters():
            p.grad = None
        stash = 0 if i == 0 else stash_step(model, i, h.detach().requires_grad_(True), labels, mask, params)
        res.stash.append(-(-stash // b))
        for p in layer.parameters():
            p.grad = None
        h = y.detach()
        del y, xin
    return res
