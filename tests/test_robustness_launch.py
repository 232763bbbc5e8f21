"""``ptplan run`` owns its workers (issue 11, items 1-3): signals, killed launchers and agents, dying ranks.

Every test starts the real launcher (``python -m ptplan.cli.main run``: launcher -> torchrun -> 2 workers)
on a long run, waits until it trains, breaks it as an operator would (Ctrl-C, kill, kill -9 of the
launcher, of torchrun or of one rank), and checks: one ``error:`` line on stderr and the exit code,
the time from the kill to the end, that no process of the run is left, that the job's AutoCache folder
and job folder are gone, and that the run log still reads.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import torch

from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.planner.plan import save_plan
from ptplan.planner.runlog import read_run_log

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

RUN_MARK = "PTPLAN_TEST_RUN"
RUN_TIMEOUT_S = 30
"""The runs' --timeout: a rank waiting on a dead peer's collective gives up after it."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """bert-tiny (seq 8) on 2 processes, K=1 x D=2; one block frozen and its prefix cached from step 4; 16 samples."""
    d = tmp_path_factory.mktemp("launch")
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=2, M=1, b=2), spec(1, K=1, D=2, M=1, b=2, cache=True)],
                     trajectory=[0, 1], samples_per_epoch=16, optimizer="sgd")  # the runs' --optimizer
    save_plan(plan, d / "plan.json")
    x, y, m = model.make_batch(16, generator=torch.Generator().manual_seed(0))
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, d / "data.pt")
    return d


def _processes(mark: str) -> list[tuple[int, str]]:
    """(pid, command) of live processes whose environment carries ``RUN_MARK=mark`` (not zombies)."""
    out = []
    needle = f"{RUN_MARK}={mark}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                out.append((int(d), f.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return out


class Run:
    """One ``ptplan run`` started in the background, with the paths it writes."""

    def __init__(self, files, tmp_path, *extra: str, epochs: int = 5000, cache_dir=None, ckpt=None):
        self.mark = uuid.uuid4().hex
        tmp_path.mkdir(exist_ok=True)
        self.log = tmp_path / "run.jsonl"
        self.cache_dir = cache_dir or tmp_path / "shm"
        self.cache_dir.mkdir(exist_ok=True)
        self.ckpt = ckpt or tmp_path / "ck"
        cmd = [sys.executable, "-m", "ptplan.cli.main", "run", str(files / "plan.json"), "--model", "bert-tiny",
               "--nproc-per-node", "2", "--data", str(files / "data.pt"), "--epochs", str(epochs),
               "--freeze-every", "4", "--optimizer", "sgd", "--lr", "0.01", "--timeout", str(RUN_TIMEOUT_S), "--no-progress",
               "--log", str(self.log), "--cache-dir", str(self.cache_dir), "--checkpoint-dir", str(self.ckpt),
               "--checkpoint-every", "8", *extra]
        env = {**os.environ, RUN_MARK: self.mark}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.out = self.err = ""

    def wait_training(self, step: int = 10, timeout: float = 120) -> None:
        """Until the log holds step ``step`` (the cache is in use from step 4)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                self.finish()
                pytest.fail(f"the run ended early ({self.proc.returncode}): {self.out}\n{self.err}")
            if self.log.exists() and f'"step": {step},' in self.log.read_text():
                return
            time.sleep(0.05)
        self.proc.kill()
        pytest.fail("the run did not start training in time")

    def worker_pids(self) -> dict[int, int]:
        """{rank: pid} of the running workers."""
        out = {}
        for pid, cmd in _processes(self.mark):
            if "ptplan.executor.launch.worker" in cmd and "torch.distributed.run" not in cmd:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                out[int(env[b"RANK"])] = pid
        return out

    def agent_pid(self) -> int:
        return next(pid for pid, cmd in _processes(self.mark) if "torch.distributed.run" in cmd)

    def finish(self, timeout: float = 60) -> float:
        """Wait for the launcher; returns the seconds it took."""
        t0 = time.monotonic()
        self.out, self.err = self.proc.communicate(timeout=timeout)
        return time.monotonic() - t0

    def error_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith("error:")]

    def assert_nothing_left(self, timeout: float = 10) -> None:
        t0 = time.monotonic()
        while _processes(self.mark) and time.monotonic() - t0 < timeout:
            time.sleep(0.1)
        assert not _processes(self.mark), _processes(self.mark)
        assert os.listdir(self.cache_dir) == [], os.listdir(self.cache_dir)
        assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"ptplan-job-")
                    and f"-{self.proc.pid}-" in n]
        if self.ckpt.exists():
            assert not [n for n in os.listdir(self.ckpt) if ".tmp." in n]
        log = read_run_log(self.log)  # whole lines only: every record reads
        assert log.steps and not log.warnings


def _cache_in_use(run: Run) -> None:
    t0 = time.monotonic()
    while not os.listdir(run.cache_dir):
        assert time.monotonic() - t0 < 30, "the AutoCache folder never appeared"
        time.sleep(0.05)
    assert all(n.startswith("ptplan-j") for n in os.listdir(run.cache_dir))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_to_the_launcher_stops_every_worker_with_one_line(files, tmp_path, sig):
    run = Run(files, tmp_path)
    run.wait_training()
    _cache_in_use(run)
    t0 = time.monotonic()
    run.proc.send_signal(sig)  # the launcher alone, as `kill` does (a terminal's Ctrl-C reaches only it too)
    run.finish()
    took = time.monotonic() - t0
    assert run.proc.returncode == 128 + sig, run.err
    assert run.error_lines() == [run.err.strip()], run.err  # exactly one line, nothing else on stderr
    assert f"stopped by {sig.name}" in run.err and "--resume" in run.err
    run.assert_nothing_left()
    print(f"{sig.name} -> launcher exit in {took:.2f} s")  # bounded by finish()'s timeout, not timed here


def test_kill_9_of_the_launcher_takes_the_workers_down_and_a_start_sweeps_the_cache(files, tmp_path):
    run = Run(files, tmp_path)
    run.wait_training()
    _cache_in_use(run)
    t0 = time.monotonic()
    run.proc.kill()
    run.finish()
    while _processes(run.mark) and time.monotonic() - t0 < 30:  # torchrun (SIGTERM) and its workers
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert not _processes(run.mark), _processes(run.mark)
    print(f"kill -9 launcher -> every process gone in {took:.2f} s")  # within the 30 s the loop waits
    left = os.listdir(run.cache_dir)  # the launcher's janitor (executor/launch/janitor.py) removed them ...
    jobs = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("ptplan-job-") and f"-{run.proc.pid}-" in n]
    assert not left and not jobs, (left, jobs)
    # ... and what a power cut leaves (the janitor gone too) the next start on this host removes
    from ptplan.executor.launch.launcher import owner_tag

    stale = owner_tag(run.proc.pid)  # the dead launcher's pid: its owner has ended
    (run.cache_dir / f"ptplan-{stale}-node0").mkdir()
    (run.cache_dir / f"ptplan-{stale}-node0" / "slab").write_bytes(b"x" * 4096)
    os.mkdir(os.path.join(tempfile.gettempdir(), f"ptplan-job-{stale}-left"))
    left = os.listdir(run.cache_dir)
    again = Run(files, tmp_path / "again", epochs=1, cache_dir=run.cache_dir, ckpt=run.ckpt)
    again.finish(timeout=300)
    assert again.proc.returncode == 0, again.err
    assert "removed" in again.err and all(n in again.err for n in left), again.err
    assert os.listdir(run.cache_dir) == []
    assert not [n for n in os.listdir(tempfile.gettempdir()) if n.startswith("ptplan-job-") and f"-{run.proc.pid}-" in n]


def test_kill_9_of_torchrun_stops_the_workers_and_says_so(files, tmp_path):
    run = Run(files, tmp_path)
    run.wait_training()
    _cache_in_use(run)
    t0 = time.monotonic()
    os.kill(run.agent_pid(), signal.SIGKILL)
    run.finish()
    took = time.monotonic() - t0
    assert run.proc.returncode == 1, run.err
    assert run.error_lines() == [run.err.strip()], run.err
    assert "torchrun (the worker agent) was killed by SIGKILL" in run.err
    run.assert_nothing_left()
    print(f"kill -9 torchrun -> launcher exit in {took:.2f} s")  # bounded by finish()'s timeout


def test_a_killed_rank_is_named_and_the_job_ends_in_seconds(files, tmp_path):
    run = Run(files, tmp_path)
    run.wait_training()
    pids = run.worker_pids()
    assert sorted(pids) == [0, 1]
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    run.finish()
    took = time.monotonic() - t0
    assert run.proc.returncode == 1, run.err
    assert run.error_lines() == [run.err.strip()], run.err
    assert run.err.startswith("error: rank 1 stopped without an error message") and "SIGKILL" in run.err
    log = re.search(r"are in (\S+workers\.log)", run.err)[1]
    assert os.path.exists(log) and "Traceback" in open(log).read()  # the tracebacks went there, not to the terminal
    run.assert_nothing_left()
    print(f"kill -9 rank 1 -> launcher exit in {took:.2f} s")
    assert took < RUN_TIMEOUT_S  # the job saw the death itself: it did not wait out the survivor's collective timeout


def test_a_ptplan_error_in_the_workers_is_one_line_exit_2_naming_the_ranks(files, tmp_path):
    """A diverging run (finite but absurd --lr): every rank stops at the same step with the same PtplanError. The
    launcher names the ranks whose report it read: both, or under load one alone, when torchrun stopped the other
    (SIGTERM) before it wrote its own (a clean-clone CI run saw "rank 1: ...")."""
    run = Run(files, tmp_path, "--lr", "1e30", epochs=3)
    run.finish(timeout=120)
    assert run.proc.returncode == 2, run.out + run.err
    assert run.error_lines() == [run.err.strip()], run.err
    m = re.fullmatch(r"error: (ranks 0-1|rank 0|rank 1): the loss is (?:nan|inf) at step (\d+) \(epoch 0, phase \d"
                     r".*lower --lr.*", run.err.strip())
    assert m, run.err
    steps = read_run_log(run.log).steps
    assert steps[-1].step == int(m[2]) and not (steps[-1].loss == steps[-1].loss and abs(steps[-1].loss) < 1e30)
    run.assert_nothing_left()


def test_a_hung_rank_is_named_and_the_job_ends_at_the_timeout(files, tmp_path):
    """Rank 1 stops responding (SIGSTOP: alive, silent): rank 0 waits in a collective until --timeout, and
    the job ends soon after it -- not at timeout + torchrun's 30 s grace -- with one line naming rank 1."""
    run = Run(files, tmp_path, "--timeout", "8")
    run.wait_training()
    pids = run.worker_pids()
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        run.finish(timeout=90)
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    took = time.monotonic() - t0
    print(f"SIGSTOP rank 1 with --timeout 8 -> launcher exit in {took:.2f} s")
    assert run.proc.returncode == 1, run.err
    assert run.error_lines() == [run.err.strip()], run.err
    assert run.err.startswith("error: rank 1 stopped without an error message") and "stuck past --timeout" in run.err
    run.assert_nothing_left()
    assert took < 8 + 15, took
