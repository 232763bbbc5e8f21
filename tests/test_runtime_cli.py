"""``ptplan run``: refusals before launching, the torchrun command, and one real 2-process torchrun run."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.models import build_model
from ptplan.executor.runlog import read_records
from ptplan.executor.testing import make_plan, spec
from ptplan.planner.plan import save_plan



@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield

@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """bert-tiny (seq 8): K=2,D=1 for one epoch, then one block frozen and K=1,D=2."""
    d = tmp_path_factory.mktemp("plan")
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=2, D=1, M=2, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1],
                     samples_per_epoch=16)
    path = d / "plan.json"
    save_plan(plan, path)
    return path


def test_world_size_mismatch_exits_2_before_launching(plan_file):
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "4", "--dry-run"])
    assert r.exit_code == 2, r.output
    assert "the plan needs K*D = 2*1 = 2 processes but this job has 4" in r.output
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "1",
                                 "--nnodes", "3", "--dry-run"])
    assert r.exit_code == 2 and "this job has 3" in r.output


def test_model_mismatch_exits_2_before_launching(plan_file):
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "gpt2-tiny", "--nproc-per-node", "2", "--dry-run"])
    assert r.exit_code == 2, r.output
    assert "the plan is for bert-tiny" in r.output and "gpt2-tiny" in r.output


def test_dry_run_prints_the_torchrun_command(plan_file):
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "2", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "-m torch.distributed.run" in r.output and "--standalone" in r.output
    assert "-m ptplan.executor.worker --config" in r.output
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "1",
                                 "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
                                 "--rdzv-endpoint", "host:29400", "--rdzv-id", "j1", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "--standalone" not in r.output
    for flag in ("--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=host:29400", "--rdzv-id=j1"):
        assert flag in r.output


def test_a_bad_eval_file_is_refused_before_launch(plan_file, tmp_path):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    x, y, m = model.make_batch(6, generator=torch.Generator().manual_seed(7))
    y[1] = 5  # a 2-class head
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, tmp_path / "held.pt")
    base = ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "2", "--dry-run"]
    r = CliRunner().invoke(cli, [*base, "--eval-data", str(tmp_path / "held.pt")])
    assert r.exit_code == 2 and r.output.startswith("error: --eval-data") and "2 classes" in r.output, r.output
    r = CliRunner().invoke(cli, [*base, "--eval-data", str(tmp_path / "missing.pt")])
    assert r.exit_code == 2 and "no such file" in r.output, r.output
    r = CliRunner().invoke(cli, [*base, "--eval-every", "3"])
    assert r.exit_code == 2 and "--eval-every needs --eval-data" in r.output, r.output


@pytest.mark.multiproc
@pytest.mark.slow
def test_ptplan_run_through_torchrun(plan_file, tmp_path):
    log = tmp_path / "run.jsonl"
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    x, y, m = model.make_batch(10, generator=torch.Generator().manual_seed(7))
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, tmp_path / "held.pt")
    cmd = [sys.executable, "-m", "ptplan.cli.main", "run", str(plan_file), "--model", "bert-tiny",
           "--nproc-per-node", "2", "--steps-per-epoch", "2", "--dropout", "0", "--optimizer", "sgd", "--lr", "0.05",
           "--log", str(log), "--checkpoint-dir", str(tmp_path / "ck"), "--timeout", "60", "--no-progress",
           "--eval-data", str(tmp_path / "held.pt")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ptplan run: 4 steps" in r.stdout
    assert re.search(r"held-out loss \d+\.\d{4}, accuracy \d+\.\d% on 10 samples", r.stdout), r.stdout
    evals = [rec for rec in read_records(log) if rec["type"] == "eval"]
    assert [(e["epoch"], e["step"], e["samples"]) for e in evals] == [(0, 2, 10), (1, 4, 10)]  # each epoch's end
    recs = read_records(log)
    assert recs[0]["type"] == "header" and recs[0]["world_size"] == 2
    steps = [rec for rec in recs if rec["type"] == "step"]
    assert [(s["epoch"], s["K"], s["D"]) for s in steps] == [(0, 2, 1), (0, 2, 1), (1, 1, 2), (1, 1, 2)]
    assert [t["to_phase"] for t in recs if t["type"] == "transition"] == [1]
    assert (tmp_path / "ck" / "checkpoint.pt").exists()
    # the run log is what `ptplan compare` reads
    from ptplan.planner.compare import compare, read_run_log
    from ptplan.planner.plan import load_plan

    c = compare(load_plan(plan_file), read_run_log(log))
    assert [p.phase for p in c.phases] == [0, 1] and len(c.transitions) == 1
    assert [e["step"] for e in c.evals] == [2, 4]
    r = CliRunner().invoke(cli, ["compare", str(plan_file), str(log)])
    assert r.exit_code == 0 and "held-out at step 4 (epoch 1, phase 1): loss" in r.output and "accuracy" in r.output
    r = CliRunner().invoke(cli, ["show", str(plan_file), "--run", str(log), "--out", str(tmp_path / "r.html"),
                                 "--warmup", "0"])
    assert r.exit_code == 0, r.output
    page = (tmp_path / "r.html").read_text()
    assert '<section id="evaluation"><h2>Held-out evaluation</h2>' in page and 'id="fig-evaluation"' in page


def test_an_export_folder_in_use_is_refused_before_launch(plan_file, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "2", "--dry-run",
                                 "--export", str(tmp_path / "out")])
    assert r.exit_code == 2 and "exists and is not an empty folder" in r.output, r.output
