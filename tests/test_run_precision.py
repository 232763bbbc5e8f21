"""``ptplan run --precision``: by default the run trains the model the plan priced, in its profile's dtype.

Found on a lent H100: a plan made from a bf16 profile ran float32 weights (the old default), so the run's
parameters, gradients and optimizer state took 2.00x the plan's bytes and ``ptplan compare`` measured another model."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.training.runlog import read_records
from ptplan.planner.plan import save_plan


def _plan(tmp_path, dtype):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0, dtype=dtype)
    plan = make_plan(model, [spec(0, K=1, D=1, M=2, b=2)], trajectory=[0], samples_per_epoch=8)
    path = tmp_path / f"plan-{dtype}.json".replace("torch.", "")
    save_plan(plan, path)
    return path


def _dry_run(plan, *args):
    """(the workers' config, the output) of ``ptplan run PLAN --dry-run``."""
    r = CliRunner().invoke(cli, ["run", str(plan), "--model", "bert-tiny", "--nproc-per-node", "1", "--dry-run", *args])
    assert r.exit_code == 0, r.output
    words = shlex.split(r.output.strip().splitlines()[-1])
    return json.loads(words[words.index("--config") + 1]), r.output


def _config(plan, *args):
    cfg, _ = _dry_run(plan, *args)
    return cfg["dtype"], cfg["precision"]


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float32, "float32")])
def test_the_default_trains_in_the_plans_dtype_and_the_flags_say_otherwise(tmp_path, dtype, name):
    plan = _plan(tmp_path, dtype)
    assert _config(plan) == (name, "fp32")  # --precision plan: the profile's dtype, no autocast
    assert _config(plan, "--precision", "fp32") == ("float32", "fp32")
    assert _config(plan, "--precision", "bf16") == ("float32", "bf16")  # float32 master weights, autocast


def test_a_bf16_plan_runs_bf16_weights_and_its_memory_is_the_plans(tmp_path):
    plan = _plan(tmp_path, torch.bfloat16)
    log = tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "ptplan.cli.main", "run", str(plan), "--model", "bert-tiny", "--nproc-per-node", "1",
           "--steps-per-epoch", "2", "--epochs", "1", "--optimizer", "sgd", "--lr", "0.05", "--device", "cpu",
           "--log", str(log), "--timeout", "60", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    model = build_model("bert-tiny", seq_len=8, dropout=0.0, dtype=torch.bfloat16)
    want = sum(p.numel() * 2 for p in model.parameters())  # bfloat16: 2 bytes a parameter
    sampled = [s for s in read_records(log) if s["type"] == "step" and s.get("memory")]
    assert sampled, "no memory-sampled step"
    assert sampled[0]["memory"]["per_rank"][0]["params"] == want


def _optimizer_config(plan, *args):
    cfg, out = _dry_run(plan, *args)
    return cfg["optimizer"], cfg["lr"], out


def test_the_default_optimizer_is_the_one_the_plan_priced(tmp_path):
    """A plan priced with SGD's optimizer state (one value per parameter) runs SGD unless told otherwise, and a run
    told otherwise says the plan's memory is not its memory (before, --optimizer defaulted to adamw whatever the plan
    priced: 2x the plan's optimizer-state bytes)."""
    from dataclasses import replace

    from ptplan.planner.plan import load_plan

    plan = load_plan(_plan(tmp_path, torch.float32))
    sgd = tmp_path / "plan-sgd.json"
    save_plan(replace(plan, inputs=replace(plan.inputs, training=replace(plan.inputs.training, optimizer="sgd"))), sgd)
    opt, lr, out = _optimizer_config(sgd)
    assert (opt, lr) == ("sgd", 0.01) and "note:" not in out
    assert _optimizer_config(sgd, "--momentum", "0.5")[0] == "sgd"  # SGD's flag applies to the plan's SGD
    opt, lr, out = _optimizer_config(sgd, "--optimizer", "adamw")
    assert (opt, lr) == ("adamw", 5e-5) and "the plan priced sgd's optimizer state (1 value(s)" in out
    assert _optimizer_config(_plan(tmp_path, torch.float32))[:2] == ("adamw", 5e-5)


def test_the_in_process_api_takes_the_same_defaults_as_ptplan_run(tmp_path):
    """``RunConfig`` left the optimizer to ``adamw`` and the learning rate to 1e-3 while ``ptplan run`` took the
    plan's optimizer and 5e-5 / 0.01: two homes for one default. Now both go through ``RunConfig.resolved``; for each
    plan and flag set the dry run's config equals the API's resolved one, and ``run_training`` logs the same rate."""
    from dataclasses import replace

    from ptplan.executor.training.config import DEFAULT_LR, RunConfig
    from ptplan.planner.plan import load_plan

    adamw = _plan(tmp_path, torch.float32)
    plan = load_plan(adamw)
    sgd = tmp_path / "plan-sgd.json"
    save_plan(replace(plan, inputs=replace(plan.inputs, training=replace(plan.inputs.training, optimizer="sgd"))), sgd)
    for path, flags, api in [(adamw, (), {}), (sgd, (), {}), (sgd, ("--optimizer", "adamw"), {"optimizer": "adamw"}),
                             (sgd, ("--lr", "0.3"), {"lr": 0.3}), (adamw, ("--optimizer", "sgd"), {"optimizer": "sgd"})]:
        got = RunConfig(plan=str(path), model="bert-tiny", **api).resolved(load_plan(path))
        assert _optimizer_config(path, *flags)[:2] == (got.optimizer, got.lr), (path.name, flags)
        assert got.resolved(load_plan(path)) is got  # resolved once is resolved
    assert RunConfig(plan="p", model="m").resolved(load_plan(sgd)).lr == DEFAULT_LR["sgd"] == 0.01
    import re

    help_text = next(p.help for p in cli.commands["run"].params if p.name == "lr")
    said = re.search(r"default: ([0-9.e-]+) with AdamW.*, ([0-9.e-]+) with SGD", help_text)
    assert said and (float(said[1]), float(said[2])) == (DEFAULT_LR["adamw"], DEFAULT_LR["sgd"]), help_text


def test_run_training_resolves_the_config_it_is_given(tmp_path):
    """A real one-process run of a config that names neither optimizer nor rate: the run log's header records the
    plan's optimizer and its default rate."""
    from ptplan.executor.data.dataset import SyntheticDataset
    from ptplan.executor.launch.local import run_world
    from ptplan.executor.training.config import DEFAULT_LR, RunConfig
    from ptplan.executor.training.loop import run_training
    from ptplan.planner.plan import load_plan

    path = _plan(tmp_path, torch.float32)
    log = tmp_path / "run.jsonl"
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    cfg = RunConfig(plan=str(path), model="bert-tiny", epochs=1, steps_per_epoch=1, progress=False, timeout_s=60,
                    log=str(log))

    def worker(rank: int, world: int) -> None:
        run_training(cfg, load_plan(path), model, SyntheticDataset(model, 8))

    res = run_world(1, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    head = next(r for r in read_records(log) if r["type"] == "header")
    assert (head["optimizer"], head["lr"]) == ("adamw", DEFAULT_LR["adamw"])
