"""Training data: a small dataset interface, synthetic and file-backed datasets, epoch order and sharding.

A dataset maps sample ids 0..N-1 to ``(inputs, labels, attention_mask or None)``, batched on dim 0.
Epoch e visits the ids in ``epoch_order(N, seed, e)`` order; step t of an epoch takes the global
batch of the next B ids, and pipeline p of D gets the contiguous shard ``[p*B/D, (p+1)*B/D)`` of it,
so the union of the shards, in pipeline order, is exactly the single-process batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from ptplan.planner.errors import PtplanError

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(inputs, labels, attention_mask or None), first dim = samples."""


class Dataset(Protocol):
    """What the runtime reads: random access to samples by id."""

    def __len__(self) -> int: ...

    def batch(self, ids: torch.Tensor) -> Batch:
        """The samples ``ids`` (int64, 1-D), stacked on dim 0."""
        ...


def iterate(ds: Dataset) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(sample_id, inputs, labels, mask)`` one sample at a time (dim 0 of size 1)."""
    for i in range(len(ds)):
        x, y, m = ds.batch(torch.tensor([i]))
        yield i, x, y, m


@dataclass
class TensorDataset:
    """Samples held as tensors (first dim = samples); e.g. loaded from a .pt or .npz file."""

    inputs: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.inputs.shape[0]
        if self.labels.shape[0] != n or (self.attention_mask is not None and self.attention_mask.shape[0] != n):
            raise PtplanError(f"dataset tensors disagree on the number of samples: inputs {tuple(self.inputs.shape)}, "
                              f"labels {tuple(self.labels.shape)}"
                              + ("" if self.attention_mask is None else f", attention_mask {tuple(self.attention_mask.shape)}"))

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def batch(self, ids: torch.Tensor) -> Batch:
        m = None if self.attention_mask is None else self.attention_mask[ids]
        return self.inputs[ids], self.labels[ids], m


class SyntheticDataset:
    """``n`` samples of the model's shapes, each generated from its own id (deterministic, lazy).

    Sample i is ``model.make_batch(1, generator=torch.Generator().manual_seed(seed * 1_000_003 + i))``.
    """

    def __init__(self, model, n: int, seed: int = 0) -> None:
        self.model, self.n, self.seed = model, n, seed
        self._cache: dict[int, Batch] = {}

    def __len__(self) -> int:
        return self.n

    def _one(self, i: int) -> Batch:
        if i not in self._cache:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            self._cache[i] = self.model.make_batch(1, generator=g)
        return self._cache[i]

    def batch(self, ids: torch.Tensor) -> Batch:
        parts = [self._one(int(i)) for i in ids.tolist()]
        xs, ys, ms = zip(*parts)
        m = None if ms[0] is None else torch.cat(ms)
        return torch.cat(xs), torch.cat(ys), m


def load_dataset(path: str | os.PathLike) -> TensorDataset:
    """A .pt (dict of tensors) or .npz file with ``inputs``, ``labels`` and optional ``attention_mask``."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise PtplanError(f"data file {p} does not exist; pass --data synthetic or a .pt/.npz file")
    if p.endswith(".npz"):
        import numpy as np

        with np.load(p) as z:
            d = {k: torch.from_numpy(z[k]) for k in z.files}
    elif p.endswith(".pt"):
        d = torch.load(p, map_location="cpu", weights_only=True)
        if not isinstance(d, dict):
            raise PtplanError(f"data file {p} holds a {type(d).__name__}; expected a dict of tensors")
    else:
        raise PtplanError(f"data file {p}: unknown format; use .pt (dict of tensors) or .npz")
    missing = [k for k in ("inputs", "labels") if k not in d]
    if missing:
        raise PtplanError(f"data file {p} lacks {missing}; it has {sorted(d)} (needs inputs, labels, "
                          f"optional attention_mask)")
    return TensorDataset(d["inputs"], d["labels"], d.get("attention_mask"))


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits sample ids 0..n-1."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


def global_batch_ids(order: torch.Tensor, cursor: int, batch: int) -> torch.Tensor:
    """The ids of the global batch starting at position ``cursor`` of the epoch order."""
    if cursor + batch > order.numel():
        raise ValueError(f"batch [{cursor}, {cursor + batch}) runs past the epoch's {order.numel()} samples")
    return order[cursor:cursor + batch]


def shard(ids: torch.Tensor, D: int, p: int) -> torch.Tensor:
    """Pipeline p's contiguous share of a global batch (its size must divide by D)."""
    B = ids.numel()
    if B % D:
        raise ValueError(f"a global batch of {B} samples does not split into {D} equal shards")
    k = B // D
    return ids[p * k:(p + 1) * k]
