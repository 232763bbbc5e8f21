"""PipeDream-2BW in the executor (executor/runtime/twobw.py): a 4-process elastic run (K=4,D=1 -> K=2,D=2 -> K=1,D=4,
three mini-batches per phase) equals a single-process reference of the same 2BW semantics, and runs
the planner's flush-free order.

The reference is written from scratch here (it shares only the model adapter with the runtime): in
each phase, mini-batch t's loss and gradient are computed at W(t) on a second copy of the model, and
applied at once to the newest weights: W(t+2) = W(t+1) - lr * grad f(W(t)), with W(0) = W(1) = the
weights the phase starts from. So after a phase's T mini-batches every gradient is applied (the
executor's drain at the transition), and the next phase starts afresh from those weights.

Difference measure as in tests/test_runtime_parity.py: per parameter tensor
max|run - ref| / max(max|ref|, 0.02); AdamW with eps=1e-6 for the same reason as there.
"""
from __future__ import annotations

import dataclasses

import math
import os

import pytest
import torch

from ptplan.executor.runtime import twobw
from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
from parity import Snapshots, assert_parity, max_rel_diff, recorded_run
from ptplan.planner.schedule import two_bw


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


SEQ, B, STEPS = 8, 8, 3
COUNTS = [0] * STEPS + [1] * STEPS + [2] * STEPS  # frozen blocks at each step: three phases of three mini-batches
N = B * len(COUNTS)
SEED, DATA_SEED = 0, 321
TOL = {"sgd": 1e-5, "adamw": 1e-4}
OPT = {"sgd": dict(lr=0.05, momentum=0.9, weight_decay=0.01), "adamw": dict(lr=1e-3, weight_decay=0.01, eps=1e-6)}
CHUNKS = {0: 1 * 4, 1: 2 * 2, 2: 4 * 2}  # D*M micro-batches per global batch in each phase


def _build(name: str):
    kw = {} if name.startswith("vit") else {"seq_len": SEQ}
    return build_model(name, granularity="half", dropout=0.0, seed=SEED, **kw)


def _plan(model):
    return make_plan(model, [spec(0, K=4, D=1, M=4, b=2, schedule="2bw"),
                             spec(1, K=2, D=2, M=2, b=2, ranks=((3, 1), (0, 2)), schedule="2bw"),
                             spec(2, K=1, D=4, M=2, b=1, schedule="2bw")], trajectory=[0, 1, 2], schedule="2bw")


def _optimizer(params, optimizer: str):
    o = OPT[optimizer]
    if optimizer == "sgd":
        return torch.optim.SGD(_groups(params, o), lr=o["lr"], momentum=o["momentum"])
    return torch.optim.AdamW(_groups(params, o), lr=o["lr"], eps=o["eps"])


def _groups(params, o):
    """Weight decay on matrices only (the executor's fine-tuning default)."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o["weight_decay"]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def reference(name: str, optimizer: str, data) -> tuple[dict[int, dict[str, torch.Tensor]], list[float]]:
    """Weights at step 0, at each phase change (after the old phase's last gradient is applied) and at the
    end; the loss of every step (at the weights that step ran with)."""
    model, stale = _build(name), _build(name)
    model.train()
    stale.train()
    opt = _optimizer(list(model.parameters()), optimizer)
    x, y, m = data
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 7919))  # epoch 0's order
    snaps, losses, prev = Snapshots(), [], None
    if optimizer == "adamw":  # what assert_parity needs to judge AdamW against rounding (tests/parity.py)
        snaps.adamw, snaps.grads, snaps.after = (OPT["adamw"]["lr"], OPT["adamw"]["eps"]), [], []

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    for t, f in enumerate(COUNTS):
        if f != prev:  # a new phase: W(0) = W(1) = the weights so far
            snaps[t] = weights()
            first = next((i for i, s in enumerate(model.specs) if s.block is not None and s.block >= f), 0) if f else 0
            for net in (model, stale):
                for i, layer in enumerate(net.layers):
                    for p in layer.parameters():
                        p.requires_grad_(i >= first)
            stale.load_state_dict(model.state_dict())
            prev = f
        ids = order[t * B:(t + 1) * B]
        n = CHUNKS[f]
        xs, ys = x[ids].chunk(n), y[ids].chunk(n)
        ms = m[ids].chunk(n) if m is not None else [None] * n
        stale.zero_grad(set_to_none=True)
        loss = sum(stale.loss(stale(a, attention_mask=c), b) for a, b, c in zip(xs, ys, ms)) / n
        loss.backward()  # the gradient at W(t)
        losses.append(loss.item())
        newest = {k: v.detach().clone() for k, v in model.state_dict().items()}  # W(t+1): what t+1 runs with
        for p, q in zip(model.parameters(), stale.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        if snaps.adamw is not None:
            snaps.grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        opt.step()  # W(t+2) = W(t+1) - lr * grad f(W(t))
        if snaps.adamw is not None:
            snaps.after.append(weights())
        opt.zero_grad(set_to_none=True)
        stale.load_state_dict(newest)
    snaps[len(COUNTS)] = weights()
    return snaps, losses


def elastic_run(name: str, optimizer: str, data, tmp: str, recompute: tuple[bool, ...] = (), layers: int = 0
                ) -> tuple[dict[int, dict], str]:
    """``recompute``: per phase; ``layers``: a recomputing stage of more than ``layers`` layers recomputes only its
    first ``layers`` (``Phase.recompute_layers``)."""
    model = _build(name)
    plan = _plan(model)
    if recompute:  # activation recomputation per phase (Phase.recompute, what --strategies auto may choose)
        plan = dataclasses.replace(plan, phases=tuple(dataclasses.replace(
            ph, recompute=r, recompute_layers=tuple(layers if r and hi - lo > layers else 0 for lo, hi in ph.partition))
            for ph, r in zip(plan.phases, recompute)))
    o = OPT[optimizer]
    cfg = RunConfig(plan="(test)", model=name, optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                    weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=SEED, freeze_every=STEPS,
                    steps_per_epoch=len(COUNTS), epochs=1, progress=False, timeout_s=60,
                    log=os.path.join(tmp, "run.jsonl"))

    def before(rank: int) -> None:
        twobw.RECORD = []

    def after(rank: int) -> None:
        torch.save(twobw.RECORD, os.path.join(tmp, f"order-{rank}.pt"))

    snaps, _ = recorded_run(cfg, plan, model, TensorDataset(*data), world=4, tmpdir=tmp, before=before, after=after,
                            deadline_s=150)
    return snaps, cfg.log


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "vit-tiny"])
def test_two_bw_run_matches_single_process_reference(name, optimizer, tmp_path):
    data = _build(name).make_batch(N, generator=torch.Generator().manual_seed(DATA_SEED))
    snaps, log = elastic_run(name, optimizer, data, str(tmp_path))
    ref, ref_losses = reference(name, optimizer, data)
    assert sorted(snaps) == [0, 3, 6, 9], sorted(snaps)  # start, two transitions (drained), end (drained)
    assert_parity(snaps, ref, (3, 6, 9), TOL[optimizer])
    steps = [r for r in read_records(log) if r["type"] == "step"]
    assert [(r["K"], r["D"], r["frozen_blocks"]) for r in steps] == [(4, 1, 0)] * 3 + [(2, 2, 1)] * 3 + [(1, 4, 2)] * 3
    for r, want in zip(steps, ref_losses):
        assert math.isclose(r["loss"], want, rel_tol=1e-5), (r["step"], r["loss"], want)
    # the stale update is real: plain (flushed) training from the same start gives other weights
    if optimizer == "sgd":
        assert max_rel_diff(snaps[3], _flushed(name, optimizer, data))[0] > 100 * TOL[optimizer]
    # the order is the planner's continuous 1F1B: mini-batch 1's forwards start before mini-batch 0's
    # backwards end on stage 0 (no flush); each update's all-reduce is launched right after its mini-batch's last
    # backward (A) and the update applied (U) before mini-batch t+2's first forward, as the simulator places it
    order = {r: torch.load(tmp_path / f"order-{r}.pt") for r in range(4)}
    plan_lists = two_bw(4, 4, minibatches=STEPS).actions
    for r in range(4):
        ran = [a for K, s, a in order[r] if K == 4]
        want = [f"{a.kind.value}{a.mb}" for a in plan_lists[r] if a.kind.value in ("F", "B")]
        assert [a for a in ran if a[0] not in "AU"] == want, r
        for t in range(STEPS):
            # (the previous update first, when the next mini-batch but one has not needed it yet)
            assert ran[ran.index(f"B{t * 4 + 3}") + 1:ran.index(f"A{t}")] in ([], [f"U{t - 1}"]), ran
            assert ran.index(f"A{t}") < ran.index(f"U{t}")
            if f"F{(t + 2) * 4}" in ran:
                assert ran.index(f"U{t}") < ran.index(f"F{(t + 2) * 4}")
    stage0 = [a for K, s, a in order[0] if K == 4]
    assert stage0.index("F4") < stage0.index("B3")
    # with D = 2 (phase 1, K = 2) the all-reduce is in flight under mini-batch 1's work on stage 0
    stage0 = [a for K, s, a in order[0] if K == 2]
    between = stage0[stage0.index("A0") + 1:stage0.index("U0")]
    assert any(a[0] in "FB" and int(a[1:]) // 2 == 1 for a in between), stage0


def _flushed(name: str, optimizer: str, data) -> dict[str, torch.Tensor]:
    """Three plain (flushed, no stale weights) steps of phase 0: what 2BW must differ from."""
    model = _build(name)
    model.train()
    opt = _optimizer(list(model.parameters()), optimizer)
    x, y, m = data
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 7919))
    for t in range(STEPS):
        ids = order[t * B:(t + 1) * B]
        xs, ys = x[ids].chunk(4), y[ids].chunk(4)
        ms = m[ids].chunk(4) if m is not None else [None] * 4
        opt.zero_grad(set_to_none=True)
        (sum(model.loss(model(a, attention_mask=c), b) for a, b, c in zip(xs, ys, ms)) / 4).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_two_bw_plans_pass_the_executors_check():
    """``ptplan run --dry-run``'s check (actions.phase_schedule) takes the planner's 2BW lists and refuses others."""
    from dataclasses import replace

    from ptplan.executor.runtime.actions import phase_schedule
    from ptplan.planner.errors import PtplanError

    plan = _plan(_build("gpt2-tiny"))
    for i, ph in enumerate(plan.phases):
        assert phase_schedule(ph, i).minibatches > 1
    ph = plan.phases[0]
    bad = replace(ph, actions=(ph.actions[1], ph.actions[0], *ph.actions[2:]))
    with pytest.raises(PtplanError, match=r"plan phase 0 .*schedule '2bw'.*continuous 1F1B.*differ"):
        phase_schedule(bad, 0)


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer,layers", [("sgd", 0), ("adamw", 0), ("sgd", 1), ("adamw", 2)])
def test_two_bw_with_recomputation_matches_the_same_reference(optimizer, layers, tmp_path):
    """Recomputation changes no number: 2BW with it in phases 0 and 2 (not 1) equals the 2BW reference, so
    each backward's rerun used its own micro-batch's weight version (the newest version is off by a step). So does
    recomputing only each stage's first ``layers`` layers (``stage.RecomputedLayers.bind_weights``: its
    checkpoint's rerun binds the version its forward used; left to the module's own parameters, it read the
    newest)."""
    name = "gpt2-tiny"
    data = _build(name).make_batch(N, generator=torch.Generator().manual_seed(DATA_SEED))
    snaps, _ = elastic_run(name, optimizer, data, str(tmp_path), recompute=(True, False, True), layers=layers)
    ref, _ = reference(name, optimizer, data)
    for step in (3, 6, 9):
        d, where = max_rel_diff(snaps[step], ref[step])
        print(f"2bw + recomputation, {optimizer}, after {step} steps: max relative difference {d:.1e}")
        assert d <= TOL[optimizer], f"after {step} steps: max relative difference {d:.2e} in {where}"
