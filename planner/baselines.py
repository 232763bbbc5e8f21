"""Baselines side by side: the model trained without freezing under one classic parallel layout each.

Legend: W GPUs, K pipeline length, D data-parallel width, tp tensor-parallel width (K·D·tp = W), M
micro-batches per pipeline (gradient accumulation where K = 1), b micro-batch size.

Every row is the planner's own search (``search.PhaseSearch``: the one stage model and the simulator) with
nothing frozen, restricted to one layout, M chosen by simulation; its training time is its iteration over the
same epochs (``planner.walk`` without freezing, as the ablation's row 1). The rows:

- ``data-parallel``: K = 1, D = W, every GPU a full replica (gradients all-reduced after the step).
- ``fsdp``: K = 1, D = W, weights, gradients and optimizer state sharded over the D replicas (FSDP2).
- ``tensor-parallel``: Megatron-style model parallelism: K = 1, tp = the widest width inside a node that
  divides the model's heads and MLP (``tp_split``), D = W / tp across nodes.
- ``pipeline-only``: K = W, D = 1 (where the model has at least W layers; else the longest pipeline that
  divides W and fits the layers, D = W / K, and the row says so).
- ``best-uniform``: the best of every uniform strategy the planner knows (any K, tp, FSDP on or off,
  recomputation on or off, the same on every stage) that fits in memory.

The first four are priced whatever their memory (the search's limit lifted) and then held against the GPU
memory the plan may use: a row that needs more says "does not fit" with its peak, so that a comparison that
the papers state (e.g. PipeDream-2BW's "over Megatron-style model parallelism") can be stated here too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .cluster import Cluster
from .config import TrainingConfig
from .errors import PtplanError
from .freeze import FreezePolicy
from .planner import phase_from_choice, walk
from .profile import Profile
from .search import PhaseSearch, Visit
from .strategy import Mode, search_strategies

GiB = float(1 << 30)
UNLIMITED = 1e30
"""The memory limit of a row priced whatever its memory (bytes; finite for the partitioner)."""

ROWS: tuple[tuple[str, str], ...] = (
    ("data-parallel", "pure data parallel (K=1, D=W)"),
    ("fsdp", "pure FSDP (K=1, D=W, sharded)"),
    ("tensor-parallel", "tensor parallel in a node x DP (Megatron-style)"),
    ("pipeline-only", "pipeline only (K=W, D=1)"),
    ("best-uniform", "best uniform strategy (any K, tp, sp, FSDP, recompute)"),
)


@dataclass(frozen=True, kw_only=True)
class BaselineRow:
    """One layout, nothing frozen: its configuration, predicted time and memory."""

    key: str
    label: str
    K: int = 0
    D: int = 0
    tp: int = 1
    sp: bool = False
    """Sequence parallelism with tp > 1 (only the best-uniform row may take it)."""
    fsdp: bool = False
    recompute: bool = False
    M: int = 0
    micro_batch_size: int = 0
    schedule: str = ""
    iteration_s: float | None = None
    """Simulated seconds per iteration (None when the layout cannot be planned: ``error``)."""
    seconds: float | None = None
    """Predicted training seconds over the run's epochs, without freezing."""
    peak_memory_bytes: int = 0
    """The fullest GPU's predicted peak."""
    limit_bytes: int = 0
    """What one GPU may use (its memory x the memory fraction)."""
    fits: bool = False
    note: str = ""
    error: str | None = None

    @property
    def fit_text(self) -> str:
        """"fits" or "does not fit: needs X GiB of Y" (or the error)."""
        if self.error is not None:
            return "not possible"
        if self.fits:
            return "fits"
        return f"does not fit: needs {self.peak_memory_bytes / GiB:,.2f} of {self.limit_bytes / GiB:,.2f} GiB"


class _Layout(PhaseSearch):
    """The planner's search restricted to one pipeline length and a set of (tp, FSDP, recompute, sp) modes."""

    def __init__(self, profile: Profile, cluster: Cluster, cfg: TrainingConfig, *, K: int | None,
                 modes: tuple[Mode, ...] | None, unlimited: bool) -> None:
        super().__init__(profile, cluster, cfg, strategies="auto" if modes is None or modes != ((1, 0, 0, False),)
                         else "off")
        self.real_limit = self.limit
        if unlimited:
            self.limit = UNLIMITED
        self.only_K = K
        if modes is None:  # every uniform strategy: no per-stage choices
            self.modes = tuple(m for m in self.modes if 2 not in m[1:3])
        else:
            self.modes = modes
        self.strategies = search_strategies(self.modes)

    def k_options(self, f: int, n_active: int, *, free: bool) -> tuple[list[int], list[str]]:
        if self.only_K is None:
            return super().k_options(f, n_active, free=True)
        return [self.only_K], []


def tp_widths(profile: Profile, cluster: Cluster, cfg: TrainingConfig) -> list[int]:
    """Tensor-parallel widths the planner allows for this model inside one node (1 always)."""
    return sorted({st.tp for st in PhaseSearch(profile, cluster, cfg, strategies="auto").strategies})


def _price(key: str, label: str, search: _Layout, cfg: TrainingConfig, freeze: FreezePolicy, note: str = ""
           ) -> BaselineRow:
    try:
        ch = search.search(0, Visit(samples=float(cfg.samples_per_epoch)), free=True)
    except PtplanError as e:
        return BaselineRow(key=key, label=label, limit_bytes=int(search.real_limit), note=note, error=str(e))
    ph = phase_from_choice(search, 0, ch, keep_timeline=False)
    points = walk([ph], {0: 0}, [0], cfg, FreezePolicy(policy="none", every=freeze.every))
    peak = int(max(ph.predicted.rank_peak_memory_bytes or ph.predicted.stage_peak_memory_bytes))
    c = ch.cand
    return BaselineRow(key=key, label=label, K=c.K, D=c.D, tp=c.tp, sp=c.sp, fsdp=c.fsdp, recompute=c.recompute, M=c.M,
                       micro_batch_size=c.b, schedule=c.schedule, iteration_s=ch.sim.iteration_s,
                       seconds=float(sum(p.seconds for p in points)), peak_memory_bytes=peak,
                       limit_bytes=int(search.real_limit), fits=peak <= search.real_limit * (1 + 1e-9), note=note)


def baselines(profile: Profile, cluster: Cluster, training: TrainingConfig, freeze: FreezePolicy
              ) -> tuple[BaselineRow, ...]:
    """Every row of the module docstring for this profile, cluster and training (the schedule as configured;
    nothing frozen; ``freeze`` only for its ``every``, which sets how steps are counted)."""
    cfg = replace(training, start_K=None, pin_K=None, pin_M=None, cache="off")
    W, n = cluster.world_size, profile.num_layers
    labels = dict(ROWS)
    rows = [_price("data-parallel", labels["data-parallel"],
                   _Layout(profile, cluster, cfg, K=1, modes=((1, 0, 0, False),), unlimited=True), cfg, freeze)]
    if W > 1:
        rows.append(_price("fsdp", labels["fsdp"], _Layout(profile, cluster, cfg, K=1, modes=((1, 1, 0, False),),
                                                          unlimited=True), cfg, freeze))
    else:
        rows.append(BaselineRow(key="fsdp", label=labels["fsdp"], error="one GPU: nothing to shard over"))
    tp = max(tp_widths(profile, cluster, cfg))
    if tp > 1:
        rows.append(_price("tensor-parallel", labels["tensor-parallel"],
                           _Layout(profile, cluster, cfg, K=1, modes=((tp, 0, 0, False),), unlimited=True), cfg, freeze,
                           note=f"tp={tp} inside each node, D={W // tp} across"))
    else:
        rows.append(BaselineRow(key="tensor-parallel", label=labels["tensor-parallel"],
                                error=f"no tensor-parallel width > 1 divides {cluster.gpus_per_node} GPUs per node "
                                      f"and the model's heads and MLP"))
    K = max(k for k in range(1, min(W, n) + 1) if W % k == 0)
    rows.append(_price("pipeline-only", labels["pipeline-only"],
                       _Layout(profile, cluster, cfg, K=K, modes=((1, 0, 0, False),), unlimited=True), cfg, freeze,
                       note="" if K == W else f"K={W} exceeds the {n} layers: K={K}, D={W // K}"))
    rows.append(_price("best-uniform", labels["best-uniform"],
                       _Layout(profile, cluster, cfg, K=None, modes=None, unlimited=False), cfg, freeze))
    return tuple(rows)


def speedup(row: BaselineRow, seconds: float) -> float | None:
    """``seconds`` (e.g. the elastic plan's) over the row's: how much faster that is than this baseline."""
    if row.seconds is None or not seconds > 0 or not math.isfinite(row.seconds):
        return None
    return row.seconds / seconds
