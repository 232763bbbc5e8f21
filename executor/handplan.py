"""Hand-made plans for a built model (custom models, examples, tests, benchmarks), valid per the plan contract.

``make_plan(model, [spec(0, K=4, D=1, M=4, b=2), spec(1, K=2, D=2, M=2, b=2), ...], trajectory=[0, 1, 2])``
gives a Plan whose profile identity matches ``model``, with even partitions and row-major rank
layouts unless given, each phase's action lists from ``planner.schedule.build_schedule`` (V chunks
per position with ``V=``), dummy predictions, and one trajectory point per freeze step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

from ptplan.planner.cluster import cpu_cluster
from ptplan.planner.config import TrainingConfig
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.plan import (Baseline, Phase, Plan, PlanInputs, Prediction, ProfileRef, Totals, TrajectoryPoint,
                                 plan_from_json)
from ptplan.planner.schedule import ScheduleError, build_schedule

from ptplan.executor.training.validate import frozen_boundary, model_fingerprint


@dataclass(frozen=True, kw_only=True)
class PhaseSpec:
    frozen_blocks: int
    K: int
    D: int
    M: int
    b: int
    """Micro-batch size (samples)."""
    partition: tuple[tuple[int, int], ...] | None = None
    """K·V layer ranges over the active layers (None: as even as possible)."""
    ranks: tuple[tuple[int, ...], ...] | None = None
    """ranks[p][k] (None: row-major, rank = p*K + k)."""
    schedule: str | None = None
    """A ``planner.schedule`` name (None: the plan's default)."""
    V: int = 1
    """Chunks (stages) per pipeline position (``Phase.V``)."""
    actions: tuple[str, ...] | None = None
    """Per position, its actions as text (``Phase.actions``). None: ``build_schedule``'s lists for the
    phase's schedule, K, M and V (none where it refuses them, e.g. 1F1B with M < K); (): none, as in
    plans written before phases stored them."""
    cache: bool = False
    """Cache the frozen prefix's output in this phase (AutoCache; ``Phase.cache``)."""


def spec(frozen_blocks: int, *, K: int, D: int, M: int, b: int, **kw: Any) -> PhaseSpec:
    return PhaseSpec(frozen_blocks=frozen_blocks, K=K, D=D, M=M, b=b, **kw)


def even_partition(lo: int, hi: int, K: int) -> tuple[tuple[int, int], ...]:
    """K contiguous ranges over [lo, hi) (K stages: K·V with V chunks per position), sizes differing by at
    most one (larger ones last)."""
    n = hi - lo
    if n < K:
        raise ValueError(f"{n} active layers cannot fill {K} stages")
    base, extra = divmod(n, K)
    out, a = [], lo
    for s in range(K):
        size = base + (1 if s >= K - extra else 0)
        out.append((a, a + size))
        a += size
    return tuple(out)


def schedule_text(name: str, K: int, M: int, V: int = 1) -> tuple[str, ...]:
    """Per position, the named schedule's actions as ``Phase.actions`` stores them."""
    return tuple(" ".join(map(str, acts)) for acts in build_schedule(name, K, M, V).actions)


def _phase(model: nn.Module, sp: PhaseSpec, schedule: str) -> Phase:
    n0 = frozen_boundary(model, sp.frozen_blocks)
    S = sp.K * sp.V
    part = sp.partition or even_partition(n0, len(model.layers), S)
    ranks = sp.ranks or tuple(tuple(p * sp.K + s for s in range(sp.K)) for p in range(sp.D))
    name = sp.schedule or schedule
    actions = sp.actions
    if actions is None:
        try:
            actions = schedule_text(name, sp.K, sp.M, sp.V)
        except ScheduleError:  # a schedule that cannot exist (tests of the checks that refuse it): no lists
            actions = ()
    pred = Prediction(iteration_s=1.0, samples_per_s=1.0, bubble_fraction=0.0, allreduce_s=0.0,
                      stage_compute_s=(0.0,) * S, stage_peak_memory_bytes=(0,) * S)
    return Phase(frozen_blocks=sp.frozen_blocks, frozen_layers=n0, K=sp.K, D=sp.D, M=sp.M,
                 micro_batch_size=sp.b, schedule=name, partition=tuple(part), cache=sp.cache,
                 ranks=tuple(tuple(r) for r in ranks), predicted=pred, V=sp.V, actions=tuple(actions))


def profile_identity(model: nn.Module) -> ProfileRef:
    return ProfileRef(model=model.name, family=model.family, num_blocks=model.num_blocks, num_layers=len(model.layers),
                      granularity=model.granularity, seq_len=model.seq_len,
                      dtype=str(next(model.parameters()).dtype).removeprefix("torch."), device="test",
                      device_kind="cpu", fingerprint=model_fingerprint(model), source="synthetic")


def make_plan(model: nn.Module, phases: Sequence[PhaseSpec], *, trajectory: Sequence[int] | None = None,
              schedule: str = "gpipe", batch_policy: str = "constant-global", epochs: int | None = None,
              samples_per_epoch: int = 1024, freeze: FreezePolicy | None = None, check: bool = True,
              optimizer: str = "adamw") -> Plan:
    """A valid Plan for ``model`` (round-tripped through the JSON validator). ``trajectory``: the
    frozen count per freeze step (default: each phase once, in order). ``check=False`` skips the validator,
    for tests of what a later check (the executor's) refuses in a plan the reader would already refuse.
    ``optimizer``: the one the plan says it priced (``ptplan run``'s default)."""
    built = [_phase(model, sp, schedule) for sp in phases]
    index = {p.frozen_blocks: i for i, p in enumerate(built)}
    traj = list(trajectory) if trajectory is not None else [p.frozen_blocks for p in built]
    batch = built[0].global_batch if batch_policy == "constant-global" else built[0].pipeline_batch
    points, step = [], 0
    for e, f in enumerate(traj):
        iters = samples_per_epoch // built[index[f]].global_batch
        points.append(TrajectoryPoint(epoch=e, step=step, frozen_blocks=f, phase=index[f], iterations=iters,
                                      seconds=0.0))
        step += iters
    world = built[0].K * built[0].D
    inputs = PlanInputs(
        profile=profile_identity(model), cluster=cpu_cluster(world),
        training=TrainingConfig(epochs=epochs or len(traj), samples_per_epoch=samples_per_epoch, batch=batch,
                                batch_policy=batch_policy, schedule=schedule, cache="off", optimizer=optimizer),
        freeze=freeze or FreezePolicy(policy="manual", manual=tuple(traj)))
    base = built[index.get(0, 0)]
    plan = Plan(inputs=inputs, phases=tuple(built), freeze_steps=tuple(traj), trajectory=tuple(points),
                totals=Totals(seconds=0.0, samples=0.0, baseline_seconds=0.0, speedup=0.0, best_static_seconds=0.0,
                              best_static_K=base.K, best_static_M=base.M, speedup_vs_best_static=0.0),
                baseline=Baseline(phase=base, seconds=0.0))
    if not check:
        return plan
    return plan_from_json(json.loads(json.dumps(plan.to_json())), source="test plan")
