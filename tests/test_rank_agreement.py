"""Checks that used to run on some ranks only, before a collective: now every rank raises the same error.

Found by an audit (2026-11-27): a check or decision taken on one rank (or from one node's own files) let the other
ranks block in the next collective (gloo: "connection reset by peer"; NCCL: a hang until --timeout). Each case here
runs two real processes, gives the ranks different inputs, and checks that both exit with the one clear message."""
from __future__ import annotations

import math

import pytest
import torch

from ptplan.executor.data.dataset import SyntheticDataset
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.freezing import FreezeSchedule
from ptplan.executor.runtime.collective import ranks_text as _ranges
from ptplan.executor.training.loop import _decide, run_training
from ptplan.executor.training.state import Position
from ptplan.planner.errors import PtplanError


def _both_refuse(res, needle: str) -> None:
    assert not res.ok and all(code == 1 for code in res.exitcodes), res.explain()
    for err in res.errors:
        assert "PtplanError" in err and needle in err, err
        assert "Connection" not in err and "timed out" not in err.lower(), err


def _run(tmp_path, sizes: tuple[int, int], samples_per_epoch: int = 8):
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=2, M=1, b=2)], trajectory=[0], samples_per_epoch=samples_per_epoch)
    cfg = RunConfig(plan="(test)", model="bert-tiny", epochs=1, steps_per_epoch=1, progress=False, timeout_s=20)

    def worker(rank: int, world: int) -> None:
        run_training(cfg, plan, model, SyntheticDataset(model, sizes[rank]))

    return run_world(2, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120)


def test_data_of_different_lengths_on_two_ranks_is_refused_on_both(tmp_path):
    """Each node loads its own --data: a shorter copy on one node used to end its epochs early."""
    res = _run(tmp_path, (12, 10))
    _both_refuse(res, "rank 0: 12 samples; rank 1: 10 samples")


def test_a_check_failing_on_one_rank_is_raised_on_every_rank(tmp_path):
    """Rank 1's data cannot fill one global batch of the plan; rank 0's can: both raise rank 1's refusal (before,
    rank 0 went on into the first collective and died there)."""
    res = _run(tmp_path, (8, 3))
    assert not res.ok
    _both_refuse(res, "3")


def test_the_same_data_on_every_rank_trains(tmp_path):
    assert _run(tmp_path, (8, 8)).ok


def _adaptive_worker(rank: int, world: int, norms: list[float]) -> None:
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=2, M=1, b=2)], trajectory=[0], samples_per_epoch=8)
    fs = FreezeSchedule(plan, "adaptive", num_blocks=model.num_blocks, every=1)
    cfg = RunConfig(plan="(test)", model="bert-tiny", freeze="adaptive", freeze_every=1)
    pos = Position(global_step=1, norm_sum=list(norms), norm_count=1)
    want, record = _decide(cfg, fs, pos)
    assert record is not None and want >= 0


@pytest.mark.parametrize("norms, ok", [([2.0, 1.5, 1.0, 0.5], True), ([math.inf, 1.5, 1.0, 0.5], False)])
def test_the_adaptive_freeze_decision_is_refused_on_every_rank(tmp_path, norms, ok):
    """A non-finite gradient norm (an overflow while the loss stays finite) made ``next_frozen`` raise on rank 0,
    the only rank that decided, while rank 1 waited in the broadcast of its decision."""
    res = run_world(2, _adaptive_worker, (norms,), tmpdir=str(tmp_path), timeout_s=10, deadline_s=60)
    if ok:
        assert res.ok, res.explain()
    else:
        _both_refuse(res, "gradient norm")


def test_rank_ranges():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8" and _ranges([3]) == "rank 3"


def test_an_export_failing_with_an_os_error_on_rank_0_is_raised_on_every_rank(tmp_path):
    """Rank 0 writes the export; an OSError outside export_hf's own checks (its temporary folder on a full disk)
    escaped the ``except PtplanError`` before the ranks' agreement, and the other ranks waited there."""
    import errno

    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=2, M=1, b=2)], trajectory=[0], samples_per_epoch=8)
    cfg = RunConfig(plan="(test)", model="bert-tiny", epochs=1, steps_per_epoch=1, progress=False, timeout_s=20,
                    export=str(tmp_path / "out"))

    def worker(rank: int, world: int) -> None:
        import tempfile

        def full(*a, **kw):
            raise OSError(errno.ENOSPC, "No space left on device")

        if rank == 0:
            tempfile.mkdtemp = full  # this forked child only
        run_training(cfg, plan, model, SyntheticDataset(model, 8))

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120)
    _both_refuse(res, "cannot write the export")


def test_a_run_log_write_error_on_rank_0_stops_every_rank_with_its_message(tmp_path):
    """Rank 0 alone writes the run log; its disk filling up raised there while the other ranks went into the next
    step's collectives. The error now waits in ``RunLog.error`` and the next step's all-reduce carries a stop flag:
    both ranks raise rank 0's message, and the log ends at its last whole record."""
    from ptplan.executor.training.runlog import RunLog
    from ptplan.planner.runlog import read_run_log

    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=2, M=1, b=2)], trajectory=[0], samples_per_epoch=8)
    log = tmp_path / "run.jsonl"
    cfg = RunConfig(plan="(test)", model="bert-tiny", epochs=3, progress=False, timeout_s=20, log=str(log))

    def worker(rank: int, world: int) -> None:
        if rank == 0:
            real, lines = RunLog._append, [0]

            def failing(self, line):
                lines[0] += 1
                if lines[0] > 4:  # the header and three steps fit
                    raise PtplanError(f"cannot write the run log {self.path}: No space left on device (the disk is "
                                      f"full)")
                real(self, line)
            RunLog._append = failing  # this forked child only
        run_training(cfg, plan, model, SyntheticDataset(model, 8))

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120)
    _both_refuse(res, "cannot write the run log")
    assert [s.step for s in read_run_log(log).steps] == [0, 1, 2]


@pytest.mark.parametrize("restarts", ["0", "1"])
def test_a_torchrun_restart_keeps_the_best_export_so_far(tmp_path, restarts):
    """--export-best writes its folder at the first evaluation; a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0,
    no --resume) found it there and refused to start (on the nodes that see the folder only, before the ranks
    agreed on inputs). A fresh start still refuses a non-empty folder; a restart goes on."""
    import os

    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plan = make_plan(model, [spec(0, K=1, D=1, M=1, b=2)], trajectory=[0], samples_per_epoch=8)
    out = tmp_path / "best"
    out.mkdir()
    (out / "config.json").write_text("{}")  # the earlier attempt's best model
    cfg = RunConfig(plan="(test)", model="bert-tiny", epochs=1, steps_per_epoch=1, progress=False, timeout_s=20,
                    export=str(out), export_best=True, eval_data="(test)")

    def worker(rank: int, world: int) -> None:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restarts
        run_training(cfg, plan, model, SyntheticDataset(model, 8), eval_dataset=SyntheticDataset(model, 4, seed=1))

    res = run_world(1, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120)
    if restarts == "0":
        _both_refuse(res, "exists and is not an empty folder")
    else:
        assert res.ok, res.explain()
        assert (out / "config.json").read_text() != "{}"  # replaced by this run's best


def test_an_unreadable_sharded_checkpoint_is_a_reason_for_the_agreement(tmp_path):
    """``sharded._check_keys`` read DCP's metadata outside ``agree``: a torn file raised on the ranks that read it
    before the others' all-gather. It now returns the reason, which ``agree`` raises on every rank."""
    from ptplan.executor.training.sharded import _check_keys

    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    why = _check_keys(str(tmp_path), {"w": torch.zeros(2)})
    assert why is not None and "cannot read the sharded checkpoint's metadata" in why
    assert "cannot read" in (_check_keys(str(tmp_path / "missing"), {}) or "")


def _eval_wire(rank: int, world: int) -> None:
    from ptplan.executor.training.evaluate import _recv, _send

    sent = [torch.arange(6).reshape(2, 3), torch.tensor([True, False]), torch.randn(2, 2, dtype=torch.bfloat16)]
    for t in sent:
        if rank == 0:
            _send(t, 1, torch.device("cpu"))
        else:
            got = _recv(0, torch.device("cpu"))
            assert got.dtype == t.dtype and torch.equal(got, t), (got, t)


def test_evaluation_sends_what_training_sends(tmp_path):
    """Evaluation had its own message header with four float dtypes: an integer or bool activation that training
    passes between stages was refused on the sender alone while its receiver waited. It now uses the pipeline's
    codec (``step.encode_head``): two real processes pass int64, bool and bfloat16 tensors."""
    res = run_world(2, _eval_wire, tmpdir=str(tmp_path), timeout_s=20, deadline_s=60)
    assert res.ok, res.explain()


def test_two_ranks_with_different_plans_are_refused_on_both(tmp_path):
    """Each node reads its own plan file: two that differ (another micro-batch count) would run different
    schedules against each other. Both ranks name the two plans."""
    model = build_model("bert-tiny", seq_len=8, dropout=0.0)
    plans = [make_plan(model, [spec(0, K=1, D=2, M=m, b=2 // m)], trajectory=[0], samples_per_epoch=8)
             for m in (1, 2)]
    cfg = RunConfig(plan="plan.json", model="bert-tiny", epochs=1, steps_per_epoch=1, progress=False, timeout_s=20)

    def worker(rank: int, world: int) -> None:
        run_training(cfg, plans[rank], model, SyntheticDataset(model, 8))

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=20, deadline_s=120)
    _both_refuse(res, "the ranks run different plans")
