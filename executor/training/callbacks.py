"""The training loop's parts, one responsibility each: callbacks the loop calls at fixed points of a run.

Every rank calls every hook of every callback, in list order, so a hook may be collective (a gather, an
all-reduce) as long as every rank's list is the same. The hooks and when the loop calls them::

    on_start(ctx)             the model is in its first phase (or the checkpoint's); before the first step
    on_transition(ctx, info)  after a phase change was logged (``info``: the transition record's fields)
    before_step(ctx)          the batch is chosen; the step has not run
    on_step(ctx, result)      the step ran (``result``: seconds, loss, record fields); the position has not moved
    after_step(ctx)           the position moved past the step (``ctx.pos.global_step`` steps done)
    on_epoch_end(ctx)         the epoch's last step ran; the position is still in the epoch
    after_epoch(ctx)          the position moved to the next epoch
    on_end(ctx)               the last epoch ended; nothing failed
    on_finish(ctx, ok)        always, last: ``ok`` after a barrier on success, else after an error

``default_callbacks`` lists them in the order the run log's records need. ``loop.run_training`` is the loop.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch.distributed as dist
from torch import Tensor

from ptplan.planner.errors import PtplanError

from ptplan.executor.cache.run import RunCache, setup_cache
from ptplan.executor.runtime.collective import agree
from ptplan.executor.data.dataset import Dataset
from ptplan.executor.runtime.elastic import ElasticRuntime
from ptplan.executor.runtime.memory import MemorySampler, StepMemory
from ptplan.executor.runtime.optim import lr_factor
from ptplan.executor.training import checkpoint as ckpt
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.evaluate import Metrics, evaluate
from ptplan.planner.records import EvalRecord, ExportRecord, StepRecord
from ptplan.executor.training.resume import rng_state
from ptplan.executor.training.state import Position, RunContext, StepResult


class Callback:
    """A part of the run; every hook does nothing unless overridden (see the module docstring)."""

    def on_start(self, ctx: RunContext) -> None: ...
    def on_transition(self, ctx: RunContext, info: dict[str, Any]) -> None: ...
    def before_step(self, ctx: RunContext) -> None: ...
    def on_step(self, ctx: RunContext, result: StepResult) -> None: ...
    def after_step(self, ctx: RunContext) -> None: ...
    def on_epoch_end(self, ctx: RunContext) -> None: ...
    def after_epoch(self, ctx: RunContext) -> None: ...
    def on_end(self, ctx: RunContext) -> None: ...
    def on_finish(self, ctx: RunContext, ok: bool) -> None: ...


class Callbacks:
    """Calls one hook on every callback in order."""

    def __init__(self, callbacks: Iterable[Callback]) -> None:
        self.items = list(callbacks)

    def call(self, hook: str, ctx: RunContext, *args: Any) -> None:
        for cb in self.items:
            getattr(cb, hook)(ctx, *args)

    def finish(self, ctx: RunContext, ok: bool) -> None:
        """``on_finish`` on every callback even when one raises; then the first error is raised."""
        first: BaseException | None = None
        for cb in self.items:
            try:
                cb.on_finish(ctx, ok)
            except BaseException as e:  # the others still close their files
                first = first or e
        if first is not None:
            raise first

    def find(self, kind: type) -> Any:
        """The first callback of ``kind`` (None if there is none)."""
        return next((cb for cb in self.items if isinstance(cb, kind)), None)


@dataclass
class Hooks:
    """Test and tooling hooks (every rank must get the same ``snapshots`` value: gathering is collective)."""

    snapshots: bool = False
    """Gather the full model to rank 0 after every transition and at the end, and call ``on_snapshot``."""
    on_snapshot: Callable[[str, int, dict[str, Tensor]], None] | None = None
    """On rank 0: (event "start"|"transition"|"final", optimizer steps done, {parameter name: tensor})."""
    after_step: Callable[[int, int], None] | None = None
    """On every rank after each step: (optimizer steps done, rank). May raise or exit (tests)."""


class Snapshots(Callback):
    """``Hooks.snapshots``: the whole model gathered to rank 0 at the start (not on a resume), after every
    transition and at the end, handed to ``Hooks.on_snapshot``."""

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks

    def _take(self, ctx: RunContext, event: str) -> None:
        if not self.hooks.snapshots:
            return
        weights, _ = ctx.rt.gather(with_state=False)
        if ctx.rank == 0 and self.hooks.on_snapshot is not None:
            self.hooks.on_snapshot(event, ctx.pos.global_step, weights)

    def on_start(self, ctx: RunContext) -> None:
        if not ctx.resuming:
            self._take(ctx, "start")

    def on_transition(self, ctx: RunContext, info: dict[str, Any]) -> None:
        self._take(ctx, "transition")

    def on_end(self, ctx: RunContext) -> None:
        self._take(ctx, "final")


class AfterStepHook(Callback):
    """``Hooks.after_step``: a function of (optimizer steps done, rank), after everything else of the step."""

    def __init__(self, fn: Callable[[int, int], None]) -> None:
        self.fn = fn

    def after_step(self, ctx: RunContext) -> None:
        self.fn(ctx.pos.global_step, ctx.rank)


class AutoCache(Callback):
    """The node's AutoCache (``executor/cache/run.py``): ``setup`` before the first phase switch, its
    ``cache_setup`` record at the start, a ``cache`` record (eviction, counters) per epoch, and its files
    removed at the finish."""

    def __init__(self) -> None:
        self.cache: RunCache | None = None
        self._rows: tuple[int, int, int] = (0, 0, 0)

    def setup(self, ctx: RunContext, copies: Sequence[frozenset[int]]) -> None:
        """Collective; refuses a nondeterministic prefix (on the layers as built: ``copies``)."""
        self.cache = setup_cache(ctx.cfg, ctx.plan, ctx.rt.model, ctx.dataset, ctx.device, copies,
                                 layer_bytes=ctx.rt.store.sizes)
        ctx.rt.set_cache(None if self.cache is None else self.cache.cache)

    def on_start(self, ctx: RunContext) -> None:
        if self.cache is not None:
            ctx.log.write(self.cache.setup_record)

    def before_step(self, ctx: RunContext) -> None:
        if self.cache is not None:
            self._rows = self.cache.cache.row_counts()

    def on_step(self, ctx: RunContext, result: StepResult) -> None:
        """This rank's rows of the step (``cache_hits``/``cache_refreshes``/``cache_misses`` on its step record
        when it served any: ``ptplan compare`` tells fill steps from steady ones by them)."""
        if self.cache is None:
            return
        h, r, m = (b - a for a, b in zip(self._rows, self.cache.cache.row_counts()))
        if h + r + m:
            result.fields.update(cache_hits=h, cache_refreshes=r, cache_misses=m)

    def on_epoch_end(self, ctx: RunContext) -> None:
        if self.cache is not None:
            ctx.log.write(self.cache.epoch_end(ctx.rt.phase, ctx.pos.epoch, ctx.pos.global_step))

    def on_finish(self, ctx: RunContext, ok: bool) -> None:
        if self.cache is not None:
            self.cache.finish(ok=ok)  # ok: a barrier, then the creators remove the files; else at once


class PeakMemory(Callback):
    """Peak memory on the 2nd step of each phase visit (2BW: the 4th; ``executor/runtime/memory.py``), added to
    that step's record. Collective on the sampled steps."""

    def __init__(self) -> None:
        self.sampler = MemorySampler()
        self.mem: StepMemory | None = None

    def before_step(self, ctx: RunContext) -> None:
        stale = bool(getattr(ctx.rt.schedule, "stale", False))  # this phase's step from its second on
        self.mem = StepMemory(ctx.rt).start() if self.sampler.want(ctx.rt.phase_index, stale=stale) else None

    def on_step(self, ctx: RunContext, result: StepResult) -> None:
        if self.mem is not None:
            self.mem.stop()
            result.fields.update(self.mem.record())  # collective
            self.mem = None


class LRSchedule(Callback):
    """The step's learning rate (``--lr-schedule``, ``--warmup-steps``: ``optim.lr_factor``), set on every
    parameter group before the step and logged with it unless it is constant."""

    def __init__(self) -> None:
        self.lr: float | None = None

    def before_step(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        self.lr = cfg.peak_lr * lr_factor(ctx.pos.global_step, warmup=cfg.warmup_steps, total=ctx.total,
                                     kind=cfg.lr_schedule)
        for g in ctx.rt.opt.param_groups:
            g["lr"] = self.lr

    def on_step(self, ctx: RunContext, result: StepResult) -> None:
        if ctx.cfg.lr_schedule != "constant" or ctx.cfg.warmup_steps:
            result.fields["lr"] = self.lr


class StepLog(Callback):
    """The ``step`` record of every step (rank 0 writes; ``runlog.RunLog``), and the log closed at the finish."""

    def on_step(self, ctx: RunContext, result: StepResult) -> None:
        ph, rt = ctx.rt.phase, ctx.rt
        ctx.log.write(StepRecord(epoch=ctx.pos.epoch, step=ctx.pos.global_step, phase=rt.phase_index,
                                 frozen_blocks=ph.frozen_blocks, K=ph.K, D=ph.D, seconds=result.seconds,
                                 samples=ph.global_batch, loss=result.loss, allreduce_seconds=rt.last_allreduce_s,
                                 grad_norm=rt.last_grad_norm, data_seconds=result.data_seconds,
                                 cache_seconds=rt.last_cache_s, **result.fields))

    def on_finish(self, ctx: RunContext, ok: bool) -> None:
        ctx.log.close()


class DivergenceGuard(Callback):
    """Stops the run on a non-finite loss (the same all-reduced value on every rank: every rank stops at the
    same step) with a PtplanError naming the step, the phase and the fix."""

    def on_step(self, ctx: RunContext, result: StepResult) -> None:
        if not math.isfinite(result.loss):
            raise PtplanError(diverged_message(ctx.cfg, result.loss, ctx.pos, ctx.rt))


def diverged_message(cfg: RunConfig, loss: float, pos: Position, rt: ElasticRuntime) -> str:
    ph = rt.phase
    where = ckpt.checkpoint_path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    hint = (f"; {where} holds the last checkpoint: resume from it with a lower --lr"
            if where and os.path.exists(where) else "")
    return (f"the loss is {loss} at step {pos.global_step} (epoch {pos.epoch}, phase {rt.phase_index}: "
            f"{ph.frozen_blocks} frozen blocks, K={ph.K}, D={ph.D}): training diverged; lower --lr (now "
            f"{cfg.lr:g}){', raise --adam-eps' if cfg.optimizer == 'adamw' else ''} or check the data{hint}")


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **kw: Any) -> None: ...
    def close(self) -> None: ...


class Progress(Callback):
    """The progress bar (``--progress``, rank 0, on stdout: under ``ptplan run`` stderr goes to the worker log)."""

    def __init__(self) -> None:
        self.bar: Any = _NoBar()

    def on_start(self, ctx: RunContext) -> None:
        if ctx.cfg.progress and ctx.rank == 0:
            from tqdm import tqdm

            self.bar = tqdm(total=ctx.total, initial=ctx.pos.global_step, unit="step", dynamic_ncols=True,
                            file=sys.stdout)

    def after_step(self, ctx: RunContext) -> None:
        ph = ctx.rt.phase
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{ctx.loss:.4f}", f=ph.frozen_blocks, K=ph.K, D=ph.D, refresh=False)

    def on_finish(self, ctx: RunContext, ok: bool) -> None:
        self.bar.close()


def score(m: Metrics) -> tuple[float, float]:
    """Larger is better: (accuracy, -loss) for classification, (-loss, 0) for causal LM."""
    return (m.accuracy, -m.loss) if m.accuracy is not None else (-m.loss, 0.0)


def model_checkpoint_path(folder: str, step: int) -> str:
    """Where ``--save-model-every`` writes the model after ``step`` optimizer steps."""
    return os.path.join(folder, f"model-step{step:06d}")


def export_model(cfg: RunConfig, rt: ElasticRuntime, out: str, *, replace: bool = False) -> None:
    """Gather the model to rank 0 and write it as a Hugging Face folder at ``out``; every rank raises rank 0's
    error. ``replace``: ``out`` may hold an earlier export (the best so far, a model checkpoint)."""
    from ptplan.executor.training.export import export_hf

    weights, _ = rt.gather(with_state=False)
    problem = None
    if rt.rank == 0:
        try:
            export_hf(rt.model, weights, out, source=cfg.weights, replace=replace)
        except PtplanError as e:
            problem = str(e)
        except OSError as e:  # outside export_hf's own checks (its temporary folder): still raised on every rank
            problem = f"cannot write the export to {out}: {e.strerror or e}; free space there or pass another --export"
        del weights
    agree(problem)


class Evaluation(Callback):
    """``--eval-data``: the model evaluated (forward only through the current stages) every ``eval_every``
    steps and at every epoch end (unless its last step just did), as ``eval`` records; with
    ``--export-best`` the best evaluation so far exported (the same Metrics on every rank: same decision)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.evals: list[Metrics] = []
        self.at: list[int] = []

    def run(self, ctx: RunContext) -> None:
        cfg, pos = ctx.cfg, ctx.pos
        with ctx.amp():
            m = evaluate(ctx.rt, self.dataset, cfg.eval_batch_size)
        self.evals.append(m)
        self.at.append(pos.global_step)
        ctx.log.write(EvalRecord(epoch=pos.epoch, step=pos.global_step, phase=ctx.rt.phase_index, loss=m.loss,
                                 samples=m.samples, seconds=m.seconds, accuracy=m.accuracy, perplexity=m.perplexity))
        if cfg.export_best and (not pos.best_eval or score(m) > tuple(pos.best_eval[:2])):
            assert cfg.export is not None  # RunConfig checks it
            pos.best_eval = [*score(m), float(pos.global_step)]
            export_model(cfg, ctx.rt, cfg.export, replace=True)
            ctx.log.write(ExportRecord(step=pos.global_step, path=cfg.export, kind="best", loss=m.loss,
                                       accuracy=m.accuracy, perplexity=m.perplexity))

    def on_start(self, ctx: RunContext) -> None:
        """On a resume at a step that ``eval_every`` evaluated (before its checkpoint), that evaluation is in
        the log already: the epoch's end at the same step does not run it again. A resume with --export-best whose
        best model so far is not in --export (another folder than the run's before) is refused on every rank: no
        later evaluation may beat it, and the run would say it exported a folder it never wrote."""
        step, every = ctx.pos.global_step, ctx.cfg.eval_every
        if ctx.resuming and every and step and step % every == 0:
            self.at.append(step)
        cfg, best = ctx.cfg, ctx.pos.best_eval
        if ctx.resuming and cfg.export_best and best and cfg.export:
            missing = dist.get_rank() == 0 and not os.path.isfile(os.path.join(cfg.export, "config.json"))
            agree(f"--export-best: the best model so far (step {int(best[-1])}) was exported before the resume, and "
                  f"--export {cfg.export} does not hold it; resume with the --export folder the run used before"
                  if missing else None)

    def after_step(self, ctx: RunContext) -> None:
        if ctx.cfg.eval_every and ctx.pos.global_step % ctx.cfg.eval_every == 0:
            self.run(ctx)

    def on_epoch_end(self, ctx: RunContext) -> None:
        if not (self.at and self.at[-1] == ctx.pos.global_step):
            self.run(ctx)


class ModelSaves(Callback):
    """``--save-model-every``: the model as a Hugging Face folder every that many steps (``model_checkpoint_path``)."""

    def after_step(self, ctx: RunContext) -> None:
        cfg, step = ctx.cfg, ctx.pos.global_step
        if cfg.save_model_every and step % cfg.save_model_every == 0:
            assert cfg.save_model_dir is not None  # RunConfig checks it
            where = model_checkpoint_path(cfg.save_model_dir, step)
            export_model(cfg, ctx.rt, where, replace=True)
            ctx.log.write(ExportRecord(step=step, path=where, kind="model"))


class FinalExport(Callback):
    """``--export``: the final model as a Hugging Face folder (not when ``--export-best`` already wrote one)."""

    def on_end(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        if cfg.export and not (cfg.export_best and ctx.pos.best_eval):
            export_model(cfg, ctx.rt, cfg.export)
            ctx.log.write(ExportRecord(step=ctx.pos.global_step, path=cfg.export, kind="final"))


class Checkpointing(Callback):
    """``--checkpoint-dir``: the run's state saved every ``checkpoint_every`` steps and at every epoch end
    (unless that step was just saved); ``save`` is the writer (``save_checkpoint``), every rank calls it."""

    def __init__(self, save: Callable[[RunContext], None] | None = None) -> None:
        self.save = save or save_checkpoint
        self.last = -1
        """The step of the newest checkpoint (-1: none yet)."""
        self.sharded: Any = None
        """``--checkpoint-format sharded``: the run's ``sharded.ShardedWriter`` (made at the first save)."""

    def on_start(self, ctx: RunContext) -> None:
        self.last = ctx.pos.global_step if ctx.resuming else -1

    def _save(self, ctx: RunContext) -> None:
        if ctx.cfg.checkpoint_format == "sharded" and self.save is save_checkpoint:
            from ptplan.executor.training.sharded import ShardedWriter

            self.sharded = self.sharded or ShardedWriter()
            ctx.log.write(self.sharded.save(ctx))  # the ``checkpoint`` record: seconds, bytes per rank
        else:
            self.save(ctx)
        self.last = ctx.pos.global_step

    def on_end(self, ctx: RunContext) -> None:
        if self.sharded is not None:
            self.sharded.wait(ctx)  # an async save in flight finished and committed (collective)

    def after_step(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        if cfg.checkpoint_dir and cfg.checkpoint_every and ctx.pos.global_step % cfg.checkpoint_every == 0:
            self._save(ctx)
            ctx.log.sync()

    def after_epoch(self, ctx: RunContext) -> None:
        if ctx.cfg.checkpoint_dir and self.last != ctx.pos.global_step:
            self._save(ctx)


def save_checkpoint(ctx: RunContext) -> None:
    """Gather to rank 0 and write the checkpoint there; every rank raises rank 0's error (a full disk)."""
    import uuid
    from dataclasses import asdict

    cfg, rt = ctx.cfg, ctx.rt
    assert cfg.checkpoint_dir is not None, "Checkpointing runs only with --checkpoint-dir"
    weights, state = rt.gather(with_state=True)
    rng: list[Any] = [None] * rt.world
    dist.all_gather_object(rng, rng_state())
    problem = None
    if rt.rank == 0:
        try:
            ckpt.save_checkpoint(cfg.checkpoint_dir, {
                "id": uuid.uuid4().hex, "plan_id": ckpt.plan_id(ctx.plan), "plan": ckpt.plan_identity(ctx.plan),
                "run": ctx.run_id, "model_name": rt.model.name, "optimizer": cfg.optimizer, "world_size": rt.world,
                "model": weights, "optim": state, "position": asdict(ctx.pos), "rng": rng})
        except PtplanError as e:
            problem = str(e)
        del weights, state
    agree(problem)


def default_callbacks(hooks: Hooks, eval_dataset: Dataset | None) -> list[Callback]:
    """Every part of a run, in the order its hooks must run (the run log's record order depends on it)."""
    out: list[Callback] = [Snapshots(hooks), AutoCache(), PeakMemory(), LRSchedule(), StepLog(), DivergenceGuard(),
                           Progress()]
    if eval_dataset is not None:
        out.append(Evaluation(eval_dataset))
    out += [ModelSaves(), Checkpointing(), FinalExport()]
    if hooks.after_step is not None:
        out.append(AfterStepHook(hooks.after_step))
    return out
