"""AutoDP: data-parallel width, the rank layout of pipelines and data-parallel groups, and the batch split.

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

Batch policies (``plan.BATCH_POLICIES``):

- ``constant-global`` (default): B stays fixed as D changes, so optimisation matches the baseline;
  each pipeline gets B / D samples, split into M micro-batches of b = B / (D * M). Both must divide.
- ``constant-pipeline`` (the paper's): each pipeline keeps its batch P, so B = D * P grows as
  freezing frees GPUs; b = P / M must divide.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from .cluster import Cluster
from .errors import InfeasibleError, PtplanError
from .config import BATCH_POLICIES

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


def valid_K(cluster: Cluster | int, n_active_layers: int) -> list[int]:
    """Pipeline lengths K that divide the world size and give every stage at least one active layer."""
    if isinstance(n_active_layers, bool) or not isinstance(n_active_layers, int) or n_active_layers < 1:
        raise PtplanError(f"number of active layers is {n_active_layers!r}; it must be an integer >= 1")
    return [k for k in divisors(_world(cluster)) if k <= n_active_layers]


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


def dp_groups(ranks: Sequence[Sequence[int]]) -> Layout:
    """Data-parallel groups: group s holds stage s of every pipeline, (ranks[0][s], ranks[1][s], ...)."""
    if not ranks:
        raise PtplanError("rank layout is empty")
    return tuple(tuple(row[s] for row in ranks) for s in range(len(ranks[0])))


def pipeline_of(ranks: Sequence[Sequence[int]], rank: int) -> tuple[int, int]:
    """(pipeline p, stage s) that ``rank`` holds."""
    for p, row in enumerate(ranks):
        for s, r in enumerate(row):
            if r == rank:
                return p, s
    raise PtplanError(f"rank {rank} is not in the layout")


# ---- batch split -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BatchSplit:
    """How one iteration's samples divide over pipelines and micro-batches."""

    policy: str
    """One of ``plan.BATCH_POLICIES``."""
    B: int
    """Global batch: samples per iteration over all D pipelines."""
    D: int
    """Data-parallel width (pipelines)."""
    pipeline_batch: int
    """Samples per pipeline per iteration (B / D)."""
    M: int
    """Micro-batches per pipeline per iteration."""
    b: int
    """Micro-batch size in samples (pipeline_batch / M)."""

    def __post_init__(self) -> None:
        assert self.policy in BATCH_POLICIES, self.policy
        assert self.B == self.D * self.pipeline_batch and self.pipeline_batch == self.M * self.b, self


def _positive(name: str, v: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PtplanError(f"{name} is {v!r}; it must be an integer >= 1")


def pipeline_batch(policy: str, batch: int, D: int) -> int:
    """Samples per pipeline per iteration. ``batch`` is B (constant-global) or the per-pipeline batch."""
    if policy not in BATCH_POLICIES:
        raise PtplanError(f"batch policy {policy!r} is not one of {', '.join(BATCH_POLICIES)}")
    _positive("batch size", batch)
    _positive("data-parallel width D", D)
    if policy == "constant-pipeline":
        return batch
    if batch % D:
        lower, upper = batch // D * D, (batch // D + 1) * D
        options = ", ".join(str(x) for x in (lower, upper) if x > 0)
        raise InfeasibleError(f"global batch {batch} does not split over D={D} pipelines ({batch} / {D} = "
                              f"{batch / D:.3g}); use a global batch that is a multiple of {D}, e.g. {options}, "
                              "or the constant-pipeline policy")
    return batch // D


def micro_batch_candidates(policy: str, batch: int, D: int, *, max_M: int | None = None) -> list[int]:
    """Every M that splits a pipeline's batch into equal micro-batches (divisors), ascending.

    The schedule adds its own rule (1F1B needs M >= K); ``max_M`` caps the list.
    """
    P = pipeline_batch(policy, batch, D)
    out = divisors(P)
    return [m for m in out if max_M is None or m <= max_M]


def split_batch(policy: str, batch: int, D: int, M: int) -> BatchSplit:
    """The batch split for one phase; InfeasibleError with valid M (or B) when it does not divide."""
    _positive("micro-batch count M", M)
    P = pipeline_batch(policy, batch, D)
    if P % M:
        valid = divisors(P)
        near = sorted(valid, key=lambda m: (abs(m - M), m))[:6]
        what = (f"global batch {batch} over D={D} pipelines gives {P} samples per pipeline"
                if policy == "constant-global" else f"per-pipeline batch {P}")
        lower, upper = P // M * M, (P // M + 1) * M
        hint = (f"a global batch of {lower * D if lower else upper * D} or {upper * D}" if policy == "constant-global"
                else f"a per-pipeline batch of {lower or upper} or {upper}")
        raise InfeasibleError(f"{what}, which does not split into M={M} equal micro-batches; use M in "
                              f"{sorted(near)} (the divisors of {P} nearest {M}), or {hint}")
    return BatchSplit(policy=policy, B=P * D, D=D, pipeline_batch=P, M=M, b=P // M)
