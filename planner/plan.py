"""The plan contract (``ptplan.plan/1``): one phase per frozen-block count, trajectory, totals, baseline.

Legend: L blocks; f frozen blocks; K pipeline length (stages per pipeline); D data-parallel width
(pipelines); M micro-batches per pipeline per iteration; b micro-batch size (samples);
global batch B = D * M * b. Layer ranges are half-open ``[lo, hi)`` indices into the profile's
flat layer list; a phase's stages cover ``[frozen_layers, num_layers)`` and stage 0 also runs the
frozen prefix ``[0, frozen_layers)`` under no_grad (or reads it from the cache).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import PtplanError, SchemaError
from .jsonio import Fields, read_json, write_json

SCHEMA = "ptplan.plan/1"
SCHEDULES = ("gpipe", "1f1b")
BATCH_POLICIES = ("constant-global", "constant-pipeline")
EVENT_KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE", "PREFIX", "CACHE")


@dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """One simulated interval on one rank of pipeline 0 (the other pipelines are identical)."""

    rank: int
    """Position in the pipeline (0..K-1), i.e. the stage-holding rank of pipeline 0."""
    stage: int
    kind: str
    """One of EVENT_KINDS (PREFIX = frozen-prefix no-grad forward; CACHE = reading cached prefix outputs)."""
    mb: int
    """Micro-batch index, -1 where it does not apply (ALLREDUCE)."""
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class Prediction:
    iteration_s: float
    """Seconds per training iteration (one global batch), including the data-parallel all-reduce."""
    samples_per_s: float
    bubble_fraction: float
    """Share of the pipeline's rank-time spent idle during the iteration (before the all-reduce)."""
    allreduce_s: float
    """Exposed (non-overlapped) all-reduce seconds at the end of the iteration."""
    stage_compute_s: tuple[float, ...]
    """Per stage: forward+backward seconds of all its micro-batches (prefix included on stage 0)."""
    stage_peak_memory_bytes: tuple[int, ...]
    """Per stage: predicted peak device memory (weights, grads, optimizer, activations in flight)."""
    cache_host_bytes: int = 0
    """Host memory the AutoCache needs for this phase (0 when the cache is off)."""


@dataclass(frozen=True, kw_only=True)
class Phase:
    frozen_blocks: int
    """f, the number of frozen Transformer blocks in this phase."""
    frozen_layers: int
    """Number of flat layers in the frozen prefix (= profile.frozen_boundary(f))."""
    K: int
    D: int
    M: int
    micro_batch_size: int
    schedule: str
    partition: tuple[tuple[int, int], ...]
    """K half-open layer ranges, contiguous, covering [frozen_layers, num_layers)."""
    cache: bool
    """Whether stage 0 reads the frozen prefix's outputs from the AutoCache."""
    ranks: tuple[tuple[int, ...], ...]
    """ranks[p][s] = global rank holding stage s of pipeline p (D rows of K)."""
    predicted: Prediction
    timeline: tuple[TimelineEvent, ...] = ()

    @property
    def pipeline_batch(self) -> int:
        return self.M * self.micro_batch_size

    @property
    def global_batch(self) -> int:
        return self.D * self.M * self.micro_batch_size

    def dp_groups(self) -> list[list[int]]:
        """For each stage s, the ranks holding it across pipelines (the data-parallel group)."""
        return [[self.ranks[p][s] for p in range(self.D)] for s in range(self.K)]


@dataclass(frozen=True, kw_only=True)
class TrajectoryPoint:
    epoch: int
    frozen_blocks: int
    phase: int
    """Index into Plan.phases."""
    iterations: int
    seconds: float
    """Predicted seconds for this epoch (iterations * phase iteration_s + transition)."""


@dataclass(frozen=True, kw_only=True)
class Baseline:
    """No freezing: a static pipeline + data parallel, with its own best K and M."""

    phase: Phase
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    inputs: dict[str, Any]
    """profile (identity), cluster (as dict), training (epochs, samples_per_epoch, global_batch,
    batch_policy, schedule, optimizer), freeze (policy, alpha, ...)."""
    phases: tuple[Phase, ...]
    trajectory: tuple[TrajectoryPoint, ...]
    totals: dict[str, float]
    """seconds, samples, and speedup (baseline seconds / seconds)."""
    baseline: Baseline
    schema: str = SCHEMA

    @property
    def world_size(self) -> int:
        return self.phases[0].K * self.phases[0].D

    def phase_for(self, frozen_blocks: int) -> Phase:
        """The phase for a frozen-block count (every count that can occur has one)."""
        for ph in self.phases:
            if ph.frozen_blocks == frozen_blocks:
                return ph
        have = [p.frozen_blocks for p in self.phases]
        raise PtplanError(f"the plan has no phase for {frozen_blocks} frozen blocks (it has {have}); "
                          f"re-run `ptplan plan` with a freeze policy that can reach it")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (lists, not tuples), ready for json.dumps or the validator."""
        d = json.loads(json.dumps(asdict(self)))
        return {"schema": d.pop("schema"), **d}


# ---- validation ---------------------------------------------------------------------------
def _prediction(f: Fields) -> Prediction:
    Fields(f.obj, f.what, f.path, allowed=Prediction.__dataclass_fields__)
    return Prediction(
        iteration_s=f.float("iteration_s", min=0), samples_per_s=f.float("samples_per_s", min=0),
        bubble_fraction=f.float("bubble_fraction", min=0, max=1), allreduce_s=f.float("allreduce_s", min=0),
        stage_compute_s=tuple(f.floats("stage_compute_s")),
        stage_peak_memory_bytes=tuple(f.ints("stage_peak_memory_bytes", min=0)),
        cache_host_bytes=f.int("cache_host_bytes", 0, min=0))


def _phase(f: Fields, num_layers: int | None) -> Phase:
    Fields(f.obj, f.what, f.path, allowed=Phase.__dataclass_fields__)
    K, D, M = f.int("K", min=1), f.int("D", min=1), f.int("M", min=1)
    frozen_layers = f.int("frozen_layers", min=0)
    parts = []
    for i, r in enumerate(f.list("partition", length=K)):
        if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                or r[0] >= r[1]):
            raise SchemaError(f.what, f"{f.path}.partition[{i}]", f"expected [lo, hi) with lo < hi, got {r!r}")
        parts.append((r[0], r[1]))
    if parts[0][0] != frozen_layers:
        raise SchemaError(f.what, f"{f.path}.partition[0]", f"starts at layer {parts[0][0]} but frozen_layers is "
                          f"{frozen_layers}", "Re-run `ptplan plan`")
    for i in range(1, K):
        if parts[i][0] != parts[i - 1][1]:
            raise SchemaError(f.what, f"{f.path}.partition[{i}]", f"starts at {parts[i][0]} but the previous stage "
                              f"ends at {parts[i - 1][1]} (stages must be contiguous)")
    if num_layers is not None and parts[-1][1] != num_layers:
        raise SchemaError(f.what, f"{f.path}.partition", f"covers layers up to {parts[-1][1]} but the model has "
                          f"{num_layers}", "Run `ptplan plan` again for this profile")
    ranks = f.list("ranks", length=D)
    seen: set[int] = set()
    for p, row in enumerate(ranks):
        if not isinstance(row, list) or len(row) != K or not all(isinstance(x, int) for x in row):
            raise SchemaError(f.what, f"{f.path}.ranks[{p}]", f"expected {K} integer ranks, got {row!r}")
        seen.update(row)
    if seen != set(range(K * D)):
        raise SchemaError(f.what, f"{f.path}.ranks", f"must use each rank 0..{K * D - 1} exactly once")
    tl = []
    for i, e in enumerate(f.objs("timeline") if "timeline" in f.obj else []):
        Fields(e.obj, e.what, e.path, allowed=TimelineEvent.__dataclass_fields__)
        tl.append(TimelineEvent(rank=e.int("rank", min=0), stage=e.int("stage", min=0),
                                kind=e.str("kind", choices=EVENT_KINDS), mb=e.int("mb", min=-1),
                                start=e.float("start", min=0), end=e.float("end", min=0)))
    pred = _prediction(f.obj_("predicted"))
    if len(pred.stage_peak_memory_bytes) != K:
        raise SchemaError(f.what, f"{f.path}.predicted.stage_peak_memory_bytes", f"has {len(pred.stage_peak_memory_bytes)} "
                          f"entries for K={K} stages")
    return Phase(frozen_blocks=f.int("frozen_blocks", min=0), frozen_layers=frozen_layers, K=K, D=D, M=M,
                 micro_batch_size=f.int("micro_batch_size", min=1), schedule=f.str("schedule", choices=SCHEDULES),
                 partition=tuple(parts), cache=f.bool("cache"),
                 ranks=tuple(tuple(r) for r in ranks), predicted=pred, timeline=tuple(tl))


def plan_from_json(obj: Any, source: str = "plan") -> Plan:
    """Validate a decoded JSON object and build a Plan; errors name the bad field."""
    top = Fields(obj, source, allowed=("schema", "inputs", "phases", "trajectory", "totals", "baseline"))
    schema = top.str("schema")
    if schema != SCHEMA:
        raise SchemaError(source, "schema", f"is {schema!r}, expected {SCHEMA!r}", "Re-create it with `ptplan plan`")
    inputs = top.obj_("inputs")
    prof = inputs.obj_("profile")
    num_layers = prof.int("num_layers", min=1)
    num_blocks = prof.int("num_blocks", min=1)
    training = inputs.obj_("training")
    training.str("batch_policy", choices=BATCH_POLICIES)
    phases = [_phase(p, num_layers) for p in top.objs("phases")]
    if not phases:
        raise SchemaError(source, "phases", "is empty: the plan has no phase", "Re-run `ptplan plan`")
    world = phases[0].K * phases[0].D
    for i, ph in enumerate(phases):
        if ph.K * ph.D != world:
            raise SchemaError(source, f"phases[{i}]", f"uses K*D = {ph.K}*{ph.D} = {ph.K * ph.D} GPUs but phase 0 "
                              f"uses {world}")
        if ph.frozen_blocks > num_blocks:
            raise SchemaError(source, f"phases[{i}].frozen_blocks", f"{ph.frozen_blocks} exceeds the model's "
                              f"{num_blocks} blocks")
    counts = [p.frozen_blocks for p in phases]
    if len(set(counts)) != len(counts):
        raise SchemaError(source, "phases", f"frozen_blocks values repeat: {counts}")
    traj = []
    for t in top.objs("trajectory"):
        Fields(t.obj, t.what, t.path, allowed=TrajectoryPoint.__dataclass_fields__)
        pi = t.int("phase", min=0)
        if pi >= len(phases):
            raise SchemaError(source, f"{t.path}.phase", f"{pi} but the plan has {len(phases)} phases")
        traj.append(TrajectoryPoint(epoch=t.int("epoch", min=0), frozen_blocks=t.int("frozen_blocks", min=0),
                                    phase=pi, iterations=t.int("iterations", min=0), seconds=t.float("seconds", min=0)))
    totals = top.obj_("totals")
    tot = {k: totals.float(k, min=0) for k in totals.obj}
    b = top.obj_("baseline", allowed=("phase", "seconds"))
    baseline = Baseline(phase=_phase(b.obj_("phase"), num_layers), seconds=b.float("seconds", min=0))
    return Plan(inputs=inputs.obj, phases=tuple(phases), trajectory=tuple(traj), totals=tot, baseline=baseline)


def load_plan(path: str | os.PathLike) -> Plan:
    """Load and validate a plan file."""
    return plan_from_json(read_json(path, "plan"), source=f"plan {os.fspath(path)}")


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Validate, then write atomically."""
    obj = plan.to_json()
    plan_from_json(json.loads(json.dumps(obj)), source="plan (before writing)")
    write_json(path, obj)
