"""Checks a plan against the job before any training: world size, model, batch split, schedule limits.

Every failure is a PtplanError with the numbers and the fix (the CLI prints it and exits 2).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Phase, Plan
from ptplan.planner.strategy import Strategy, runtime_refusal
from ptplan.planner.profile import structure_fingerprint
from ptplan.planner.tp_split import tp_refusal


def model_fingerprint(model: nn.Module) -> str:
    """The structure hash a profile of this model records (names, kinds, blocks, parameter counts)."""
    return structure_fingerprint((spec.name, spec.kind, spec.block, sum(p.numel() for p in layer.parameters()))
                                 for layer, spec in zip(model.layers, model.specs))


def _config(model: nn.Module) -> dict[str, Any]:
    """The model's Hugging Face config as a dict ({} for a custom model)."""
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    return to_dict() if callable(to_dict) else {}


def frozen_boundary(model: nn.Module, frozen_blocks: int) -> int:
    """Index of the first active layer with ``frozen_blocks`` frozen (as ``Profile.frozen_boundary``)."""
    if frozen_blocks == 0:
        return 0
    for i, spec in enumerate(model.specs):
        if spec.block is not None and spec.block >= frozen_blocks:
            return i
    return max(i for i, s in enumerate(model.specs) if s.block is not None) + 1


def global_batch_of(plan: Plan) -> int:
    """The plan's training batch: global under constant-global, per pipeline under constant-pipeline."""
    return plan.inputs.training.batch


def batch_policy_of(plan: Plan) -> str:
    return plan.inputs.training.batch_policy


def check_strategies(plan: Plan) -> None:
    """Refuse the strategies the executor does not run (``ptplan plan --strategies auto``, issue 14): tensor
    parallelism for a family ``hybrid.tp_families`` does not name, and any stage ``planner.strategy.runtime_refusal``
    refuses under the phase's schedule (the list the search also leaves out, so `ptplan plan` never writes them).

    Runs: recomputation (``Phase.recompute``, on every stage or per stage) with every schedule (2BW's loop
    checkpoints each micro-batch's ``functional_call`` on its weight version; under a split backward a whole
    recomputing stage rebuilds its graph once in B); FSDP (``Phase.fsdp``, on every stage or per stage) with GPipe,
    1F1B and interleaved 1F1B; tensor parallelism (``Phase.tp``), alone or with FSDP on a 2-D mesh, with or without
    the AutoCache."""
    from ptplan.executor.runtime.hybrid import tp_families

    family = plan.inputs.profile.family
    for i, ph in enumerate(plan.phases):
        what = f"plan phase {i} ({ph.frozen_blocks} frozen blocks, {ph.strategy_label})"
        fix = "make the plan with `ptplan plan --strategies off`"
        if ph.tp > 1 and family not in tp_families():
            raise PtplanError(f"{what}: the executor splits {', '.join(tp_families())} layers for tensor parallelism "
                              f"but this plan's model is a {family}; {fix}")
        for s in range(ph.K * ph.V):
            st = Strategy(tp=ph.tp, fsdp=ph.fsdp_at(s), recompute=ph.recompute_at(s),
                          recompute_layers=ph.recompute_layers_at(s), sp=ph.sp)
            why = runtime_refusal(ph.schedule, st, ph.D)
            if why is not None:
                raise PtplanError(f"{what}, stage {s}: {why}; make the plan again with this ptplan (`ptplan plan` "
                                  f"leaves these out), with another --schedule, or with `ptplan plan --strategies off`")


def check_world(plan: Plan, world_size: int) -> None:
    """The job's process count is the plan's (strategies are checked first: ``check_strategies``)."""
    check_strategies(plan)
    want = plan.world_size
    if world_size != want:
        p = plan.phases[0]
        raise PtplanError(
            f"the plan needs K*D = {p.K}*{p.D} = {want} processes but this job has {world_size}; "
            f"launch it with {want} processes in all (--nnodes x --nproc-per-node = {want}) or make a plan for "
            f"{world_size} GPUs with `ptplan plan`")


def _first_difference(plan: Plan, model: nn.Module, plan_path: str | None) -> str:
    """Where the model first differs from the plan's profile, layer by layer (name, kind, block, parameters), when
    the profile file is at hand (``replan.profile_file``: as recorded, or beside the plan): e.g. the head of another
    label count. '' otherwise."""
    from ptplan.executor.launch.replan import profile_file
    from ptplan.planner.profile import load_profile

    path = profile_file(plan, plan_path or ".")
    if path is None:
        return ""
    try:
        layers = load_profile(path).layers
    except PtplanError:
        return ""
    for rec, layer, spec in zip(layers, model.layers, model.specs):
        n = sum(p.numel() for p in layer.parameters())
        if (rec.name, rec.kind, rec.block, rec.params) != (spec.name, spec.kind, spec.block, n):
            what = f"layer {rec.index} ({rec.name}): {rec.params:,} parameters in the profile, {n:,} in the model"
            if (rec.name, rec.kind) != (spec.name, spec.kind):
                what = f"layer {rec.index} is {rec.name} ({rec.kind}) in the profile, {spec.name} ({spec.kind}) here"
            head = " -- the head: another --num-labels than the profile's?" if spec.kind == "head" else ""
            return f"; first difference: {what}{head}"
    return ""


def check_model(plan: Plan, model: nn.Module, plan_path: str | None = None) -> None:
    prof = plan.inputs.profile
    have = dict(model=model.name, num_layers=len(model.layers), num_blocks=model.num_blocks,
                granularity=model.granularity)
    desc = (f"{model.name} ({model.num_blocks} blocks, {len(model.layers)} layers at {model.granularity} "
            f"granularity)")
    fix = (f"pass --model {prof.model} or make a plan for {model.name} (`ptplan profile` then `ptplan plan`)"
           if model.name != prof.model else
           f"run {model.name} as it was profiled (the same --num-labels, --weights config and image size), or profile "
           f"it as it is and plan again (`ptplan profile` then `ptplan plan`)")
    for key, value in have.items():
        if getattr(prof, key) != value:
            raise PtplanError(f"the plan is for {prof.model} ({prof.num_blocks} blocks, {prof.num_layers} layers at "
                              f"{prof.granularity} granularity) but the model is {desc}: {key} "
                              f"{getattr(prof, key)!r} != {value!r}; {fix}")
    fp = prof.fingerprint
    if fp and fp != model_fingerprint(model):
        raise PtplanError(f"the plan's profile fingerprint {fp} does not match {desc} (fingerprint "
                          f"{model_fingerprint(model)}: layer names, kinds or parameter counts differ, e.g. another "
                          f"--weights config, image size or label count){_first_difference(plan, model, plan_path)}; {fix}")
    L = model.num_blocks
    for i, ph in enumerate(plan.phases):
        if ph.frozen_blocks > L:
            raise PtplanError(f"plan phase {i} freezes {ph.frozen_blocks} blocks but {model.name} has {L}")
        if ph.tp > 1 and (why := tp_refusal(model.family, _config(model), ph.tp)):  # heads, kv heads, MLP width
            raise PtplanError(f"plan phase {i} ({ph.frozen_blocks} frozen blocks, {ph.strategy_label}): {why}; "
                              f"make the plan with `ptplan plan --strategies off`")
        b = frozen_boundary(model, ph.frozen_blocks)
        if ph.frozen_layers != b:
            raise PtplanError(f"plan phase {i} ({ph.frozen_blocks} frozen blocks) starts its pipeline at layer "
                              f"{ph.frozen_layers} but in {desc} block {ph.frozen_blocks} starts at layer {b}; {fix}")
        if ph.partition[-1][1] != len(model.layers):
            raise PtplanError(f"plan phase {i}'s partition ends at layer {ph.partition[-1][1]} but {desc} has "
                              f"{len(model.layers)} layers; {fix}")
        if ph.slices and sum(ph.slices) != model.seq_len:  # token slices (TeraPipe): executor/runtime/sliced.py
            raise PtplanError(f"plan phase {i} ({ph.frozen_blocks} frozen blocks) cuts sequences of "
                              f"{sum(ph.slices)} tokens into slices {list(ph.slices)} but {model.name} runs "
                              f"sequences of {model.seq_len}; profile and plan at --seq-len {model.seq_len}, or plan "
                              f"with --token-slices off")


def check_phase(i: int, ph: Phase, global_batch: int | None, policy: str) -> None:
    """The phase's schedule and batch split. The schedule is checked by the very function the runtime
    builds it with (``actions.phase_schedule``: sizes, the stored action lists, message order), so a plan
    refused here is exactly one the workers could not run."""
    from ptplan.executor.runtime.actions import phase_schedule

    phase_schedule(ph, i)
    if global_batch is None:
        return
    if policy == "constant-global":
        split = ph.D * ph.M
        if global_batch % split or global_batch // split != ph.micro_batch_size:
            raise PtplanError(
                f"plan phase {i} ({ph.frozen_blocks} frozen blocks) cannot split the global batch of {global_batch} "
                f"samples into D*M = {ph.D}*{ph.M} = {split} equal micro-batches of {ph.micro_batch_size}: "
                f"{ph.D}*{ph.M}*{ph.micro_batch_size} = {ph.global_batch}; use a global batch divisible by {split} "
                f"and re-plan")
    elif ph.pipeline_batch != global_batch:
        raise PtplanError(
            f"plan phase {i} ({ph.frozen_blocks} frozen blocks) runs {ph.M}*{ph.micro_batch_size} = "
            f"{ph.pipeline_batch} samples per pipeline but the plan's per-pipeline batch is {global_batch}; "
            f"use a batch divisible by M={ph.M} and re-plan")


def check_trajectory(plan: Plan) -> None:
    """Every frozen count the plan's freeze steps reach has a phase (the plan reader checks it too)."""
    have = sorted(p.frozen_blocks for p in plan.phases)
    for T, f in enumerate(plan.freeze_steps):
        if f not in have:
            raise PtplanError(f"the plan's freeze step {T} reaches {f} frozen blocks but the plan has phases only "
                              f"for {have}; re-run `ptplan plan`")


def check_plan(plan: Plan, model: nn.Module, world_size: int) -> None:
    """Everything that must hold before training starts."""
    check_world(plan, world_size)
    check_model(plan, model)
    check_trajectory(plan)
    gb, policy = global_batch_of(plan), batch_policy_of(plan)
    for i, ph in enumerate(plan.phases):
        check_phase(i, ph, gb, policy)
    if policy == "constant-global":
        sizes = {ph.global_batch for ph in plan.phases}
        if len(sizes) > 1:
            raise PtplanError(f"constant-global-batch plan whose phases use different global batches {sorted(sizes)}; "
                              f"re-plan with `ptplan plan`")


def check_epoch_data(plan: Plan, cfg: Any, n: int, what: str) -> None:
    """Refuse data too small for the run: fewer samples than the largest global batch (that phase's step), or fewer
    than ``--steps-per-epoch`` steps of the smallest. The launcher and every worker check the same."""
    biggest = max(ph.global_batch for ph in plan.phases)
    smallest = min(ph.global_batch for ph in plan.phases)
    if n < biggest:
        raise PtplanError(f"{what} has {n} samples, fewer than one global batch of {biggest}")
    if cfg.steps_per_epoch and cfg.steps_per_epoch * smallest > n:
        raise PtplanError(f"--steps-per-epoch {cfg.steps_per_epoch} needs at least {cfg.steps_per_epoch}*{smallest} "
                          f"= {cfg.steps_per_epoch * smallest} samples per epoch but {what} has {n}; lower "
                          f"--steps-per-epoch or use more data")
