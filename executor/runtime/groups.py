"""Rank layout of one phase and its process groups (pipeline and data-parallel), built in one fixed order.

Legend: K positions per pipeline, V chunks (stages) per position, D pipelines (data-parallel width),
tp ranks per position (tensor-parallel width, issue 14); ``phase.ranks[p][k]`` is the first global
rank at position k of pipeline p, its tensor-parallel group being ranks ``ranks[p][k] + j`` for j < tp,
holding the chunks ``chunks_of(phase, k)`` (with V = 1, position k holds stage k). The ranks with tp
index j form tp pipelines of their own (pipeline groups and data-parallel groups per j), and the
stage's tp ranks split each layer between them. Every rank creates every group of a phase in the same
order (all pipeline groups, then all data-parallel groups, then all tensor-parallel groups); groups of
size 1 are never created. A position with an FSDP stage (``Phase.fsdp_at``: a phase's stages may differ) gets
a data-parallel group that backs a DeviceMesh (``_mesh_group``); the others a plain one. Pipeline groups keep the position order (``sort_ranks=False``), so a rank's
group rank is its position.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ptplan.planner.plan import Phase


@dataclass(frozen=True, kw_only=True)
class Place:
    """Where one rank sits in a phase."""

    pipeline: int
    """p, which pipeline (data-parallel replica) the rank belongs to."""
    stage: int
    """k, its position in that pipeline: the stage it runs when V = 1 (``chunks_of`` gives its chunks)."""
    tp: int = 0
    """j, its index in the position's tensor-parallel group (0 when tp = 1)."""


def locate(phase: Phase, rank: int) -> Place:
    """The (pipeline, stage) of a global rank in a phase."""
    for p, row in enumerate(phase.ranks):
        for s, r in enumerate(row):
            if r <= rank < r + phase.tp:
                return Place(pipeline=p, stage=s, tp=rank - r)
    raise ValueError(f"rank {rank} is not in the phase's layout {phase.ranks}")


def chunks_of(phase: Phase, position: int) -> tuple[int, ...]:
    """The chunks (stages, 0..K·V-1) that pipeline position ``position`` runs, in ascending order."""
    return tuple(c for c, k in enumerate(phase.stage_to_rank()) if k == position)


def pipeline_members(phase: Phase) -> list[list[int]]:
    """For each pipeline and tp index j (pipeline-major), its ranks in stage order."""
    return [[r + j for r in row] for row in phase.ranks for j in range(phase.tp)]


def dp_members(phase: Phase) -> list[list[int]]:
    """For each position and tp index j (position-major), the ranks holding the same shard across pipelines."""
    return [[r + j for r in g] for g in phase.dp_groups() for j in range(phase.tp)]


def tp_members(phase: Phase) -> list[list[int]]:
    """For each pipeline and position (pipeline-major), its tensor-parallel group."""
    return [[r + j for j in range(phase.tp)] for row in phase.ranks for r in row]


def fsdp_chunks(phase: Phase, position: int) -> tuple[int, ...]:
    """The chunks of pipeline position ``position`` that FSDP shards over their data-parallel group
    (``Phase.fsdp_at``; none when D = 1: there is nothing to shard over)."""
    if phase.D == 1:
        return ()
    return tuple(c for c in chunks_of(phase, position) if phase.fsdp_at(c))


def fsdp_positions(phase: Phase) -> set[int]:
    """The pipeline positions with at least one FSDP chunk (their data-parallel groups back a DeviceMesh)."""
    return {k for k in range(phase.K) if fsdp_chunks(phase, k)}


def dp_ranks_of(phase: Phase, place: Place) -> list[int]:
    """The data-parallel group of the rank at ``place``."""
    return [phase.ranks[p][place.stage] + place.tp for p in range(phase.D)]


def tp_ranks_of(phase: Phase, place: Place) -> list[int]:
    """The tensor-parallel group of the rank at ``place``."""
    r = phase.ranks[place.pipeline][place.stage]
    return list(range(r, r + phase.tp))


@dataclass(kw_only=True)
class PhaseGroups:
    """The process groups one rank uses in a phase (None where the group would have one member)."""

    place: Place
    pp_group: dist.ProcessGroup | None
    """This rank's pipeline (K ranks, group rank = position); None when K == 1."""
    dp_group: dist.ProcessGroup | None
    """The ranks at this rank's position (and tp index) across pipelines (they hold the same chunks); None
    when D == 1."""
    tp_group: dist.ProcessGroup | None = None
    """This rank's tensor-parallel group (tp ranks, group rank = tp index); None when tp == 1."""
    created: list[dist.ProcessGroup]
    """Every group this rank is a member of (to destroy at the next transition)."""


def build_groups(phase: Phase, rank: int, *, timeout: timedelta | None = None,
                 backend: str | None = None) -> PhaseGroups:
    """Create the phase's groups; must be called by every rank of the world with the same phase."""
    place = locate(phase, rank)
    created: list[dist.ProcessGroup] = []
    pp_group = dp_group = None
    if phase.K > 1:
        for row in pipeline_members(phase):
            g = dist.new_group(list(row), timeout=timeout, backend=backend, sort_ranks=False)
            if rank in row:
                pp_group = g
                created.append(g)
    if phase.D > 1:
        fsdp = fsdp_positions(phase)
        for idx, members in enumerate(dp_members(phase)):  # position-major: position idx // tp
            if idx // phase.tp in fsdp:
                g = _mesh_group(sorted(members), timeout=timeout, backend=backend)
            else:
                g = dist.new_group(sorted(members), timeout=timeout, backend=backend)
                if rank in members:
                    created.append(g)
            if rank in members:
                dp_group = g
    tp_group = None
    if phase.tp > 1:
        for members in tp_members(phase):
            g = _mesh_group(members, timeout=timeout, backend=backend)
            if rank in members:
                tp_group = g
    if pp_group is not None:
        got = dist.get_rank(pp_group)
        assert got == place.stage, f"pipeline group rank {got} != position {place.stage}"
    return PhaseGroups(place=place, pp_group=pp_group, dp_group=dp_group, tp_group=tp_group, created=created)


_MESH_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_MESH_WORLD: list[object] = [None]


def _mesh_group(members: list[int], *, timeout: timedelta | None, backend: str | None) -> dist.ProcessGroup:
    """A group that backs a DeviceMesh (FSDP's data-parallel group, a tensor-parallel group): made once per
    member list for the life of the world and never destroyed at a transition, because DTensor caches
    sharding and redistribution plans by mesh (its ranks), not by group, and would reuse a destroyed
    group's name for an equal mesh made later. Every rank calls this for the same lists in the same order,
    so every rank creates the same groups."""
    if _MESH_WORLD[0] is not dist.group.WORLD:
        _MESH_GROUPS.clear()
        _MESH_WORLD[0] = dist.group.WORLD
    key = tuple(members)
    if key not in _MESH_GROUPS:
        _MESH_GROUPS[key] = dist.new_group(list(members), timeout=timeout, backend=backend)
    return _MESH_GROUPS[key]


def destroy_groups(groups: PhaseGroups | None) -> None:
    """Destroy a phase's groups; never the default (WORLD) group."""
    if groups is None:
        return
    for g in groups.created:
        if g is None or g is dist.group.WORLD or g == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        dist.destroy_process_group(g)
    groups.created.clear()
