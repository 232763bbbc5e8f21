"""Restarts (issue 11, item 7): the resume decision is agreed by every rank, wherever the checkpoint is.

Each rank looks at its own checkpoint folder; the ranks resume from the newest usable checkpoint any
of them holds (``training._find_checkpoint``), so a job needs no shared file system and a restart that
gives rank 0 another node still finds it. Pinned twice: in forked processes with a different folder
per rank, and with two real launchers on loopback (two simulated nodes, c10d rendezvous,
``--max-restarts 1``) whose rank 1 is killed mid-run: the job ends with exit 0 and the same weights
and optimizer state as an uninterrupted run.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from ptplan.executor.training.checkpoint import load_checkpoint
from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.training.job import build_for_plan, make_dataset, with_plan_num_labels
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import read_records
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.planner.plan import load_plan, save_plan

pytestmark = pytest.mark.multiproc


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _plan(model):
    return make_plan(model, [spec(0, K=2, D=1, M=2, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1],
                     samples_per_epoch=16)


def _world_run(tmp, cfg_of, plan, model, data, *, restarted=False, after_step=None):
    """Train on 2 forked ranks; ``cfg_of(rank)`` gives each rank its config. Returns (result, final weights)."""
    out = os.path.join(tmp, f"final-{time.monotonic_ns()}.pt")

    def worker(rank, world):
        if restarted:
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"

        def save(event, step, weights):
            if event == "final":
                torch.save(weights, out)

        run_training(cfg_of(rank), plan, model, data,
                     hooks=Hooks(snapshots=True, on_snapshot=save, after_step=after_step))

    res = run_world(2, worker, tmpdir=tmp, timeout_s=30, deadline_s=120)
    return res, (torch.load(out) if res.ok else None)


def test_ranks_agree_to_resume_from_the_newest_checkpoint_any_rank_holds(tmp_path):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0, seed=0)
    plan = _plan(model)
    data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
    tmp = str(tmp_path)

    def cfg(rank=0, **kw):
        base = dict(plan="(test)", model="bert-tiny", optimizer="adamw", lr=1e-3, freeze_every=4, epochs=4,
                    progress=False, timeout_s=30, log=os.path.join(tmp, f"run{rank}.jsonl"))
        return RunConfig(**{**base, **kw})

    res, want = _world_run(tmp, lambda r: cfg(r, log=os.path.join(tmp, "ref.jsonl")), plan, model, data)
    assert res.ok, res.explain()

    def kill(step, rank):
        if step == 7:
            os._exit(9)

    first = tmp_path / "first"
    res, _ = _world_run(tmp, lambda r: cfg(r, checkpoint_dir=str(first), checkpoint_every=2), plan, model, data,
                        after_step=kill)
    assert res.exitcodes == (9, 9)
    # rank 1's node kept the checkpoint (step 6); rank 0's folder holds an older one of another plan
    (tmp_path / "node1").mkdir()
    shutil.move(str(first / "checkpoint.pt"), tmp_path / "node1" / "checkpoint.pt")
    other = make_plan(model, [spec(0, K=1, D=2, M=1, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1],
                      samples_per_epoch=16)
    res, _ = _world_run(tmp, lambda r: cfg(r, checkpoint_dir=str(tmp_path / "node0"), checkpoint_every=2, epochs=1,
                                           log=os.path.join(tmp, "other.jsonl")), other, model, data)
    assert res.ok, res.explain()

    res, got = _world_run(tmp, lambda r: cfg(r, checkpoint_dir=str(tmp_path / f"node{r}")), plan, model, data,
                          restarted=True)  # a torchrun restart: no --resume flag, every rank asks
    assert res.ok, res.explain()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    resume = [r for r in read_records(os.path.join(tmp, "run0.jsonl")) if r["type"] == "resume"]
    assert [(r["step"], r["source_rank"], r["attempt"]) for r in resume] == [(6, 1, 1)]


def test_resume_without_a_usable_checkpoint_fails_alike_on_every_rank(tmp_path):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0, seed=0)
    plan = _plan(model)
    data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "checkpoint.pt").write_bytes(b"PK\x03\x04 not really a zip")

    def worker(rank, world):
        ck = str(tmp_path / ("bad" if rank == 1 else "none"))
        run_training(RunConfig(plan="(test)", model="bert-tiny", epochs=1, progress=False, timeout_s=30,
                               checkpoint_dir=ck, resume=True), plan, model, data)

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.exitcodes == (1, 1), res.explain()
    for e in res.errors:
        assert "PtplanError: checkpoint" in e and "bad/checkpoint.pt" in e and "cannot be read" in e
    assert res.seconds < 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_of_rank(rank: int, parents: set[int]) -> int | None:
    """The pid of the worker process with RANK=rank among the descendants of ``parents``."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except OSError:
                pass
    todo, seen = list(parents), set()
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            if c in seen:
                continue
            seen.add(c)
            todo.append(c)
            try:
                with open(f"/proc/{c}/cmdline", "rb") as f:
                    cmd = f.read()
                with open(f"/proc/{c}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if b"ptplan.executor.launch.worker" in cmd and b"torch.distributed.run" not in cmd and f"RANK={rank}".encode() in env:
                return c
    return None


@pytest.mark.slow
def test_two_launchers_restart_a_killed_rank_to_the_same_weights(tmp_path):
    """Two nodes on loopback (c10d), each with its own checkpoint folder (no shared file system)."""
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    save_plan(_plan(model), tmp_path / "plan.json")
    x, y, m = model.make_batch(16, generator=torch.Generator().manual_seed(3))
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, tmp_path / "data.pt")
    epochs, port = 12, _free_port()  # 48 steps: killed at step 16 (phase 1, checkpoints every 2), 32 left to resume
    args = ["--model", "bert-tiny", "--nproc-per-node", "1", "--nnodes", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart-test", "--max-restarts", "1",
            "--data", str(tmp_path / "data.pt"), "--epochs", str(epochs), "--freeze-every", "6", "--optimizer",
            "adamw", "--lr", "1e-3", "--timeout", "30", "--no-progress", "--checkpoint-every", "2"]
    nodes = []
    for n in "ab":
        (tmp_path / n).mkdir()
        nodes.append(subprocess.Popen(
            [sys.executable, "-m", "ptplan.cli.main", "run", str(tmp_path / "plan.json"), *args,
             "--log", str(tmp_path / n / "run.jsonl"), "--checkpoint-dir", str(tmp_path / n / "ck")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        t0 = time.monotonic()
        killed = None
        while killed is None and time.monotonic() - t0 < 180:
            logs = [tmp_path / n / "run.jsonl" for n in "ab"]
            if any(p.exists() and "\"step\": 16," in p.read_text() for p in logs):
                pid = _worker_of_rank(1, {p.pid for p in nodes})
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = pid
            if any(p.poll() is not None for p in nodes):
                break
            time.sleep(0.02)
        outs = [p.communicate(timeout=240) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert killed is not None, outs
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, out + err
    assert sum(f"ptplan run: {epochs * 4} steps" in out for out, _ in outs) == 1, outs
    # the newest checkpoint (the run's end), on whichever node global rank 0 ended on
    finals = [load_checkpoint(tmp_path / n / "ck") for n in "ab" if (tmp_path / n / "ck" / "checkpoint.pt").exists()]
    got = max(finals, key=lambda d: d["position"]["global_step"])
    assert got["position"]["global_step"] == epochs * 4
    logs = [read_records(tmp_path / n / "run.jsonl") for n in "ab" if (tmp_path / n / "run.jsonl").exists()]
    assert any(r["type"] == "resume" and r["attempt"] == 1 for recs in logs for r in recs)

    # the same run, uninterrupted, in forked processes (same config as the launchers built)
    cfg = with_plan_num_labels(RunConfig(
        plan=str(tmp_path / "plan.json"), model="bert-tiny", epochs=epochs, freeze_every=6, optimizer="adamw",
        lr=1e-3, timeout_s=30, progress=False, data=str(tmp_path / "data.pt"),
        checkpoint_dir=str(tmp_path / "ref"), log=str(tmp_path / "ref.jsonl")))
    plan = load_plan(cfg.plan)

    def worker(rank, world):
        mdl = build_for_plan(plan, cfg)
        run_training(cfg, plan, mdl, make_dataset(plan, cfg, mdl))

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=240)
    assert res.ok, res.explain()
    want = load_checkpoint(tmp_path / "ref")
    assert sorted(got["model"]) == sorted(want["model"])
    for k in want["model"]:
        assert torch.equal(got["model"][k], want["model"][k]), k
    for k in want["optim"]:
        for s in want["optim"][k]:
            assert torch.equal(got["optim"][k][s], want["optim"][k][s]), (k, s)
