"""Parity helpers for the multi-process tests: weight differences and one recorded elastic run."""
from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from ptplan.executor.launch.local import run_world
from ptplan.planner.plan import Plan


def max_rel_diff(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The parity tests' difference measure: per tensor max|run - ref| / max(max|ref|, 0.02) (the floor is
    the models' init std, so tensors still ~0, such as biases, are judged on the weights' scale); returns
    the worst and its name."""
    assert run.keys() == ref.keys(), sorted(set(run) ^ set(ref))[:5]
    worst, where = 0.0, ""
    for k, r in ref.items():
        d = ((run[k] - r).abs().max() / r.abs().max().clamp_min(0.02)).item()
        if d > worst:
            worst, where = d, k
    return worst, where


def assert_parity(snaps: dict[int, dict[str, torch.Tensor]], ref: dict[int, dict[str, torch.Tensor]], steps,
                  tol: float) -> float:
    """The parity tests' check: after each of ``steps``, the run's weights are within ``tol`` of the
    reference's (``max_rel_diff``); returns the worst difference."""
    worst = 0.0
    for step in steps:
        d, where = max_rel_diff(snaps[step], ref[step])
        assert d <= tol, f"after {step} steps: max relative difference {d:.2e} in {where}"
        worst = max(worst, d)
    return worst



def recorded_run(cfg: Any, plan: Plan, model: nn.Module, dataset: Any, *, world: int, tmpdir: str,
                 record: Any = None, before: Any = None, after: Any = None, timeout_s: float = 60.0,
                 deadline_s: float = 180.0) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, list]]:
    """The parity tests' elastic run: ``training.run_training(cfg, plan, model, dataset)`` on ``world`` forked
    ranks (``run_world``) with snapshots on. Returns (rank 0's gathered weights by optimizer step, one per
    snapshot: the start, every transition, the end; per rank the list of ``record(step, rank)`` values, one
    per step, JSON round-tripped, when ``record`` is given, else {}). ``before(rank)`` and ``after(rank)`` run
    in each child around the training (to patch or collect what the test watches)."""
    import os

    from ptplan.executor.training.loop import Hooks, run_training

    def worker(rank: int, world_size: int) -> None:
        def save(event: str, step: int, weights: dict[str, torch.Tensor]) -> None:
            torch.save(weights, os.path.join(tmpdir, f"snap-{step}-{event}.pt"))

        def write(step: int, r: int) -> None:
            with open(os.path.join(tmpdir, f"record-{r}.jsonl"), "a") as fh:
                fh.write(json.dumps(record(step, r)) + "\n")

        if before is not None:
            before(rank)
        run_training(cfg, plan, model, dataset,
                     hooks=Hooks(snapshots=True, on_snapshot=save, after_step=write if record is not None else None))
        if after is not None:
            after(rank)

    res = run_world(world, worker, tmpdir=tmpdir, timeout_s=timeout_s, deadline_s=deadline_s)
    assert res.ok, res.explain()
    snaps = {int(f.split("-")[1]): torch.load(os.path.join(tmpdir, f)) for f in os.listdir(tmpdir)
             if f.startswith("snap-")}
    records = {r: [json.loads(x) for x in open(os.path.join(tmpdir, f"record-{r}.jsonl"))] for r in range(world)} \
        if record is not None else {}
    return snaps, records
