"""``ptplan run``: check the plan against the job, then launch torchrun with one worker per process."""
from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Any, Callable

import click

from ptplan.planner.errors import PtplanError


RUN_LAUNCH_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--model", default=None,
                 help="Model adapter name (e.g. bert-base) or a local Hugging Face folder; must match the plan's "
                      "profile [default: the MODEL (and --weights) the plan's profile was made with]."),
    click.option("--weights", type=click.Path(file_okay=False), default=None,
                 help="Local Hugging Face model folder whose weights to start from [default: a --model folder's own "
                      "weights when it has weight files, else random init from --seed]."),
    click.option("--nproc-per-node", type=int, default=None,
                 help="Processes (GPUs) on this node [default on one node: the plan's K*D]."),
    click.option("--nnodes", default="1", show_default=True,
                 help="Nodes (torchrun), or MIN:MAX: with --rdzv-backend c10d the job goes on when nodes leave or "
                      "join, re-planning for the new world size from the plan's profile and resuming from its last "
                      "sharded checkpoint (--checkpoint-format sharded --checkpoint-every N, --max-restarts >= 1)."),
    click.option("--node-rank", type=int, default=None, help="This node's rank (torchrun static rendezvous)."),
    click.option("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (torchrun)."),
    click.option("--rdzv-id", default=None, help="Job id shared by all nodes (torchrun)."),
    click.option("--rdzv-backend", default=None, help="Rendezvous backend, e.g. c10d (torchrun)."),
    click.option("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                 help="Rendezvous settings (torchrun), e.g. last_call_timeout=2,keep_alive_interval=1 (how long an "
                      "elastic rendezvous waits for more nodes, how soon it drops a lost one)."),
    click.option("--master-addr", default=None, help="Static rendezvous address (torchrun)."),
    click.option("--master-port", type=int, default=None, help="Static rendezvous port (torchrun)."),
    click.option("--max-restarts", type=int, default=0, show_default=True,
                 help="Restart the worker group on a failure; restarts resume from --checkpoint-dir."),
]
"""The model and torchrun's launch: processes, nodes, rendezvous, restarts."""


RUN_TRAINING_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--epochs", type=int, default=None, help="Epochs (default: the plan's)."),
    click.option("--steps-per-epoch", type=int, default=None,
                 help="Optimizer steps per epoch (default: the plan's samples per epoch over the global batch; a "
                      "shorter --data file, its own)."),
    click.option("--optimizer", type=click.Choice(["plan", "sgd", "adamw"]), default="plan", show_default=True,
                 help="plan: the optimizer the plan priced the optimizer state of (its --optimizer); another one is "
                      "run with a note that the plan's memory is not its memory."),
    click.option("--lr", type=float, default=None,
                 help="Peak learning rate [default: 5e-5 with AdamW (fine-tuning), 0.01 with SGD]."),
    click.option("--lr-schedule", type=click.Choice(["constant", "linear", "cosine"]), default="constant",
                 show_default=True, help="After the warm-up: keep the rate, or decay it to 0 at the last step."),
    click.option("--warmup-steps", type=int, default=0, show_default=True,
                 help="Linear learning-rate warm-up over the first N optimizer steps."),
    click.option("--clip-grad-norm", type=float, default=None,
                 help="Clip the global gradient norm (the whole model's, across stages) to this value."),
    click.option("--decay-all", is_flag=True,
                 help="Apply --weight-decay to biases and normalisation weights too (default: matrices only)."),
    click.option("--momentum", type=float, default=0.9, show_default=True, help="SGD momentum."),
    click.option("--weight-decay", type=float, default=0.0, show_default=True),
    click.option("--adam-eps", type=float, default=1e-8, show_default=True, help="AdamW epsilon."),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--freeze", type=click.Choice(["planned", "adaptive"]), default="planned", show_default=True,
                 help="Follow the plan's trajectory, or decide from measured gradient norms."),
    click.option("--freeze-every", type=int, default=None,
                 help="A freeze step every N optimizer steps (default: the plan's cadence, per epoch)."),
    click.option("--alpha", type=float, default=None, help="Freeze rate for --freeze adaptive (default: the plan's)."),
]
"""Training: epochs, optimizer, learning rate, seed and freezing."""


RUN_OUTPUT_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--checkpoint-dir", type=click.Path(file_okay=False), default=None),
    click.option("--checkpoint-every", type=int, default=0, show_default=True,
                 help="Also checkpoint every N steps (always at each epoch end when --checkpoint-dir is set)."),
    click.option("--resume", is_flag=True, help="Continue from --checkpoint-dir/checkpoint.pt."),
    click.option("--checkpoint-format", type=click.Choice(["single", "sharded"]), default="single", show_default=True,
                 help="single: rank 0 gathers and writes checkpoint.pt (same plan and world size on resume; no shared "
                      "folder needed). sharded: every rank writes its own stage (torch.distributed.checkpoint) to one "
                      "folder all ranks see; --resume with any plan of the same profile (another GPU count)."),
    click.option("--async-checkpoint", is_flag=True,
                 help="With --checkpoint-format sharded: write in the background while training goes on."),
    click.option("--log", "log_path", default="run.jsonl", show_default=True,
                 help="Run log (JSON lines) for `ptplan compare`."),
    click.option("--data", default="synthetic", show_default=True,
                 help="'synthetic' or a .pt/.npz file with inputs, labels and optional attention_mask; a file longer "
                      "than the plan's samples per epoch trains its first N each epoch (the plan's epoch)."),
    click.option("--no-shuffle", is_flag=True, help="Visit samples in id order."),
    click.option("--eval-data", type=click.Path(dir_okay=False), default=None,
                 help="Held-out .pt/.npz file (the --data format): evaluated at each epoch end (accuracy and loss "
                      "for classification, perplexity for GPT-2), logged and printed at the end."),
    click.option("--eval-every", type=int, default=0, show_default=True,
                 help="Also evaluate every N optimizer steps (0: epoch ends only)."),
    click.option("--eval-batch-size", type=int, default=32, show_default=True,
                 help="Samples per evaluation micro-batch on each pipeline."),
    click.option("--export", "export_dir", type=click.Path(file_okay=False), default=None,
                 help="Write the final model here as a complete Hugging Face folder: weights, config.json with the "
                      "--data file's label names, the tokenizer (or image processor) of --weights or the --model "
                      "folder, and a model card (README.md). Must not exist or be empty."),
    click.option("--export-best", is_flag=True,
                 help="Write --export at the best held-out evaluation (accuracy; loss for causal LMs) instead of "
                      "the end; needs --eval-data."),
    click.option("--save-model-every", type=int, default=0, show_default=True,
                 help="Every N optimizer steps, write the model only (a Hugging Face folder, no optimizer state) to "
                      "--save-model-dir/model-stepNNNNNN."),
    click.option("--save-model-dir", type=click.Path(file_okay=False), default=None,
                 help="Folder for --save-model-every [default: --checkpoint-dir]."),
]
"""Checkpoints, the run log, the data, evaluation and the model written out."""


RUN_DEVICE_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--precision", type=click.Choice(["plan", "fp32", "bf16"]), default="plan", show_default=True,
                 help="plan: weights, activations, gradients and optimizer state in the dtype of the plan's profile "
                      "(what the plan priced: a bf16 profile trains bf16 weights); fp32: float32 throughout; bf16: "
                      "float32 weights, gradients and optimizer state with the forward passes under torch.autocast in "
                      "bfloat16, on CUDA (a GPU with bf16) or CPU."),
    click.option("--dropout", type=float, default=None, help="Set every dropout probability of the model."),
    click.option("--num-labels", type=int, default=None,
                 help="Classes of the classification head (bert, vit) [default: the plan's profile's]."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
    click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
                 help="Seconds a collective may wait before the job fails (a dead rank)."),
    click.option("--no-progress", is_flag=True, help="No progress bar."),
]
"""Precision, the model's head and dropout, the device, timeouts and progress."""


RUN_CACHE_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--cache", "cache_mode", type=click.Choice(["auto", "off"]), default="auto", show_default=True,
                 help="AutoCache: 'auto' caches the frozen prefix's output per sample in the phases where the plan "
                      "says so (ptplan plan --cache); 'off' recomputes it every step (same results)."),
    click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                 help="Directory for the cache's RAM tier, shared by the processes of a node; removed at the end "
                      "(default: /dev/shm, RAM-backed)."),
    click.option("--cache-budget", default=None, metavar="SIZE",
                 help="Cap on the cache's RAM-tier bytes per node, e.g. 8GiB or 500MB (default: what the data "
                      "needs, every sample's prefix output at two frozen counts)."),
    click.option("--cache-spill-dir", type=click.Path(file_okay=False), default=None,
                 help="Disk directory for cache slabs beyond --cache-budget (default: none; rows that do not fit "
                      "are recomputed)."),
    click.option("--cache-allow-nondeterministic", is_flag=True,
                 help="Cache even when the frozen prefix is not a fixed function of the sample (random data "
                      "augmentation, a layer random in eval mode); later epochs then replay the first output. "
                      "Without it such a run stops before training."),
]
"""AutoCache: the frozen prefix's outputs cached per sample."""


def with_options(*groups: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    """A decorator applying the option groups in order (the first one's first option shows first in --help)."""
    def apply(f: Any) -> Any:
        for opt in reversed([o for g in groups for o in g]):
            f = opt(f)
        return f
    return apply


@click.command("run")
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False))
@with_options(RUN_LAUNCH_OPTIONS, RUN_TRAINING_OPTIONS, RUN_OUTPUT_OPTIONS, RUN_DEVICE_OPTIONS,
              RUN_CACHE_OPTIONS)
@click.option("--dry-run", is_flag=True, help="Check everything and print the torchrun command; do not run.")
def run(plan_path: str, model: str | None, weights: str | None, nproc_per_node: int | None, nnodes: str, node_rank: int | None,
        rdzv_endpoint: str | None, rdzv_id: str | None, rdzv_backend: str | None, rdzv_conf: str | None,
        master_addr: str | None,
        master_port: int | None, max_restarts: int, epochs: int | None, steps_per_epoch: int | None,
        optimizer: str, lr: float | None, lr_schedule: str, warmup_steps: int, clip_grad_norm: float | None,
        decay_all: bool, momentum: float, weight_decay: float, adam_eps: float, seed: int, freeze: str,
        freeze_every: int | None, alpha: float | None, checkpoint_dir: str | None, checkpoint_every: int,
        resume: bool, checkpoint_format: str, async_checkpoint: bool, log_path: str, data: str, no_shuffle: bool, eval_data: str | None, eval_every: int,
        eval_batch_size: int, export_dir: str | None, export_best: bool, save_model_every: int,
        save_model_dir: str | None, precision: str, dropout: float | None, num_labels: int | None,
        device: str, timeout_s: float, no_progress: bool, cache_mode: str, cache_dir: str | None,
        cache_budget: str | None, cache_spill_dir: str | None, cache_allow_nondeterministic: bool,
        dry_run: bool) -> None:
    """Replay PLAN as real elastic pipelined data-parallel training (torchrun; gloo on CPU, NCCL on GPU).

    \b
    one node:   ptplan run plan.json --model bert-base --nproc-per-node 4
                ptplan run plan.json --data train.pt   (the plan's model and world size)
    two nodes:  ptplan run plan.json --model bert-base --nproc-per-node 8 --nnodes 2 \\
                  --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id job1   (on each node)
    """
    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.launch.launcher import Rendezvous

    from ptplan.planner.plan import load_plan

    plan = load_plan(plan_path)  # once, for the defaults the plan sets
    model, weights, nproc_per_node = _from_plan(plan, plan_path, model, weights, nproc_per_node, nnodes)
    precision, dtype = _precision(plan, precision)
    from ptplan.executor.training.config import optimizer_for

    optimizer, optimizer_note = optimizer_for(plan, optimizer)
    click.get_current_context().params["optimizer"] = optimizer  # what RUN_RULES check the flags against
    rdzv = Rendezvous(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                      rdzv_id=rdzv_id, rdzv_backend=rdzv_backend, master_addr=master_addr, master_port=master_port,
                      max_restarts=max_restarts, rdzv_conf=rdzv_conf)
    if not log_path.strip():
        raise PtplanError("--log is empty; give a file name (the run log `ptplan compare` reads)")
    # Every path the workers read or write is made absolute here: they may start in another directory.
    save_model_dir = save_model_dir or (checkpoint_dir if save_model_every else None)
    cfg = RunConfig(plan=os.path.abspath(plan_path), model=os.path.abspath(model) if os.path.isdir(model) else model,
                    weights=_absolute(weights), epochs=epochs,
                    steps_per_epoch=steps_per_epoch, optimizer=optimizer,
                    lr=lr, lr_schedule=lr_schedule,
                    warmup_steps=warmup_steps, clip_grad_norm=clip_grad_norm, decay_all=decay_all, momentum=momentum,
                    weight_decay=weight_decay, adam_eps=adam_eps, seed=seed, freeze=freeze, freeze_every=freeze_every,
                    alpha=alpha, checkpoint_dir=os.path.abspath(checkpoint_dir) if checkpoint_dir else None,
                    checkpoint_every=checkpoint_every, resume=resume, checkpoint_format=checkpoint_format,
                    async_checkpoint=async_checkpoint,
                    log=os.path.abspath(log_path) if log_path else None,
                    data=data if data == "synthetic" else os.path.abspath(data), shuffle=not no_shuffle,
                    eval_data=os.path.abspath(eval_data) if eval_data else None, eval_every=eval_every,
                    eval_batch_size=eval_batch_size, export=_absolute(export_dir), export_best=export_best,
                    save_model_every=save_model_every, save_model_dir=_absolute(save_model_dir), precision=precision,
                    dtype=dtype,
                    dropout=dropout, num_labels=num_labels, device=device, timeout_s=timeout_s,
                    progress=not no_progress, cache=cache_mode,
                    cache_dir=os.path.abspath(cache_dir) if cache_dir else None,
                    cache_budget=None if cache_budget is None else parse_size(cache_budget, "--cache-budget"),
                    cache_spill_dir=os.path.abspath(cache_spill_dir) if cache_spill_dir else None,
                    cache_allow_nondeterministic=cache_allow_nondeterministic).resolved(plan)
    from ptplan.cli.flags import RUN_RULES, refuse_inapplicable

    refuse_inapplicable(click.get_current_context(), RUN_RULES)  # after each value's own check (RunConfig)
    if optimizer_note:
        click.echo(f"note: {optimizer_note}", err=True)
    _check_and_launch(cfg, rdzv, dry_run)


def _check_and_launch(cfg: Any, rdzv: Any, dry_run: bool) -> None:
    """The plan's head size into the config, every check before launch, then torchrun (--dry-run: print its
    command instead); a failed job exits with its code, an exported model is finished."""
    from ptplan.executor.training.job import with_plan_num_labels
    from ptplan.executor.launch.launcher import command, launch, worker_log_path

    cfg = with_plan_num_labels(cfg)
    wlog = worker_log_path(cfg.log, rdzv)
    replan = check_before_launch(cfg, rdzv, worker_log=wlog)
    if dry_run:
        click.echo(shlex.join(command(cfg, rdzv)))
        return
    from ptplan.cli.outputs import make_parent_folders

    make_parent_folders(cfg.log, wlog)  # checked creatable before launch; the workers open them
    outcome = launch(cfg, rdzv, worker_log=wlog, replan=replan)
    if outcome.swept:
        click.echo(f"note: removed {len(outcome.swept)} file(s) left by ended ptplan jobs: "
                   f"{', '.join(outcome.swept)}", err=True)
    if outcome.code:
        click.echo(f"error: {outcome.message}", err=True)
        sys.exit(outcome.code)
    _finish_export(cfg)


def _from_plan(plan: Any, plan_path: str, model: str | None, weights: str | None, nproc_per_node: int | None,
               nnodes: str) -> tuple[str, str | None, int]:
    """--model/--weights and --nproc-per-node from the plan where not given (cli/run_defaults.py)."""
    if model is not None and nproc_per_node is not None:
        return model, weights, nproc_per_node
    from ptplan.cli.run_defaults import model_from_plan, nproc_from_plan

    if model is None:
        model, recorded = model_from_plan(plan, plan_path)
        weights = weights if weights is not None else recorded
    return model, weights, nproc_per_node if nproc_per_node is not None else nproc_from_plan(plan, nnodes)


def _precision(plan: Any, precision: str) -> tuple[str, str]:
    """``--precision`` -> (RunConfig.precision, RunConfig.dtype): ``plan`` trains in the plan's profile dtype with no
    autocast (the model the plan priced), ``fp32`` in float32, ``bf16`` float32 weights under bfloat16 autocast."""
    if precision != "plan":
        return precision, "float32"
    return "fp32", plan.inputs.profile.dtype


def _finish_export(cfg) -> None:
    """After a run with --export: tokenizer, label names and a model card in the folder (where rank 0 wrote it)."""
    if not cfg.export or not os.path.isfile(os.path.join(cfg.export, "config.json")):
        return
    from ptplan.executor.training.export import finish_export

    folder = cfg.model if os.path.isdir(cfg.model) else None
    for note in finish_export(cfg.export, sources=[cfg.weights, folder], data=cfg.data, plan_path=cfg.plan,
                              log_path=cfg.log):
        click.echo(f"note: {note}", err=True)


def _absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def check_before_launch(cfg, rdzv, *, worker_log: str | None = None) -> Any:
    """Refuse a job that cannot work before starting any process: world size, model, batch, schedule, the
    outputs (never an input, folders writable), the data file (dtype, ids, labels, sequence length, size)
    and, on one node, the checkpoint a --resume would read (readable, of this plan and run). Returns an elastic
    job's re-plan settings (``replan.check_elastic``), else None."""
    from ptplan.cli.main import check_outputs
    from ptplan.executor.data.dataset import check_data, load_dataset
    from ptplan.executor.training.freezing import FreezeSchedule
    from ptplan.executor.training.job import build_for_plan, epoch_samples, epoch_samples_note, samples_needed
    from ptplan.executor.training.validate import (batch_policy_of, check_epoch_data, check_model, check_phase,
                                                   check_trajectory, global_batch_of)
    from ptplan.planner.plan import load_plan

    plan = load_plan(cfg.plan)
    world = rdzv.fixed_world()
    replan = _check_world(cfg, rdzv, plan)
    gb, policy = global_batch_of(plan), batch_policy_of(plan)
    for i, ph in enumerate(plan.phases):
        check_phase(i, ph, gb, policy)
    check_trajectory(plan)
    ckpt_file = os.path.join(cfg.checkpoint_dir, "checkpoint.pt") if cfg.checkpoint_dir else None
    if cfg.checkpoint_dir and os.path.exists(cfg.checkpoint_dir) and not os.path.isdir(cfg.checkpoint_dir):
        raise PtplanError(f"--checkpoint-dir {cfg.checkpoint_dir} is a file, not a folder")
    data_file = None if cfg.data == "synthetic" else os.path.abspath(cfg.data)
    check_outputs([("plan", cfg.plan), ("--data file", data_file), ("--eval-data file", cfg.eval_data)],
                  [("--log", cfg.log), ("worker log", worker_log),
                   ("checkpoint", ckpt_file)], make_folders=True)
    if cfg.cache_dir is not None and not os.path.isdir(cfg.cache_dir):
        raise PtplanError(f"--cache-dir {cfg.cache_dir}: no such directory; create it or leave the option out "
                          f"(/dev/shm)")
    if data_file is not None and not os.path.exists(data_file):
        raise PtplanError(f"--data {cfg.data}: no such file; pass 'synthetic' or a .pt/.npz file")
    if cfg.export is not None and not (cfg.export_best and cfg.resume):  # a resumed --export-best: the best so far
        from ptplan.executor.training.export import check_export_dir

        check_export_dir(cfg.export)
    if cfg.weights is not None and not os.path.isdir(cfg.weights):
        raise PtplanError(f"--weights {cfg.weights}: no such folder; give a local Hugging Face model folder")
    if cfg.save_model_dir is not None:
        if os.path.exists(cfg.save_model_dir) and not os.path.isdir(cfg.save_model_dir):
            raise PtplanError(f"--save-model-dir {cfg.save_model_dir} is a file, not a folder")
        check_outputs([], [("model checkpoint", os.path.join(cfg.save_model_dir, "model-step000000"))],
                      make_folders=True)
    if cfg.device == "cuda":
        from ptplan.executor.training.job import check_cuda

        check_cuda(rdzv.nproc_per_node, f"--nproc-per-node {rdzv.nproc_per_node}")
    if cfg.precision == "bf16" and cfg.device == "cuda":
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise PtplanError(f"--precision bf16: {torch.cuda.get_device_name(0)} has no bfloat16 support; run "
                              f"with --precision fp32")
    if cfg.eval_data is not None and not os.path.exists(cfg.eval_data):
        raise PtplanError(f"--eval-data {cfg.eval_data}: no such file; pass a .pt/.npz file in the --data format")
    model = build_for_plan(plan, cfg, layers=[])  # the module tree only: no weights in the launcher (issue 10)
    check_model(plan, model, cfg.plan)
    FreezeSchedule(plan, cfg.freeze, num_blocks=model.num_blocks, every=cfg.freeze_every, alpha=cfg.alpha)
    note = None
    if data_file is not None:
        ds = load_dataset(data_file)
        check_data(ds, model, what=f"--data {cfg.data}")
        note = epoch_samples_note(plan, cfg, len(ds), f"--data {cfg.data}")
        n = epoch_samples(plan, cfg, len(ds))
        check_epoch_data(plan, cfg, n, f"--data {cfg.data}")
        del ds
    else:
        n = samples_needed(plan, cfg)
        _check_synthetic_epoch(cfg, plan, n, rdzv.nproc_per_node)
    _check_run_length(cfg, plan, n)
    if cfg.eval_data is not None:
        ev = load_dataset(cfg.eval_data)
        check_data(ev, model, what=f"--eval-data {cfg.eval_data}")
        del ev
    if cfg.resume and rdzv.max_nodes == 1:
        _check_resumable(cfg, plan, model.name, world, n)
    if note:
        click.echo(f"note: {note}", err=True)
    return replan


def _check_world(cfg, rdzv, plan) -> Any:
    """The job's processes against the plan's, and the nodes' rendezvous. An elastic job (--nnodes MIN:MAX) forms
    its world at the rendezvous and its workers re-plan when it is not the plan's: what that needs is checked
    (``replan.check_elastic``) and its re-plan settings returned; else None."""
    from ptplan.executor.training.validate import check_world

    replan = None
    if rdzv.elastic:
        from ptplan.executor.launch.replan import check_elastic

        check_world(plan, plan.world_size)  # the plan's strategies
        replan = check_elastic(cfg, rdzv, plan)
    else:
        check_world(plan, rdzv.fixed_world())
    rdzv.check_nodes()
    return replan


def _check_run_length(cfg, plan, samples: int) -> None:
    """--freeze-every and --warmup-steps within the steps the run has (a freeze step that never comes freezes
    nothing; a warm-up as long as the run never reaches the peak learning rate)."""
    from ptplan.cli.flags import check_freeze_every

    biggest = max(ph.global_batch for ph in plan.phases)
    epochs = cfg.epochs or plan.inputs.training.epochs
    per_epoch = cfg.steps_per_epoch or samples // biggest
    check_freeze_every("--freeze-every", cfg.freeze_every, epochs * per_epoch,
                       f"{epochs} epochs of {per_epoch} steps", "leave it out (the plan's cadence)")
    most = epochs * (cfg.steps_per_epoch or samples // min(ph.global_batch for ph in plan.phases))
    if cfg.warmup_steps and cfg.warmup_steps >= most:
        per = (f"--steps-per-epoch {cfg.steps_per_epoch}" if cfg.steps_per_epoch else
               "the plan's smallest global batch")
        raise PtplanError(f"--warmup-steps {cfg.warmup_steps} is not shorter than the run ({most} steps at most: "
                          f"{epochs} epochs of {per}): the learning rate would never reach its peak; give fewer "
                          f"warm-up steps")


def _check_synthetic_epoch(cfg, plan, samples: int, nproc_per_node: int) -> None:
    """With --data synthetic: --steps-per-epoch within the plan's epoch (the plan's samples per epoch is the data
    size a synthetic run stands for), and each process's shuffled order of the epoch within this machine's
    available memory."""
    from ptplan.executor.profiling.profiler import _available_host_bytes
    from ptplan.planner.config import epoch_order_problem

    biggest = max(ph.global_batch for ph in plan.phases)
    have = plan.inputs.training.samples_per_epoch
    if cfg.steps_per_epoch and samples > have:
        raise PtplanError(f"--steps-per-epoch {cfg.steps_per_epoch} needs {cfg.steps_per_epoch}*{biggest} = "
                          f"{samples:,} samples per epoch but the plan's epoch has {have:,} ({have // biggest} "
                          f"steps of {biggest}); give --steps-per-epoch {max(have // biggest, 1)} or less, or re-plan with "
                          f"--samples-per-epoch {samples}")
    why = epoch_order_problem(samples, nproc_per_node, _available_host_bytes())
    if why is not None:
        raise PtplanError(f"--data synthetic: {why} (available now on this machine)")


def _check_resumable(cfg, plan, model_name: str, world: int, samples: int) -> None:
    """On one node, the checkpoint --resume reads: present, readable and of this plan and run (several nodes:
    the workers look for it on every node, see ``executor.training``)."""
    from ptplan.executor.training import checkpoint as ckpt, sharded

    cfg = cfg.resolved(plan)  # the optimizer the checkpoint is checked against (``plan``: the plan's)
    run_id = {"samples": samples, "seed": cfg.seed, "shuffle": cfg.shuffle, "freeze": cfg.freeze,
              "freeze_every": cfg.freeze_every}
    if cfg.checkpoint_format == "sharded" and os.path.exists(sharded.meta_path(cfg.checkpoint_dir)):
        meta = sharded.read_meta(cfg.checkpoint_dir)  # any plan of its profile can continue it
        problems = sharded.resume_problems(meta, plan=plan, model_name=model_name, optimizer=cfg.optimizer,
                                           freeze=cfg.freeze, run=run_id)
        if problems:
            raise PtplanError(f"cannot resume from {sharded.meta_path(cfg.checkpoint_dir)}: " + "; ".join(problems)
                              + sharded.FIX)
        _check_position(cfg, plan, meta["position"], sharded.meta_path(cfg.checkpoint_dir))
        return
    if cfg.checkpoint_format == "single" and not os.path.exists(ckpt.checkpoint_path(cfg.checkpoint_dir)) \
            and os.path.exists(sharded.meta_path(cfg.checkpoint_dir)):
        raise PtplanError(f"no checkpoint at {ckpt.checkpoint_path(cfg.checkpoint_dir)}, but "
                          f"{sharded.meta_path(cfg.checkpoint_dir)} is a sharded one: resume it with "
                          f"--checkpoint-format sharded")
    data = ckpt.load_checkpoint(cfg.checkpoint_dir, mmap=True)
    problems = ckpt.mismatches(data, plan=plan, model_name=model_name, optimizer=cfg.optimizer, world_size=world,
                               run=run_id)
    if problems:
        raise PtplanError(f"cannot resume from {ckpt.checkpoint_path(cfg.checkpoint_dir)}: " + "; ".join(problems)
                          + "; resume with the plan and settings it was written with, or start without --resume "
                            "(and another --checkpoint-dir)")
    _check_position(cfg, plan, data["position"], ckpt.checkpoint_path(cfg.checkpoint_dir))


def _check_position(cfg, plan, pos: dict, where: str) -> None:
    """A checkpoint past the run's last epoch is refused (--epochs fewer than it has done: nothing would run, and
    the log would say the run went on); one at its very end is a note (nothing to train; --export still exports)."""
    epochs = cfg.epochs or plan.inputs.training.epochs
    at, inside, step = int(pos["epoch"]), int(pos["step_in_epoch"]), int(pos["global_step"])
    if at > epochs or (at == epochs and inside > 0):
        raise PtplanError(f"cannot resume from {where}: it is at epoch {at}, step {step}, past this run's "
                          f"{epochs} epoch(s); resume with --epochs {at + (1 if inside else 0)} or more, or start "
                          f"without --resume")
    if at == epochs:
        click.echo(f"note: {where} is at the end of the run's {epochs} epoch(s) (step {step}): no step will run"
                   + (f"; --export {cfg.export} exports it as it is" if cfg.export else ""), err=True)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, option: str) -> int:
    """Bytes from '123', '500MB', '8GiB', '1.5 GB' (decimal and binary units, case-insensitive)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m[2].lower() if m else ""
    if not m or unit not in _UNITS:
        raise PtplanError(f"{option} {text!r}: expected a size such as 8GiB, 500MB or 1000000 (bytes)")
    return int(float(m[1]) * _UNITS[unit])
