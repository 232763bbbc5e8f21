"""Parity helpers for the multi-process tests: weight differences and one recorded elastic run."""
from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from ptplan.executor.launch.local import run_world
from ptplan.planner.plan import Plan

T = TypeVar("T")


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


GRAD_ROUNDING = 1e-6
"""Relative difference of two float32 computations of the same gradient (another summation order, another
CPU): measured 3.6e-7 to 6.6e-7 (tests/test_terapipe_exec.py, gpt2-tiny and llama-tiny, 2 and 4 processes)."""


MIN_SHARE = 0.4
"""The least share of the elements a gradient moved that an AdamW parity check holds to its tolerance: the strict
comparison must keep covering a large part of the model (48 % to 75 % in these tests; bert-tiny's embedding rows of
rare tokens are the most ill-conditioned)."""


class Snapshots(dict):
    """A reference's weights by step (a plain dict to every reader), and for an AdamW reference what
    ``assert_parity`` needs to judge it: ``adamw`` = (lr, eps), each step's gradients and the weights after it."""

    adamw: tuple[float, float] | None = None
    grads: list[dict[str, torch.Tensor]]
    after: list[dict[str, torch.Tensor]]


def assert_parity(snaps: dict[int, dict[str, torch.Tensor]], ref: dict[int, dict[str, torch.Tensor]], steps,
                  tol: float) -> float:
    """The parity tests' check: after each of ``steps``, the run's weights are within ``tol`` of the
    reference's (``max_rel_diff``); returns the worst difference. An AdamW reference (``Snapshots`` with
    ``adamw``) is held to ``tol`` where AdamW's update is well-conditioned against the gradients' rounding
    (``adamw_well_conditioned``, with ``GRAD_ROUNDING``) -- at least ``MIN_SHARE`` of the elements a gradient
    moved (an embedding row of a token no batch held has none) -- and elsewhere to what AdamW's steps can move an element
    (``adamw_loose_bound``)."""
    worst = 0.0
    masks = None
    if isinstance(ref, Snapshots) and ref.adamw is not None:
        lr, eps = ref.adamw
        masks = adamw_well_conditioned(ref.grads, ref.after, lr=lr, eps=eps, grad_tol=GRAD_ROUNDING, tol=tol)
    for step in steps:
        if masks is None or step == 0:
            d, where = max_rel_diff(snaps[step], ref[step])
        else:
            d, where, outside, _ = masked_max_rel_diff(snaps[step], ref[step], masks[step - 1])
            share = moved_share(masks[step - 1], ref.grads[:step])
            assert share >= MIN_SHARE, f"after {step} steps: only {share:.0%} of the moved elements are well-conditioned"
            assert outside <= adamw_loose_bound(ref.adamw[0], step), (step, outside)
        assert d <= tol, f"after {step} steps: max relative difference {d:.2e} in {where}"
        worst = max(worst, d)
    return worst


LIVE: dict[str, Any] = {}
"""In a child of ``recorded_run``, from the run's start: ``"rt"``, this rank's ``ElasticRuntime`` (``live_runtime``).
What a ``record``/``after`` function inspects (the optimizer, the stage) without scanning the garbage collector's
objects: in a child forked from pytest that scan visits ~400,000 inherited objects, 0.3-0.5 s a call."""


def live_runtime() -> Any:
    """This child's running ``ElasticRuntime`` (``LIVE``); only inside ``recorded_run``'s training."""
    rt = LIVE.get("rt")
    assert rt is not None, "live_runtime() is called inside recorded_run's training only"
    return rt


_ONCE: dict[tuple, Any] = {}


def once(key: tuple, compute: Callable[[], T]) -> T:
    """``compute()``, run once per ``key`` in this process. For the single-process references: deterministic
    functions of what the key names (model, data, freeze schedule, optimizer), and several parity cases of a file
    compare with the same one. Callers only read the result."""
    if key not in _ONCE:
        _ONCE[key] = compute()
    return _ONCE[key]


def recorded_run(cfg: Any, plan: Plan, model: nn.Module, dataset: Any, *, world: int, tmpdir: str,
                 record: Any = None, before: Any = None, after: Any = None, timeout_s: float = 60.0,
                 deadline_s: float = 180.0) -> tuple[dict[int, dict[str, torch.Tensor]], dict[int, list]]:
    """The parity tests' elastic run: ``training.run_training(cfg, plan, model, dataset)`` on ``world`` forked
    ranks (``run_world``) with snapshots on. Returns (rank 0's gathered weights by optimizer step, one per
    snapshot: the start, every transition, the end; per rank the list of ``record(step, rank)`` values, one
    per step, JSON round-tripped, when ``record`` is given, else {}). ``before(rank)`` and ``after(rank)`` run
    in each child around the training (to patch or collect what the test watches); ``record`` and ``after`` find
    the rank's runtime with ``live_runtime()``."""
    import os

    from ptplan.executor.training.callbacks import Callback
    from ptplan.executor.training.loop import Hooks, run_training

    class Live(Callback):
        def on_start(self, ctx: Any) -> None:
            LIVE["rt"] = ctx.rt

    def worker(rank: int, world_size: int) -> None:
        def save(event: str, step: int, weights: dict[str, torch.Tensor]) -> None:
            torch.save(weights, os.path.join(tmpdir, f"snap-{step}-{event}.pt"))

        def write(step: int, r: int) -> None:
            with open(os.path.join(tmpdir, f"record-{r}.jsonl"), "a") as fh:
                fh.write(json.dumps(record(step, r)) + "\n")

        if before is not None:
            before(rank)
        run_training(cfg, plan, model, dataset,
                     hooks=Hooks(snapshots=True, on_snapshot=save, after_step=write if record is not None else None),
                     callbacks=[Live()])
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
                           lr: float, eps: float, grad_tol: float, tol: float, floor: float = 0.02,
                           grad_floor: float | None = None,
                           betas: tuple[float, float] = (0.9, 0.999)) -> list[dict[str, torch.Tensor]]:
    """Per step t and tensor, the elements whose AdamW weights a run may be held to ``tol`` on (a bool mask).

    The arithmetic: AdamW moves an element by lr·m̂/(√v̂+ε), m̂ and v̂ the bias-corrected moving averages of g and
    g². Gradients that differ by rounding (another summation order, another CPU: at most Δg = ``grad_tol`` of the
    tensor's largest gradient, every step) change m̂ and √v̂ by at most Δg, so the update by at most
    lr·Δg·(1/(√v̂+ε) + |m̂|/(√v̂+ε)²). Where g is near ε that is lr/ε (1e3 with lr 1e-3, ε 1e-6) times Δg: the run
    and its reference legitimately differ there by 1e-4 on one CPU and not another. m̂ and v̂ are the reference's
    own (replayed from its gradients); an element is held to ``tol`` at step t while the sum of those bounds
    over the steps so far stays within tol·max(max|w_t|, floor); the others to what any AdamW step can move
    them (``adamw_loose_bound``).

    ``grads[t]``/``weights[t]``: the reference's gradients at step t (of the parameters that trained) and its
    weights after that step. ``grad_floor`` (default ``floor``): the smallest gradient scale Δg is taken of; with
    clipped gradients (every element far below ``floor``) the tensor's own largest gradient is the scale its
    rounding is relative to, so pass 0."""
    b1, b2 = betas
    out: list[dict[str, torch.Tensor]] = []
    m: dict[str, torch.Tensor] = {}
    v: dict[str, torch.Tensor] = {}
    n: dict[str, int] = {}
    err: dict[str, torch.Tensor] = {}
    for g_t, w_t in zip(grads, weights):
        masks = {}
        for k, w in w_t.items():
            g = g_t.get(k)
            if g is not None:  # the parameter trained at this step: Adam's moments and step, replayed
                g = g.double()
                n[k] = n.get(k, 0) + 1
                m[k] = b1 * m.get(k, torch.zeros_like(g)) + (1 - b1) * g
                v[k] = b2 * v.get(k, torch.zeros_like(g)) + (1 - b2) * g * g
                mh, sv = m[k] / (1 - b1 ** n[k]), (v[k] / (1 - b2 ** n[k])).sqrt() + eps
                dg = grad_tol * max(float(g.abs().max()), floor if grad_floor is None else grad_floor)
                err[k] = err.get(k, torch.zeros_like(g)) + lr * dg * (1 / sv + mh.abs() / sv ** 2)
            masks[k] = err.get(k, torch.zeros_like(w, dtype=torch.float64)) <= tol * max(float(w.abs().max()), floor)
        out.append(masks)
    return out


def moved_share(mask: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]) -> float:
    """The share of the elements some step's gradient moved (g != 0) that ``mask`` holds."""
    inside = total = 0
    for k, m in mask.items():
        moved = torch.zeros_like(m)
        for g in grads:
            if k in g:
                moved |= g[k] != 0
        inside += int((m & moved).sum())
        total += int(moved.sum())
    return inside / max(total, 1)


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


def two_phase_job(folder: Any, seq_len: int, samples: int) -> tuple[nn.Module, Plan]:
    """bert-tiny (``seq_len`` tokens, no dropout) with a hand-made two-phase plan (K=2, D=1, M=2 then one frozen
    block at K=1, D=2, M=1; micro-batches of 2), saved as ``folder/plan.json``, and ``samples`` synthetic samples
    saved as ``folder/data.pt``: the small job the robustness and checkpoint tests run and damage."""
    from pathlib import Path

    from ptplan.executor.families.models import build_model
    from ptplan.executor.handplan import make_plan, spec
    from ptplan.planner.plan import save_plan

    d = Path(folder)
    model = build_model("bert-tiny", seq_len=seq_len, dropout=0.0)
    plan = make_plan(model, [spec(0, K=2, D=1, M=2, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1],
                     samples_per_epoch=samples)
    save_plan(plan, d / "plan.json")
    x, y, m = model.make_batch(samples, generator=torch.Generator().manual_seed(0))
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, d / "data.pt")
    return model, plan
