"""One rank's stages of a phase: the layer storage it holds, a module per stage made of those layers, and the
schedule that runs them.

Stage (chunk) s runs layers ``partition[s]``; a rank holds one stage, or V of them with interleaved
schedules (``groups.chunks_of``). Stage 0 first runs the frozen prefix ``[0, frozen_layers)`` under
``no_grad`` in eval mode, unless the phase caches it (then stage 0's input is the prefix's output,
from ``cache.prefix_forward``). The layers are the canonical model's own modules (no copies), so
training a stage trains the canonical model in place. The schedule runs the plan's action lists
(``actions``): torch.distributed.pipelining's custom-schedule runtime when K > 1, ``LocalSchedule``
when K = 1.

Storage (``LayerStore``): every rank keeps the canonical model's module tree and every
``nn.Parameter`` object (so one optimizer over all of them stays valid and a parameter keeps its
name), but only the layers it holds (``transition.holdings``) have storage; a layer it does not
hold has each parameter's ``.data`` swapped for an empty tensor, its shape recorded to allocate it
again. A rank starts with only its stage: ``ptplan run`` builds each rank's layers of the phase it
starts in and nothing else (``build_model(..., layers=training.stage_layers(...))``: the other
layers' parameters stay on the meta device, and ``LayerStore`` turns them into empty CPU tensors,
the same objects, with no storage), so no rank's host memory ever holds the whole model at the
build -- bert-base at 4 even stages materialises 154.0, 99.1, 90.1 and 74.4 MiB of parameters on its
ranks against 417.6 MiB for the whole model, peak resident memory 535, 482, 472 and 459 MiB against
805 MiB, of which 392 MiB are the interpreter with torch and transformers
(``bench/stage_build_bytes.py``). The first switch then moves nothing (every rank built what it needs); a model built whole (tests, ``custom_model``: the user's layers are
already materialised, left as they are) starts as every layer on HOST and is freed to the stage at
the first switch. Initialisation does not depend on who builds a layer: each Hugging Face submodule is
initialised from its own seed (``models.module_seed``), so a stage build equals the whole build on its
layers, bit for bit (``tests/test_stage_build.py``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Phase
from ptplan.planner.schedule import ActionKind, Schedule

from ptplan.executor.runtime.actions import split_backwards, torch_actions
from ptplan.executor.runtime.transition import DEVICE, HOST


class LayerStore:
    """Which layers have storage on this rank, and where: ``DEVICE``, ``HOST`` (CPU memory) or None."""

    def __init__(self, layers: nn.ModuleList, device: torch.device) -> None:
        self.layers, self.device = layers, device
        self.params = [list(layer.parameters()) for layer in layers]
        self.shapes = {id(p): p.shape for ps in self.params for p in ps}
        """Every parameter's full shape, kept while it has no storage."""
        self.sizes = [sum(p.numel() * p.element_size() for p in ps) for ps in self.params]
        """Bytes of each layer's parameters."""
        self.where: list[str | None] = [self._adopt(i) for i in range(len(layers))]
        """Per layer: ``DEVICE``, ``HOST`` or None (no storage). As built: a layer ``build_model`` built
        here is in host memory (HOST); one it left on the meta device (another stage's) has none."""

    def _adopt(self, i: int) -> str | None:
        """Where layer i is as built; a layer with a parameter on the meta device gets empty CPU tensors
        (the same ``nn.Parameter`` objects: ``swap_tensors``) and no storage."""
        ps = self.params[i]
        if any(p.device.type == "meta" for p in ps):
            for p in ps:
                if p.device.type == "meta":
                    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=p.dtype),
                                                             requires_grad=p.requires_grad))
                else:
                    p.data = torch.empty(0, dtype=p.dtype)
            for b in self.layers[i].buffers():
                assert b.device.type != "meta", f"layer {i} has a buffer on the meta device"
            return None
        return HOST if all(p.device.type == "cpu" for p in ps) else DEVICE

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
    """Layers ``[lo, hi)`` of a layered model, preceded on stage 0 by the frozen prefix.

    ``recompute`` (``Phase.recompute``, issue 14): the active layers run as one
    ``torch.utils.checkpoint`` unit (non-reentrant), so a micro-batch in flight keeps only the stage's
    input (and output) and its backward first reruns the stage's forward -- ``planner/stage.py``'s
    recomputation terms. The frozen prefix runs under ``no_grad`` either way (it saves nothing).
    """

    def __init__(self, layers: nn.ModuleList | list[nn.Module], lo: int, hi: int, prefix: int, *,
                 recompute: bool = False, active: list[nn.Module] | None = None,
                 frozen: list[nn.Module] | None = None) -> None:
        super().__init__()
        self.lo, self.hi, self.prefix_len, self.recompute = lo, hi, prefix, recompute
        self.prefix = nn.ModuleList(layers[:prefix] if frozen is None else frozen)
        self.active = nn.ModuleList(layers[lo:hi] if active is None else active)

    def train(self, mode: bool = True) -> "StageModule":
        super().train(mode)
        self.prefix.eval()  # frozen layers always run as in inference (no dropout)
        return self

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if len(self.prefix):
            with torch.no_grad():
                for layer in self.prefix:
                    x = layer(x, attention_mask=attention_mask)
        if self.recompute and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._run_active, x, attention_mask, use_reentrant=False)
        return self._run_active(x, attention_mask)

    def _run_active(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        for layer in self.active:
            x = layer(x, attention_mask=attention_mask)
        return x


class RecomputedLayers(nn.Module):
    """Consecutive layers of a stage run as one ``torch.utils.checkpoint`` unit (non-reentrant): a
    micro-batch in flight keeps only their input, and its backward reruns them first."""

    def __init__(self, layers: list[nn.Module], lo: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.lo, self.hi = lo, lo + len(layers)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        if torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._run_active, x, attention_mask, use_reentrant=False)
        return self._run_active(x, attention_mask)

    def _run_active(self, x: Tensor, attention_mask: Tensor | None) -> Tensor:
        for layer in self.layers:
            x = layer(x, attention_mask=attention_mask)
        return x


def recompute_first(mod: nn.Module, r: int) -> None:
    """Make stage module ``mod`` (``stage.StageModule``) recompute only its first r active layers
    (``Phase.recompute_layers``): those become one ``RecomputedLayers`` unit, the others keep their
    activations, and the module's own whole-stage checkpoint is switched off."""
    active = list(mod.active)
    if not 1 <= r < len(active):
        raise PtplanError(f"recompute the first {r} of a stage's {len(active)} active layers: use 1..{len(active) - 1}, "
                          f"or 0 for all of them; re-run `ptplan plan`")
    mod.recompute = False
    mod.active = nn.ModuleList([RecomputedLayers(active[:r], mod.lo), *active[r:]])


def stage_module(model: nn.Module, phase: Phase, stage: int, *, cached_prefix: bool = False,
                 twins: dict[int, nn.Module] | None = None) -> StageModule:
    """The module for stage (chunk) ``stage`` of ``phase``, made of ``model.layers`` (views, not copies).

    ``cached_prefix``: the caller feeds stage 0 the frozen prefix's output (AutoCache), so the module
    holds no prefix; the frozen layers are put in eval mode all the same, as they run when computed.
    ``twins``: layer index -> the module that runs in its place (the split and/or sharded copies of the
    active layers and, on stage 0, of the frozen prefix: ``hybrid``).
    """
    lo, hi = phase.partition[stage]
    prefix = phase.frozen_layers if stage == 0 and not cached_prefix else 0
    active = None if not twins else [twins.get(i, model.layers[i]) for i in range(lo, hi)]
    frozen = None if not twins else [twins.get(i, model.layers[i]) for i in range(prefix)]
    mod = StageModule(model.layers, lo, hi, prefix, recompute=phase.recompute_at(stage), active=active, frozen=frozen)
    if mod.recompute and phase.recompute_layers_at(stage):  # only its first r layers (Galvatron's layer-wise)
        recompute_first(mod, phase.recompute_layers_at(stage))
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


def build_schedule(chunks: dict[int, StageModule], phase: Phase, schedule: Schedule, device: torch.device,
                   pp_group, loss_fn: Callable[[Tensor, Tensor], Tensor]):
    """The phase's schedule on this rank: ``schedule``'s lists (``actions.phase_schedule``) run by
    torch.distributed.pipelining's custom-schedule runtime, one hand-built ``PipelineStage`` per chunk
    this rank holds (``chunks``: chunk index -> module), or by ``LocalSchedule`` when K == 1 (one
    position, no process group).

    The loss is a mean per micro-batch and each stage's ``ALLREDUCE`` (torch's ``REDUCE_GRAD``) divides
    its accumulated gradients by M, so a pipeline's gradient is the mean over its micro-batches.
    """
    if phase.K == 1:
        return LocalSchedule(chunks, schedule, loss_fn)
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    stages = [PipelineStage(mod, c, phase.stages, device, group=pp_group) for c, mod in sorted(chunks.items())]
    runtime = _PipelineScheduleRuntime(stages, n_microbatches=phase.M, loss_fn=loss_fn, scale_grads=True)
    runtime._prepare_schedule_with_comms(torch_actions(schedule), format="compute_comms")
    return runtime


class LocalSchedule:
    """A pipeline of one position (K = 1): its action list run in this process, with ``step`` called as
    torch's schedules are (``step(x, target=y, losses=[], attention_mask=m)``).

    Chunks pass activations and gradients in memory (the plan has no messages at K = 1). Each action
    does what torch's runtime does for it: F runs a chunk on one micro-batch (the last adds the loss);
    B is the full backward, or where the (chunk, micro-batch) has a W only the input gradient
    (``stage_backward_input``; on chunk 0, whose input needs no gradient, nothing), W the weight
    gradient (``stage_backward_weight``; on chunk 0 the whole backward); ALLREDUCE divides the chunk's
    gradients by M. The compute entry points are ``_forward``, ``_backward`` and ``_backward_weight``.
    """

    def __init__(self, chunks: dict[int, StageModule], schedule: Schedule,
                 loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        assert schedule.num_ranks == 1 and set(chunks) == set(range(schedule.K)), (schedule.K, sorted(chunks))
        self.chunks, self.schedule, self.loss_fn = chunks, schedule, loss_fn
        self.M, self.last = schedule.M, schedule.K - 1
        self.split = split_backwards(schedule)

    def step(self, x: Tensor, *, target: Tensor, losses: list[Tensor] | None = None, return_outputs: bool = False,
             **kwargs: Tensor) -> None:
        M = self.M
        self._xs, self._ys = torch.tensor_split(x, M), torch.tensor_split(target, M)
        parts = {k: torch.tensor_split(t, M) for k, t in kwargs.items()}
        self._kw = [{k: v[m] for k, v in parts.items()} for m in range(M)]
        self._fwd: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        """(chunk, micro-batch) -> (its input, its output; the loss on the last chunk) until its backward."""
        self._grad_in: dict[tuple[int, int], Tensor | None] = {}
        """(chunk, micro-batch) -> the gradient of its input, until the chunk before uses it."""
        self._pending: dict[tuple[int, int], Any] = {}
        """(chunk, micro-batch) -> what its W needs, from its input-gradient B."""
        self._losses: dict[int, Tensor] = {}
        try:
            for a in self.schedule.actions[0]:
                if a.kind is ActionKind.F:
                    self._forward(a.stage, a.mb)
                elif a.kind is ActionKind.B:
                    self._backward(a.stage, a.mb, full=(a.stage, a.mb) not in self.split)
                elif a.kind is ActionKind.W:
                    self._backward_weight(a.stage, a.mb)
                elif a.kind is ActionKind.ALLREDUCE:
                    for p in self.chunks[a.stage].parameters():
                        if p.grad is not None:
                            p.grad.div_(M)
                else:
                    raise PtplanError(f"a one-position pipeline has no messages, but its schedule holds {a}")
            if losses is not None:
                losses.extend(self._losses[m] for m in range(M))
        finally:
            del self._xs, self._ys, self._kw, self._fwd, self._grad_in, self._pending, self._losses

    def _forward(self, c: int, m: int) -> None:
        inp = self._xs[m] if c == 0 else self._fwd[(c - 1, m)][1].detach().requires_grad_(True)
        out = self.chunks[c](inp, **self._kw[m])
        if c == self.last:
            out = self.loss_fn(out, self._ys[m])
            self._losses[m] = out.detach()
        self._fwd[(c, m)] = (inp, out)

    def _out_grad(self, c: int, m: int) -> Tensor | None:
        return None if c == self.last else self._grad_in.pop((c + 1, m))

    def _backward(self, c: int, m: int, *, full: bool) -> None:
        from torch.distributed.pipelining._backward import stage_backward_input

        if full:
            inp, out = self._fwd.pop((c, m))
            torch.autograd.backward(out, grad_tensors=self._out_grad(c, m))
            if c > 0:
                self._grad_in[(c, m)] = inp.grad
            return
        if c == 0:  # torch's first stage: the input needs no gradient, so W runs the whole backward
            self._pending[(c, m)] = self._out_grad(c, m)
            return
        inp, out = self._fwd.pop((c, m))
        grad = self._out_grad(c, m)
        dinputs, groups = stage_backward_input([out], None if grad is None else [grad], [inp],
                                               self.chunks[c].parameters())
        self._grad_in[(c, m)] = dinputs[0]
        self._pending[(c, m)] = groups

    def _backward_weight(self, c: int, m: int) -> None:
        from torch.distributed.pipelining._backward import stage_backward_weight

        pending = self._pending.pop((c, m))
        if c == 0:
            _, out = self._fwd.pop((c, m))
            torch.autograd.backward(out, grad_tensors=pending)
        else:
            stage_backward_weight(self.chunks[c].parameters(), pending)
