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
- **No-grad forward** (nograd_forward_s): eval mode under ``torch.no_grad``, layer by layer, timed
  (how a frozen layer runs).
- **Optimizer step** (optimizer_s): one AdamW step (torch's default implementation for the device)
  over each layer's parameters, with gradients present, timed per layer, the layers stepped one
  after another in each repeat (as warm or cold in the caches as in a whole-model step; median of
  ``repeats`` after ``warmup``); the parameter values are restored afterwards.
- **Memory**: parameter and gradient bytes (the model dtype), optimizer bytes (AdamW: two fp32
  moments per parameter; no fp32 master copy counted), output bytes per sample, and bytes saved for
  backward per sample, measured with ``torch.autograd.graph.saved_tensors_hooks`` during one forward
  at the largest b (storages counted once, parameters excluded, divided by b).

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
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from ptplan.planner.errors import PtplanError
from ptplan.planner.profile import DeviceInfo, LayerRecord, ModelInfo, Profile, WholeModel

from .models import LayeredModel, config_summary

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ADAMW_STATE_BYTES_PER_PARAM = 8
"""AdamW keeps two fp32 moments (exp_avg, exp_avg_sq) per parameter."""


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
    bwd_marks = [None] * n
    grad: Tensor | None = None
    for i in range(n - 1, -1, -1):
        a = clock.stamp()
        torch.autograd.backward(outs[i], grad_tensors=grad)
        bwd_marks[i] = (a, clock.stamp())
        grad = ins[i].grad if i > 0 else None
    clock.sync()
    return [clock.seconds(a, b) for a, b in fwd_marks], [clock.seconds(a, b) for a, b in bwd_marks]


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


def _storage_key(t: Tensor) -> tuple[int, int]:
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a plain storage
        return id(t), t.numel() * t.element_size()


def _memory_pass(model: LayeredModel, x: Tensor, labels: Tensor, mask: Tensor | None, b: int
                 ) -> tuple[list[int], list[int]]:
    """Per-layer (output bytes per sample, saved-for-backward bytes per sample) from one forward."""
    param_ptrs = {_storage_key(p)[0] for p in model.parameters()}
    n = len(model.layers)
    out_bytes, saved_bytes = [], []
    h = x
    for i, layer in enumerate(model.layers):
        xin = h if i == 0 else h.detach().requires_grad_(True)
        seen: set[int] = set()
        total = [0]

        def pack(t: Tensor) -> Tensor:
            if isinstance(t, Tensor):
                ptr, nbytes = _storage_key(t)
                if ptr not in param_ptrs and ptr not in seen:
                    seen.add(ptr)
                    total[0] += nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(xin, attention_mask=mask)
            if i == n - 1:
                model.loss(y, labels)
        out_bytes.append(-(-y.numel() * y.element_size() // b))
        saved_bytes.append(-(-total[0] // b))
        h = y.detach()
    return out_bytes, saved_bytes


def _optimizer_steps(model: LayeredModel, clock: _Clock, warmup: int, repeats: int) -> list[float]:
    """Per layer: median seconds of one AdamW step over its parameters (values restored afterwards).

    One optimizer per layer, stepped layer after layer in one pass per repeat, so each layer's
    parameters, gradients and moments are as cold in the caches as in a whole-model step.
    """
    layers = [list(layer.parameters()) for layer in model.layers]
    with torch.no_grad():
        saved = [[p.detach().clone() for p in ps] for ps in layers]
        for ps in layers:
            for p in ps:
                p.grad = torch.full_like(p, 1e-3)
    opts = [torch.optim.AdamW(ps, lr=1e-3) if ps else None for ps in layers]
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


# ---- the profiler ------------------------------------------------------------------------------

def profile_model(model: LayeredModel, *, device: str, batch_sizes: Sequence[int], warmup: int, repeats: int,
                  progress: bool, timer: str = "wall") -> Profile:
    """Measure every layer of ``model`` at each micro-batch size; the model is left unchanged.

    ``timer``: ``wall`` (default) or ``cpu`` (process CPU time; CPU device with one thread only).
    """
    from tqdm import tqdm

    dev = resolve_device(device)
    if timer not in TIMERS:
        raise PtplanError(f"unknown timer {timer!r}; choose one of {', '.join(TIMERS)}")
    if timer == "cpu" and dev.type != "cpu":
        raise PtplanError("the cpu timer measures CPU time; on CUDA the profiler always uses CUDA events")
    if timer == "cpu" and torch.get_num_threads() != 1:
        raise PtplanError(f"the cpu timer needs one torch thread (now {torch.get_num_threads()}); "
                          "pass --threads 1 or use --timer wall")
    bs = check_batch_sizes(batch_sizes)
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
    n = len(model.layers)
    clock = _Clock(dev, timer)
    fwd = [[0.0] * len(bs) for _ in range(n)]
    bwd = [[0.0] * len(bs) for _ in range(n)]
    nog = [[0.0] * len(bs) for _ in range(n)]
    whole_f, whole_fb, peaks = [], [], []
    out_bytes: list[int] = []
    saved_bytes: list[int] = []
    bar = tqdm(total=len(bs) * (warmup + repeats) * 2, desc=f"profile {model.name}", unit="step",
               file=sys.stderr, disable=not progress, leave=False)
    gen = torch.Generator().manual_seed(0)
    try:
        with _preserved(model, dev):
            for j, b in enumerate(bs):
                x, labels, mask = model.make_batch(b, gen)
                model.train()
                lf, lb, wf, wfb = [], [], [], []
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                for r in range(warmup + repeats):
                    f_i, b_i = _layered_step(model, clock, x, labels, mask)
                    w_f, w_fb = _whole_step(model, clock, x, labels, mask)
                    if r >= warmup:
                        lf.append(f_i)
                        lb.append(b_i)
                        wf.append(w_f)
                        wfb.append(w_fb)
                    bar.update(1)
                if dev.type == "cuda":
                    peaks.append(int(torch.cuda.max_memory_allocated(dev)))
                _clear_grads(model)
                model.eval()
                ln = []
                for r in range(warmup + repeats):
                    t = _nograd_pass(model, clock, x, labels, mask)
                    if r >= warmup:
                        ln.append(t)
                    bar.update(1)
                for i in range(n):
                    fwd[i][j] = statistics.median(s[i] for s in lf)
                    bwd[i][j] = statistics.median(s[i] for s in lb)
                    nog[i][j] = statistics.median(s[i] for s in ln)
                whole_f.append(statistics.median(wf))
                whole_fb.append(statistics.median(wfb))
                if j == len(bs) - 1:
                    model.train()
                    out_bytes, saved_bytes = _memory_pass(model, x, labels, mask, b)
                    _clear_grads(model)
            opt_s = _optimizer_steps(model, clock, warmup, repeats)
    finally:
        bar.close()

    records = []
    for i, (layer, spec) in enumerate(zip(model.layers, model.specs)):
        ps = list(layer.parameters())
        count = sum(p.numel() for p in ps)
        nbytes = sum(p.numel() * p.element_size() for p in ps)
        records.append(LayerRecord(
            index=i, name=spec.name, kind=spec.kind, block=spec.block, params=count, param_bytes=nbytes,
            grad_bytes=nbytes, optimizer_bytes=ADAMW_STATE_BYTES_PER_PARAM * count,
            output_bytes_per_sample=out_bytes[i], saved_bytes_per_sample=saved_bytes[i],
            forward_s=tuple(fwd[i]), backward_s=tuple(bwd[i]), nograd_forward_s=tuple(nog[i]),
            optimizer_s=opt_s[i]))
    info = ModelInfo(name=model.name, family=model.family, num_blocks=model.num_blocks, seq_len=model.seq_len,
                     dtype=DTYPE_NAMES[dtype], granularity=model.granularity, config=config_summary(model))
    measurement = {
        "warmup": warmup, "repeats": repeats, "statistic": "median",
        "timer": "cuda_events" if dev.type == "cuda" else
                 ("process_time (CPU time, 1 thread)" if timer == "cpu" else "perf_counter (wall)"),
        "method": "layers timed one by one inside a full layer-by-layer training step; "
                  "whole-model steps alternate with layered steps",
        "head_includes_loss": True, "whole_model_forward": "train mode, grad enabled, loss included",
        "grads_set_to_none_each_step": True,
        "memory_batch_size": bs[-1], "optimizer": "AdamW (2 fp32 moments per parameter)",
        "optimizer_step": "AdamW step over each layer's parameters alone, timed per layer",
    }
    return Profile(model=info, device=_device_info(dev), batch_sizes=bs, layers=tuple(records),
                   whole_model=WholeModel(forward_s=tuple(whole_f), forward_backward_s=tuple(whole_fb),
                                          peak_memory_bytes=tuple(peaks)),
                   measurement=measurement)


def agreement(profile: Profile) -> list[tuple[int, float, float, float]]:
    """Per batch size: (b, per-layer forward+backward sum, whole-model step, relative difference)."""
    out = []
    for j, b in enumerate(profile.batch_sizes):
        s = sum(r.forward_s[j] + r.backward_s[j] for r in profile.layers)
        w = profile.whole_model.forward_backward_s[j]
        out.append((b, s, w, (s - w) / w if w > 0 else float("nan")))
    return out
