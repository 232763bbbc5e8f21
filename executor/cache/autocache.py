"""AutoCache: the frozen prefix's output per sample, shared by a node's processes, refreshed incrementally.

Legend: f = frozen *layers* (a phase's ``frozen_layers``: the prefix is the flat layers ``[0, f)``);
c = a smaller count at which a sample is already cached; N = samples in the data set.

An entry is keyed by (sample id, f) and holds ``layers[0:f]``'s output for that sample, one
fixed-size row of shape ``sample_shape`` (e.g. ``[seq_len, hidden]``). Storage is a directory of
slab files (``cache_store``): one file per (f, shard of ``shard_rows`` consecutive sample ids),
memory-mapped by every process of the node, in ``<root>/ptplan-<job_id>`` (root defaults to
/dev/shm, a tmpfs) while the slabs there fit ``budget_bytes``, then in
``<spill_dir>/ptplan-<job_id>`` on disk, else not cached at all.

Lifecycle, per node::

    # local rank 0, before the others:
    cache = ActivationCache(job_id=job, create=True, sample_shape=(S, H), dtype=torch.float32,
                            num_samples=N, budget_bytes=B, spill_dir="/scratch")
    # barrier; then every other local rank:
    cache = ActivationCache(job_id=job, create=False)
    cache.check_dataset(dataset)             # refuses random augmentation
    ...
    h = prefix_forward(model, x, mask, ids, phase.frozen_layers, cache,   # stage 0, every step
                       micro_batch_size=phase.micro_batch_size)
    ...
    cache.evict_below(phase.frozen_layers)   # after each epoch (any rank; idempotent)
    ...
    cache.close()                            # every rank; then barrier; then, local rank 0:
    cache.cleanup()                          # removes every file (also: leaving a ``with`` block
                                             # of the creating instance)

``prefix_forward`` is the whole hot path: it looks up each sample's best cached count c <= f, serves
c == f from the cache, runs only ``layers[c:f]`` on cached rows for 0 < c < f (incremental refresh)
and the whole prefix for misses, writes what it computed under f, and returns the batch's prefix
output. The runtime calls it with the phase's micro-batch size, so that it computes on the same
shapes as a stage that recomputes the prefix (bit-identical rows; see ``prefix_forward``). On a GPU
the frozen layers stay in host memory on stage 0 (the runtime's ``transition.holdings``) and
``LayeredModel.run_layers`` streams each through the device for its forward. Once every row of a shard is cached at f, that shard's slabs at smaller counts are deleted
(their rows are superseded); ``evict_below`` deletes the rest at the end of an epoch.

Determinism (``cache_guard``): on first use at each f, the prefix is checked for active dropout and
run twice on one sample; ``check_dataset`` refuses augmented data. ``allow_nondeterministic=True``
turns the refusals into notes (``stats().notes``).
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError

from ptplan.executor.cache.guard import (check_dataset, check_prefix_modules, check_repeatable, eval_mode,
                                         prefix_fingerprint)
from ptplan.executor.cache.meta import DEFAULT_SLAB_BYTES, MAX_SHARD_ROWS, SCHEMA, attach_meta, create_meta
from ptplan.executor.cache.serve import serve_prefix
from ptplan.executor.cache.store import DTYPES, Slab, SlabInfo, SlabStore, dtype_name

__all__ = ["SCHEMA", "DEFAULT_SLAB_BYTES", "MAX_SHARD_ROWS", "ActivationCache", "CacheStats", "default_root",
           "prefix_forward", "prefix_sample_shape"]

_JOB_ID = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


def default_root() -> str:
    """/dev/shm when it is a writable directory (RAM-backed on Linux), else the temp directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def prefix_sample_shape(model: nn.Module) -> tuple[int, int]:
    """Per-sample shape of a frozen prefix's output for a ptplan LayeredModel: ``(seq_len, hidden)``."""
    return int(model.seq_len), int(model.config.hidden_size)


@dataclass
class CacheStats:
    """Counters of this process (samples) and the node-wide bytes and slabs now on each tier."""

    hits: int = 0
    """Samples served at the requested frozen count."""
    refreshes: int = 0
    """Samples served from a smaller cached count c by running only layers [c, f)."""
    misses: int = 0
    """Samples whose whole prefix was computed."""
    rows_written: int = 0
    rows_not_cached: int = 0
    """Rows not stored: RAM budget full and no spill directory (or the disk full too)."""
    disk_full: int = 0
    """Slabs this process could not create because a tier's file system was full (not the budget)."""
    slabs_evicted: int = 0
    bytes_evicted: int = 0
    slabs_promoted: int = 0
    """Spilled slabs moved into RAM after evictions freed budget."""
    ram_bytes: int = 0
    disk_bytes: int = 0
    ram_slabs: int = 0
    disk_slabs: int = 0
    budget_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    """Determinism problems accepted with allow_nondeterministic=True."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ActivationCache:
    """Per-sample frozen-prefix outputs in memory-mapped slabs shared by the processes of one node.

    ``create=True`` (one process per node, first): makes the directories, removing any left by an
    earlier run of the same ``job_id``, and writes ``meta.json``; ``sample_shape``, ``dtype``,
    ``num_samples`` and ``budget_bytes`` are required. ``create=False``: attaches to the directory
    the creator made; the description comes from ``meta.json`` and any argument given must agree.

    ``budget_bytes``: RAM-tier bytes (slab files under ``root``), node-wide. ``spill_dir``: where
    slabs beyond the budget go (None: they are not cached). ``shard_rows``: samples per slab
    (default: about 64 MiB per slab). ``random_augmentation``: the data set's declaration (refused
    unless ``allow_nondeterministic``).
    """

    def __init__(self, root: str | os.PathLike | None = None, *, job_id: str, create: bool,
                 sample_shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                 num_samples: int | None = None, budget_bytes: int | None = None,
                 spill_dir: str | os.PathLike | None = None, shard_rows: int | None = None,
                 allow_nondeterministic: bool = False, random_augmentation: bool = False) -> None:
        if not isinstance(job_id, str) or not _JOB_ID.match(job_id):
            raise PtplanError(f"cache job id {job_id!r} must be 1-100 characters of letters, digits, '.', '_', '-'")
        self.job_id = job_id
        self.root = os.fspath(root) if root is not None else default_root()
        self.dir = os.path.join(self.root, f"ptplan-{job_id}")
        self.allow_nondeterministic = allow_nondeterministic
        self.created = create
        self._stats = CacheStats()
        self._checked: set[int] = set()
        self._tags: dict[tuple[int, int], str] = {}
        self._closed = False
        given = dict(sample_shape=None if sample_shape is None else [int(s) for s in sample_shape],
                     dtype=None if dtype is None else dtype_name(dtype), num_samples=num_samples,
                     budget_bytes=budget_bytes,
                     spill_dir=None if spill_dir is None else os.path.join(os.fspath(spill_dir), f"ptplan-{job_id}"),
                     shard_rows=shard_rows)
        meta = create_meta(self.root, self.dir, job_id, given) if create else attach_meta(self.dir, given)
        self.meta = meta
        self.sample_shape: tuple[int, ...] = tuple(meta["sample_shape"])
        self.dtype: torch.dtype = DTYPES[meta["dtype"]]
        self.num_samples: int = meta["num_samples"]
        self.shard_rows: int = meta["shard_rows"]
        self.budget_bytes: int = meta["budget_bytes"]
        self.spill_dir: str | None = meta["spill_dir"]
        self.row_bytes: int = int(np.prod(self.sample_shape)) * self.dtype.itemsize
        self.store = SlabStore(self.dir, self.spill_dir, self.budget_bytes)
        self._stats.budget_bytes = self.budget_bytes
        if random_augmentation:
            self._stats.notes.extend(check_dataset(_Declared(), allow_nondeterministic=allow_nondeterministic))

    # ---- keys ----------------------------------------------------------------------------------
    def ids(self, sample_ids: Tensor | np.ndarray) -> np.ndarray:
        """Sample ids as a flat int64 array, checked against the size the cache was made for."""
        ids = (sample_ids.detach().cpu().numpy() if isinstance(sample_ids, Tensor) else np.asarray(sample_ids))
        ids = ids.astype(np.int64, copy=False).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            raise PtplanError(f"sample ids must be in 0..{self.num_samples - 1} (the cache was sized for "
                              f"{self.num_samples} samples), got {int(ids.min())}..{int(ids.max())}")
        return ids

    def _split(self, ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """[(shard, positions in ids, local rows in the shard's slab)]."""
        shards = ids // self.shard_rows
        out = []
        for s in np.unique(shards).tolist():
            pos = np.nonzero(shards == s)[0]
            out.append((int(s), pos, ids[pos] - s * self.shard_rows))
        return out

    def _info(self, frozen_layers: int, shard: int, tag: str) -> SlabInfo:
        first = shard * self.shard_rows
        return SlabInfo(frozen_layers=frozen_layers, shard=shard, first=first,
                        rows=min(self.shard_rows, self.num_samples - first), shape=self.sample_shape,
                        dtype=dtype_name(self.dtype), tag=tag)

    def _check_tag(self, slab: Slab, tag: str | None) -> None:
        if tag is not None and slab.info.tag != tag:
            raise PtplanError(f"cached rows in {slab.path} were computed by other prefix weights (fingerprint "
                              f"{slab.info.tag}, now {tag}): the frozen layers changed or another job shares "
                              f"job id {self.job_id!r}; use a fresh job id or call cleanup()")

    def _to_bytes(self, t: Tensor) -> np.ndarray:
        n = t.shape[0]
        return t.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy()

    def _from_bytes(self, a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).view(self.dtype).view(a.shape[0], *self.sample_shape)

    # ---- lookups -------------------------------------------------------------------------------
    def lookup_rows(self, sample_ids: Tensor, frozen_layers: int) -> Tensor:
        """Per sample, the largest cached count c <= frozen_layers (int64; -1 where none)."""
        self._check_open()
        ids = self.ids(sample_ids)
        best = np.full(ids.size, -1, dtype=np.int64)
        listing = self.store.listing()
        for shard, pos, local in self._split(ids):
            counts = sorted((f for f, s in listing if s == shard and f <= frozen_layers), reverse=True)
            todo = np.ones(pos.size, dtype=bool)
            for c in counts:
                slab = self.store.get(c, shard, listing[(c, shard)])
                if slab is None:
                    continue
                ok = slab.valid(local) & todo
                best[pos[ok]] = c
                todo &= ~ok
                if not todo.any():
                    break
        return torch.from_numpy(best)

    def lookup_partial(self, sample_ids: Tensor, frozen_layers: int) -> int | None:
        """The largest count c <= frozen_layers at which *every* sample is cached, or None."""
        self._check_open()
        ids = self.ids(sample_ids)
        counts = sorted({f for f, _ in self.store.listing() if f <= frozen_layers}, reverse=True)
        for c in counts:
            if all(self._slab_has(c, shard, local) for shard, _, local in self._split(ids)):
                return c
        return None

    def _slab_has(self, frozen_layers: int, shard: int, local: np.ndarray) -> bool:
        slab = self.store.get(frozen_layers, shard)
        return slab is not None and bool(slab.valid(local).all())

    def get(self, sample_ids: Tensor, frozen_layers: int, *, tag: str | None = None) -> Tensor | None:
        """The cached rows ``[B, *sample_shape]`` (CPU) if every sample is cached at exactly
        ``frozen_layers``, else None. ``tag``: expected prefix fingerprint (checked when given)."""
        self._check_open()
        ids = self.ids(sample_ids)
        parts = []
        for shard, pos, local in self._split(ids):
            slab = self.store.get(frozen_layers, shard)
            if slab is None:
                return None
            self._check_tag(slab, tag)
            if not slab.valid(local).all():  # flags first (pread), then the rows
                return None
            parts.append((pos, slab.read(local)))
        if len(parts) == 1:
            return self._from_bytes(parts[0][1])  # one shard: already in the caller's order
        out = np.empty((ids.size, self.row_bytes), dtype=np.uint8)
        for pos, rows in parts:
            out[pos] = rows
        return self._from_bytes(out)

    # ---- writes and eviction -------------------------------------------------------------------
    def put(self, sample_ids: Tensor, frozen_layers: int, tensor: Tensor, *, tag: str = "") -> int:
        """Store ``tensor[i]`` as sample ``sample_ids[i]``'s prefix output at ``frozen_layers``.

        Rows already cached are left alone. Returns the rows written; rows with no room (budget
        full, no spill directory) are counted in ``stats().rows_not_cached``. A shard whose rows
        are now all cached at ``frozen_layers`` drops its slabs at smaller counts.
        """
        self._check_open()
        if frozen_layers < 1:
            raise PtplanError(f"frozen_layers must be >= 1 to cache a prefix output, got {frozen_layers}")
        ids = self.ids(sample_ids)
        if tuple(tensor.shape) != (ids.size, *self.sample_shape) or tensor.dtype != self.dtype:
            raise PtplanError(f"cache rows must be {self.dtype} of shape [{ids.size}, "
                              f"{', '.join(map(str, self.sample_shape))}], got {tensor.dtype} {list(tensor.shape)}")
        data = self._to_bytes(tensor)
        written = 0
        superseded: list[int] = []
        for shard, pos, local in self._split(ids):
            slab = self.store.get_or_create(self._info(frozen_layers, shard, tag))
            if slab is None:
                self._stats.rows_not_cached += pos.size
                continue
            self._check_tag(slab, tag or None)
            new = ~slab.valid(local)
            slab.write(local[new], data[pos[new]])
            written += int(new.sum())
            if new.any() and slab.valid().all():
                superseded.append(shard)
        self._stats.rows_written += written
        if superseded:
            listing = self.store.listing()
            self._evict([(f, s) for f, s in listing if s in superseded and f < frozen_layers],
                        promote=[(frozen_layers, s) for s in superseded])
        return written

    def _evict(self, keys: list[tuple[int, int]], promote: list[tuple[int, int]]) -> None:
        """Remove ``keys``, then move complete spilled slabs among ``promote`` into the freed RAM."""
        if keys:
            slabs, freed = self.store.remove(keys)
            self._stats.slabs_evicted += slabs
            self._stats.bytes_evicted += freed
        if self.spill_dir is not None and promote:
            self._stats.slabs_promoted += self.store.promote(promote)

    def evict_below(self, frozen_layers: int) -> int:
        """Delete every entry cached at a count < ``frozen_layers`` and move complete spilled slabs at
        higher counts into RAM as the budget allows; returns bytes freed. Call when an epoch at
        ``frozen_layers`` ends (every sample refreshed by then); idempotent, any process."""
        self._check_open()
        before = self._stats.bytes_evicted
        listing = self.store.listing()
        self._evict([k for k in listing if k[0] < frozen_layers], promote=[k for k in listing if k[0] >= frozen_layers])
        return self._stats.bytes_evicted - before

    # ---- prefix --------------------------------------------------------------------------------
    def tag_for(self, model: nn.Module, frozen_layers: int) -> str:
        """The prefix weights' fingerprint, computed once per (model, count) in this process."""
        key = (id(model), frozen_layers)
        if key not in self._tags:
            self._tags[key] = prefix_fingerprint(model, frozen_layers)
        return self._tags[key]

    def ensure_cacheable(self, model: nn.Module, frozen_layers: int, inputs: Tensor,
                         attention_mask: Tensor | None) -> None:
        """On first use at ``frozen_layers``: refuse active dropout, and run the prefix twice to compare."""
        if frozen_layers in self._checked:
            return
        a = self.allow_nondeterministic
        notes = check_prefix_modules(model, frozen_layers, allow_nondeterministic=a)
        below = max((c for c in self._checked if c < frozen_layers), default=0)
        notes += check_repeatable(model, frozen_layers, inputs, attention_mask, allow_nondeterministic=a,
                                  checked=below)
        self._stats.notes.extend(notes)
        self._checked.add(frozen_layers)

    def mark_checked(self, counts: list[int], notes: list[str]) -> None:
        """Count ``counts`` as checked (``ensure_cacheable`` skips them): the run checked them across its
        processes (``cache_run``), ``notes`` what the check accepted."""
        self._checked.update(counts)
        self._stats.notes.extend(notes)

    def check_dataset(self, dataset: Any) -> None:
        """Refuse a data set that declares or shows random augmentation (see ``cache_guard``)."""
        self._stats.notes.extend(check_dataset(dataset, allow_nondeterministic=self.allow_nondeterministic))

    def prefix_forward(self, model: nn.Module, inputs: Tensor, attention_mask: Tensor | None, sample_ids: Tensor,
                       frozen_layers: int, *, micro_batch_size: int | None = None) -> Tensor:
        """``layers[0:frozen_layers]``'s output for the batch, from the cache where possible (see ``prefix_forward``)."""
        self._check_open()
        return serve_prefix(self, model, inputs, attention_mask, sample_ids, frozen_layers, micro_batch_size)

    def record(self, *, hits: int = 0, refreshes: int = 0, misses: int = 0) -> None:
        """Count rows served from the cache, refreshed from a smaller count, or computed whole."""
        self._stats.hits += hits
        self._stats.refreshes += refreshes
        self._stats.misses += misses

    # ---- reporting and lifetime ----------------------------------------------------------------
    def row_counts(self) -> tuple[int, int, int]:
        """(hits, refreshes, misses) this process has served so far (cheap: no file listing, unlike ``stats``)."""
        return self._stats.hits, self._stats.refreshes, self._stats.misses

    def stats(self) -> CacheStats:
        """This process's counters plus the node-wide bytes and slabs on each tier now."""
        s = CacheStats(**{**self._stats.as_dict(), "notes": list(self._stats.notes)})
        s.disk_full = sum(self.store.full.values())
        if not self._closed and os.path.isdir(self.dir):
            for k, v in self.store.usage().items():
                setattr(s, k, v)
        return s

    def _check_open(self) -> None:
        if self._closed:
            raise PtplanError(f"activation cache {self.dir} is closed")

    def close(self) -> None:
        """Unmap this process's slabs (the files stay for the node's other processes)."""
        if not self._closed:
            self.store.close()
            self._closed = True

    def cleanup(self) -> None:
        """Close and remove every file of this cache (RAM and spill tiers); call once per node, last."""
        self.store.destroy()
        self._closed = True

    def __enter__(self) -> "ActivationCache":
        return self

    def __exit__(self, *exc) -> None:
        if self.created:
            self.cleanup()
        else:
            self.close()


class _Declared:
    """Stand-in data set for the ``random_augmentation=True`` constructor flag."""

    random_augmentation = True

    def __len__(self) -> int:
        return 0


def prefix_forward(model: nn.Module, inputs: Tensor, attention_mask: Tensor | None, sample_ids: Tensor,
                   frozen_layers: int, cache: ActivationCache | None = None, *,
                   micro_batch_size: int | None = None) -> Tensor:
    """The frozen prefix ``layers[0:frozen_layers]``'s output for a batch, under no_grad and eval mode.

    With a cache, per sample: cached at ``frozen_layers`` -> read it; cached at a smaller count c ->
    run only ``layers[c:frozen_layers]`` on it (incremental refresh) and store the result; not
    cached -> run the whole prefix and store it. Without a cache: plain recomputation (identical
    results). ``frozen_layers == 0`` returns ``inputs`` unchanged.

    ``micro_batch_size`` b (what the runtime passes: the phase's): the batch is served b consecutive
    samples at a time, and a micro-batch that is not all cached at ``frozen_layers`` is computed
    whole, from the largest count all its rows share. The prefix then runs on exactly the shapes a
    stage that recomputes it runs (one micro-batch), so its rows are bit-identical to recomputation:
    torch's kernels do not promise the same bits for a sample in batches of different sizes (a GEMM
    may block 8 rows differently from 16), and they differ on CPUs for BERT at b = 1 versus b >= 2.
    One case stays apart: a row refreshed from count c was computed up to c in the micro-batches of
    the phase that cached it; when that phase's b differs, the refreshed row equals recomputation
    only up to that rounding (of the order of 1e-7 relative in float32).

    Layers kept in host memory while ``inputs`` is on a GPU (the cached phases' prefix on stage 0)
    are streamed through the device one layer at a time (``models.streamed``).
    """
    if cache is not None:
        return cache.prefix_forward(model, inputs, attention_mask, sample_ids, frozen_layers,
                                    micro_batch_size=micro_batch_size)
    if frozen_layers == 0:
        return inputs
    b = micro_batch_size or inputs.shape[0]
    with torch.no_grad(), eval_mode(model.layers[:frozen_layers]):
        parts = [model.run_layers(inputs[a:a + b], 0, frozen_layers,
                                  None if attention_mask is None else attention_mask[a:a + b])
                 for a in range(0, inputs.shape[0], b)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
