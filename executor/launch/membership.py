"""A worker of an elastic job at its start: the plan for the world it finds itself in, and the run log's
``membership`` record when that world is not the one its checkpoint (or plan) was written for.

torchrun restarts the worker group with another world size when a node is lost (the surviving workers fail on
the lost peer; ``--max-restarts``) or joins (torchrun stops the group and starts it again). Every worker then:

1. compares ``WORLD_SIZE`` with the plan's world size; when they differ it plans again for the new one
   (``replan.replan``: the same search as ``ptplan plan``, from the plan's profile and settings) and checks that
   every rank got the same plan (its id); rank 0 writes it beside the run log (``replan.replanned_path``) and
   the run goes on with it (``cfg.plan`` names it);
2. reads the sharded checkpoint it will resume from (``sharded.json``: world size, plan id, phases); when its
   world size is not this one, the membership changed: rank 0 logs a ``membership`` record (``Membership``,
   after the ``resume`` record) with both worlds, both plans' ids and phase layouts, and the step resumed from.

The resume itself is the sharded checkpoint's (``executor/training/sharded.py``: any plan of the same profile).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch.distributed as dist

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Plan, save_plan

from ptplan.executor.runtime.collective import agree
from ptplan.executor.launch.replan import ReplanSettings, replan, replanned_path
from ptplan.executor.training import checkpoint as ckpt
from ptplan.executor.training.callbacks import Callback
from ptplan.executor.training.config import RunConfig
from ptplan.planner.records import MembershipRecord
from ptplan.executor.training.state import RunContext


def layout(plan: Plan) -> list[dict[str, Any]]:
    """Per phase: frozen blocks, K, D, tp, M, micro-batch size and schedule (the run log header's shape, plus tp)."""
    return [dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, tp=p.tp, M=p.M, b=p.micro_batch_size,
                 schedule=p.schedule) for p in plan.phases]


def describe(plan: Plan, path: str | None) -> dict[str, Any]:
    """A plan as the membership record names it: world size, id (``checkpoint.plan_id``), file and phases."""
    return {"world_size": plan.world_size, "plan_id": ckpt.plan_id(plan), "plan": path, "phases": layout(plan)}


def _from_checkpoint(meta: dict[str, Any], known: dict[str, str]) -> dict[str, Any]:
    """The previous membership as a sharded checkpoint's metadata records it (``known``: plan id -> file)."""
    phases = [dict(frozen_blocks=p[0], K=p[2], D=p[3], M=p[4], b=p[5], schedule=p[6]) for p in meta["plan"]["phases"]]
    return {"world_size": int(meta["world_size"]), "plan_id": meta["plan_id"], "plan": known.get(meta["plan_id"]),
            "phases": phases}


def _checkpoint_meta(cfg: RunConfig) -> dict[str, Any] | None:
    """The sharded checkpoint this start resumes from (``--resume`` or a torchrun restart), if there is one."""
    from ptplan.executor.training import sharded

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if not (cfg.checkpoint_dir and (cfg.resume or restarted) and os.path.exists(sharded.meta_path(cfg.checkpoint_dir))):
        return None
    try:
        return sharded.read_meta(cfg.checkpoint_dir, files=False)  # its records; the resume checks the files
    except PtplanError:
        return None  # the resume itself names the problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class Membership(Callback):
    """The ``membership`` record rank 0 logs at the start of a run whose world changed (after its ``resume``)."""

    old: dict[str, Any]
    new: dict[str, Any]
    replan_s: float
    """Seconds this rank spent planning for the new world (0: the plan was the job's own)."""

    def on_start(self, ctx: RunContext) -> None:
        ctx.log.write(MembershipRecord(step=ctx.pos.global_step, resumed=ctx.resuming,
                                       attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), from_=self.old,
                                       to=self.new, replan_seconds=self.replan_s))
        ctx.log.sync()


def _agreed_plan(plan: Plan, settings: ReplanSettings, world: int) -> tuple[Plan, str, float]:
    """The plan for ``world`` processes, planned by every rank and checked equal; rank 0 writes it beside the run
    log. Returns (plan, its file, seconds). Collective."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    t0 = time.perf_counter()
    problem, new = None, None
    try:
        new = replan(plan, settings, world, per_node)
    except PtplanError as e:
        problem = str(e)
    agree(problem)
    assert new is not None
    seconds = time.perf_counter() - t0
    ids: list[Any] = [None] * world
    dist.all_gather_object(ids, ckpt.plan_id(new))
    if len(set(ids)) != 1:
        raise PtplanError(f"re-planning for {world} processes gave different plans on different ranks (ids {ids}); "
                          f"the nodes must run the same ptplan and numpy versions")
    path = replanned_path(settings, world)
    problem = None
    if dist.get_rank() == 0:
        try:
            save_plan(new, path)
        except (OSError, PtplanError) as e:
            problem = f"cannot write the re-planned plan {path}: {e}"
    agree(problem)
    return new, path, seconds


def plan_for_world(cfg: RunConfig, plan: Plan, settings: ReplanSettings | None
                   ) -> tuple[RunConfig, Plan, Membership | None]:
    """(the config naming the plan to run, that plan, the membership record's callback or None) for this world.
    Collective when the world is not the plan's (``_agreed_plan``)."""
    world, own = dist.get_world_size(), cfg.plan
    if settings is None or world == plan.world_size:
        new, path, seconds = plan, cfg.plan, 0.0
    else:
        new, path, seconds = _agreed_plan(plan, settings, world)
        cfg = dataclasses.replace(cfg, plan=path)
    meta = _checkpoint_meta(cfg)
    if meta is not None:
        known = {ckpt.plan_id(plan): own, ckpt.plan_id(new): path}
        earlier = replanned_path(settings, int(meta["world_size"])) if settings is not None else None
        if earlier is not None and os.path.isfile(earlier) and meta["plan_id"] not in known:
            known[meta["plan_id"]] = earlier  # an earlier re-plan of this job for the checkpoint's world
        old = _from_checkpoint(meta, known)
    elif new is not plan:
        old = describe(plan, own)  # no checkpoint yet: the previous attempt ran the job's own plan
    else:
        return cfg, new, None
    if old["world_size"] == world:
        return cfg, new, None  # a restart on the same world: no change of membership
    return cfg, new, Membership(old=old, new=describe(new, path), replan_s=seconds)
