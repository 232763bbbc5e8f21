"""Re-planning on a membership change: what an elastic job (``ptplan run --nnodes MIN:MAX``) needs to plan again
for another world size, and the planning itself (torch-free: the launcher imports it, the workers call it).

A plan records its inputs (``plan.inputs``: the profile's identity and file path, the cluster, the training
settings, the freeze policy) but not two search switches, ``--strategies`` and ``--token-slices``; they are
read off the plan's phases (``settings_for``: any tensor-parallel, FSDP or recomputing stage means
``--strategies auto``; any token-sliced phase ``--token-slices auto``). The launcher resolves the profile file
once (as recorded, or beside the plan), checks that it is the plan's (fingerprint), and hands the workers
these settings in ``PTPLAN_REPLAN`` (JSON). A worker whose world (``WORLD_SIZE``) is not the plan's then runs
the same search as ``ptplan plan`` (``make_plan``) for the same device kind with the new process count
(``cluster_for``), in-process, and writes the plan beside the run log (``replanned_path``).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from ptplan.planner.cluster import Cluster
from ptplan.planner.errors import PtplanError

if TYPE_CHECKING:
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.plan import Plan

    from ptplan.executor.launch.launcher import Rendezvous
    from ptplan.executor.training.config import RunConfig

ENV_REPLAN = "PTPLAN_REPLAN"
"""The re-plan settings (``ReplanSettings`` as JSON), set by the launcher of an elastic job."""


@dataclass(frozen=True, kw_only=True)
class ReplanSettings:
    """What a worker needs beyond the plan to plan again for another world size."""

    profile: str
    """The plan's profile file, absolute (its fingerprint checked against the plan's by the launcher)."""
    strategies: str
    """``off`` or ``auto``: the plan's ``--strategies`` (read off its phases)."""
    token_slices: str
    """``off`` or ``auto``: the plan's ``--token-slices`` (read off its phases)."""
    log: str
    """The run log; re-planned plans are written beside it (``replanned_path``)."""

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "ReplanSettings | None":
        text = os.environ.get(ENV_REPLAN)
        return None if not text else cls(**json.loads(text))


def profile_file(plan: "Plan", plan_path: str) -> str | None:
    """The plan's profile file when it can be found: its recorded path, or the same name beside the plan."""
    ref = plan.inputs.profile.path
    if not ref:
        return None
    here = os.path.dirname(os.path.abspath(plan_path))
    for cand in (ref if os.path.isabs(ref) else os.path.abspath(ref), os.path.join(here, ref),
                 os.path.join(here, os.path.basename(ref))):
        if os.path.isfile(cand):
            return cand
    return None


def settings_for(cfg: "RunConfig", plan: "Plan") -> ReplanSettings:
    """The re-plan settings of ``cfg``'s plan; PtplanError when its profile file is gone or is another one."""
    from ptplan.planner.profile import load_profile

    fix = (f"keep the profile the plan was made from at {plan.inputs.profile.path or '(not recorded)'} (or beside "
           f"the plan), or run with a fixed --nnodes")
    path = profile_file(plan, cfg.plan)
    if path is None:
        raise PtplanError(f"--nnodes MIN:MAX re-plans from the plan's profile when the node count changes, but the "
                          f"profile file of {cfg.plan} is not found; {fix}")
    prof = load_profile(path)
    if prof.fingerprint() != plan.inputs.profile.fingerprint:
        raise PtplanError(f"--nnodes MIN:MAX re-plans from the plan's profile, but {path} has fingerprint "
                          f"{prof.fingerprint()} and the plan was made from {plan.inputs.profile.fingerprint}; {fix}")
    strategies = "auto" if any(p.tp > 1 or p.any_fsdp or p.any_recompute for p in plan.phases) else "off"
    slices = "auto" if any(p.slices for p in plan.phases) else "off"
    return ReplanSettings(profile=path, strategies=strategies, token_slices=slices,
                          log=os.path.abspath(cfg.log or "run.jsonl"))


def check_elastic(cfg: "RunConfig", rdzv: "Rendezvous", plan: "Plan") -> ReplanSettings:
    """An elastic job (MIN < MAX nodes) can re-plan and resume: a sharded checkpoint written every N steps,
    restarts allowed, a global batch that does not depend on the world size, and the plan's profile at hand.
    Returns the settings the workers get."""
    lo, hi = rdzv.min_nodes, rdzv.max_nodes
    need = []
    if not cfg.checkpoint_dir or cfg.checkpoint_format != "sharded":
        need.append("--checkpoint-dir DIR --checkpoint-format sharded (a folder every node sees; any world size "
                    "resumes from it)")
    if not cfg.checkpoint_every:
        need.append("--checkpoint-every N (the steps since the last checkpoint are run again after a change)")
    if rdzv.max_restarts < 1:
        need.append("--max-restarts 1 or more (a lost node fails the worker group; a restart re-plans)")
    if plan.inputs.training.batch_policy != "constant-global":
        need.append(f"a plan with the constant-global batch policy (this one's is "
                    f"{plan.inputs.training.batch_policy}: its global batch, and so the data order from the "
                    f"checkpoint on, would change with the world size; ptplan plan --batch-policy constant-global)")
    if need:
        raise PtplanError(f"--nnodes {lo}:{hi}: when the node count changes the job re-plans for the new world size "
                          f"and resumes from its last checkpoint, so it needs " + "; ".join(need)
                          + "; or pass a fixed --nnodes")
    settings = settings_for(cfg, plan)
    per = rdzv.nproc_per_node
    for nodes in range(lo, hi + 1):  # the re-plans the workers would make, made now: one that fails is refused here
        if nodes * per != plan.world_size:
            try:
                plan_for(plan, settings, nodes * per, per)
            except PtplanError as e:
                raise PtplanError(f"--nnodes {lo}:{hi} lets the job shrink or grow to {nodes} node(s), "
                                  f"{nodes * per} processes, and the workers would re-plan for it, but no plan fits "
                                  f"{nodes * per} processes: {e}\nGive a --nnodes range whose every world size can "
                                  f"be planned.") from None
    return settings


def cluster_for(cluster: Cluster, world: int, per_node: int) -> Cluster:
    """The plan's cluster with ``world`` processes, ``per_node`` on each node: the same device, links and overheads
    with ``world / per_node`` nodes. On a CPU cluster the processes of a node share its RAM, so each gets the node's
    host memory over ``per_node`` (or, without it, the plan's per-node total over ``per_node``)."""
    if per_node < 1 or world % per_node:
        raise PtplanError(f"cannot re-plan for {world} processes with {per_node} per node (not a whole number of "
                          f"nodes)")
    nodes = world // per_node
    out = replace(cluster, name=f"{cluster.name}-{nodes}x{per_node}", nodes=nodes, gpus_per_node=per_node)
    if cluster.device_kind == "cpu":
        node_ram = cluster.host_memory_bytes or cluster.gpu_memory_bytes * cluster.gpus_per_node
        out = replace(out, gpu_memory_bytes=node_ram // per_node,
                      concurrency_slowdown=cluster.concurrency_slowdown if per_node > 1 else 1.0)
    return out


def replan(plan: "Plan", settings: ReplanSettings, world: int, per_node: int) -> "Plan":
    """The plan ``ptplan plan`` makes from ``plan``'s profile and settings for ``world`` processes (``cluster_for``);
    PtplanError naming the world size when no plan fits it."""
    try:
        return plan_for(plan, settings, world, per_node)
    except PtplanError as e:
        raise PtplanError(f"the job now has {world} processes (was planned for {plan.world_size}) and re-planning "
                          f"for {world} failed: {e}") from None


def plan_for(plan: "Plan", settings: ReplanSettings, world: int, per_node: int) -> "Plan":
    """``replan``'s planning, its errors as the planner raises them."""
    from ptplan.planner.config import check_batch_reach
    from ptplan.planner.planner import make_plan
    from ptplan.planner.profile import load_profile

    prof = load_profile(settings.profile)
    cluster = cluster_for(plan.inputs.cluster, world, per_node)
    inp = plan.inputs
    training = for_world(inp.training, world)
    check_batch_reach(training, cluster.world_size, max(prof.batch_sizes))
    return make_plan(prof, cluster, training, inp.freeze, profile_path=settings.profile,
                     strategies=settings.strategies, token_slices=settings.token_slices)


def for_world(training: "TrainingConfig", world: int) -> "TrainingConfig":
    """The plan's training settings for ``world`` processes: a --start-K or -K that does not divide it (or exceeds
    it) was the user's choice for the planned world, not for this one, so the search chooses K freely
    (``--start-K 2`` planned for 2 processes cannot start a 1-process job)."""
    from ptplan.planner.candidates import valid_lengths

    def fits(K: int | None) -> bool:
        return K is None or K in valid_lengths(world, K)

    return replace(training, start_K=training.start_K if fits(training.start_K) else None,
                   pin_K=training.pin_K if fits(training.pin_K) else None)


def replanned_path(settings: ReplanSettings, world: int) -> str:
    """Where the plan for ``world`` processes is written: beside the run log, ``<stem>.plan-world<W>.json``."""
    stem = settings.log[:-len(".jsonl")] if settings.log.endswith(".jsonl") else settings.log
    return f"{stem}.plan-world{world}.json"
