"""The training loop: replay a plan as pipelined data-parallel training, changing phase inside the job.

Per step: decide the frozen count (the plan's trajectory, or the adaptive gradient-norm rule),
switch phase when it changes (``runtime.ElasticRuntime.switch``), take the next global batch of
the epoch's order, train on this pipeline's shard, log. Checkpoints, resume, snapshots and the
progress bar live here too. Every rank calls ``run_training`` with the same arguments.

Before it, ``ptplan run``'s workers agree on the phase they start in (``start_phase``: phase 0's, or the
checkpoint's on a resume) and each builds only its layers of that phase (``stage_layers``), so no rank
ever materialises the whole model; ``run_training`` takes the model as built (see its docstring).
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Plan

from ptplan.executor.training import checkpoint as ckpt
from ptplan.executor.cache.run import agree, setup_cache
from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import Dataset, check_data, epoch_order, global_batch_ids, shard
from ptplan.executor.training.evaluate import Metrics, evaluate
from ptplan.executor.training.freezing import FreezeSchedule
from ptplan.executor.runtime.memory import MemorySampler, StepMemory
from ptplan.executor.runtime.optim import ensure_state, lr_factor, make_optimizer, state_keys
from ptplan.executor.training.runlog import RunLog
from ptplan.executor.runtime.elastic import ElasticRuntime, broadcast_int, phase_index
from ptplan.executor.runtime.transition import Transfer, exchange, holdings, needs, owned_layers
from ptplan.executor.training.validate import check_plan


@dataclass
class Hooks:
    """Test and tooling hooks (every rank must get the same ``snapshots`` value: gathering is collective)."""

    snapshots: bool = False
    """Gather the full model to rank 0 after every transition and at the end, and call ``on_snapshot``."""
    on_snapshot: Callable[[str, int, dict[str, Tensor]], None] | None = None
    """On rank 0: (event "start"|"transition"|"final", optimizer steps done, {parameter name: tensor})."""
    after_step: Callable[[int, int], None] | None = None
    """On every rank after each step: (optimizer steps done, rank). May raise or exit (tests)."""


@dataclass
class Position:
    """Where the run is; saved in checkpoints."""

    epoch: int = 0
    step_in_epoch: int = 0
    cursor: int = 0
    """Samples of the epoch's order consumed so far."""
    global_step: int = 0
    """Optimizer steps done."""
    frozen_blocks: int = 0
    decided_T: int = 0
    """Last freeze step T already decided (adaptive)."""
    norm_sum: list[float] = field(default_factory=list)
    """Per block: sum of per-step gradient norms since the last decision (adaptive)."""
    norm_count: int = 0
    best_eval: list[float] = field(default_factory=list)
    """``--export-best``: the best evaluation's score (``_score``) and step, once one was exported."""


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
                 eval_dataset: Dataset | None = None) -> RunSummary:
    """Train ``model`` following ``plan`` on an initialised default process group; every rank calls this.

    Checks the plan and the data against the job first (PtplanError before any collective), then
    agrees with the other ranks whether to resume and from which rank's checkpoint (``--resume``, or
    a torchrun restart that finds one: ``_find_checkpoint``), then trains. A non-finite loss stops the
    run on every rank with a PtplanError naming the step. With ``eval_dataset`` (``--eval-data``), the
    model is evaluated (``evaluate``: forward only through the current stages) at every epoch end and
    every ``cfg.eval_every`` steps, before that step's checkpoint, and logged as ``eval`` records.

    Memory: ``model`` arrives as built for this rank: in ``ptplan run`` only the layers it holds in the
    phase it starts in (``start_phase``, ``stage_layers``: phase 0's, or on resume the checkpoint's
    phase) have weights, in host memory; every other parameter is on the meta device (``build_model``'s
    ``layers``). ``stage.LayerStore`` takes that as the starting holdings; the build check
    (``_built_copies``: per layer, a checksum from each rank that built it, compared among those) and the
    AutoCache's determinism check (``cache_run``: the prefix run layer by layer on the ranks that hold
    it) work on those layers alone, and the first phase switch moves nothing but what a rank lacks
    (nothing, when every rank built its own stage). A model built whole (tests, ``custom_model``) works
    too: the first switch frees what the rank does not hold. On resume each rank reads only its own
    layers' weights and optimizer state from the checkpoint (mapped, tensor by tensor), or gets them from
    the source rank when its node has another copy of the file (``_resume``). After the run ``model``
    holds only this rank's last stage.
    """
    hooks = hooks or Hooks()
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_plan(plan, model, world)
    training = plan.inputs.training
    epochs = cfg.epochs or training.epochs
    N = len(dataset)
    smallest = min(ph.global_batch for ph in plan.phases)
    if cfg.steps_per_epoch and cfg.steps_per_epoch * smallest > N:
        raise PtplanError(f"--steps-per-epoch {cfg.steps_per_epoch} needs at least {cfg.steps_per_epoch}*{smallest} = "
                          f"{cfg.steps_per_epoch * smallest} samples per epoch but the data has {N}; lower "
                          f"--steps-per-epoch or use more data")
    if N < min(ph.global_batch for ph in plan.phases):
        raise PtplanError(f"the data has {N} samples, fewer than one global batch of "
                          f"{min(ph.global_batch for ph in plan.phases)}")
    check_data(dataset, model)
    if cfg.export and not (cfg.export_best and cfg.resume):  # before any training: the same refusal on every
        from ptplan.executor.training.export import check_export_dir                   # rank (rank 0 writes the export)

        check_export_dir(cfg.export)
    if cfg.export_best and eval_dataset is None:
        raise PtplanError("--export-best needs --eval-data (the held-out set that says which model is best)")
    amp = autocast(cfg, device)
    if eval_dataset is not None:
        check_data(eval_dataset, model, what=f"--eval-data {cfg.eval_data or ''}".strip())
    backend = dist.get_backend()
    torch.manual_seed(cfg.seed * 1009 + rank)  # dropout streams differ per rank, as in plain data parallelism
    if cfg.clip_grad_norm is not None and any(ph.schedule == "2bw" for ph in plan.phases):
        raise PtplanError("--clip-grad-norm needs one global gradient norm per step, but PipeDream-2BW updates its "
                          "stages at different times; plan with another schedule or leave clipping out")
    opt = make_optimizer(list(model.parameters()), cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay, eps=cfg.adam_eps, decay_all=cfg.decay_all)
    rt = ElasticRuntime(plan, model, opt, device=device, timeout_s=cfg.timeout_s, backend=backend)
    rt.clip_grad_norm = cfg.clip_grad_norm
    fs = FreezeSchedule(plan, cfg.freeze, num_blocks=model.num_blocks, every=cfg.freeze_every, alpha=cfg.alpha)
    run_id = _run_id(cfg, N)
    source = _find_checkpoint(cfg, plan, model.name, world, run_id)  # collective: (rank, step) or None
    resuming = source is not None
    log = RunLog(cfg.log if rank == 0 else None, append=resuming)
    fingerprint = plan.inputs.profile.fingerprint
    pos = Position(norm_sum=[0.0] * model.num_blocks)
    t_start = time.perf_counter()
    if not resuming:
        log.header(plan_fingerprint=fingerprint, model=model.name, world_size=world, backend=backend,
                   optimizer=cfg.optimizer, lr=cfg.lr, seed=cfg.seed, freeze=cfg.freeze,
                   freeze_every=fs.every, batch_policy=training.batch_policy, epochs=epochs,
                   steps_per_epoch=cfg.steps_per_epoch, data=cfg.data, samples=N, plan=cfg.plan,
                   **({"precision": cfg.precision} if cfg.precision != "fp32" else {}),
                   phases=[dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M, b=p.micro_batch_size,
                                schedule=p.schedule) for p in plan.phases])
    cache = None
    try:
        copies = _built_copies(rt)  # collective: per layer, the ranks holding an agreeing copy as built
        # Collective; refuses a nondeterministic prefix. First, on the layers as built.
        cache = setup_cache(cfg, plan, model, dataset, device, copies)
        rt.set_cache(None if cache is None else cache.cache)
        if source is not None:
            pos, info = _resume(cfg, plan, rt, source, run_id)
            log.write({"type": "resume", "step": pos.global_step, "epoch": pos.epoch, "phase": rt.phase_index,
                       "seconds": info["seconds"], "parts": info["parts"], "bytes": info["bytes"],
                       "source_rank": source.rank,
                       "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
        else:
            pos.frozen_blocks = fs.planned(0, 0)
            index = phase_index(plan, pos.frozen_blocks)
            lacking = [i for i, (need, have) in enumerate(zip(needs(plan.phases[index], rt.n), copies))
                       if need and not have]
            if lacking:  # the same list on every rank (``copies`` is gathered)
                raise PtplanError(f"layers {lacking} of the model were built by no rank, but phase {index} needs "
                                  f"them; build each rank's model with build_model(..., layers=stage_layers(plan, "
                                  f"{index}, rank)) (what ptplan run does) or whole")
            rt.switch(index, have_weights=copies, have_state=None)  # from here on, each rank holds only its stage
            if hooks.snapshots:
                _snapshot(rt, hooks, "start", 0)
        if cache is not None:
            log.write(cache.setup_record)
    except BaseException:
        if cache is not None:
            cache.finish(ok=False)
        log.close()
        raise

    total = None
    if cfg.steps_per_epoch:
        total = epochs * cfg.steps_per_epoch
    elif cfg.freeze == "planned" and fs.every is None:
        total = sum(N // plan.phase_for(fs.planned(e, 0)).global_batch for e in range(epochs))
    if cfg.lr_schedule != "constant" and total is None:
        raise PtplanError(f"--lr-schedule {cfg.lr_schedule} decays to 0 at the run's last step, but the number of "
                          f"steps is not known in advance (adaptive freezing or --freeze-every); pass "
                          f"--steps-per-epoch")
    bar = _progress(cfg.progress and rank == 0, total, pos.global_step)
    sampler = MemorySampler()  # peak memory on the 2nd step of each phase visit (executor/runtime/memory.py)
    transitions: list[dict[str, Any]] = []
    last_ckpt = pos.global_step if resuming else -1
    loss = None
    evals: list[Metrics] = []
    evals_at: list[int] = []

    def run_eval() -> None:
        assert eval_dataset is not None
        with amp():
            m = evaluate(rt, eval_dataset, cfg.eval_batch_size)
        evals.append(m)
        evals_at.append(pos.global_step)
        log.write({"type": "eval", "epoch": pos.epoch, "step": pos.global_step, "phase": rt.phase_index,
                   **m.to_record()})
        if cfg.export_best and (not pos.best_eval or _score(m) > tuple(pos.best_eval[:2])):
            pos.best_eval = [*_score(m), float(pos.global_step)]  # the same Metrics on every rank: same decision
            _export(cfg, rt, cfg.export, replace=True)
            log.write({"type": "export", "step": pos.global_step, "path": cfg.export, "kind": "best",
                       **{k: v for k, v in m.to_record().items() if k in ("loss", "accuracy", "perplexity")}})

    try:
        while pos.epoch < epochs:
            order = epoch_order(N, cfg.seed, pos.epoch, cfg.shuffle)
            while not (cfg.steps_per_epoch and pos.step_in_epoch >= cfg.steps_per_epoch):
                want, decision = _decide(cfg, fs, pos, device)
                if decision is not None:
                    log.write(decision)
                if want != rt.phase.frozen_blocks:
                    info = _transition(rt, plan, want, pos)
                    transitions.append(info)
                    log.transition(**info)
                    log.sync()
                    if hooks.snapshots:
                        _snapshot(rt, hooks, "transition", pos.global_step)
                ph = rt.phase
                if pos.cursor + ph.global_batch > N:  # the rest of the epoch holds no full global batch
                    if cfg.steps_per_epoch:
                        log.write({"type": "epoch_end", "epoch": pos.epoch, "steps": pos.step_in_epoch,
                                   "reason": f"data exhausted: {N - pos.cursor} samples left, global batch "
                                             f"{ph.global_batch}"})
                    break
                ids = global_batch_ids(order, pos.cursor, ph.global_batch)
                mine = shard(ids, ph.D, rt.groups.place.pipeline)
                mem = StepMemory(rt).start() if sampler.want(rt.phase_index) else None
                lr = cfg.lr * lr_factor(pos.global_step, warmup=cfg.warmup_steps, total=total, kind=cfg.lr_schedule)
                for g in opt.param_groups:
                    g["lr"] = lr
                t0 = time.perf_counter()
                with amp():
                    loss, norms = rt.train_step(dataset.batch(mine), want_norms=cfg.freeze == "adaptive", ids=mine)
                secs = time.perf_counter() - t0
                measured = {} if mem is None else (mem.stop() or mem.record())  # collective
                if cfg.freeze == "adaptive":
                    pos.norm_sum = [a + b for a, b in zip(pos.norm_sum, norms)]
                    pos.norm_count += 1
                log.step(epoch=pos.epoch, step=pos.global_step, phase=rt.phase_index, frozen_blocks=ph.frozen_blocks,
                         K=ph.K, D=ph.D, seconds=secs, samples=ph.global_batch, loss=loss,
                         allreduce_seconds=rt.last_allreduce_s, **measured,
                         **({"lr": lr} if cfg.lr_schedule != "constant" or cfg.warmup_steps else {}),
                         **({"grad_norm": rt.last_grad_norm} if rt.last_grad_norm is not None else {}))
                if not math.isfinite(loss):  # the same all-reduced value on every rank: every rank stops here
                    raise PtplanError(_diverged(cfg, loss, pos, rt))
                pos.cursor += ph.global_batch
                pos.step_in_epoch += 1
                pos.global_step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", f=ph.frozen_blocks, K=ph.K, D=ph.D, refresh=False)
                if eval_dataset is not None and cfg.eval_every and pos.global_step % cfg.eval_every == 0:
                    run_eval()
                if cfg.save_model_every and pos.global_step % cfg.save_model_every == 0:
                    assert cfg.save_model_dir is not None  # RunConfig checks it
                    where = model_checkpoint_path(cfg.save_model_dir, pos.global_step)
                    _export(cfg, rt, where, replace=True)
                    log.write({"type": "export", "step": pos.global_step, "path": where, "kind": "model"})
                if cfg.checkpoint_dir and cfg.checkpoint_every and pos.global_step % cfg.checkpoint_every == 0:
                    _save(cfg, plan, rt, pos, run_id)
                    log.sync()
                    last_ckpt = pos.global_step
                if hooks.after_step is not None:
                    hooks.after_step(pos.global_step, rank)
            if cache is not None:
                log.write(cache.epoch_end(rt.phase, pos.epoch, pos.global_step))
            if eval_dataset is not None and not (evals and evals_at[-1] == pos.global_step):
                run_eval()  # the epoch's end (unless its last step just did)
            log.sync()
            pos.epoch += 1
            pos.step_in_epoch = 0
            pos.cursor = 0
            if cfg.checkpoint_dir and last_ckpt != pos.global_step:
                _save(cfg, plan, rt, pos, run_id)
                last_ckpt = pos.global_step
        if hooks.snapshots:
            _snapshot(rt, hooks, "final", pos.global_step)
        if cfg.export and not (cfg.export_best and pos.best_eval):
            _export(cfg, rt, cfg.export)
            log.write({"type": "export", "step": pos.global_step, "path": cfg.export, "kind": "final"})
        dist.barrier()
        if cache is not None:
            cache.finish(ok=True)
    finally:
        if cache is not None:
            cache.finish(ok=False)  # after an error: no barrier; a no-op after the line above
        bar.close()
        log.close()
    rt.close()
    return RunSummary(steps=pos.global_step, transitions=transitions, final_loss=loss,
                      seconds=time.perf_counter() - t_start, evals=evals)


def _decide(cfg: RunConfig, fs: FreezeSchedule, pos: Position, device: torch.device
            ) -> tuple[int, dict[str, Any] | None]:
    """The frozen count for the next step (identical on every rank), and the adaptive decision record."""
    if cfg.freeze == "planned":
        return fs.planned(pos.epoch, pos.global_step), None
    T = fs.T(pos.epoch, pos.global_step)
    if T <= pos.decided_T:
        return pos.frozen_blocks, None
    norms = [s / pos.norm_count for s in pos.norm_sum] if pos.norm_count else None
    want = fs.adaptive(pos.frozen_blocks, norms) if dist.get_rank() == 0 else 0
    want = broadcast_int(want, device)
    record = {"type": "freeze_decision", "step": pos.global_step, "T": T, "from_frozen": pos.frozen_blocks,
              "to_frozen": want, "alpha": fs.alpha, "grad_norms": norms, "steps_measured": pos.norm_count}
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


def _snapshot(rt: ElasticRuntime, hooks: Hooks, event: str, step: int) -> None:
    weights, _ = rt.gather(with_state=False)
    if rt.rank == 0 and hooks.on_snapshot is not None:
        hooks.on_snapshot(event, step, weights)


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


def _score(m: Metrics) -> tuple[float, float]:
    """Larger is better: (accuracy, -loss) for classification, (-loss, 0) for causal LM."""
    return (m.accuracy, -m.loss) if m.accuracy is not None else (-m.loss, 0.0)


def model_checkpoint_path(folder: str, step: int) -> str:
    """Where ``--save-model-every`` writes the model after ``step`` optimizer steps."""
    return os.path.join(folder, f"model-step{step:06d}")


def _export(cfg: RunConfig, rt: ElasticRuntime, out: str, *, replace: bool = False) -> None:
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
        del weights
    agree(problem)


def _diverged(cfg: RunConfig, loss: float, pos: Position, rt: ElasticRuntime) -> str:
    ph = rt.phase
    where = ckpt.checkpoint_path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    hint = (f"; {where} holds the last checkpoint: resume from it with a lower --lr"
            if where and os.path.exists(where) else "")
    return (f"the loss is {loss} at step {pos.global_step} (epoch {pos.epoch}, phase {rt.phase_index}: "
            f"{ph.frozen_blocks} frozen blocks, K={ph.K}, D={ph.D}): training diverged; lower --lr (now "
            f"{cfg.lr:g}){', raise --adam-eps' if cfg.optimizer == 'adamw' else ''} or check the data{hint}")


def _save(cfg: RunConfig, plan: Plan, rt: ElasticRuntime, pos: Position, run_id: dict[str, Any]) -> None:
    """Gather to rank 0 and write the checkpoint there; every rank raises rank 0's error (a full disk)."""
    weights, state = rt.gather(with_state=True)
    rng = [None] * rt.world
    dist.all_gather_object(rng, _rng_state())
    problem = None
    if rt.rank == 0:
        try:
            ckpt.save_checkpoint(cfg.checkpoint_dir, {
                "id": uuid.uuid4().hex, "plan_id": ckpt.plan_id(plan), "plan": ckpt.plan_identity(plan), "run": run_id,
                "model_name": rt.model.name, "optimizer": cfg.optimizer, "world_size": rt.world, "model": weights,
                "optim": state, "position": asdict(pos), "rng": rng})
        except PtplanError as e:
            problem = str(e)
        del weights, state
    agree(problem)


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _run_id(cfg: RunConfig, samples: int) -> dict[str, Any]:
    """The run settings a checkpoint is bound to (``checkpoint.RUN_KEYS``)."""
    return {"samples": samples, "seed": cfg.seed, "shuffle": cfg.shuffle, "freeze": cfg.freeze,
            "freeze_every": cfg.freeze_every}


def start_phase(cfg: RunConfig, plan: Plan, *, model_name: str, samples: int) -> int:
    """The phase the run starts in: the checkpoint's when it resumes (``_find_checkpoint``), else the
    frozen count of step 0's. Collective (every rank calls it, before building its model: ``ptplan run``
    builds each rank's ``stage_layers`` of this phase); ``samples``: the training data's size."""
    source = _find_checkpoint(cfg, plan, model_name, dist.get_world_size(), _run_id(cfg, samples))
    if source is not None:
        return phase_index(plan, source.frozen_blocks)
    fs = FreezeSchedule(plan, cfg.freeze, num_blocks=plan.inputs.profile.num_blocks, every=cfg.freeze_every,
                        alpha=cfg.alpha)
    return phase_index(plan, fs.planned(0, 0))


def stage_layers(plan: Plan, index: int, rank: int) -> list[int]:
    """The layers ``rank`` holds in phase ``index`` (``transition.holdings``: its stage's active layers, and
    on stage 0 the frozen prefix): what ``build_model(..., layers=...)`` builds on that rank."""
    return sorted(holdings(plan.phases[index], rank, plan.inputs.profile.num_layers, cached_prefix=False))


def _built_copies(rt: ElasticRuntime) -> list[frozenset[int]]:
    """Per layer, the ranks whose copy as built can be trusted: every rank that built it when their
    copies agree (two float64 sums of its weights each, all-gathered), else the lowest such rank and
    those that agree with it. Collective; call before the first switch. Empty: no rank built it."""
    v = torch.zeros(rt.n, 3, dtype=torch.float64)
    with torch.no_grad():
        for i, ps in enumerate(rt.layer_params):
            if rt.store.where[i] is None:
                continue
            v[i, 0] = 1.0
            for p in ps:
                d = p.detach().double()
                v[i, 1] += d.sum().cpu()
                v[i, 2] += (d * d).sum().cpu()
    got = [torch.zeros_like(v).to(rt.device) for _ in range(rt.world)]
    dist.all_gather(got, v.to(rt.device))
    got = [g.cpu() for g in got]
    out = []
    for i in range(rt.n):
        built = [r for r in range(rt.world) if got[r][i, 0] == 1.0]
        out.append(frozenset(r for r in built if torch.equal(got[r][i], got[built[0]][i])))
    return out


@dataclass(frozen=True)
class _Source:
    """The checkpoint a run resumes from."""

    rank: int
    """The rank whose checkpoint it is (the newest usable; lowest rank on a tie)."""
    step: int
    frozen_blocks: int
    readers: frozenset[int]
    """Ranks whose own checkpoint file is this very one (same ``id``; a shared folder, or one node): each
    reads its own layers from it. The others get theirs from ``rank``."""


def _find_checkpoint(cfg: RunConfig, plan: Plan, model_name: str, world: int, run_id: dict[str, Any]
                     ) -> _Source | None:
    """Whether to resume and from which rank's checkpoint, agreed by every rank (collective).

    Each rank looks at its own ``--checkpoint-dir`` (its node's disk, or a shared folder) and reports the
    checkpoint's step, or why it cannot resume this run. When any rank asks to resume (``--resume``, or
    a torchrun restart: TORCHELASTIC_RESTART_COUNT > 0), the source is the newest usable checkpoint
    (lowest rank on a tie), whichever node holds it. None: start from scratch (no rank asked, or a
    restart before the first checkpoint). Raises the same PtplanError on every rank when ``--resume``
    finds no usable checkpoint on any rank.
    """
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    wants = bool(cfg.resume or (restarted and cfg.checkpoint_dir))
    mine: dict[str, Any] | None = None
    if wants and cfg.checkpoint_dir and os.path.exists(ckpt.checkpoint_path(cfg.checkpoint_dir)):
        try:
            data = ckpt.load_checkpoint(cfg.checkpoint_dir, mmap=True)
            problems = ckpt.mismatches(data, plan=plan, model_name=model_name, optimizer=cfg.optimizer,
                                       world_size=world, run=run_id)
            if problems:
                raise PtplanError(f"cannot resume from {ckpt.checkpoint_path(cfg.checkpoint_dir)}: "
                                  + "; ".join(problems) + "; resume with the plan and settings it was written "
                                  "with, or start without --resume (and another --checkpoint-dir)")
            mine = {"step": int(data["position"]["global_step"]),
                    "frozen_blocks": int(data["position"]["frozen_blocks"]), "id": data.get("id")}
            del data
        except PtplanError as e:
            mine = {"error": str(e)}
    got: list[Any] = [None] * world
    dist.all_gather_object(got, (wants, cfg.resume, mine))
    if not any(w for w, _, _ in got):
        return None
    usable = [(-m["step"], r) for r, (_, _, m) in enumerate(got) if m and "step" in m]
    if usable:
        step, src = min(usable)
        m = got[src][2]
        readers = {r for r, (_, _, o) in enumerate(got) if o and m["id"] is not None and o.get("id") == m["id"]}
        return _Source(rank=src, step=-step, frozen_blocks=m["frozen_blocks"], readers=frozenset(readers | {src}))
    errors = [(r, m["error"]) for r, (_, _, m) in enumerate(got) if m and "error" in m]
    if errors:
        err = PtplanError(errors[0][1])
        err.rank = errors[0][0]  # type: ignore[attr-defined]
        raise err
    if any(explicit for _, explicit, _ in got):
        dirs = sorted({cfg.checkpoint_dir or "(none)"})
        raise PtplanError(f"--resume: no checkpoint.pt in --checkpoint-dir {', '.join(dirs)} on any node; run "
                          f"without --resume to start from scratch")
    return None


def _resume(cfg: RunConfig, plan: Plan, rt: ElasticRuntime, source: _Source, run_id: dict[str, Any]
            ) -> tuple[Position, dict[str, Any]]:
    """Fill each rank's layers of the checkpoint's phase (weights, and optimizer state of the active layers
    it owns) from the checkpoint, then enter that phase: a reader of the file (``_Source.readers``) copies
    its own layers' tensors from its mapped file (the others' are never read); the source rank sends the
    rest, tensor by tensor from its mapped file, to the ranks that cannot read it. Storage is given first
    where the phase keeps each layer, so the switch moves nothing and a sharded stage (tp, FSDP) is built
    from the loaded values."""
    src = source.rank
    data = None
    problem, payload = None, None
    if rt.rank in source.readers:
        try:
            data = ckpt.load_checkpoint(cfg.checkpoint_dir, mmap=True)
            problems = ckpt.mismatches(data, plan=plan, model_name=rt.model.name, optimizer=cfg.optimizer,
                                       world_size=rt.world, run=run_id)
            if data["position"]["global_step"] != source.step:
                problems.append(f"it is at step {data['position']['global_step']} now, not {source.step} (the file "
                                f"changed while the ranks agreed on it)")
            if problems:
                raise PtplanError(f"cannot resume from {ckpt.checkpoint_path(cfg.checkpoint_dir)}: "
                                  + "; ".join(problems))
            shapes = {rt.names[id(p)]: rt.store.shapes[id(p)] for ps in rt.layer_params for p in ps}
            ckpt.check_state(data, shapes, state_keys(rt.opt))
            if rt.rank == src:
                payload = {"position": data["position"], "rng": data["rng"]}
        except PtplanError as e:
            problem = str(e)
    meta = agree(problem, payload)[src]
    pos = Position(**meta["position"])
    index = phase_index(plan, pos.frozen_blocks)
    new = plan.phases[index]
    t0 = time.perf_counter()
    cached = rt._caches(new)
    held = holdings(new, rt.rank, rt.n, cached_prefix=cached)
    for i, where in held.items():  # storage where the phase keeps the layer, about to be overwritten
        if rt.store.where[i] != where:
            rt.store.place(i, where, keep_values=False)
    keys = state_keys(rt.opt)
    active = range(new.frozen_layers, rt.n)
    owned = [i for i in owned_layers(new, rt.rank, rt.n) if i in active]
    names = [[rt.names[id(p)] for p in ps] for ps in rt.layer_params]
    if data is not None:  # a reader: its own layers from its own file
        with torch.no_grad():
            for i in held:
                for p, name in zip(rt.layer_params[i], names[i]):
                    p.copy_(data["model"][name])
            for i in owned:
                for p, name in zip(rt.layer_params[i], names[i]):
                    for v, k in zip(ensure_state(rt.opt, p), keys):
                        v.copy_(data["optim"][name][k])
    lacking = [r for r in range(rt.world) if r not in source.readers]
    weights = [Transfer(src=src, dst=r, layers=tuple(sorted(holdings(new, r, rt.n, cached_prefix=cached))))
               for r in lacking]
    state = [Transfer(src=src, dst=r, layers=tuple(i for i in owned_layers(new, r, rt.n) if i in active))
             for r in lacking]

    def weights_of(layers: tuple[int, ...]) -> list[Tensor]:
        if rt.rank == src:
            return [data["model"][n] for i in layers for n in names[i]]
        return [p.data for i in layers for p in rt.layer_params[i]]

    def state_of(layers: tuple[int, ...]) -> list[Tensor]:
        if rt.rank == src:
            return [data["optim"][n][k] for i in layers for n in names[i] for k in keys]
        return [t for i in layers for p in rt.layer_params[i] for t in ensure_state(rt.opt, p)]

    batched = rt.backend == "nccl"
    sent = exchange([t for t in weights if t.layers], rt.rank, weights_of, rt.device, batched=batched)
    sent += exchange([t for t in state if t.layers], rt.rank, state_of, rt.device, batched=batched)
    del data
    load_s = time.perf_counter() - t0
    need = needs(new, rt.n)  # every rank that needs a layer now holds it, and its owners its state
    info = rt.switch(index, have_weights=need,
                     have_state=[need[i] if i in active else frozenset() for i in range(rt.n)])
    rng = meta["rng"][rt.rank]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    both = torch.tensor([load_s, sent], dtype=torch.float64, device=rt.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    load_s = float(both[0].item())
    info = {**info, "seconds": info["seconds"] + load_s, "parts": {**info["parts"], "checkpoint": load_s},
            "bytes": {**info["bytes"], "checkpoint_sent_max": int(both[1].item())}}
    return pos, info


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **kw: Any) -> None: ...
    def close(self) -> None: ...


def _progress(enabled: bool, total: int | None, initial: int):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    # stdout: under ``ptplan run`` the workers' stderr goes to the worker log
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout)
