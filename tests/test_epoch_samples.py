"""A run trains the epoch its plan priced: a data file longer than the plan's samples per epoch gives each epoch
its first N samples (the plan's steps and AutoCache rows), a shorter one gives shorter epochs, each with a note.

Found by an audit: ``ptplan plan --data F --samples-per-epoch 1000`` on a file of 5,000 samples priced 31 steps
per epoch and 35 MB of AutoCache rows, and the run took 156 steps per epoch and needed 164 MB (it read the whole
file, in two places: the launcher's checks and each worker).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.job import epoch_samples, epoch_samples_note, file_dataset
from ptplan.executor.training.runlog import read_records
from ptplan.planner.plan import save_plan


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """bert-tiny (seq 8), one process, global batch 4; the plan prices 16 samples per epoch; files of 24 and 8."""
    d = tmp_path_factory.mktemp("epoch")
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=1, M=2, b=2)], trajectory=[0, 0], samples_per_epoch=16, optimizer="sgd")
    save_plan(plan, d / "plan.json")
    for n in (24, 8):
        x, y, m = model.make_batch(n, generator=torch.Generator().manual_seed(n))
        torch.save({"inputs": x, "labels": y, "attention_mask": m}, d / f"data{n}.pt")
    return d, plan


def test_the_epoch_is_the_plans_where_the_file_holds_more(files):
    d, plan = files
    cfg = RunConfig(plan=str(d / "plan.json"), model="bert-tiny", data=str(d / "data24.pt"))
    assert epoch_samples(plan, cfg, 24) == 16 and epoch_samples(plan, cfg, 8) == 8
    full = torch.load(d / "data24.pt")
    ds = file_dataset(plan, cfg)
    assert len(ds) == 16 and torch.equal(ds.inputs, full["inputs"][:16]) and torch.equal(ds.labels, full["labels"][:16])
    assert "each epoch trains the first 16" in epoch_samples_note(plan, cfg, 24, "--data x")
    assert "epochs are shorter than planned" in epoch_samples_note(plan, cfg, 8, "--data x")
    assert epoch_samples_note(plan, cfg, 16, "--data x") is None
    stepped = RunConfig(plan=str(d / "plan.json"), model="bert-tiny", data=str(d / "data24.pt"), steps_per_epoch=2)
    assert epoch_samples(plan, stepped, 24) == 24 and epoch_samples_note(plan, stepped, 24, "x") is None


def test_the_launcher_says_so(files):
    d, _ = files
    r = CliRunner().invoke(cli, ["run", str(d / "plan.json"), "--model", "bert-tiny", "--nproc-per-node", "1",
                                 "--data", str(d / "data24.pt"), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "note: --data" in r.output and "has 24 samples and the plan priced 16 per epoch" in r.output


def test_a_run_steps_through_the_plans_epoch(files, tmp_path):
    d, _ = files
    log = tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "ptplan.cli.main", "run", str(d / "plan.json"), "--model", "bert-tiny",
           "--nproc-per-node", "1", "--data", str(d / "data24.pt"), "--epochs", "2", "--optimizer", "sgd", "--lr",
           "0.05", "--dropout", "0", "--device", "cpu", "--log", str(log), "--timeout", "60", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = [s for s in read_records(log) if s["type"] == "step"]
    assert [sum(s["epoch"] == e for s in steps) for e in (0, 1)] == [4, 4]  # 16 samples / 4 per step, not 24 / 4
