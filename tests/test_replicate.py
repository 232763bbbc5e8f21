"""AutoDP: rank layouts, data-parallel groups, valid K, and the batch split policies."""
from __future__ import annotations

import pytest

from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.errors import InfeasibleError, PtplanError
from ptplan.planner.replicate import (BatchSplit, check_layout, divisors, dp_groups, layout,
                                      micro_batch_candidates, pipeline_batch, pipeline_of, split_batch, valid_K)


def nodes_of(cluster: Cluster, row) -> set[int]:
    return {cluster.node_of(r) for r in row}


def test_divisors():
    assert divisors(1) == [1]
    assert divisors(16) == [1, 2, 4, 8, 16]
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    with pytest.raises(PtplanError):
        divisors(0)


@pytest.mark.parametrize("K", [1, 2, 4, 8, 16])
def test_layout_uses_every_rank_once_and_keeps_pipelines_in_a_node(K):
    c = get_preset("paper")                     # 2 nodes x 8
    ranks = layout(c, K)
    assert len(ranks) == 16 // K and all(len(row) == K for row in ranks)
    assert sorted(r for row in ranks for r in row) == list(range(16))
    for row in ranks:
        expected_nodes = 1 if K <= 8 else K // 8
        assert len(nodes_of(c, row)) == expected_nodes


def test_layout_literal_paper_k4():
    assert layout(get_preset("paper"), 4) == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    assert dp_groups(layout(get_preset("paper"), 4)) == ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14),
                                                         (3, 7, 11, 15))
    # K=8: PipeTransformer's T0 picture, pipelines on ranks 0..7 and 8..15, DP pairs across nodes
    assert dp_groups(layout(get_preset("paper"), 8)) == tuple((s, s + 8) for s in range(8))


def test_layout_spans_fewest_nodes_when_longer_than_a_node():
    c = Cluster.uniform(nodes=8, gpus_per_node=8)
    for K in (16, 32, 64):
        for row in layout(c, K):
            assert len(nodes_of(c, row)) == K // 8
            # neighbours cross a node boundary only K/8 - 1 times
            hops = sum(c.node_of(a) != c.node_of(b) for a, b in zip(row, row[1:]))
            assert hops == K // 8 - 1


def test_halving_k_keeps_ranks_inside_the_old_pipeline():
    c = Cluster.uniform(nodes=2, gpus_per_node=8)
    for K in (16, 8, 4, 2):
        old, new = layout(c, K), layout(c, K // 2)
        for row in new:
            assert any(set(row) <= set(o) for o in old)


def test_layout_rejects_k_that_does_not_divide_with_the_valid_list():
    with pytest.raises(InfeasibleError, match=r"K=3 does not divide the 16 GPUs.*valid K: 1, 2, 4, 8, 16"):
        layout(get_preset("paper"), 3)


def test_layout_of_a_plain_world_size_and_k_not_dividing_g():
    ranks = layout(24, 6)
    check_layout(ranks, 24)
    assert ranks[1] == (6, 7, 8, 9, 10, 11)


def test_check_layout_catches_errors():
    with pytest.raises(PtplanError, match="exactly once.*missing \\[3\\].*repeated or out of range \\[2\\]"):
        check_layout(((0, 1), (2, 2)), 4)
    with pytest.raises(PtplanError, match="pipeline 1 has 1 ranks"):
        check_layout(((0, 1), (2,)), 3)


def test_dp_groups_and_pipeline_of():
    ranks = layout(8, 2)
    groups = dp_groups(ranks)
    assert groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert pipeline_of(ranks, 5) == (2, 1)
    # every rank is in exactly one DP group
    assert sorted(r for g in groups for r in g) == list(range(8))


def test_valid_k():
    c = get_preset("paper")
    assert valid_K(c, 27) == [1, 2, 4, 8, 16]
    assert valid_K(c, 5) == [1, 2, 4]
    assert valid_K(1024, 195) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_constant_global_split():
    s = split_batch("constant-global", 512, 4, 8)
    assert s == BatchSplit(policy="constant-global", B=512, D=4, pipeline_batch=128, M=8, b=16)
    # more pipelines, same global batch
    assert split_batch("constant-global", 512, 16, 8).b == 4


def test_constant_pipeline_split_grows_global_batch():
    s = split_batch("constant-pipeline", 64, 4, 8)
    assert (s.B, s.pipeline_batch, s.b) == (256, 64, 8)
    assert split_batch("constant-pipeline", 64, 16, 8).B == 1024


def test_split_errors_name_numbers_and_fixes():
    with pytest.raises(InfeasibleError, match=r"global batch 400 does not split over D=3 pipelines.*399, 402"):
        split_batch("constant-global", 400, 3, 4)
    with pytest.raises(InfeasibleError, match=r"100 samples per pipeline.*M=3.*\[1, 2, 4, 5, 10, 20\].*396 or 408"):
        split_batch("constant-global", 400, 4, 3)
    with pytest.raises(InfeasibleError, match=r"per-pipeline batch 64.*M=5.*60 or 65"):
        split_batch("constant-pipeline", 64, 4, 5)
    with pytest.raises(PtplanError, match="batch policy 'bogus'"):
        split_batch("bogus", 64, 4, 4)
    with pytest.raises(PtplanError, match="M is 0"):
        split_batch("constant-global", 64, 4, 0)


def test_micro_batch_candidates():
    assert micro_batch_candidates("constant-global", 512, 4) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert micro_batch_candidates("constant-global", 512, 4, max_M=10) == [1, 2, 4, 8]
    assert micro_batch_candidates("constant-pipeline", 12, 8) == [1, 2, 3, 4, 6, 12]
    assert pipeline_batch("constant-pipeline", 12, 8) == 12
    with pytest.raises(InfeasibleError):
        micro_batch_candidates("constant-global", 10, 4)
