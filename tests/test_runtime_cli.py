"""``ptplan run``: refusals before launching, the torchrun command, and one real 2-process torchrun run."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
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
                     samples_per_epoch=16, optimizer="sgd")  # the runs' --optimizer
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
    assert "-m ptplan.executor.launch.worker --config" in r.output
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "1",
                                 "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
                                 "--rdzv-endpoint", "host:29400", "--rdzv-id", "j1", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "--standalone" not in r.output
    for flag in ("--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=host:29400", "--rdzv-id=j1"):
        assert flag in r.output


def test_a_plan_for_several_nodes_run_on_one_says_so(tmp_path):
    """A plan for the paper's 2 x 8 cluster launched as 1 node x 16 processes with no word (a CLI audit)."""
    r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "paper", "--epochs", "2", "--out",
                                 str(tmp_path / "paper.json"), "--quiet"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "paper.json"), "--dry-run"])
    assert r.exit_code == 0 and "--nproc-per-node=16 --nnodes=1" in r.output, r.output
    assert "note: the plan is for 2 nodes x 8 (paper); this job runs all 16 processes on this machine" in r.output


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


# ---- paths, precision (issue 12) ------------------------------------------------------------------

def _worker_config(output: str) -> dict:
    """The RunConfig JSON the dry run would hand every worker (``--config``)."""
    import json
    import shlex

    words = shlex.split(output.strip().splitlines()[-1])
    return json.loads(words[words.index("--config") + 1])


def test_paths_reach_the_workers_absolute(plan_file, tmp_path, monkeypatch):
    from ptplan.executor.training.export import hf_model

    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    (tmp_path / "in").mkdir()
    hf_model(model, {k: v.detach() for k, v in model.named_parameters()}).save_pretrained(tmp_path / "in" / "bert-tiny")
    x, y, m = model.make_batch(16, generator=torch.Generator().manual_seed(7))
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, tmp_path / "in" / "train.pt")
    torch.save({"inputs": x[:6], "labels": y[:6], "attention_mask": m[:6]}, tmp_path / "in" / "held.pt")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "2", "--dry-run",
                                 "--weights", "in/bert-tiny", "--data", "in/train.pt", "--eval-data", "in/held.pt",
                                 "--export", "exported", "--export-best", "--checkpoint-dir", "ck",
                                 "--save-model-every", "2", "--log", "logs/run.jsonl", "--precision", "bf16"])
    assert r.exit_code == 0, r.output
    cfg = _worker_config(r.output)
    want = {"weights": "in/bert-tiny", "data": "in/train.pt", "eval_data": "in/held.pt", "export": "exported",
            "checkpoint_dir": "ck", "save_model_dir": "ck", "log": "logs/run.jsonl"}
    assert {k: cfg[k] for k in want} == {k: str(tmp_path / v) for k, v in want.items()}
    assert cfg["precision"] == "bf16" and cfg["export_best"] is True and cfg["save_model_every"] == 2
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "2", "--dry-run"])
    assert _worker_config(r.output)["data"] == "synthetic"
    r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "in/bert-tiny", "--nproc-per-node", "2", "--dry-run"])
    assert r.exit_code == 0, r.output  # a local model folder reaches the workers absolute too
    assert _worker_config(r.output)["model"] == str(tmp_path / "in" / "bert-tiny")
    for args, msg in ((["--weights", "in/nope"], "--weights"), (["--data", "nope.pt"], "no such file"),
                      (["--export-best"], "--export-best needs --export DIR"),
                      (["--save-model-every", "2"], "--save-model-every needs a folder")):
        r = CliRunner().invoke(cli, ["run", str(plan_file), "--model", "bert-tiny", "--nproc-per-node", "2",
                                     "--dry-run", *args])
        assert r.exit_code == 2 and msg in r.output and r.output.count("\n") == 1, r.output


def _reference(name: str, data, *, bf16: bool, lr: float = 0.05):
    """One process: the run's 4 steps (epoch 0's order, 2 micro-batches of 2, block 0 frozen after step 2), SGD;
    forward under CPU bfloat16 autocast when ``bf16``. Returns (final weights, losses)."""
    import contextlib

    model = build_model(name, seq_len=8, dropout=0.0, seed=0)
    model.train()
    opt = torch.optim.SGD(list(model.parameters()), lr=lr, momentum=0.9)
    x, y, m = data
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0 * 7919 + 0))
    losses = []
    for t in range(4):
        if t == 2:
            first = next(i for i, s in enumerate(model.specs) if s.block is not None and s.block >= 1)
            for i, layer in enumerate(model.layers):
                for p in layer.parameters():
                    p.requires_grad_(i >= first)
        ids = order[4 * t:4 * t + 4]
        opt.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            loss = sum(model.loss(model(a, attention_mask=c), b)
                       for a, b, c in zip(x[ids].chunk(2), y[ids].chunk(2), m[ids].chunk(2))) / 2
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.named_parameters()}, losses


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["bert-tiny", "llama-tiny"])
def test_bf16_autocast_run_matches_a_single_process_autocast_reference(name, tmp_path):
    import math

    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.data.dataset import TensorDataset
    from ptplan.executor.launch.local import run_world
    from parity import max_rel_diff
    from ptplan.executor.training.loop import Hooks, run_training

    model = build_model(name, seq_len=8, dropout=0.0, seed=0)
    plan = make_plan(model, [spec(0, K=2, D=1, M=2, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1])
    data = model.make_batch(16, generator=torch.Generator().manual_seed(3))
    cfg = RunConfig(plan="(test)", model=name, optimizer="sgd", lr=0.05, seed=0, freeze_every=2, steps_per_epoch=4,
                    epochs=1, progress=False, timeout_s=60, log=str(tmp_path / "run.jsonl"), precision="bf16")

    def worker(rank: int, world: int) -> None:
        def save(event, step, weights):
            if event == "final":
                torch.save(weights, tmp_path / "final.pt")

        seen = set()
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_hook(lambda m, i, o: seen.add(str(o.dtype)))
        run_training(cfg, plan, model, TensorDataset(*data), hooks=Hooks(snapshots=True, on_snapshot=save))
        (tmp_path / f"dtypes{rank}.txt").write_text(",".join(sorted(seen)))

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    assert [(tmp_path / f"dtypes{r}.txt").read_text() for r in (0, 1)] == ["torch.bfloat16"] * 2  # every matmul
    final = torch.load(tmp_path / "final.pt")
    assert all(v.dtype == torch.float32 for v in final.values())  # master weights stay float32
    ref, ref_losses = _reference(name, data, bf16=True)
    fp32, fp32_losses = _reference(name, data, bf16=False)
    losses = [r["loss"] for r in read_records(tmp_path / "run.jsonl") if r["type"] == "step"]
    # Step 0 starts from the same weights: the loss is the autocast reference's, not float32's.
    assert abs(losses[0] - ref_losses[0]) <= 1e-6 * abs(ref_losses[0]) < abs(losses[0] - fp32_losses[0]) / 10, \
        (losses[0], ref_losses[0], fp32_losses[0])
    # Later steps: one bfloat16 rounding of a weight that differs in its last float32 bit (summation order) can
    # change, so the run follows the reference within bfloat16's resolution, not bit for bit.
    assert all(math.isclose(a, b, rel_tol=5e-4) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    d, where = max_rel_diff(final, ref)
    start = {k: v.detach() for k, v in build_model(name, seq_len=8, dropout=0.0, seed=0).named_parameters()}
    dist = sum(((final[k] - ref[k]).double() ** 2).sum() for k in ref).sqrt()
    update = sum(((ref[k] - start[k]).double() ** 2).sum() for k in ref).sqrt()
    print(f"bf16 {name}: step-0 loss {losses[0]:.7f} (autocast reference {ref_losses[0]:.7f}, fp32 "
          f"{fp32_losses[0]:.7f}); final weights: max relative difference {d:.1e}, distance {dist / update:.1e} "
          f"of the update")
    assert d <= 3e-2 and dist <= 0.02 * update, (d, where, float(dist / update))




def test_run_one_node_resume_continues_the_latest_run_folder(plan_file, tmp_path):
    """examples/run_one_node.sh made a new runs/<time> folder on every start, so its documented --resume looked for
    a checkpoint in the empty new folder and could never resume (an executor audit). It now continues the latest
    run folder; here both are empty, so ptplan run's own check names the latest one's checkpoint."""
    import os
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "run_one_node.sh"
    for name in ("20260101-000000", "20260102-000000"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    env = {**os.environ, "PLAN": str(plan_file), "MODEL": "bert-tiny", "NPROC": "2"}
    r = subprocess.run(["bash", str(script), "--resume", "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "resuming runs/20260102-000000" in r.stderr
    assert "runs/20260102-000000/ckpt/checkpoint.pt; run without --resume" in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path / "runs")) == ["20260101-000000", "20260102-000000"]  # no new folder
    (tmp_path / "none").mkdir()  # no runs/ at all: the script's own message (set -o pipefail once hid it)
    r = subprocess.run(["bash", str(script), "--resume", "--dry-run"], cwd=tmp_path / "none", env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--resume but no run folder in runs/; give OUT=" in r.stderr, r.stderr


def test_another_label_count_than_the_profiles_is_named(tmp_path):
    """`ptplan run k2.json --num-labels 5` said "pass --model bert-tiny" though bert-tiny was the model (a CLI
    audit): the message now names the first layer that differs (the head) and the fix for the same model."""
    r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "cpu:2", "-K", "2", "--epochs", "2",
                                 "--samples-per-epoch", "256", "--batch", "32", "--out", str(tmp_path / "k2.json"),
                                 "--quiet"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "k2.json"), "--num-labels", "5", "--dry-run"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "first difference: layer 10 (head): 130 parameters in the profile, 325 in the model" in r.output
    assert "run bert-tiny as it was profiled (the same --num-labels" in r.output and "pass --model" not in r.output
