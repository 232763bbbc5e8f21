"""Token-sliced phases in the elastic runtime (``ptplan run`` of a ``--token-slices auto`` plan): 2-process runs
through K=2 token-sliced (slices 10,7,5,2) -> one block frozen, K=1, D=2 unsliced -> two blocks frozen, K=2
token-sliced again with other slices (9,8,4,3) on the reversed rank order equal a single-process unsliced
reference after every transition (SGD 1e-5, AdamW 1e-4), for gpt2-tiny and llama-tiny; and the executor's
checks (``ptplan run --dry-run``: ``validate.check_plan``) accept such plans and refuse broken ones.

The reference shares only the model adapter with the runtime: one plain model, the run's data order, the
full-batch loss as the mean over the run's D·M micro-batches, and the same optimizer. Difference measure as
in tests/test_runtime_parity.py: per tensor max|run - ref| / max(max|ref|, 0.02); AdamW eps=1e-6 as there.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from ptplan.executor.runtime import sliced as sliced_mod
from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
from parity import Snapshots, assert_parity, recorded_run
from ptplan.executor.training.validate import check_plan
from ptplan.planner.errors import PtplanError, SchemaError
from ptplan.planner.plan import plan_from_json
from ptplan.planner.schedule import terapipe


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


SEQ, B, STEPS_PER_PHASE = 24, 4, 2
COUNTS = [0, 0, 1, 1, 2, 2]  # frozen blocks at each step
N = B * len(COUNTS)
SLICES = {0: (10, 7, 5, 2), 2: (9, 8, 4, 3)}
CHUNKS = {0: 2, 1: 4, 2: 2}  # D*M micro-batches per global batch
SEED, DATA_SEED = 0, 123
TOL = {"sgd": 1e-5, "adamw": 1e-4}
OPT = {"sgd": dict(lr=0.05, momentum=0.9, weight_decay=0.01), "adamw": dict(lr=1e-3, weight_decay=0.01, eps=1e-6)}


def _build(name: str):
    return build_model(name, granularity="half", seq_len=SEQ, dropout=0.0, seed=SEED)


def sliced(plan, slices: dict[int, tuple[int, ...]]):
    """The plan with token slices on the phases ``slices`` names (frozen count -> lengths), their actions
    TeraPipe's, validated by the plan reader."""
    phases = []
    for ph in plan.phases:
        s = slices.get(ph.frozen_blocks)
        if s:
            ph = dataclasses.replace(ph, slices=tuple(s), actions=tuple(
                " ".join(map(str, a)) for a in terapipe(ph.K, ph.M, len(s)).actions))
        phases.append(ph)
    base = dataclasses.replace(plan.baseline, phase=phases[0])
    obj = dataclasses.replace(plan, phases=tuple(phases), baseline=base).to_json()
    return plan_from_json(json.loads(json.dumps(obj)), source="test plan")


def _plan(model, cache: bool = False):
    return sliced(make_plan(model, [spec(0, K=2, D=1, M=2, b=2), spec(1, K=1, D=2, M=2, b=1),
                                    spec(2, K=2, D=1, M=2, b=2, ranks=((1, 0),), cache=cache)],
                            trajectory=[0, 1, 2], schedule="gpipe"), SLICES)


def _first_active_layer(model, f: int) -> int:
    return 0 if f == 0 else next(i for i, s in enumerate(model.specs) if s.block is not None and s.block >= f)


def reference(name: str, optimizer: str, data) -> tuple[dict[int, dict[str, torch.Tensor]], list[float]]:
    """Weights before each step where the frozen count changes and at the end; each step's loss."""
    model = _build(name)
    model.train()
    params = list(model.parameters())
    o = OPT[optimizer]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": o["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = (torch.optim.SGD(groups, lr=o["lr"], momentum=o["momentum"])
           if optimizer == "sgd" else torch.optim.AdamW(groups, lr=o["lr"], eps=o["eps"]))
    x, y, m = data
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED * 7919))  # epoch 0's order
    snaps, losses, prev = Snapshots(), [], None
    if optimizer == "adamw":  # what assert_parity needs to judge AdamW against rounding (tests/parity.py)
        snaps.adamw, snaps.grads, snaps.after = (o["lr"], o["eps"]), [], []
    for t, f in enumerate(COUNTS):
        if f != prev:
            snaps[t] = {k: v.detach().clone() for k, v in model.named_parameters()}
            first = _first_active_layer(model, f)
            for i, layer in enumerate(model.layers):
                for p in layer.parameters():
                    p.requires_grad_(i >= first)
            prev = f
        ids = order[t * B:(t + 1) * B]
        n = CHUNKS[f]
        opt.zero_grad(set_to_none=True)
        loss = sum(model.loss(model(a, attention_mask=c), b) for a, b, c in
                   zip(x[ids].chunk(n), y[ids].chunk(n), m[ids].chunk(n))) / n
        loss.backward()
        if snaps.adamw is not None:
            snaps.grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        opt.step()
        if snaps.adamw is not None:
            snaps.after.append({k: p.detach().clone() for k, p in model.named_parameters()})
        losses.append(loss.item())
    snaps[len(COUNTS)] = {k: v.detach().clone() for k, v in model.named_parameters()}
    return snaps, losses


def elastic_run(name: str, optimizer: str, data, tmp: str, cache: bool = False) -> tuple[dict[int, dict], str]:
    model = _build(name)
    plan = _plan(model, cache)
    o = OPT[optimizer]
    kw = {}
    if cache:  # phase 2's stage 0 reads the frozen prefix's output from the AutoCache (filled on this pass)
        os.makedirs(os.path.join(tmp, "ram"))
        kw = dict(cache="auto", cache_dir=os.path.join(tmp, "ram"))
    cfg = RunConfig(plan="(test)", model=name, optimizer=optimizer, lr=o["lr"], momentum=o.get("momentum", 0.9),
                    weight_decay=o["weight_decay"], adam_eps=o.get("eps", 1e-8), seed=SEED,
                    freeze_every=STEPS_PER_PHASE, steps_per_epoch=len(COUNTS), epochs=1, progress=False,
                    timeout_s=30, log=os.path.join(tmp, "run.jsonl"), **kw)

    def before(rank: int) -> None:
        sliced_mod.RECORD = []

    def after(rank: int) -> None:
        torch.save(sliced_mod.RECORD, os.path.join(tmp, f"ran-{rank}.pt"))

    snaps, _ = recorded_run(cfg, plan, model, TensorDataset(*data), world=2, tmpdir=tmp, before=before, after=after,
                            timeout_s=30, deadline_s=90)
    return snaps, cfg.log


@pytest.mark.multiproc
@pytest.mark.parametrize("name,optimizer,cache", [("gpt2-tiny", "sgd", False), ("gpt2-tiny", "adamw", False),
                                                  ("llama-tiny", "sgd", False), ("llama-tiny", "adamw", False),
                                                  ("llama-tiny", "sgd", True)])
def test_token_sliced_elastic_run_matches_unsliced_reference(name, optimizer, cache, tmp_path):
    """cache: phase 2 (two blocks frozen, K=2 sliced) reads its frozen prefix's output from the AutoCache, so
    its stage 0 slices the cached hidden states instead of running the prefix."""
    data = _build(name).make_batch(N, generator=torch.Generator().manual_seed(DATA_SEED))
    snaps, log = elastic_run(name, optimizer, data, str(tmp_path), cache)
    ref, ref_losses = reference(name, optimizer, data)
    assert sorted(snaps) == [0, 2, 4, 6], sorted(snaps)  # start, two transitions, end
    worst = assert_parity(snaps, ref, (2, 4, 6), TOL[optimizer])
    print(f"\ntoken-sliced parity {name} {optimizer}{' cached prefix' if cache else ''}: max relative difference {worst:.1e}")  # pytest -s shows it
    recs = read_records(log)
    steps = [r for r in recs if r["type"] == "step"]
    assert [(r["K"], r["D"], r["frozen_blocks"]) for r in steps] == [(2, 1, 0)] * 2 + [(1, 2, 1)] * 2 + [(2, 1, 2)] * 2
    for r, want in zip(steps, ref_losses):
        assert math.isclose(r["loss"], want, rel_tol=1e-5), (r["step"], r["loss"], want)
    # the token-sliced phases ran executor/runtime/sliced.py's loop (phase 2 on the reversed rank order), phase 1 did not
    ran = {r: torch.load(tmp_path / f"ran-{r}.pt") for r in range(2)}
    assert ran[0] == [(2, 0, SLICES[0])] * 2 + [(2, 1, SLICES[2])] * 2, ran[0]
    assert ran[1] == [(2, 1, SLICES[0])] * 2 + [(2, 0, SLICES[2])] * 2, ran[1]
    if cache:
        cached = [r for r in recs if r["type"] == "cache"]
        assert [r["rows_written"] for r in cached if r["phase_caches"]] == [2 * B], cached  # phase 2's 8 rows
    trans = [r for r in recs if r["type"] == "transition"]
    assert [(t["step"], t["from_phase"], t["to_phase"]) for t in trans] == [(2, 0, 1), (4, 1, 2)]
    # K=2 -> K=1, D=2: each rank receives the other's layers with their optimizer state (moved, not reset);
    # K=1, D=2 -> K=2: both ranks already hold everything, nothing moves
    assert trans[0]["bytes"]["optimizer_state"] > 0 and trans[0]["bytes"]["weights"] > 0
    assert trans[1]["bytes"] == {"weights": 0, "optimizer_state": 0}


def test_executor_checks_accept_sliced_phases_and_refuse_broken_ones():
    """What `ptplan run --dry-run` runs (validate.check_plan): a sliced plan passes; stored actions that are not
    TeraPipe's, a model of another sequence length, and slices the plan reader refuses fail with the fix."""
    model = _build("gpt2-tiny")
    plan = _plan(model)
    check_plan(plan, model, 2)
    bad = dataclasses.replace(plan.phases[0], actions=tuple(
        " ".join(map(str, a)) for a in terapipe(2, 2, 3).actions))
    with pytest.raises(PtplanError, match="action lists differ"):
        check_plan(dataclasses.replace(plan, phases=(bad, *plan.phases[1:])), model, 2)
    with pytest.raises(PtplanError, match="sequences of 32"):
        check_plan(plan, build_model("gpt2-tiny", granularity="half", seq_len=32, dropout=0.0, seed=SEED), 2)
    obj = plan.to_json()
    obj["phases"][0]["slices"] = [10, 7, 5, 3]
    with pytest.raises(SchemaError, match="sum to 25 tokens"):
        plan_from_json(obj)
    obj["phases"][0]["slices"] = [24]
    with pytest.raises(SchemaError, match="at least 2"):
        plan_from_json(obj)
    obj["phases"][0]["slices"] = [12, 0, 12]
    with pytest.raises(SchemaError, match=">= 1"):
        plan_from_json(obj)
    bert = build_model("bert-tiny", granularity="half", seq_len=SEQ, dropout=0.0, seed=SEED)
    obj = make_plan(bert, [spec(0, K=2, D=1, M=2, b=2)], schedule="gpipe").to_json()
    obj["phases"][0]["slices"] = [12, 12]
    with pytest.raises(SchemaError, match="causal LMs"):
        plan_from_json(obj)


def test_ptplan_run_dry_run_checks_token_sliced_phases(tmp_path):
    """`ptplan run --dry-run` of a plan with token-sliced phases passes; with a sliced phase's action lists
    edited it exits 2 before launching, naming the phase and the fix (the plan reader every command shares
    refuses it: ``plan_checks``)."""
    from click.testing import CliRunner

    from ptplan.cli.main import cli
    from ptplan.planner.plan import save_plan

    plan = _plan(_build("gpt2-tiny"))
    save_plan(plan, tmp_path / "plan.json")
    args = ["run", str(tmp_path / "plan.json"), "--model", "gpt2-tiny", "--nproc-per-node", "2", "--dry-run"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    obj = plan.to_json()
    obj["phases"][2]["actions"] = [" ".join(map(str, a)) for a in terapipe(2, 2, 3).actions]
    (tmp_path / "plan.json").write_text(json.dumps(obj))
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and "field 'phases[2].actions'" in r.output and "action lists differ" in r.output \
        and "Re-run `ptplan plan`" in r.output and r.output.count("\n") == 1, r.output
