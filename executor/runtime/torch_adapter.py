"""The one place the executor reaches into torch's private pipelining API, behind a version guard.

The step interpreter (``step``) runs every schedule itself; from torch it borrows only the split backward
of zero-bubble schedules (``torch.distributed.pipelining._backward``: the input gradient now, the weight
gradient later from what the first half kept) and, for the schedule report, torch's action type
(``torch.distributed.pipelining.schedules._Action``, which prints a plan's lists in torch's IR). Both are
private, so they are imported here only, after ``check_torch`` has checked the running torch against
``SUPPORTED`` -- the range ``tests/test_torch_adapter.py`` pins (the interface was read and tested on
torch 2.13; 2.8 is the oldest the package declares).
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Iterator

import torch
from torch import Tensor
from torch.nn import Parameter

from ptplan.planner.errors import PtplanError

SUPPORTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 8), (2, 14))
"""Torch versions whose private pipelining helpers this adapter was written against: [low, high)."""


def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``text`` (default: the running torch's ``__version__``, e.g. ``2.13.0+cpu``)."""
    text = torch.__version__ if text is None else text
    m = re.match(r"(\d+)\.(\d+)", str(text))
    if m is None:
        raise PtplanError(f"cannot read a torch version from {text!r}")
    return int(m.group(1)), int(m.group(2))


@lru_cache(maxsize=None)
def check_torch(text: str | None = None) -> tuple[int, int]:
    """Raise PtplanError unless the torch version (``text``, default the running one) is in ``SUPPORTED``."""
    v = torch_version(text)
    lo, hi = SUPPORTED
    if not lo <= v < hi:
        raise PtplanError(f"torch {text or torch.__version__} is outside the range the executor's pipelining adapter "
                          f"supports (>= {lo[0]}.{lo[1]}, < {hi[0]}.{hi[1]}): install a torch in that range, or "
                          f"check executor/runtime/torch_adapter.py against the new torch and widen SUPPORTED")
    return v


def backward_input(outputs: list[Tensor], grads: list[Tensor] | None, inputs: list[Tensor],
                   weights: Iterator[Parameter]) -> tuple[tuple[Tensor | None, ...], list[dict[str, Any]]]:
    """The gradients of ``inputs`` only (zero-bubble B), and what ``backward_weight`` needs later."""
    check_torch()
    from torch.distributed.pipelining._backward import stage_backward_input

    return stage_backward_input(outputs, grads, inputs, weights)


def backward_weight(weights: Iterator[Parameter], groups: list[dict[str, Any]]) -> None:
    """The weights' gradients (zero-bubble W), accumulated into ``.grad``, from ``backward_input``'s groups: one group
    a call, so that a group's gradients are freed once added, before the next group's are made (torch's one call
    keeps the previous group's beside them: two weights' gradients at once on a bert-tiny MLP half, where the stage
    model prices the largest one, ``accumulate``)."""
    check_torch()
    from torch.distributed.pipelining._backward import stage_backward_weight

    params = list(weights)
    for group in groups:
        stage_backward_weight(iter(params), [group])


def torch_action(token: str) -> Any:
    """One action in torch's schedule IR (``_Action.from_str``), e.g. ``1SEND_F0`` or ``0REDUCE_GRAD``."""
    check_torch()
    from torch.distributed.pipelining.schedules import _Action

    return _Action.from_str(token)
