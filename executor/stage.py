"""One rank's stage of a phase: the layer storage it holds, a module made of those layers, and its schedule.

Stage s runs layers ``partition[s]``; stage 0 first runs the frozen prefix ``[0, frozen_layers)``
under ``no_grad`` in eval mode, unless the phase caches it (then stage 0's input is the prefix's
output, from ``cache.prefix_forward``). The layers are the canonical model's own modules (no copies), so
training a stage trains the canonical model in place.

Storage (``LayerStore``): every rank keeps the canonical model's module tree and every
``nn.Parameter`` object (so one optimizer over all of them stays valid and a parameter keeps its
name), but only the layers it holds (``transition.holdings``) have storage; a layer it does not
hold has each parameter's ``.data`` swapped for an empty tensor, its shape recorded to allocate it
again. This was chosen over building on the meta device and materialising per stage because a
layer moves between ranks at every transition anyway (it must be allocated and freed at run time
whatever the build does), and because it keeps the model's initialisation exactly as
``build_model`` makes it (bit-identical on every rank, checked once) with no per-layer re-seeding.
The price is the build: each rank first builds the whole model in host memory (see
``executor/training.py``), and frees what it does not hold at the first phase switch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ptplan.planner.plan import Phase

from .transition import DEVICE, HOST


class LayerStore:
    """Which layers have storage on this rank, and where: ``DEVICE``, ``HOST`` (CPU memory) or None."""

    def __init__(self, layers: nn.ModuleList, device: torch.device) -> None:
        self.layers, self.device = layers, device
        self.params = [list(layer.parameters()) for layer in layers]
        self.shapes = {id(p): p.shape for ps in self.params for p in ps}
        """Every parameter's full shape, kept while it has no storage."""
        self.sizes = [sum(p.numel() * p.element_size() for p in ps) for ps in self.params]
        """Bytes of each layer's parameters."""
        self.where: list[str | None] = [HOST if all(p.device.type == "cpu" for p in ps) else DEVICE
                                        for ps in self.params]
        """Per layer: ``DEVICE``, ``HOST`` or None (no storage). ``build_model`` builds on the CPU: HOST."""

    def _home(self, where: str) -> torch.device:
        return torch.device("cpu") if where == HOST else self.device

    def place(self, i: int, where: str, *, keep_values: bool) -> None:
        """Give layer i storage at ``where``: its values moved there when ``keep_values`` (and it has
        storage), else uninitialised (about to be received). Buffers move with it."""
        dev = self._home(where)
        with torch.no_grad():
            for p in self.params[i]:
                if keep_values and self.where[i] is not None:
                    p.data = p.data.to(dev)
                else:
                    p.grad = None
                    p.data = torch.empty(self.shapes[id(p)], dtype=p.dtype, device=dev)
            for b in self.layers[i].buffers():
                b.data = b.data.to(dev)
        self.where[i] = where

    def release(self, i: int) -> None:
        """Free layer i's parameters (an empty tensor each, shape recorded); its buffers stay (tiny)."""
        for p in self.params[i]:
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype)
        self.where[i] = None

    def held_bytes(self, where: str) -> int:
        """Bytes of the parameters of the layers held at ``where``."""
        return sum(size for size, w in zip(self.sizes, self.where) if w == where)


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
