"""AutoPipe partitioner: optimal against brute force, infeasible cases, edges, and the paper's greedy."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ptplan.planner.errors import InfeasibleError, PtplanError
from ptplan.planner.partition import (MemoryInfeasibleError, Partition, _one, greedy_param_partition,
                                      optimal_partition, stage_cost)

GiB = 2**30


def brute_force(costs, K, boundary=None, extra=0.0, memory=None, extra_mem=0.0, limit=None):
    """Every split of n layers into K non-empty stages, as (bottleneck, sum of squares, ranges)."""
    n = len(costs)
    out = []
    for cuts in itertools.combinations(range(1, n), K - 1):
        b = (0, *cuts, n)
        ranges = tuple((b[s], b[s + 1]) for s in range(K))
        if memory is not None and limit is not None:
            mem = [sum(memory[lo:hi]) + (extra_mem if lo == 0 else 0.0) for lo, hi in ranges]
            if max(mem) > limit:
                continue
        sc = [stage_cost(costs, lo, hi, boundary_s=boundary, stage0_extra_s=extra) for lo, hi in ranges]
        out.append((max(sc), sum(c * c for c in sc), ranges))
    return out


def check_against_brute(rng: random.Random, integer: bool) -> None:
    n = rng.randint(1, 10)
    K = rng.randint(1, n)
    draw = (lambda a, b: float(rng.randint(a, b))) if integer else (lambda a, b: rng.uniform(a, b))
    costs = [draw(0, 5) for _ in range(n)]
    boundary = [draw(0, 3) for _ in range(n)] if rng.random() < 0.7 else None
    extra = draw(0, 6) if rng.random() < 0.5 else 0.0
    memory = limit = None
    extra_mem = 0.0
    if rng.random() < 0.5:
        memory = [draw(1, 4) for _ in range(n)]
        extra_mem = draw(0, 3) if rng.random() < 0.5 else 0.0
        limit = draw(4, 14)
    kwargs = dict(boundary_s=boundary, stage0_extra_s=extra, memory=memory, stage0_extra_memory=extra_mem,
                  memory_limit=limit)
    splits = brute_force(costs, K, boundary, extra, memory, extra_mem, limit)
    if not splits:
        with pytest.raises(InfeasibleError):
            optimal_partition(costs, K, **kwargs)
        return
    p = optimal_partition(costs, K, **kwargs)
    best = min(s[0] for s in splits)
    assert p.bottleneck == pytest.approx(best, rel=1e-12, abs=1e-12), (costs, K, kwargs)
    # the result is a real split, its reported costs are the model's, and it fits in memory
    assert p.K == K and p.ranges[-1][1] == n
    for (lo, hi), c in zip(p.ranges, p.stage_costs):
        assert c == pytest.approx(stage_cost(costs, lo, hi, boundary_s=boundary, stage0_extra_s=extra))
    if limit is not None:
        assert max(p.stage_memory) <= limit + 1e-9
    # secondary objective: least sum of squares among the bottleneck-optimal splits
    tied = [s for s in splits if s[0] <= best * (1 + 1e-12) + 1e-12]
    least_sq = min(s[1] for s in tied)
    assert sum(c * c for c in p.stage_costs) == pytest.approx(least_sq, rel=1e-9, abs=1e-9)
    if integer:  # exact arithmetic: the deterministic tie-break picks the latest cuts, last cut first
        winners = [s[2] for s in tied if s[1] == least_sq]
        expect = max(winners, key=lambda r: [lo for lo, _ in reversed(r)])
        assert p.ranges == expect, (costs, K, kwargs, winners)


@pytest.mark.parametrize("seed", range(6))
def test_optimal_matches_brute_force_random_floats(seed):
    rng = random.Random(seed)
    for _ in range(120):
        check_against_brute(rng, integer=False)


@pytest.mark.parametrize("seed", range(6))
def test_optimal_matches_brute_force_integer_ties(seed):
    rng = random.Random(1000 + seed)
    for _ in range(120):
        check_against_brute(rng, integer=True)


def reference_dp(costs, K, boundary, extra, memory, extra_mem, limit):
    """A plain O(K n^2) dynamic program for (least bottleneck, then least sum of squares)."""
    n = len(costs)
    inf = float("inf")

    def cost(i, j):
        if memory is not None and limit is not None:
            if sum(memory[i:j]) + (extra_mem if i == 0 else 0.0) > limit:
                return inf
        return stage_cost(costs, i, j, boundary_s=boundary, stage0_extra_s=extra)

    C = [[cost(i, j) if i < j else inf for j in range(n + 1)] for i in range(n + 1)]
    F = [C[0][:]] + [[inf] * (n + 1) for _ in range(K - 1)]
    for k in range(1, K):
        for j in range(n + 1):
            F[k][j] = min((max(F[k - 1][i], C[i][j]) for i in range(j)), default=inf)
    T = F[K - 1][n]
    Q = [[c * c if c <= T else inf for c in C[0]]] + [[inf] * (n + 1) for _ in range(K - 1)]
    for k in range(1, K):
        for j in range(n + 1):
            Q[k][j] = min((Q[k - 1][i] + C[i][j] ** 2 for i in range(j) if C[i][j] <= T), default=inf)
    return T, Q[K - 1][n]


@pytest.mark.parametrize("seed", range(4))
def test_optimal_matches_reference_dp_on_larger_cases(seed):
    rng = random.Random(500 + seed)
    for _ in range(6):
        n = rng.randint(20, 45)
        K = rng.choice([2, 3, 5, 8, 13, n // 2, n - 1, n])
        # some near-zero layers (e.g. a final norm) widen the band; boundary costs vary per cut
        costs = [rng.choice([0.0, 0.01, rng.uniform(0.5, 2.0)]) for _ in range(n)]
        boundary = [rng.uniform(0.0, 0.5) for _ in range(n)]
        extra = rng.choice([0.0, 2.5])
        memory = [rng.uniform(1.0, 3.0) for _ in range(n)]
        limit = rng.choice([None, sum(memory) / K * 1.3, sum(memory) / K * 2.0])
        args = (costs, K, boundary, extra, memory if limit else None, 1.0 if limit else 0.0, limit)
        T, Q = reference_dp(*args)
        kwargs = dict(boundary_s=boundary, stage0_extra_s=extra, memory=args[4], stage0_extra_memory=args[5],
                      memory_limit=limit)
        if T == float("inf"):
            with pytest.raises(InfeasibleError):
                optimal_partition(costs, K, **kwargs)
            continue
        p = optimal_partition(costs, K, **kwargs)
        assert p.bottleneck == pytest.approx(T, rel=1e-12)
        assert sum(c * c for c in p.stage_costs) == pytest.approx(Q, rel=1e-9)


def test_boundary_costs_make_stage_cost_non_monotone():
    # a cheap cut after layer 2 and an expensive one after layer 1: the longer first stage is cheaper
    costs = [1.0, 1.0, 1.0, 1.0]
    boundary = [0.0, 10.0, 0.0, 0.0]
    assert stage_cost(costs, 0, 3, boundary_s=boundary) < stage_cost(costs, 0, 2, boundary_s=boundary)
    p = optimal_partition(costs, 2, boundary_s=boundary)
    assert p.ranges in (((0, 1), (1, 4)), ((0, 3), (3, 4)))
    assert p.bottleneck == 3.0


def test_uniform_costs_split_evenly():
    p = optimal_partition([1.0] * 12, 4)
    assert p.counts == (3, 3, 3, 3) and p.bottleneck == 3.0
    p = optimal_partition([1.0] * 10, 4)          # 10 = 3 + 3 + 2 + 2 in some order, balanced
    assert sorted(p.counts) == [2, 2, 3, 3] and p.bottleneck == 3.0


def test_stage0_extra_moves_work_off_stage_0():
    p = optimal_partition([1.0] * 8, 2, stage0_extra_s=4.0)
    assert p.ranges == ((0, 2), (2, 8)) and p.stage_costs == (6.0, 6.0)


def test_k1_and_k_equals_n():
    costs = [3.0, 1.0, 2.0]
    p = optimal_partition(costs, 1, boundary_s=[5.0, 5.0, 5.0], stage0_extra_s=1.0)
    assert p.ranges == ((0, 3),) and p.stage_costs == (7.0,)
    p = optimal_partition(costs, 3, boundary_s=[0.5, 0.25])
    assert p.ranges == ((0, 1), (1, 2), (2, 3))
    assert p.stage_costs == (3.5, 1.75, 2.25)
    p = optimal_partition([2.0], 1)
    assert p.ranges == ((0, 1),) and p.bottleneck == 2.0


def test_shifted_and_counts():
    p = optimal_partition([1.0] * 6, 3)
    assert p.counts == (2, 2, 2)
    assert p.shifted(5) == ((5, 7), (7, 9), (9, 11))


def test_more_stages_than_layers_is_infeasible_with_numbers():
    with pytest.raises(InfeasibleError, match=r"cannot split 3 layers into K=4 stages.*K <= 3"):
        optimal_partition([1.0, 1.0, 1.0], 4)


def test_layer_too_big_for_a_gpu():
    with pytest.raises(InfeasibleError, match=r"layer 2 alone needs 20.00 GiB \(the least of any stage that can hold "
                                              r"it\) but one device has 16.00 GiB"):
        optimal_partition([1.0] * 4, 3, memory=[GiB, GiB, 20 * GiB, GiB], memory_limit=16 * GiB)
    # in 2 stages layer 2 is never alone: a stage holding it holds layer 1 or 3 too, and the message says so
    with pytest.raises(InfeasibleError, match=r"best split's largest stage needs 21.00 GiB"):
        optimal_partition([1.0] * 4, 2, memory=[GiB, GiB, 20 * GiB, GiB], memory_limit=16 * GiB)


def test_stage0_prefix_too_big():
    with pytest.raises(InfeasibleError, match=r"stage 0 needs at least 17.00 GiB \(layer 0 alone as stage 0, with "
                                              r"the 15.00 GiB that stage 0 always holds: .*\) but one device has "
                                              r"16.00 GiB"):
        optimal_partition([1.0] * 4, 2, memory=[2 * GiB] * 4, stage0_extra_memory=15 * GiB,
                          memory_limit=16 * GiB)


def test_no_split_fits_reports_best_largest_stage():
    # 6 layers of 5 GiB in 2 stages: the best split needs 15 GiB per GPU, the GPU has 12
    with pytest.raises(InfeasibleError, match=r"best split's largest stage needs 15.00 GiB but one device has "
                                              r"12.00 GiB.*larger K"):
        optimal_partition([1.0] * 6, 2, memory=[5 * GiB] * 6, memory_limit=12 * GiB)


def test_no_split_fits_although_the_total_would():
    # 16 GiB in total fits two 8.5 GiB GPUs, but no contiguous split does: the best needs 10 GiB
    with pytest.raises(MemoryInfeasibleError, match=r"best split's largest stage needs 10.00 GiB but one device has "
                                                    r"8.50 GiB"):
        optimal_partition([1.0] * 4, 2, memory=[5 * GiB, 5 * GiB, 5 * GiB, GiB], memory_limit=8.5 * GiB)
    assert issubclass(MemoryInfeasibleError, InfeasibleError)


def test_memory_forces_an_unbalanced_split():
    # time wants 2+2, but layer 0 plus the frozen prefix leave room for only one layer on stage 0
    p = optimal_partition([1.0] * 4, 2, memory=[4.0] * 4, stage0_extra_memory=6.0, memory_limit=12.0)
    assert p.ranges == ((0, 1), (1, 4)) and p.stage_memory == (10.0, 12.0)


def test_bad_inputs_are_user_errors():
    with pytest.raises(PtplanError, match="costs\\[1\\] is -1.0"):
        optimal_partition([1.0, -1.0], 1)
    with pytest.raises(PtplanError, match="boundary_s has 5 entries for 3 layers"):
        optimal_partition([1.0] * 3, 2, boundary_s=[0.0] * 5)
    with pytest.raises(PtplanError, match="K is 0"):
        optimal_partition([1.0], 0)
    with pytest.raises(PtplanError, match="memory_limit was given without per-layer memory"):
        optimal_partition([1.0], 1, memory_limit=1.0)
    with pytest.raises(PtplanError, match="empty"):
        optimal_partition([], 1)
    with pytest.raises(PtplanError, match="memory_limit is 0"):
        optimal_partition([1.0], 1, memory=[1.0], memory_limit=0)
    with pytest.raises(PtplanError, match="stage0_extra_s is -1.0"):
        optimal_partition([1.0], 1, stage0_extra_s=-1.0)


def test_deterministic():
    rng = random.Random(7)
    costs = [rng.choice([1.0, 2.0]) for _ in range(40)]
    results = {optimal_partition(costs, 7, boundary_s=[0.5] * 40).ranges for _ in range(3)}
    assert len(results) == 1


def reference_split(costs, K, boundary, extra, memory, extra_mem, limit):
    """A plain O(K n^2) dynamic program over the module docstring's lexicographic objective (least slowest
    stage, then least sum of squares, then the latest cuts from the last cut backwards): no band, no bound,
    no row ranges. Integer costs keep every sum exact. None if no split fits."""
    n, inf = len(costs), float("inf")

    def cost(lo, hi):
        if memory is not None and sum(memory[lo:hi]) + (extra_mem if lo == 0 else 0.0) > limit:
            return inf
        return stage_cost(costs, lo, hi, boundary_s=boundary, stage0_extra_s=extra)

    c = {(i, j): cost(i, j) for i in range(n) for j in range(i + 1, n + 1)}
    F = [[inf] * (n + 1) for _ in range(K + 1)]
    F[0][0] = 0.0
    for k in range(1, K + 1):
        for j in range(1, n + 1):
            F[k][j] = min((max(F[k - 1][i], c[i, j]) for i in range(j)), default=inf)
    T = F[K][n]
    if T == inf:
        return None
    Q = [[inf] * (n + 1) for _ in range(K + 1)]
    Q[0][0] = 0.0
    for k in range(1, K + 1):
        for j in range(1, n + 1):
            Q[k][j] = min((Q[k - 1][i] + c[i, j] ** 2 for i in range(j) if c[i, j] <= T), default=inf)
    cuts, j = [n], n
    for k in range(K, 0, -1):
        j = max(i for i in range(j) if c[i, j] <= T and Q[k - 1][i] + c[i, j] ** 2 == Q[k][j])
        cuts.append(j)
    cuts.reverse()
    return tuple(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("seed", range(4))
def test_banded_split_equals_a_plain_dp(seed):
    """``split_stages`` narrows its search (a heuristic split's bound, each stage's own rows and columns of
    the band): on random integer cases with up to 60 layers and 24 stages it picks exactly the split a
    plain dynamic program over every stage picks."""
    rng = random.Random(700 + seed)
    for _ in range(12):
        n = rng.randint(12, 60)
        K = rng.randint(2, min(n, 24))
        costs = [float(rng.randint(1, 9)) for _ in range(n)]
        boundary = [float(rng.randint(0, 3)) for _ in range(n)] if rng.random() < 0.7 else None
        extra = float(rng.randint(0, 40)) if rng.random() < 0.6 else 0.0
        memory = limit = None
        extra_mem = 0.0
        if rng.random() < 0.5:
            memory = [float(rng.randint(1, 4)) for _ in range(n)]
            extra_mem = float(rng.randint(0, 6))
            limit = float(rng.randint(max(4, int(sum(memory) / K)), int(sum(memory) / K * 2) + 8))
        want = reference_split(costs, K, boundary, extra, memory, extra_mem, limit)
        kwargs = dict(boundary_s=boundary, stage0_extra_s=extra, memory=memory, stage0_extra_memory=extra_mem,
                      memory_limit=limit)
        if want is None:
            with pytest.raises(InfeasibleError):
                optimal_partition(costs, K, **kwargs)
            continue
        assert optimal_partition(costs, K, **kwargs).ranges == want, (costs, K, kwargs)


def test_large_call_is_valid():
    """200 layers into 8, 32, 64 stages (its time: bench/unit_timings.py)."""
    rng = random.Random(3)
    n = 200
    costs = [rng.uniform(0.5, 1.5) for _ in range(n)]
    boundary = [rng.uniform(0.0, 0.2) for _ in range(n)]
    memory = [rng.uniform(1.0, 2.0) * GiB for _ in range(n)]
    for K in (8, 32, 64):
        p = optimal_partition(costs, K, boundary_s=boundary, stage0_extra_s=3.0, memory=memory,
                              stage0_extra_memory=2 * GiB, memory_limit=80 * GiB)
        assert isinstance(p, Partition) and p.K == K and p.ranges[-1][1] == n
        assert p.bottleneck >= (sum(costs) + 3.0) / K


# ---- the paper's greedy balancer ---------------------------------------------------------------
def vit_b16_sublayers() -> list[int]:
    """ViT-B/16 (ImageNet-1k head) sub-layer parameter counts as PipeTransformer splits it."""
    d, mlp = 768, 3072
    embedding = d * 3 * 16 * 16 + d + d + 197 * d          # patch conv, cls token, positions
    attention = 2 * d + 3 * (d * d + d) + d * d + d         # LayerNorm, q/k/v, output projection
    ffn = 2 * d + d * mlp + mlp + mlp * d + d               # LayerNorm, two linears
    return [embedding] + [attention, ffn] * 12 + [2 * d, d * 1000 + 1000]


def test_greedy_reproduces_paper_vit_split():
    params = vit_b16_sublayers()
    assert sum(params) == 86_567_656                     # the repo's total
    p = greedy_param_partition(params, 4)
    assert p.counts == (7, 6, 6, 8)
    assert [round(s, 3) for s in p.stage_costs] == [22.006, 21.264, 21.264, 22.034]
    # and the K=8 split at T=0 from the research notes (largest partition 14.18 M)
    p8 = greedy_param_partition(params, 8)
    assert p8.counts == (4, 2, 3, 3, 3, 3, 4, 5) and round(p8.bottleneck, 2) == 14.18


def test_optimal_beats_or_matches_greedy_on_params():
    params = [x / 1e6 for x in vit_b16_sublayers()]
    for K in (2, 4, 8):
        greedy = greedy_param_partition(vit_b16_sublayers(), K).bottleneck
        assert optimal_partition(params, K).bottleneck <= greedy + 1e-9


def test_greedy_reports_an_empty_stage():
    with pytest.raises(InfeasibleError, match="left stage 1 empty"):
        greedy_param_partition([1e6, 100e6, 1e6], 3)


# ---- the memory message's numbers are floors of every split (the real stage model, brute-forced) -----------------

def _message_cases(seed: int):
    """Stage models of small synthetic profiles (some layers given a huge output, as an LM head's logits), with
    frozen prefixes, schedules and micro-batch counts drawn at random, and a limit under their best split."""
    from dataclasses import replace as _replace

    from ptplan.planner.candidate import Candidate
    from ptplan.planner.cluster import Cluster
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.search import PhaseSearch
    from ptplan.planner.synthetic import synthetic_profile

    rng = random.Random(seed)
    prof = synthetic_profile(num_blocks=rng.choice((2, 3)), hidden=1024, seq_len=512, vocab=rng.choice((512, 50257)))
    big = rng.sample(range(len(prof.layers)), 2)
    prof = _replace(prof, layers=tuple(_replace(r, output_bytes_per_sample=r.output_bytes_per_sample * 40)
                                       if r.index in big else r for r in prof.layers))
    for _ in range(3):
        K, M = rng.choice((2, 3, 4)), rng.choice((1, 2, 4, 8))
        cluster = Cluster.uniform(nodes=1, gpus_per_node=K)
        sched = rng.choice(("1f1b", "gpipe")) if M >= K else "gpipe"  # 1F1B needs M >= K
        cfg = TrainingConfig(epochs=1, samples_per_epoch=64, batch=M * 2, schedule=sched)
        search = PhaseSearch(prof, cluster, cfg)
        f = rng.choice((0, 1))
        n0 = prof.frozen_boundary(f)
        if len(prof.layers) - n0 < K:
            continue
        model = search.model(Candidate(K=K, D=1, M=M, b=2, cache=False, schedule=sched), n0)
        yield K, model


def _every_split(model, K):
    a, n = int(model.start), int(model.n)
    for cuts in itertools.combinations(range(a + 1, n), K - 1):
        bounds = (a, *cuts, n)
        yield [(s, bounds[s], bounds[s + 1], _one(model, s, bounds[s], bounds[s + 1])[1]) for s in range(K)]


@pytest.mark.parametrize("seed", range(12))
def test_every_number_a_memory_message_names_is_a_floor_of_every_split(seed):
    """``_memory_message`` names a layer alone, stage 0, or the best split's largest stage. Each number must hold
    for every split: before, "layer i alone" was layer i priced at stage 1 (paying its output to a next stage M
    times), which an LM head on the last stage never pays (a 70 B model's head was said to need 298 GiB)."""
    import re

    from ptplan.planner.partition import _memory_message

    checked = 0
    for K, model in _message_cases(seed):
        splits = list(_every_split(model, K))
        best = min(max(m for *_, m in sp) for sp in splits)
        for limit in (best * 0.999, best * 0.6, best * 0.2):
            msg = _memory_message(model, K, limit)
            printed = float(re.search(r"needs (?:at least )?([\d.]+) GiB", msg).group(1)) * GiB
            need = printed - 0.005 * GiB  # printed to 0.01 GiB: the least the number can have been
            assert printed + 0.005 * GiB > limit, msg
            if m := re.match(r"layer (\d+) alone needs", msg):
                i = int(m.group(1))
                held = [mem for sp in splits for s, lo, hi, mem in sp if lo <= i < hi]
                assert min(held) >= need * (1 - 1e-9), (msg, min(held) / GiB)
            elif msg.startswith("stage 0 needs"):
                assert min(sp[0][3] for sp in splits) >= need * (1 - 1e-9), msg
            else:
                assert "best split's largest stage" in msg, msg
                assert printed == pytest.approx(best, abs=0.0051 * GiB), msg
            checked += 1
    assert checked >= 3


# ---- the per-position memory lower bound (``position_state``) proves what it refuses --------------------------------

_VARIANTS = ({}, {"recompute": True}, {"recompute": True, "recompute_layers": 1}, {"fsdp": True},
             {"recompute_per_stage": True}, {"recompute_per_stage": True, "fsdp_per_stage": True})


def _bound_cases(seed: int):
    """(K, model, build at another frozen count) of the real stage model over small synthetic profiles (some layers
    with a huge output), every schedule family with a memory term of its own, and every strategy kind, uniform and
    chosen per stage (``StageChoice``), D = 2 (FSDP shards over it)."""
    from dataclasses import replace as _replace

    from ptplan.planner.candidate import Candidate
    from ptplan.planner.cluster import Cluster
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.search import PhaseSearch
    from ptplan.planner.synthetic import synthetic_profile

    rng = random.Random(seed)
    prof = synthetic_profile(num_blocks=rng.choice((2, 3)), hidden=1024, seq_len=512, vocab=rng.choice((512, 50257)))
    big = rng.sample(range(len(prof.layers)), 2)
    prof = _replace(prof, layers=tuple(_replace(r, output_bytes_per_sample=r.output_bytes_per_sample * 40,
                                                backward_stash_bytes_per_sample=r.saved_bytes_per_sample // 3)
                                       if r.index in big else r for r in prof.layers))
    for _ in range(4):
        K, M = rng.choice((2, 3, 4)), rng.choice((1, 2, 4, 8))
        sched = rng.choice(("1f1b", "gpipe", "zb-h1", "2bw")) if M >= K else "gpipe"
        cfg = TrainingConfig(epochs=1, samples_per_epoch=64, batch=M * 4, schedule=sched)
        search = PhaseSearch(prof, Cluster.uniform(nodes=1, gpus_per_node=2 * K), cfg)
        n0, other = rng.sample((0, 1, 2), 2)
        cand = Candidate(K=K, D=2, M=M, b=2, cache=False, schedule=sched, **rng.choice(_VARIANTS))
        if len(prof.layers) - max(n0, other) >= K:
            yield K, search.model(cand, n0), search.model(cand, other)


@pytest.mark.parametrize("seed", range(10))
def test_the_position_bound_is_a_floor_and_refuses_only_what_fits_nowhere(seed):
    """``position_state`` row s is additive per layer and at most the exact peak of every stage at position s, in
    every split (brute force); ``refusal_by_bound`` refuses a limit only where no split fits it, and
    ``split_stages`` (which checks it first) finds a split exactly where the brute force does. The bound is the
    same for a candidate at any frozen count (the search keeps it across phases to refuse without a model)."""
    from ptplan.planner.partition import refusal_by_bound, split_stages

    checked = refused = 0
    for K, model, elsewhere in _bound_cases(seed):
        rows = model.position_state
        np.testing.assert_array_equal(rows, elsewhere.position_state)
        splits = list(_every_split(model, K))
        for sp in splits:
            for s, lo, hi, mem in sp:
                assert rows[s, hi] - rows[s, lo] <= mem * (1 + 1e-12), (s, lo, hi)
        best = min(max(m for *_, m in sp) for sp in splits)
        for limit in (best * 1.0001, best * 0.999, best * 0.8, best * 0.5, best * 0.2):
            err = refusal_by_bound(rows, model.start, limit, lambda: model)
            fits = best <= limit * (1 + 1e-12)
            assert not (fits and err is not None), limit
            refused += err is not None
            if err is not None:
                assert "GiB" in str(err)  # the message builds the model it was given lazily
            try:
                got = split_stages(model, K, limit)
            except InfeasibleError:
                assert not fits
            else:
                assert fits and max(got.stage_memory) <= limit * (1 + 1e-9)
            checked += 1
    assert checked >= 20 and refused >= 1
