"""FSDP under a split backward (ZB-H1): a sharded stage's B runs its whole backward (FSDP2 reduce-scatters in it) and
its W nothing, as ``planner/strategy.strategy_table`` prices it (no weight-gradient part, no stash). The numbers are
``tests/test_hybrid_runtime.py``'s (parity through transitions, ZB-H1 and ZB-V; run split instead, through torch's
weight-gradient pass, such a stage skips FSDP's reduce-scatter and the run ends 1e-1 off the reference); this is
what a rank holds: its shards of weights, gradients and optimizer state, as under 1F1B.

The peak: stage 0's ranks read 2,541,524 bytes against the stage model's 3,194,112 (docs/strategies.md). Before the
layers shared FSDP2's list of reduce-scatter inputs in flight (``hybrid.shard_layer``), they read 2,874,324 or
3,266,388, the second over the model's: each layer, its own FSDP root, kept its layer's whole gradient until the
backward call ended."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.profiling.profiler import profile_model
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.loop import run_training
from ptplan.executor.training.runlog import read_records
from ptplan.planner.cluster import cpu_cluster
from ptplan.planner.costs import CostTable
from ptplan.planner.schedule import peak_inflight, peak_stashed
from ptplan.planner.stage import PhaseShape, StageModel, links_for

SEQ, M, STEPS = 8, 8, 2


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_sharded_stage_under_a_split_backward_holds_its_shards(tmp_path, schedule):
    """K = 2, D = 2, every stage FSDP-sharded, M = 8 micro-batches of 1, AdamW, on 4 forked processes: at the sampled
    step's peak each rank's weights, gradients and optimizer state are exactly the stage model's shards, its FSDP
    transient the model's, and its peak within the model's; and FSDP2 never holds more than one reduce-scatter input
    of a rank's layers at a time (``hybrid.shard_layer``: each layer its own root kept one each, until the backward
    call ended: the test read 3 so)."""
    model = build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0)
    plan = make_plan(model, [spec(0, K=2, D=2, M=M, b=1, schedule=schedule)], samples_per_epoch=2 * M * STEPS)
    plan = dataclasses.replace(plan, phases=tuple(dataclasses.replace(p, fsdp=True) for p in plan.phases))
    cfg = RunConfig(plan="(test)", model="bert-tiny", optimizer="adamw", lr=1e-3, seed=0, progress=False,
                    steps_per_epoch=STEPS, epochs=1, timeout_s=60, log=os.path.join(tmp_path, "run.jsonl"))
    data = TensorDataset(*model.make_batch(plan.phases[0].global_batch * STEPS,
                                           generator=torch.Generator().manual_seed(1)))

    def worker(rank: int, world: int) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        torch.set_num_threads(1)
        lists: dict[int, list] = {}
        most = [0]
        post_backward = FSDPParamGroup.post_backward

        def observed(group, *args, **kwargs):  # FSDP2's own hook, run as it is; only the retained inputs are read
            lists[id(group.comm_ctx.reduce_scatter_states)] = group.comm_ctx.reduce_scatter_states
            most[0] = max(most[0], sum(map(len, lists.values())))
            return post_backward(group, *args, **kwargs)

        FSDPParamGroup.post_backward = observed
        run_training(cfg, plan, model, data)
        with open(os.path.join(tmp_path, f"retained{rank}"), "w") as f:
            f.write(str(most[0]))

    res = run_world(4, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=150)
    assert res.ok, res.explain()
    (rec,) = [r for r in read_records(cfg.log) if r["type"] == "step" and r.get("memory_sampled")]
    table = CostTable(profile_model(build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.0, seed=0),
                                    device="cpu", batch_sizes=(1, 2), warmup=0, repeats=1, progress=False))
    ph = plan.phases[0]
    shape = PhaseShape(K=2, M=M, b=1, D=2, frozen=0, cache=False, inflight=peak_inflight(schedule, 2, M),
                       stashed=peak_stashed(schedule, 2, M), optimizer="adamw", device_is_host=True, fsdp=True)
    predicted = StageModel(table, shape, links_for(cpu_cluster(4), 2)).stage_memory(ph.partition)
    for rank, got in enumerate(rec["memory"]["per_rank"]):
        s = next(row.index(rank) for row in ph.ranks if rank in row)
        lo, hi = ph.partition[s]
        counters = 4 * sum(1 for i in range(lo, hi) for _ in model.layers[i].parameters())  # AdamW's step counts
        want = predicted[s]
        assert (got["params"], got["grads"], got["optimizer"] - counters) == (
            want.weights, want.gradients, want.optimizer), (schedule, rank)
        # FSDP2's gathered layers, counted as they are gathered and resharded (``memory._FsdpGathers``): at most the
        # largest layer whole and the flat buffer its all-gather received into, the stage model's 2 x its weights
        # (its gradient, made in its backward, is in the backward's working set); 0 when the count missed them
        assert got["transient"] == 2 * table.param_bytes[lo:hi].max(), (schedule, rank)
        assert got["total"] <= want.total, (schedule, rank, got["total"], want.total)
        with open(os.path.join(tmp_path, f"retained{rank}")) as f:
            assert int(f.read()) == 1, (schedule, rank)  # the input of the layer before, until this one's replaces it
