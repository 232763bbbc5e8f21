"""The ablation: how much of the predicted speedup each part of elastic pipelining gives, for one model and cluster.

Legend: L blocks, f frozen blocks, n0 frozen flat layers, K pipeline length, S the starting K (one
pipeline per node unless given, as the paper starts), D data-parallel width (D0 = W / S, the
baseline's), M micro-batches, b micro-batch size, B global batch, W GPUs.

Every row is a predicted total training time over the same freeze trajectory, and every number
comes from the one stage model (``stage.py``) and the simulator (``simulate.py``); restricted rows
restrict the search from outside it (subclasses of ``search.PhaseSearch`` here, sub-clusters), and
each row's phases are assembled and walked by the planner's own functions (``planner.trajectory_phases``,
``planner.walk``). The rows:

1. ``no-freeze``: the static K=S pipeline x D0 baseline, M by simulation: the plan's baseline.
2. ``freeze-only``: the trajectory's frozen blocks skip their backward, gradients, all-reduce and
   optimizer step, but the static phase-0 split, K, D and M stay. The frozen layers then sit inside
   later stages, where the search's phases never put them (they put the frozen prefix on stage 0), so
   ``freeze_only_costs`` prices the static phase with ``StageModel`` over ``frozen_in_place_table`` (a frozen
   layer costs its no-grad forward, no backward, no gradient, optimizer state or step, no saved activations)
   and drops the messages and syncs that no longer exist (no gradient into a frozen layer; no all-reduce on a
   stage that trains nothing). With nothing frozen it equals ``StageModel.stage_costs``, and with every frozen
   layer on stage 0 it equals the stage model's phase with that frozen prefix (tests check both).
3. ``autopipe``: AutoPipe re-splits and compresses K (any K <= S that divides W, as the planner
   allows), but D stays D0: the freed GPUs idle. Each pipeline compresses in place (it keeps the
   first K of its GPUs), modelled as a sub-cluster of K·D0 GPUs with the same nodes and links
   (``fixed_width_cluster``); cache off.
4. ``autopipe-autocache``: row 3 with the AutoCache decided as the planner decides it (``auto``).
5. ``autopipe-autodp``: the planner as is with ``--cache off`` (AutoDP: D = W / K).
6. ``full``: the planner as is (``--cache auto``).

Beyond the paper, each the full system with one part replaced:

7. ``greedy-split``: row 6's K, D, M and cache per phase, re-priced with the paper's greedy
   parameter-size balancer (``partition.greedy_param_partition``) instead of the optimal split,
   through ``StageModel.stage_costs`` and ``simulate``; phases whose greedy split does not fit in
   memory are marked (their time is still shown: the paper's code would run out of memory there).
8. ``k-halving``: K only from S, S/2, S/4, ... (the paper's 8 -> 4 -> 2 -> 1) instead of any K.
9. ``paper-m-table``: M from the paper's hard-coded table (``paper_micro_batches``) instead of by
   simulation; where the table's M is not valid (does not split the pipeline batch, gives a
   micro-batch size outside the profile's measured sizes, or M < K under 1F1B) the valid M nearest
   to it is used, and the phase says so.

Beside the rows, ``baselines.py``'s classic layouts without freezing (pure data parallel, pure FSDP, tensor
parallel, pipeline only, the best uniform strategy), each with its memory ("does not fit" where it does not).

Speedups are against row 1; each row also states its step against the row it builds on (2 on 1,
3 on 2, 4 on 3, 5 on 3, 6 on 5, 7-9 on 6). ``PAPER_SPEEDUPS`` holds the paper's published bars
(PyTorch blog Fig. 9: ViT-B/16 on ImageNet, 2 nodes x 8 Quadro RTX 5000), for comparison only.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from .baselines import BaselineRow, baselines
from .cluster import Cluster
from .config import TrainingConfig
from .costs import CostTable, _cum
from .errors import InfeasibleError, PtplanError
from .freeze import FreezePolicy
from .partition import greedy_param_partition
from .plan import Phase, Plan, TrajectoryPoint
from .planner import make_plan, phase_from_choice, trajectory_phases, visits, walk
from .profile import Profile
from .replicate import divisors
from .schedule import build_schedule
from .search import Candidate, Choice, PhaseSearch, Visit
from .simulate import StageCost, simulate
from .stage import Links, StageModel

PAPER_SPEEDUPS: dict[str, float] = {"no-freeze": 1.0, "freeze-only": 0.95, "autopipe-autocache": 1.26,
                                    "autopipe-autodp": 2.27, "full": 2.83}
"""The paper's ablation (PyTorch blog Fig. 9; ViT-B/16 ImageNet, 2 nodes x 8 Quadro RTX 5000), by row key."""

PAPER_M_TABLE: dict[int, int] = {8: 2 * 8, 4: 4 * 4, 2: 8 * 2, 1: 4}
"""PipeTransformer's hard-coded micro-batch counts by K (2K at K=8, 4K at K=4, 8K at K=2, 4 at K=1)."""

ROWS: tuple[tuple[str, str, int], ...] = (
    ("no-freeze", "no freezing: static pipeline x D", 0),
    ("freeze-only", "freeze only: static split, K, D, M", 1),
    ("autopipe", "+ AutoPipe (re-split, any K <= S; D fixed)", 2),
    ("autopipe-autocache", "+ AutoPipe + AutoCache (D fixed)", 3),
    ("autopipe-autodp", "+ AutoPipe + AutoDP (cache off)", 3),
    ("full", "+ AutoPipe + AutoDP + AutoCache (full)", 5),
    ("greedy-split", "full, paper's greedy balancer for the split", 6),
    ("k-halving", "full, K halving only", 6),
    ("paper-m-table", "full, paper's hard-coded M table", 6),
)
"""(key, what changed, the row it builds on) for rows 1..9."""

GiB = float(1 << 30)


# ---- results ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RowPhase:
    """One visited frozen count's configuration in a row, with its simulated iterations."""

    frozen_blocks: int
    K: int
    D: int
    M: int
    micro_batch_size: int
    cache: bool
    partition: tuple[tuple[int, int], ...]
    """K layer ranges (row 2: the static phase-0 split over all layers, frozen ones included)."""
    iteration_s: float
    fill_iteration_s: float
    """Seconds of an iteration that fills the AutoCache (0 when the phase does not cache)."""
    peak_memory_bytes: int
    """The fullest stage's predicted peak."""
    fits: bool
    """Whether every stage fits in the GPU memory the plan may use."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A run of optimizer steps at one frozen count inside one epoch (the planner's trajectory point)."""

    epoch: int
    step: int
    frozen_blocks: int
    K: int
    D: int
    M: int
    cache: bool
    iterations: int
    fill_iterations: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class AblationRow:
    number: int
    """1..9, as in the module docstring."""
    key: str
    label: str
    """What changed."""
    versus: int
    """The row this one builds on (0 for row 1)."""
    seconds: float | None
    """Predicted training seconds; None when the row cannot be priced (``error`` says why)."""
    speedup: float | None
    """Row 1's seconds / this row's."""
    speedup_vs: float | None
    """Seconds of row ``versus`` / this row's."""
    paper_speedup: float | None
    """The paper's published bar for this row, where it has one."""
    phases: tuple[RowPhase, ...] = ()
    """The visited frozen counts, ascending."""
    trajectory: tuple[Segment, ...] = ()
    notes: tuple[str, ...] = ()
    error: str | None = None

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.phases)

    def summary(self) -> str:
        """The K x D trajectory, consecutive equal configurations merged: ``8x2 (e0) > 1x16+c (e1-9)``
        (+c: the AutoCache is on)."""
        runs: list[list[Any]] = []
        for s in self.trajectory:
            tok = f"{s.K}x{s.D}" + ("+c" if s.cache else "")
            if runs and runs[-1][0] == tok:
                runs[-1][2] = s.epoch
            else:
                runs.append([tok, s.epoch, s.epoch])
        return " > ".join(f"{t} (e{a}{'' if a == b else f'-{b}'})" for t, a, b in runs)


@dataclass(frozen=True, kw_only=True)
class Ablation:
    """Every row for one profile, cluster, training config and freeze policy."""

    model: str
    profile_source: str
    device: str
    cluster: str
    world_size: int
    start_K: int
    training: TrainingConfig
    """The training config the rows share (start_K filled in; each row sets its own cache mode)."""
    freeze: FreezePolicy
    freeze_steps: tuple[int, ...]
    rows: tuple[AblationRow, ...]
    best_static_seconds: float
    """The fastest static configuration without freezing (any K, M; the plan's ``best_static``), beside row 1."""
    best_static_K: int
    best_static_M: int
    warnings: tuple[str, ...] = ()
    baselines: tuple[BaselineRow, ...] = ()
    """Classic layouts without freezing (``baselines.py``: pure data parallel, pure FSDP, tensor parallel,
    pipeline only, the best uniform strategy), each with its time and memory, beside the rows."""

    def baseline_speedup(self, b: BaselineRow) -> float | None:
        """Row 1's seconds over the baseline's (as the rows' speedups)."""
        return self.baseline_seconds / b.seconds if b.seconds else None

    def row(self, key: str) -> AblationRow:
        for r in self.rows:
            if r.key == key:
                return r
        raise PtplanError(f"no ablation row {key!r}; rows: {', '.join(r.key for r in self.rows)}")

    @property
    def baseline_seconds(self) -> float:
        s = self.rows[0].seconds
        assert s is not None, "row 1 is always priced"
        return s

    def to_json(self) -> dict[str, Any]:
        d = json.loads(json.dumps(asdict(self)))
        for r, obj in zip(self.rows, d["rows"]):
            obj["summary"] = r.summary()
            obj["fits"] = r.fits
        for b, obj in zip(self.baselines, d["baselines"]):
            obj["fit"] = b.fit_text
            obj["speedup"] = self.baseline_speedup(b)
        return {"schema": "ptplan.ablation/1", **d}


# ---- row 2: frozen layers inside a static split ------------------------------------------------
def frozen_in_place_table(table: CostTable, n0: int) -> CostTable:
    """``table`` with the layers [0, n0) frozen where they are (the freeze-only row's per-layer costs, as
    ``strategy.strategy_table`` states a strategy's): a frozen layer's forward is its no-grad forward, and it has
    no backward (nor its weight-gradient part or working set), gradient, gradient sync, saved activations, optimizer step or
    trained weights (so no optimizer state, temporaries or second 2BW version: ``freeze_only_costs`` adds its
    weights back as plain bytes, as the stage model holds a frozen prefix's). Its output stays."""
    t = copy.copy(table)
    t._cache, t._derived = {}, {}
    frozen = np.arange(table.n) < n0
    t._fwd = np.where(frozen[:, None], table._nog, table._fwd)
    t._bwd = np.where(frozen[:, None], 0.0, table._bwd)
    t._bww = np.where(frozen[:, None], 0.0, table._bww)
    t.grad_bytes = np.where(frozen, 0.0, table.grad_bytes)
    t.saved_per_sample = np.where(frozen, 0.0, table.saved_per_sample)
    t.working_per_sample = np.where(frozen, 0.0, table.working_per_sample)
    t.accumulate_bytes = np.where(frozen, 0.0, table.accumulate_bytes)
    t.stash_per_sample = np.where(frozen, 0.0, table.stash_per_sample)
    t.cum_stash = _cum(t.stash_per_sample)
    t.set_optimizer(np.where(frozen, 0.0, table.optimizer_s), table.optimizer_call_s)
    t.param_bytes = np.where(frozen, 0.0, table.param_bytes)
    t.cum_param = _cum(t.param_bytes)
    t.cum_grad, t.cum_saved = _cum(t.grad_bytes), _cum(t.saved_per_sample)
    t.cum_sync = np.concatenate((np.zeros(n0), table.cum_sync[n0:] - table.cum_sync[n0]))  # no sync before n0
    return t


TableFn = Callable[[CostTable, int], CostTable]
"""A per-layer cost table with the layers [0, n0) frozen, from the profile's: ``frozen_in_place_table`` unless a
caller prices another way of running the frozen layers (``bench/pt_freeze_only.py``)."""


def freeze_only_model(search: PhaseSearch, cand: Candidate, n0: int, table: TableFn = frozen_in_place_table
                      ) -> StageModel:
    """The one stage model of the freeze-only phase: the static phase's (``search.model`` with nothing frozen),
    pricing the layers from ``table`` (``frozen_in_place_table``)."""
    base = search.uniform_model(cand, 0)
    return StageModel(base.raw, base.shape, base.links, shard_table=table(base.t, n0))


def freeze_only_costs(search: PhaseSearch, cand: Candidate, ranges: Sequence[tuple[int, int]], n0: int,
                      table: TableFn = frozen_in_place_table) -> list[StageCost]:
    """The simulator's stage costs of a static split (covering all layers) with layers [0, n0) frozen
    wherever they sit: ``freeze_only_model``'s ``stage_costs``, less what does not exist once they are frozen
    -- no gradient is sent back into a frozen layer (a stage whose input is a frozen layer's output sends none),
    a stage that trains nothing has no all-reduce and holds nothing for a backward -- plus the
    frozen weights a stage holds (one version, no optimizer state, as the stage model's ``stage0_static`` holds a
    frozen prefix's). ``table`` prices the layers (``freeze_only_model``)."""
    t = search.t
    if len(ranges) != cand.S or ranges[0][0] != 0 or ranges[-1][1] != t.n:
        raise PtplanError(f"{list(ranges)} is not a static split of all {t.n} layers into K*V={cand.S} stages")
    model = freeze_only_model(search, cand, n0, table)
    out = []
    for s, ((lo, hi), c) in enumerate(zip(ranges, model.stage_costs(ranges))):
        frozen_w = float(t.cum_param[min(hi, n0)] - t.cum_param[min(lo, n0)])
        c = replace(c, fixed_bytes=int(c.fixed_bytes + frozen_w))
        if lo <= n0:  # the input is a frozen layer's output (or the data): no gradient goes back
            c = replace(c, send_backward_s=0.0, send_backward_latency_s=0.0)
        if hi <= n0:  # trains nothing: no all-reduce, nothing held for a backward
            c = replace(c, allreduce_s=0.0, activation_bytes_per_mb=0)
        out.append(c)
    return out


# ---- restricted searches ----------------------------------------------------------------------
def start_K_for(cluster: Cluster, training: TrainingConfig) -> int:
    """The starting pipeline length: the config's start_K, else one pipeline per node (the paper's).
    It must keep pipelines node-aligned (divide the GPUs per node, or be a multiple of it) so that
    row 3's in-place compression is a sub-cluster."""
    G, W = cluster.gpus_per_node, cluster.world_size
    S = training.start_K if training.start_K is not None else G
    aligned = [k for k in divisors(W) if G % k == 0 or k % G == 0]
    if W % S or not (G % S == 0 or S % G == 0):
        raise PtplanError(f"start K={S} must divide the {W} GPUs of {cluster.name} and divide, or be a multiple "
                          f"of, its {G} GPUs per node (pipelines aligned with nodes); valid: "
                          f"{', '.join(map(str, aligned))}")
    return S


def fixed_width_cluster(cluster: Cluster, S: int, K: int) -> Cluster | None:
    """The GPUs that D0 = W / S pipelines compressed in place from S to K stages occupy, as a cluster
    (each pipeline keeps the first K of its GPUs), or None when that is not node-aligned."""
    G = cluster.gpus_per_node
    D0 = cluster.world_size // S
    if G % S == 0:  # S / G pipelines per node stay on their node
        nodes, per = cluster.nodes, G // S * K
    elif K <= G:  # a pipeline over S/G nodes shrinks onto its first node
        nodes, per = D0, K
    elif K % G == 0:
        nodes, per = D0 * K // G, G
    else:
        return None
    if nodes == cluster.nodes and per == G:
        return cluster
    return replace(cluster, name=f"{cluster.name}[{nodes}x{per} of {cluster.nodes}x{G}]", nodes=nodes,
                   gpus_per_node=per, nics_per_node=min(cluster.nics_per_node, per))


class _OneK(PhaseSearch):
    """The planner's search with one pipeline length only (over a sub-cluster of K·D0 GPUs)."""

    def __init__(self, profile: Profile, cluster: Cluster, cfg: TrainingConfig, K: int) -> None:
        super().__init__(profile, cluster, cfg)
        self.only_K = K

    def k_options(self, f: int, n_active: int, *, free: bool) -> tuple[list[int], list[str]]:
        if self.only_K > n_active:
            return [], [f"K={self.only_K} exceeds the {n_active} active layers"]
        return [self.only_K], []


class FixedWidthSearch(PhaseSearch):
    """Rows 3-4: AutoPipe without AutoDP. For each frozen count the best of the K allowed (K = S with
    nothing frozen; any K <= S dividing W after), each searched by the planner on the sub-cluster its
    D0 in-place pipelines occupy; D stays D0."""

    def __init__(self, profile: Profile, cluster: Cluster, cfg: TrainingConfig) -> None:
        super().__init__(profile, cluster, cfg)
        assert cfg.start_K is not None
        self.S = cfg.start_K
        sub_cfg = replace(cfg, start_K=None)
        self.parts: dict[int, PhaseSearch] = {}
        self.skipped: list[str] = []
        for K in divisors(self.W):
            if K > self.S:
                continue
            sub = fixed_width_cluster(cluster, self.S, K)
            if sub is None:
                self.skipped.append(f"K={K}: compressing {self.S}-stage pipelines in place to {K} GPUs is not "
                                    f"node-aligned")
                continue
            self.parts[K] = _OneK(profile, sub, sub_cfg, K)

    def links(self, K: int, schedule: str = "1f1b", V: int = 1, tp: int = 1) -> Links:
        return self.parts[K].links(K, schedule, V, tp)

    def stage0_per_node(self, K: int) -> int:
        return self.parts[K].stage0_per_node(K)

    def search(self, f: int, visit: Visit, *, free: bool = False, cache: bool | None = None) -> Choice:
        ks = [self.S] if f == 0 else sorted(self.parts)
        best: Choice | None = None
        errors: list[str] = []
        for K in ks:
            try:
                got = self.parts[K].search(f, visit, cache=cache)
            except InfeasibleError as e:
                errors.append(str(e))
                continue
            if best is None or (got.objective, got.cand.K, got.cand.M, got.cand.cache) < \
                    (best.objective, best.cand.K, best.cand.M, best.cand.cache):
                best = got
        if best is None:
            raise InfeasibleError(f"with D fixed at {self.W // self.S}: " + (errors[0] if errors else
                                                                            "no pipeline length"))
        return best


class HalvingSearch(PhaseSearch):
    """Row 8: the planner with K only from S, S/2, S/4, ... (the paper's rule)."""

    def k_options(self, f: int, n_active: int, *, free: bool) -> tuple[list[int], list[str]]:
        ks, notes = super().k_options(f, n_active, free=free)
        S = self.cfg.start_K or self.W
        halvings = set()
        while S >= 1:
            halvings.add(S)
            if S % 2:
                break
            S //= 2
        return [k for k in ks if k in halvings], notes


def paper_micro_batches(K: int) -> int:
    """The paper's hard-coded M for pipeline length K (``PAPER_M_TABLE``). For a K the table lacks,
    the same multiple of K as the table's nearest K (by log2, ties to the larger K): 2K above 8."""
    if K in PAPER_M_TABLE:
        return PAPER_M_TABLE[K]
    near = min(PAPER_M_TABLE, key=lambda k: (abs(math.log2(K) - math.log2(k)), -k))
    return max(1, round(PAPER_M_TABLE[near] / near * K))


class PaperMSearch(PhaseSearch):
    """Row 9: the planner with M from the paper's table; where the table's M is not a valid count for a
    K, the valid one nearest to it (by ratio, ties to the larger). If no K fits with those, M is free."""

    free_m = False

    def candidates(self, f: int, n0: int, *, free: bool = False, pin_k: bool = True, cache: bool | None = None
                   ) -> tuple[list[Candidate], list[str], list[str]]:
        out, reasons, notes = super().candidates(f, n0, free=free, pin_k=pin_k, cache=cache)
        if self.free_m:
            return out, reasons, notes
        keep: list[Candidate] = []
        for K in sorted({c.K for c in out}):
            want = paper_micro_batches(K)
            ms = sorted({c.M for c in out if c.K == K})
            M = min(ms, key=lambda m: (abs(math.log(m / want)), -m))
            keep += [c for c in out if c.K == K and c.M == M]
        return keep, reasons, notes

    def search(self, f: int, visit: Visit, *, free: bool = False, cache: bool | None = None) -> Choice:
        try:
            return super().search(f, visit, free=free, cache=cache)
        except InfeasibleError:
            self.free_m = True
            try:
                got = super().search(f, visit, free=free, cache=cache)
            finally:
                self.free_m = False
            return replace(got, notes=("no table M fits here; M chosen by simulation", *got.notes))


# ---- assembling rows --------------------------------------------------------------------------
def _assemble(search: PhaseSearch, table: list[int], training: TrainingConfig, freeze: FreezePolicy
              ) -> tuple[list[Phase], list[TrajectoryPoint]]:
    """The visited counts' phases and the walked trajectory, exactly as ``make_plan`` assembles them."""
    expected = visits(table, training, freeze, search.W)
    counts = sorted(expected)
    chosen = trajectory_phases(search, counts, expected)
    phases = [phase_from_choice(search, f, chosen[f], keep_timeline=False) for f in counts]
    return phases, walk(phases, {f: i for i, f in enumerate(counts)}, table, training, freeze)


def _row_phase(ph: Phase, limit: float, notes: Sequence[str] = ()) -> RowPhase:
    peak = ph.predicted.peak_memory_bytes
    return RowPhase(frozen_blocks=ph.frozen_blocks, K=ph.K, D=ph.D, M=ph.M, micro_batch_size=ph.micro_batch_size,
                    cache=ph.cache, partition=ph.partition, iteration_s=ph.predicted.iteration_s,
                    fill_iteration_s=ph.predicted.fill_iteration_s, peak_memory_bytes=peak,
                    fits=peak <= limit * (1 + 1e-9), notes=tuple(ph.notes) + tuple(notes))


def _segments(phases: Sequence[Phase], points: Sequence[TrajectoryPoint]) -> tuple[Segment, ...]:
    return tuple(Segment(epoch=p.epoch, step=p.step, frozen_blocks=p.frozen_blocks, K=phases[p.phase].K,
                         D=phases[p.phase].D, M=phases[p.phase].M, cache=phases[p.phase].cache,
                         iterations=p.iterations, fill_iterations=p.fill_iterations, seconds=p.seconds)
                 for p in points)


@dataclass(frozen=True)
class _Priced:
    """A row before its speedups: visited phases (as the planner's Phase, for ``walk``) and their rows."""

    phases: list[Phase]
    points: list[TrajectoryPoint]
    rows: list[RowPhase]
    notes: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        return float(sum(p.seconds for p in self.points))


def _from_search(search: PhaseSearch, table: list[int], training: TrainingConfig, freeze: FreezePolicy,
                 notes: Sequence[str] = ()) -> _Priced:
    phases, points = _assemble(search, table, training, freeze)
    return _Priced(phases, points, [_row_phase(ph, search.limit) for ph in phases], tuple(notes))


def _from_plan(plan: Plan, limit: float) -> _Priced:
    used = sorted({p.phase for p in plan.trajectory})
    phases = [plan.phases[i] for i in used]
    remap = {i: j for j, i in enumerate(used)}
    points = [replace(p, phase=remap[p.phase]) for p in plan.trajectory]
    return _Priced(phases, points, [_row_phase(ph, limit) for ph in phases])


def _repriced(ph: Phase, iteration_s: float, fill_s: float, **changes: Any) -> Phase:
    """A phase with new simulated iterations (what ``walk`` reads), for re-priced rows."""
    return replace(ph, predicted=replace(ph.predicted, iteration_s=iteration_s, fill_iteration_s=fill_s), **changes)


def _freeze_only(search: PhaseSearch, base: Phase, table: list[int], training: TrainingConfig,
                 freeze: FreezePolicy) -> _Priced:
    cand = Candidate(K=base.K, D=base.D, M=base.M, b=base.micro_batch_size, cache=False, schedule=base.schedule,
                     V=base.V)
    sched = build_schedule(base.schedule, base.K, base.M, base.V)
    counts = sorted(visits(table, training, freeze, search.W))
    phases, rows = [], []
    for f in counts:
        n0 = search.p.frozen_boundary(f)
        sim = simulate(sched, freeze_only_costs(search, cand, base.partition, n0),
                       step_overhead_s=search.c.step_overhead_s)
        ph = _repriced(base, sim.iteration_s, 0.0, frozen_blocks=f, frozen_layers=n0, notes=())
        phases.append(ph)
        peak = max(sim.rank_peak_memory_bytes or sim.stage_peak_memory_bytes)
        rows.append(RowPhase(frozen_blocks=f, K=base.K, D=base.D, M=base.M, micro_batch_size=base.micro_batch_size,
                             cache=False, partition=base.partition, iteration_s=sim.iteration_s, fill_iteration_s=0.0,
                             peak_memory_bytes=peak, fits=peak <= search.limit * (1 + 1e-9)))
    points = walk(phases, {f: i for i, f in enumerate(counts)}, table, training, freeze)
    return _Priced(phases, points, rows)


def fill_sources(phases: Sequence[Phase]) -> list[int]:
    """For phases in trajectory order: the frozen layers whose outputs are cached when each starts (the
    last earlier cached phase's prefix, 0 if none), which its fill refreshes from (the planner's rule)."""
    out, last = [], 0
    for ph in phases:
        out.append(last if ph.cache else 0)
        if ph.cache:
            last = ph.frozen_layers
    return out


def reprice(search: PhaseSearch, ph: Phase, ranges: Sequence[tuple[int, int]], fill_from: int
            ) -> tuple[float, float, int]:
    """(iteration seconds, fill iteration seconds or 0, fullest device's peak bytes: all its chunks together, as
    ``Prediction.peak_memory_bytes``) of a phase's K, D, M and cache with another split, through the one stage model
    and the simulator."""
    cand = Candidate(K=ph.K, D=ph.D, M=ph.M, b=ph.micro_batch_size, cache=ph.cache, schedule=ph.schedule, V=ph.V)
    model = search.model(cand, ph.frozen_layers, fill_from)
    sched = build_schedule(ph.schedule, ph.K, ph.M, ph.V)
    sim = simulate(sched, model.stage_costs(ranges), step_overhead_s=search.c.step_overhead_s)
    fill = 0.0
    if ph.cache:
        fill = simulate(sched, model.stage_costs(ranges, fill=True), step_overhead_s=search.c.step_overhead_s
                        ).iteration_s
    return sim.iteration_s, fill, int(max(sim.rank_peak_memory_bytes))


def _greedy(search: PhaseSearch, full: _Priced, table: list[int], training: TrainingConfig,
            freeze: FreezePolicy) -> _Priced:
    phases, rows = [], []
    for ph, fill_from in zip(full.phases, fill_sources(full.phases)):
        n0 = ph.frozen_layers
        notes: list[str] = []
        try:
            g = greedy_param_partition(search.t.params[n0:].tolist(), ph.K * ph.V)  # every stage (chunk)
            ranges = tuple((lo + n0, hi + n0) for lo, hi in g.ranges)
        except InfeasibleError as e:
            ranges = ph.partition
            notes.append(f"{e}; priced with the optimal split")
        it, fill, peak = reprice(search, ph, ranges, fill_from)
        fits = peak <= search.limit * (1 + 1e-9)
        if not fits:
            notes.append(f"the greedy split does not fit: a stage needs {peak / GiB:.2f} GiB, a GPU may use "
                         f"{search.limit / GiB:.2f} GiB")
        phases.append(_repriced(ph, it, fill, partition=ranges))
        rows.append(RowPhase(frozen_blocks=ph.frozen_blocks, K=ph.K, D=ph.D, M=ph.M,
                             micro_batch_size=ph.micro_batch_size, cache=ph.cache, partition=ranges, iteration_s=it,
                             fill_iteration_s=fill, peak_memory_bytes=peak, fits=fits, notes=tuple(notes)))
    counts = [ph.frozen_blocks for ph in phases]
    points = walk(phases, {f: i for i, f in enumerate(counts)}, table, training, freeze)
    return _Priced(phases, points, rows)


def _paper_m_notes(search: PhaseSearch, priced: _Priced) -> _Priced:
    """Row 9's phases whose M is not the table's say why."""
    rows = []
    lo, hi = search.t.measured_range
    for r in priced.rows:
        want = paper_micro_batches(r.K)
        if r.M != want and not any("chosen by simulation" in n for n in r.notes):
            bp = r.M * r.micro_batch_size
            if bp % want:
                why = f"does not split the {bp} samples per pipeline"
            elif search.cfg.schedule in ("1f1b", "zb-h1") and want < r.K:
                why = f"is below K={r.K} (1F1B needs M >= K)"
            elif not search.cfg.allow_extrapolation and not lo <= bp // want <= hi:
                why = f"gives micro-batches of {bp // want} samples, outside the profile's measured {lo}..{hi}"
            else:
                why = "does not fit in memory"
            r = replace(r, notes=(*r.notes, f"the paper's M={want} for K={r.K} {why}; nearest valid M={r.M}"))
        rows.append(r)
    return replace(priced, rows=rows)


def _prefix_note(search: PhaseSearch, autopipe: _Priced, freeze_only: _Priced) -> str:
    """Why AutoPipe without AutoDP or AutoCache can be slower than freeze only, with the numbers of the
    frozen count where it loses most."""
    only = {r.frozen_blocks: r for r in freeze_only.rows}
    r = max(autopipe.rows, key=lambda x: x.iteration_s - only[x.frozen_blocks].iteration_s)
    n0 = search.p.frozen_boundary(r.frozen_blocks)
    stage0 = search.uniform_model(Candidate(K=r.K, D=r.D, M=r.M, b=r.micro_batch_size, cache=False), n0)
    prefix = r.M * stage0.prefix_s  # the stage model's recomputed prefix, per micro-batch
    return (f"slower than freeze only: AutoPipe keeps the frozen prefix on stage 0 (the one stage model's layout), "
            f"which recomputes it for every micro-batch; at {r.frozen_blocks} frozen blocks (K={r.K}, M={r.M}) stage 0 "
            f"spends {prefix:.1f} s of the {r.iteration_s:.1f} s iteration on it, against a "
            f"{only[r.frozen_blocks].iteration_s:.1f} s iteration with freeze only, whose static stages keep the "
            f"frozen layers spread out. The AutoCache (row 4) removes the recompute")


# ---- the ablation -----------------------------------------------------------------------------
def ablate(profile: Profile, cluster: Cluster, training: TrainingConfig, freeze: FreezePolicy) -> Ablation:
    """Every row of the ablation (module docstring) for this profile, cluster, training and freeze policy.
    ``training``'s cache mode is ignored (each row sets its own); pinned K or M are refused."""
    if training.pin_K is not None or training.pin_M is not None:
        raise PtplanError(f"the ablation searches K and M itself; drop the pinned "
                          f"{'K' if training.pin_K is not None else 'M'} (keep --start-K to set the starting K)")
    S = start_K_for(cluster, training)
    cfg = replace(training, start_K=S, pin_K=None, pin_M=None, cache="auto")
    cfg_off = replace(cfg, cache="off")
    full_plan = make_plan(profile, cluster, cfg, freeze)
    dp_plan = make_plan(profile, cluster, cfg_off, freeze)
    table = list(full_plan.freeze_steps)
    search = PhaseSearch(profile, cluster, cfg)
    limit = search.limit

    base = full_plan.baseline.phase
    base_points = walk([base], {0: 0}, [0], cfg, FreezePolicy(policy="none", every=freeze.every))
    priced: dict[str, _Priced | str] = {
        "no-freeze": _Priced([base], base_points, [_row_phase(base, limit)]),
        "freeze-only": _freeze_only(search, base, table, cfg, freeze),
        "autopipe-autodp": _from_plan(dp_plan, limit),
        "full": _from_plan(full_plan, limit),
    }
    full = priced["full"]
    assert isinstance(full, _Priced)
    for key, make in (
            ("autopipe", lambda: _fixed_width(profile, cluster, cfg_off, table, freeze)),
            ("autopipe-autocache", lambda: _fixed_width(profile, cluster, cfg, table, freeze)),
            ("greedy-split", lambda: _greedy(search, full, table, cfg, freeze)),
            ("k-halving", lambda: _from_search(HalvingSearch(profile, cluster, cfg), table, cfg, freeze)),
            ("paper-m-table", lambda: _paper_m_notes(search, _from_search(PaperMSearch(profile, cluster, cfg), table,
                                                                          cfg, freeze)))):
        try:
            priced[key] = make()
        except PtplanError as e:  # this row's restriction fits nowhere, or its batch does not fit an epoch
            priced[key] = str(e)

    p2, p3 = priced["freeze-only"], priced["autopipe"]
    if isinstance(p2, _Priced) and isinstance(p3, _Priced) and p3.seconds > p2.seconds:
        priced["autopipe"] = replace(p3, notes=(*p3.notes, _prefix_note(search, p3, p2)))
    base_s = full_plan.baseline.seconds
    rows: list[AblationRow] = []
    secs: dict[int, float | None] = {}
    for i, (key, label, versus) in enumerate(ROWS, start=1):
        got = priced[key]
        paper = PAPER_SPEEDUPS.get(key)
        if isinstance(got, str):
            secs[i] = None
            rows.append(AblationRow(number=i, key=key, label=label, versus=versus, seconds=None, speedup=None,
                                    speedup_vs=None, paper_speedup=paper, error=got))
            continue
        s = base_s if key == "no-freeze" else got.seconds
        secs[i] = s
        ref = secs.get(versus)
        rows.append(AblationRow(
            number=i, key=key, label=label, versus=versus, seconds=s, speedup=base_s / s if s > 0 else None,
            speedup_vs=(ref / s if ref is not None and s > 0 else None) if versus else None, paper_speedup=paper,
            phases=tuple(got.rows), trajectory=_segments(got.phases, got.points), notes=got.notes))
    return Ablation(model=profile.model.name, profile_source=profile.provenance.source, device=profile.device.name,
                    cluster=cluster.name, world_size=cluster.world_size, start_K=S, training=cfg, freeze=freeze,
                    freeze_steps=tuple(table), rows=tuple(rows),
                    best_static_seconds=full_plan.totals.best_static_seconds,
                    best_static_K=full_plan.totals.best_static_K, best_static_M=full_plan.totals.best_static_M,
                    warnings=tuple(w.message for w in full_plan.warnings),
                    baselines=baselines(profile, cluster, cfg, freeze))


def _fixed_width(profile: Profile, cluster: Cluster, cfg: TrainingConfig, table: list[int], freeze: FreezePolicy
                 ) -> _Priced:
    search = FixedWidthSearch(profile, cluster, cfg)
    return _from_search(search, table, cfg, freeze, notes=search.skipped)
