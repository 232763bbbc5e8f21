"""AutoDP: the rank layout of D pipelines of K stages, and so of the data-parallel groups.

Legend: W = world size (GPUs); G = GPUs per node; K = pipeline length (stages); D = W / K
data-parallel width (pipelines); M = micro-batches per pipeline per iteration; b = micro-batch size
(samples); B = global batch (samples per iteration over all pipelines) = D * M * b.
``ranks[p][s]`` is the rank that holds stage s of pipeline p.

Layout rule: pipeline p is the consecutive ranks [p*K, (p+1)*K), stage s on rank p*K + s. Ranks
are numbered node by node, so when K divides G every pipeline sits inside one node and all its
point-to-point traffic (every micro-batch, both directions) uses the fast intra-node links, while
the data-parallel groups (one all-reduce per iteration) cross nodes; when G divides K a pipeline
spans exactly K/G nodes, the fewest possible, with one inter-node hop per node boundary. Other K
also pack consecutively. Halving K splits each pipeline into two that keep their ranks, so a phase
change moves as little as possible. This is PipeTransformer's layout (process r of a node drives
GPUs [r*K, (r+1)*K)).
The batch split over pipelines and micro-batches is the search's (``search.PhaseSearch.pipeline_batch``,
policies in ``config.BATCH_POLICIES``).
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from .cluster import Cluster
from .errors import InfeasibleError, PtplanError

Layout = tuple[tuple[int, ...], ...]


def divisors(x: int) -> list[int]:
    """Positive divisors of x, ascending."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise PtplanError(f"cannot list divisors of {x!r}; it must be an integer >= 1")
    small, large = [], []
    d = 1
    while d * d <= x:
        if x % d == 0:
            small.append(d)
            if d != x // d:
                large.append(x // d)
        d += 1
    return small + large[::-1]


def _world(cluster: Cluster | int) -> int:
    return cluster if isinstance(cluster, int) else cluster.world_size


def layout(cluster: Cluster | int, K: int) -> Layout:
    """ranks[p][s] for D = W / K pipelines of K stages (see the module docstring for the rule)."""
    W = _world(cluster)
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise PtplanError(f"pipeline length K is {K!r}; it must be an integer >= 1")
    if W % K:
        raise InfeasibleError(f"K={K} does not divide the {W} GPUs, so they cannot form equal pipelines; "
                              f"valid K: {', '.join(map(str, divisors(W)))}")
    ranks = tuple(tuple(range(p * K, (p + 1) * K)) for p in range(W // K))
    check_layout(ranks, W)
    return ranks


def check_layout(ranks: Sequence[Sequence[int]], world_size: int) -> None:
    """Raise PtplanError unless ranks is D rows of K ranks using each of 0..world_size-1 exactly once."""
    if not ranks or not ranks[0]:
        raise PtplanError("rank layout is empty")
    K = len(ranks[0])
    for p, row in enumerate(ranks):
        if len(row) != K:
            raise PtplanError(f"pipeline {p} has {len(row)} ranks but pipeline 0 has {K}")
    flat = [r for row in ranks for r in row]
    if len(flat) != world_size or set(flat) != set(range(world_size)):
        seen = Counter(flat)
        missing = sorted(set(range(world_size)) - set(flat))
        extra = sorted(r for r, c in seen.items() if c > 1 or not 0 <= r < world_size)
        raise PtplanError(f"rank layout must use each rank 0..{world_size - 1} exactly once "
                          f"(missing {missing[:8]}, repeated or out of range {extra[:8]})")
