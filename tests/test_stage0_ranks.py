"""Which ranks keep the frozen prefix, in one place (``Phase.stage0_ranks``): every rank of each pipeline's stage-0
tensor-parallel group. The runtime's holdings and the run log's AutoCache host need (``cache.run.host_need``) both
read it; the log counted one rank per pipeline, a factor tp under the planner's ``cache_host_bytes_per_node`` (found
by an audit: K = 1, tp = 4 on an 8-GPU node is 8 ranks keeping the prefix, the log said 2)."""
from __future__ import annotations

import dataclasses

import torch

from ptplan.executor.cache.run import host_need
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.runtime.stage import LayerStore
from ptplan.executor.runtime.transition import HOST, holdings
from ptplan.planner.cache_size import host_bytes


def test_every_tp_rank_of_stage_0_keeps_the_prefix_and_the_host_need_counts_them():
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=2, D=2, M=2, b=2), spec(1, K=2, D=2, M=2, b=2, cache=True)],
                     trajectory=[0, 1], samples_per_epoch=16)
    ph = dataclasses.replace(plan.phases[1], tp=2, ranks=((0, 2), (4, 6)))  # 8 ranks: K=2 x D=2 x tp=2
    plan = dataclasses.replace(plan, phases=(plan.phases[0], ph))
    assert ph.stage0_ranks == (0, 1, 4, 5)
    n = len(model.layers)
    for rank in range(8):
        prefix_on_host = all(holdings(ph, rank, n, cached_prefix=True).get(i) == HOST for i in range(ph.frozen_layers))
        assert prefix_on_host == (rank in ph.stage0_ranks), rank
    weights = sum(p.numel() * p.element_size() for layer in model.layers[:ph.frozen_layers] for p in layer.parameters())
    sizes = LayerStore(model.layers, torch.device("cpu")).sizes
    # a rank that built only the first two layers counts the others at full size too (``LayerStore.sizes``)
    part = build_model("bert-tiny", seq_len=8, dropout=0.0, layers=[0, 1])
    assert LayerStore(part.layers, torch.device("cpu")).sizes == sizes
    row = 8 * 64 * torch.float32.itemsize
    assert host_need(plan, [1], sizes, 16, row, local_world=8, pinned=False) == host_bytes(16, row, weights, 4)  # 1
    assert host_need(plan, [1], sizes, 16, row, local_world=4, pinned=False) == host_bytes(16, row, weights, 2)  # 2
    # page-locked on GPUs: the weights at most twice (torch rounds each tensor up to a power of two)
    rows = host_bytes(16, row, 0, 2)
    assert host_need(plan, [1], sizes, 16, row, local_world=4, pinned=True) == rows + 2 * 2 * weights
