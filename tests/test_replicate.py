"""AutoDP: rank layouts and the data-parallel groups they imply."""
from __future__ import annotations

import pytest

from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.errors import InfeasibleError, PtplanError
from ptplan.planner.replicate import check_layout, divisors, layout


def dp_groups(ranks):
    """For each stage, the ranks holding it across pipelines (what ``Phase.dp_groups`` returns)."""
    return tuple(tuple(row[s] for row in ranks) for s in range(len(ranks[0])))


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
