"""The training loop: replay a plan as pipelined data-parallel training, changing phase inside the job.

Per step: decide the frozen count (the plan's trajectory, or the adaptive gradient-norm rule),
switch phase when it changes (``runtime.ElasticRuntime.switch``), take the next global batch of
the epoch's order, train on this pipeline's shard. Everything else -- the AutoCache, the learning-rate
schedule, peak-memory sampling, the run log's step records, the divergence stop, the progress bar,
evaluation, exports, checkpoints and the test hooks -- is a callback (``executor/training/callbacks.py``);
resuming from a checkpoint is ``executor/training/resume.py``. Every rank calls ``run_training`` with the
same arguments.

Before it, ``ptplan run``'s workers agree on the phase they start in (``start_phase``: phase 0's, or the
checkpoint's on a resume) and each builds only its layers of that phase (``stage_layers``), so no rank
ever materialises the whole model; ``run_training`` takes the model as built (see its docstring).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Plan

from ptplan.executor.data.dataset import Dataset, check_data, epoch_order, global_batch_ids, shard
from ptplan.executor.runtime.collective import agree, ranks_text
from ptplan.executor.runtime.elastic import ElasticRuntime, phase_index
from ptplan.executor.runtime.optim import make_optimizer
from ptplan.executor.runtime.transition import needs
from ptplan.executor.training.checkpoint import plan_id
from ptplan.executor.training.callbacks import (AutoCache, Callback, Callbacks, Evaluation, Hooks, default_callbacks,
                                                model_checkpoint_path)
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.evaluate import Metrics
from ptplan.executor.training.freezing import FreezeSchedule
from ptplan.executor.training.resume import Source, built_copies, find_checkpoint, restore, run_id, stage_layers, \
    restart_count, start_phase
from ptplan.planner.records import (EpochEndRecord, FreezeDecisionRecord, HeaderRecord, ResumeRecord,
                                               TransitionRecord)
from ptplan.executor.training.runlog import RunLog
from ptplan.executor.training.state import Position, RunContext, StepResult
from ptplan.executor.training.validate import check_epoch_data, check_plan

__all__ = ["Hooks", "Position", "RunSummary", "autocast", "model_checkpoint_path", "run_training", "stage_layers",
           "start_phase"]


@dataclass
class RunSummary:
    steps: int
    transitions: list[dict[str, Any]]
    final_loss: float | None
    seconds: float
    evals: list[Metrics] = field(default_factory=list)
    """Every evaluation of the run (``--eval-data``), in order; the last one is the final model's."""


def run_training(cfg: RunConfig, plan: Plan, model: torch.nn.Module, dataset: Dataset, *,
                 device: torch.device | None = None, hooks: Hooks | None = None,
                 eval_dataset: Dataset | None = None, callbacks: Sequence[Callback] = ()) -> RunSummary:
    """Train ``model`` following ``plan`` on an initialised default process group; every rank calls this.

    Checks the plan and the data against the job first (PtplanError before any collective), then
    agrees with the other ranks whether to resume and from which rank's checkpoint (``--resume``, or
    a torchrun restart that finds one: ``resume.find_checkpoint``), then trains. A non-finite loss stops the
    run on every rank with a PtplanError naming the step. With ``eval_dataset`` (``--eval-data``), the
    model is evaluated (``evaluate``: forward only through the current stages) at every epoch end and
    every ``cfg.eval_every`` steps, before that step's checkpoint, and logged as ``eval`` records.
    ``callbacks`` run after the built-in ones (``callbacks.default_callbacks``), with the same hooks.

    Memory: ``model`` arrives as built for this rank: in ``ptplan run`` only the layers it holds in the
    phase it starts in (``start_phase``, ``stage_layers``: phase 0's, or on resume the checkpoint's
    phase) have weights, in host memory; every other parameter is on the meta device (``build_model``'s
    ``layers``). ``stage.LayerStore`` takes that as the starting holdings; the build check
    (``resume.built_copies``: per layer, a checksum from each rank that built it, compared among those) and
    the AutoCache's determinism check (``cache_run``: the prefix run layer by layer on the ranks that hold
    it) work on those layers alone, and the first phase switch moves nothing but what a rank lacks
    (nothing, when every rank built its own stage). A model built whole (tests, ``custom_model``) works
    too: the first switch frees what the rank does not hold. On resume each rank reads only its own
    layers' weights and optimizer state from the checkpoint (mapped, tensor by tensor), or gets them from
    the source rank when its node has another copy of the file (``resume.restore``). After the run
    ``model`` holds only this rank's last stage.
    """
    hooks = hooks or Hooks()
    cfg = cfg.resolved(plan)  # the optimizer and learning rate the plan sets, where cfg leaves them to it
    ctx, source = _prepare(cfg, plan, model, dataset, device or torch.device("cpu"), eval_dataset)
    t_start = time.perf_counter()
    cbs = Callbacks([*default_callbacks(hooks, eval_dataset), *callbacks])
    ok = False
    try:
        _enter(ctx, cbs, source)
        cbs.call("on_start", ctx)
        while ctx.pos.epoch < ctx.epochs:
            _run_epoch(ctx, cbs)
        cbs.call("on_end", ctx)
        agree(ctx.log.error)  # a write error after the last step: raised on every rank (was dist.barrier())
        ok = True
    finally:
        cbs.finish(ctx, ok)
    ctx.rt.close()
    ev = cbs.find(Evaluation)
    return RunSummary(steps=ctx.pos.global_step, transitions=ctx.transitions, final_loss=ctx.loss,
                      seconds=time.perf_counter() - t_start, evals=ev.evals if ev is not None else [])


def _check_inputs(cfg: RunConfig, plan: Plan, model: torch.nn.Module, dataset: Dataset,
                  eval_dataset: Dataset | None, world: int) -> None:
    """The plan, the data and the flags against the job: the same PtplanError on every rank, before any
    collective."""
    check_plan(plan, model, world)
    check_epoch_data(plan, cfg, len(dataset), "the data")
    check_data(dataset, model)
    # before any training: the same refusal on every rank (rank 0 writes the export); --export-best's folder holds
    # the best model so far once the run has evaluated, so a resumed or restarted run (torchrun) may find it there
    if cfg.export and not (cfg.export_best and (cfg.resume or restart_count() > 0)):
        from ptplan.executor.training.export import check_export_dir

        check_export_dir(cfg.export)
    if cfg.export_best and eval_dataset is None:
        raise PtplanError("--export-best needs --eval-data (the held-out set that says which model is best)")


def _agree_inputs(cfg: RunConfig, plan: Plan, model: torch.nn.Module, dataset: Dataset,
                  eval_dataset: Dataset | None, world: int) -> None:
    """``_check_inputs`` on every rank, then one collective: the lowest failing rank's PtplanError is raised on every
    rank, the ranks must run one plan (``checkpoint.plan_id``) and their data must hold as many samples (each node
    loads its own plan, ``--data`` and ``--eval-data``; a shorter copy on one node would end its epochs early and
    leave the others waiting in a collective)."""
    problem = None
    try:
        _check_inputs(cfg, plan, model, dataset, eval_dataset, world)
        if eval_dataset is not None:
            check_data(eval_dataset, model, what=f"--eval-data {cfg.eval_data or ''}".strip())
    except PtplanError as e:
        problem = str(e)
    got = agree(problem, (len(dataset), None if eval_dataset is None else len(eval_dataset), plan_id(plan)))
    plans = _by_value([g[2] for g in got])
    if len(plans) > 1:
        said = "; ".join(f"{ranks_text(rs)}: plan {pid}" for pid, rs in plans.items())
        raise PtplanError(f"the ranks run different plans ({said}): each node reads its own {cfg.plan}; give every "
                          f"node the same plan file and start again")
    for i, (what, flag) in enumerate((("training data", "--data"), ("evaluation data", "--eval-data"))):
        by_size = _by_value([g[i] for g in got])
        if len(by_size) > 1:
            said = "; ".join(f"{ranks_text(rs)}: {'no' if n is None else n} samples" for n, rs in by_size.items())
            path = (cfg.data if i == 0 else cfg.eval_data) or ""
            raise PtplanError(f"the ranks' {what} differ in length ({said}): each node reads its own {flag} {path}; "
                              f"give every node the same file (a shared file system, or copy it) and start again")


def _by_value(values: list[Any]) -> dict[Any, list[int]]:
    """Each value the ranks reported, with the ranks that reported it."""
    out: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        out.setdefault(v, []).append(r)
    return out


def _total_steps(cfg: RunConfig, plan: Plan, fs: FreezeSchedule, epochs: int, N: int) -> int | None:
    """The run's optimizer steps when known in advance; refuses a decaying LR schedule without it."""
    total = None
    if cfg.steps_per_epoch:
        total = epochs * cfg.steps_per_epoch
    elif cfg.freeze == "planned" and fs.every is None:
        total = sum(N // plan.phase_for(fs.planned(e, 0)).global_batch for e in range(epochs))
    if cfg.lr_schedule != "constant" and total is None:
        raise PtplanError(f"--lr-schedule {cfg.lr_schedule} decays to 0 at the run's last step, but the number of "
                          f"steps is not known in advance (adaptive freezing or --freeze-every); pass "
                          f"--steps-per-epoch")
    return total


def _prepare(cfg: RunConfig, plan: Plan, model: torch.nn.Module, dataset: Dataset, device: torch.device,
             eval_dataset: Dataset | None) -> tuple[RunContext, Source | None]:
    """Check everything, build the optimizer and the runtime, agree on a checkpoint to resume from, open the
    run log (its header unless resuming). Collective in ``_agree_inputs`` and ``find_checkpoint``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _agree_inputs(cfg, plan, model, dataset, eval_dataset, world)
    amp = autocast(cfg, device)
    torch.manual_seed(cfg.seed * 1009 + rank)  # dropout streams differ per rank, as in plain data parallelism
    if cfg.clip_grad_norm is not None and any(ph.schedule == "2bw" for ph in plan.phases):
        raise PtplanError("--clip-grad-norm needs one global gradient norm per step, but PipeDream-2BW updates its "
                          "stages at different times; plan with another schedule or leave clipping out")
    epochs, N = cfg.epochs or plan.inputs.training.epochs, len(dataset)
    fs = FreezeSchedule(plan, cfg.freeze, num_blocks=model.num_blocks, every=cfg.freeze_every, alpha=cfg.alpha)
    total = _total_steps(cfg, plan, fs, epochs, N)
    opt = make_optimizer(list(model.parameters()), cfg.optimizer, lr=cfg.peak_lr, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay, eps=cfg.adam_eps, decay_all=cfg.decay_all)
    rt = ElasticRuntime(plan, model, opt, device=device, timeout_s=cfg.timeout_s, backend=dist.get_backend())
    rt.clip_grad_norm = cfg.clip_grad_norm
    rid = run_id(cfg, N)
    source = find_checkpoint(cfg, plan, model.name, world, rid)  # collective: (rank, step) or None
    problem, log = None, RunLog(None)
    # a resume into a log that does not exist yet (another --log) starts it with its header too
    fresh = rank == 0 and cfg.log is not None and (not os.path.exists(cfg.log) or os.path.getsize(cfg.log) == 0)
    try:  # rank 0 alone opens it (a resumed log at once): its refusal raised on every rank
        # a resume (a restart after a lost node) waits for the lost writer's lock to lapse; a fresh start does not:
        # a second job that waited would take the log over once the first job ended, and start it again from step 0
        log = RunLog(cfg.log if rank == 0 else None, append=source is not None,
                     lock_wait_s=min(cfg.timeout_s, 120.0) if source is not None else 0.0)
    except PtplanError as e:
        problem = str(e)
    except OSError as e:  # its folder cannot be made (the in-process API; ``ptplan run`` makes it first)
        problem = f"cannot open the run log {cfg.log}: {e.strerror or e}; give a --log path that can be written"
    try:
        agree(problem)
    except PtplanError:
        log.close()  # another rank's refusal: let the log (and its lock) go with this run
        raise
    log.defer = True  # from here rank 0 alone writing must not raise alone (``RunLog.defer``): the header, the
    # resume record, every step's, each raised on every rank by the next step's stop flag or the run's end
    ctx = RunContext(cfg=cfg, plan=plan, rt=rt, dataset=dataset, log=log, fs=fs, device=device, run_id=rid,
                     resuming=source is not None, epochs=epochs, total=total, amp=amp,
                     pos=Position(norm_sum=[0.0] * model.num_blocks))
    if source is None or fresh:
        _header(ctx)
    return ctx, source


def _header(ctx: RunContext) -> None:
    cfg, plan = ctx.cfg, ctx.plan
    ctx.log.write(HeaderRecord(
        plan_fingerprint=plan.inputs.profile.fingerprint, model=ctx.rt.model.name, world_size=ctx.rt.world,
        backend=ctx.rt.backend, optimizer=cfg.optimizer, lr=cfg.peak_lr, seed=cfg.seed, freeze=cfg.freeze,
        freeze_every=ctx.fs.every, batch_policy=plan.inputs.training.batch_policy, epochs=ctx.epochs,
        steps_per_epoch=cfg.steps_per_epoch, data=cfg.data, samples=len(ctx.dataset), plan=cfg.plan,
        precision=cfg.precision if cfg.precision != "fp32" else None,
        phases=[dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M, b=p.micro_batch_size, schedule=p.schedule)
                for p in plan.phases]))


def _enter(ctx: RunContext, cbs: Callbacks, source: Source | None) -> None:
    """The build check and the AutoCache's set-up on the layers as built, then the first phase: the
    checkpoint's (``resume.restore``, a ``resume`` record) or step 0's. Collective."""
    rt, plan = ctx.rt, ctx.plan
    copies = built_copies(rt)  # collective: per layer, the ranks holding an agreeing copy as built
    cache = cbs.find(AutoCache)
    if cache is not None:
        cache.setup(ctx, copies)
    if source is not None:
        ctx.pos, info = restore(ctx.cfg, plan, rt, source, ctx.run_id)
        ctx.log.write(ResumeRecord(step=ctx.pos.global_step, epoch=ctx.pos.epoch, phase=rt.phase_index,
                                   seconds=info["seconds"], parts=info["parts"], bytes=info["bytes"],
                                   source_rank=source.rank,
                                   attempt=restart_count()))
        return
    ctx.pos.frozen_blocks = ctx.fs.planned(0, 0)
    index = phase_index(plan, ctx.pos.frozen_blocks)
    lacking = [i for i, (need, have) in enumerate(zip(needs(plan.phases[index], rt.n), copies)) if need and not have]
    if lacking:  # the same list on every rank (``copies`` is gathered)
        raise PtplanError(f"layers {lacking} of the model were built by no rank, but phase {index} needs "
                          f"them; build each rank's model with build_model(..., layers=stage_layers(plan, "
                          f"{index}, rank)) (what ptplan run does) or whole")
    rt.switch(index, have_weights=copies, have_state=None)  # from here on, each rank holds only its stage


def _run_epoch(ctx: RunContext, cbs: Callbacks) -> None:
    """The epoch's steps until ``--steps-per-epoch`` or the data runs out, then the epoch's end."""
    cfg, pos, N = ctx.cfg, ctx.pos, len(ctx.dataset)
    order = epoch_order(N, cfg.seed, pos.epoch, cfg.shuffle)
    while not (cfg.steps_per_epoch and pos.step_in_epoch >= cfg.steps_per_epoch):
        _follow_freeze(ctx, cbs)
        ph = ctx.rt.phase
        if pos.cursor + ph.global_batch > N:  # the rest of the epoch holds no full global batch
            if cfg.steps_per_epoch:
                ctx.log.write(EpochEndRecord(epoch=pos.epoch, steps=pos.step_in_epoch,
                                             reason=f"data exhausted: {N - pos.cursor} samples left, global batch "
                                                    f"{ph.global_batch}"))
            break
        _step(ctx, cbs, order)
    cbs.call("on_epoch_end", ctx)
    ctx.log.sync()
    pos.epoch += 1
    pos.step_in_epoch = 0
    pos.cursor = 0
    cbs.call("after_epoch", ctx)


def _step(ctx: RunContext, cbs: Callbacks, order: torch.Tensor) -> None:
    """One optimizer step on this pipeline's shard of the next global batch."""
    rt, pos, ph = ctx.rt, ctx.pos, ctx.rt.phase
    adaptive = ctx.cfg.freeze == "adaptive"
    ids = global_batch_ids(order, pos.cursor, ph.global_batch)
    mine = shard(ids, ph.D, rt.groups.place.pipeline)
    cbs.call("before_step", ctx)
    t0 = time.perf_counter()
    batch = ctx.dataset.batch(mine)  # timed apart: the input pipeline is in the step but in no plan
    data_s = time.perf_counter() - t0
    rt.stop_reason = ctx.log.error  # rank 0's deferred run-log error stops every rank in this step's all-reduce
    with ctx.amp():
        loss, norms = rt.train_step(batch, want_norms=adaptive, ids=mine)
    result = StepResult(seconds=time.perf_counter() - t0, loss=loss, data_seconds=data_s)
    ctx.loss = loss
    if adaptive:
        pos.norm_sum = [a + b for a, b in zip(pos.norm_sum, norms)]
        pos.norm_count += 1
    cbs.call("on_step", ctx, result)
    pos.cursor += ph.global_batch
    pos.step_in_epoch += 1
    pos.global_step += 1
    cbs.call("after_step", ctx)


def _follow_freeze(ctx: RunContext, cbs: Callbacks) -> None:
    """Decide the next step's frozen count and change phase when it differs (logged, then ``on_transition``)."""
    want, decision = _decide(ctx.cfg, ctx.fs, ctx.pos)
    if decision is not None:
        ctx.log.write(decision)
    if want != ctx.rt.phase.frozen_blocks:
        info = _transition(ctx.rt, ctx.plan, want, ctx.pos)
        ctx.transitions.append(info)
        ctx.log.write(TransitionRecord.from_json({"type": TransitionRecord.TYPE, **info}))
        ctx.log.sync()
        cbs.call("on_transition", ctx, info)


def _decide(cfg: RunConfig, fs: FreezeSchedule, pos: Position) -> tuple[int, FreezeDecisionRecord | None]:
    """The frozen count for the next step (identical on every rank), and the adaptive decision record."""
    if cfg.freeze == "planned":
        return fs.planned(pos.epoch, pos.global_step), None
    T = fs.T(pos.epoch, pos.global_step)
    if T <= pos.decided_T:
        return pos.frozen_blocks, None
    norms = [s / pos.norm_count for s in pos.norm_sum] if pos.norm_count else None
    problem, want = None, 0
    try:  # every rank decides (the norms are all-reduced); rank 0's count is taken, its refusal raised everywhere
        want = fs.adaptive(pos.frozen_blocks, norms)
    except PtplanError as e:
        problem = str(e)
    want = agree(problem, want)[0]
    record = FreezeDecisionRecord(step=pos.global_step, T=T, from_frozen=pos.frozen_blocks, to_frozen=want,
                                  alpha=fs.alpha, grad_norms=norms, steps_measured=pos.norm_count)
    pos.decided_T = T
    pos.norm_sum = [0.0] * len(pos.norm_sum)
    pos.norm_count = 0
    return want, record


def _transition(rt: ElasticRuntime, plan: Plan, want: int, pos: Position) -> dict[str, Any]:
    old, old_index = rt.phase, rt.phase_index
    new_index = phase_index(plan, want)
    owners = needs(old, rt.n)
    state = [owners[i] if i >= old.frozen_layers else frozenset() for i in range(rt.n)]
    info = rt.switch(new_index, have_weights=rt.current, have_state=state)
    pos.frozen_blocks = want
    new = rt.phase
    return {"step": pos.global_step, "from_phase": old_index, "to_phase": new_index, **info,
            "from": {"frozen_blocks": old.frozen_blocks, "K": old.K, "D": old.D},
            "to": {"frozen_blocks": new.frozen_blocks, "K": new.K, "D": new.D}}


def autocast(cfg: RunConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A context factory for the forward passes: ``torch.autocast`` in bfloat16 on ``device`` for
    ``--precision bf16`` (the weights, gradients and optimizer state stay in ``cfg.dtype``), else nothing.
    Refuses bf16 on a GPU without it (PtplanError on every rank)."""
    if cfg.precision == "fp32":
        return contextlib.nullcontext
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise PtplanError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bfloat16 support; run "
                          f"with --precision fp32")
    if cfg.dtype != "float32":
        raise PtplanError(f"--precision bf16 autocasts a float32 model; this run's model is {cfg.dtype}")
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
