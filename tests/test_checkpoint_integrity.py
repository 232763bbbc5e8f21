"""Damaged checkpoints through the real paths (an audit's findings): a sharded save's missing, truncated or empty
``.distcp`` file, and flipped bytes in a shard or in ``checkpoint.pt``, are each one message naming the file --
from ``ptplan run --resume --dry-run`` before launch (exit 2, one line) and from the workers' own check (every
rank raises it before training). A checkpoint written before checksums still resumes, unchecked.

The checkpoints are real: a 1-epoch bert-tiny run on 2 forked gloo ranks writes one in each format (its end, step
4); each test damages a copy and resumes it with --epochs 2.
"""
from __future__ import annotations

import json
import os
import shutil
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.data.dataset import load_dataset
from ptplan.executor.launch.local import run_world
from ptplan.executor.training import checkpoint as ckpt, sharded
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.loop import run_training
from ptplan.executor.training.runlog import read_records
from ptplan.planner.errors import PtplanError
from tests.parity import two_phase_job

SEQ, N = 8, 16

pytestmark = pytest.mark.multiproc


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A plan, its data and one checkpoint per format (``single``, ``sharded``), each at step 4 of 8."""
    d = tmp_path_factory.mktemp("integrity")
    model, plan = two_phase_job(d, SEQ, N)
    data = load_dataset(str(d / "data.pt"))

    def cfg(fmt, folder, **kw):
        base = dict(plan=str(d / "plan.json"), model="bert-tiny", num_labels=2, data=str(d / "data.pt"), epochs=1,
                    progress=False, timeout_s=30, log=str(d / f"{fmt}.jsonl"), checkpoint_dir=str(folder),
                    checkpoint_format=fmt)
        return RunConfig(**{**base, **kw})

    for fmt in ("single", "sharded"):
        c = cfg(fmt, d / fmt)
        res = run_world(2, lambda rank, world: run_training(c, plan, model, data), tmpdir=str(d), timeout_s=30,
                        deadline_s=120)
        assert res.ok, res.explain()
    return {"dir": d, "model": model, "plan": plan, "data": data, "cfg": cfg, "single": d / "single",
            "sharded": d / "sharded"}


def _flip(path, at: int) -> None:
    """64 bytes inverted at byte ``at`` of ``path`` (the audit's damage)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(64)
        f.seek(at)
        f.write(bytes(x ^ 0xFF for x in b))


def _damage(job, tmp_path, fmt: str, damage: str):
    """A copy of ``fmt``'s checkpoint with ``damage``; returns (its folder, the damaged file)."""
    folder = tmp_path / "ck"
    shutil.copytree(job[fmt], folder)
    if fmt == "single":
        path = folder / "checkpoint.pt"
        if damage == "flipped":  # inside the largest tensor record (the word embeddings), as the audit did
            with zipfile.ZipFile(path) as z:
                big = max(z.infolist(), key=lambda i: i.compress_size)
            _flip(path, big.header_offset + big.compress_size // 2)
        elif damage == "old":  # as written before checksums: no ``checksums`` field
            data = torch.load(path, weights_only=True)
            del data["checksums"]
            torch.save(data, path)
        return folder, path
    meta_file = folder / "sharded.json"
    meta = json.loads(meta_file.read_text())
    shard = folder / meta["folder"] / "__1_0.distcp"
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "empty":
        os.truncate(shard, 0)
    elif damage == "flipped":
        _flip(shard, shard.stat().st_size // 2)
    elif damage == "torn metadata":  # before: refused by the workers only, after launch
        shard = folder / meta["folder"] / ".metadata"
        os.truncate(shard, 1000)
    elif damage == "old":  # as written before checksums: no ``files``
        del meta["files"]
        meta_file.write_text(json.dumps(meta))
        return folder, meta_file
    return folder, shard


def _dry_run(job, folder, fmt):
    d = job["dir"]
    return CliRunner().invoke(cli, list(map(str, [
        "run", d / "plan.json", "--model", "bert-tiny", "--nproc-per-node", "2", "--data", d / "data.pt",
        "--epochs", "2", "--checkpoint-dir", folder, "--checkpoint-format", fmt, "--resume", "--dry-run"])))


def _resume(job, tmp_path, folder, fmt):
    """``run_training`` with --resume on 2 forked ranks (the workers' own look: several nodes skip the launcher's)."""
    cfg = job["cfg"](fmt, folder, resume=True, epochs=2, log=str(tmp_path / "run.jsonl"))

    def worker(rank, world):
        run_training(cfg, job["plan"], job["model"], job["data"])

    return run_world(2, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=120)


def test_a_save_records_every_file_with_its_checksum(job):
    meta = json.loads((job["sharded"] / "sharded.json").read_text())
    step = job["sharded"] / meta["folder"]
    assert sorted(meta["files"]) == sorted(os.listdir(step)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for name, rec in meta["files"].items():
        assert rec == {"bytes": (step / name).stat().st_size, "crc32": sharded.file_crc32(str(step / name))}
    data = torch.load(job["single"] / "checkpoint.pt", weights_only=True, mmap=True)
    assert data["checksums"] == ckpt.CHECKSUMS
    with zipfile.ZipFile(job["single"] / "checkpoint.pt") as z:
        assert z.testzip() is None and all(i.CRC != 0 for i in z.infolist() if i.file_size)


@pytest.mark.parametrize("fmt,damage,says", [
    ("sharded", "missing", "is missing (its .metadata places"),
    ("sharded", "truncated", "but its .metadata places tensor items up to byte"),
    ("sharded", "empty", "is empty (0 bytes), but its .metadata places tensor items up to byte"),
    ("sharded", "flipped", "is damaged: its CRC-32 is"),
    ("sharded", "torn metadata", "cannot be read (UnpicklingError: pickle data was truncated)"),
    ("single", "flipped", "is damaged: its record archive/data/"),
])
def test_a_damaged_checkpoint_is_one_message_naming_the_file_before_launch_and_in_the_workers(
        job, tmp_path, fmt, damage, says):
    """The audit: a missing/truncated/empty shard gave `rank 1 failed: CheckpointException ... Traceback`, exit 1,
    after the workers started; flipped bytes in either format resumed silently (exit 0, 73 tensors differing)."""
    folder, path = _damage(job, tmp_path, fmt, damage)
    r = _dry_run(job, folder, fmt)
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1, r.output
    assert str(path) in r.output and says in r.output and "start without --resume" in r.output, r.output
    assert "Traceback" not in r.output

    res = _resume(job, tmp_path, folder, fmt)
    assert res.exitcodes == (1, 1), res.explain()
    for e in res.errors:
        assert "PtplanError: " in e and str(path) in e and says in e, e
        assert "CheckpointException" not in e, e
    assert not (tmp_path / "run.jsonl").exists()


@pytest.mark.parametrize("fmt", ["single", "sharded"])
def test_a_checkpoint_written_before_checksums_still_resumes(job, tmp_path, fmt):
    folder, _ = _damage(job, tmp_path, fmt, "old")
    r = _dry_run(job, folder, fmt)
    assert r.exit_code == 0, r.output
    res = _resume(job, tmp_path, folder, fmt)
    assert res.ok, res.explain()
    records = read_records(str(tmp_path / "run.jsonl"))
    assert [r["step"] for r in records if r["type"] == "resume"] == [4]
    assert max(r["step"] for r in records if r["type"] == "step") == 7


def _load_damaged(rank, world, folders, out):
    """``sharded._load`` of a whole save (the checks before it skipped) from each folder; the messages to ``out``."""
    said = []
    for folder in folders:
        md = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        want = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in md.items()}
        try:
            sharded._load(want, folder)
            said.append("loaded")
        except PtplanError as e:
            said.append(str(e))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(said, f)


def test_a_load_that_fails_in_dcp_is_one_message_naming_the_cause(job, tmp_path):
    """A file that goes bad after the checks (between ``find`` and the load): DCP's CheckpointException (every
    rank's traceback) becomes one PtplanError naming the first cause."""
    folders = []
    for damage in ("missing", "truncated"):
        (tmp_path / damage).mkdir()
        folder, _ = _damage(job, tmp_path / damage, "sharded", damage)
        folders.append(str(folder / json.loads((folder / "sharded.json").read_text())["folder"]))
    out = str(tmp_path / "said")
    res = run_world(2, _load_damaged, (folders, out), tmpdir=str(tmp_path), timeout_s=30, deadline_s=60)
    assert res.ok, res.explain()
    for rank in range(2):
        missing, truncated = json.load(open(f"{out}.{rank}"))
        assert missing.startswith(f"cannot read the sharded checkpoint {folders[0]} (ranks 0-1): FileNotFoundError")
        assert os.path.join(folders[0], "__1_0.distcp") in missing and "Traceback" not in missing, missing
        assert truncated.startswith(f"cannot read the sharded checkpoint {folders[1]} (rank"), truncated
        assert "EOFError" in truncated and "Traceback" not in truncated, truncated
