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


def adamw_well_conditioned(grads: list[dict[str, torch.Tensor]], weights: list[dict[str, torch.Tensor]], *,
                           lr: float, eps: float, grad_tol: float, tol: float, floor: float = 0.02
                           ) -> list[dict[str, torch.Tensor]]:
    """Per step t and tensor, the elements whose AdamW weights a run may be held to ``tol`` on (a bool mask).

    The arithmetic: AdamW moves an element by lr·m̂/(√v̂+ε). A gradient that differs by Δg (rounding: another
    summation order, another CPU) moves it differently by at most about 2·lr·Δg/(√v̂+ε), and √v̂ (a weighted
    mean of the squared gradients so far) is at least the smallest |g| so far. At step 0 that is exactly
    lr·ε·Δg/(|g|+ε)²: an element whose gradient is near ε amplifies rounding by lr/ε (1e3 with lr 1e-3, ε
    1e-6) -- the run and its reference legitimately differ there by 1e-4 on one CPU and not another. With Δg
    the gradients' own tolerance (``grad_tol`` of the tensor's scale, as the gradients are compared), an element
    is held to ``tol`` at step t when Σ_{s<=t} 2·lr·Δg_s/(min_{r<=s}|g_r| + ε) <= tol·max(max|w_t|, floor);
    the others are held to what any AdamW step can move them (``adamw_loose_bound``).

    ``grads[t]``/``weights[t]``: the reference's gradients at step t and weights after it."""
    out: list[dict[str, torch.Tensor]] = []
    smallest: dict[str, torch.Tensor] = {}
    err: dict[str, torch.Tensor] = {}
    for g_t, w_t in zip(grads, weights):
        masks = {}
        for k, w in w_t.items():
            g = g_t.get(k)
            if g is None:  # frozen at this step: its weights do not move, its error so far stays
                g_abs = None
            else:
                g_abs = g.abs()
                smallest[k] = g_abs if k not in smallest else torch.minimum(smallest[k], g_abs)
                dg = grad_tol * max(float(g_abs.max()), floor)
                err[k] = err.get(k, torch.zeros_like(w)) + 2 * lr * dg / (smallest[k] + eps)
            masks[k] = err.get(k, torch.zeros_like(w)) <= tol * max(float(w.abs().max()), floor)
        out.append(masks)
    return out


def adamw_loose_bound(lr: float, steps: int) -> float:
    """The most AdamW's bias-corrected step lr·m̂/(√v̂+ε) moves an element over ``steps`` steps, twice (two runs
    moving apart): |m̂|/√v̂ stays below 3 for the first steps with β = (0.9, 0.999)."""
    return 2 * 3 * lr * steps


def masked_max_rel_diff(run: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], mask: dict[str, torch.Tensor],
                        floor: float = 0.02) -> tuple[float, str, float, float]:
    """``max_rel_diff`` over the masked elements; also the largest absolute difference outside the mask and the
    share of elements inside it."""
    worst, where, outside, inside, total = 0.0, "", 0.0, 0, 0
    for k, r in ref.items():
        d = (run[k] - r).abs()
        m = mask[k]
        inside += int(m.sum())
        total += m.numel()
        if bool(m.any()):
            rel = (d[m].max() / r.abs().max().clamp_min(floor)).item()
            if rel > worst:
                worst, where = rel, k
        if bool((~m).any()):
            outside = max(outside, d[~m].max().item())
    return worst, where, outside, inside / max(total, 1)
