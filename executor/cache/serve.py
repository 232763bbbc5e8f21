"""Serving a batch's frozen-prefix output from the AutoCache: read hits, refresh rows cached at a smaller
count (run only the layers between), compute misses, and store what was computed (``prefix_forward``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

from ptplan.executor.cache.guard import eval_mode

if TYPE_CHECKING:
    from ptplan.executor.cache.autocache import ActivationCache


def serve_prefix(cache: ActivationCache, model: nn.Module, inputs: Tensor, attention_mask: Tensor | None,
                 sample_ids: Tensor, frozen_layers: int, micro_batch_size: int | None) -> Tensor:
    """``layers[0:frozen_layers]``'s output for the batch, from ``cache`` where possible (see ``prefix_forward``)."""
    if frozen_layers == 0:
        return inputs
    cache.ensure_cacheable(model, frozen_layers, inputs, attention_mask)
    ids = cache.ids(sample_ids)
    if ids.size != inputs.shape[0]:
        raise PtplanError(f"{ids.size} sample ids for a batch of {inputs.shape[0]} samples")
    tag = cache.tag_for(model, frozen_layers)
    if micro_batch_size is None:
        return _per_sample(cache, model, inputs, attention_mask, ids, frozen_layers, tag)
    b = micro_batch_size
    if b < 1 or ids.size % b:
        raise PtplanError(f"a batch of {ids.size} samples does not split into micro-batches of {b}")
    if ids.size == b:
        return _micro_batch(cache, model, inputs, attention_mask, ids, frozen_layers, tag)
    out = torch.empty((ids.size, *cache.sample_shape), dtype=cache.dtype, device=inputs.device)
    for a in range(0, ids.size, b):
        m = None if attention_mask is None else attention_mask[a:a + b]
        out[a:a + b] = _micro_batch(cache, model, inputs[a:a + b], m, ids[a:a + b], frozen_layers, tag)
    return out


def _run(model: nn.Module, x: Tensor, lo: int, hi: int, mask: Tensor | None) -> Tensor:
    with torch.no_grad(), eval_mode(model.layers[:hi]):
        return model.run_layers(x, lo, hi, mask)


def _micro_batch(cache: ActivationCache, model: nn.Module, x: Tensor, mask: Tensor | None, ids: np.ndarray, f: int,
                 tag: str) -> Tensor:
    """One micro-batch, served or computed whole: read at f if every row is there, else run layers
    [c, f) on the rows cached at the largest c < f that has all of them (or [0, f) on the inputs)."""
    dev = x.device
    h = cache.get(ids, f, tag=tag)
    if h is not None:
        cache.record(hits=ids.size)
        return h.to(dev)
    c = cache.lookup_partial(ids, f - 1)
    h = cache.get(ids, c, tag=cache.tag_for(model, c)) if c else None
    if c and h is not None:
        cache.record(refreshes=ids.size)
        h = _run(model, h.to(dev), c, f, mask)
    else:  # a miss, or the rows were evicted since the lookup
        cache.record(misses=ids.size)
        h = _run(model, x, 0, f, mask)
    cache.put(ids, f, h, tag=tag)
    return h


def _per_sample(cache: ActivationCache, model: nn.Module, inputs: Tensor, attention_mask: Tensor | None,
                ids: np.ndarray, f: int, tag: str) -> Tensor:
    """The batch split by each sample's best cached count: hits read, the rest computed per group."""
    dev = inputs.device
    best = cache.lookup_rows(ids, f).numpy()
    groups = sorted(set(best.tolist()), reverse=True)
    parts: list[tuple[np.ndarray, Tensor]] = []
    for c in groups:
        sel = np.nonzero(best == c)[0]
        whole = len(groups) == 1  # the usual case: the batch needs no splitting
        x = inputs if whole else inputs[torch.from_numpy(sel).to(dev)]
        mask = attention_mask if whole or attention_mask is None else attention_mask[torch.from_numpy(sel).to(dev)]
        h = cache.get(ids[sel], c, tag=cache.tag_for(model, c)) if c > 0 else None
        if h is not None and c == f:
            cache.record(hits=sel.size)
            parts.append((sel, h.to(dev)))
            continue
        if h is not None:
            cache.record(refreshes=sel.size)
            h = _run(model, h.to(dev), c, f, mask)
        else:  # a miss, or the rows were evicted since the lookup
            cache.record(misses=sel.size)
            h = _run(model, x, 0, f, mask)
        cache.put(ids[sel], f, h, tag=tag)
        parts.append((sel, h))
    if len(parts) == 1:
        return parts[0][1]
    out = torch.empty((ids.size, *cache.sample_shape), dtype=cache.dtype, device=dev)
    for sel, h in parts:
        out[torch.from_numpy(sel).to(dev)] = h
    return out
