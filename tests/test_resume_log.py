"""Logs that do not double count (issue 23, item 5): a resumed run's log holds the stopped run's records
from the checkpoint on and the resumed run's again; the reader (``planner.runlog.read_run_log``) keeps each
step, evaluation, cache and export record once -- the resumed run's -- and ``ptplan compare`` counts each
step once, says where the run resumed, and treats the first step after a resume as a warm-up step."""
from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.executor.training.runlog import RunLog, read_records
from ptplan.planner.compare import compare, format_comparison
from ptplan.planner.plan import save_plan
from ptplan.planner.runlog import read_run_log


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _step(log: RunLog, step: int, *, epoch: int = 0, seconds: float = 0.1) -> None:
    log.step(epoch=epoch, step=step, phase=0, frozen_blocks=0, K=1, D=1, seconds=seconds, samples=2, loss=1.0)


def test_a_record_the_resumed_run_writes_again_replaces_the_first_runs(tmp_path):
    """The checkpoint at step 2 was taken right after step 1 (``--checkpoint-every``), before the epoch's end
    (cache record, evaluation, a data-exhausted ``epoch_end``) and a model export at step 3: the resumed run
    writes the epoch's end again, and the export with its own step."""
    path = tmp_path / "run.jsonl"
    log = RunLog(path)
    log.header(model="m", world_size=1, phases=[])
    for s in range(2):
        _step(log, s)
    log.write({"type": "eval", "epoch": 0, "step": 1, "phase": 0, "loss": 0.9, "samples": 4, "seconds": 0.1})
    log.write({"type": "epoch_end", "epoch": 0, "steps": 2, "reason": "data exhausted"})
    log.write({"type": "eval", "epoch": 0, "step": 2, "phase": 0, "loss": 0.8, "samples": 4, "seconds": 0.1})
    _step(log, 2, epoch=1)
    log.write({"type": "export", "step": 3, "path": "m", "kind": "model"})
    log.close()
    log = RunLog(path, append=True)  # the resumed run
    log.write({"type": "resume", "step": 2, "epoch": 0, "seconds": 0.1})
    log.write({"type": "epoch_end", "epoch": 0, "steps": 2, "reason": "data exhausted"})
    log.write({"type": "eval", "epoch": 0, "step": 2, "phase": 0, "loss": 0.7, "samples": 4, "seconds": 0.1})
    for s in (2, 3):
        _step(log, s, epoch=1, seconds=0.2)
    log.write({"type": "export", "step": 4, "path": "m", "kind": "model"})
    log.close()
    read = read_run_log(path)
    assert [(s.step, s.seconds) for s in read.steps] == [(0, 0.1), (1, 0.1), (2, 0.2), (3, 0.2)]
    assert [(r.type, r.get("step"), r.get("loss")) for r in read.records if r.type in ("eval", "export", "epoch_end")] \
        == [("eval", 1, 0.9), ("epoch_end", None, None), ("eval", 2, 0.7), ("export", 4, None)]
    assert read.resumes == ({"step": 2, "line": 9, "replaced_steps": 1},) and not read.warnings


@pytest.mark.multiproc
def test_a_resumed_run_is_counted_once_by_compare(tmp_path):
    """2 ranks, 3 steps per epoch, a checkpoint every 3 steps (taken before the epoch's end writes its cache
    and evaluation records), killed after step 4; resumed, it ends the first epoch again and runs 3..8."""
    model = build_model("bert-tiny", seq_len=8, dropout=0.0, seed=0)
    plan = make_plan(model, [spec(0, K=2, D=1, M=2, b=2), spec(1, K=1, D=2, M=1, b=2, cache=True)],
                     trajectory=[0, 1], samples_per_epoch=16)
    save_plan(plan, tmp_path / "plan.json")
    data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
    held = TensorDataset(*model.make_batch(8, generator=torch.Generator().manual_seed(2)))
    log = tmp_path / "run.jsonl"
    (tmp_path / "shm").mkdir()

    def run(after_step=None, **kw):
        cfg = RunConfig(plan=str(tmp_path / "plan.json"), model="bert-tiny", optimizer="sgd", lr=0.05, epochs=3,
                        steps_per_epoch=3, freeze_every=2, progress=False, timeout_s=30, log=str(log),
                        checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=3, eval_data="(held)",
                        cache_dir=str(tmp_path / "shm"), **kw)

        def worker(rank, world):
            run_training(cfg, plan, model, data, eval_dataset=held, hooks=Hooks(after_step=after_step))

        return run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=120)

    def kill(step, rank):
        if step == 5:
            os._exit(9)

    assert run(kill).exitcodes == (9, 9)
    res = run(resume=True)
    assert res.ok, res.explain()
    raw = read_records(log)
    assert [r["step"] for r in raw if r["type"] == "step"] == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8]
    assert [r["step"] for r in raw if r["type"] == "eval"] == [3, 3, 6, 9]  # the first epoch's end, twice
    read = read_run_log(log)
    assert [s.step for s in read.steps] == list(range(9))
    assert [r.get("step") for r in read.records if r.type == "eval"] == [3, 6, 9]
    assert [(r.get("epoch"), r.get("step")) for r in read.records if r.type == "cache"] == [(0, 3), (1, 6), (2, 9)]
    assert [(r["step"], r["replaced_steps"]) for r in read.resumes] == [(3, 2)]

    c = compare(plan, read, warmup=0)
    sampled = sum(1 for s in read.steps if s.memory_sampled)
    assert sum(p.steps for p in c.phases + c.fills) == 9 - sampled  # each step once (cache-fill steps in their rows)
    visits = compare(plan, read, warmup=1)  # phase 1 visited at step 2 and again at the resume (step 3)
    # left out: the visit's first step (2), the resume's (3) and the step after the evaluation at step 6 (a drained
    # stage); the rest is counted once, as a steady step or as an AutoCache fill step (its own row)
    timed = [s.step for s in read.steps if s.phase == 1 and not s.memory_sampled and s.step not in (2, 3, 6)]
    assert sum(p.steps for p in visits.phases + visits.fills if p.phase == 1) == len(timed) and len(timed) >= 2
    assert [e["step"] for e in c.evals] == [3, 6, 9]
    assert "resumed from step 3" in format_comparison(c) and "2 step record(s)" in format_comparison(c)
    out = tmp_path / "cmp.json"
    r = CliRunner().invoke(cli, ["compare", str(tmp_path / "plan.json"), str(log), "--json", str(out), "--warmup", "0"])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["resumes"][0]["replaced_steps"] == 2 and "resumed from step 3" in r.output


def test_one_job_writes_a_log_and_a_second_writer_is_refused_until_the_first_is_gone(tmp_path):
    """A node that joined a running elastic job started a job of its own on the same --log (an audit: the two
    overwrote each other's log and checkpoints). The writer holds a lock from its start; a second writer, here
    another process, is refused naming its pid, and the lock goes with the process (a killed run frees it)."""
    from ptplan.planner.errors import PtplanError

    log = tmp_path / "run.jsonl"
    holder = _holding(log, 60)
    try:
        with pytest.raises(PtplanError, match=rf"another process \(host .*, pid {holder.pid}\) is writing the run "
                                              rf"log .*run\.jsonl: two jobs on one --log"):
            RunLog(log, append=True)
    finally:
        holder.kill()
        holder.wait()
    mine = RunLog(log)  # the killed holder's lock is gone with it
    with pytest.raises(PtplanError, match=rf"pid {os.getpid()}"):
        RunLog(log)
    mine.close()
    RunLog(log).close()
    (tmp_path / "folder.jsonl").mkdir()  # a log that cannot be opened leaves no lock behind (a review found one)
    with pytest.raises(PtplanError, match="cannot open the run log"):
        RunLog(tmp_path / "folder.jsonl", append=True)
    (tmp_path / "folder.jsonl").rmdir()
    RunLog(tmp_path / "folder.jsonl", append=True).close()


def test_a_writer_waits_for_a_lock_whose_holder_goes_away(tmp_path):
    """A lost node's lock on a shared file system lasts until its lease ends: the training loop's writer waits
    for it (``lock_wait_s``) instead of refusing at once. Here the holder exits after a second."""
    log = tmp_path / "run.jsonl"
    holder = _holding(log, 1)
    RunLog(log, lock_wait_s=60).close()  # got once the holder exited
    assert holder.wait(timeout=60) == 0


def test_a_fresh_run_does_not_wait_for_a_held_log(tmp_path):
    """A fresh start refuses a held log at once; only a resume waits (for a lost node's lease). A joiner that waited
    took the log over when the first job ended and started it again from step 0 (seen once: 192 steps -> 2). The
    holder here lets go after 3 s; a run that waited would get the log and succeed."""
    from tests.parity import two_phase_job

    model, plan = two_phase_job(tmp_path, 8, 16)
    log = tmp_path / "run.jsonl"
    holder = _holding(log, 3)
    cfg = RunConfig(plan=str(tmp_path / "plan.json"), model="bert-tiny", num_labels=2, data=str(tmp_path / "data.pt"),
                    epochs=1, progress=False, timeout_s=30, log=str(log))
    data = TensorDataset(**{k: v for k, v in torch.load(tmp_path / "data.pt").items()})

    def worker(rank, world):
        run_training(cfg, plan, model, data)

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=120)
    holder.wait(timeout=60)
    assert not res.ok and any("is writing the run log" in e for e in res.errors), res.explain()


def _holding(log, seconds: int):
    """Another process that holds ``log``'s writer lock for ``seconds`` (returned once it holds it)."""
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import time\n"
                               "from ptplan.executor.training.runlog import RunLog\n"
                               f"RunLog({str(log)!r}); print('held', flush=True); time.sleep({seconds})"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder
