"""The optimizer: one torch optimizer over the whole canonical model, with state only for owned params.

Every rank keeps every ``nn.Parameter`` object of the model (those of layers it does not hold have
no storage: ``stage.LayerStore``) and a single optimizer over all of them. A parameter that has no
gradient (frozen, or held by another stage) is skipped by ``step()``, so the optimizer never has to
be rebuilt; at a phase change only the state of the parameters that move is sent, and the state of
parameters a rank no longer owns is dropped (freed). State tensors are created eagerly with the
values torch's lazy initialisation would give (zeros; AdamW ``step`` = 0), which is exact: SGD's
first update ``0 * momentum + grad`` equals its lazy ``clone(grad)`` bit for bit.
"""
from __future__ import annotations

import math

import torch

from ptplan.planner.errors import PtplanError

OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "linear", "cosine")


def param_groups(params: list[torch.nn.Parameter], weight_decay: float, *, decay_all: bool = False
                 ) -> list[dict]:
    """Weight decay on matrices only: biases and normalisation weights (the 1-D parameters) get none, as
    fine-tuning recipes (BERT's, Hugging Face's Trainer) do; ``decay_all`` decays every parameter. Two
    groups, decayed first, each in ``params``' order."""
    if decay_all or weight_decay == 0:
        return [{"params": params, "weight_decay": weight_decay}]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def make_optimizer(params: list[torch.nn.Parameter], kind: str, *, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                   eps: float = 1e-8, decay_all: bool = False) -> torch.optim.Optimizer:
    """SGD (with momentum) or AdamW over ``params`` (the whole model, in a fixed order), weight decay per
    ``param_groups``."""
    groups = param_groups(params, weight_decay, decay_all=decay_all)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise PtplanError(f"unknown optimizer {kind!r}; use one of {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, *, warmup: int, total: int | None, kind: str) -> float:
    """The learning rate's multiplier for optimizer step ``step`` (0-based): linear warm-up from 1/(warmup+1)
    over ``warmup`` steps, then ``constant``, or a ``linear`` or ``cosine`` decay to 0 at step ``total``
    (the formulas of transformers' get_linear/cosine_schedule_with_warmup, shifted so that the first step
    does not run at lr 0)."""
    if kind not in LR_SCHEDULES:
        raise PtplanError(f"unknown learning-rate schedule {kind!r}; use one of {', '.join(LR_SCHEDULES)}")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    if total is None:
        raise PtplanError(f"--lr-schedule {kind} needs the run's total steps; pass --steps-per-epoch")
    span = max(total - warmup, 1)
    done = min(max(step - warmup, 0), span) / span
    return 1.0 - done if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))


def state_keys(opt: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter state entries this optimizer keeps, in a fixed order."""
    if isinstance(opt, torch.optim.SGD):
        return ("momentum_buffer",) if opt.param_groups[0]["momentum"] != 0 else ()
    if isinstance(opt, torch.optim.AdamW):
        keys = ("step", "exp_avg", "exp_avg_sq")
        return keys + (("max_exp_avg_sq",) if opt.param_groups[0]["amsgrad"] else ())
    raise TypeError(f"unsupported optimizer {type(opt).__name__}")


def state_dtype(key: str, p: torch.Tensor) -> torch.dtype:
    """The dtype ``ensure_state`` gives a parameter's state entry: AdamW's step count float32, the rest ``p``'s."""
    return torch.float32 if key == "step" else p.dtype


def _fresh(opt: torch.optim.Optimizer, key: str, p: torch.Tensor) -> torch.Tensor:
    if key == "step":
        g = opt.param_groups[0]
        if g.get("capturable") or g.get("fused"):
            return torch.zeros((), dtype=torch.float32, device=p.device)
        return torch.tensor(0.0, dtype=torch.float32)
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def ensure_state(opt: torch.optim.Optimizer, p: torch.nn.Parameter) -> list[torch.Tensor]:
    """The state tensors of ``p`` (created as torch would lazily, if missing), in ``state_keys`` order."""
    keys = state_keys(opt)
    st = opt.state[p]
    for k in keys:
        if k not in st or st[k] is None:
            st[k] = _fresh(opt, k, p)
    return [st[k] for k in keys]


def drop_state(opt: torch.optim.Optimizer, keep: set[int]) -> None:
    """Forget the state of every parameter whose id() is not in ``keep``."""
    for p in list(opt.state.keys()):
        if id(p) not in keep:
            del opt.state[p]
