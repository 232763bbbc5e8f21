"""One rank's stages of a phase: the layer storage it holds, a module per stage made of those layers, and the
schedule that runs them.

Stage (chunk) s runs layers ``partition[s]``; a rank holds one stage, or V of them with interleaved
schedules (``groups.chunks_of``). Stage 0 first runs the frozen prefix ``[0, frozen_layers)`` under
``no_grad`` in eval mode, unless the phase caches it (then stage 0's input is the prefix's output,
from ``cache.prefix_forward``). The layers are the canonical model's own modules (no copies), so
training a stage trains the canonical model in place. The step runs the plan's action lists
(``actions``) on the one step interpreter (``step.StepInterpreter``) at every K (``build_schedule``).

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
initialised from its own seed (``families.weights.module_seed``), so a stage build equals the whole build on its
layers, bit for bit (``tests/test_stage_build.py``).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Phase
from ptplan.planner.schedule import Schedule, splits_backward

from ptplan.executor.runtime.step import ChunkCompute, Recomputed, StepInterpreter
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
        self.pins = device.type == "cuda"
        """Whether ``pin`` page-locks the layers held in host memory (a CUDA rank's, until the driver refuses)."""
        self.unlocked = False
        """Whether page-locked storage was let go since the last ``trim``."""
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
        storage), else uninitialised (about to be received). Buffers move with it. Host storage is pageable
        (``pin`` locks a held layer's)."""
        dev = self._home(where)
        self._dropping(i)
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

    def pin(self, i: int) -> None:
        """Page-lock host layer i's parameters where ``pins``; nothing for a layer on the device or without storage.

        For the layers a rank holds in host memory (``ElasticRuntime._settle``: the AutoCache's frozen prefix on a
        GPU), which the fill copies to the device at every fill step (``weights.streamed``): from pageable memory
        that copy goes through the driver's staging buffer at a fraction of the copy engine's rate (104 MB of
        bert-base's prefix: 8.4 against 54.8 GB/s, ``bench/fill_path.py`` on a lent H200). Receive buffers (a
        gather, a resume) stay pageable. torch's page-locked allocator rounds each tensor up to a power of two
        (bert-base's weight tensors: 1.70 times their bytes, counted from their shapes); the plan's host memory
        charges at most twice (``cache_size.PINNED_ROUNDING``). Where the driver refuses to lock more, a warning
        says so and this store stops trying (the copies are slower, nothing else changes)."""
        if self.where[i] != HOST or not self.pins:
            return
        with torch.no_grad():
            for p in self.params[i]:
                if p.data.is_pinned():
                    continue
                try:
                    locked = torch.empty(p.data.shape, dtype=p.dtype, pin_memory=True)
                except RuntimeError as e:
                    self.pins = False
                    warnings.warn(f"cannot page-lock host memory for layer {i} ({e}); the layers kept in host memory "
                                  f"stay pageable, and the AutoCache's fill copies them to the device more slowly")
                    return
                p.data = locked.copy_(p.data)

    def release(self, i: int) -> None:
        """Free layer i's parameters (an empty tensor each, shape recorded); its buffers stay (tiny)."""
        self._dropping(i)
        for p in self.params[i]:
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype)
        self.where[i] = None

    def _dropping(self, i: int) -> None:
        """Note that layer i's storage is about to go: page-locked blocks go back to torch's page-locked cache,
        which keeps them locked until ``trim``."""
        if self.where[i] == HOST and any(p.data.is_pinned() for p in self.params[i]):
            self.unlocked = True

    def trim(self) -> None:
        """Hand page-locked blocks that no layer uses any more back to the system (after a switch moved or freed
        pinned layers: a later phase's stage-0 ranks need not be this one's)."""
        if not self.unlocked:
            return
        self.unlocked = False
        empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) \
            or getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            try:
                empty()
            except RuntimeError:  # no accelerator to ask: nothing was locked through it
                pass

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

    @contextlib.contextmanager
    def without_checkpoint(self) -> Iterator[None]:
        """Run the active layers as plain layers (``step.ChunkCompute``'s rebuild under a split backward)."""
        was, self.recompute = self.recompute, False
        try:
            yield
        finally:
            self.recompute = was

    def recomputed(self) -> Recomputed | None:
        """How this stage recomputes under a split backward (``step.Recomputed``): the whole stage, run without its
        checkpoint; or its first r layers (``recompute_first``) as the head and the layers after them as the tail;
        None where it does not recompute."""
        def stage(x: Tensor, kw: dict[str, Tensor]) -> Tensor:
            with self.without_checkpoint():
                return self(x, **kw)
        if self.recompute:
            return Recomputed(head=stage, head_params=list(self.parameters()))
        unit = self.active[0] if len(self.active) else None
        if not isinstance(unit, RecomputedLayers):
            return None
        rest = list(self.active)[1:]

        def tail(h: Tensor, kw: dict[str, Tensor]) -> Tensor:
            for layer in rest:
                h = layer(h, **kw)
            return h
        assert not len(self.prefix), "a stage with a frozen prefix (stage 0) recomputes through its checkpoint"
        return Recomputed(head=lambda x, kw: unit(x, plain=True, **kw), head_params=list(unit.parameters()), tail=tail,
                          tail_params=[p for layer in rest for p in layer.parameters()])


class RecomputedLayers(nn.Module):
    """Consecutive layers of a stage run as one ``torch.utils.checkpoint`` unit (non-reentrant): a
    micro-batch in flight keeps only their input, and its backward reruns them first."""

    def __init__(self, layers: list[nn.Module], lo: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.lo, self.hi = lo, lo + len(layers)
        self.bind_weights = False
        """Whether the rerun uses the weight tensors the forward used (``twobw.TwoBW`` sets it: its forward runs in a
        ``functional_call`` on a micro-batch's weight version, and a checkpoint's rerun, in the backward, would
        otherwise read the module's own parameters, the newest version)."""

    def forward(self, x: Tensor, attention_mask: Tensor | None = None, *, plain: bool = False) -> Tensor:
        """The unit's layers, as one checkpoint where autograd records; ``plain``: without it (a split backward's
        rebuild, ``StageModule.recomputed``, and the bound rerun below)."""
        if plain or not torch.is_grad_enabled():
            return self._run_active(x, attention_mask)
        from torch.utils.checkpoint import checkpoint

        if not self.bind_weights:
            return checkpoint(self._run_active, x, attention_mask, use_reentrant=False)
        from torch.func import functional_call

        named = list(self.named_parameters())  # inside a functional_call: the version's tensors
        names = [name for name, _ in named]

        def rerun(x: Tensor, mask: Tensor | None, *weights: Tensor) -> Tensor:
            return functional_call(self, dict(zip(names, weights)), (x,), {"attention_mask": mask, "plain": True})
        return checkpoint(rerun, x, attention_mask, *(w for _, w in named), use_reentrant=False)

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
                   pp_group: Any, loss_fn: Callable[[Tensor, Tensor], Tensor], *, position: int,
                   model: nn.Module | None = None, cached_prefix: bool = False,
                   update: Callable[[list[tuple[nn.Parameter, Tensor | None]]], Callable[[], None]] | None = None
                   ) -> StepInterpreter:
    """The phase's step on this rank: the one interpreter (``step.StepInterpreter``) over ``schedule``'s lists
    (``actions.phase_schedule``) at pipeline position ``position``, with the compute and step policy the
    phase's data asks for -- token slices (``Phase.slices``: ``sliced.SliceCompute`` on ``model``'s layers),
    PipeDream-2BW (schedule ``2bw``: ``twobw.TwoBW``, whose updates call ``update``, which begins an update and
    returns the call that applies it), else whole micro-batches
    on ``chunks`` (chunk index -> module) with a flushed step. At K = 1 there are no messages (``pp_group`` None).

    The loss is a mean per micro-batch and each stage's ``ALLREDUCE`` divides its accumulated gradients by M,
    so a pipeline's gradient is the mean over its micro-batches.
    """
    from ptplan.executor.runtime.sliced import sliced_compute
    from ptplan.executor.runtime.twobw import TwoBW

    compute: Any
    policy: Any = None
    if phase.slices:
        if model is None:
            raise PtplanError("a token-sliced phase's step needs the model (its layers run slice by slice)")
        compute = sliced_compute(model, phase, position, cached_prefix=cached_prefix)
    else:
        split = splits_backward(phase.schedule)  # (a recomputing chunk rebuilds its graph once for B and W)
        whole = frozenset(c for c in chunks if split and phase.D > 1 and phase.fsdp_at(c))  # (FSDP: never split)
        rebuild = {c: mod.recomputed() for c, mod in chunks.items() if split and c > 0 and c not in whole}
        compute = ChunkCompute(chunks, loss_fn, M=phase.M, last=schedule.K - 1,
                               rebuild={c: rc for c, rc in rebuild.items() if rc is not None}, whole=whole)
        if phase.schedule == "2bw":
            if update is None or len(chunks) != 1:
                raise PtplanError(f"a 2BW phase runs one chunk per position with an update function, got chunks "
                                  f"{sorted(chunks)}")
            policy = TwoBW(chunks[position], schedule, position, update)
            compute.call = policy.call
    return StepInterpreter(schedule, position, compute, group=pp_group, device=device, policy=policy)

