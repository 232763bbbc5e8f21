"""Rank layout of one phase and its process groups (pipeline and data-parallel), built in one fixed order.

Legend: K positions per pipeline, V chunks (stages) per position, D pipelines (data-parallel width);
``phase.ranks[p][k]`` is the global rank at position k of pipeline p, holding the chunks
``chunks_of(phase, k)`` (with V = 1, position k holds stage k). Every rank creates every group of a
phase in the same order (all pipeline groups, then all data-parallel groups); groups of size 1 are
never created. Pipeline groups keep the position order (``sort_ranks=False``), so a rank's group rank
is its position.
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


def locate(phase: Phase, rank: int) -> Place:
    """The (pipeline, stage) of a global rank in a phase."""
    for p, row in enumerate(phase.ranks):
        for s, r in enumerate(row):
            if r == rank:
                return Place(pipeline=p, stage=s)
    raise ValueError(f"rank {rank} is not in the phase's layout {phase.ranks}")


def chunks_of(phase: Phase, position: int) -> tuple[int, ...]:
    """The chunks (stages, 0..K·V-1) that pipeline position ``position`` runs, in ascending order."""
    return tuple(c for c, k in enumerate(phase.stage_to_rank()) if k == position)


def pipeline_members(phase: Phase) -> list[list[int]]:
    """For each pipeline, its ranks in stage order."""
    return [list(row) for row in phase.ranks]


@dataclass(kw_only=True)
class PhaseGroups:
    """The process groups one rank uses in a phase (None where the group would have one member)."""

    place: Place
    pp_group: dist.ProcessGroup | None
    """This rank's pipeline (K ranks, group rank = position); None when K == 1."""
    dp_group: dist.ProcessGroup | None
    """The ranks at this rank's position across pipelines (they hold the same chunks); None when D == 1."""
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
        for members in phase.dp_groups():
            g = dist.new_group(sorted(members), timeout=timeout, backend=backend)
            if rank in members:
                dp_group = g
                created.append(g)
    if pp_group is not None:
        got = dist.get_rank(pp_group)
        assert got == place.stage, f"pipeline group rank {got} != position {place.stage}"
    return PhaseGroups(place=place, pp_group=pp_group, dp_group=dp_group, created=created)


def destroy_groups(groups: PhaseGroups | None) -> None:
    """Destroy a phase's groups; never the default (WORLD) group."""
    if groups is None:
        return
    for g in groups.created:
        if g is None or g is dist.group.WORLD or g == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        dist.destroy_process_group(g)
    groups.created.clear()
