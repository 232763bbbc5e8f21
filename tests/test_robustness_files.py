"""Checkpoints, the run log, options, the data file and outputs (issue 11, items 4, 5, 6 and 8).

Disk-full cases run real processes against a real size-limited file system: a tmpfs mounted for the
test (root only; skipped where it cannot be mounted). Everything refused before launch is checked
through the CLI with ``--dry-run`` or a refused real invocation (no process starts).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.training import checkpoint as ckpt
from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset, load_dataset
from ptplan.executor.launch.launcher import owner_tag
from ptplan.executor.families.models import build_model
from ptplan.executor.training.runlog import RunLog, read_records
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.planner.plan import save_plan
from ptplan.planner.runlog import read_run_log
from tests.parity import two_phase_job


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


@contextlib.contextmanager
def small_fs(path, size: str):
    """A tmpfs of ``size`` (e.g. "6m") mounted at ``path`` for the duration (skip where mounting fails)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0777", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(folder) -> str:
    """Fill the file system of ``folder`` with one file; returns its path."""
    path = os.path.join(folder, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    return path


# ---- a small job: plan, data, config, and a checkpoint written by it ---------------------------------

SEQ, N = 8, 16


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("job")
    model, plan = two_phase_job(d, SEQ, N)

    def cfg(**kw):
        base = dict(plan=str(d / "plan.json"), model="bert-tiny", num_labels=2, data=str(d / "data.pt"), epochs=2,
                    progress=False, timeout_s=30, log=str(d / "run.jsonl"))
        return RunConfig(**{**base, **kw})

    good = d / "ck"
    c = cfg(checkpoint_dir=str(good))
    data = load_dataset(c.data)

    def worker(rank, world):
        run_training(c, plan, model, data)

    res = run_world(2, worker, tmpdir=str(d), timeout_s=30, deadline_s=120)
    assert res.ok, res.explain()
    return {"dir": d, "model": model, "plan": plan, "cfg": cfg, "data": data, "ckpt": good}


def _header(rl, plan):
    rl.header(model="bert-tiny", world_size=plan.world_size, plan_fingerprint=plan.inputs.profile.fingerprint,
              phases=[dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M) for p in plan.phases])


def _cli(*args):
    r = CliRunner().invoke(cli, list(map(str, args)))
    return r


def _run_args(job, *extra):
    d = job["dir"]
    return ["run", d / "plan.json", "--model", "bert-tiny", "--nproc-per-node", "2", "--data", d / "data.pt",
            "--epochs", "2", "--dry-run", *extra]


# ---- item 4: checkpoints ------------------------------------------------------------------------------

def test_a_good_checkpoint_passes_the_pre_launch_check(job):
    r = _cli(*_run_args(job, "--checkpoint-dir", job["ckpt"], "--resume"))
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "a tensor", "version 1", "no position"])
def test_a_damaged_checkpoint_is_one_clear_error_before_launch(job, tmp_path, damage):
    good = (job["ckpt"] / "checkpoint.pt").read_bytes()
    folder = tmp_path / "ck"
    folder.mkdir()
    path = folder / "checkpoint.pt"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(good[:len(good) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(4096))
    elif damage == "a tensor":
        torch.save(torch.zeros(3), path)
    else:
        data = torch.load(job["ckpt"] / "checkpoint.pt", weights_only=True)
        if damage == "version 1":
            data["version"] = 1
        else:
            del data["position"]
        torch.save(data, path)
    r = _cli(*_run_args(job, "--checkpoint-dir", folder, "--resume"))
    assert r.exit_code == 2, r.output
    assert r.output.startswith(f"error: checkpoint {path}") and r.output.count("\n") == 1, r.output
    assert "Traceback" not in r.output


def test_another_plans_or_another_runs_checkpoint_is_refused(job, tmp_path):
    model = job["model"]
    other = make_plan(model, [spec(0, K=1, D=2, M=1, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1],
                      samples_per_epoch=N)
    save_plan(other, tmp_path / "other.json")
    r = _cli("run", tmp_path / "other.json", "--model", "bert-tiny", "--nproc-per-node", "2", "--data",
             job["dir"] / "data.pt", "--checkpoint-dir", job["ckpt"], "--resume", "--dry-run")
    assert r.exit_code == 2, r.output
    assert "it was written for another plan (phase 0 is frozen=0 K=2 D=1 M=2 b=2 there, frozen=0 K=1 D=2" in r.output
    x, y, m = model.make_batch(N // 2)  # fewer samples than the plan's epoch (a longer file trains the plan's N)
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, tmp_path / "fewer.pt")
    r = _cli(*_run_args(job, "--checkpoint-dir", job["ckpt"], "--resume", "--data", tmp_path / "fewer.pt", "--seed", "3"))
    assert r.exit_code == 2 and "its samples is 16, this run's is 8" in r.output and "its seed is 0" in r.output


def test_a_checkpoint_past_the_runs_epochs_is_refused_and_one_at_its_end_is_a_note(job, tmp_path):
    """An audit resumed a finished 2-epoch checkpoint with --epochs 1: exit 0, "final loss None", a resume record
    appended. Past the run's end is refused; at its end is a note; a sharded checkpoint read as single says so."""
    args = _run_args(job, "--checkpoint-dir", job["ckpt"], "--resume")
    args[args.index("--epochs") + 1] = "1"
    r = _cli(*args)
    assert r.exit_code == 2, r.output
    assert "it is at epoch 2, step 8, past this run's 1 epoch(s); resume with --epochs 2 or more" in r.output, r.output
    r = _cli(*_run_args(job, "--checkpoint-dir", job["ckpt"], "--resume"))
    assert r.exit_code == 0 and "is at the end of the run's 2 epoch(s) (step 8): no step will run" in r.output
    (tmp_path / "sh").mkdir()
    (tmp_path / "sh" / "sharded.json").write_text("{}")
    r = _cli(*_run_args(job, "--checkpoint-dir", tmp_path / "sh", "--resume"))
    assert r.exit_code == 2 and "is a sharded one: resume it with --checkpoint-format sharded" in r.output, r.output


def test_a_finished_run_resumed_into_a_new_log_exports_whole(job, tmp_path):
    """A SLURM requeue after completion: --resume at the last step with a new --log and --export. Before, the log
    had no header and the export no README (its model card read a log with no steps: exit 2 after "exported")."""
    from ptplan.executor.training.export import finish_export

    model, data = job["model"], job["data"]
    cfg = job["cfg"](checkpoint_dir=str(job["ckpt"]), resume=True, log=str(tmp_path / "new.jsonl"),
                     export=str(tmp_path / "export"))

    def worker(rank, world):
        summary = run_training(cfg, job["plan"], model, data)
        assert summary.final_loss is None

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=120)
    assert res.ok, res.explain()
    kinds = [json.loads(line)["type"] for line in (tmp_path / "new.jsonl").read_text().splitlines()]
    assert kinds[:2] == ["header", "resume"] and "step" not in kinds, kinds
    finish_export(cfg.export, sources=[None], data=cfg.data, plan_path=cfg.plan, log_path=cfg.log)  # as `ptplan run`
    assert "not logged" in (tmp_path / "export" / "README.md").read_text()
    mask = os.umask(0o022)
    os.umask(mask)
    assert (tmp_path / "export").stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0700


def test_a_resumed_export_best_into_another_folder_is_refused(job, tmp_path):
    """--export-best resumed with another --export than the run's before printed 'exported to' that folder and never
    wrote it (the best model so far lives in the first folder; an executor audit)."""
    from ptplan.executor.training.loop import run_training as train

    model, data = job["model"], job["data"]
    first = job["cfg"](checkpoint_dir=str(tmp_path / "ck"), log=str(tmp_path / "run.jsonl"), epochs=1,
                       export=str(tmp_path / "e1"), export_best=True, eval_data=job["cfg"]().data)

    def run(cfg):
        def worker(rank, world):
            train(cfg, job["plan"], model, data, eval_dataset=data)
        return run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=120)

    res = run(first)
    assert res.ok, res.explain()
    assert (tmp_path / "e1" / "config.json").is_file()
    res = run(dataclasses.replace(first, epochs=2, resume=True, export=str(tmp_path / "e2")))
    assert not res.ok and all("--export-best: the best model so far (step 4) was exported before the resume, and "
                              f"--export {tmp_path / 'e2'} does not hold it" in e for e in res.errors), res.errors
    res = run(dataclasses.replace(first, epochs=2, resume=True))
    assert res.ok, res.explain()


def test_two_label_names_reach_the_exported_config(tmp_path):
    """transformers 5 writes no id2label for its default two classes; the export took that for 0 classes and kept
    LABEL_0/LABEL_1 with a wrong note."""
    import transformers

    from ptplan.executor.training.export import finish_export

    transformers.BertConfig(num_labels=2).save_pretrained(tmp_path / "export")
    torch.save({"inputs": torch.zeros(2, 4, dtype=torch.long), "labels": torch.tensor([0, 1]),
                "meta": {"label_names": ["neg", "pos"]}}, tmp_path / "data.pt")
    (tmp_path / "plan.json").write_text(json.dumps(make_plan(build_model("bert-tiny", seq_len=SEQ),
                                                             [spec(0, K=1, D=1, M=1, b=2)], trajectory=[0],
                                                             samples_per_epoch=N).to_json()))
    notes = finish_export(tmp_path / "export", sources=[None], data=str(tmp_path / "data.pt"),
                          plan_path=str(tmp_path / "plan.json"), log_path=None)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"} and config["label2id"] == {"neg": 0, "pos": 1}, notes
    assert not any("label names" in n for n in notes), notes


def test_resume_checks_the_checkpoint_in_the_workers_too(job, tmp_path):
    """Another plan's checkpoint given to workers directly (several nodes skip the launcher's look)."""
    model, data = job["model"], job["data"]
    other = make_plan(model, [spec(0, K=1, D=2, M=1, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1],
                      samples_per_epoch=N)
    cfg = job["cfg"](checkpoint_dir=str(job["ckpt"]), resume=True, log=str(tmp_path / "run.jsonl"))

    def worker(rank, world):
        run_training(cfg, other, model, data)

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.exitcodes == (1, 1)
    assert all("PtplanError: cannot resume from" in e and "another plan" in e for e in res.errors)
    assert not (tmp_path / "run.jsonl").exists()


def test_a_full_disk_during_a_checkpoint_keeps_the_last_one_and_leaves_no_temp_file(job, tmp_path):
    """Real processes writing to a 9 MB tmpfs (a checkpoint is 3.7 MB): the one of step 2 fits, then the disk fills up."""
    model, plan, data = job["model"], job["plan"], job["data"]
    out = tmp_path / "final.pt"

    def run(cfg, after_step=None):
        def worker(rank, world):
            def save(event, step, weights):
                if event == "final":
                    torch.save(weights, out)
            run_training(cfg, plan, model, data, hooks=Hooks(snapshots=True, on_snapshot=save, after_step=after_step))
        return run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=120)

    res = run(job["cfg"](optimizer="adamw", log=str(tmp_path / "ref.jsonl")))
    assert res.ok, res.explain()
    want = torch.load(out)
    with small_fs(tmp_path / "fs", "9m") as fs:
        folder = fs / "ck"
        cfg = job["cfg"](optimizer="adamw", checkpoint_dir=str(folder), checkpoint_every=1,
                         log=str(tmp_path / "run.jsonl"))

        def fill(step, rank):
            if step == 2 and rank == 0:
                _fill(fs)

        res = run(cfg, after_step=fill)
        assert res.exitcodes == (1, 1), res.explain()
        for e in res.errors:
            assert "PtplanError: cannot write the checkpoint" in e and "(the disk is full)" in e, e
        assert sorted(os.listdir(folder)) == ["checkpoint.pt"]  # no temp file left
        assert ckpt.load_checkpoint(folder)["position"]["global_step"] == 2
        os.unlink(fs / "filler")  # the operator frees space, then resumes
        res = run(job["cfg"](optimizer="adamw", checkpoint_dir=str(folder), checkpoint_every=1, resume=True,
                             log=str(tmp_path / "run.jsonl")))
        assert res.ok, res.explain()
        assert sorted(os.listdir(folder)) == ["checkpoint.pt"]
    got = torch.load(out)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_killed_writers_temp_file_is_removed_by_the_next_save(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = folder / f"checkpoint.pt.tmp.{owner_tag(dead.pid)}"
        busy = folder / f"checkpoint.pt.tmp.{owner_tag(alive.pid)}"
        stale.write_bytes(b"x" * 1000)
        busy.write_bytes(b"y")
        dead.kill()
        dead.wait()
        payload = {k: v for k, v in torch.load(_any_checkpoint(tmp_path), weights_only=True).items() if k != "version"}
        ckpt.save_checkpoint(folder, payload)
        assert not stale.exists() and busy.exists()  # a live writer's file stays
        busy.unlink()
    finally:
        alive.kill()
        alive.wait()
    assert sorted(os.listdir(folder)) == ["checkpoint.pt"]


def _any_checkpoint(tmp_path):
    """A minimal valid checkpoint file (contents do not matter to the temp-file sweep)."""
    p = tmp_path / "any.pt"
    torch.save({"version": ckpt.VERSION, "plan_id": "x", "plan": {}, "run": {}, "model_name": "m", "optimizer": "sgd",
                "world_size": 1, "model": {}, "optim": {}, "position": {}, "rng": [None]}, p)
    return p


# ---- item 5: the run log --------------------------------------------------------------------------------

def test_a_new_log_replaces_the_old_one_only_at_the_first_step(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text('{"old": true}\n')
    log = RunLog(path)
    log.header(model="m", world_size=1, phases=[])
    log.close()  # the run failed before training: the old log stays
    assert path.read_text() == '{"old": true}\n'
    log = RunLog(path)
    log.header(model="m", world_size=1, phases=[])
    assert path.read_text() == '{"old": true}\n'
    log.step(epoch=0, step=0, phase=0, frozen_blocks=0, K=1, D=1, seconds=0.1, samples=2, loss=1.0)
    log.close()
    assert [r["type"] for r in read_records(path)] == ["header", "step"]


def test_a_resume_cuts_a_torn_last_line_before_appending(tmp_path):
    path = tmp_path / "run.jsonl"
    log = RunLog(path)
    log.header(model="m", world_size=1, phases=[])
    for s in range(3):
        log.step(epoch=0, step=s, phase=0, frozen_blocks=0, K=1, D=1, seconds=0.1, samples=2, loss=1.0)
    log.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"type": "step", "epoch": 0, "st')  # killed mid-line
    assert read_run_log(path).warnings  # readers tolerate it, with a warning
    log = RunLog(path, append=True)
    log.write({"type": "resume", "step": 2, "epoch": 0, "seconds": 0.1})
    log.step(epoch=0, step=2, phase=0, frozen_blocks=0, K=1, D=1, seconds=0.2, samples=2, loss=0.5)
    log.close()
    read = read_run_log(path)
    assert not read.warnings and [s.step for s in read.steps] == [0, 1, 2] and read.steps[-1].loss == 0.5


@pytest.mark.multiproc
def test_the_log_is_synced_at_phase_changes_epoch_ends_and_checkpoints(tmp_path):
    model = build_model("bert-tiny", seq_len=SEQ, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=1, M=1, b=2), spec(1, K=1, D=1, M=1, b=2)], trajectory=[0, 1],
                     samples_per_epoch=8)
    data = TensorDataset(*model.make_batch(8, generator=torch.Generator().manual_seed(1)))
    cfg = RunConfig(plan="(test)", model="bert-tiny", epochs=2, progress=False, timeout_s=30, freeze_every=3,
                    log=str(tmp_path / "run.jsonl"), checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=5)
    synced = tmp_path / "synced.txt"

    def worker(rank, world):
        orig = RunLog.sync

        def sync(self):
            with open(synced, "a") as f:
                f.write(f"{len(read_records(self.path)) if self.path and os.path.exists(self.path) else 0}\n")
            orig(self)

        RunLog.sync = sync
        run_training(cfg, plan, model, data)

    res = run_world(1, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.ok, res.explain()
    recs = read_records(cfg.log)
    kinds = [r["type"] for r in recs]
    at = [int(x) for x in synced.read_text().split()]
    # after the transition (step 3), the checkpoint (step 5) and both epoch ends every record so far was synced
    trans = kinds.index("transition") + 1
    assert trans in at and len(recs) in at
    steps5 = next(i for i, r in enumerate(recs) if r["type"] == "step" and r["step"] == 4) + 1
    assert steps5 in at


@pytest.mark.multiproc
def test_a_resume_replaces_the_replayed_steps_and_transitions_in_compare(job, tmp_path):
    """Killed after step 3 with a checkpoint at step 2 and a phase change at step 2: the resumed run
    logs step 2, step 3 and the transition again; `ptplan compare` counts each once."""
    model, plan, data = job["model"], job["plan"], job["data"]
    log = tmp_path / "run.jsonl"
    cfg = job["cfg"](log=str(log), checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, freeze_every=2,
                     steps_per_epoch=3, epochs=2)

    def kill(step, rank):
        if step == 3:
            os._exit(9)

    def worker(c, after_step=None):
        return lambda rank, world: run_training(c, plan, model, data, hooks=Hooks(after_step=after_step))

    res = run_world(2, worker(cfg, kill), tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.exitcodes == (9, 9)
    res = run_world(2, worker(job["cfg"](log=str(log), checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2,
                                         freeze_every=2, steps_per_epoch=3, epochs=2, resume=True)),
                    tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.ok, res.explain()
    recs = read_records(log)
    assert [r["step"] for r in recs if r["type"] == "step"] == [0, 1, 2, 2, 3, 4, 5]  # step 2 replayed in the file
    assert [r["step"] for r in recs if r["type"] == "transition"] == [2, 2]
    out = tmp_path / "cmp.json"
    r = _cli("compare", job["dir"] / "plan.json", log, "--json", out, "--warmup", "0")
    assert r.exit_code == 0, r.output
    cmp = json.loads(out.read_text())
    assert len(cmp["transitions"]) == 1 and [p["phase"] for p in cmp["phases"]] == [0, 1], cmp
    assert [s.step for s in read_run_log(log).steps] == [0, 1, 2, 3, 4, 5]


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_full_disk_under_the_run_log_is_one_line_and_the_log_still_reads(job, tmp_path):
    """`ptplan run` (launcher, torchrun, 2 workers) with its log on a 32 KiB tmpfs (~130 steps' lines fit)."""
    with small_fs(tmp_path / "fs", "32k") as fs:
        log = fs / "run.jsonl"
        d = job["dir"]
        cmd = [sys.executable, "-m", "ptplan.cli.main", "run", str(d / "plan.json"), "--model", "bert-tiny",
               "--nproc-per-node", "2", "--data", str(d / "data.pt"), "--epochs", "2000", "--no-progress",
               "--timeout", "30", "--log", str(log)]
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, r.stdout + r.stderr
        # every rank raises rank 0's error (the step's stop flag), so the launcher names both
        assert r.stderr.strip().startswith("error: ranks 0-1: cannot write the run log") and "disk is full" in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        read = read_run_log(log)
        assert not read.warnings and len(read.steps) > 50  # whole lines only
        assert log.read_bytes().endswith(b"\n")
        res = _cli("compare", d / "plan.json", log)
        assert res.exit_code == 0, res.output
        print(f"log full -> exit after {time.monotonic() - t0:.1f} s, {len(read.steps)} steps logged")


def test_compare_and_show_tolerate_a_torn_last_line_with_a_warning(job, tmp_path):
    log = tmp_path / "run.jsonl"
    rl = RunLog(log)
    _header(rl, job["plan"])
    for s in range(4):
        rl.step(epoch=0, step=s, phase=0, frozen_blocks=0, K=2, D=1, seconds=0.1, samples=4, loss=1.0)
    rl.close()
    with open(log, "a") as f:
        f.write('{"type": "step", "ep')
    r = _cli("compare", job["dir"] / "plan.json", log)
    assert r.exit_code == 0 and "cut off" in r.output, r.output
    r = _cli("show", job["dir"] / "plan.json", "--run", log, "--out", tmp_path / "r.html")
    assert r.exit_code == 0 and "warning: run log" in r.output and "cut off" in r.output, r.output


# ---- item 6: options and the data file, before launch -------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--adam-eps", "0"], "--adam-eps must be > 0"),
    (["--momentum", "nan"], "--momentum must be a finite number"),
    (["--momentum", "1"], "--momentum must be >= 0 and < 1"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    (["--timeout", "nan"], "--timeout must be a finite number"),
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--dropout", "1.5"], "--dropout must be >= 0 and < 1"),
    (["--seed", "-1"], "--seed must lie in"),
    (["--nnodes", "abc"], "--nnodes 'abc': expected a node count"),
    (["--nnodes", "1:2"], "the node count cannot vary"),
    (["--nnodes", "0"], "--nnodes must be at least 1"),
    (["--master-port", "99999999"], "--master-port must be a TCP port in 1..65535"),
    (["--rdzv-endpoint", "host"], "expected HOST:PORT"),
    (["--rdzv-endpoint", "host:70000"], "expected HOST:PORT"),
    (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
    (["--nproc-per-node", "1", "--nnodes", "2"], "--nnodes 2 needs a rendezvous"),
    (["--node-rank", "3"], "--node-rank must lie in 0..0"),
    (["--warmup-steps", "100000"], "--warmup-steps 100000 is not shorter than the run (8 steps at most: 2 epochs"),
])
def test_every_option_is_checked_before_launch(job, args, message):
    r = _cli(*_run_args(job), *args)
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and message in r.output and r.output.count("\n") == 1, r.output


def test_a_device_the_machine_lacks_is_refused_before_launch(job):
    """--dry-run passed --device cuda on a machine without CUDA (a CLI audit); the run then failed in every worker.
    One check (``job.check_cuda``) now serves the launcher and the workers."""
    import torch

    r = _cli(*_run_args(job, "--device", "cuda"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        assert r.exit_code == 0, r.output
    elif torch.cuda.is_available():
        assert r.exit_code == 2 and "--nproc-per-node 2 needs 2 CUDA devices but only 1 are visible" in r.output
    else:
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
        assert "--device cuda but this torch build or machine has no CUDA device" in r.output, r.output


def test_nnodes_min_equal_max_is_the_fixed_count(job):
    r = _cli(*_run_args(job, "--nnodes", "1:1"))
    assert r.exit_code == 0 and "--nnodes=1 --standalone" in r.output, r.output


@pytest.fixture(scope="module")
def plan48(tmp_path_factory):
    """A 48-token bert-tiny plan (the issue's case: 64- and 16-token files must be refused before launch)."""
    d = tmp_path_factory.mktemp("seq48")
    model = build_model("bert-tiny", seq_len=48, dropout=0.0)
    save_plan(make_plan(model, [spec(0, K=1, D=2, M=1, b=2)], samples_per_epoch=16), d / "plan.json")
    return d, model


def _bad_data(model, tmp_path, case):
    x, y, m = model.make_batch(16, generator=torch.Generator().manual_seed(0))
    if case == "64 tokens":
        x, m = torch.cat([x, x[:, :16]], 1), torch.cat([m, m[:, :16]], 1)
    elif case == "16 tokens":
        x, m = x[:, :16], m[:, :16]
    elif case == "float ids":
        x = x.float()
    elif case == "ids beyond the vocabulary":
        x[3, 5] = model.config.vocab_size
    elif case == "negative ids":
        x[0, 0] = -1
    elif case == "labels beyond the classes":
        y[2] = 7
    elif case == "float labels":
        y = y.float()
    elif case == "mask values":
        m[1, 1] = 2
    elif case == "too few samples":
        x, y, m = x[:1], y[:1], m[:1]
    path = tmp_path / "data.pt"
    torch.save({"inputs": x, "labels": y, "attention_mask": m}, path)
    return path


@pytest.mark.parametrize("case, message", [
    ("64 tokens", "inputs of shape [16, 64] but the plan's bert-tiny takes [samples, 48]"),
    ("16 tokens", "inputs of shape [16, 16] but the plan's bert-tiny takes [samples, 48]"),
    ("float ids", "token ids must be an integer tensor"),
    ("ids beyond the vocabulary", "..1024 but bert-tiny's vocabulary has 1024 entries (0..1023)"),
    ("negative ids", "token ids span -1.."),
    ("labels beyond the classes", "..7 but the classification head has 2 classes"),
    ("float labels", "labels are torch.float32"),
    ("mask values", "attention_mask must hold only 0 and 1"),
    ("too few samples", "has 1 samples, fewer than one global batch of 4"),
])
def test_the_data_file_is_checked_before_launch(plan48, tmp_path, case, message):
    d, model = plan48
    data = _bad_data(model, tmp_path, case)
    log = tmp_path / "run.jsonl"
    log.write_text("previous run\n")
    r = _cli("run", d / "plan.json", "--model", "bert-tiny", "--nproc-per-node", "2", "--data", data, "--log", log)
    assert r.exit_code == 2, r.output
    assert r.output.startswith(f"error: --data {data}") and message in r.output, r.output
    assert log.read_text() == "previous run\n"  # refused before anything ran or was written


# ---- item 8: outputs ---------------------------------------------------------------------------------------

def _digest(*paths):
    return [p.read_bytes() for p in paths]


def test_no_command_writes_over_its_inputs(job, tmp_path):
    d = job["dir"]
    plan, data, log = d / "plan.json", d / "data.pt", tmp_path / "run.jsonl"
    rl = RunLog(log)
    _header(rl, job["plan"])
    rl.step(epoch=0, step=0, phase=0, frozen_blocks=0, K=2, D=1, seconds=0.1, samples=4, loss=1.0)
    rl.close()
    before = _digest(plan, data, log)
    cases = [
        (["compare", plan, log, "--json", log], "--json", "run log"),
        (["compare", plan, log, "--json", plan], "--json", "plan"),
        (["show", plan, "--run", log, "--out", log], "--out", "run log"),
        (_run_args(job, "--log", plan), "--log", "plan"),
        (_run_args(job, "--log", data), "--log", "--data file"),
    ]
    for args, opt, what in cases:
        r = _cli(*args)
        assert r.exit_code == 2, (args, r.output)
        assert r.output.startswith(f"error: {opt} ") and f"is the {what} itself" in r.output, r.output
        assert r.output.count("\n") == 1, r.output  # nothing printed before the refusal
    r = _cli(*_run_args(job, "--log", tmp_path / "ck" / "checkpoint.pt", "--checkpoint-dir", tmp_path / "ck"))
    assert r.exit_code == 2 and "are the same file" in r.output, r.output
    assert _digest(plan, data, log) == before


def test_an_output_in_a_missing_folder_is_refused_before_anything_is_written(job, tmp_path):
    d = job["dir"]
    r = _cli("compare", d / "plan.json", job["dir"] / "run.jsonl", "--json", tmp_path / "no" / "such" / "c.json")
    assert r.exit_code == 2 and "does not exist" in r.output and r.output.count("\n") == 1, r.output
    out = tmp_path / "p.json"
    r = _cli("plan", "bert-tiny", "--cluster", "cpu:2", "--out", out, "--report", tmp_path / "no" / "r.html",
             "--quiet")
    assert r.exit_code == 2 and not out.exists(), r.output  # all outputs or none
    prof = tmp_path / "prof.json"
    from ptplan.profiles import shipped
    prof.write_bytes(shipped("bert-tiny_cpu_fp32").read_bytes())
    r = _cli("plan", prof, "--cluster", "cpu:2", "--out", prof)
    assert r.exit_code == 2 and "also an input" in r.output
    assert prof.read_bytes() == shipped("bert-tiny_cpu_fp32").read_bytes()
