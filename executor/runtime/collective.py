"""Agreement across ranks: one collective that raises the same error on every rank, and how a message names ranks.

A check that can fail on some ranks only (a file one node lacks, rank 0's run log on a full disk) goes through
``agree`` before the next collective, so that no rank is left waiting for a peer that gave up."""
from __future__ import annotations

from typing import Any

from ptplan.planner.errors import PtplanError


def agree(problem: str | None, payload: Any = None) -> list[Any]:
    """Raise the lowest rank's problem on every rank (a PtplanError whose ``rank`` names it), else return
    every rank's payload (collective: no rank is left waiting for a peer that gave up)."""
    import torch.distributed as dist  # here: the launcher reads ``ranks_text`` without importing torch

    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (problem, payload))
    first = next(((r, p) for r, (p, _) in enumerate(got) if p), None)
    if first:
        err = PtplanError(first[1])
        err.rank = first[0]  # type: ignore[attr-defined]
        raise err
    return [x for _, x in got]


def ranks_text(ranks: list[int]) -> str:
    """How a message names ranks: [3] -> 'rank 3'; [0, 1, 2, 5] -> 'ranks 0-2, 5'."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(out)
