"""Fine-tuning essentials (issue 12): weight decay on matrices only, learning-rate warm-up and decay, and
global gradient-norm clipping -- a 4-process elastic run equals a single-process reference written here.

The run: bert-tiny (seq 8, no dropout), K=2,D=2,M=2 for 3 steps, then one block frozen and K=1,D=4
for 3 steps (a transition in between), global batch 8. The reference: one plain model, the same data
order (``epoch_order``), the loss as the mean over the run's 4 micro-batches, torch's own
``clip_grad_norm_`` over every parameter with a gradient, a linear warm-up (2 steps) and decay, and
the optimizer with two parameter groups (decay on the >= 2-D parameters only). The clip value is
small enough that every step clips, so a wrong global norm (a stage counted twice, a replica
missing) would show.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset, epoch_order
from ptplan.executor.families.models import build_model
from ptplan.executor.runtime.optim import lr_factor, param_groups
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from parity import GRAD_ROUNDING, MIN_SHARE, adamw_loose_bound, adamw_well_conditioned, masked_max_rel_diff, max_rel_diff
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.planner.errors import PtplanError

pytestmark = pytest.mark.multiproc

N, B, STEPS, WARMUP, CLIP = 48, 8, 6, 2, 0.05
OPT = {"sgd": dict(lr=0.05, momentum=0.9, weight_decay=0.01, tol=1e-5),
       "adamw": dict(lr=2e-3, weight_decay=0.01, eps=1e-6, tol=1e-5)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _build():
    return build_model("bert-tiny", seq_len=8, granularity="half", dropout=0.0, seed=0)


def test_lr_factor_matches_the_usual_schedules():
    f = [lr_factor(t, warmup=2, total=6, kind="linear") for t in range(6)]
    assert f == pytest.approx([1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25])
    c = [lr_factor(t, warmup=0, total=4, kind="cosine") for t in range(4)]
    assert c == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))])
    assert lr_factor(10, warmup=2, total=None, kind="constant") == 1.0
    with pytest.raises(PtplanError, match="needs the run's total steps"):
        lr_factor(5, warmup=0, total=None, kind="linear")


def test_weight_decay_skips_biases_and_norms():
    m = _build()
    g = param_groups(list(m.parameters()), 0.01)
    assert [x["weight_decay"] for x in g] == [0.01, 0.0]
    assert all(p.ndim >= 2 for p in g[0]["params"]) and all(p.ndim == 1 for p in g[1]["params"])
    names = {id(p): n for n, p in m.named_parameters()}
    assert any("LayerNorm" in names[id(p)] or "layer_norm" in names[id(p)].lower() for p in g[1]["params"])
    assert len(param_groups(list(m.parameters()), 0.01, decay_all=True)) == 1


def _reference(optimizer: str, data):
    o = OPT[optimizer]
    model = _build()
    model.train()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = (torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"]) if optimizer == "sgd" else
           torch.optim.AdamW(groups, lr=o["lr"], eps=o["eps"]))
    x, y, m = data
    order = epoch_order(N, 0, 0)
    norms, lrs, grads, weights = [], [], [], []
    first_active = next(i for i, s in enumerate(model.specs) if s.block is not None and s.block >= 1)
    for t in range(STEPS):
        if t == 3:  # one block frozen from step 3
            for i, layer in enumerate(model.layers):
                for p in layer.parameters():
                    p.requires_grad_(i >= first_active)
        ids = order[t * B:(t + 1) * B]
        xs, ys, ms = x[ids].chunk(4), y[ids].chunk(4), m[ids].chunk(4)
        opt.zero_grad(set_to_none=True)
        loss = sum(model.loss(model(a, attention_mask=c), b) for a, b, c in zip(xs, ys, ms)) / 4
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], CLIP)))
        lr = o["lr"] * (t + 1) / (WARMUP + 1) if t < WARMUP else o["lr"] * (1 - (t - WARMUP) / (STEPS - WARMUP))
        for g in opt.param_groups:
            g["lr"] = lr
        lrs.append(lr)
        # what AdamW sees this step: the clipped gradient scaled by this step's lr relative to the base lr
        # (adamw_well_conditioned takes one lr; the schedule only scales the update)
        grads.append({k: p.grad.detach().clone() * (lr / o["lr"]) for k, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        weights.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return weights[-1], norms, lrs, grads, weights


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_clipping_schedule_and_decay_groups_match_a_single_process_reference(optimizer, tmp_path):
    o = OPT[optimizer]
    model = _build()
    data = model.make_batch(N, generator=torch.Generator().manual_seed(3))
    plan = make_plan(model, [spec(0, K=2, D=2, M=2, b=2), spec(1, K=1, D=4, M=1, b=2)], trajectory=[0, 1])
    cfg = RunConfig(plan="(test)", model="bert-tiny", optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                    weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=0, freeze_every=3,
                    steps_per_epoch=STEPS, epochs=1, progress=False, timeout_s=60, log=str(tmp_path / "run.jsonl"),
                    lr_schedule="linear", warmup_steps=WARMUP, clip_grad_norm=CLIP)

    def worker(rank: int, world: int) -> None:
        def save(event, step, weights):
            if event == "final":
                torch.save(weights, tmp_path / "final.pt")

        run_training(cfg, plan, model, TensorDataset(*data), hooks=Hooks(snapshots=True, on_snapshot=save))

    res = run_world(4, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    got = torch.load(tmp_path / "final.pt")
    want, norms, lrs, grads, weights = _reference(optimizer, data)
    steps = [r for r in read_records(cfg.log) if r["type"] == "step"]
    assert [(r["K"], r["D"]) for r in steps] == [(2, 2)] * 3 + [(1, 4)] * 3
    assert [r["lr"] for r in steps] == pytest.approx(lrs, rel=1e-12)
    assert [r["grad_norm"] for r in steps] == pytest.approx(norms, rel=1e-4)
    assert all(n > CLIP for n in norms)  # every step clipped
    if optimizer == "sgd":
        worst, where = max_rel_diff(got, want)
    else:  # AdamW: held to tol where the update is well-conditioned, elsewhere to what AdamW can move an element
        masks = adamw_well_conditioned(grads, weights, lr=o["lr"], eps=o["eps"], grad_tol=GRAD_ROUNDING, tol=o["tol"],
                                       grad_floor=0.0)
        worst, where, outside, share = masked_max_rel_diff(got, want, masks[-1])
        print(f"\nadamw: max rel diff {worst:.2e} ({where}) on {share:.1%} of the elements; elsewhere {outside:.1e} "
              f"(bound {adamw_loose_bound(o['lr'], STEPS):.1e})")
        assert share >= MIN_SHARE, share  # the strict comparison still covers most of the elements
        assert outside <= adamw_loose_bound(o["lr"], STEPS), outside
    assert worst <= o["tol"], (worst, where)


def test_options_are_checked():
    with pytest.raises(PtplanError, match="--clip-grad-norm must be"):
        RunConfig(plan="p", model="m", clip_grad_norm=0.0)
    with pytest.raises(PtplanError, match="unknown --lr-schedule"):
        RunConfig(plan="p", model="m", lr_schedule="step")
    with pytest.raises(PtplanError, match="--warmup-steps must be >= 0"):
        RunConfig(plan="p", model="m", warmup_steps=-1)
