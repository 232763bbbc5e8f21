"""The central check: 4-process elastic runs (K=4,D=1 -> K=2,D=2 -> K=1,D=4) equal a single-process reference,
for every schedule the executor runs: GPipe, 1F1B, ZB-H1 (backward split into B and W) and interleaved
1F1B with V=2 chunks per position (8 -> 4 -> 2 stages).

Each run forks 4 gloo processes; rank 0 gathers the full model after every transition and at the
end. The reference below is written from scratch (it shares only the model adapter with the
runtime): one plain model, the same data order, the same freeze schedule, the full-batch loss as
the mean over the run's micro-batches, and the same optimizer.

Difference measure, per parameter tensor: max|run - ref| / max(max|ref|, 0.02), the floor being
the models' init std, so that tensors that are still ~0 (biases) are judged on the weights' scale.
AdamW runs use eps=1e-6 (BERT's pre-training value): attention key biases have mathematically
zero gradients (softmax is shift invariant), and with eps=1e-8 Adam turns their 1e-10 rounding
noise into lr-sized steps whose sign no two implementations share.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
from parity import Snapshots, assert_parity, max_rel_diff, recorded_run


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield

pytestmark = pytest.mark.multiproc

SEQ, N, B, STEPS_PER_PHASE = 8, 48, 8, 2
SEED, DATA_SEED = 0, 123
TOL = {"sgd": 1e-5, "adamw": 1e-4}
OPT = {"sgd": dict(lr=0.05, momentum=0.9, weight_decay=0.01), "adamw": dict(lr=1e-3, weight_decay=0.01, eps=1e-6)}
# Rank layouts per family: row-major for BERT; pipelines whose stage order is not the rank order for
# ViT and GPT-2 (exercises group-rank = stage and the weight moves between arbitrary owners).
LAYOUTS = {
    "bert-tiny": (None, None, None),
    "vit-tiny": (None, ((2, 0), (3, 1)), ((3,), (2,), (1,), (0,))),
    "gpt2-tiny": (((1, 3, 0, 2),), ((3, 1), (0, 2)), None),
}
COUNTS = [0, 0, 1, 1, 2, 2]          # frozen blocks at each step
CHUNKS = {0: 4 * 1, 1: 2 * 2, 2: 2 * 4}  # D*M micro-batches per global batch in each phase


def _build(name: str):
    kw = {} if name.startswith("vit") else {"seq_len": SEQ}
    return build_model(name, granularity="half", dropout=0.0, seed=SEED, **kw)


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2)]
"""(schedule, V) pairs the parity tests run."""


def _plan(model, schedule: str, V: int = 1):
    l0, l1, l2 = LAYOUTS[model.name]
    return make_plan(model, [spec(0, K=4, D=1, M=4, b=2, ranks=l0, schedule=schedule, V=V),
                             spec(1, K=2, D=2, M=2, b=2, ranks=l1, schedule=schedule, V=V),
                             spec(2, K=1, D=4, M=2, b=1, ranks=l2, schedule=schedule, V=V)], trajectory=[0, 1, 2])


def _data(model):
    return model.make_batch(N, generator=torch.Generator().manual_seed(DATA_SEED))


# ---- the reference: one process, one plain model ------------------------------------------------

def _first_active_layer(model, f: int) -> int:
    if f == 0:
        return 0
    for i, s in enumerate(model.specs):
        if s.block is not None and s.block >= f:
            return i
    raise AssertionError(f)


def reference(name: str, optimizer: str, data, counts=COUNTS, chunks=CHUNKS, batch=None
              ) -> tuple[dict[int, dict[str, torch.Tensor]], list[float]]:
    """Weights before each step where the frozen count changes and at the end; the loss of every step.

    ``batch[f]``: global batch with f frozen blocks (default B); ``chunks[f]``: micro-batches in it.
    """
    batch = batch or {f: B for f in chunks}
    model = _build(name)
    model.train()
    params = list(model.parameters())
    o = OPT[optimizer]
    # weight decay on matrices only, as fine-tuning recipes do (biases and norm weights: none)
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = (torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"])
           if optimizer == "sgd" else torch.optim.AdamW(groups, lr=o["lr"], eps=o["eps"]))
    x, y, m = data
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 7919 + 0))  # epoch 0's order
    snaps, losses, prev, cursor = Snapshots(), [], None, 0
    if optimizer == "adamw":  # what assert_parity needs to judge AdamW against rounding (tests/parity.py)
        snaps.adamw, snaps.grads, snaps.after = (o["lr"], o["eps"]), [], []
    for t, f in enumerate(counts):
        if f != prev:
            snaps[t] = {k: v.detach().clone() for k, v in model.named_parameters()}
            first = _first_active_layer(model, f)
            for i, layer in enumerate(model.layers):
                for p in layer.parameters():
                    p.requires_grad_(i >= first)
            prev = f
        ids = order[cursor:cursor + batch[f]]
        cursor += batch[f]
        n = chunks[f]
        xs, ys = x[ids].chunk(n), y[ids].chunk(n)
        ms = m[ids].chunk(n) if m is not None else [None] * n
        opt.zero_grad(set_to_none=True)
        loss = sum(model.loss(model(a, attention_mask=c), b) for a, b, c in zip(xs, ys, ms)) / n
        loss.backward()
        if snaps.adamw is not None:
            snaps.grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        opt.step()
        if snaps.adamw is not None:
            snaps.after.append({k: p.detach().clone() for k, p in model.named_parameters()})
        losses.append(loss.item())
    snaps[len(counts)] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return snaps, losses


# ---- the elastic run --------------------------------------------------------------------------

def elastic_run(name: str, schedule: str, optimizer: str, data, tmp: str, plan=None, V: int = 1
                ) -> tuple[dict[int, dict], str]:
    model = _build(name)
    plan = plan or _plan(model, schedule, V)
    o = OPT[optimizer]
    cfg = RunConfig(plan="(test)", model=name, optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                    weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=SEED,
                    freeze_every=STEPS_PER_PHASE, steps_per_epoch=len(COUNTS), epochs=1, progress=False,
                    timeout_s=60, log=os.path.join(tmp, "run.jsonl"))
    snaps, _ = recorded_run(cfg, plan, model, TensorDataset(*data), world=4, tmpdir=tmp, deadline_s=150)
    return snaps, cfg.log


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("schedule,V", SCHEDULES, ids=[s for s, _ in SCHEDULES])
@pytest.mark.parametrize("name", ["bert-tiny", "vit-tiny", "gpt2-tiny"])
def test_elastic_run_matches_single_process_reference(name, schedule, V, optimizer, tmp_path):
    data = _data(_build(name))
    snaps, log = elastic_run(name, schedule, optimizer, data, str(tmp_path), V=V)
    ref, ref_losses = reference(name, optimizer, data)
    assert sorted(snaps) == [0, 2, 4, 6], sorted(snaps)  # start, two transitions, end
    worst = assert_parity(snaps, ref, (2, 4, 6), TOL[optimizer])
    print(f"parity {name} {schedule} {optimizer}: max relative difference {worst:.1e}")  # pytest -s shows it
    recs = read_records(log)
    steps = [r for r in recs if r["type"] == "step"]
    assert [(r["K"], r["D"], r["frozen_blocks"]) for r in steps] == [(4, 1, 0)] * 2 + [(2, 2, 1)] * 2 + [(1, 4, 2)] * 2
    for r, want in zip(steps, ref_losses):
        assert math.isclose(r["loss"], want, rel_tol=1e-5), (r["step"], r["loss"], want)
    trans = [r for r in recs if r["type"] == "transition"]
    assert [(t["step"], t["from_phase"], t["to_phase"]) for t in trans] == [(2, 0, 1), (4, 1, 2)]
    assert all(set(t["parts"]) == {"weights", "optimizer_state", "groups", "rebuild"} for t in trans)
    assert all(t["bytes"]["optimizer_state"] > 0 for t in trans)  # state moved, not reset


def test_second_run_gives_identical_weights(tmp_path):
    data = _data(_build("gpt2-tiny"))
    a, _ = elastic_run("gpt2-tiny", "1f1b", "adamw", data, str(tmp_path / "a"))
    b, _ = elastic_run("gpt2-tiny", "1f1b", "adamw", data, str(tmp_path / "b"))
    for step in (2, 4, 6):
        for k in a[step]:
            assert torch.equal(a[step][k], b[step][k]), (step, k)


def test_constant_pipeline_batch_policy_matches_reference(tmp_path):
    """The paper's policy: each pipeline keeps 8 samples, so the global batch grows 8 -> 16 -> 32 with D."""
    name = "bert-tiny"
    model = _build(name)
    plan = make_plan(model, [spec(0, K=4, D=1, M=4, b=2), spec(1, K=2, D=2, M=2, b=4), spec(2, K=1, D=4, M=2, b=4)],
                     trajectory=[0, 1, 2], schedule="1f1b", batch_policy="constant-pipeline")
    data = _data(model)  # 48 samples: 8 + 8 + 16 + 16 would overrun, so the epoch ends early
    snaps, log = elastic_run(name, "1f1b", "sgd", data, str(tmp_path), plan=plan)
    steps = [r for r in read_records(log) if r["type"] == "step"]
    assert [r["samples"] for r in steps] == [8, 8, 16, 16]  # the 32-sample phase does not fit the epoch
    ref, _ = reference(name, "sgd", data, counts=[0, 0, 1, 1], chunks={0: 4, 1: 4}, batch={0: 8, 1: 16})
    for step in (2, 4):
        d, where = max_rel_diff(snaps[step], ref[step])
        assert d <= TOL["sgd"], f"after {step} steps: max relative difference {d:.2e} in {where}"


@pytest.fixture(autouse=True)
def _mkdirs(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
