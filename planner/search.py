"""The phase search: for one frozen-block count, the fastest (K, M, cache) whose AutoPipe split fits, proven.

Legend: L blocks, f frozen blocks, n0 frozen flat layers, K pipeline length, D = W / K
data-parallel width (W GPUs), M micro-batches per pipeline, b micro-batch size, B = D·M·b global
batch, N samples per epoch.

Steps, all pure functions of the profile, the cluster and the training settings:

1. ``candidates`` (``candidates.py``): every (K, M, cache) the constraints allow: K divides W and is at most the active
   layers (the pinned K where it is possible; K <= start_K after the first phase), M splits the
   pipeline's batch (M >= K for 1F1B; the pinned M where possible), b inside the profile's
   measured sizes unless extrapolation is allowed, the AutoCache where the mode and the nodes'
   host memory allow; with ``strategies="auto"`` also every tp inside a node and, for FSDP and for
   recomputation, off / on for every stage / chosen per stage (``stage.StageChoice``; each split's assignment
   of strategies to stages the best by the simulated iteration, ``assign.py``; FSDP only where D > 1). There is
   no cap on M: memory and the batch bound it.
   With ``--schedule 2bw`` (PipeDream-2BW) an iteration is one mini-batch of the flush-free steady
   state, stages keep two weight versions of their active layers, and M >= K.
2. ``lower_bound`` (``bounds.py``): a bound on the simulated iteration that needs no partition (the stages' total
   compute divided over K, and one micro-batch's path through every stage). The simulator's
   iteration is never below it. Where stages choose FSDP, it is taken with per layer the smaller
   of the costs with and without FSDP (``strategy.min_table``), so it bounds every choice.
3. ``search`` (``_branch_and_bound``): candidates in order of their bound per sample; each is split exactly by AutoPipe
   under the one stage model's memory (``partition.split_stages``) and simulated; the search
   stops when the next bound per sample is no better than the best simulated. So the result is the
   candidate an exhaustive "split and simulate every candidate" would pick (tests check that).
   With the AutoCache the objective is the phase's time per sample with its fill iterations
   (the first pass over the data, which computes and writes the prefix's outputs) charged.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from .assign import best_assignments, options
from .bounds import Chain, Counts, Least, chain_counts, chain_ends, count_times, iteration_lower_bound, last_backward
from .bounds import FORM_CELLS, PathTables, least_terms, path_tables, path_terms, split_bound, split_bounds
from .cache_size import host_bytes
from .candidate import Candidate, Choice, Visit
from .candidate import seconds_per_sample as _seconds_per_sample
from .candidates import check_pins, enumerate_candidates, pipeline_lengths, schedule_shapes
from .cluster import Cluster, charged_overheads, measured_host_io
from .config import AUTO_SCHEDULES, TrainingConfig
from .costs import CostTable
from .errors import InfeasibleError, PtplanError
from .partition import refusal_by_bound, split_stages
from .resplit import GIVE_UP, StageTerms, Terms, best_split, enumerable
from .profile import Profile
from .schedule import Schedule, build_schedule, peak_inflight, peak_stashed, splits_backward, stage_to_rank
from .simulate import StageCost, StageTimes, critical_paths, iterations, rank_paths, simulate
from .stage import Links, PhaseShape, StageChoice, StageModel, links_for, stage_times
from .strategy import Strategy, min_table, runtime_refusal, search_modes, search_strategies, strategy_table
from .strategy import tp_allreduce_coeffs
from .tp_split import tp_refusal

__all__ = ["Candidate", "Choice", "PhaseSearch", "Visit", "exhaustive", "iteration_bound_holds",
           "split_bound"]  # the records (candidate.py) and split_bound (bounds.py) are imported from here too

GiB = float(1 << 30)
LAYERWISE = (1, 2, 4, 8)
"""Layer counts a stage may recompute from its start, short of all of its layers (``stage_options``)."""


class PhaseSearch:
    """Searches every phase of one profile + cluster + training config (memoises what phases share)."""

    def __init__(self, profile: Profile, cluster: Cluster, cfg: TrainingConfig, *, strategies: str = "off") -> None:
        """``strategies``: "off" (every stage plain data parallel, the search as before) or "auto" (every
        tp inside a node that divides the GPUs and the model's heads, key/value heads and MLP width
        (``tp_split``); FSDP off, on every stage, or chosen per stage; recomputation
        likewise: ``modes``)."""
        cluster = charged_overheads(cluster, profile)  # the profiler's measured per-action overhead (cluster.py)
        self.p, self.c, self.cfg = profile, cluster, cfg
        self.io = measured_host_io(cluster, profile, cfg.host_read_bandwidth)
        """The AutoCache's host bandwidths: the profiler's measured ones, else the config's ``host_read_bandwidth``."""
        if strategies not in ("off", "auto"):
            raise PtplanError(f"strategies={strategies!r}; use off or auto")
        check_pins(cfg, cluster.world_size, profile.num_layers)
        G = cluster.gpus_per_node
        tps = [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= G and G % t == 0  # and divides heads, kv heads, MLP
               and tp_refusal(profile.model.family, profile.model.config, t) is None] if strategies == "auto" else [1]
        self.modes = search_modes(tps, strategies == "auto", profile.model.family, profile.model.seq_len)
        """(tp, FSDP mode, recomputation mode, sequence parallelism) per candidate family (``strategy.search_modes``),
        modes as ``Candidate.mode``: 0 off, 1 on every stage, 2 chosen per stage. Every uniform strategy; then
        recomputation chosen per stage with FSDP chosen per stage too, or on every stage (where D > 1: FSDP shards
        over the replicas), or off (only where D = 1; where D > 1 choosing both per stage covers it: a stage takes
        FSDP only where that is faster or the only fit). Choosing FSDP per stage with recomputation fixed is left
        out: recomputation changes only a stage's busy time and memory, so the stage's own choice of it is never
        worse for the split. Each tp > 1 family again with sequence parallelism where the family runs it
        (``tp_split.sp_refusal``; ``candidates.enumerate_candidates`` drops the (K, V) it refuses)."""
        self.strategies = search_strategies(self.modes)
        """The uniform strategies searched (the default first)."""
        self._tables: dict[tuple, CostTable] = {}
        self.t = CostTable(profile, time_scale=cluster.concurrency_slowdown)
        self.n = profile.num_layers
        self.W = cluster.world_size
        self.limit = cluster.gpu_memory_bytes * cfg.memory_fraction
        self._links: dict[tuple[int, str, int] | tuple[int, str, int, int], Links] = {}
        self._stage0: dict[int, int] = {}
        self._tp_ar: dict[int, tuple[float, float]] = {}
        self._rows: dict[Candidate, np.ndarray] = {}
        """Per candidate (without the cache), its stage family's ``position_state``: made with its first model, it
        lets later phases refuse it without one where even that bound fits nothing (``partition.refusal_by_bound``)."""
        self._fbmax: dict[int | tuple[int, int], np.ndarray] = {}
        self._hint: dict[bool | None, tuple] = {}
        self._split_memo: dict[tuple, tuple] = {}
        """(stage model, AutoPipe's split) of the candidates ``_branch_and_bound`` evaluated without the descent."""
        self.schedules = self._schedules()
        self.evaluated = 0
        """Candidates split and simulated so far (for benchmarks)."""
        self.unproven = 0  # per-stage strategy searches stopped at ``assign.MAX_COLUMNS`` (for benchmarks)

    # ---- shared pieces -------------------------------------------------------------------------
    def _schedules(self) -> tuple[str, ...]:
        """The schedules to search: the configured one, or ``auto``'s set (zero-bubble ones only when
        the profile split the backward into its input- and weight-gradient parts)."""
        if self.cfg.schedule != "auto":
            return (self.cfg.schedule,)
        return tuple(s for s in AUTO_SCHEDULES if not splits_backward(s) or self.t.backward_split_measured)

    def links(self, K: int, schedule: str = "1f1b", V: int = 1, tp: int = 1) -> Links:
        """Links of K positions; with tp > 1 each position is a tp-wide group of one node, laid out as one
        device of a cluster with gpus_per_node / tp devices per node (its pipeline sends costed as one link)."""
        key: tuple[int, str, int] | tuple[int, str, int, int] = (K, schedule, V) if tp == 1 else (K, schedule, V, tp)
        if key not in self._links:
            cl = self.c if tp == 1 else replace(self.c, gpus_per_node=self.c.gpus_per_node // tp)
            self._links[key] = links_for(cl, K, stage_to_rank(schedule, K, V))
        return self._links[key]

    def tp_ar(self, tp: int) -> tuple[float, float]:
        """``strategy.tp_allreduce_coeffs`` on this cluster, once per tp."""
        if tp not in self._tp_ar:
            self._tp_ar[tp] = tp_allreduce_coeffs(self.c, tp)
        return self._tp_ar[tp]

    def table_for(self, c: Candidate) -> CostTable:
        """The per-shard cost table of candidate c's strategy (``strategy.strategy_table``; the profile's own
        table for the default strategy). With FSDP chosen per stage: per layer the smaller of the tables
        with and without FSDP (``strategy.min_table``), which bounds any stage's costs from below."""
        if c.tp == 1 and not c.fsdp and not c.fsdp_per_stage:
            return self.t
        if c.fsdp_per_stage:
            key: tuple = ("min", c.tp, c.sp, c.D, c.K, c.schedule, c.V)
            if key not in self._tables:
                self._tables[key] = min_table(self.table_for(replace(c, fsdp_per_stage=False)),
                                              self.table_for(replace(c, fsdp_per_stage=False, fsdp=True)))
            return self._tables[key]
        key = (c.tp, c.sp, c.fsdp, c.D, c.K, c.schedule, c.V)
        if key not in self._tables:
            L = self.links(c.K, c.schedule, c.V, c.tp)
            self._tables[key] = strategy_table(self.t, c.strategy, c.D, self.tp_ar(c.tp),
                                               (float(np.mean(L.ar_lat)), float(np.mean(L.ar_per_byte))))
        return self._tables[key]

    def schedule(self, c: Candidate) -> Schedule:
        return build_schedule(c.schedule, c.K, c.M, c.V)

    def stage_limit(self, c: Candidate, n0: int | None = None, fill_from: int = 0) -> float:
        """Bytes one stage (chunk) may use: the device's usable memory, over V chunks per position. On a CPU cluster
        with the AutoCache (given n0) the processes and the cache share the node's RAM: each process may use what
        the cache leaves of it, split evenly (issue 22: before, the processes' limits took all of it)."""
        lim = self.limit
        if c.cache and n0 is not None and self.c.device_is_host and self.c.host_memory_bytes is not None:
            room = self.c.host_memory_bytes * self.cfg.memory_fraction - self.host_bytes_per_node(c, n0, fill_from)
            lim = min(lim, max(room, 1.0) / self.c.gpus_per_node)
        return lim / c.V

    def pipeline_batch(self, D: int) -> int | None:
        if self.cfg.batch_policy == "constant-global":
            return self.cfg.batch // D if self.cfg.batch % D == 0 else None
        return self.cfg.batch

    def model(self, cand: Candidate, n0: int, fill_from: int = 0) -> StageModel | StageChoice:
        """The stage model of a candidate; with per-stage choices, a ``StageChoice`` over one model per option,
        choosing under the limit the split uses."""
        if cand.per_stage:
            return StageChoice([self.uniform_model(replace(cand, fsdp_per_stage=False, recompute_per_stage=False,
                                                           fsdp=st.fsdp, recompute=st.recompute,
                                                           recompute_layers=st.recompute_layers), n0, fill_from)
                                for st in self.stage_options(cand, n0)], self.stage_limit(cand, n0, fill_from))
        return self.uniform_model(cand, n0, fill_from)

    def stage_options(self, cand: Candidate, n0: int) -> list[Strategy]:
        """The strategies ``StageChoice`` offers each stage of a per-stage candidate: ``Candidate.options``, and
        where recomputation is chosen per stage also recomputing only the first r layers (Galvatron's
        layer-wise choice, r = 1, 2, 4, ... below the active layers), before recomputing them all; each one the
        executor runs with the candidate's schedule (``strategy.runtime_refusal``)."""
        out: list[Strategy] = []
        for st in cand.options:
            more = [replace(st, recompute_layers=r) for r in LAYERWISE if r < self.n - n0] \
                if st.recompute and cand.recompute_per_stage else []
            out += [x for x in more if runtime_refusal(cand.schedule, x, cand.D) is None] + [st]
        return out

    def uniform_model(self, cand: Candidate, n0: int, fill_from: int = 0) -> StageModel:
        """The stage model of the candidate's one strategy (``Candidate.strategy``) on every stage."""
        shape = PhaseShape(K=cand.K, M=cand.M, b=cand.b, D=cand.D, frozen=n0, cache=cand.cache, V=cand.V,
                           inflight=peak_inflight(cand.schedule, cand.K, cand.M, cand.V),
                           stashed=peak_stashed(cand.schedule, cand.K, cand.M, cand.V),
                           optimizer=self.cfg.optimizer, device_is_host=self.c.device_is_host,
                           weight_versions=2 if cand.schedule == "2bw" else 1, own_p2p=cand.schedule == "2bw",
                           action_overhead_s=self.c.action_overhead_s,
                           host_io=self.io,
                           tp=cand.tp, sp=cand.sp, fsdp=cand.fsdp, recompute=cand.recompute,
                           recompute_layers=cand.recompute_layers,
                           tp_ar=self.tp_ar(cand.tp),
                           stage_ranks=stage_to_rank(cand.schedule, cand.K, cand.V))
        return StageModel(self.t, shape, self.links(cand.K, cand.schedule, cand.V, cand.tp), fill_from=fill_from,
                          shard_table=self.table_for(cand))

    def shapes(self, K: int, M: int, n_active: int) -> list[tuple[str, int]]:
        """(schedule, V) pairs for K positions and M micro-batches (``candidates.schedule_shapes``)."""
        return schedule_shapes(self, K, M, n_active)

    # ---- 1. candidates -------------------------------------------------------------------------
    def k_options(self, f: int, n_active: int, *, free: bool) -> tuple[list[int], list[str]]:
        """Pipeline lengths to try, and notes when a pinned K cannot be used here (``candidates.pipeline_lengths``)."""
        return pipeline_lengths(self, f, n_active, free=free)

    def candidates(self, f: int, n0: int, *, free: bool = False, pin_k: bool = True, cache: bool | None = None
                   ) -> tuple[list[Candidate], list[str], list[str]]:
        """``candidates.enumerate_candidates``: (candidates, reasons some K or M were left out, notes)."""
        return enumerate_candidates(self, f, n0, free=free, pin_k=pin_k, cache=cache)

    # ---- 2. bounds -----------------------------------------------------------------------------
    def objective_bound(self, c: Candidate, n0: int, visit: Visit) -> float:
        """Seconds per sample that this candidate's objective is at least, whatever its split: the
        iteration bound below for steady iterations, and with the AutoCache also for fill iterations
        (the fill's set-up is the same for every split), weighted as the objective weighs them."""
        steady = self.lower_bound(c, n0)
        if not c.cache:
            return steady / c.B
        fill = self.lower_bound(c, n0, fill_from=visit.fill_from)
        return _seconds_per_sample(c, steady, fill, visit, self.cfg.samples_per_epoch)

    def lower_bound(self, c: Candidate, n0: int, *, fill_from: int | None = None) -> float:
        """``bounds.iteration_lower_bound``: seconds that the simulated iteration of any split of c is at least."""
        return iteration_lower_bound(self, c, n0, fill_from=fill_from)

    def fb_suffix_max(self, b: int, table: CostTable | None = None) -> np.ndarray:
        """``[i]``: the largest forward + backward of one layer among layers [i, n) at micro-batch size b
        (in ``table``, default the profile's)."""
        table = self.t if table is None else table
        key: int | tuple[int, int] = b if table is self.t else (b, id(table))
        got = self._fbmax.get(key)
        if got is None:
            tm = table.at(b)
            got = np.maximum.accumulate((tm.fwd + tm.bwd)[::-1])[::-1]
            self._fbmax[key] = got
        return got

    def split_bound(self, c: Candidate, costs: Sequence[StageCost]) -> float:
        """``split_bound`` (module level) for this search's cluster."""
        return split_bound(c, costs, self.c.step_overhead_s)

    def host_bytes_per_node(self, c: Candidate, n0: int, fill_from: int) -> float:
        """Host memory a node needs for the AutoCache: every sample's prefix output at n0 and, while a
        fill refreshes from fill_from, at fill_from too; plus the frozen weights the node's stage-0
        ranks keep in host memory to fill it (page-locked on a GPU: ``cache_size.PINNED_ROUNDING``)."""
        if not c.cache:
            return 0.0
        N, out = self.cfg.samples_per_epoch, self.t.out_per_sample
        return float(host_bytes(N, int(out[n0 - 1]), float(self.t.cum_param[n0]), self.stage0_per_node(c.K),
                                int(out[fill_from - 1]) if fill_from > 0 else 0,  # the runtime's slabs
                                pinned=not self.c.device_is_host))

    def stage0_per_node(self, K: int) -> int:
        """The most stage-0 ranks any node holds at pipeline length K."""
        if K not in self._stage0:
            first = np.array([row[0] for row in self.links(K).ranks]) // self.c.gpus_per_node
            self._stage0[K] = int(np.bincount(first).max())
        return self._stage0[K]

    def host_fits(self, c: Candidate, n0: int, fill_from: int) -> tuple[bool, str]:
        cap = self.c.host_memory_bytes
        need = self.host_bytes_per_node(c, n0, fill_from)
        if cap is None or not c.cache:
            return True, ""
        usable = cap * self.cfg.memory_fraction  # on a CPU cluster shared with the processes (``stage_limit``)
        if need < usable:
            return True, ""
        return False, (f"the AutoCache needs {need / GiB:,.1f} GiB of host memory per node "
                       f"(prefix outputs of {self.cfg.samples_per_epoch:,} samples and the frozen weights) but a "
                       f"node has {usable / GiB:,.1f} GiB ({cap / GiB:,.1f} GiB x {self.cfg.memory_fraction:g}"
                       + (f", shared with its {self.c.gpus_per_node} processes" if self.c.device_is_host else "")
                       + "); use fewer samples per epoch, a node with more memory, or --cache off")

    # ---- 3. evaluation and search --------------------------------------------------------------
    def evaluate(self, c: Candidate, n0: int, visit: Visit, cutoff: float = math.inf, *, descend: bool = True,
                 give_up: float | None = None) -> "Choice | str | _Reason | None":
        """Split and simulate one candidate; a reason when it does not fit; None when its split's bound
        per sample is no better than ``cutoff`` (it cannot win). The split: the best by simulated time
        (``resplit.best_split``: every split where there are few, else the descent from AutoPipe's split, which
        ``descend=False`` leaves out, and which is not started from a split over ``give_up``, default
        ``cutoff`` x (1 + ``GIVE_UP``))."""
        self.evaluated += 1
        fill_from = visit.fill_from if c.cache else 0
        ok, why = self.host_fits(c, n0, fill_from)
        if not ok:
            return f"{c.tag}: {why}"
        key = (c, n0, fill_from)
        lim = self.stage_limit(c, n0, fill_from)  # V > 1: each of a position's V chunks within limit / V
        memo = self._split_memo.pop(key, None)
        rows_key = replace(c, cache=False)  # the memory lower bound depends on neither n0 nor the cache
        if memo is None and rows_key in self._rows:  # a phase before built this candidate's model
            refused = refusal_by_bound(self._rows[rows_key], n0, lim, lambda: self.model(c, n0, fill_from))
            if refused is not None:
                return _Reason(f"{c.tag}: ", refused)
        model, part = memo or (self.model(c, n0, fill_from), None)
        self._rows[rows_key] = model.position_state
        try:
            part = part or split_stages(model, c.S, lim)
        except InfeasibleError as e:
            return _Reason(f"{c.tag}: ", e)
        if not descend:  # ``_branch_and_bound`` may descend from it later
            self._split_memo[key] = (model, part)
        sched = self.schedule(c)
        sc = _Scorer(self, c, model, sched, visit, cutoff)
        first = (part.ranges[0][0], *(hi for _, hi in part.ranges))
        cuts, score = best_split(first, sc, bounds=sc.bounds, start=sc.start(first), **sc.proofs(self.batched(c)),
                                 give_up=(cutoff * (1 + GIVE_UP) if give_up is None else give_up) if descend
                                 else -math.inf, cutoff=cutoff)
        if score > cutoff * (1 + 1e-12):
            return None
        ranges = tuple(zip(cuts[:-1], cuts[1:]))
        if isinstance(model, StageChoice):  # each stage's strategy: the split's best assignment, not its busy pick
            model.fix(ranges, sc.chosen(np.array([cuts]))[1][0])
        costs = tuple(model.stage_costs(ranges))
        sim = simulate(sched, costs, step_overhead_s=self.c.step_overhead_s)
        fill_costs: tuple[StageCost, ...] = ()
        fill_sim = None
        fill_s = sim.iteration_s
        if c.cache:
            fill_costs = tuple(model.stage_costs(ranges, fill=True))
            fill_sim = simulate(sched, fill_costs, step_overhead_s=self.c.step_overhead_s)
            fill_s = fill_sim.iteration_s
        peak = max(sim.rank_peak_memory_bytes)
        assert peak <= self.limit * (1 + 1e-9), "the simulator and the partitioner disagree on memory"
        return Choice(cand=c, ranges=ranges, costs=costs, sim=sim, fill_costs=fill_costs, fill_sim=fill_sim,
                      memory=tuple(model.stage_memory(ranges)), strategies=model.stage_strategies(ranges),
                      links=self.links(c.K, c.schedule, c.V, c.tp),
                      objective=_seconds_per_sample(c, sim.iteration_s, fill_s, visit, self.cfg.samples_per_epoch))

    def batched(self, c: Candidate) -> bool:
        """Whether the candidate's splits are scored many at once (``_Scorer.many``): a schedule without token
        slices (``simulate.iterations``)."""
        return self.schedule(c).slices == 1

    def search(self, f: int, visit: Visit, *, free: bool = False, cache: bool | None = None) -> Choice:
        """The best configuration for f frozen blocks (``free``: ignore start_K and the pins; ``cache``:
        only with or without the AutoCache, None: as configured)."""
        n0 = self.p.frozen_boundary(f)
        choice = _branch_and_bound(self, f, n0, visit, free=free, pin_k=True, cache=cache)
        if isinstance(choice, Choice):
            return choice
        if self.cfg.pin_K is not None and not free:  # the pinned K fits nowhere here: choose freely, say so
            again = _branch_and_bound(self, f, n0, visit, free=False, pin_k=False, cache=cache)
            if isinstance(again, Choice):
                note = (f"pinned K={self.cfg.pin_K} does not fit here (no micro-batch count or split of it fits in "
                        f"memory); K chosen freely")
                return replace(again, notes=(note, *again.notes))
        raise _infeasible(self, f, n0, choice)


def _branch_and_bound(search: PhaseSearch, f: int, n0: int, visit: Visit, *, free: bool, pin_k: bool,
                     cache: bool | None) -> "Choice | list[str | _Reason]":
    """Step 3: candidates in order of their bound per sample, each split and simulated, until the next bound
    is no better than the best simulated; then the descent for the ones near the best. The reasons none fits
    where none does."""
    cands, reasons0, notes = search.candidates(f, n0, free=free, pin_k=pin_k, cache=cache)
    reasons: list[str | _Reason] = list(reasons0)
    fits = []
    for c in cands:
        ok, why = search.host_fits(c, n0, visit.fill_from if c.cache else 0)
        if ok:
            fits.append(c)
        elif not any(isinstance(r, str) and r.endswith(why) for r in reasons[-1:]):
            reasons.append(f"K={c.K}, cache on: {why}")
    # recomputation is not in the bound (``lower_bound``): candidates that differ only in it share theirs
    bounds: dict[tuple, float] = {}

    def bound(c: Candidate) -> float:
        key = (c.K, c.D, c.M, c.b, c.cache, c.schedule, c.V, c.tp, c.sp, c.fsdp, c.fsdp_per_stage)
        got = bounds.get(key)
        if got is None:
            got = bounds[key] = search.objective_bound(c, n0, visit)
        return got

    heap = [(bound(c), i, c) for i, c in enumerate(fits)]
    # the previous phase's winner first: a good incumbent lets the bounds skip most candidates
    hint = search._hint.get(cache)
    first = [c for c in fits if hint is not None and (c.K, c.M, c.cache, c.schedule, c.V, c.tp, c.sp, c.mode) == hint]
    heapq.heapify(heap)
    best: Choice | None = None

    near: list[Choice] = []

    def consider(c: Candidate, descend: bool = False) -> None:
        nonlocal best
        got = search.evaluate(c, n0, visit, best.objective if best is not None else math.inf, descend=descend)
        if isinstance(got, Choice) and not descend:
            near.append(got)
        if got is None:
            return
        if not isinstance(got, Choice):
            reasons.append(got)
        elif best is None or _order(got) < _order(best):
            best = got

    for c in first:
        consider(c)
    while heap:
        lb, _, c = heapq.heappop(heap)
        if best is not None and lb > best.objective * (1 + 1e-12):
            break
        if c not in first:
            consider(c)
    if best is None:
        return reasons
    # the descent, for the candidates whose AutoPipe split is near the best (``resplit.GIVE_UP``)
    for ch in sorted(near, key=_order):
        if ch.objective <= best.objective * (1 + GIVE_UP) and not enumerable(n0, search.n, ch.cand.S,
                                                                             batched=search.batched(ch.cand)):
            consider(ch.cand, True)
    search._split_memo.clear()
    search._hint[cache] = (best.cand.K, best.cand.M, best.cand.cache, best.cand.schedule, best.cand.V,
                         best.cand.tp, best.cand.sp, best.cand.mode)
    return replace(best, notes=tuple(notes))


def _infeasible(search: PhaseSearch, f: int, n0: int, reasons: "Sequence[str | _Reason]") -> InfeasibleError:
    told: list[str] = []
    rest = 0
    for r in _spread(reasons):  # a reason's text may cost a search (``_Reason``): only the shown ones are made
        if len(told) == 8:
            rest += 1
        elif (text := str(r)) not in told:
            told.append(text)
    shown = "\n  ".join(told) + (f"\n  (+{rest} more)" if rest else "")
    prefix = (f"\nThe frozen prefix holds {search.t.cum_param[n0] / GiB:.2f} GiB of weights (on stage 0 unless "
              f"cached)." if n0 else "")
    return InfeasibleError(
        f"no pipeline configuration fits with {f} frozen blocks on {search.c.name} "
        f"({search.W} {search.c.device_noun_plural} x {search.c.gpu_memory_bytes / GiB:.1f} GiB, "
        f"{search.cfg.memory_fraction:.0%} usable):\n  {shown or 'no candidate (K, M)'}{prefix}\n"
        f"Fix: use a cluster with more or larger GPUs, a smaller batch, a batch divisible by more "
        f"data-parallel widths, --cache auto, or profile the micro-batch sizes the batch needs"
        f"{'' if len(search.strategies) > 1 else '; or --strategies auto (tensor parallel, FSDP, recomputation)'}.")


def _spread(reasons: "Sequence[str | _Reason]") -> "list[str | _Reason]":
    """The reasons in turns over the pipeline lengths they name (``K=2, ...``): the first of each K, then the
    second of each, so that the few shown cover every K tried and not only the first K's many strategies."""
    turn: dict[str, int] = {}
    keyed = []
    for i, r in enumerate(reasons):
        head = r.prefix if isinstance(r, _Reason) else r
        k = head.split(",", 1)[0].split(":", 1)[0] if head.startswith("K=") else ""
        turn[k] = turn.get(k, -1) + 1
        keyed.append((turn[k], i, r))
    return [r for _, _, r in sorted(keyed, key=lambda x: x[:2])]


def _order(ch: Choice) -> tuple:
    """How choices compare: the objective, then (deterministic ties) smaller K, M, no cache, name, V,
    then the simpler strategy (smaller tp, fewer FSDP stages, fewer recomputing stages, a strategy fixed
    for every stage before one chosen per stage)."""
    c = ch.cand
    n_fsdp = sum(st.fsdp for st in ch.strategies) if ch.strategies else c.S * c.fsdp
    n_rc = sum(st.recompute for st in ch.strategies) if ch.strategies else c.S * c.recompute
    return ch.objective, c.K, c.M, c.cache, c.schedule, c.V, c.tp, c.sp, n_fsdp, n_rc, c.mode


class _Scorer:
    """``resplit.best_split``'s score of one candidate's splits: the phase's seconds per sample (the
    simulator's steady iteration, and with the AutoCache its fill iteration, weighted as ``_seconds_per_sample``;
    where stages choose their strategy, under the split's best assignment, ``chosen``); infinite where a stage
    breaks the memory limit; the split's lower bound (``PhaseSearch.split_bound``) per
    sample instead, where that already loses to the best split so far (never below the simulated objective, so no
    such split is taken over a simulated one). Not where it loses only to the search's cutoff: the descent may have
    to pass through such a split, and a bound under its best would be taken for the split's score."""

    def __init__(self, search: PhaseSearch, c: Candidate, model: StageModel | StageChoice, sched: Schedule,
                 visit: Visit, cutoff: float) -> None:
        self.s, self.c, self.model, self.sched, self.visit, self.cutoff = search, c, model, sched, visit, cutoff
        self.limit = search.stage_limit(c, model.start, visit.fill_from if c.cache else 0) * (1 + 1e-12)

    def __call__(self, cuts: tuple[int, ...], best: float) -> float:
        model = self.model
        if isinstance(model, StageChoice):  # the split's least over its stages' strategies (``assign``)
            return float(self.chosen(np.array([cuts]), bar=best)[0][0])
        return self._simulated(cuts, best)

    def _simulated(self, cuts: tuple[int, ...], best: float) -> float:
        """``__call__`` of one split under the model's own choice of each stage's costs (a ``StageChoice``: each
        stage's fastest busy time that fits, or the assignment ``fix`` gave it)."""
        s, c, model = self.s, self.c, self.model
        ranges = tuple(zip(cuts[:-1], cuts[1:]))
        if bool((np.asarray(model.peaks(ranges)) > self.limit).any()):
            return math.inf
        costs = model.stage_costs(ranges)
        if not c.cache:  # (the fill iteration has its own costs: a cached candidate's splits are all simulated)
            lb = s.split_bound(c, costs) / c.B
            if lb > best * (1 + 1e-12):  # not ``min(best, cutoff)``: a bound under ``best`` would read as a score,
                return lb                # and the descent would step onto it (issue 22's audit, 2026-11-28)
        steady = simulate(self.sched, costs, step_overhead_s=s.c.step_overhead_s).iteration_s
        fill = steady
        if c.cache:
            fill = simulate(self.sched, model.stage_costs(ranges, fill=True), step_overhead_s=s.c.step_overhead_s
                            ).iteration_s
        return _seconds_per_sample(c, steady, fill, self.visit, s.cfg.samples_per_epoch)

    def many(self, X: np.ndarray, bar: float = math.inf) -> np.ndarray:
        """``__call__`` of the splits in the rows of X at once, every one simulated (``simulate.iterations``, equal to
        ``simulate``'s to the last bit); for a schedule without token slices (``PhaseSearch.batched``). Where stages
        choose their strategy, ``chosen``'s: the least entry is the least over every split and assignment. With a
        ``bar``, as ``__call__``'s ``best``: a split whose bound (``split_bounds``) is over it gets the bound."""
        c, m, s = self.c, self.model, self.s
        if isinstance(m, StageChoice):
            return self.chosen(X, bar)[0]
        lo, hi = X[:, :-1], X[:, 1:]
        fits: np.ndarray = np.asarray((m.evaluate_split(m.prepare(lo, hi))[1] <= self.limit).all(axis=1))
        out = np.full(len(X), math.inf)
        if fits.any() and math.isfinite(bar) and not c.cache:  # (as ``_simulated``: the fill has its own costs)
            rows = np.flatnonzero(fits)
            out[rows] = lb = self._split_bounds(stage_times(m, lo[rows], hi[rows]), None)
            fits[rows[lb > bar * (1 + 1e-12)]] = False
        if fits.any():
            lo, hi = lo[fits], hi[fits]
            steady = iterations(self.sched, stage_times(m, lo, hi), step_overhead_s=s.c.step_overhead_s)
            fill = iterations(self.sched, stage_times(m, lo, hi, fill=True), step_overhead_s=s.c.step_overhead_s
                              ) if c.cache else steady
            out[fits] = _seconds_per_sample(c, steady, fill, self.visit, s.cfg.samples_per_epoch)
        return out

    def start(self, cuts: tuple[int, ...]) -> float | None:
        """``best_split``'s ``start``: where stages choose their strategy, the split's objective with each stage's
        fastest busy time that fits (one simulation; ``__call__`` simulates every assignment); None otherwise."""
        return self._simulated(cuts, math.inf) if isinstance(self.model, StageChoice) else None

    def chosen(self, X: np.ndarray, bar: float = math.inf) -> tuple[np.ndarray, np.ndarray]:
        """(objective, assignment) of the splits in the rows of X whose stages each choose their strategy
        (``StageChoice``), by the simulated iteration (``assign.best_assignments``, from each stage's fastest busy
        time that fits): the least entry is the least over every split and every assignment of models to its
        stages, or at least ``bar``; infinite (assignment -1) where a stage fits no model. With a ``bar`` (the
        descent's best), a split whose bound over every assignment (``split_bounds`` of its ideal stages, as
        ``__call__`` bounds one model's) is over it gets that bound (assignment -1). Counts in
        ``PhaseSearch.unproven`` the calls that left assignments unsearched (``assign.MAX_COLUMNS``)."""
        c, m, s = self.c, self.model, self.s
        assert isinstance(m, StageChoice)
        lo, hi = X[:, :-1], X[:, 1:]
        busy, peak = m.each(lo, hi)
        fits = peak <= self.limit
        ok = np.all(np.any(fits, axis=0), axis=1)
        out, picks = np.full(len(X), math.inf), np.full(lo.shape, -1, dtype=np.int64)
        lo, hi, busy, peak = lo[ok], hi[ok], busy[:, ok], peak[:, ok]
        N, ovh, rows = s.cfg.samples_per_epoch, s.c.step_overhead_s, np.flatnonzero(ok)
        if not len(rows):
            return out, picks
        o = options([stage_times(x, lo, hi) for x in m.models],
                    [stage_times(x, lo, hi, fill=True) for x in m.models] if c.cache else None, fits[:, ok])
        if math.isfinite(bar):  # the splits' bounds over every assignment first, as ``__call__``'s for one model
            out[rows] = lb = self._split_bounds(*o.ideal())
            go = lb <= bar * (1 + 1e-12)
            if not go.all():
                rows, busy, peak, o = rows[go], busy[:, go], peak[:, go], o.take(go)
        if len(rows):
            out[rows], picks[rows], proven = best_assignments(
                self.sched, o, m.fastest(busy, peak), lambda st, fl: _seconds_per_sample(c, st, fl, self.visit, N),
                step_overhead_s=ovh, bar=bar)
            s.unproven += not proven
        return out, picks

    def _split_bounds(self, steady: StageTimes, fill: StageTimes | None) -> np.ndarray:
        """The objective's lower bound of splits from their stages' times (``bounds.split_bounds`` of the steady
        and, with the AutoCache, the fill iteration, weighted per sample as the objective weighs them)."""
        c, ovh = self.c, self.s.c.step_overhead_s
        st = split_bounds(c, steady, ovh)
        return _seconds_per_sample(c, st, st if fill is None else split_bounds(c, fill, ovh), self.visit,
                                   self.s.cfg.samples_per_epoch)

    def bounds(self, X: np.ndarray) -> np.ndarray:
        """Lower bounds of ``__call__`` for the splits in the rows of X (``resplit.Bounds``), cheap (numpy): the
        terms of ``PhaseSearch.split_bound`` from each stage's least durations over the models that fit it
        (``bounds.least_terms``): its busy time l_s (its layers' forward and backward, no messages, plus its two
        actions' overheads and stage 0's prefix), all-reduce and step d_s, and forward f_s. Every rank runs its
        M forwards and backwards one at a time, then its all-reduce and optimizer step (M·l_s + d_s); with a flush,
        stage s starts only after micro-batch 0's forwards on the stages before it (Σ_{s'<s} f_s' + M·l_s + d_s),
        and without W it also ends only before their last backwards, after which stage 0's all-reduce and step
        come (Σ_{s'<s} l_s' + M·l_s + d_0), each with the least messages on the links between (``Chain``). In a
        schedule whose stages' last B's chain (``bounds.chain_counts``) also every stage's last B (``last_backward``,
        ``chain_ends``) and the W's after it, then its d_s.
        With the AutoCache stage 0's set-up comes first (reading, or in a fill
        iteration filling, the cache); then the step overhead; steady and fill iterations weighted as the
        objective weighs them (``_seconds_per_sample``). Infinite where no model fits a stage."""
        c, lo, hi, chain = self.c, X[:, :-1], X[:, 1:], self._counts is not None
        x = Least(*np.stack([least_terms(c, self.model, self.limit, lo[:, k], hi[:, k], k, chain=chain)
                             for k in range(X.shape[1] - 1)], axis=-1))
        fits = np.isfinite(x.busy).all(axis=1)  # (such a split is infinite, not nan)
        L, done, Fw, PB, Wt = (np.where(fits[:, None], v, 0.0) for v in x)
        flush, p, S = c.schedule != "2bw", self._chain, X.shape[1] - 1
        work, sent = c.M * L + done, p.sent[:S]
        head = np.max(np.cumsum(L, axis=1) - L + 2 * sent + c.M * L, axis=1) + done[:, 0] \
            if flush and not splits_backward(c.schedule) else -np.inf
        arrive = np.cumsum(Fw, axis=1) - Fw + sent  # micro-batch 0 through the stages before
        if flush:
            head = np.maximum(head, np.max(arrive + work, axis=1))
        n = self._counts
        if n is not None:  # each stage's all-reduce and step after its own last B and W's (``chain_ends``)
            zb = splits_backward(c.schedule)
            path = Fw + PB if zb else L  # one micro-batch's forward and B on a later stage
            after = np.cumsum(path[:, ::-1], axis=1)[:, ::-1] - path + 2 * (p.sent[S] - sent)
            ends = last_backward(n, c.M, arrive, Fw, PB, Wt, after, None if zb else L)
            ends = chain_ends(ends, PB + p.link) + count_times(n.w_tail, Wt)
            head = np.maximum(head, np.max(ends + done, axis=1))

        def iteration(setup: float) -> np.ndarray:  # the cache's set-up delays stage 0's rank, and so every stage
            return np.maximum(np.maximum(work[:, 0] + setup, np.max(work, axis=1)), head + setup) \
                + self.s.c.step_overhead_s
        return np.where(fits, self._weighted(iteration), np.inf)

    def _weighted(self, iteration: Callable[[float], np.ndarray]) -> np.ndarray:
        """The objective's weighting (``_seconds_per_sample``) of a steady and (with the AutoCache) a fill
        iteration, given as ``iteration(stage 0's set-up)``, each set-up its least over the models."""
        ms = self.model.models if isinstance(self.model, StageChoice) else (self.model,)
        steady = iteration(min(m.read_setup_s for m in ms))
        fill = iteration(min(m.fill_setup_s for m in ms)) if self.c.cache else steady
        ws, wf = self._weights
        out = np.zeros(np.shape(steady))
        for weight, it in ((ws, steady), (wf, fill)):
            if weight:  # (not 0 x inf where a stage fits nothing)
                out = out + weight * it
        return out

    @functools.cached_property
    def _weights(self) -> tuple[float, float]:
        """The objective's weights of a steady and a fill iteration: it is linear in the two."""
        c, v, N = self.c, self.visit, self.s.cfg.samples_per_epoch
        return _seconds_per_sample(c, 1.0, 0.0, v, N), _seconds_per_sample(c, 0.0, 1.0, v, N)

    def proofs(self, batched: bool) -> dict:
        """``best_split``'s ``many``, ``proof`` and ``forms`` for this candidate: ``many`` for a batched schedule
        (``PhaseSearch.batched``), ``forms`` where there is a flush and the tables (``bounds.path_tables``) hold at
        most ``bounds.FORM_CELLS`` stage-range cells."""
        c, m = self.c, self.model.n - self.model.start + 1
        formed = batched and c.schedule != "2bw" and c.S * m * m <= FORM_CELLS
        return dict(many=self.many if batched else None, proof=self.stage_bounds, forms=self.forms if formed else None)

    @functools.cached_property
    def _tables(self) -> PathTables:
        return path_tables(self.c, self.model, self.limit, self._weights)

    def forms(self, cuts: tuple[int, ...] | None, at_most: int) -> Terms:
        """``resplit.Forms``: the chains of actions that end the split's steady and (with the AutoCache) fill
        iterations, and those that would were one rank a little slower (``simulate.critical_paths``), or without a
        split each rank's own chain (``simulate.rank_paths``), the first ``at_most`` of them,
        each priced on every stage and range (``bounds.path_terms``) in the objective's units (its weights' sum
        times the iteration: the tables' set-up is their weighted mean)."""
        if cuts is None:
            counts = list(rank_paths(self.sched))
        else:
            X = np.array([cuts])
            counts = [n for fill in ((False, True) if self.c.cache else (False,))
                      for n in critical_paths(self.sched, stage_times(self.model, X[:, :-1], X[:, 1:], fill=fill))]
        t = self._tables
        v = np.empty((min(len(counts), max(at_most, 0)), self.c.S, len(t.i) + 1))
        for q, n in enumerate(counts[:len(v)]):
            v[q] = path_terms(t, n)
            v[q, 0] += self.s.c.step_overhead_s
            v[q] *= sum(self._weights)
        return Terms(v, self._slots)

    @functools.cached_property
    def _slots(self) -> np.ndarray:
        return Terms.slots(self._tables.m)

    @functools.cached_property
    def _counts(self) -> Counts | None:
        """``bounds.chain_counts`` of the candidate's schedule where the bounds read the chain: with one stage a rank
        only (with several, a rank's V stages' work together bounds more than one stage's chain; measured on the
        synthetic grid, interleaved 1F1B, the pairs left 140 of 142 candidates descended, and planning took
        1.3-1.6x as long: the proof by the simulator's chains, ``forms``, takes those)."""
        c = self.c
        return chain_counts(c.schedule, c.K, c.M, c.V) if c.V == 1 else None

    @functools.cached_property
    def _chain(self) -> Chain:
        """What the bounds read of the active layers besides each stage's ``Least``, each its least over the models:
        the per-action overhead, stage 0's prefix, the forward and backward prefix sums per layer, and each link's
        least message, stage s to s + 1 (its latency and the smallest boundary's bytes; none where a schedule's
        stages are not one chain of ranks)."""
        c, model = self.c, self.model
        ms = model.models if isinstance(model, StageChoice) else (model,)
        a, n, S = model.start, model.n, c.S

        def least_cum(name: str) -> np.ndarray:
            return np.concatenate(([0.0], np.cumsum(np.min([np.diff(getattr(m.times, name)) for m in ms], axis=0))))
        link = np.zeros(S)
        if c.V == 1 and S > 1:
            least_out = c.b * float(np.min([m.t.out_per_sample[a:n - 1].min() for m in ms]))
            link[:-1] = np.min([m.links.send_lat + least_out * m.links.send_inv_bw for m in ms], axis=0)
        zb = splits_backward(c.schedule)
        path = np.min([np.diff(m.times.cum_bwd - (m.times.cum_bwd_weight if zb else 0.0)) for m in ms], axis=0)
        return Chain(ovh=min(m.ovh for m in ms), prefix=min(m.prefix_s for m in ms), cum_fwd=least_cum("cum_fwd"),
                     cum_path=np.concatenate(([0.0], np.cumsum(path))), link=link,
                     sent=np.concatenate(([0.0], np.cumsum(link))))

    def stage_bounds(self) -> StageTerms:
        """``bounds`` stage by stage (``resplit.Proof``): G[s, i, j] bounds from below ``bounds`` of every split whose
        stage s holds layers [a + i, a + j) (a the first active layer). Each of ``bounds``' terms is one stage's
        (its work, and its head: the stages before it through their layers' least prefix sums over every model,
        and for stage 0's all-reduce and step, their least over stage 0's ends), and the weighted steady and fill
        iterations are bounded by the largest weighted sum of one stage's terms. Infinite where the stage does
        not fit. Where the stages' last B's chain (``bounds.chain_counts``) also the pairs (``StageTerms``): stage s's
        all-reduce and step follow the last B of every stage p >= s, then the B's of stages s..p-1 (``chain_ends``)
        and stage s's W's after its last B: A_p + B_s, A_p stage p's last B (``last_backward``) plus the B's before
        it from the first active layer, B_s stage s's W's after its last B, all-reduce and step, less the B's before
        it."""
        c, model, p = self.c, self.model, self._chain
        a, n, S = model.start, model.n, c.S
        i, j = np.triu_indices(n - a + 1, k=1)
        lo, hi, st = i + a, j + a, np.arange(S)[:, None]
        L, done, Fw, PB, Wt = np.stack([least_terms(c, model, self.limit, lo, hi, k, chain=self._counts is not None)
                                        for k in range(S)], axis=1)
        sent = p.sent[:S, None]
        before_L = model.cum_time_lb[lo] - model.cum_time_lb[a] + 2 * p.ovh * st + (st > 0) * p.prefix + 2 * sent
        before_F = p.cum_fwd[lo] - p.cum_fwd[a] + p.ovh * st + (st > 0) * p.prefix + sent
        work, flush = c.M * L + done, c.schedule != "2bw"
        done0 = float(done[0][lo == a].min())

        def iteration(setup: float) -> np.ndarray:
            t = work + (st == 0) * setup
            if flush and not splits_backward(c.schedule):
                t = np.maximum(t, before_L + c.M * L + done0 + setup)
            if flush:
                t = np.maximum(t, before_F + work + setup)
            return t + self.s.c.step_overhead_s

        def grid(v: np.ndarray) -> np.ndarray:
            out = np.full((S, n - a + 1, n - a + 1), np.inf)
            out[:, i, j] = v
            return out
        cn = self._counts
        if cn is None:
            return StageTerms(grid(self._weighted(iteration)))
        zb = splits_backward(c.schedule)
        later = p.cum_fwd[n] - p.cum_fwd[hi] + p.cum_path[n] - p.cum_path[hi] if zb else \
            model.cum_time_lb[n] - model.cum_time_lb[hi]
        after = later + 2 * p.ovh * (S - 1 - st) + 2 * (p.sent[S] - sent)
        chain = p.cum_path[lo] - p.cum_path[a] + p.ovh * st + sent  # the B's (and messages) before each stage
        n_st = Counts(*(v[:, None] for v in cn))
        ends = last_backward(n_st, c.M, before_F, Fw, PB, Wt, after, None if zb else L) + chain
        A = self._weighted(lambda setup: ends + setup + self.s.c.step_overhead_s)
        B = self._weighted(lambda setup: done + count_times(n_st.w_tail, Wt) - chain)
        return StageTerms(grid(np.maximum(self._weighted(iteration), A + B)), grid(A), grid(B))


class _Reason:
    """Why a candidate did not fit; the exception's message (which may cost a search) is made only
    when the reason is shown."""

    def __init__(self, prefix: str, err: Exception) -> None:
        self.prefix, self.err = prefix, err

    def __str__(self) -> str:
        return f"{self.prefix}{self.err}"


def exhaustive(search: PhaseSearch, f: int, visit: Visit, *, cache: bool | None = None) -> Choice | None:
    """Every candidate split and simulated, the best kept: the reference the tests hold ``search`` to. Unlike
    ``search`` it bounds no candidate (each is split and simulated, in the order ``candidates`` gives) and every
    candidate's descent runs; only splits whose lower bound (``_Scorer.bounds``, ``split_bound``) is over the
    best objective so far are not simulated, as they cannot win."""
    n0 = search.p.frozen_boundary(f)
    cands, _, _ = search.candidates(f, n0, cache=cache)
    best: Choice | None = None
    for c in cands:
        got = search.evaluate(c, n0, visit, best.objective if best is not None else math.inf, give_up=math.inf)
        if isinstance(got, Choice) and (best is None or _order(got) < _order(best)):
            best = got
    return best


def iteration_bound_holds(search: PhaseSearch, c: Candidate, n0: int, choice: Choice) -> bool:
    """The partition-free bound never exceeds the simulated iteration (for tests)."""
    return search.lower_bound(c, n0) <= choice.sim.iteration_s * (1 + 1e-9)

