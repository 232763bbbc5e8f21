"""The search's records: a candidate (K, D, M, b, cache, schedule, strategy), how long its phase runs
(``Visit``), and a candidate split and simulated (``Choice``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .plan import MemoryBreakdown
from .simulate import SimResult, StageCost
from .stage import Links
from .strategy import Strategy, phase_label


@dataclass(frozen=True, kw_only=True)
class Visit:
    """How long a phase is expected to run, for weighing the AutoCache's fill against its savings."""

    samples: float
    """Samples the phase processes over the run (on the trajectory), or one epoch's (off it)."""
    fill_from: int = 0
    """Flat layers whose outputs are already cached when the phase starts (its fill runs only the
    layers [fill_from, n0)); 0 = from the inputs."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    K: int
    D: int
    M: int
    b: int
    cache: bool
    schedule: str = "1f1b"
    V: int = 1
    """Stages (chunks) per pipeline position: K·V stages in all."""
    tp: int = 1
    """Tensor-parallel width of every stage (``strategy.py``): K·D·tp GPUs."""
    sp: bool = False
    """Sequence parallelism on every stage, with tp > 1 (``strategy.Strategy.sp``; ``strategy.search_modes``)."""
    fsdp: bool = False
    """FSDP on every stage (with ``fsdp_per_stage``: False)."""
    recompute: bool = False
    """Recomputation on every stage (with ``recompute_per_stage``: False)."""
    fsdp_per_stage: bool = False
    """Each stage chooses FSDP on or off (``stage.StageChoice``; the assignment by the simulated iteration)."""
    recompute_per_stage: bool = False
    """Each stage chooses recomputation on or off, likewise, and how many of its first layers to recompute
    (``PhaseSearch.model``)."""
    recompute_layers: int = 0
    """With ``recompute``: only the first r layers of each stage (0 = all); set for ``StageChoice``'s models."""

    @property
    def strategy(self) -> Strategy:
        """The strategy of every stage (per-stage choices: off here, see ``options``)."""
        return Strategy(tp=self.tp, fsdp=self.fsdp, recompute=self.recompute, recompute_layers=self.recompute_layers,
                        sp=self.sp)

    @property
    def per_stage(self) -> bool:
        return self.fsdp_per_stage or self.recompute_per_stage

    @property
    def options(self) -> tuple[Strategy, ...]:
        """The strategies a stage may take, simplest first (no FSDP, no recomputation)."""
        return tuple(Strategy(tp=self.tp, fsdp=f, recompute=r, sp=self.sp)
                     for f in ((False, True) if self.fsdp_per_stage else (self.fsdp,))
                     for r in ((False, True) if self.recompute_per_stage else (self.recompute,)))

    @property
    def mode(self) -> tuple[int, int]:
        """(FSDP, recomputation), each 0 off, 1 on every stage, 2 chosen per stage (for tie-breaking)."""
        return (2 if self.fsdp_per_stage else int(self.fsdp), 2 if self.recompute_per_stage else int(self.recompute))

    @property
    def B(self) -> int:
        return self.D * self.M * self.b

    @property
    def tag(self) -> str:
        """How a reason names the candidate: ``K=2, M=8``, then what else sets it apart where it is not the
        default (the schedule's chunks ``V=2``, the strategy ``tp4·sp·fsdp``, per-stage choices, the cache)."""
        extra = ([f"V={self.V}"] if self.V > 1 else []) + \
            ([self.strategy.label] if self.strategy.label != "dp" else []) + \
            (["FSDP per stage"] if self.fsdp_per_stage else []) + \
            (["recomputation per stage"] if self.recompute_per_stage else []) + (["cache on"] if self.cache else [])
        return ", ".join([f"K={self.K}", f"M={self.M}", *extra])

    @property
    def S(self) -> int:
        return self.K * self.V


@dataclass(frozen=True, kw_only=True)
class Choice:
    """A candidate split, simulated: what a phase of the plan is made of."""

    cand: Candidate
    ranges: tuple[tuple[int, int], ...]
    costs: tuple[StageCost, ...]
    sim: SimResult
    fill_costs: tuple[StageCost, ...] = ()
    fill_sim: SimResult | None = None
    memory: tuple[MemoryBreakdown, ...] = ()
    strategies: tuple[Strategy, ...] = ()
    """Per stage (K·V entries), the strategy it runs (the candidate's one, or each stage's choice)."""
    objective: float = math.inf
    """Seconds per sample over the phase (fill iterations included)."""

    @property
    def label(self) -> str:
        """The strategy as text (``strategy.phase_label``: per stage where the stages differ)."""
        sts = self.strategies or (self.cand.strategy,) * self.cand.S
        return phase_label(self.cand.tp, [st.fsdp for st in sts], [st.recompute for st in sts],
                           [st.recompute_layers for st in sts], sp=self.cand.sp)
    notes: tuple[str, ...] = ()
    links: Links | None = field(default=None, repr=False)


def seconds_per_sample(c: Candidate, steady: Any, fill: Any, visit: Visit, N: int) -> Any:
    """Expected seconds per sample of the phase: one fill pass over the data, then steady iterations (``steady`` and
    ``fill``: seconds, or numpy arrays of them, one per split: elementwise)."""
    if not c.cache:
        return steady / c.B
    fill_samples = min(visit.samples, float(N // c.B * c.B))
    return (fill * fill_samples + steady * max(visit.samples - fill_samples, 0.0)) / (max(visit.samples, 1.0) * c.B)
