"""Per-layer cost tables from a profile: seconds at any micro-batch size, bytes, and their prefix sums.

Legend: n = number of flat layers; b = micro-batch size (samples). Arrays have one value per layer;
``cum_*`` arrays have n + 1 entries (``cum[j] - cum[i]`` is the sum over layers ``[i, j)``), so a
stage's total is two lookups whatever its length.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .errors import PtplanError
from .profile import Profile, interp_rows

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of each dtype a profile may be measured in."""
OPTIMIZER_SLOTS = {"adamw": 2, "sgd": 1}
"""Parameter-sized state tensors per parameter: AdamW's two moments (exp_avg, exp_avg_sq), SGD's momentum
buffer. torch allocates each like its parameter (``zeros_like(p)``), so in the parameters' dtype: bf16
weights get bf16 moments (the executor trains with plain torch optimizers, no fp32 master copy)."""


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a profile's ``model.dtype``); PtplanError naming the known ones."""
    if dtype not in DTYPE_BYTES:
        raise PtplanError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def optimizer_state_bytes(params, dtype: str, optimizer: str = "adamw"):
    """THE optimizer-state bytes of ``params`` parameters (a number or an array) stored in ``dtype`` under
    ``optimizer``: params · bytes(dtype) · slots(optimizer) (``OPTIMIZER_SLOTS``). The profiler, the projection,
    the synthetic profiles and the stage model all call this one function (issue 21)."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise PtplanError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_SLOTS)}")
    return params * (dtype_bytes(dtype) * OPTIMIZER_SLOTS[optimizer])


def _cum(a: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(a)))


class RangeMax:
    """``max(a[i:j])`` for arrays of stages [i, j) at once, for per-layer values with few distinct levels (a
    Transformer's layers repeat): per level v, the first layer at or after each i whose value reaches v; a stage
    holds v when that layer is before j. Over ``LEVELS`` distinct positive values are rounded up to ``LEVELS`` of
    them (the answer is then an upper bound)."""

    LEVELS = 24

    def __init__(self, a: np.ndarray) -> None:
        a = np.asarray(a, dtype=float)
        n = len(a)
        u = np.unique(a[a > 0])
        if len(u) > self.LEVELS:
            u = u[np.linspace(0, len(u) - 1, self.LEVELS).round().astype(int)]  # keeps the largest
        self.levels: list[tuple[float, np.ndarray]] = []
        below = 0.0
        for v in u:  # v is reported where some layer exceeds the level below it
            hit = np.append(np.where(a > below, np.arange(n), n), n)
            self.levels.append((float(v), np.minimum.accumulate(hit[::-1])[::-1]))
            below = float(v)

    def __bool__(self) -> bool:
        return bool(self.levels)

    def query(self, at_I: Any, J: np.ndarray) -> np.ndarray:
        """The max over each stage [I, J); ``at_I(arr)`` is ``arr[I]`` (the partitioner passes a strided take)."""
        res = np.zeros(np.shape(J))
        for v, first in self.levels:
            res = np.where(at_I(first) < J, v, res)
        return res


@dataclass(frozen=True)
class TimesAt:
    """Per-layer seconds at one micro-batch size, with prefix sums."""

    b: int
    fwd: np.ndarray
    bwd: np.ndarray
    nograd: np.ndarray
    cum_fb: np.ndarray
    """Prefix sums of forward + backward."""
    cum_fwd: np.ndarray
    cum_bwd: np.ndarray
    cum_nograd: np.ndarray
    cum_bwd_weight: np.ndarray
    """Prefix sums of the backward's weight-gradient part (0 where the profile did not split it)."""


def optimizer_call_s(params: np.ndarray, seconds: np.ndarray) -> float:
    """The fixed cost of one optimizer call, from per-layer step times each measured with its own optimizer.

    A step costs a fixed part per call (the optimizer's Python work and kernel launches, whatever the size) and
    a part proportional to the parameters it updates; the profiler steps one optimizer per layer, so every layer's
    time holds the fixed part once, while the runtime pays it once per stage. Estimated as the intercept of the
    least-squares line of the layers' times against their parameter counts, held within [0, the smallest layer's
    time] (no layer costs less than a call); 0 with fewer than three layers that step. On a GPU that waits for
    the host the part is large: the lent H100's bert-base profile has 27 layers of 0.32-0.67 ms, an intercept of
    0.40 ms held to the head's 0.315 ms, so one call over the model is priced 3.7 ms against the per-layer sum's
    11.9 ms (``bench/gpu_replan.py``: the measured steady step moved from +21.7 % to +1.9 %). On this project's CPU
    it is 0.08 ms for bert-tiny (one AdamW call over the model measured 1.90 ms, priced 1.67, the per-layer sum
    2.46: ``bench/optimizer_call.py``) and 0 for the larger models, whose intercept is negative."""
    steps = seconds > 0
    if int(steps.sum()) < 3 or float(np.ptp(params[steps])) == 0.0:
        return 0.0
    A = np.stack([np.ones(int(steps.sum())), params[steps]], axis=1)
    (intercept, _), *_ = np.linalg.lstsq(A, seconds[steps], rcond=None)
    return float(min(max(intercept, 0.0), seconds[steps].min()))


@dataclass
class CostTable:
    """Per-layer costs of one profile, with per-micro-batch-size results memoised."""

    profile: Profile
    time_scale: float = 1.0
    """Factor on every time (the cluster's ``concurrency_slowdown`` when its processes share a CPU)."""
    _cache: dict[int, TimesAt] = field(default_factory=dict, repr=False)
    _derived: dict[Any, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        p = self.profile
        self.n = p.num_layers
        self.batch_sizes = np.asarray(p.batch_sizes, dtype=float)
        k = float(self.time_scale)
        self._fwd = k * np.array([r.forward_s for r in p.layers], dtype=float)
        self._bwd = k * np.array([r.backward_s for r in p.layers], dtype=float)
        self._nog = k * np.array([r.nograd_forward_s for r in p.layers], dtype=float)
        self.backward_split_measured = all(r.backward_weight_s is not None for r in p.layers)
        """Whether every layer's backward was split into its input- and weight-gradient parts."""
        self._bww = k * np.array([r.backward_weight_s if r.backward_weight_s is not None
                                  else (0.0,) * len(r.backward_s) for r in p.layers], dtype=float)
        self.params = np.array([r.params for r in p.layers], dtype=float)
        self.param_bytes = np.array([r.param_bytes for r in p.layers], dtype=float)
        self.dtype = p.model.dtype
        self.dtype_bytes = dtype_bytes(p.model.dtype)
        """Bytes per element of the profile's dtype (its weights, gradients and activations)."""
        self.grad_bytes = np.array([r.grad_bytes for r in p.layers], dtype=float)
        self.saved_per_sample = np.array([r.saved_bytes_per_sample for r in p.layers], dtype=float)
        self.working_per_sample = np.array([r.backward_working_bytes_per_sample for r in p.layers], dtype=float)
        """Per layer, its backward's working set per sample (``LayerRecord.backward_working_bytes_per_sample``)."""
        self.accumulate_bytes = np.array([r.accumulate_bytes for r in p.layers], dtype=float)
        """Per layer, what its backward makes more when adding into existing ``.grad`` (``LayerRecord``)."""
        self.stash_per_sample = np.array([r.backward_stash_bytes_per_sample for r in p.layers], dtype=float)
        """Per layer, what a split backward's B leaves for its W, per sample (``LayerRecord``)."""
        self.stash_measured = bool(self.stash_per_sample.any())
        """Whether the profile records the stash (older profiles do not: zero-bubble plans then leave it out)."""
        self.out_per_sample = np.array([r.output_bytes_per_sample for r in p.layers], dtype=float)
        self.optimizer_measured = all(r.optimizer_s is not None for r in p.layers)
        """Whether the profile measured every layer's optimizer step (older profiles did not)."""
        steps = k * np.array([r.optimizer_s or 0.0 for r in p.layers], dtype=float)
        self.set_optimizer(steps, optimizer_call_s(self.params, steps))
        self.cum_param = _cum(self.param_bytes)
        self.cum_grad = _cum(self.grad_bytes)
        self.cum_saved = _cum(self.saved_per_sample)
        self.cum_stash = _cum(self.stash_per_sample)
        self.cum_sync = self.cum_grad
        """Prefix sums of the bytes a stage's data-parallel gradient sync all-reduces (``strategy.py``
        halves them for FSDP's reduce-scatter)."""
        self.max_param_upto = np.concatenate(([0.0], np.maximum.accumulate(self.param_bytes)))
        """``max_param_upto[j]``: the largest single layer's weights among layers ``[0, j)``."""

    def derived(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, made once per table and ``key`` and kept: what the stage models of one table share (a copy
        that changes the table's numbers starts empty, as ``_cache`` does)."""
        got = self._derived.get(key)
        if got is None:
            got = self._derived[key] = make()
        return got

    def set_optimizer(self, per_layer: np.ndarray, call_s: float) -> None:
        """Per layer, seconds of one optimizer step over its parameters alone (0: nothing to step), of which
        ``call_s`` is the fixed cost of a call (the prefix sums that ``optimizer_range_s`` reads follow)."""
        self.optimizer_s = per_layer
        """Seconds of one AdamW step over each layer's parameters alone (independent of b; 0 where not measured
        or nothing steps), as the profiler times it: one optimizer per layer."""
        self.optimizer_call_s = float(call_s)
        """Of each layer's ``optimizer_s``, the fixed cost of an optimizer call (``optimizer_call_s``)."""
        steps = per_layer > 0
        self._cum_opt_calls = _cum(steps.astype(float))
        self._cum_opt_var = _cum(np.where(steps, per_layer - self.optimizer_call_s, 0.0))

    def optimizer_range_s(self, lo: Any, hi: Any) -> Any:
        """Seconds of one optimizer step over the layers [lo, hi) (arrays of bounds: elementwise): the runtime
        steps one optimizer over a rank's parameters (``executor/runtime/optim.py``), so a stage pays the call's
        fixed cost once and each layer its own part: ``optimizer_call_s`` + Σ (``optimizer_s`` - it), 0 where
        no layer steps."""
        calls = self._cum_opt_calls[hi] - self._cum_opt_calls[lo]
        return (calls > 0) * self.optimizer_call_s + self._cum_opt_var[hi] - self._cum_opt_var[lo]

    @property
    def measured_range(self) -> tuple[int, int]:
        """(smallest, largest) micro-batch size the profile measured."""
        return int(self.batch_sizes[0]), int(self.batch_sizes[-1])

    def extrapolated(self, b: int) -> bool:
        lo, hi = self.measured_range
        return not lo <= b <= hi

    def at(self, b: int) -> TimesAt:
        """Per-layer seconds at micro-batch size b (piecewise linear between measured sizes)."""
        hit = self._cache.get(b)
        if hit is None:
            bs, x = self.batch_sizes, float(b)
            f, bw, ng = interp_rows(bs, self._fwd, x), interp_rows(bs, self._bwd, x), interp_rows(bs, self._nog, x)
            bww = np.minimum(interp_rows(bs, self._bww, x), bw)
            hit = TimesAt(b=b, fwd=f, bwd=bw, nograd=ng, cum_fb=_cum(f + bw), cum_fwd=_cum(f), cum_bwd=_cum(bw),
                          cum_nograd=_cum(ng), cum_bwd_weight=_cum(bww))
            self._cache[b] = hit
        return hit

    def prefix_nograd_s(self, frozen_layers: int, b: int) -> float:
        """Seconds of the frozen prefix's no-grad forward for one micro-batch."""
        return float(self.at(b).cum_nograd[frozen_layers])
