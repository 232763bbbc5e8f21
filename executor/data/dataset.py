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

from ptplan.executor.families import CAUSAL_FAMILIES

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
            # on the CPU whatever device the model is on (now or later): the runtime moves each batch to its
            # device in one place (runtime/train_step), and samples made before and after a move must concatenate
            x, y, m = self.model.make_batch(1, generator=g)
            self._cache[i] = (x.cpu(), y.cpu(), None if m is None else m.cpu())
        return self._cache[i]

    def batch(self, ids: torch.Tensor) -> Batch:
        parts = [self._one(int(i)) for i in ids.tolist()]
        xs, ys, ms = zip(*parts)
        m = None if ms[0] is None else torch.cat(ms)
        return torch.cat(xs), torch.cat(ys), m


def _read_tensors(p: str) -> dict:
    """The dict a .pt or .npz data file holds, read without running code from it (``weights_only``; npz without
    pickles); a file that is not one (random bytes, a truncated copy, another format) is one PtplanError."""
    how = "a .pt file (a dict of tensors, as `ptplan data` writes) or an .npz file"
    if p.endswith(".npz"):
        import numpy as np

        try:
            with np.load(p, allow_pickle=False) as z:
                return {k: torch.from_numpy(z[k]) for k in z.files}
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
            raise PtplanError(f"data file {p} is not a readable .npz file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''}); give {how}") from None
    if not p.endswith(".pt"):
        raise PtplanError(f"data file {p}: unknown format; use .pt (dict of tensors) or .npz")
    try:
        d = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... for bad bytes
        raise PtplanError(f"data file {p} is not a readable .pt file ({type(e).__name__}; it is read with "
                          f"weights_only, so only tensors and plain containers load); give {how}") from None
    if not isinstance(d, dict):
        raise PtplanError(f"data file {p} holds a {type(d).__name__}; expected a dict of tensors")
    return d


def load_dataset(path: str | os.PathLike) -> TensorDataset:
    """A .pt (dict of tensors) or .npz file with ``inputs``, ``labels`` and optional ``attention_mask``."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise PtplanError(f"data file {p} does not exist; pass --data synthetic or a .pt/.npz file")
    d = _read_tensors(p)
    missing = [k for k in ("inputs", "labels") if k not in d]
    if missing:
        raise PtplanError(f"data file {p} lacks {missing}; it has {sorted(map(str, d))} (needs inputs, labels, "
                          f"optional attention_mask)")
    for k in ("inputs", "labels", "attention_mask"):
        if k in d and not isinstance(d[k], torch.Tensor):
            raise PtplanError(f"data file {p}: {k!r} is a {type(d[k]).__name__}, expected a tensor; write the file "
                              f"with `ptplan data`")
    return TensorDataset(d["inputs"], d["labels"], d.get("attention_mask"))


def check_data(ds: Dataset, model, what: str = "the data") -> None:
    """Refuse data the model cannot train on, before training: the inputs' shape (sequence length or image
    size) and dtype against ``model.make_batch``'s, token ids within the vocabulary, labels within the
    head's classes (GPT-2: next-token ids or -100), a 0/1 attention mask of the inputs' shape.

    A ``TensorDataset`` is checked whole (one pass of min/max); any other data set on sample 0.
    """
    if len(ds) == 0:
        raise PtplanError(f"{what} has no samples")
    if isinstance(ds, TensorDataset):
        x, y, m = ds.inputs, ds.labels, ds.attention_mask
    else:
        x, y, m = ds.batch(torch.tensor([0]))
    rx, ry, rm = model.make_batch(1)
    family = model.family
    if model.pixels:
        if tuple(x.shape[1:]) != tuple(rx.shape[1:]):
            raise PtplanError(f"{what}: images of shape {list(x.shape[1:])} but the plan's {model.name} takes "
                              f"{list(rx.shape[1:])} (channels, height, width; the plan's sequence length "
                              f"{model.seq_len}); resize the images or plan for this image size")
        if not x.is_floating_point():
            raise PtplanError(f"{what}: inputs are {x.dtype}, ViT takes floating-point pixels")
        if not bool(torch.isfinite(x).all()):
            raise PtplanError(f"{what}: the inputs hold NaN or infinite pixel values")
    else:
        if x.dim() != 2 or x.shape[1] != model.seq_len:
            raise PtplanError(f"{what}: inputs of shape {list(x.shape)} but the plan's {model.name} takes "
                              f"[samples, {model.seq_len}] token ids (the plan's sequence length {model.seq_len}); "
                              f"pad or cut the sequences to {model.seq_len} tokens, or profile and plan for "
                              f"{x.shape[-1] if x.dim() == 2 else '?'} tokens")
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise PtplanError(f"{what}: inputs are {x.dtype}; token ids must be an integer tensor (int64)")
        vocab = int(model.config.vocab_size)
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or hi >= vocab:
            raise PtplanError(f"{what}: token ids span {lo}..{hi} but {model.name}'s vocabulary has {vocab} "
                              f"entries (0..{vocab - 1}); tokenize with this model's tokenizer")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise PtplanError(f"{what}: labels are {y.dtype}; they must be an integer tensor (int64)")
    if tuple(y.shape[1:]) != tuple(ry.shape[1:]):
        raise PtplanError(f"{what}: labels of shape {list(y.shape)} but {model.name} takes "
                          f"[samples{''.join(f', {d}' for d in ry.shape[1:])}]")
    if family in CAUSAL_FAMILIES:
        vocab = int(model.config.vocab_size)
        ok = (y == -100) | ((y >= 0) & (y < vocab))
        if not bool(ok.all()):
            raise PtplanError(f"{what}: next-token labels must be token ids in 0..{vocab - 1} or -100 (ignored)")
    else:
        classes = int(model.num_labels)
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= classes:
            raise PtplanError(f"{what}: labels span {lo}..{hi} but the classification head has {classes} classes "
                              f"(0..{classes - 1}); pass --num-labels {hi + 1} (and plan with a profile measured "
                              f"with that head) or fix the labels")
    if m is not None:
        if rm is None:
            raise PtplanError(f"{what}: has an attention_mask but {model.name} takes none; drop it")
        if tuple(m.shape[1:]) != tuple(rm.shape[1:]):
            raise PtplanError(f"{what}: attention_mask of shape {list(m.shape)}, expected [samples, {model.seq_len}]")
        if not bool(((m == 0) | (m == 1)).all()):
            raise PtplanError(f"{what}: attention_mask must hold only 0 and 1")


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
