"""The training loop's callbacks (issue 21, item 2), each on its own: one real rank (a forked gloo world of
one process), a real runtime in phase 0 of a two-phase bert-tiny plan, and the callback's hooks called by
hand -- or a whole run with a recording callback to pin the order of the hooks."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import pytest
import torch

from ptplan.executor.data.dataset import TensorDataset, epoch_order
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.runtime.optim import lr_factor
from ptplan.executor.training import callbacks as cb
from ptplan.executor.training import loop
from ptplan.executor.training.checkpoint import load_checkpoint
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.runlog import read_records
from ptplan.executor.training.state import RunContext, StepResult
from ptplan.planner.errors import PtplanError

pytestmark = pytest.mark.multiproc


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _job() -> tuple[Any, Any, Any]:
    model = build_model("bert-tiny", seq_len=8, dropout=0.0, seed=0)
    plan = make_plan(model, [spec(0, K=1, D=1, M=1, b=4), spec(1, K=1, D=1, M=2, b=2)], trajectory=[0, 1],
                     samples_per_epoch=16)
    data = TensorDataset(*model.make_batch(16, generator=torch.Generator().manual_seed(1)))
    return model, plan, data


def _cfg(tmp: str, **kw: Any) -> RunConfig:
    base = dict(plan="(test)", model="bert-tiny", optimizer="sgd", lr=0.05, epochs=1, steps_per_epoch=4,
                progress=False, timeout_s=30, log=os.path.join(tmp, "run.jsonl"))
    return RunConfig(**{**base, **kw})


def _one_rank(tmp_path, cfg: RunConfig, body: Callable[[RunContext], Any]) -> Any:
    """``body(ctx)`` on one forked rank, the runtime in phase 0 and the run log open; returns what it returned
    (JSON round-tripped)."""
    out = tmp_path / "out.json"

    def worker(rank: int, world: int) -> None:
        model, plan, data = _job()
        ctx, source = loop._prepare(cfg, plan, model, data, torch.device("cpu"), None)
        loop._enter(ctx, cb.Callbacks([]), source)
        try:
            got = body(ctx)
        finally:
            ctx.log.close()
        out.write_text(json.dumps(got))

    res = run_world(1, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=90)
    assert res.ok, res.explain()
    return json.loads(out.read_text())


def _train(ctx: RunContext, cbs: cb.Callbacks, steps: int) -> None:
    order = epoch_order(len(ctx.dataset), ctx.cfg.seed, ctx.pos.epoch, ctx.cfg.shuffle)
    for _ in range(steps):
        loop._step(ctx, cbs, order)


def test_callbacks_finish_closes_every_part_even_when_one_raises():
    seen = []

    class Closer(cb.Callback):
        def __init__(self, name: str, fail: bool = False) -> None:
            self.name, self.fail = name, fail

        def on_finish(self, ctx, ok):
            seen.append((self.name, ok))
            if self.fail:
                raise OSError(f"{self.name} failed")

    cbs = cb.Callbacks([Closer("a", fail=True), Closer("b"), Closer("c", fail=True)])
    with pytest.raises(OSError, match="a failed"):
        cbs.finish(None, False)  # type: ignore[arg-type]
    assert seen == [("a", False), ("b", False), ("c", False)]
    assert cbs.find(Closer).name == "a" and cbs.find(cb.Progress) is None


def test_default_callbacks_are_in_the_order_the_run_log_needs():
    names = [type(c).__name__ for c in cb.default_callbacks(cb.Hooks(after_step=lambda s, r: None), object())]
    assert names == ["Snapshots", "AutoCache", "PeakMemory", "LRSchedule", "StepLog", "DivergenceGuard", "Progress",
                     "Evaluation", "ModelSaves", "Checkpointing", "FinalExport", "AfterStepHook"]
    assert "Evaluation" not in [type(c).__name__ for c in cb.default_callbacks(cb.Hooks(), None)]


def test_score_prefers_accuracy_then_lower_loss():
    from ptplan.executor.training.evaluate import Metrics

    def m(loss: float, acc: float | None) -> Metrics:
        return Metrics(loss=loss, accuracy=acc, perplexity=None if acc is not None else math.exp(loss), samples=8,
                       seconds=0.1)

    assert cb.score(m(0.9, 0.75)) > cb.score(m(0.5, 0.5))
    assert cb.score(m(0.4, 0.5)) > cb.score(m(0.5, 0.5))
    assert cb.score(m(0.4, None)) > cb.score(m(0.5, None))


def test_lr_schedule_sets_every_group_and_logs_the_rate(tmp_path):
    cfg = _cfg(str(tmp_path), lr_schedule="linear", warmup_steps=2, weight_decay=0.01)

    def body(ctx: RunContext) -> Any:
        lrs, logged = [], []
        sched = cb.LRSchedule()
        for step in range(4):
            ctx.pos.global_step = step
            sched.before_step(ctx)
            lrs.append([g["lr"] for g in ctx.rt.opt.param_groups])
            r = StepResult(seconds=0.1, loss=1.0)
            sched.on_step(ctx, r)
            logged.append(r.fields["lr"])
        return {"total": ctx.total, "lrs": lrs, "logged": logged}

    got = _one_rank(tmp_path, cfg, body)
    want = [0.05 * lr_factor(t, warmup=2, total=4, kind="linear") for t in range(4)]
    assert got["total"] == 4
    assert got["logged"] == pytest.approx(want)
    assert all(len(g) == 2 and g == pytest.approx([w, w]) for g, w in zip(got["lrs"], want))  # decay + no decay


def test_a_constant_rate_is_not_logged(tmp_path):
    def body(ctx: RunContext) -> Any:
        sched, r = cb.LRSchedule(), StepResult(seconds=0.1, loss=1.0)
        sched.before_step(ctx)
        sched.on_step(ctx, r)
        return r.fields

    assert _one_rank(tmp_path, _cfg(str(tmp_path)), body) == {}


def test_step_log_writes_the_phase_and_the_fields_callbacks_added(tmp_path):
    cfg = _cfg(str(tmp_path))

    def body(ctx: RunContext) -> Any:
        ctx.pos.global_step, ctx.pos.epoch = 3, 0
        cb.StepLog().on_step(ctx, StepResult(seconds=0.25, loss=0.5, fields={"lr": 0.01}))
        return None

    _one_rank(tmp_path, cfg, body)
    (rec,) = [r for r in read_records(cfg.log) if r["type"] == "step"]
    assert rec == {"type": "step", "epoch": 0, "step": 3, "phase": 0, "frozen_blocks": 0, "K": 1, "D": 1,
                   "seconds": 0.25, "samples": 4, "loss": 0.5, "allreduce_seconds": 0.0, "lr": 0.01}


def test_divergence_guard_stops_on_a_non_finite_loss_and_names_the_step(tmp_path):
    def body(ctx: RunContext) -> Any:
        guard = cb.DivergenceGuard()
        guard.on_step(ctx, StepResult(seconds=0.1, loss=2.0))  # finite: nothing
        ctx.pos.global_step = 7
        try:
            guard.on_step(ctx, StepResult(seconds=0.1, loss=float("nan")))
        except PtplanError as e:
            return str(e)
        return None

    msg = _one_rank(tmp_path, _cfg(str(tmp_path)), body)
    assert msg is not None and "the loss is nan at step 7" in msg and "phase 0" in msg and "lower --lr" in msg


def test_peak_memory_measures_the_second_step_of_each_visit(tmp_path):
    class Fields(cb.Callback):
        def __init__(self) -> None:
            self.got: list[list[str]] = []

        def on_step(self, ctx, result):
            self.got.append(sorted(result.fields))

    def body(ctx: RunContext) -> Any:
        rec = Fields()
        _train(ctx, cb.Callbacks([cb.PeakMemory(), rec]), 3)
        return rec.got

    got = _one_rank(tmp_path, _cfg(str(tmp_path)), body)
    assert got[0] == [] and got[2] == []
    assert {"memory_sampled", "peak_memory_bytes", "memory"} <= set(got[1])


def test_checkpointing_saves_every_n_steps_and_once_at_the_epoch_end(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = _cfg(str(tmp_path), checkpoint_dir=ck, checkpoint_every=2)

    def body(ctx: RunContext) -> Any:
        saved: list[int] = []
        part = cb.Checkpointing(save=lambda c: (saved.append(c.pos.global_step), cb.save_checkpoint(c)))
        part.on_start(ctx)
        for step in range(1, 4):
            ctx.pos.global_step = step
            part.after_step(ctx)
        part.after_epoch(ctx)  # step 3: not saved yet
        part.after_epoch(ctx)  # step 3 again: already saved
        ctx.pos.global_step = 4
        part.after_step(ctx)
        part.after_epoch(ctx)
        return saved

    assert _one_rank(tmp_path, cfg, body) == [2, 3, 4]
    data = load_checkpoint(ck)
    assert data["position"]["global_step"] == 4 and data["world_size"] == 1 and data["run"]["samples"] == 16


def test_evaluation_at_the_epoch_end_is_skipped_when_the_step_just_evaluated(tmp_path):
    cfg = _cfg(str(tmp_path), eval_every=2, eval_data="(the training data)")

    def body(ctx: RunContext) -> Any:
        ev = cb.Evaluation(ctx.dataset)
        ctx.pos.global_step = 1
        cb.StepLog().on_step(ctx, StepResult(seconds=0.1, loss=1.0))  # a new log is written from its first step
        ctx.pos.global_step = 2
        ev.after_step(ctx)
        ev.on_epoch_end(ctx)
        ctx.pos.global_step = 3
        ev.after_step(ctx)
        ev.on_epoch_end(ctx)
        return ev.at

    assert _one_rank(tmp_path, cfg, body) == [2, 3]
    assert [(r["type"], r["step"]) for r in read_records(cfg.log) if r["type"] != "header"] \
        == [("step", 1), ("eval", 2), ("eval", 3)]


def test_a_resume_at_an_evaluated_step_does_not_evaluate_it_again_at_the_epoch_end(tmp_path):
    cfg = _cfg(str(tmp_path), eval_every=2, eval_data="(the training data)")

    def body(ctx: RunContext) -> Any:
        out = []
        for resuming, step in ((True, 4), (True, 3), (False, 4)):
            ev = cb.Evaluation(ctx.dataset)
            ctx.resuming, ctx.pos.global_step = resuming, step
            ev.on_start(ctx)
            ev.on_epoch_end(ctx)
            out.append(len(ev.evals))
        return out

    assert _one_rank(tmp_path, cfg, body) == [0, 1, 1]


def test_a_run_calls_the_hooks_in_order_and_finishes_after_an_error(tmp_path):
    trace = tmp_path / "trace.txt"

    class Trace(cb.Callback):
        def __init__(self, fail_at: int | None = None) -> None:
            self.fail_at = fail_at

        def _w(self, text: str) -> None:
            with open(trace, "a") as f:
                f.write(text + "\n")

        def on_start(self, ctx): self._w(f"start {ctx.pos.global_step}")
        def on_transition(self, ctx, info): self._w(f"transition {info['from_phase']}->{info['to_phase']}")
        def before_step(self, ctx): self._w(f"before {ctx.pos.global_step}")
        def on_step(self, ctx, result): self._w(f"step {ctx.pos.global_step}")

        def after_step(self, ctx):
            self._w(f"after {ctx.pos.global_step}")
            if ctx.pos.global_step == self.fail_at:
                raise RuntimeError("stop here")

        def on_epoch_end(self, ctx): self._w(f"epoch_end {ctx.pos.epoch}")
        def after_epoch(self, ctx): self._w(f"after_epoch {ctx.pos.epoch}")
        def on_end(self, ctx): self._w("end")
        def on_finish(self, ctx, ok): self._w(f"finish {ok}")

    cfg = _cfg(str(tmp_path), freeze_every=2, steps_per_epoch=3)

    def run(fail_at: int | None) -> Any:
        def worker(rank: int, world: int) -> None:
            model, plan, data = _job()
            loop.run_training(cfg, plan, model, data, callbacks=[Trace(fail_at)])
        return run_world(1, worker, tmpdir=str(tmp_path), timeout_s=30, deadline_s=90)

    assert run(None).ok
    lines = trace.read_text().split("\n")[:-1]
    assert lines == ["start 0", "before 0", "step 0", "after 1", "before 1", "step 1", "after 2",
                     "transition 0->1", "before 2", "step 2", "after 3", "epoch_end 0", "after_epoch 1", "end",
                     "finish True"]
    assert [r["step"] for r in read_records(cfg.log) if r["type"] == "step"] == [0, 1, 2]
    trace.unlink()
    res = run(1)
    assert res.exitcodes == (1,) and "stop here" in res.errors[0]
    assert trace.read_text().split("\n")[-3:] == ["after 1", "finish False", ""]
    assert [r["step"] for r in read_records(cfg.log) if r["type"] == "step"] == [0]  # written, the log closed
