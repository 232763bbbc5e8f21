"""Measure every layer of a LayeredModel on CPU or CUDA and return a ``ptplan.profile/1`` Profile.

How it measures (per micro-batch size b, after ``warmup`` untimed repeats, median of ``repeats``):

- **Layered step** (forward_s, backward_s): one full training step run layer by layer, the way a
  pipeline runs it. Forward: each layer gets the previous layer's real output, detached and with
  ``requires_grad`` on, so its backward includes the input gradient; each layer call is timed.
  Backward: layer by layer from the head down, each with the gradient its successor produced, each
  timed. Because the layers run in sequence inside one step, caches are as warm (or cold) as in a
  whole-model step, so the per-layer sum can be checked against the whole step. The head's times
  include the loss (the last pipeline stage computes it).
- **Whole-model step** (whole_model.forward_s, forward_backward_s): ``model(inputs)``, loss,
  backward, timed as one. Layered and whole steps alternate, so machine noise hits both alike.
- **Split backward** (backward_weight_s): a third layer-by-layer step, alternating with the two
  above, whose backward runs each layer as a zero-bubble schedule does, with the functions torch's
  ``PipelineStage`` calls for its I and W actions: B, the input gradient
  (``stage_backward_input``: autograd.grad with respect to the layer's input, keeping the gradients
  that reach the weights' operations), then W, the weight gradient (``stage_backward_weight``: from
  those kept gradients to the parameters), each timed. A layer whose input needs no gradient (the
  first) has no B and its W is the whole backward, as on torch's first stage. The record keeps W's
  share of the split, ``backward_weight_s = backward_s x W / (B + W)``, so B + W is the layered
  backward exactly; the split's own sums beside the layered backward's, per size, are in the
  profile's ``measurement["backward_split"]`` (their agreement is the check that the split costs
  what the whole backward does).
- **No-grad forward** (nograd_forward_s): eval mode under ``torch.no_grad``, layer by layer, timed
  (how a frozen layer runs).
- **Optimizer step** (optimizer_s): one AdamW step (torch's default implementation for the device)
  over each layer's parameters, with gradients present, timed per layer, the layers stepped one
  after another in each repeat (as warm or cold in the caches as in a whole-model step; median of
  ``repeats`` after ``warmup``); the parameter values are restored afterwards.
- **Memory**: parameter and gradient bytes (the model dtype), optimizer bytes (AdamW: two
  moments per parameter in its dtype, as torch allocates them: ``costs.optimizer_state_bytes``; no fp32 master copy), output bytes per sample, and bytes saved for
  backward per sample, measured with ``torch.autograd.graph.saved_tensors_hooks`` during one forward
  at each b (storages counted once, parameters excluded, divided by b); the profile records the
  largest b's.

Micro-batch sizes: the ones given, or by default powers of two 1, 2, 4, ... up to 64, stopping at
the memory limit (CUDA: the device's memory; CPU: the host's available RAM plus the model's own
parameters, which are resident already): after each size, the next size's peak is estimated from
what was measured (``estimate_peak_bytes``) and it and every larger size are skipped when it would
not fit (``default_batch_sizes``; the profile's ``measurement`` says which and why).

Provenance: ``source="measured"`` and the command that asked for the profile (``command``).

Gradients are set to None before every step (as ``zero_grad(set_to_none=True)`` does). Timer: CUDA
events with ``torch.cuda.synchronize`` on CUDA; on CPU ``time.perf_counter`` (wall, the default) or,
with ``timer="cpu"`` and one torch thread, ``time.process_time`` -- the CPU time the step used, which
does not count time spent waiting for a core, so it stays meaningful on a shared, busy machine.

The model is left as found: parameter values, ``requires_grad`` flags, existing ``.grad`` tensors,
every module's train/eval flag, its device, and the global RNG state are restored; no hook is left.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from ptplan.executor.cache.autocache import prefix_sample_shape
from ptplan.executor.profiling.host_io import measure_host_io
from ptplan.executor.profiling.live_bytes import memory_pass
from ptplan.executor.profiling.overhead import measure_action_overhead
from ptplan.executor.runtime.optim import make_optimizer
from ptplan.planner.costs import optimizer_state_bytes
from ptplan.planner.errors import PtplanError
from ptplan.planner.profile import DeviceInfo, LayerRecord, ModelInfo, Profile, Provenance, WholeModel

from ptplan.executor.families import CAUSAL_FAMILIES, LayeredModel, config_summary, family_of
from ptplan.planner.families import FAMILY_FACTS, family_facts

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---- timing ------------------------------------------------------------------------------------

TIMERS = ("wall", "cpu")


class _Clock:
    """Timestamps: CUDA events on CUDA; on CPU wall time (perf_counter) or process CPU time.

    Durations are read after ``sync``. The ``cpu`` timer (``time.process_time``) ignores time spent
    waiting for a core, so it is robust on a shared machine, but it is only meaningful with one
    intra-op thread (with more it would add up the threads' time, spin-waiting included).
    """

    def __init__(self, device: torch.device, timer: str = "wall") -> None:
        self.cuda = device.type == "cuda"
        self.now = time.process_time if timer == "cpu" else time.perf_counter

    def stamp(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return self.now()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a


# ---- leaving the model as found ----------------------------------------------------------------

@contextmanager
def _preserved(model: LayeredModel, device: torch.device) -> Iterator[None]:
    """Enable grads on every parameter for measuring; restore flags, grads, modes, device and RNG."""
    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    modes = [(m, m.training) for m in model.modules()]
    home = params[0].device if params else device
    cuda_devs = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devs):
        torch.manual_seed(0)
        try:
            if home != device:
                model.to(device)
            for p in params:
                p.requires_grad_(True)
                p.grad = None
            yield
        finally:
            for p in params:
                p.grad = None
            if home != device:
                model.to(home)
            for p, f, g in zip(params, flags, grads):
                p.requires_grad_(f)
                p.grad = g
            for m, t in modes:
                m.training = t


def _clear_grads(model: LayeredModel) -> None:
    for p in model.parameters():
        p.grad = None


# ---- one measurement each ----------------------------------------------------------------------

def _layered_step(model: LayeredModel, clock: _Clock, x: Tensor, labels: Tensor, mask: Tensor | None
                  ) -> tuple[list[float], list[float]]:
    """One training step layer by layer; returns per-layer forward and backward seconds."""
    n = len(model.layers)
    _clear_grads(model)
    ins: list[Tensor] = []
    outs: list[Tensor] = []
    fwd_marks = []
    clock.sync()
    h = x
    for i, layer in enumerate(model.layers):
        xin = h if i == 0 else h.detach().requires_grad_(True)
        a = clock.stamp()
        y = layer(xin, attention_mask=mask)
        if i == n - 1:
            y = model.loss(y, labels)
        fwd_marks.append((a, clock.stamp()))
        ins.append(xin)
        outs.append(y)
        h = y
    bwd_marks: list[tuple[Any, Any]] = [(None, None)] * n
    grad: Tensor | None = None
    for i in range(n - 1, -1, -1):
        a = clock.stamp()
        torch.autograd.backward(outs[i], grad_tensors=grad)
        bwd_marks[i] = (a, clock.stamp())
        grad = ins[i].grad if i > 0 else None
    clock.sync()
    return [clock.seconds(a, b) for a, b in fwd_marks], [clock.seconds(a, b) for a, b in bwd_marks]


def _split_step(model: LayeredModel, clock: _Clock, x: Tensor, labels: Tensor, mask: Tensor | None
                ) -> tuple[list[float], list[float]]:
    """One training step layer by layer whose backward is split as zero-bubble schedules run it; returns
    per-layer input-gradient (B) and weight-gradient (W) seconds."""
    from ptplan.executor.runtime.torch_adapter import backward_input as stage_backward_input
    from ptplan.executor.runtime.torch_adapter import backward_weight as stage_backward_weight

    n = len(model.layers)
    _clear_grads(model)
    ins: list[Tensor] = []
    outs: list[Tensor] = []
    h = x
    for i, layer in enumerate(model.layers):
        xin = h if i == 0 else h.detach().requires_grad_(True)
        y = layer(xin, attention_mask=mask)
        if i == n - 1:
            y = model.loss(y, labels)
        ins.append(xin)
        outs.append(y)
        h = y
    marks: list = [None] * n
    grad: Tensor | None = None
    clock.sync()
    for i in range(n - 1, -1, -1):
        params = list(model.layers[i].parameters())
        a = clock.stamp()
        if ins[i].requires_grad:
            dinputs, groups = stage_backward_input([outs[i]], None if grad is None else [grad], [ins[i]], iter(params))
            b = clock.stamp()
            stage_backward_weight(iter(params), groups)
            grad = dinputs[0]
        else:  # no input gradient to compute: W is the whole backward (torch's first stage)
            b = a
            torch.autograd.backward(outs[i], grad_tensors=grad)
            grad = None
        marks[i] = (a, b, clock.stamp())
    clock.sync()
    return [clock.seconds(a, b) for a, b, _ in marks], [clock.seconds(b, c) for _, b, c in marks]


def _whole_step(model: LayeredModel, clock: _Clock, x: Tensor, labels: Tensor, mask: Tensor | None
                ) -> tuple[float, float]:
    """One training step of the whole model; returns (forward incl. loss, forward + backward) seconds."""
    _clear_grads(model)
    clock.sync()
    a = clock.stamp()
    loss = model.loss(model(x, attention_mask=mask), labels)
    b = clock.stamp()
    loss.backward()
    c = clock.stamp()
    clock.sync()
    return clock.seconds(a, b), clock.seconds(a, c)


def _nograd_pass(model: LayeredModel, clock: _Clock, x: Tensor, labels: Tensor, mask: Tensor | None
                 ) -> list[float]:
    n = len(model.layers)
    marks = []
    clock.sync()
    with torch.no_grad():
        h = x
        for i, layer in enumerate(model.layers):
            a = clock.stamp()
            h = layer(h, attention_mask=mask)
            if i == n - 1:
                model.loss(h, labels)
            marks.append((a, clock.stamp()))
    clock.sync()
    return [clock.seconds(a, b) for a, b in marks]


def _optimizer_steps(model: LayeredModel, clock: _Clock, warmup: int, repeats: int) -> list[float]:
    """Per layer: median seconds of one AdamW step over its parameters (values restored afterwards).

    One optimizer per layer (``runtime.optim.make_optimizer``'s AdamW with its defaults, as ``ptplan run`` builds
    it), stepped layer after layer in one pass per repeat, so each layer's parameters, gradients and moments are as
    cold in the caches as in a whole-model step. The runtime steps one optimizer over a rank's layers, which the
    planner prices from these times (``planner.costs.optimizer_call_s``).
    """
    layers = [list(layer.parameters()) for layer in model.layers]
    with torch.no_grad():
        saved = [[p.detach().clone() for p in ps] for ps in layers]
        for ps in layers:
            for p in ps:
                p.grad = torch.full_like(p, 1e-3)
    opts = [make_optimizer(ps, "adamw", lr=1e-3) if ps else None for ps in layers]  # the runtime's (no weight decay)
    times: list[list[float]] = [[] for _ in layers]
    try:
        for r in range(warmup + repeats):
            for i, opt in enumerate(opts):
                if opt is None:
                    continue
                clock.sync()
                a = clock.stamp()
                opt.step()
                b = clock.stamp()
                clock.sync()
                if r >= warmup:
                    times[i].append(clock.seconds(a, b))
    finally:
        with torch.no_grad():
            for ps, vs in zip(layers, saved):
                for p, v in zip(ps, vs):
                    p.copy_(v)
                    p.grad = None
    return [statistics.median(t) if t else 0.0 for t in times]


# ---- device description ------------------------------------------------------------------------

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _device_info(device: torch.device) -> DeviceInfo:
    today = _dt.date.today().isoformat()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(kind="cuda", name=props.name, memory_bytes=int(props.total_memory),
                          torch_version=torch.__version__, date=today, threads=torch.get_num_threads())
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    return DeviceInfo(kind="cpu", name=_cpu_name(), memory_bytes=int(mem), torch_version=torch.__version__,
                      date=today, threads=torch.get_num_threads())


def resolve_device(device: str) -> torch.device:
    """``cpu`` | ``cuda`` | ``cuda:N`` -> torch.device, with a clear error if CUDA is not there."""
    try:
        d = torch.device(device)
    except RuntimeError:
        raise PtplanError(f"unknown device {device!r}; use cpu or cuda") from None
    if d.type not in ("cpu", "cuda"):
        raise PtplanError(f"unsupported device {device!r}; use cpu or cuda")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise PtplanError("cuda requested but torch.cuda.is_available() is False; use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise PtplanError(f"{device} requested but only {torch.cuda.device_count()} CUDA devices exist")
    return d


def check_batch_sizes(batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """Positive integers, returned sorted and de-duplicated."""
    bs = list(batch_sizes)
    if not bs:
        raise PtplanError("no batch sizes given; pass e.g. --batch-sizes 1,2,4")
    for b in bs:
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise PtplanError(f"batch sizes must be positive integers, got {b!r}")
    return tuple(sorted(set(bs)))


# ---- classification heads ----------------------------------------------------------------------

DEFAULT_NUM_LABELS = {n: f.default_num_labels for n, f in FAMILY_FACTS.items() if f.default_num_labels is not None}
"""The usual classification head per family (``planner/families.py``): the text encoders a 2-class sequence
classifier (as ``BertForSequenceClassification``), ViT ImageNet-1k's 1000 classes (as the published ViT
checkpoints). The causal families (``families.CAUSAL_FAMILIES``) have a language-model head instead
(one logit per vocabulary token)."""


def model_family(name: str) -> str | None:
    """The family (Hugging Face model_type) of a preset name or a local model folder: ``bert-base`` ->
    ``bert``, ``gpt2-medium`` -> ``gpt2``, a Mistral folder -> ``mistral``; None when ``name`` is neither."""
    return family_of(name)


def head_num_labels(name: str, num_labels: int | None) -> int | None:
    """The classifier size for model ``name``: ``num_labels`` when given, else the family's usual head.

    None for a causal LM (and for unknown names, which ``build_model`` refuses); a causal LM with
    ``num_labels`` is an error, since its head is the language-model head.
    """
    family = model_family(name)
    if family in CAUSAL_FAMILIES:
        if num_labels is not None:
            raise PtplanError(f"{name} has a language-model head (one logit per vocabulary token), not a "
                              f"classifier, so --num-labels does not apply; leave it out (it is for "
                              f"{', '.join(DEFAULT_NUM_LABELS)} models)")
        return None
    if num_labels is not None and (isinstance(num_labels, bool) or num_labels < 1):
        raise PtplanError(f"--num-labels must be at least 1, got {num_labels}")
    if num_labels is None:
        return DEFAULT_NUM_LABELS.get(family or "")
    return num_labels


def profile_num_labels(profile: Profile) -> int | None:
    """The classifier size a profile was measured with (None for an LM head or when it cannot be told).

    From ``model.config["num_labels"]``; for files written before the profiler recorded it, from the
    head's parameter count (a linear layer ``hidden_size -> n`` with bias has ``n * (hidden_size + 1)``).
    """
    if profile.model.family not in DEFAULT_NUM_LABELS:
        return None
    n = profile.model.config.get("num_labels")
    if isinstance(n, int) and not isinstance(n, bool) and n >= 1:
        return n
    hidden = profile.model.config.get("hidden_size")
    heads = [r for r in profile.layers if r.kind == "head"]
    if not isinstance(hidden, int) or len(heads) != 1 or heads[0].params % (hidden + 1):
        return None
    return heads[0].params // (hidden + 1) or None


def model_for_profile(profile: Profile, *, model: str | os.PathLike | None = None,
                      layers: Sequence[int] | None = None) -> LayeredModel:
    """The model ``profile`` was measured on, built again: the one way a tool re-measures a profile's model.

    Name (or ``model``: the folder of a profile made from a local folder), granularity, dtype, sequence length
    (ViT: the config's image size), classifier size (``profile_num_labels``) and dropout (the profile's config,
    where all of the family's dropout fields agree) come from the file; ``layers`` as ``build_model``'s (``[]``:
    every weight on the meta device). The built model's layer structure must give the profile's fingerprint
    (names, kinds, blocks, parameter counts), else a PtplanError says what differs: a tool that measures a
    model other than the profile's must not write its numbers into the profile.
    """
    from ptplan.executor.families import build_model, get
    from ptplan.executor.training.validate import model_fingerprint

    m = profile.model
    cfg = m.config
    pixels = getattr(family_facts(m.family), "pixels", False)
    drop = {cfg[f] for f in get(m.family).dropout_fields if isinstance(cfg.get(f), (int, float))}
    labels = profile_num_labels(profile)
    side = cfg.get("image_size")
    built = build_model(model if model is not None else m.name, granularity=m.granularity,
                        dtype=getattr(torch, m.dtype), layers=layers,
                        dropout=float(drop.pop()) if len(drop) == 1 else None,
                        seq_len=None if pixels else m.seq_len,
                        image_size=side if pixels and isinstance(side, int) else None,
                        num_labels=2 if labels is None else labels)  # (a causal LM's head ignores it)
    if model_fingerprint(built) != profile.fingerprint():
        have = {r.name: r.params for r in profile.layers}
        counts = [(s.name, sum(p.numel() for p in layer.parameters())) for layer, s in zip(built.layers, built.specs)]
        bad = [f"{n}: {c:,} parameters, the profile's {have[n]:,}" if n in have else f"{n}: not in the profile"
               for n, c in counts if have.get(n) != c][:3]
        raise PtplanError(f"{built.name} built from the profile's settings ({len(built.layers)} layers, "
                          f"{m.granularity} granularity, {labels} labels) does not match the profile "
                          f"({profile.num_layers} layers): {'; '.join(bad) or 'layer names or kinds differ'}; "
                          f"the profile was made from another model or config (pass its folder as the model, "
                          f"or profile again with `ptplan profile`)")
    return built


# ---- default micro-batch sizes -----------------------------------------------------------------

DEFAULT_MAX_BATCH = 64
"""Default micro-batch sizes are the powers of two up to this."""
MEMORY_MARGIN = 1.25
"""An estimated peak is multiplied by this before it is compared with the memory limit: the estimate
leaves out the input gradients in flight, the batch itself and the allocator's slack."""


def powers_of_two(max_batch: int = DEFAULT_MAX_BATCH) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_batch``."""
    if max_batch < 1:
        raise PtplanError(f"the largest default micro-batch size must be >= 1, got {max_batch}")
    return tuple(1 << k for k in range(max_batch.bit_length()) if 1 << k <= max_batch)


def static_bytes(model: LayeredModel) -> int:
    """Parameters + gradients + AdamW state (``costs.optimizer_state_bytes``: two moments in the parameters' dtype)
    of the whole model."""
    return sum(p.numel() * 2 * p.element_size() + optimizer_state_bytes(p.numel(), DTYPE_NAMES[p.dtype])
               for p in model.parameters())


def estimate_peak_bytes(*, static: int, saved_per_sample: int, batch_size: int,
                        margin: float = MEMORY_MARGIN) -> int:
    """(parameters + gradients + optimizer state + saved-for-backward bytes per sample x b) x margin."""
    return int(margin * (static + saved_per_sample * batch_size) + 0.5)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True, kw_only=True)
class DefaultSizes:
    """Which default micro-batch sizes fit a memory limit, by the estimate."""

    sizes: tuple[int, ...]
    """The powers of two measured or still to measure (ascending)."""
    skipped: tuple[int, ...]
    """The larger ones that would not fit."""
    reason: str = ""
    """One line saying which sizes were skipped and why (empty when none was)."""


def default_batch_sizes(*, static: int, saved_per_sample: int, memory_limit_bytes: int | None, measured: int = 1,
                        limit_name: str = "the memory limit", max_batch: int = DEFAULT_MAX_BATCH,
                        margin: float = MEMORY_MARGIN) -> DefaultSizes:
    """Powers of two 1..``max_batch`` split into those to measure and those skipped for memory.

    Called after measuring size ``measured``: ``static`` is the parameter + gradient + optimizer-state
    bytes and ``saved_per_sample`` the bytes saved for backward per sample measured there. Sizes up
    to ``measured`` are kept (they ran); each larger one is kept while its estimated peak
    (``estimate_peak_bytes``) fits ``memory_limit_bytes``, and the first that does not fit is skipped
    with every larger one. None as the limit: no limit is known and nothing is skipped.
    """
    cands = powers_of_two(max_batch)
    if memory_limit_bytes is None:
        return DefaultSizes(sizes=cands, skipped=())

    def fits(b: int) -> bool:
        return b <= measured or estimate_peak_bytes(static=static, saved_per_sample=saved_per_sample,
                                                    batch_size=b, margin=margin) <= memory_limit_bytes

    stop = next((i for i, b in enumerate(cands) if not fits(b)), len(cands))
    sizes, skipped = cands[:stop], cands[stop:]
    if not skipped:
        return DefaultSizes(sizes=sizes, skipped=())
    first = estimate_peak_bytes(static=static, saved_per_sample=saved_per_sample, batch_size=skipped[0], margin=margin)
    plural = "s" if len(skipped) > 1 else ""
    reason = (f"skipped micro-batch size{plural} {', '.join(map(str, skipped))}: at {skipped[0]} the estimated "
              f"peak {_gib(first)} exceeds {limit_name} ({_gib(memory_limit_bytes)}); estimate = (parameters + "
              f"gradients + optimizer state {_gib(static)} + {_gib(saved_per_sample)} saved for backward per "
              f"sample x b) x {margin:g}; pass --batch-sizes to choose the sizes yourself")
    return DefaultSizes(sizes=sizes, skipped=skipped, reason=reason)


def _available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory_limit(device: torch.device, model: LayeredModel) -> tuple[int | None, str]:
    """(bytes, what it is) a profile's micro-batch sizes must fit: the CUDA device's memory, or on CPU
    the host's available RAM plus the model's parameter bytes (already resident, yet counted by the
    estimate)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"the memory of {props.name}"
    avail = _available_host_bytes()
    if avail is None:
        return None, "unknown host memory"
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    return avail + resident, "the host's available RAM plus the model's resident parameters"


# ---- the profiler ------------------------------------------------------------------------------

@dataclass
class _SizeResult:
    """Everything measured at one micro-batch size."""

    forward: list[float]
    backward: list[float]
    backward_input: list[float]
    """Per layer: B, the input-gradient part of the split backward (``_split_step``)."""
    backward_weight: list[float]
    """Per layer: W, the weight-gradient part of the split backward."""
    nograd: list[float]
    whole_forward: float
    whole_forward_backward: float
    peak: int | None
    out_bytes: list[int]
    saved_bytes: list[int]
    working_bytes: list[int]
    """Per layer, the backward's working set per sample (``live_bytes.memory_pass``)."""
    accumulate_bytes: list[int]
    """Per layer, what its backward makes more when adding into existing ``.grad``."""
    stash_bytes: list[int]
    """Per layer, what its split backward's B leaves for its W, per sample."""


def budget_rounds(budget_s: float, round_s: float, warmup: int, repeats: int, *, first: bool) -> tuple[int, int]:
    """(warm-up, timed) rounds for one micro-batch size under ``budget_s`` seconds, one round taking ``round_s``
    (its first round already run counts): all ``warmup + repeats`` when they fit; else as many as fit, with one
    warm-up on the first size (later sizes run code already warm) and always at least one timed round."""
    full = warmup + repeats
    fit = int(budget_s // round_s) if round_s > 0 else full
    if fit >= full:
        return warmup, repeats
    w = min(warmup, 1 if first else 0)
    return w, max(1, min(repeats, fit - w))


def _measure_size(model: LayeredModel, clock: _Clock, dev: torch.device, b: int, gen: torch.Generator,
                  warmup: int, repeats: int, bar: Any, budget_s: float | None = None,
                  first: bool = True) -> tuple[_SizeResult, tuple[int, int]]:
    """Layered, whole and split-backward steps alternating, then no-grad forwards, then one memory pass, at size b.

    ``budget_s``: seconds this size may take; the first round is timed and the rounds cut to fit
    (``budget_rounds``). Returns the result and the (warm-up, timed) rounds run."""
    n = len(model.layers)
    x, labels, mask = model.make_batch(b, gen)
    model.train()
    lf, lb, wf, wfb, sb, sw = [], [], [], [], [], []
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    r = 0
    while r < warmup + repeats:
        start = time.perf_counter()
        f_i, b_i = _layered_step(model, clock, x, labels, mask)
        w_f, w_fb = _whole_step(model, clock, x, labels, mask)
        bi_i, bw_i = _split_step(model, clock, x, labels, mask)
        if r == 0 and budget_s is not None:  # a round also runs a no-grad forward and shares the memory pass
            round_s = (time.perf_counter() - start) * 1.25
            warmup, repeats = budget_rounds(budget_s, round_s, warmup, repeats, first=first)
        if r >= warmup:
            lf.append(f_i)
            lb.append(b_i)
            wf.append(w_f)
            wfb.append(w_fb)
            sb.append(bi_i)
            sw.append(bw_i)
        bar.update(1)
        r += 1
    peak = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
    _clear_grads(model)
    model.eval()
    ln = []
    for r in range(warmup + repeats):
        t = _nograd_pass(model, clock, x, labels, mask)
        if r >= warmup:
            ln.append(t)
        bar.update(1)
    model.train()
    mem = memory_pass(model, x, labels, mask, b)
    _clear_grads(model)
    return _SizeResult(forward=[statistics.median(s[i] for s in lf) for i in range(n)],
                       backward=[statistics.median(s[i] for s in lb) for i in range(n)],
                       backward_input=[statistics.median(s[i] for s in sb) for i in range(n)],
                       backward_weight=[statistics.median(s[i] for s in sw) for i in range(n)],
                       nograd=[statistics.median(s[i] for s in ln) for i in range(n)],
                       whole_forward=statistics.median(wf), whole_forward_backward=statistics.median(wfb),
                       peak=peak, out_bytes=mem.output, saved_bytes=mem.saved, working_bytes=mem.working, accumulate_bytes=mem.accumulate,
                       stash_bytes=mem.stash), \
        (warmup, repeats)


def profile_model(model: LayeredModel, *, device: str, batch_sizes: Sequence[int] | None = None, warmup: int,
                  repeats: int, progress: bool, timer: str = "wall", command: str = "",
                  memory_limit_bytes: int | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                  budget_s: float | None = None) -> Profile:
    """Measure every layer of ``model`` at each micro-batch size; the model is left unchanged.

    ``batch_sizes``: the sizes to measure; None: powers of two up to ``max_batch``, stopping at the
    memory limit (``memory_limit_bytes``, or when None the device's: see ``memory_limit``).
    ``timer``: ``wall`` (default) or ``cpu`` (process CPU time; CPU device with one thread only).
    ``command``: the command line that asked for this profile, recorded in its provenance.
    ``budget_s``: a target for the whole profile in seconds (None: exactly ``warmup`` and ``repeats`` per
    size): every size is still measured, with fewer rounds where the time would not fit (``budget_rounds``;
    each size gets a share of what is left in proportion to its micro-batch size plus 4). The rounds run per size
    and the machine's load average are recorded in the profile's ``measurement``.
    """
    from tqdm import tqdm

    dev = resolve_device(device)
    _check_timer(timer, dev)
    auto = batch_sizes is None
    todo = list(powers_of_two(max_batch) if batch_sizes is None else check_batch_sizes(batch_sizes))
    dtype = _checked_dtype(model, warmup, repeats)
    limit, limit_name = memory_limit_bytes, "the memory limit given"
    if auto and limit is None:
        limit, limit_name = memory_limit(dev, model)
    static = static_bytes(model)
    clock = _Clock(dev, timer)
    per_size = 2 * (warmup + repeats)
    results: list[_SizeResult] = []
    measured: list[int] = []
    skipped: DefaultSizes | None = None
    bar = tqdm(total=len(todo) * per_size, desc=f"profile {model.name}", unit="step",
               file=sys.stderr, disable=not progress, leave=False)
    gen = torch.Generator().manual_seed(0)
    began, load_before, rounds = time.perf_counter(), _load_average(), []
    try:
        with _preserved(model, dev):
            while todo:
                b = todo.pop(0)
                pending = [b] + ([c for c in powers_of_two(max_batch) if c > b] if auto else todo)
                share = _budget_share(budget_s, began, pending)
                res, run = _measure_size(model, clock, dev, b, gen, warmup, repeats, bar, share, not measured)
                results.append(res)
                rounds.append(run)
                measured.append(b)
                if auto:
                    last = results[-1]  # every layer's stash and the largest backward working set, per sample
                    choice = default_batch_sizes(static=static,
                                                 saved_per_sample=sum(last.saved_bytes) + max(last.working_bytes),
                                                 memory_limit_bytes=limit, measured=b, limit_name=limit_name,
                                                 max_batch=max_batch)
                    todo = [c for c in choice.sizes if c > b]
                    skipped = choice if choice.skipped else None
                bar.total = bar.n + len(todo) * per_size
                bar.refresh()
            opt_s = _optimizer_steps(model, clock, warmup, repeats)
    finally:
        bar.close()
    load = {"before": load_before, "after": _load_average(), "seconds": round(time.perf_counter() - began, 1)}

    bs = tuple(measured)
    records = _layer_records(model, results, opt_s)
    info = _model_info(model, dtype)
    measurement = _measurement(dev, timer, warmup, repeats, measured, results, rounds, budget_s, load)
    if (ovh := measure_action_overhead(dev)) is not None:  # planner.cluster.charged_overheads charges it
        measurement["action_overhead_s"] = ovh
    # the AutoCache's host traffic at the largest micro-batch's rows (planner.cluster.measured_host_io charges it)
    try:
        measurement["host_io"] = measure_host_io(dev, prefix_sample_shape(model), dtype, max(bs))
    except OSError as e:  # no cache folder to measure in: the plan charges host_read_bandwidth instead
        measurement["host_io"] = {"note": f"not measured: {e}"}
    if auto:
        measurement.update(_default_sizes_record(max_batch, limit, skipped))
    peaks = tuple(r.peak for r in results if r.peak is not None)
    return Profile(model=info, device=_device_info(dev), batch_sizes=bs, layers=tuple(records),
                   whole_model=WholeModel(forward_s=tuple(r.whole_forward for r in results),
                                          forward_backward_s=tuple(r.whole_forward_backward for r in results),
                                          peak_memory_bytes=peaks),
                   measurement=measurement, provenance=Provenance(source="measured", command=command))


def _checked_dtype(model: LayeredModel, warmup: int, repeats: int) -> torch.dtype:
    """The model's dtype, once warmup, repeats, the parameters and the dtype are checked."""
    if warmup < 0:
        raise PtplanError(f"warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise PtplanError(f"repeats must be >= 1, got {repeats}")
    params = list(model.parameters())
    if not params:
        raise PtplanError(f"model {model.name} has no parameters")
    dtype = params[0].dtype
    if dtype not in DTYPE_NAMES:
        raise PtplanError(f"unsupported model dtype {dtype}; use float32, bfloat16 or float16")
    return dtype


def _budget_share(budget_s: float | None, began: float, pending: list[int]) -> float | None:
    """Seconds for the first of ``pending`` sizes: what is left of ``budget_s`` (None: no budget) in proportion to
    its cost, ~ b plus a fixed part (~4 samples' worth)."""
    if budget_s is None:
        return None
    b = pending[0]
    return max(0.0, budget_s - (time.perf_counter() - began)) * (b + 4) / sum(c + 4 for c in pending)


def _model_info(model: LayeredModel, dtype: torch.dtype) -> ModelInfo:
    """The profile's model record: name, family, size, dtype and the config a run rebuilds it from."""
    config = config_summary(model)
    if model.family in DEFAULT_NUM_LABELS:
        config["num_labels"] = model.num_labels  # the classifier's size, so a run rebuilds the same head
    return ModelInfo(name=model.name, family=model.family, num_blocks=model.num_blocks, seq_len=model.seq_len,
                     dtype=DTYPE_NAMES[dtype], granularity=model.granularity, config=config)


def _check_timer(timer: str, dev: torch.device) -> None:
    """The timer exists and suits the device (the CPU timer: CPU, one thread)."""
    if timer not in TIMERS:
        raise PtplanError(f"unknown timer {timer!r}; choose one of {', '.join(TIMERS)}")
    if timer == "cpu" and dev.type != "cpu":
        raise PtplanError("the cpu timer measures CPU time; on CUDA the profiler always uses CUDA events")
    if timer == "cpu" and torch.get_num_threads() != 1:
        raise PtplanError(f"the cpu timer needs one torch thread (now {torch.get_num_threads()}); "
                          "pass --threads 1 or use --timer wall")


def _layer_records(model: LayeredModel, results: list[_SizeResult], opt_s: list[float]) -> list[LayerRecord]:
    """One LayerRecord per layer from the per-size results (memory from the largest size measured)."""
    last = results[-1]
    records = []
    for i, (layer, spec) in enumerate(zip(model.layers, model.specs)):
        ps = list(layer.parameters())
        count = sum(p.numel() for p in ps)
        nbytes = sum(p.numel() * p.element_size() for p in ps)
        records.append(LayerRecord(
            index=i, name=spec.name, kind=spec.kind, block=spec.block, params=count, param_bytes=nbytes,
            grad_bytes=nbytes, optimizer_bytes=sum(optimizer_state_bytes(p.numel(), DTYPE_NAMES[p.dtype]) for p in ps),
            output_bytes_per_sample=last.out_bytes[i], saved_bytes_per_sample=last.saved_bytes[i],
            backward_working_bytes_per_sample=last.working_bytes[i], accumulate_bytes=last.accumulate_bytes[i],
            backward_stash_bytes_per_sample=last.stash_bytes[i],
            forward_s=tuple(r.forward[i] for r in results), backward_s=tuple(r.backward[i] for r in results),
            nograd_forward_s=tuple(r.nograd[i] for r in results),
            backward_weight_s=tuple(weight_share(r.backward_input[i], r.backward_weight[i]) * r.backward[i]
                                    for r in results), optimizer_s=opt_s[i]))
    return records


def _default_sizes_record(max_batch: int, limit: int | None, skipped: DefaultSizes | None) -> dict[str, Any]:
    """What the profile's ``measurement`` says about default micro-batch sizes: the rule and what it skipped."""
    out: dict[str, Any] = {"batch_sizes": f"default: powers of two up to {max_batch}, stopping where the estimated "
                                          f"peak exceeds the memory limit",
                           "memory_limit_bytes": limit, "skipped_batch_sizes": list(skipped.skipped) if skipped else []}
    if skipped:
        out["skipped_reason"] = skipped.reason
    return out


def _measurement(dev: torch.device, timer: str, warmup: int, repeats: int, measured: list[int],
                 results: list[_SizeResult], rounds: list[tuple[int, int]], budget_s: float | None,
                 load: dict[str, Any]) -> dict[str, Any]:
    """The profile's ``measurement`` record: how every number was timed (timer, rounds, load, method)."""
    measurement: dict[str, Any] = {
        "warmup": warmup, "repeats": repeats, "statistic": "median",
        "timer": "cuda_events" if dev.type == "cuda" else
                 ("process_time (CPU time, 1 thread)" if timer == "cpu" else "perf_counter (wall)"),
        "method": "layers timed one by one inside a full layer-by-layer training step; "
                  "whole-model steps alternate with layered steps",
        "head_includes_loss": True, "whole_model_forward": "train mode, grad enabled, loss included",
        "grads_set_to_none_each_step": True,
        "memory_batch_size": measured[-1],
        "optimizer": "AdamW (2 moments per parameter in its dtype; weight decay 0, ptplan run's default)",
        "optimizer_step": "AdamW step over each layer's parameters alone, timed per layer",
        "backward_weight": "backward_s x W / (B + W), B and W timed per layer in a split-backward step (torch's "
                           "stage_backward_input, stage_backward_weight)",
        "backward_split": [{"batch_size": b, "input_s": sum(r.backward_input), "weight_s": sum(r.backward_weight),
                            "backward_s": sum(r.backward)} for b, r in zip(measured, results)],
    }
    measurement["rounds_per_size"] = [{"batch_size": b, "warmup": w, "repeats": r}
                                      for b, (w, r) in zip(measured, rounds)]
    measurement["budget_s"] = budget_s
    measurement["load_average"] = load  # 1-minute load average at the start and the end (compare reads it)
    return measurement


def _load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): how busy the machine was while timing."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def weight_share(input_s: float, weight_s: float) -> float:
    """W's share of a split backward, W / (B + W) (0 when neither took measurable time)."""
    total = input_s + weight_s
    return weight_s / total if total > 0 else 0.0


def agreement(profile: Profile) -> list[tuple[int, float, float, float]]:
    """Per batch size: (b, per-layer forward+backward sum, whole-model step, relative difference)."""
    out = []
    for j, b in enumerate(profile.batch_sizes):
        s = sum(r.forward_s[j] + r.backward_s[j] for r in profile.layers)
        w = profile.whole_model.forward_backward_s[j]
        out.append((b, s, w, (s - w) / w if w > 0 else float("nan")))
    return out
