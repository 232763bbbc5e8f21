"""Resume paths found by a review of the rank-agreement change (2026-11-27), each in real processes.

- rank 0's first write of a resumed run (its ``resume`` record) on a full disk: raised on rank 0 alone before;
- a run-log folder that cannot be made (the in-process API): an OSError on rank 0 alone before;
- a checkpoint of a run with the default optimizer (``plan``) checked by ``start_phase``: compared the literal
  ``plan`` with the checkpoint's ``adamw`` before;
- a bf16 checkpoint resumed in float32 on a rank that cannot read the file: the source sent bf16 bytes into float32
  buffers (other message sizes; gloo filled the weights with garbage and the loss was nan)."""
from __future__ import annotations

import math
import shutil

import torch

from ptplan.executor.data.dataset import SyntheticDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.loop import run_training, start_phase
from ptplan.executor.training.runlog import RunLog
from ptplan.planner.errors import PtplanError
from tests.test_rank_agreement import _both_refuse

BASE = dict(plan="(test)", model="bert-tiny", steps_per_epoch=1, progress=False, timeout_s=20)


def _first(tmp_path, plan, model, **kw):
    def worker(rank: int, world: int) -> None:
        run_training(RunConfig(**{**BASE, "epochs": 1, **kw}), plan, model, SyntheticDataset(model, 8))
    res = run_world(plan.phases[0].K * plan.phases[0].D, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120)
    assert res.ok, res.explain()


def test_a_full_disk_at_the_resume_record_stops_every_rank(tmp_path):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=2, M=1, b=2)], trajectory=[0], samples_per_epoch=8)
    kw = dict(checkpoint_dir=str(tmp_path / "ck"), log=str(tmp_path / "run.jsonl"))
    _first(tmp_path, plan, model, **kw)

    def worker(rank: int, world: int) -> None:
        if rank == 0:
            def full(self, line):
                raise PtplanError(f"cannot write the run log {self.path}: No space left on device (the disk is full)")
            RunLog._append = full  # this forked child only
        run_training(RunConfig(**BASE, epochs=2, resume=True, **kw), plan, model, SyntheticDataset(model, 8))

    _both_refuse(run_world(2, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120), "cannot write the run log")


def test_a_run_log_folder_that_cannot_be_made_is_refused_on_every_rank(tmp_path):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=2, M=1, b=2)], trajectory=[0], samples_per_epoch=8)
    (tmp_path / "file").write_text("x")
    cfg = RunConfig(**BASE, epochs=1, log=str(tmp_path / "file" / "run.jsonl"))

    def worker(rank: int, world: int) -> None:
        run_training(cfg, plan, model, SyntheticDataset(model, 8))

    _both_refuse(run_world(2, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120), "cannot open the run log")


def test_start_phase_checks_a_checkpoint_against_the_plans_optimizer(tmp_path):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=1, M=1, b=2)], trajectory=[0], samples_per_epoch=8)
    ck = str(tmp_path / "ck")
    _first(tmp_path, plan, model, checkpoint_dir=ck)  # optimizer and rate left to the plan

    def worker(rank: int, world: int) -> None:
        assert start_phase(RunConfig(**BASE, resume=True, checkpoint_dir=ck), plan, model_name=model.name,
                           samples=8) == 0

    res = run_world(1, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120)
    assert res.ok, res.explain()


def test_a_bf16_checkpoint_resumed_in_float32_sends_what_the_file_reads(tmp_path):
    """Rank 1 cannot read rank 0's file, so rank 0 sends it its stage. Resumed in float32, that run ends with the
    same loss as the run in which both ranks read the file (each converting by ``copy_``)."""
    mb = build_model("bert-tiny", seq_len=8, dropout=0.0, dtype=torch.bfloat16)
    plan = make_plan(mb, [spec(0, K=2, D=1, M=1, b=2)], trajectory=[0], samples_per_epoch=8)
    a = tmp_path / "A"
    _first(tmp_path, plan, mb, dtype="bfloat16", checkpoint_dir=str(a), optimizer="sgd", lr=1e-3)
    losses = {}
    for name, other in (("read", "read"), ("sent", "empty")):
        mine = tmp_path / f"{name}-0"
        shutil.copytree(a, mine)
        (tmp_path / f"{name}-1").mkdir()
        out = tmp_path / f"{name}.loss"

        def worker(rank: int, world: int) -> None:
            model = build_model("bert-tiny", seq_len=8, dropout=0.0)  # float32 (--precision fp32 on a bf16 plan)
            folder = mine if rank == 0 or other == "read" else tmp_path / f"{name}-1"
            s = run_training(RunConfig(**BASE, epochs=2, dtype="float32", resume=True, checkpoint_dir=str(folder),
                                       optimizer="sgd", lr=1e-3), plan, model, SyntheticDataset(model, 8))
            if rank == 0:
                out.write_text(repr(s.final_loss))

        res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120)
        assert res.ok, res.explain()
        losses[name] = float(out.read_text())
    assert math.isfinite(losses["read"]) and losses["sent"] == losses["read"], losses
