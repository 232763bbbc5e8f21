"""The AutoCache inside a run: one cache per node, checked before training, evicted per epoch, removed at the end.

Legend: f = a phase's frozen *layers*; N = samples in the data set; a node's *creator* is its local rank 0.

Every rank calls, in this order (each call is collective)::

    rc = setup_cache(cfg, plan, model, dataset, device)  # None: --cache off, or no phase caches
    runtime.set_cache(rc.cache)                          # stage 0 of a caching phase: prefix_forward
    record = rc.epoch_end(phase, epoch, step)            # after each epoch: evict below f, sum the stats
    rc.finish(ok=True)                                   # close everywhere, barrier, creators remove files

Setup: each node's creator makes the cache (``<cache_dir>/ptplan-<job>-node<n>``, ``<job>`` the node's
launcher tag, see ``launch``; RAM budget
below), the others attach after a barrier; then every rank checks the data set (no random
augmentation) and, for every frozen count a phase caches, that the prefix gives the same output
twice in eval mode, as the runtime runs it. Setup runs before the runtime's first phase switch, on
the layers as built: each rank built only its stage of the first phase, so the prefix runs layer by
layer on the ranks that hold it, its hidden state sent from one to the next, each layer run twice on
the same input (``cache_guard.check_repeatable_layers``); on a GPU the check streams the host-memory
layers through the device one at a time, as the fill does (``LayeredModel.run_layers``). A problem on
any rank raises the same PtplanError on every rank before the first step, unless ``cache_allow_nondeterministic`` (then it is a note in the
``cache_setup`` record). Dropout in the model is no reason to refuse: ptplan runs the frozen prefix
in eval mode whether it caches it or not, so a cached row is exactly what recomputation gives.

Budget (RAM tier, per node): the slab bytes of every sample at one frozen count and, when the run caches more than
one count, at a second (after a freeze, an epoch refreshes the rows at the old count into the new one, and a
shard's old slab goes only once all its rows are refreshed), capped by ``cache_budget``
(``planner/cache_size.py``: the planner prices the same slabs). Rows are stored in the model's dtype, what the
prefix outputs (under ``--precision bf16`` autocast the blocks still output float32). The ``cache_setup`` record
logs the plan's ``Phase.predicted.cache_host_bytes_per_node`` (rows at one count plus the frozen weights kept in host
memory to fill, in the profile's dtype: ``plan_dtype``; the weights twice on a GPU, page-locked:
``cache_size.PINNED_ROUNDING``) beside the same sum from this run's model and device (``host_bytes_per_node``),
and ``refresh_bytes``, the part of ``need_bytes`` for the second count.
"""
from __future__ import annotations

import math
import os
import re
import uuid
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ptplan.planner.cache_size import cache_bytes, host_bytes, shard_rows
from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Phase, Plan

from ptplan.executor.cache.autocache import ActivationCache, prefix_sample_shape
from ptplan.executor.cache.guard import check_prefix_modules, check_repeatable_layers, eval_mode
from ptplan.executor.cache.store import SlabInfo, dtype_name
from ptplan.executor.runtime.collective import agree
from ptplan.executor.training.config import RunConfig
from ptplan.planner.records import CacheRecord, CacheSetupRecord
from ptplan.executor.data.dataset import Dataset

COUNTERS = ("hits", "refreshes", "misses", "rows_written", "rows_not_cached", "slabs_evicted", "bytes_evicted",
            "slabs_promoted", "disk_full")
"""Per-process counters (``CacheStats``), summed over the ranks; logged per epoch."""
NODE_USAGE = ("ram_bytes", "disk_bytes", "ram_slabs", "disk_slabs")
"""Node-wide usage after the epoch's eviction, summed over the nodes."""


def caching_phases(plan: Plan, cfg: RunConfig) -> list[int]:
    """Indices of the phases whose frozen prefix this run caches (none with ``--cache off``)."""
    if cfg.cache == "off":
        return []
    return plan.caching_phases()


def budget_for(num_samples: int, sample_shape: tuple[int, ...], dtype: torch.dtype,
               cap: int | None = None, *, refresh: bool = True) -> tuple[int, int]:
    """(RAM bytes for every sample's slab rows at one frozen count, and at a second one while an epoch refreshes
    rows into a larger count (``refresh``), samples per slab): ``cache_size.cache_bytes``, the planner's model.

    Slabs hold about 64 MiB, fewer rows under a small ``cap`` (at least 16 slabs fit in it), so that
    a small budget still caches part of the data.
    """
    row = math.prod(sample_shape) * dtype.itemsize
    rows = shard_rows(row, num_samples, cap)
    return cache_bytes(num_samples, row, row if refresh else 0, cap), rows


def host_need(plan: Plan, phases: Sequence[int], layer_bytes: Sequence[int], num_samples: int, row_bytes: int,
              local_world: int, *, pinned: bool) -> int:
    """What the plan's ``cache_host_bytes_per_node`` counts, from this run's model (``layer_bytes``: each layer's
    parameter bytes at full size, ``LayerStore.sizes``, whichever layers this rank holds): per caching phase, every
    row at its count plus the frozen weights its stage-0 ranks on the busiest node keep in host memory to fill
    (``cache_size.host_bytes``; ``pinned``: page-locked, on a GPU), the most over the phases."""
    out = 0
    for i in phases:
        ph = plan.phases[i]
        firsts = [r // local_world for r in ph.stage0_ranks]  # each keeps the frozen weights in host memory
        weights = sum(layer_bytes[:ph.frozen_layers])
        out = max(out, host_bytes(num_samples, row_bytes, weights, max(firsts.count(n) for n in set(firsts)),
                                  pinned=pinned))
    return out


def _place() -> tuple[int, int]:
    """(node index, local rank): torchrun's GROUP_RANK and LOCAL_RANK; without them, one node."""
    rank = dist.get_rank()
    if "LOCAL_RANK" not in os.environ:
        return 0, rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return int(os.environ.get("GROUP_RANK", rank // local_world)), int(os.environ["LOCAL_RANK"])


def _job_base() -> str:
    """The node's cache name: the tag of the launcher that started this node's workers (``ptplan run``;
    stable across torchrun restarts, so a restart's creator replaces what a failed attempt left, and the
    launcher removes it when the job ends: ``launch``), else one random name for the whole job (rank 0's)."""
    from ptplan.executor.launch.launcher import ENV_JOB_TAG

    obj = [uuid.uuid4().hex[:16]]
    dist.broadcast_object_list(obj, src=0)  # every rank, launcher or not: the same collectives everywhere
    tag = re.sub(r"[^A-Za-z0-9._-]", "_", os.environ.get(ENV_JOB_TAG, ""))[:80]
    return tag or obj[0]


class RunCache:
    """This rank's handle on its node's cache, with what the run log needs."""

    def __init__(self, cache: ActivationCache, *, creator: bool, device: torch.device, record: CacheSetupRecord):
        self.cache, self.creator, self.device = cache, creator, device
        self.setup_record = record
        """The ``cache_setup`` run-log record (rank 0 writes it)."""
        self._last = dict.fromkeys(COUNTERS, 0)
        self._done = False

    def epoch_end(self, phase: Phase, epoch: int, step: int) -> CacheRecord:
        """Evict rows below this phase's count if it caches; the ``cache`` record (collective)."""
        if self.creator and phase.caches_prefix:
            self.cache.evict_below(phase.frozen_layers)
        s = self.cache.stats()
        vals = [getattr(s, k) for k in COUNTERS] + [getattr(s, k) if self.creator else 0 for k in NODE_USAGE]
        vec = torch.tensor(vals, dtype=torch.int64, device=self.device)
        dist.all_reduce(vec)
        tot = dict(zip(COUNTERS + NODE_USAGE, vec.tolist()))
        rec = CacheRecord(epoch=epoch, step=step, frozen_layers=phase.frozen_layers, phase_caches=phase.cache,
                          **{k: tot[k] - self._last[k] for k in COUNTERS}, **{k: tot[k] for k in NODE_USAGE},
                          totals={k: tot[k] for k in COUNTERS})
        self._last = {k: tot[k] for k in COUNTERS}
        return rec

    def finish(self, *, ok: bool) -> None:
        """Close on every rank; creators remove the files after a barrier when ``ok``. After an error every
        rank removes its node's files at once (peers may be gone, the creator among them; unlinked slabs
        stay readable by whoever still maps them); what a killed process cannot remove, the launcher does."""
        if self._done:
            return
        self._done = True
        self.cache.close()
        if ok:
            dist.barrier()
        if self.creator or not ok:
            self.cache.cleanup()


def _check_deterministic(cache: ActivationCache, model: nn.Module, dataset: Dataset, counts: list[int],
                         device: torch.device, copies: Sequence[frozenset[int]]) -> None:
    """The data set, then the prefix at each cached count on sample 0, in eval mode as the runtime runs it:
    each prefix layer on the lowest rank that holds it as built (``copies``), the hidden state passed on
    (``cache_guard.check_repeatable_layers``), so no rank needs another's layers. Every rank's cache then
    counts those counts as checked."""
    cache.check_dataset(dataset)
    x, _, mask = dataset.batch(torch.tensor([0]))
    x, mask = x.to(device), None if mask is None else mask.to(device)
    top = counts[-1]
    lacking = [i for i in range(top) if not copies[i]]
    if lacking:
        raise PtplanError(f"layers {lacking} of the frozen prefix were built by no rank")
    a = cache.allow_nondeterministic
    with eval_mode(model.layers[:top]):
        notes = [n for f in counts for n in check_prefix_modules(model, f, allow_nondeterministic=a)]
        notes += check_repeatable_layers(model, counts, x, mask, [min(c) for c in copies[:top]], dist.get_rank(),
                                         allow_nondeterministic=a)
    cache.mark_checked(counts, notes)


def setup_cache(cfg: RunConfig, plan: Plan, model: nn.Module, dataset: Dataset, device: torch.device,
                copies: Sequence[frozenset[int]] | None = None, *,
                layer_bytes: Sequence[int] | None = None) -> RunCache | None:
    """Create or attach this node's cache and check determinism (collective; see the module docstring).
    ``copies``: per layer, the ranks holding it as built (``resume.built_copies``); None: every rank
    holds every layer. ``layer_bytes``: each layer's parameter bytes at full size (the runtime's
    ``LayerStore.sizes``: a layer this rank did not build has no storage to count); None: counted from
    ``model``, which must then hold every layer."""
    phases = caching_phases(plan, cfg)
    if not phases:
        if cfg.cache == "off" and plan.caching_phases() and dist.get_rank() == 0:
            print("ptplan run: note: --cache off: the frozen prefix is recomputed in the phases where the plan "
                  "caches it (same results, slower stage 0)", flush=True)
        return None
    node, local = _place()
    creator = local == 0
    job = f"{_job_base()}-node{node}"
    shape = prefix_sample_shape(model)
    dtype = next(model.parameters()).dtype  # what the prefix outputs: also under --precision bf16 (autocast), where
    # every family's residual stream leaves a block in float32 (tests/test_compare_fills.py)
    N = len(dataset)
    sizes = list(layer_bytes) if layer_bytes is not None else \
        [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.layers]
    refresh = len({plan.phases[i].frozen_layers for i in phases}) > 1  # a later phase refreshes an earlier's rows
    need, rows_per_slab = budget_for(N, shape, dtype, cfg.cache_budget, refresh=refresh)
    budget = need if cfg.cache_budget is None else min(need, cfg.cache_budget)
    if budget < need and dist.get_rank() == 0:
        print(f"ptplan run: note: the AutoCache needs up to {need} bytes per node for {N} samples but "
              f"--cache-budget allows {budget}; rows beyond it go to "
              f"{cfg.cache_spill_dir or 'no spill directory, so they are recomputed'}", flush=True)
    cache: ActivationCache | None = None
    try:
        problem = None
        try:
            if creator:
                cache = ActivationCache(cfg.cache_dir, create=True, sample_shape=shape, dtype=dtype, num_samples=N,
                                        budget_bytes=budget, spill_dir=cfg.cache_spill_dir, shard_rows=rows_per_slab,
                                        job_id=job, allow_nondeterministic=cfg.cache_allow_nondeterministic)
        except PtplanError as e:
            problem = f"activation cache on node {node}: {e}"
        agree(problem)  # also the barrier: every node's cache exists now
        problem = None
        try:
            if not creator:
                cache = ActivationCache(cfg.cache_dir, create=False, job_id=job,
                                        allow_nondeterministic=cfg.cache_allow_nondeterministic)
        except PtplanError as e:
            problem = f"activation cache on node {node}: {e}"
        agree(problem)
        assert cache is not None, "every rank opened the node's cache (agree raised otherwise)"
        problem = None
        try:
            everyone = frozenset(range(dist.get_world_size()))
            _check_deterministic(cache, model, dataset, sorted({plan.phases[i].frozen_layers for i in phases}), device,
                                 [everyone] * len(model.layers) if copies is None else copies)
        except PtplanError as e:
            problem = (f"{e} (ptplan run: --cache-allow-nondeterministic accepts this; --cache off recomputes "
                       f"the prefix instead)")
        all_notes = agree(problem, None if problem else cache.stats().notes)
    except BaseException:
        if cache is not None:
            cache.cleanup()  # any rank: the job is failing on every rank
        raise
    nodes = torch.tensor([int(creator)], dtype=torch.int64, device=device)
    dist.all_reduce(nodes)
    n_nodes = int(nodes.item())
    predicted = max(plan.phases[i].predicted.cache_host_bytes_per_node for i in phases)
    row = math.prod(shape) * dtype.itemsize
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    record = CacheSetupRecord(job_id=job, nodes=n_nodes, dir=cache.dir, spill_dir=cache.spill_dir,
                              budget_bytes=cache.budget_bytes, need_bytes=need, plan_bytes_per_node=predicted,
                              row_bytes=row, refresh_bytes=need - cache_bytes(N, row, 0, cfg.cache_budget),
                              host_bytes_per_node=host_need(plan, phases, sizes, N, row, local_world,
                                                            pinned=device.type == "cuda"),
                              plan_dtype=plan.inputs.profile.dtype,
                              sample_shape=list(shape), dtype=dtype_name(dtype), samples=N, shard_rows=cache.shard_rows,
                              phases=phases, frozen_layers=sorted({plan.phases[i].frozen_layers for i in phases}),
                              allow_nondeterministic=cfg.cache_allow_nondeterministic,
                              notes=sorted({n for ns in all_notes for n in ns}))
    return RunCache(cache, creator=creator, device=device, record=record)
