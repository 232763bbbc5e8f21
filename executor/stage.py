"""One rank's stage of a phase: a module made of views of the canonical model's layers, and its schedule.

Stage s runs layers ``partition[s]``; stage 0 first runs the frozen prefix ``[0, frozen_layers)``
under ``no_grad`` in eval mode, unless the phase caches it (then stage 0's input is the prefix's
output, from ``cache.prefix_forward``). The layers are the canonical model's own modules (no copies), so
training a stage trains the canonical model in place.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ptplan.planner.plan import Phase


class StageModule(nn.Module):
    """Layers ``[lo, hi)`` of a layered model, preceded on stage 0 by the frozen prefix."""

    def __init__(self, layers: nn.ModuleList, lo: int, hi: int, prefix: int) -> None:
        super().__init__()
        self.lo, self.hi, self.prefix_len = lo, hi, prefix
        self.prefix = nn.ModuleList(layers[:prefix])
        self.active = nn.ModuleList(layers[lo:hi])

    def train(self, mode: bool = True) -> "StageModule":
        super().train(mode)
        self.prefix.eval()  # frozen layers always run as in inference (no dropout)
        return self

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if len(self.prefix):
            with torch.no_grad():
                for layer in self.prefix:
                    x = layer(x, attention_mask=attention_mask)
        for layer in self.active:
            x = layer(x, attention_mask=attention_mask)
        return x


def stage_module(model: nn.Module, phase: Phase, stage: int, *, cached_prefix: bool = False) -> StageModule:
    """The module for stage ``stage`` of ``phase``, made of ``model.layers`` (views, not copies).

    ``cached_prefix``: the caller feeds stage 0 the frozen prefix's output (AutoCache), so the module
    holds no prefix; the frozen layers are put in eval mode all the same, as they run when computed.
    """
    lo, hi = phase.partition[stage]
    prefix = phase.frozen_layers if stage == 0 and not cached_prefix else 0
    mod = StageModule(model.layers, lo, hi, prefix)
    mod.train()
    if cached_prefix:
        for layer in model.layers[:phase.frozen_layers]:
            layer.eval()
    return mod


def set_trainable(model: nn.Module, frozen_layers: int) -> None:
    """requires_grad off for the frozen prefix ``[0, frozen_layers)``, on for every other layer."""
    for i, layer in enumerate(model.layers):
        for p in layer.parameters():
            p.requires_grad_(i >= frozen_layers)


def build_schedule(module: StageModule, phase: Phase, stage: int, device: torch.device,
                   pp_group, loss_fn: Callable[[Tensor, Tensor], Tensor]):
    """A hand-built ``PipelineStage`` and the phase's schedule (GPipe or 1F1B, M micro-batches).

    The loss is a mean per micro-batch and ``scale_grads=True`` divides the accumulated gradients
    by M, so a pipeline's gradient is the mean over its micro-batches.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pstage = PipelineStage(module, stage, phase.K, device, group=pp_group)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[phase.schedule]
    return cls(pstage, n_microbatches=phase.M, loss_fn=loss_fn, scale_grads=True)
