"""Recomputation under a split backward (ZB-H1, ZB-V) runs the forward as many times as the plan prices, and trains
as the same schedule without it.

A checkpointed stage recomputes its forward in every backward pass that reaches it, and a split backward makes one
pass for its B and one per parameter group for its W: on this bert-tiny's last stage (6 layers) each micro-batch
ran its forward 20 times (80 a step at M = 4; 28 on ZB-V's chunks) where the stage model prices 2, and held the
recomputed activations of many passes at once (at M = 16, 2,573,376 bytes measured against 1,849,666 predicted:
``tests/test_send_release.py``). The runtime now runs
such a stage's F without autograd and lets its B rebuild the graph once, on the random-number state its F began
with (``executor/runtime/step.ChunkCompute``'s ``rebuild``); B and W share it.
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch

from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.runlog import read_records
from parity import recorded_run

pytestmark = pytest.mark.multiproc

SEQ, M, STEPS = 8, 4, 3


def _run(tmp: str, schedule: str, V: int, recompute: bool, layers: int = 0):
    """K = 2 (V chunks a position), M micro-batches of 2, dropout 0.1, SGD, STEPS steps on 2 forked ranks; with
    ``layers``, each stage recomputes its first ``layers`` layers only. Returns (the weights at the end, per rank
    each layer's forward calls per step, the losses per step, the plan's phase)."""
    os.makedirs(tmp, exist_ok=True)
    model = build_model("bert-tiny", seq_len=SEQ, granularity="half", dropout=0.1, seed=0)
    plan = make_plan(model, [spec(0, K=2, D=1, M=M, b=2, schedule=schedule, V=V)], samples_per_epoch=2 * M * STEPS)
    if recompute:
        plan = dataclasses.replace(plan, phases=tuple(dataclasses.replace(
            p, recompute=True, recompute_layers=(layers,) * len(p.partition)) for p in plan.phases))
    cfg = RunConfig(plan="(test)", model="bert-tiny", optimizer="sgd", lr=0.05, seed=0, progress=False,
                    steps_per_epoch=STEPS, epochs=1, timeout_s=60, log=os.path.join(tmp, "run.jsonl"))
    data = TensorDataset(*model.make_batch(2 * M * STEPS, generator=torch.Generator().manual_seed(1)))
    calls: Counter[int] = Counter()

    def count(rank: int) -> None:
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: calls.update([i]))

    def record(step: int, rank: int) -> dict[str, int]:
        got = dict(calls)
        calls.clear()
        return {str(i): n for i, n in got.items()}

    snaps, per_rank = recorded_run(cfg, plan, model, data, world=2, tmpdir=tmp, before=count, record=record)
    losses = [r["loss"] for r in read_records(cfg.log) if r["type"] == "step"]
    return snaps[max(snaps)], per_rank, losses, plan.phases[0]


@pytest.mark.parametrize("schedule,V", [("zb-h1", 1), ("zb-v", 2)])
def test_recomputation_under_a_split_backward_runs_each_forward_twice_and_trains_as_without(
        tmp_path, one_torch_thread, schedule, V):
    """Every active layer runs its forward 2M times a step with recomputation (F, then the rebuild or the
    checkpoint's recomputation), M without; the losses and the final weights equal the run without recomputation
    (dropout on: the rebuild replays the F's random numbers)."""
    plain_w, plain_calls, plain_loss, _ = _run(str(tmp_path / "plain"), schedule, V, False)
    rc_w, rc_calls, rc_loss, _ = _run(str(tmp_path / "rc"), schedule, V, True)
    for calls, per_mb in ((plain_calls, 1), (rc_calls, 2)):
        for rank, steps in calls.items():
            assert len(steps) == STEPS
            for step in steps:
                assert step and set(step.values()) == {per_mb * M}, (schedule, per_mb, rank, step)
    assert rc_loss == pytest.approx(plain_loss, rel=1e-6, abs=0)
    assert plain_w.keys() == rc_w.keys()
    for k in plain_w:
        torch.testing.assert_close(rc_w[k], plain_w[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("schedule,V,r", [("zb-h1", 1, 2), ("zb-v", 2, 1)])
def test_layer_wise_recomputation_under_a_split_backward_reruns_only_the_first_layers(
        tmp_path, one_torch_thread, schedule, V, r):
    """Each stage recomputing its first r layers (Galvatron's layer-wise choice): those run their forward 2M times a
    step (F, then one rebuild for B and W together), the others M times, as ``planner/stage.py`` prices it; the
    losses and final weights equal the run without recomputation (dropout on)."""
    plain_w, _, plain_loss, _ = _run(str(tmp_path / "plain"), schedule, V, False)
    rc_w, rc_calls, rc_loss, phase = _run(str(tmp_path / "rc"), schedule, V, True, layers=r)
    first = {lo + k for lo, hi in phase.partition if hi - lo > r for k in range(r)}
    assert len(first) == r * len(phase.partition), phase.partition  # every stage recomputes r of its layers
    for rank, steps in rc_calls.items():
        for step in steps:
            want = {i: (2 if i in first else 1) * M for i in map(int, step)}
            assert {int(i): n for i, n in step.items()} == want, (schedule, rank, step)
    assert rc_loss == pytest.approx(plain_loss, rel=1e-6, abs=0)
    for k in plain_w:
        torch.testing.assert_close(rc_w[k], plain_w[k], rtol=1e-5, atol=1e-6, msg=k)
