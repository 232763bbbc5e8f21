"""Flags that do not apply to the other options given: refused (or warned) by name, never silently ignored."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import click
from click.core import ParameterSource

from ptplan.planner.errors import PtplanError

Rule = tuple[str, Callable[[dict[str, Any]], bool], str]
"""(parameter name, when it does not apply given every parameter's value, why and the fix)."""


def given(ctx: click.Context, name: str) -> bool:
    """Whether the user set parameter ``name`` (on the command line or through the environment)."""
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def _flag(ctx: click.Context, name: str) -> str:
    for p in ctx.command.params:
        if p.name == name and isinstance(p, click.Option):
            return max(p.opts, key=len)
    return name


def refuse_inapplicable(ctx: click.Context, rules: Sequence[Rule]) -> None:
    """Raise PtplanError for the first rule whose flag was given where it does not apply."""
    for name, idle, why in rules:
        if given(ctx, name) and idle(ctx.params):
            raise PtplanError(f"{_flag(ctx, name)} {why.format_map(ctx.params)}")


PLAN_RULES: list[Rule] = [
    ("alpha", lambda p: p["freeze_policy"] != "geometric" and not p.get("adaptive"),
     "sets the geometric freeze rate; it does nothing with --freeze {freeze_policy}: leave it out or use "
     "--freeze geometric"),
    ("manual", lambda p: p["freeze_policy"] != "manual",
     "lists frozen blocks for --freeze manual; leave it out or use --freeze manual"),
    ("freeze_every", lambda p: p["freeze_policy"] == "none",
     "sets when layers freeze, but --freeze none never freezes any: leave it out or choose a freeze policy"),
    ("cache", lambda p: p["freeze_policy"] == "none" and p.get("cache") == "on",
     "on caches the frozen prefix's outputs, but --freeze none never freezes a layer: leave it out or choose a "
     "freeze policy"),
]
"""``ptplan plan`` and ``ptplan ablate`` (the shared options)."""

RUN_RULES: list[Rule] = [
    ("alpha", lambda p: p["freeze"] != "adaptive",
     "is the freeze rate of --freeze adaptive; --freeze planned follows the plan's trajectory (its alpha is the "
     "plan's): leave it out, or run with --freeze adaptive"),
    ("checkpoint_every", lambda p: not p["checkpoint_dir"],
     "needs --checkpoint-dir (where to write the checkpoints)"),
    ("save_model_dir", lambda p: not p["save_model_every"],
     "is the folder of --save-model-every N; give --save-model-every too, or leave it out"),
    ("momentum", lambda p: p["optimizer"] != "sgd",
     "is SGD's and this run uses adamw (the plan's optimizer unless --optimizer says otherwise): leave it out"),
    ("adam_eps", lambda p: p["optimizer"] != "adamw",
     "is AdamW's and this run uses sgd (the plan's optimizer unless --optimizer says otherwise): leave it out"),
    ("eval_batch_size", lambda p: not p["eval_data"], "needs --eval-data (what to evaluate)"),
    ("cache_dir", lambda p: p["cache_mode"] == "off", "is the AutoCache's folder; with --cache off leave it out"),
    ("cache_budget", lambda p: p["cache_mode"] == "off", "caps the AutoCache; with --cache off leave it out"),
    ("cache_spill_dir", lambda p: p["cache_mode"] == "off", "is the AutoCache's disk tier; with --cache off leave "
                                                            "it out"),
    ("cache_allow_nondeterministic", lambda p: p["cache_mode"] == "off",
     "lets the AutoCache cache a random prefix; with --cache off leave it out"),
]
"""``ptplan run``."""


def check_freeze_every(option: str, every: int | None, steps: int, where: str, other: str = "--freeze none") -> None:
    """A freeze step every ``every`` optimizer steps must come at least once in the ``steps`` the training has."""
    if every is not None and every > steps:
        raise PtplanError(f"{option} {every:,}: the training has {steps:,} optimizer steps ({where}), so no freeze "
                          f"step would ever come and no layer would freeze; give {option} {max(steps, 1)} or less, "
                          f"or {other}")


def twobw_warning(schedule: str, freeze_policy: str, freeze_every: int | None) -> str | None:
    """PipeDream-2BW with a freeze step after every optimizer step: each phase change drains its pipeline."""
    if schedule == "2bw" and freeze_policy != "none" and freeze_every == 1:
        return ("--schedule 2bw with --freeze-every 1: a freeze step after every optimizer step can change the "
                "phase at every step, and 2BW drains its pipeline at each phase change, so those steps run as 1F1B "
                "with a flush and the plan's 2BW steady-state times do not hold there; use --freeze-every 2 or more "
                "(or --schedule 1f1b)")
    return None
