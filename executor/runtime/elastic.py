"""One rank's elastic runtime: its stage's layers, the optimizer, the current phase, its groups and stage.

Legend: K positions (ranks) per pipeline, V chunks (stages) per position, D pipelines, M micro-batches per
pipeline.

A rank holds exactly what ``planner/stage.py`` says its stage holds (``transition.holdings``): the
active layers of its stage on the device, plus on stage 0 the frozen prefix -- on the device when
it recomputes it, in host memory when the AutoCache serves it. Every other layer of the canonical
model keeps its ``nn.Parameter`` objects without storage (``stage.LayerStore``), so one optimizer
over all parameters stays valid (``optim``: it keeps state only for this rank's active layers). A
phase gives each rank one stage, or V chunks at one pipeline position (``stage``), run by the plan's
action lists (``actions``) on the one step interpreter (``step.StepInterpreter``, for every schedule); their
gradients are averaged over the position's data-parallel group by one flat all-reduce after the
schedule's step (never DDP around a stage). A stage with FSDP (``Phase.fsdp_at``, D > 1) instead trains
FSDP2-sharded copies of its active layers over that group (``hybrid.ShardedStage``: gradients reduce-scattered
in the backward, the optimizer stepping the shards), and the flat all-reduce leaves those layers out; it is
left -- full weights and optimizer state gathered back into the canonical layers -- before a switch, a gather,
a cache change and at the end, so everything below moves plain full tensors. A phase with ``Phase.tp`` > 1
does the same with tensor-parallel copies over the stage's tp group (ranks ``ranks[p][s] + j``, ``groups``),
the flat all-reduce then running on each rank's local shards. Stage 0's frozen prefix, when it runs it (not
cached), is split over tp and, when its chunk 0 has FSDP, sharded over its data-parallel group the same way
(frozen: weights only, all-gathered in the no-grad forward; gathered back on leaving). A stage with recomputation
(``Phase.recompute_at``) runs its active layers under ``torch.utils.checkpoint`` (``stage.StageModule``), or
only its first r of them (``Phase.recompute_layers_at``, Galvatron's layer-wise choice: ``stage.recompute_first``).
FSDP and recomputation are per stage (chunk): a phase's stages may differ (``ptplan plan --strategies auto``
chooses per stage), so one position may shard and recompute while the next runs plain data parallel.
Entering a phase (``ElasticRuntime.switch``) frees what the rank neither keeps nor sends, allocates
what it newly holds, moves weights and then optimizer state to their new owners (``transition``),
frees what it only sent, destroys the old groups and creates the new ones in the same order on
every rank (``groups``), and rebuilds the stage and its schedule. The training loop is in
``training``. The step's body is ``train_step`` (its gradient average, clipping and norms in
``gradients``); ``gather`` brings the whole model to rank 0. A PipeDream-2BW phase (schedule ``2bw``)
runs the same interpreter under the 2BW policy
(``twobw.TwoBW``: each ``train_step`` runs one mini-batch's stretch of the plan's continuous 1F1B, with
two weight versions and one-step-stale updates: the step is ``stale``, it steps the optimizer itself);
``switch``, ``gather`` and ``close`` first drain it. A token-sliced phase (``Phase.slices``, TeraPipe) runs it
with the slice compute (``sliced.SliceCompute``) on the canonical layers; each ``train_step`` runs the whole
schedule, so it leaves nothing to drain, and its gradients are averaged and stepped as in any phase.
In a phase that caches the frozen prefix (``Phase.cache``, with a cache set up by
``cache_run``), stage 0's module holds no prefix: ``train_step`` feeds it ``cache.prefix_forward``'s
output for the shard, computed micro-batch by micro-batch as recomputation would.

Memory outside the steady state: before the first ``switch`` a rank holds what it built, in host
memory -- under ``ptplan run`` its own stage of the phase it starts in (``training.start_phase``), so the
first switch moves nothing; during a switch a rank holds what it keeps plus, until sent, what it gives
away; ``gather`` makes rank 0 hold the whole model (and, for checkpoints, every active layer's
optimizer state) in host memory until it returns -- one source rank's messages at a time.
"""


from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Phase, Plan

from ptplan.executor.runtime.actions import phase_schedule
from ptplan.executor.cache.autocache import ActivationCache
from ptplan.executor.runtime.gather import gather
from ptplan.executor.runtime.gradients import allreduce_grads, twobw_update
from ptplan.executor.runtime.groups import PhaseGroups, build_groups, chunks_of, destroy_groups, dp_ranks_of, fsdp_chunks, tp_ranks_of
from ptplan.executor.runtime.hybrid import ShardedStage
from ptplan.executor.runtime.optim import drop_state, ensure_state
from ptplan.executor.runtime.stage import LayerStore, build_schedule, set_trainable, stage_module
from ptplan.executor.runtime.step import StepInterpreter
from ptplan.executor.runtime.train_step import train_step
from ptplan.executor.runtime.transition import DEVICE, HOST, Transfer, exchange, holdings, needs, owned_layers, plan_transfers, sources


class PhaseState:
    """The phase a runtime is in (set by ``ElasticRuntime.switch``): before the first switch, and after
    ``close``, there is no phase, index or groups, and asking for one is an error, not a None."""

    def __init__(self) -> None:
        self._phase_index: int | None = None
        self._phase: Phase | None = None
        self._groups: PhaseGroups | None = None

    @property
    def entered(self) -> bool:
        """Whether a phase was entered (``switch``)."""
        return self._phase is not None

    @staticmethod
    def _entered(value: Any) -> Any:
        if value is None:
            raise RuntimeError("the runtime has entered no phase yet (or was closed): call switch() first")
        return value

    @property
    def phase(self) -> Phase:
        """The phase this rank runs now."""
        return self._entered(self._phase)

    @property
    def phase_index(self) -> int:
        """The current phase's index in the plan."""
        return self._entered(self._phase_index)

    @property
    def groups(self) -> PhaseGroups:
        """The current phase's process groups and this rank's place in them (built by ``switch`` first)."""
        return self._entered(self._groups)


class ElasticRuntime(PhaseState):
    """One rank's view of the run: its layers' storage, optimizer, current phase, groups and stage."""

    def __init__(self, plan: Plan, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 device: torch.device, timeout_s: float, backend: str) -> None:
        self.plan, self.model, self.opt = plan, model, optimizer
        self.device, self.backend = device, backend
        self.timeout = _timedelta(timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.n = len(model.layers)
        self.store = LayerStore(model.layers, device)
        self.layer_params = self.store.params
        seen: dict[int, int] = {}
        for i, ps in enumerate(self.layer_params):
            for p in ps:
                if id(p) in seen and seen[id(p)] != i:
                    raise PtplanError(f"layers {seen[id(p)]} and {i} share a parameter (tied weights); the runtime "
                                      f"needs every parameter in exactly one layer")
                seen[id(p)] = i
        self.layer_of = seen
        self.sizes = self.store.sizes
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.block_of = [s.block for s in model.specs]
        self.phase_schedules = [phase_schedule(ph, i) for i, ph in enumerate(plan.phases)]
        """Per phase, the schedule it runs (``actions.phase_schedule``: the plan's action lists, checked
        here, before any collective, so a plan the executor cannot run fails on every rank at once)."""
        PhaseState.__init__(self)
        self.chunks: dict[int, torch.nn.Module] = {}
        """The stages (chunks) this rank runs in the current phase: chunk index -> module."""
        self.module = None
        """This rank's stage module (V = 1), or all its chunks in one ModuleList (V > 1)."""
        self.schedule: StepInterpreter | None = None
        """This rank's step (``step.StepInterpreter``) for the current phase."""
        self.owned: list[int] = []
        self.held: dict[int, str] = {}
        """The layers this rank holds in the current phase and where (``transition.holdings``)."""
        self.last_allreduce_s = 0.0
        """Seconds of the last step's data-parallel gradient all-reduce on this rank."""
        self.last_cache_s: float | None = None
        """Seconds the last step spent serving stage 0's frozen-prefix output from the AutoCache on this rank (None
        where it did not: another stage, or a phase that does not cache)."""
        self.current: list[frozenset[int]] = [frozenset()] * self.n
        """Per layer, the ranks holding a current copy (in a phase: the ranks that need it; ``transition``)."""
        self.cache: ActivationCache | None = None
        """The node's AutoCache (``cache_run``; set with ``set_cache``). None: always recompute."""
        self.clip_grad_norm: float | None = None
        """Clip the global gradient norm to this before each optimizer step (``train_step``); None: do not."""
        self.stop_reason: str | None = None
        """A problem this rank found outside the step (the training loop sets it: rank 0's run-log write error):
        the next step's all-reduce carries a flag for it, and every rank raises it (``train_step._reduce``)."""
        self.last_grad_norm: float | None = None
        """With clipping: the last step's global gradient norm before clipping."""
        self._norms: list[float] | None = None
        """2BW, while a step asked for gradient norms: per block, the squared norms of its updates so far."""
        self.sharded: ShardedStage | None = None
        """While this rank's stage has FSDP (``Phase.fsdp_at``, D > 1) or tp > 1: its active layers sharded over
        its data-parallel group and/or split over its tp group (``hybrid``); None otherwise, and between leaving
        and re-entering a phase."""
        self.memory_hook: Callable[[str, Tensor], None] | None = None
        """Set by ``memory.StepMemory`` while it measures a step: told of the cached stage 0's shard input
        (``"buffers"``) and of the flat gradient all-reduce buffer (``"transient"``) when they are made."""

    # ---- moving layers ---------------------------------------------------------------------
    def _weights_of(self, layers: tuple[int, ...]) -> list[Tensor]:
        return [p.data for i in layers for p in self.layer_params[i]]

    def _state_of(self, layers: tuple[int, ...]) -> list[Tensor]:
        return [t for i in layers for p in self.layer_params[i] for t in ensure_state(self.opt, p)]

    def _transfers(self, have: Sequence[frozenset[int]], need: Sequence[frozenset[int]], state: bool
                   ) -> list[Transfer]:
        return plan_transfers(have, need, [2 * s for s in self.sizes] if state else self.sizes)

    def _exchange(self, transfers: list[Transfer], state: bool) -> int:
        return exchange(transfers, self.rank, self._state_of if state else self._weights_of, self.device,
                        batched=self.backend == "nccl")

    def _params_of(self, layers) -> set[int]:
        return {id(p) for i in layers for p in self.layer_params[i]}

    def _settle(self, held: dict[int, str], *, also: set[int], current: Sequence[frozenset[int]] | None) -> None:
        """Free every layer neither in ``held`` nor in ``also``, then give each held layer storage where
        it belongs, keeping its values when this rank's copy is current (``current`` None: all are)."""
        for i in range(self.n):
            if i not in held and i not in also and self.store.where[i] is not None:
                self.store.release(i)
        for i, where in held.items():
            if self.store.where[i] != where:
                self.store.place(i, where, keep_values=current is None or self.rank in current[i])
            self.store.pin(i)  # a held host layer is streamed to the device: page-locked on a CUDA rank
        self.store.trim()

    def switch(self, index: int, *, have_weights: list[frozenset[int]],
               have_state: list[frozenset[int]] | None) -> dict[str, Any]:
        """Enter phase ``index``: move weights and optimizer state, free and allocate, rebuild groups and stage.

        ``have_weights[i]``: ranks holding a current copy of layer i; ``have_state[i]``: ranks holding
        layer i's optimizer state (None: no state exists yet). Returns seconds per part (the slowest
        rank's) and bytes sent (all ranks together).
        """
        new = self.plan.phases[index]
        t0 = time.perf_counter()
        self._drain_2bw()
        self._unshard()
        self.module = self.schedule = None  # the old stage and its receive buffers go first
        self.chunks = {}
        self.opt.zero_grad(set_to_none=True)
        need = needs(new, self.n)
        held = holdings(new, self.rank, self.n, cached_prefix=self._caches(new))
        owned = owned_layers(new, self.rank, self.n)
        weights = self._transfers(have_weights, need, state=False)
        state: list[Transfer] = []
        if have_state is not None:
            active = [i >= new.frozen_layers for i in range(self.n)]
            have_s = [h if a else frozenset() for h, a in zip(have_state, active)]
            state = self._transfers(have_s, [nd if a and h else frozenset() for nd, h, a in zip(need, have_s, active)],
                                    state=True)
        sent_state = sources(state, self.rank)
        drop_state(self.opt, self._params_of(set(owned) | sent_state))
        self._settle(held, also=sources(weights, self.rank) | sent_state, current=have_weights)
        sent_w = self._exchange(weights, state=False)
        t1 = time.perf_counter()
        sent_s = self._exchange(state, state=True)
        drop_state(self.opt, self._params_of(owned))
        self._settle(held, also=set(), current=None)
        self.current, self.owned, self.held = need, owned, held
        t2 = time.perf_counter()
        set_trainable(self.model, new.frozen_layers)
        old = self._phase
        if old is None or self._groups is None or (old.K, old.D, old.tp, old.ranks) != (new.K, new.D, new.tp,
                                                                                           new.ranks):
            destroy_groups(self._groups)
            self._groups = None
            self._groups = build_groups(new, self.rank, timeout=self.timeout, backend=None)
        t3 = time.perf_counter()
        self._build_stage(new, index)
        t4 = time.perf_counter()
        self._phase, self._phase_index = new, index
        secs = torch.tensor([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0], dtype=torch.float64, device=self.device)
        sent = torch.tensor([sent_w, sent_s], dtype=torch.float64, device=self.device)
        dist.all_reduce(secs, op=dist.ReduceOp.MAX)
        dist.all_reduce(sent)
        w, s, g, r, total = secs.tolist()
        bw, bs = sent.tolist()
        return {"seconds": total, "parts": {"weights": w, "optimizer_state": s, "groups": g, "rebuild": r},
                "bytes": {"weights": int(bw), "optimizer_state": int(bs)}}

    def _unshard(self) -> None:
        """Leave FSDP (collective over the data-parallel group): full weights and optimizer state back in
        the canonical layers, the stage dropped (rebuilt by ``_build_stage``)."""
        if self.sharded is not None:
            self.module = self.schedule = None
            self.chunks = {}
            self.sharded.leave()
            self.sharded = None

    def _fsdp_chunks(self, ph: Phase) -> tuple[int, ...]:
        """This rank's chunks that FSDP shards in ``ph`` (``Phase.fsdp_at``: a phase's stages may differ)."""
        return fsdp_chunks(ph, self.groups.place.stage)

    def _wants_shards(self, ph: Phase | None) -> bool:
        return ph is not None and (ph.tp > 1 or bool(self._fsdp_chunks(ph)))

    def _build_stage(self, ph: Phase, index: int, *, shard: bool = True) -> None:
        """This rank's chunks and schedule for ``ph``; with ``shard`` (and a phase with tp or FSDP) on
        sharded copies of its active layers (``hybrid``; collective over the group), else on the layers."""
        twins = None
        if self._wants_shards(ph) and shard:
            place = self.groups.place
            fs = self._fsdp_chunks(ph)
            dp = (self.groups.dp_group, dp_ranks_of(ph, place)) if fs else None
            tp = (self.groups.tp_group, tp_ranks_of(ph, place)) if ph.tp > 1 else None
            # stage 0's frozen prefix (when it runs it: not cached) is split and sharded as its chunk 0 is
            prefix = list(range(ph.frozen_layers)) if place.stage == 0 and not self._caches(ph) else []
            fsdp_layers = {i for c in fs for i in range(*ph.partition[c])} | (set(prefix) if 0 in fs else set())
            self.sharded = ShardedStage(self.model.layers, self.layer_params, self.owned, self.opt, dp=dp, tp=tp,
                                        device=self.device, release=self.store.release,
                                        place=lambda i: self.store.place(i, DEVICE, keep_values=False),
                                        fsdp_layers=fsdp_layers, prefix=prefix, sp=ph.sp)
            self.sharded.enter()
            twins = self.sharded.copies
        self.chunks = {c: stage_module(self.model, ph, c, cached_prefix=self._caches(ph), twins=twins)
                       for c in chunks_of(ph, self.groups.place.stage)}
        mods = list(self.chunks.values())
        self.module = mods[0] if len(mods) == 1 else torch.nn.ModuleList(mods)
        self.schedule = build_schedule(self.chunks, ph, self.phase_schedules[index], self.device, self.groups.pp_group,
                                       self.model.loss, position=self.groups.place.stage, model=self.model,
                                       cached_prefix=self._caches(ph), update=partial(twobw_update, self))

    def _reshard(self) -> None:
        """In a phase with tp or FSDP whose stage is not sharded now (after ``drain`` or a gather): shard it
        again (collective over the group; every rank of the phase calls it at the same point)."""
        if self._wants_shards(self.phase) and self.sharded is None:
            self.module = self.schedule = None
            self.chunks = {}
            self._build_stage(self.phase, self.phase_index)

    def _drain_2bw(self) -> None:
        """Finish what the step left in flight (2BW's outstanding backwards and updates; nothing otherwise)."""
        if self.schedule is not None:
            self.schedule.drain()

    def drain(self) -> None:
        """Make the stage's layers hold the weights training has reached, as plain modules (collective over
        the phase's ranks): a 2BW phase runs its outstanding backwards and updates; a phase with tp or FSDP
        gathers its shards back and runs its chunks on the full layers until the next ``train_step`` shards
        them again -- so an evaluation (``evaluate``) runs the same forward on every rank whatever its
        strategy, with no collective inside a layer (FSDP replicas may evaluate unequal shard counts)."""
        self._drain_2bw()
        if self.sharded is not None:
            self._unshard()
            self._build_stage(self.phase, self.phase_index, shard=False)

    def set_cache(self, cache: ActivationCache | None) -> None:
        """Read the frozen prefix's output from ``cache`` in caching phases from now on (call before the
        first ``switch``, or between steps: then the prefix moves between host and device as needed and
        the current stage is rebuilt)."""
        self.cache = cache
        if self.entered:
            self._unshard()
            self.held = holdings(self.phase, self.rank, self.n, cached_prefix=self._caches(self.phase))
            self._settle(self.held, also=set(), current=None)
            self._build_stage(self.phase, self.phase_index)

    # ---- one optimizer step ----------------------------------------------------------------
    def _allreduce_grads(self) -> None:
        """Average the gradients over the data-parallel group (``gradients.allreduce_grads``)."""
        allreduce_grads(self)

    def _caches(self, ph: Phase) -> bool:
        """Whether stage 0 of ``ph`` reads the frozen prefix's output from the cache."""
        return self.cache is not None and ph.caches_prefix

    def train_step(self, batch: tuple[Tensor, Tensor, Tensor | None], *, want_norms: bool,
                   ids: Tensor | None = None) -> tuple[float, list[float]]:
        """Forward, backward, data-parallel gradient average and optimizer step on this rank's shard
        (``train_step.train_step``): the global mean loss and, with ``want_norms``, the per-block gradient
        norms; ``ids``, the shard's sample ids, are needed when the phase caches the frozen prefix."""
        return train_step(self, batch, want_norms=want_norms, ids=ids)

    # ---- whole-model views -----------------------------------------------------------------
    def gather(self, with_state: bool = False) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]]]:
        """Bring every layer (and optionally every active layer's optimizer state) to rank 0 (``gather.gather``;
        collective): rank 0 gets ({name: weights}, {name: {key: state}}) on the CPU, the others empty dicts."""
        return gather(self, with_state)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of the parameters this rank holds now: ``{"device": ..., "host": ...}``."""
        return {"device": self.store.held_bytes(DEVICE), "host": self.store.held_bytes(HOST)}

    def close(self) -> None:
        """Destroy the phase's groups. The model keeps only this rank's last stage (the rest has no storage)."""
        self._drain_2bw()
        self._unshard()
        destroy_groups(self._groups)
        self._groups = None


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def phase_index(plan: Plan, frozen_blocks: int) -> int:
    return plan.phase_index(frozen_blocks)
