"""Multi-process runs that go wrong or stop: refusal before training, a dying rank, kill and resume, adaptive freezing."""
from __future__ import annotations

import os

import pytest
import torch

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.planner.freeze import next_frozen


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield

pytestmark = pytest.mark.multiproc

SEQ, N = 8, 64


def _bert():
    return build_model("bert-tiny", seq_len=SEQ, dropout=0.0, seed=0)


def _three_phase_plan(model, schedule="gpipe"):
    return make_plan(model, [spec(0, K=4, D=1, M=4, b=2), spec(1, K=2, D=2, M=2, b=2), spec(2, K=1, D=4, M=2, b=1)],
                     trajectory=[0, 1, 2], schedule=schedule)


def _data(model):
    return TensorDataset(*model.make_batch(N, generator=torch.Generator().manual_seed(1)))


def _cfg(tmp, **kw):
    base = dict(plan="(test)", model="bert-tiny", optimizer="adamw", lr=1e-3, freeze_every=2, steps_per_epoch=6,
                epochs=1, progress=False, timeout_s=30, log=os.path.join(tmp, "run.jsonl"))
    return RunConfig(**{**base, **kw})


def test_world_size_mismatch_refused_before_any_collective(tmp_path):
    model = _bert()
    plan = _three_phase_plan(model)  # needs 4 processes
    cfg = _cfg(str(tmp_path))

    def worker(rank, world):
        run_training(cfg, plan, model, _data(model))

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.exitcodes == (1, 1)
    for err in res.errors:
        assert "PtplanError: the plan needs K*D = 4*1 = 4 processes but this job has 2" in err
    assert not os.path.exists(cfg.log)  # nothing trained, nothing logged
    assert res.seconds < 30  # before the 30 s collective timeout: no rank waited on a collective


def test_model_mismatch_refused_before_any_collective(tmp_path):
    plan = make_plan(_bert(), [spec(0, K=1, D=2, M=1, b=2)])
    vit = build_model("vit-tiny", dropout=0.0)
    cfg = _cfg(str(tmp_path), model="vit-tiny")

    def worker(rank, world):
        run_training(cfg, plan, vit, _data(vit))

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.exitcodes == (1, 1)
    assert all("the plan is for bert-tiny" in e and "vit-tiny" in e for e in res.errors)


def test_a_dead_rank_makes_the_job_fail_not_hang(tmp_path):
    model = _bert()
    plan = _three_phase_plan(model, "1f1b")
    cfg = _cfg(str(tmp_path), timeout_s=20)

    def die(step, rank):
        if rank == 2 and step == 3:  # inside phase 1 (K=2, D=2), between two steps
            os._exit(7)

    def worker(rank, world):
        run_training(cfg, plan, model, _data(model), hooks=Hooks(after_step=die))

    res = run_world(4, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=90)
    assert res.exitcodes[2] == 7
    assert None not in res.exitcodes, f"ranks still running at the deadline: {res.exitcodes}"
    assert all(c != 0 for c in res.exitcodes), res.exitcodes
    assert res.seconds < 60


def _final_weights(tmp, cfg, plan, model, data, after_step=None):
    def worker(rank, world):
        def save(event, step, weights):
            if event == "final":
                torch.save(weights, os.path.join(tmp, "final.pt"))

        run_training(cfg, plan, model, data, hooks=Hooks(snapshots=True, on_snapshot=save, after_step=after_step))

    return run_world(4, worker, tmpdir=tmp, timeout_s=30, deadline_s=120)


def test_killed_job_resumes_from_checkpoint_to_the_same_weights(tmp_path):
    model = _bert()
    plan = _three_phase_plan(model, "1f1b")
    data = _data(model)
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full_dir.mkdir()
    cut_dir.mkdir()
    # Uninterrupted run (AdamW: its moments must survive the kill).
    res = _final_weights(str(full_dir), _cfg(str(full_dir)), plan, model, data)
    assert res.ok, res.explain()
    want = torch.load(full_dir / "final.pt")

    # The same run, killed (every rank) after 3 steps: a transition happened after 2, a checkpoint after 3.
    ck = str(cut_dir / "ck")
    cfg = _cfg(str(cut_dir), checkpoint_dir=ck, checkpoint_every=1)

    def kill(step, rank):
        if step == 3:
            os._exit(9)

    res = _final_weights(str(cut_dir), cfg, plan, model, data, after_step=kill)
    assert res.exitcodes == (9, 9, 9, 9), res.explain()
    assert os.path.exists(os.path.join(ck, "checkpoint.pt"))
    assert not [f for f in os.listdir(ck) if ".tmp." in f]  # written atomically

    res = _final_weights(str(cut_dir), _cfg(str(cut_dir), checkpoint_dir=ck, checkpoint_every=1, resume=True),
                         plan, model, data)
    assert res.ok, res.explain()
    got = torch.load(cut_dir / "final.pt")
    for k in want:
        assert torch.equal(got[k], want[k]), k
    recs = read_records(cfg.log)
    steps = [r["step"] for r in recs if r["type"] == "step"]
    assert steps == [0, 1, 2, 3, 4, 5], steps  # the log is appended to, each step once
    resume = [r for r in recs if r["type"] == "resume"]
    assert len(resume) == 1 and resume[0]["step"] == 3 and resume[0]["phase"] == 1


def test_adaptive_freezing_follows_the_gradient_norm_rule(tmp_path):
    model = _bert()
    # A phase for every count 0..4 (L = 4), alpha = 1/2: from f the bound is ceil(f + (4 - f) / 2).
    plan = make_plan(model, [spec(0, K=4, D=1, M=4, b=2), spec(1, K=2, D=2, M=2, b=2), spec(2, K=2, D=2, M=2, b=2),
                             spec(3, K=1, D=4, M=2, b=1), spec(4, K=1, D=4, M=2, b=1)], trajectory=[0])
    cfg = _cfg(str(tmp_path), freeze="adaptive", alpha=0.5, freeze_every=2, steps_per_epoch=8)
    data = _data(model)

    def worker(rank, world):
        run_training(cfg, plan, model, data)

    res = run_world(4, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=120)
    assert res.ok, res.explain()
    recs = read_records(cfg.log)
    decisions = [r for r in recs if r["type"] == "freeze_decision"]
    assert [d["step"] for d in decisions] == [2, 4, 6]
    for d in decisions:
        norms = d["grad_norms"]
        assert len(norms) == 4 and d["steps_measured"] == 2
        assert all(n > 0 for n in norms[d["from_frozen"]:])  # every active block measured
        assert d["to_frozen"] == next_frozen(d["from_frozen"], 4, 0.5, norms)
    counts = [r["frozen_blocks"] for r in recs if r["type"] == "step"]
    assert counts == sorted(counts) and counts[-1] > 0
    assert len([r for r in recs if r["type"] == "transition"]) >= 1
