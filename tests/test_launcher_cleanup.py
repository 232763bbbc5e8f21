"""Nothing left by a killed launcher (issue 23, item 4): after ``kill -9`` of ``ptplan run``, its janitor
(``executor/launch/janitor.py``) stops torchrun and the workers and removes the node's AutoCache folder in
/dev/shm and the job folder in the temp folder, without another run on the host."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import torch

from ptplan.executor.cache.autocache import default_root
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.janitor import Janitor, clean_up
from ptplan.executor.launch.launcher import owner_tag
from ptplan.planner.plan import save_plan

RUN_MARK = "PTPLAN_TEST_RUN"


def _processes(mark: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``RUN_MARK=mark``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if f"{RUN_MARK}={mark}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(int(d))
        except OSError:
            continue
    return out


def _files_of(pid: int) -> list[str]:
    """ptplan's files of the launcher ``pid`` in the AutoCache root and the temp folder."""
    out = []
    for d in dict.fromkeys([default_root(), tempfile.gettempdir()]):
        out += [os.path.join(d, n) for n in os.listdir(d) if n.startswith("ptplan-") and f"-{pid}-" in n]
    return out


@pytest.mark.multiproc
@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_no_file_in_shm_or_the_temp_folder(tmp_path):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=2, M=1, b=2), spec(1, K=1, D=2, M=1, b=2, cache=True)],
                     trajectory=[0, 1], samples_per_epoch=16, optimizer="sgd")  # the runs' --optimizer
    save_plan(plan, tmp_path / "plan.json")
    x, y, m = model.make_batch(16, generator=torch.Generator().manual_seed(0))
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, tmp_path / "data.pt")
    mark, log = uuid.uuid4().hex, tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "ptplan.cli.main", "run", str(tmp_path / "plan.json"), "--model", "bert-tiny",
           "--nproc-per-node", "2", "--data", str(tmp_path / "data.pt"), "--epochs", "5000", "--freeze-every", "4",
           "--optimizer", "sgd", "--lr", "0.01", "--timeout", "30", "--no-progress", "--log", str(log)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, RUN_MARK: mark})
    try:
        t0 = time.monotonic()
        cache = os.path.join(default_root(), f"ptplan-{owner_tag(proc.pid)}-node0")
        while not (os.path.isdir(cache) and log.exists() and '"step": 8,' in log.read_text()):
            assert proc.poll() is None, f"the run ended early ({proc.returncode})"
            assert time.monotonic() - t0 < 180, "the run did not start training with its cache in time"
            time.sleep(0.05)
        left = _files_of(proc.pid)
        assert cache in left and any(os.path.basename(p).startswith("ptplan-job-") for p in left), left
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t_kill = time.monotonic()
        while _files_of(proc.pid) and time.monotonic() - t_kill < 10:
            time.sleep(0.05)
        took = time.monotonic() - t_kill
        assert _files_of(proc.pid) == [], _files_of(proc.pid)
        while _processes(mark) and time.monotonic() - t_kill < 30:
            time.sleep(0.05)
        assert _processes(mark) == []
        print(f"kill -9 launcher -> its files gone in {took:.2f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_janitor_exits_without_touching_anything_when_told_done(tmp_path):
    job = tmp_path / f"ptplan-job-{owner_tag()}-x"
    job.mkdir()
    j = Janitor.start(owner_tag(), str(job), [str(tmp_path)])
    j.agent(os.getpid(), None)
    j.done()
    assert j.proc is not None and j.proc.returncode == 0
    assert job.is_dir()  # the launcher's own finally removes it; a janitor told "done" leaves it


def test_clean_up_stops_the_started_workers_then_removes_the_jobs_files(tmp_path):
    tag = owner_tag()
    job = tmp_path / f"ptplan-job-{tag}-x"
    job.mkdir()
    cache = tmp_path / f"ptplan-{tag}-node0"
    cache.mkdir()
    (cache / "slab").write_bytes(b"x" * 100)
    other = tmp_path / f"ptplan-{owner_tag(1)}-node0"  # another (live) job's cache: not this janitor's
    other.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        from ptplan.executor.launch.launcher import _start_ticks

        (job / "a0-r0.start").write_text(f'{{"pid": {sleeper.pid}, "ticks": {_start_ticks(sleeper.pid)}}}')
        removed = clean_up(tag, str(job), [str(tmp_path)], None)
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    assert sorted(removed) == sorted([str(cache), str(job)]) and not cache.exists() and not job.exists()
    assert other.is_dir()
