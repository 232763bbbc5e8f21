"""The one stage model: a pipeline stage's time and peak memory, used by the partitioner, the search and the simulator.

Legend: n flat layers; a phase freezes the prefix [0, n0) and splits the active layers [n0, n)
into K contiguous stages; stage s holds [lo, hi) on pipeline position s; M micro-batches of b
samples per pipeline per iteration; D data-parallel replicas of every stage.

Time, per micro-batch on stage s (seconds; ``StageModel.stage_costs`` hands them to the simulator):

    forward   = Σ forward[lo:hi]  + o          o = the cluster's per-action overhead when K > 1
    backward  = Σ backward[lo:hi] + o          (+ Σ forward[lo:hi] with recomputation: the stage
                                                reruns its forward from the stashed input first)
    send      = latency + bytes / bandwidth of the link s -> s+1 (activation out) and s -> s-1
                (its gradient back), bytes = b · output bytes per sample of the boundary layer (measured in
                the profile's dtype); the latency is also given apart (``StageCost.send_*_latency_s``): a
                token-sliced schedule pays it once per slice (``terapipe.slice_costs``)
    prefix    = stage 0 recomputing the frozen prefix: Σ no-grad forward[0:n0], inside every forward
    setup     = stage 0 with the AutoCache, once per iteration before its first forward: the shard's
                M·b cached rows read from host memory (steady epochs), or, in a fill epoch, the
                prefix layers [c, n0) run on rows cached at c (0 = from the inputs) and written back,
                streaming their weights from host memory when the device is not the host
    allreduce = D > 1 without FSDP: ring all-reduce of Σ grad bytes[lo:hi] over the stage's data-parallel
                group (FSDP reduce-scatters inside every backward instead: ``strategy.py``), one flat buffer
                after the stage's last backward, exactly as the runtime does it (``executor/runtime/gradients.py``
                ``allreduce_grads`` after the schedule's step: no bucketed overlap with the stage's own backward;
                the simulator overlaps it only with the other stages' remaining work; PipeDream-2BW's with the
                next mini-batch's work); its latency once per rank when a rank holds several chunks
    optimizer = one optimizer call over the stage's layers: the call's fixed part + each layer's own part of its
                measured per-layer AdamW step (``CostTable.optimizer_range_s``); the fixed part once per rank

o is the cluster's ``action_overhead_s``, or the profiler's measured one where larger
(``cluster.charged_overheads``); ``StageCost.overhead_s`` and ``tp_comm_s`` / ``tp_comm_latency_s`` (the
tensor-parallel all-reduces inside forward and backward) say what the totals hold, so that token slices pay
them per slice.

The partitioner minimises the slowest stage's ``busy`` = forward + backward + both sends + prefix
(+ setup / M on stage 0), the work a micro-batch costs the stage.

Memory, per rank holding stage s (bytes): ``peak = static + max(inflight · per_mb, after)``

    static  = v · (weights Σ param[lo:hi] + gradients Σ grad[lo:hi]) + optimizer state
              (``costs.optimizer_state_bytes``, the one function the profiler, the projection and the
              synthetic profiles also call: adamw 2, sgd 1 parameter-sized tensors in the parameters' dtype);
              v = the schedule's weight versions of the active layers: 1, or 2 for PipeDream-2BW
              (the version in use and the next one; two gradients: a mini-batch's, held for its update
              until the next mini-batch but one starts, beside the next one's accumulating on its own
              version, as ``executor/runtime/twobw.py`` runs it; one optimizer state)
    w       = what the backward in progress holds on top: peak = static + max(inflight · per_mb + w, after).
              The backward's working set: max over the stage's layers of b · working[i] (the bytes layer i's
              backward makes at its peak, per sample: ``LayerRecord.backward_working_bytes_per_sample``,
              measured by ``executor/profiling/live_bytes.py``); on the stage holding the model's last layer,
              less b · out[n-1] (the runtime keeps the loss, not the head's output, so that output is gone
              before any backward runs); with M > 1, plus accumulate[i] (what a later micro-batch's backward
              makes more, each weight gradient being made apart before it is added into ``.grad``; the
              first micro-batch's gradients become ``.grad`` without a copy). With recomputation,
              also one micro-batch's working set b · (Σ saved[lo:hi] + out[hi-1]), rebuilt from the stashed
              input.
            + under a zero-bubble schedule, each micro-batch between its B and its W (at most
              ``schedule.peak_stashed`` of them) holds what its B left for its W, b · Σ stash[lo:hi]; with
              recomputation B rebuilds the stage's graph and W reads it, and the F's input and output (per_mb,
              counted among the micro-batches in flight) are let go: b · Σ stash[lo:hi] + max(b · Σ saved[lo:hi] -
              per_mb, 0) (``executor/runtime/step.ChunkCompute``'s rebuild)
            + receive buffers, where a neighbouring stage is on another rank (``PhaseShape.stage_ranks``;
              consecutive chunks of one rank pass tensors in place): one activation buffer per micro-batch
              for the stage before and one gradient buffer per micro-batch for the stage after,
              M·b·(out[lo-1] if stage s-1 is remote) + M·b·(out[hi-1] if stage s+1 is remote);
              PipeDream-2BW's own loop (``own_p2p``) one gradient buffer, b·(out[hi-1] if s < K-1),
              and each micro-batch in flight holds its received input, b·out[lo-1] more in per_mb
            + stage 0 recomputing the prefix: the frozen weights Σ param[0:n0] (one version: frozen
              layers are never updated)
            + stage 0 with the AutoCache: the shard's prefix outputs M·b·out[n0-1] (the frozen
              weights stay in host memory; see ``cache.py``)
    per_mb  = b · (Σ saved-for-backward[lo:hi] + out[hi-1]): what a micro-batch in flight holds
              until its backward (the saved activations and the stage's output); with
              recomputation its input and its output, b · (out[lo-1] + out[hi-1]) (the input 0 for token
              ids at layer 0; the runtime keeps each micro-batch's output until its backward either way)
    inflight= the schedule's most micro-batches in flight on stage s (``schedule.peak_inflight``)
    So PipeDream-2BW with recomputation on stage s of K uniform stages holds 2|W|/K + (K-s)·(|A_input| +
    |A_output|) plus two gradients, the optimizer state, the buffers and one micro-batch's working set (the
    paper's memory model, 2|W|/d + d·|A_input(b)|, counts the weights and the inputs).
    after   = (PipeDream-2BW, which never drains: added to static, not maxed: its update's all-reduce buffer
              lives under the next mini-batch's work, its optimizer's temporaries beside micro-batches in flight;
              an upper bound, as the temporaries meet no backward) the largest transient once the
              pipeline has drained: the flat gradient all-reduce
              buffer (Σ grad[lo:hi] when D > 1), on GPUs AdamW's foreach temporaries (one
              weight-sized buffer), and on stage 0 with the AutoCache the fill's transient (one
              streamed frozen layer's weights on a GPU plus one micro-batch's layer output: the
              executor fills the cache micro-batch by micro-batch, on the shapes a recomputing
              stage 0 uses)

Strategies (``strategy.py``, issue 14): with tensor parallel width tp > 1 or FSDP, every per-layer cost above is
first replaced by one shard's (``strategy_table``: times / tp plus the Megatron all-reduces and FSDP's all-gathers,
weights and gradients / tp and / D, saved activations divided where Megatron's split divides them, all but the
linears' gathered input with sequence parallelism ``PhaseShape.sp``), FSDP's per-micro-batch reduce-scatter joins
the backward and replaces the all-reduce and its flat buffer, and ``static`` gains FSDP's gathered-layer transient
over the stage's layers (``gather_layers``). An uncached frozen prefix is priced from the same per-shard table --
stage 0 runs it split over tp and, when stage 0 has FSDP, sharded over D: its weights and no-grad forward (with its
all-reduces and all-gathers) are the shard's, and it has no gradient terms --; a cached prefix stays whole in host
memory, so the cache set-up and the streamed weights keep the profile's own numbers (``StageModel.raw``). The
default (tp=1, no FSDP) leaves every number above unchanged.

Layer-wise recomputation (Galvatron's, ``PhaseShape.recompute_layers`` = r >= 1): only the stage's first r
active layers [lo, R), R = min(lo + r, hi), are one checkpoint unit; the others keep their activations:

    backward += Σ forward[lo:R]
    per_mb    = b · (out[lo-1] + Σ saved[R:hi] + out[hi-1])     (their input, the others' activations)
    w         = b · (Σ saved[lo:R] + out[R-1])                  (the unit's activations, rebuilt)
    stash    += max(b · Σ saved[lo:R] - b · out[lo-1], 0)        (zero-bubble: B rebuilds the unit, W reads it)

(a stage of r layers or fewer recomputes them all, as above). ``executor/runtime.recompute_first`` runs
exactly this; ``tests/test_stage_strategy_runtime.py`` counts the saved bytes with ``saved_tensors_hooks``. Under a
split backward the unit's F runs without autograd and its B rebuilds it once, after the other layers' input
gradient, for both B and W (``executor/runtime/step.ChunkCompute``'s ``rebuild``, ``tests/test_split_backward_recompute.py``).

One ``StageModel`` prices every stage with one strategy. ``StageChoice`` prices stages whose strategies
differ (issue 14, per stage): over one ``StageModel`` per strategy of the same phase, each candidate stage
takes, for the partitioner (AutoPipe's min-max split, where the search starts), the fastest strategy that fits
the memory limit; the search chooses every split's assignment by the simulated iteration instead
(``assign.py``, ``StageChoice.fix``); each stage's costs and memory are its chosen model's.

Not modelled (each small, or outside a training step): AdamW's step counter (4 bytes per
parameter tensor); what a rank holds *during* a phase transition (what it keeps, what it has
received and what it has not sent yet); rank 0 gathering the whole model into host memory for a
checkpoint; and every rank building the whole model once in host memory at start-up
(``executor/runtime/stage.py``).

What the executor holds is exactly this: a rank materialises only its stage's layers
(``executor/runtime/elastic.py``), and ``executor/runtime/memory.py`` measures the same terms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, Sequence

import numpy as np

from .cluster import Cluster, HostIO
from .costs import OPTIMIZER_SLOTS, CostTable, RangeMax, optimizer_state_bytes
from .errors import PtplanError
from .plan import MemoryBreakdown
from .replicate import layout
from .simulate import StageCost, StageTimes, peak_bytes
from .strategy import Strategy, gather_layers, splittable, strategy_table

OPTIMIZER_STATE_FACTOR = {k: float(v) for k, v in OPTIMIZER_SLOTS.items()}
"""Optimizer-state bytes per byte of weights (``costs.OPTIMIZER_SLOTS``: torch allocates state like the
parameter); kept for callers that scale a byte count -- the stage model itself calls
``costs.optimizer_state_bytes``."""
OPTIMIZER_TEMP_FACTOR_GPU = {"adamw": 1.0, "sgd": 0.0}
"""Weight-sized temporaries of torch's foreach optimizer step on CUDA (AdamW's sqrt of the second
moment); on CPU torch steps tensor by tensor and the temporary is one tensor's size (not modelled)."""
PREFIX_MODES = ("recompute", "cached", "fill")


@dataclass(frozen=True, kw_only=True)
class Links:
    """One pipeline shape's rank layout and per-stage communication coefficients. A pipeline of K
    positions holds S = K·V stages (chunks), placed by the schedule (``schedule.stage_to_rank``)."""

    ranks: tuple[tuple[int, ...], ...]
    """ranks[p][k]: the rank at position k of pipeline p."""
    send_lat: np.ndarray
    """S-1 entries: latency of the link from stage c's position to stage c+1's (pipeline 0; the others
    are alike; 0 where both stages share a position)."""
    send_inv_bw: np.ndarray
    """S-1 entries: 1 / bandwidth of that link."""
    ar_lat: np.ndarray
    """S entries: all-reduce seconds of stage c's data-parallel group = ar_lat[c] + bytes · ar_per_byte[c]."""
    ar_per_byte: np.ndarray


def links_for(cluster: Cluster, K: int, placement: tuple[int, ...] | None = None) -> Links:
    """Layout and coefficients for K positions holding the stages at ``placement`` (stage c on position
    placement[c]; default one stage per position). The K position groups all-reduce at about the same
    time at the end of an iteration, so each is costed as one of K groups sharing the inter-node
    links."""
    ranks = layout(cluster, K)
    row = ranks[0]
    s2r = tuple(range(K)) if placement is None else tuple(placement)
    lk = [cluster.link(row[s2r[c]], row[s2r[c + 1]]) if s2r[c] != s2r[c + 1] else (math.inf, 0.0)
          for c in range(len(s2r) - 1)]
    D = len(ranks)
    lat, per = [], []
    for k in range(K):
        group = [ranks[p][k] for p in range(D)]
        a0 = cluster.allreduce_seconds(group, 0.0, concurrent=K)
        lat.append(a0)
        per.append((cluster.allreduce_seconds(group, 1e9, concurrent=K) - a0) / 1e9)
    return Links(ranks=ranks, send_lat=np.array([x[1] for x in lk], dtype=float),
                 send_inv_bw=np.array([1.0 / x[0] for x in lk], dtype=float),
                 ar_lat=np.array([lat[k] for k in s2r], dtype=float),
                 ar_per_byte=np.array([per[k] for k in s2r], dtype=float))


def cache_setup_s(table: CostTable, n0: int, M: int, b: int, io: HostIO, *, device_is_host: bool,
                  fill_from: int | None = None) -> float:
    """Stage 0's once-per-iteration AutoCache work for a shard of M·b samples (the module docstring's
    ``setup``): reading the rows at n0 (``fill_from`` None: a steady iteration; at ``io.read``), or filling them:
    run layers [fill_from, n0) on rows cached at fill_from (or on the inputs when it is 0; those rows read at
    ``io.read``), write the rows at n0 (``io.write``), and stream those layers' weights from host memory when the
    device is not the host (``io.weights``)."""
    out = table.out_per_sample
    if fill_from is None:
        return M * b * float(out[n0 - 1]) / io.read
    c = fill_from
    read_c = M * b * float(out[c - 1]) / io.read if c > 0 else 0.0
    rows = M * b * float(out[n0 - 1]) / io.write
    stream = 0.0 if device_is_host else float(table.cum_param[n0] - table.cum_param[c]) / io.weights
    tm = table.at(b)
    return M * float(tm.cum_nograd[n0] - tm.cum_nograd[c]) + read_c + rows + stream


def remote_neighbours(ranks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per stage (chunk), whether the stage before it and the stage after it are on another rank (``ranks``: each
    stage's): where a receive buffer holds the activation coming in, and the gradient coming back."""
    r = np.asarray(ranks)
    return np.concatenate(([False], r[1:] != r[:-1])), np.concatenate((r[:-1] != r[1:], [False]))


def once_per_rank(ranks: Sequence[int], opt: np.ndarray, call_s: float, ar: np.ndarray, ar_lat: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per stage (chunk), its optimizer and all-reduce seconds (``opt``, ``ar``: (..., S), one split or a row per
    split) with the optimizer call's fixed part (``call_s``) and the all-reduce's latency (``ar_lat``) paid once per
    rank, on its first chunk that has them: a rank steps one optimizer and all-reduces one flat buffer over all its
    chunks (``ranks``: each chunk's)."""
    opt, ar = np.array(opt, dtype=float), np.array(ar, dtype=float)
    paid_opt: dict[int, np.ndarray] = {}
    paid_ar: dict[int, np.ndarray] = {}
    for i, r in enumerate(ranks):
        for x, paid, fixed in ((opt, paid_opt, call_s), (ar, paid_ar, ar_lat[i])):
            has = x[..., i] > 0
            before = paid.get(r, False)
            x[..., i] = np.where(has & before, np.maximum(x[..., i] - fixed, 0.0), x[..., i])
            paid[r] = has | before
    return opt, ar


@dataclass(frozen=True, kw_only=True)
class PhaseShape:
    """What a phase fixes for all of its stages."""

    K: int
    M: int
    b: int
    D: int
    frozen: int
    """n0, the frozen prefix's length in flat layers."""
    cache: bool
    """Whether stage 0 reads the prefix's output from the AutoCache instead of recomputing it."""
    inflight: tuple[int, ...]
    """Per stage (chunk), the schedule's most micro-batches in flight (``schedule.peak_inflight``)."""
    V: int = 1
    """Chunks (stages) per pipeline position: S = K·V stages, placed by the schedule."""
    optimizer: str = "adamw"
    weight_versions: int = 1
    """Copies of the active layers' weights and gradients a stage keeps: 1, or 2 for PipeDream-2BW (frozen layers
    keep one)."""
    recompute: bool = False
    """Activation recomputation: a micro-batch in flight holds only the stage's input and output, and the
    backward first reruns the stage's forward."""
    recompute_layers: int = 0
    """With recomputation: only the stage's first r active layers are recomputed (0 = all of them; a stage
    of r layers or fewer recomputes them all)."""
    stashed: tuple[int, ...] = ()
    """Per stage, the most micro-batches at once between their B and their W (``schedule.peak_stashed``: zero-bubble
    schedules), each holding what its B left for its W (Σ stash[lo:hi] per sample); empty: none."""
    own_p2p: bool = False
    """The stage exchanges messages in ptplan's own point-to-point loop (PipeDream-2BW,
    ``executor/runtime/twobw.py``), not torch.distributed.pipelining's: no receive buffer per micro-batch; a
    received activation stays with its micro-batch until its backward (``per_mb``), a received
    gradient only while that backward runs (one buffer)."""
    tp: int = 1
    """Tensor-parallel width of every stage (``strategy.py``): K · D · tp GPUs."""
    fsdp: bool = False
    """Sharded data parallel (ZeRO-3) over the D replicas (``strategy.py``)."""
    sp: bool = False
    """Sequence parallelism with tp > 1 (``strategy.Strategy.sp``): split layers' saved activations per ``saved_share``."""
    tp_ar: tuple[float, float] = (0.0, 0.0)
    """(latency s, s/byte) of the tp group's all-reduce (``strategy.tp_allreduce_coeffs``)."""
    device_is_host: bool = False
    """CPU "clusters": the device memory is host memory, so nothing is streamed between them."""
    action_overhead_s: float = 0.0
    host_io: HostIO = HostIO()
    """The AutoCache's host bandwidths (``cluster.measured_host_io``)."""
    stage_ranks: tuple[int, ...] = ()
    """Per stage, the rank that holds it (``schedule.stage_to_rank``): consecutive stages on one rank pass their
    activations and gradients in place, with no receive buffer. Empty: one rank per stage (V = 1's placement)."""

    @property
    def S(self) -> int:
        """Stages (chunks) per pipeline."""
        return self.K * self.V

    def __post_init__(self) -> None:
        if len(self.inflight) != self.S:
            raise PtplanError(f"PhaseShape: {len(self.inflight)} in-flight counts for K*V={self.S} stages")
        if self.stashed and len(self.stashed) != self.S:
            raise PtplanError(f"PhaseShape: {len(self.stashed)} stashed counts for K*V={self.S} stages")
        if self.stage_ranks and len(self.stage_ranks) != self.S:
            raise PtplanError(f"PhaseShape: {len(self.stage_ranks)} stage ranks for K*V={self.S} stages")
        if not self.stage_ranks and self.V > 1:
            raise PtplanError("PhaseShape: V > 1 chunks per rank need stage_ranks (schedule.stage_to_rank)")
        if self.optimizer not in OPTIMIZER_STATE_FACTOR:
            raise PtplanError(f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZER_STATE_FACTOR)}")
        if self.weight_versions not in (1, 2):
            raise PtplanError(f"PhaseShape: weight_versions={self.weight_versions!r}; a stage keeps 1 weight version, "
                              f"or 2 with PipeDream-2BW")
        if not isinstance(self.recompute, bool):
            raise PtplanError(f"PhaseShape: recompute must be true or false, got {self.recompute!r}")
        Strategy(tp=self.tp, fsdp=self.fsdp, recompute=self.recompute,
                 recompute_layers=self.recompute_layers, sp=self.sp)  # validates tp, fsdp and the recomputed layers


@dataclass(frozen=True)
class Band:
    """Stage components for arrays of candidate stages [I, J) (any equal shapes), before the stage index."""

    I: np.ndarray
    J: np.ndarray
    fb: np.ndarray
    """Σ (forward + backward) seconds."""
    state: np.ndarray
    """Weights + gradients + optimizer state bytes."""
    grad: np.ndarray
    weights: np.ndarray
    per_mb: np.ndarray
    in_bytes: np.ndarray
    """b · output bytes of layer I-1 (what the stage receives), 0 at I = 0."""
    out_bytes: np.ndarray
    """b · output bytes of layer J-1 (what the stage sends)."""
    working: np.ndarray | float = 0.0
    """What a backward in progress holds on top of the micro-batches in flight: with recomputation one micro-batch's
    activations, rebuilt for its backward; and the backward's working set (module docstring)."""
    stash: np.ndarray | float = 0.0
    """b · Σ stash[I:J]: what one micro-batch's B leaves for its W (zero-bubble schedules)."""


def _stage0_prefix(raw: CostTable, table: CostTable, times: Any, sh: PhaseShape, fill_from: int
                   ) -> tuple[float, float, float, float, float]:
    """Stage 0's frozen-prefix terms (static bytes, prefix seconds, cache read and fill set-up seconds, transient
    bytes after): with the AutoCache, the shard's prefix outputs and the host traffic (priced from the profile's
    own table ``raw``: the prefix stays whole in host memory); else the prefix's weights and no-grad forward, split
    and sharded as the stage's layers (``table``, ``times``)."""
    n0, b, M = sh.frozen, sh.b, sh.M
    if not sh.cache:  # split (/ tp) and, with FSDP, sharded (/ D); + its all-reduces (tp) and all-gathers (FSDP)
        return float(table.cum_param[n0]), float(times.cum_nograd[n0]), 0.0, 0.0, 0.0
    out = table.out_per_sample
    read = cache_setup_s(raw, n0, M, b, sh.host_io, device_is_host=sh.device_is_host)
    fill = cache_setup_s(raw, n0, M, b, sh.host_io, device_is_host=sh.device_is_host, fill_from=fill_from)
    streamed = 0.0 if sh.device_is_host else float(raw.max_param_upto[n0])
    return float(M * b * out[n0 - 1]), 0.0, read, fill, streamed + float(b * out[:n0].max())


class StageModel:
    """Time and memory of any stage of one phase (see the module docstring); vectorised over stages."""

    def __init__(self, table: CostTable, shape: PhaseShape, links: Links, *, fill_from: int = 0,
                 shard_table: CostTable | None = None) -> None:
        """``table``: the profile's; ``shard_table``: ``strategy.strategy_table`` of it for the shape's strategy
        and these links, when the caller keeps one (``search.PhaseSearch.table_for``); made here otherwise."""
        self.t, self.shape, self.links = table, shape, links
        sh = shape
        if not 0 <= sh.frozen < table.n:
            raise PtplanError(f"frozen prefix of {sh.frozen} layers leaves nothing to train in {table.n} layers")
        if sh.cache and sh.frozen == 0:
            raise PtplanError("a phase with nothing frozen has no prefix to cache")
        if not 0 <= fill_from <= sh.frozen:
            raise PtplanError(f"fill_from={fill_from} must lie in 0..{sh.frozen}")
        st = Strategy(tp=sh.tp, fsdp=sh.fsdp, recompute=sh.recompute, sp=sh.sp)
        self._gather = None
        """With FSDP, the range maxima of each layer's gathered weights x 2 and unsharded gradient (``strategy.py``'s
        transient, over a stage's layers: ``prepare``)."""
        prefix_gather = 0.0
        if st.fsdp:
            W, G = gather_layers(table, st)
            self._gather = (RangeMax(2 * W), RangeMax(G))
            if sh.frozen and not sh.cache:  # stage 0 gathers the uncached prefix's layers in its forward too
                prefix_gather = float(2 * W[:sh.frozen].max())
        self.raw = table
        """The profile's own table: the AutoCache's prefix (whole in host memory) is priced from it; an uncached
        prefix runs split and sharded as the stage's active layers (``strategy.py``), from ``t``."""
        table = shard_table if shard_table is not None else strategy_table(
            table, st, sh.D, sh.tp_ar, (float(np.mean(links.ar_lat)), float(np.mean(links.ar_per_byte))))
        self.t = table
        self.sync = sh.D > 1 and not sh.fsdp
        """Whether the stage all-reduces its gradients after the pipeline (FSDP reduce-scatters them instead)."""
        self.start, self.n = sh.frozen, table.n
        self.times = table.at(sh.b)
        self.cum_opt_state = self.optimizer_bytes(table.cum_param)
        """Prefix sums of the optimizer state's bytes (one shard's: the table's weights / tp and / D)."""
        self.cum_state = sh.weight_versions * (table.cum_param + table.cum_grad) + self.cum_opt_state
        """Additive lower bound of a stage's memory (prefix sums): weights and gradients (every version) + state."""
        self.cum_time_lb = self.times.cum_fb + (self.times.cum_fwd if sh.recompute and not sh.recompute_layers
                                                else 0.0)
        """Additive lower bound of a stage's busy time (prefix sums): forward + backward (+ a whole recomputation)."""
        self._index = np.arange(table.n + 1)
        a = splittable(self.raw) if sh.tp > 1 else np.zeros(table.n)
        self._cum_tp_lat = np.concatenate(([0.0], np.cumsum(a * sh.tp_ar[0])))
        """Prefix sums of the tp all-reduces' latencies in one forward (``strategy.py``: a per half, 2 per block)."""
        self._cum_tp_per_sample = np.concatenate(([0.0], np.cumsum(a * self.raw.out_per_sample * sh.tp_ar[1])))
        """Prefix sums of their bytes' seconds per sample of the micro-batch."""
        self.ovh = sh.action_overhead_s if sh.K > 1 else 0.0
        self.opt_temp = 0.0 if sh.device_is_host else OPTIMIZER_TEMP_FACTOR_GPU[sh.optimizer]
        b, M = sh.b, sh.M
        self.fill_from = fill_from
        L = links
        self._lat_in = np.concatenate(([0.0], L.send_lat))
        self._inv_in = np.concatenate(([0.0], L.send_inv_bw))
        self._lat_out = np.concatenate((L.send_lat, [0.0]))
        self._inv_out = np.concatenate((L.send_inv_bw, [0.0]))
        self._inflight = np.asarray(sh.inflight, dtype=float)
        self._stashed = np.asarray(sh.stashed, dtype=float) if any(sh.stashed) else None
        """Per stage, micro-batches between B and W at once (``PhaseShape.stashed``), or None: no stash priced."""
        self._remote_in, self._remote_out = remote_neighbours(sh.stage_ranks or tuple(range(sh.S)))
        self._out_before = np.concatenate(([0.0], table.out_per_sample))
        """``_out_before[i]``: output bytes per sample of layer i - 1 (what a stage starting at i receives)."""
        self._working = table.derived(("working", b, M > 1), lambda: RangeMax(
            b * table.working_per_sample + (table.accumulate_bytes if M > 1 else 0.0)))
        """Per layer, its backward's working set for one micro-batch (adding into ``.grad`` when M > 1); max over a
        stage's layers (``band``)."""
        self._has_working = sh.recompute or bool(self._working)
        self.stage0_static, self.prefix_s, self.read_setup_s, self.fill_setup_s, self.stage0_after = \
            _stage0_prefix(self.raw, table, self.times, sh, fill_from)
        self._stage0_held = self.stage0_static + prefix_gather
        """What stage 0 holds beyond its layers' terms: ``stage0_static`` (the frozen prefix's weights or the cached
        shard) and, with FSDP, the uncached prefix's gathered layers (2 x its largest, ``strategy.py``)."""

    @cached_property
    def position_state(self) -> np.ndarray:
        """(S, n + 1): per position s, prefix sums of per-layer bytes a stage's peak at s is at least: ``cum_state`` +
        the saved activations per micro-batch in flight at s (recomputation: once). Other terms only add."""
        times = np.ones(self.shape.S) if self.shape.recompute else self._inflight
        return self.cum_state[None, :] + times[:, None] * (self.shape.b * self.t.cum_saved)[None, :]

    def optimizer_bytes(self, weight_bytes: Any) -> Any:
        """Optimizer-state bytes of ``weight_bytes`` of weights in the table's dtype (``costs.optimizer_state_bytes``,
        the one function the profiler, the projection and the synthetic profiles call)."""
        return optimizer_state_bytes(weight_bytes / self.t.dtype_bytes, self.t.dtype, self.shape.optimizer)

    @property
    def strategy(self) -> Strategy:
        """The strategy every stage of this model uses."""
        sh = self.shape
        return Strategy(tp=sh.tp, fsdp=sh.fsdp, recompute=sh.recompute, recompute_layers=sh.recompute_layers, sp=sh.sp)

    def stage_strategies(self, ranges: Sequence[tuple[int, int]]) -> tuple[Strategy, ...]:
        """Each stage's strategy in a split: this model's one (``StageChoice`` chooses per stage); a stage that
        recomputes its first r layers but has no more than r recomputes them all (``recompute_layers`` 0)."""
        lo, hi = self.check_ranges(ranges)
        st, r = self.strategy, self.shape.recompute_layers
        whole = replace(st, recompute_layers=0)
        return tuple(whole if r and r >= b - a else st for a, b in zip(lo.tolist(), hi.tolist()))

    # ---- vectorised evaluation -------------------------------------------------------------
    def band(self, I: Any, J: np.ndarray, memo: dict | None = None) -> Band:
        """Index-dependent components of the stages [I, J) (absolute layer indices, I < J). ``I`` may be
        an index object with ``take_from(arr)`` (the partitioner's strided band) instead of an array. ``memo``:
        where models of one ``StageChoice`` share what depends only on their table (``_table_band``)."""
        t, b = self.t, self.shape.b
        at_I = _indexer(I)
        if memo is None:
            got = _table_band(self, at_I, J)
        else:
            sh = self.shape
            key = (id(t), b, sh.M > 1, sh.weight_versions, sh.optimizer, self._stashed is None)
            got = memo.get(key) or memo.setdefault(key, _table_band(self, at_I, J))
        grad, weights, state, out_J, in_bytes, full, bwd, stash = got
        r = self.shape.recompute_layers
        if self.shape.recompute and r:  # the first r layers: their input stashed, the rest's activations kept
            R = np.minimum(at_I(self._index) + r, J)  # R = J: the whole stage, as below
            tm = self.times
            if self._stashed is not None:  # a split backward's B rebuilds the first r layers' graph, which W reads
                stash = stash + np.maximum(b * (t.cum_saved[R] - at_I(t.cum_saved)) - in_bytes, 0.0)
            return Band(I=I, J=J, fb=tm.cum_fb[J] - at_I(tm.cum_fb) + tm.cum_fwd[R] - at_I(tm.cum_fwd),
                        state=state, grad=grad, weights=weights,
                        per_mb=in_bytes + b * (t.cum_saved[J] - t.cum_saved[R] + out_J), in_bytes=in_bytes,
                        out_bytes=b * out_J, stash=stash,
                        working=b * (t.cum_saved[R] - at_I(t.cum_saved) + t.out_per_sample[R - 1]) + bwd)
        if self.shape.recompute:  # the stashed input and the output per micro-batch; one working set rebuilt at a time
            per_mb = in_bytes + b * out_J
            if self._stashed is not None:  # a split backward's B rebuilds the graph its W reads, and lets go of the
                # F's input and output: between B and W a micro-batch holds the rebuilt activations, not per_mb
                stash = stash + np.maximum(full - b * out_J - per_mb, 0.0)
            return Band(I=I, J=J, fb=self.cum_time_lb[J] - at_I(self.cum_time_lb), state=state, grad=grad,
                        weights=weights, per_mb=per_mb, in_bytes=in_bytes, out_bytes=b * out_J, working=full + bwd,
                        stash=stash)
        return Band(I=I, J=J, fb=self.times.cum_fb[J] - at_I(self.times.cum_fb), state=state, grad=grad,
                    weights=weights, per_mb=full, in_bytes=in_bytes, out_bytes=b * out_J, working=bwd, stash=stash)

    def prepare(self, I: np.ndarray, J: np.ndarray, memo: dict | None = None) -> tuple[np.ndarray, ...]:
        """The stage-index-free parts of stages [I, J), for ``evaluate`` (the partitioner computes them
        once per search and slices them per stage index); ``memo`` as ``band``'s."""
        bd = self.band(I, J, memo)
        after = bd.grad if self.sync else np.zeros_like(bd.grad)  # the flat all-reduce buffer
        if self.opt_temp:
            after = np.maximum(after, self.opt_temp * bd.weights)
        state = bd.state
        if self._gather is not None:  # FSDP's transient, over the stage's layers
            at_I = _indexer(I)
            state = state + self._gather[0].query(at_I, J) + self._gather[1].query(at_I, J)
        terms = (bd.fb + 2 * self.ovh, bd.in_bytes, bd.out_bytes, state, bd.per_mb, after,
                 np.broadcast_to(bd.working, np.shape(bd.fb)))
        return terms if self._stashed is None else terms + (np.broadcast_to(bd.stash, np.shape(bd.fb)),)

    def _combine(self, terms: tuple[np.ndarray, ...], s: int | np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(busy, static, per_mb, after, inflight) of prepared stages at stage index s (a number, or an
        array broadcasting against the terms): the module docstring's formulas, in one place. (The
        number case branches instead of multiplying by 0/1 flags: it runs once per stage index in
        every split search.) Recomputation's working set w joins ``static`` and leaves ``after``
        (max(after - w, 0)), so that ``peak_bytes`` gives static + max(inflight · per_mb + w, after); so does a
        zero-bubble schedule's stash, stashed[s] · b · Σ stash (``PhaseShape.stashed``)."""
        t, static, per_mb, after, infl = self._combine_raw(terms[:6], s)
        if self._stashed is not None:
            static = static + self._stashed[s] * terms[7]
        if self.shape.own_p2p:  # 2BW never drains: its update's transient adds (module docstring: after)
            static, after = static + after, np.zeros_like(after)
        if self._has_working:
            w = terms[6]
            static, after = static + w, np.maximum(after - w, 0.0)
        return t, static, per_mb, after, infl

    def _combine_raw(self, terms: tuple[np.ndarray, ...], s: int | np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        sh = self.shape
        base, inb, outb, state, per_mb, after = terms
        if isinstance(s, (int, np.integer)):
            t, static = base, state
            if s > 0:
                t = t + (self._lat_in[s] + inb * self._inv_in[s])
                if sh.own_p2p:
                    per_mb = per_mb if sh.recompute else per_mb + inb
                elif self._remote_in[s]:
                    static = static + sh.M * inb
            if s < sh.S - 1:
                t = t + (self._lat_out[s] + outb * self._inv_out[s])
                if self._remote_out[s]:
                    static = static + (1 if sh.own_p2p else sh.M) * outb
            if s == 0:
                t = t + (self.prefix_s + self.read_setup_s / sh.M)
                static = static + self._stage0_held
                if self.stage0_after:
                    after = np.maximum(after, self.stage0_after)
            return t, static, per_mb, after, self._inflight[s]
        si = np.asarray(s)
        has_in, has_out, is0 = si > 0, si < sh.S - 1, si == 0
        t = base + has_in * (self._lat_in[si] + inb * self._inv_in[si]) \
            + has_out * (self._lat_out[si] + outb * self._inv_out[si]) \
            + is0 * (self.prefix_s + self.read_setup_s / sh.M)
        rin, rout = self._remote_in[si], self._remote_out[si]
        if sh.own_p2p:
            static = state + rout * outb + is0 * self._stage0_held
            if not sh.recompute:
                per_mb = per_mb + has_in * inb
        else:
            static = state + sh.M * (rin * inb + rout * outb) + is0 * self._stage0_held
        if self.stage0_after:
            after = np.where(is0, np.maximum(after, self.stage0_after), after)
        return t, static, per_mb, after, self._inflight[si]

    def peak_upper(self, terms: tuple[np.ndarray, ...]) -> np.ndarray:
        """Bytes that the prepared stages' peak is at most at any position: ``_combine`` with every
        position-dependent term on at once (both receive buffers, stage 0's prefix or cache, the most
        micro-batches in flight), each of which only adds."""
        sh = self.shape
        _, inb, outb, state, per_mb, after, w = terms[:7]
        if sh.own_p2p:
            static = state + outb + self._stage0_held
            per = per_mb if sh.recompute else per_mb + inb
        else:
            static, per = state + sh.M * (inb + outb) + self._stage0_held, per_mb
        if self._stashed is not None:
            static = static + float(self._stashed.max()) * terms[7]
        if self.stage0_after:
            after = np.maximum(after, self.stage0_after)
        if sh.own_p2p:  # as ``_combine``: 2BW's transient adds
            static, after = static + after, np.zeros_like(after)
        if self._has_working:
            static, after = static + w, np.maximum(after - w, 0.0)
        return peak_bytes(static, per, float(self._inflight.max()), after)

    def evaluate(self, s: int, terms: tuple[np.ndarray, ...], cols: slice = slice(None)
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(busy seconds, peak bytes) of the prepared stages as stage s (see the module docstring)."""
        t, static, per_mb, after, infl = self._combine(tuple(x[..., cols] for x in terms), s)
        return t, peak_bytes(static, per_mb, infl, after)

    def evaluate_split(self, terms: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        """``evaluate`` for the K prepared stages of one split at once, stage s being entry s."""
        t, static, per_mb, after, infl = self._combine(terms, np.arange(self.shape.S))
        return t, peak_bytes(static, per_mb, infl, after)

    # ---- one split -------------------------------------------------------------------------
    def check_ranges(self, ranges: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) arrays of a split of the active layers into K contiguous stages; PtplanError if not."""
        if len(ranges) != self.shape.S or ranges[0][0] != self.start or ranges[-1][1] != self.n or any(
                a[1] != c[0] or a[0] >= a[1] for a, c in zip(ranges, ranges[1:])) or ranges[-1][0] >= ranges[-1][1]:
            raise PtplanError(f"{list(ranges)} is not a split of layers [{self.start}, {self.n}) into "
                              f"K*V={self.shape.S} contiguous non-empty stages")
        return np.array([r[0] for r in ranges]), np.array([r[1] for r in ranges])

    def peaks(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """Each stage's peak bytes in a split."""
        return self.evaluate_split(self.prepare(*self.check_ranges(ranges)))[1]

    def stage_memory(self, ranges: Sequence[tuple[int, int]]) -> tuple[MemoryBreakdown, ...]:
        """Each stage's peak memory, term by term."""
        lo, hi = self.check_ranges(ranges)
        sh, t = self.shape, self.t
        terms = self.prepare(lo, hi)
        _, static, per_mb, after, infl = self._combine(terms, np.arange(sh.S))
        weights = t.cum_param[hi] - t.cum_param[lo]
        w = sh.weight_versions * weights + (np.arange(sh.S) == 0) * (0.0 if sh.cache else t.cum_param[sh.frozen])
        g = sh.weight_versions * (t.cum_grad[hi] - t.cum_grad[lo])
        o = self.optimizer_bytes(weights)
        rc = terms[6] if self._has_working else np.zeros(sh.S)  # recomputation's and the backward's working sets
        if self._stashed is not None:  # what the micro-batches between B and W keep for their W
            rc = rc + self._stashed * terms[7]
        # the simulator's peak of ``stage_costs``' whole bytes (int() of each term), so that the two agree to the
        # byte; from the fractional terms (tp > 1) they differ by up to the micro-batches in flight (118 bytes at
        # GPipe's M = 128)
        total = peak_bytes(np.trunc(static), np.trunc(per_mb), infl, np.trunc(after))
        raw_after = self._combine_raw(terms[:6], np.arange(sh.S))[3]
        added = raw_after if sh.own_p2p else np.zeros(sh.S)  # 2BW's transient is in ``static`` (``_combine``)
        return tuple(MemoryBreakdown(weights=int(w[s]), gradients=int(g[s]), optimizer=int(o[s]),
                                     buffers=int(static[s] - w[s] - g[s] - o[s] - rc[s] - added[s]),
                                     activations=int(infl[s] * per_mb[s] + rc[s]),
                                     transient=int(raw_after[s]), inflight=int(infl[s]), total=int(total[s]))
                     for s in range(sh.S))

    def stage_costs(self, ranges: Sequence[tuple[int, int]], *, fill: bool = False) -> list[StageCost]:
        """The simulator's per-stage costs for a split (``fill``: an iteration that fills the cache)."""
        lo, hi = self.check_ranges(ranges)
        _, static, per_mb, after, _ = self._combine(self.prepare(lo, hi), np.arange(self.shape.S))
        cols = [a.tolist() for a in stage_times(self, lo, hi, fill=fill)]
        return [StageCost(**{f: col[i] for f, col in zip(StageTimes._fields, cols)}, overhead_s=self.ovh,
                          fixed_bytes=int(static[i]), activation_bytes_per_mb=int(per_mb[i]),
                          after_bytes=int(after[i])) for i in range(self.shape.S)]


def stage_times(m: StageModel | StageChoice, lo: np.ndarray, hi: np.ndarray, *, fill: bool = False) -> StageTimes:
    """The simulator's per-stage seconds (the module docstring's time formulas, in one place) of one split (lo, hi:
    (S,)) or of many at once (rows of (N, S)): ``StageModel.stage_costs`` reads one split's, ``simulate.iterations``
    simulates many (``fill``: an iteration that fills the cache). A ``StageChoice``'s stages each take the times of
    the model they choose (``StageChoice.stage_costs``)."""
    if isinstance(m, StageChoice):
        return m.stage_times(lo, hi, fill=fill)
    sh, L, tm, t = m.shape, m.links, m.times, m.t
    K = sh.S
    s = np.arange(K)
    inb, outb = sh.b * m._out_before[lo], sh.b * t.out_per_sample[hi - 1]
    send_f = (s < K - 1) * (m._lat_out + outb * m._inv_out)
    send_b = (s > 0) * (m._lat_in + inb * m._inv_in)
    ar = (L.ar_lat + (t.cum_sync[hi] - t.cum_sync[lo]) * L.ar_per_byte) if m.sync else np.zeros(np.shape(lo))
    fwd = tm.cum_fwd[hi] - tm.cum_fwd[lo] + m.ovh
    bwd = tm.cum_bwd[hi] - tm.cum_bwd[lo] + m.ovh
    if sh.recompute:  # the backward reruns the (first r layers' of the) stage's forward first
        upto = np.minimum(lo + sh.recompute_layers, hi) if sh.recompute_layers else hi
        bwd = bwd + (tm.cum_fwd[upto] - tm.cum_fwd[lo])
    bww = tm.cum_bwd_weight[hi] - tm.cum_bwd_weight[lo]
    opt = t.optimizer_range_s(lo, hi)
    if sh.V > 1:
        opt, ar = once_per_rank(sh.stage_ranks, opt, t.optimizer_call_s, ar, L.ar_lat)
    setup = (m.fill_setup_s if fill else m.read_setup_s) if sh.cache else 0.0
    tp_lat = m._cum_tp_lat[hi] - m._cum_tp_lat[lo]
    first = np.broadcast_to(s == 0, np.shape(lo))
    return StageTimes(forward_s=fwd, backward_s=bwd, backward_weight_s=np.minimum(bww, bwd),
                      prefix_s=first * m.prefix_s, setup_s=first * setup, send_forward_s=send_f,
                      send_backward_s=send_b, allreduce_s=ar, optimizer_s=opt,
                      send_forward_latency_s=np.broadcast_to((s < K - 1) * m._lat_out, np.shape(lo)),
                      send_backward_latency_s=np.broadcast_to((s > 0) * m._lat_in, np.shape(lo)),
                      tp_comm_s=tp_lat + sh.b * (m._cum_tp_per_sample[hi] - m._cum_tp_per_sample[lo]),
                      tp_comm_latency_s=tp_lat)


def _indexer(I: Any) -> Callable[[np.ndarray], np.ndarray]:
    """``arr[I]`` as a function of ``arr``: ``I`` an array of stage starts, or the partitioner's strided band (an
    index object with ``take_from(arr)``)."""
    take = getattr(I, "take_from", None)
    if take is not None:
        return take
    return lambda arr: arr[I]


def _table_band(m: StageModel, at_I: Callable[[np.ndarray], np.ndarray], J: np.ndarray) -> tuple:
    """What ``StageModel.band`` gives the same for every model of one table, micro-batch size and schedule (whatever
    its recomputation): gradient, weight and state bytes of the stages, the output's bytes per sample, and per
    micro-batch the input, the activations and output kept, the backward's working set and the stash."""
    t, b = m.t, m.shape.b
    out_J = t.out_per_sample[J - 1]
    bwd: np.ndarray | float = 0.0  # the backward's working set; the last stage's output dies with the loss
    if m._working:
        bwd = m._working.query(at_I, J)
        bwd = np.where(J == m.n, np.maximum(bwd - b * out_J, 0.0), bwd)
    return (t.cum_grad[J] - at_I(t.cum_grad), t.cum_param[J] - at_I(t.cum_param), m.cum_state[J] - at_I(m.cum_state),
            out_J, b * at_I(m._out_before), b * (t.cum_saved[J] - at_I(t.cum_saved) + out_J), bwd,
            b * (t.cum_stash[J] - at_I(t.cum_stash)) if m._stashed is not None else 0.0)


class StageChoice:
    """Per-stage strategies (issue 14): a stage family over several ``StageModel``s of one phase (the same K, M,
    b, D, tp, schedule and cache; each a strategy -- FSDP on or off, recomputation on or off) in which every
    stage takes the fastest strategy whose peak fits ``limit``, or the model ``fix`` gives it.

    As ``partition.split_stages``'s family, a candidate stage [I, J) at position s costs the least busy time
    of the strategies that fit there (its peak is that strategy's); where none fits, the smallest peak of
    any, so that the split search sees it does not fit. A min-max split (then least sum of squares) over these
    costs is the best over every split and every per-stage choice of strategy together: with the split fixed,
    each stage's choice touches only its own cost, and taking each stage's least cost minimises both the
    slowest stage and the sum of squares. Ties go to the earlier model (give the simplest first: no FSDP, no
    recomputation). In 1F1B stage 0 keeps K micro-batches in flight and the last stage one, so recomputation,
    or FSDP's sharded state, is often needed on the first stages only.

    The busy time leaves out what comes after a stage's last backward: FSDP has no all-reduce there and shards
    the optimizer step, which end a flushed iteration on stage 0. So the search (``search._Scorer.chosen``) scores
    each split by its best assignment under the simulator (``assign.best_assignments``, from ``each`` and
    ``fastest``) and ``fix``es the chosen split's; ``stage_costs``, ``stage_memory`` and ``stage_strategies`` then
    give each stage's numbers from the model it takes, exactly as that model alone gives them.

    ``models[0]`` must never be slower than the others on any stage (the search gives the simplest first: no
    FSDP, no recomputation); then where it fits every candidate stage at every position (``peak_upper``) the
    others are not prepared, and where it fits every stage asked for they are not evaluated. The search's
    models also recompute only a stage's first 1, 2, 4, ... layers (Galvatron's layer-wise choice), so each
    stage takes the least recomputation that fits.
    """

    def __init__(self, models: Sequence[StageModel], limit: float) -> None:
        if not models:
            raise PtplanError("StageChoice needs at least one stage model")
        a = models[0]
        if any((m.start, m.n, m.shape.S) != (a.start, a.n, a.shape.S) for m in models):
            raise PtplanError("StageChoice: the models must split the same layers into the same number of stages")
        self.models = tuple(models)
        self.limit = float(limit) * (1 + 1e-12)  # ``split_stages``' tolerance
        self.start, self.n, self.shape = a.start, a.n, a.shape
        self.cum_time_lb = _cum_min([m.cum_time_lb for m in models])
        """Prefix sums of each layer's least busy-time lower bound over the models."""
        self.cum_state = _cum_min([m.cum_state for m in models])
        """Prefix sums of each layer's least memory lower bound over the models."""
        self._k0 = len(a.prepare(np.array([a.start]), np.array([a.n])))
        self._last: tuple[tuple, tuple[np.ndarray, tuple[int, ...]]] | None = None
        """How many arrays one model's prepared terms are."""

    @cached_property
    def position_state(self) -> np.ndarray:
        """``StageModel.position_state`` of a stage that takes any model: each layer's least bytes over them."""
        return _cum_min([m.position_state for m in self.models])

    def _pick(self, got: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(time, peak, model index) per stage from each model's (time, peak): the fastest model that fits (the
        first of equals), else the smallest peak (the first of equals)."""
        every = np.array(np.broadcast_arrays(*(x for tm in got for x in tm)), dtype=float)
        T, P = every[0::2], every[1::2]
        fit = np.where(P <= self.limit, T, np.inf)
        i = np.argmin(fit, axis=0)
        i = np.where(np.isfinite(np.take_along_axis(fit, i[None], 0)[0]), i, np.argmin(P, axis=0))
        return np.take_along_axis(T, i[None], 0)[0], np.take_along_axis(P, i[None], 0)[0], i.astype(np.int64)

    # ---- the partitioner's protocol (``partition._StageFamily``) ------------------------------
    def prepare(self, I: Any, J: np.ndarray) -> tuple[np.ndarray, ...]:
        """The first model's prepared terms when it fits every candidate stage at every position
        (``StageModel.peak_upper``: then it is every stage's choice, being never slower), else every model's:
        one flat tuple of arrays of the band's shape either way (the partitioner may slice each of them)."""
        memo: dict = {}
        t0 = self.models[0].prepare(I, J, memo)
        if len(self.models) == 1 or bool(np.all(self.models[0].peak_upper(t0) <= self.limit)):
            return t0
        return t0 + tuple(x for m in self.models[1:] for x in m.prepare(I, J, memo))

    def _split(self, terms: tuple[np.ndarray, ...]) -> list[tuple[np.ndarray, ...]]:
        k = len(terms) // len(self.models)
        return [tuple(terms[i * k:(i + 1) * k]) for i in range(len(self.models))]

    def _each(self, terms: tuple[np.ndarray, ...], run: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(time, peak, model) per stage: the first model's where only its terms were prepared or where it
        fits every stage asked for, else ``_pick`` over every model's (``run(model, its terms)``)."""
        parts = self._split(terms) if len(terms) > self._k0 else [terms]
        t0, m0 = run(self.models[0], parts[0])
        if len(parts) == 1 or bool(np.all(np.asarray(m0) <= self.limit)):
            return np.asarray(t0, dtype=float), np.asarray(m0, dtype=float), np.zeros(np.shape(m0), dtype=np.int64)
        return self._pick([(t0, m0), *(run(m, x) for m, x in zip(self.models[1:], parts[1:]))])

    def evaluate(self, s: int, terms: tuple[np.ndarray, ...], cols: slice = slice(None)
                 ) -> tuple[np.ndarray, np.ndarray]:
        t, mem, _ = self._each(terms, lambda m, x: m.evaluate(s, x, cols))
        return t, mem

    def evaluate_split(self, terms: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
        t, mem, _ = self._each(terms, lambda m, x: m.evaluate_split(x))
        return t, mem

    # ---- one split -------------------------------------------------------------------------
    def choose(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """The model (index into ``models``) each stage of a split takes."""
        return self._chosen(ranges)[1]

    def peaks(self, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
        """``StageModel.peaks``: each stage's peak bytes under the model it takes."""
        return self._chosen(ranges)[0]

    def _chosen(self, ranges: Sequence[tuple[int, int]]) -> tuple[np.ndarray, tuple[int, ...]]:
        """(peaks, picks) of a split: as ``fix`` set them, else the fastest busy time that fits; the last split's
        kept (a split is scored, then costed, then described)."""
        key = tuple(map(tuple, ranges))
        if self._last is None or self._last[0] != key:
            lo, hi = self.models[0].check_ranges(ranges)
            _, mem, idx = self._each(self.prepare(lo, hi), lambda m, x: m.evaluate_split(x))
            self._last = (key, (mem, tuple(int(i) for i in idx)))
        return self._last[1]

    def fix(self, ranges: Sequence[tuple[int, int]], picks: Sequence[int]) -> None:
        """Each stage of this split takes the model ``picks`` gives it (the search's choice by the simulated
        iteration, ``assign.best_assignments``) until another split is asked for."""
        lo, hi = self.models[0].check_ranges(ranges)
        _, peaks = self.each(lo, hi)
        picks = tuple(int(i) for i in picks)
        self._last = (tuple(map(tuple, ranges)), (peaks[list(picks), 0, np.arange(len(picks))], picks))

    def each(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(busy time, peak) of every model on the stages of many splits (rows of lo, hi): (P, N, S) each."""
        lo, hi = np.atleast_2d(lo), np.atleast_2d(hi)
        memo: dict = {}
        got = [m.evaluate_split(m.prepare(lo, hi, memo)) for m in self.models]
        return (np.array([np.broadcast_to(t, lo.shape) for t, _ in got], dtype=float),
                np.array([np.broadcast_to(p, lo.shape) for _, p in got], dtype=float))

    def fastest(self, busy: np.ndarray, peak: np.ndarray) -> np.ndarray:
        """(N, S): each stage's fastest model by busy time that fits (``each``' arrays), else its smallest peak."""
        return self._pick(list(zip(busy, peak)))[2]

    def stage_strategies(self, ranges: Sequence[tuple[int, int]]) -> tuple[Strategy, ...]:
        picks = self.choose(ranges)
        each = {i: self.models[i].stage_strategies(ranges) for i in set(picks)}
        return tuple(each[i][s] for s, i in enumerate(picks))

    def stage_times(self, lo: np.ndarray, hi: np.ndarray, *, fill: bool = False) -> StageTimes:
        """``stage.stage_times`` of many splits at once (rows of lo, hi): each stage's from the model it takes."""
        _, _, idx = self._each(self.prepare(lo, hi), lambda m, x: m.evaluate_split(x))
        out: StageTimes | None = None
        for i in np.unique(idx).tolist():
            x = stage_times(self.models[i], lo, hi, fill=fill)
            out = x if out is None else StageTimes(*(np.where(idx == i, a, b) for a, b in zip(x, out)))
        assert out is not None
        return out

    def stage_costs(self, ranges: Sequence[tuple[int, int]], *, fill: bool = False) -> list[StageCost]:
        picks = self.choose(ranges)
        each = {i: self.models[i].stage_costs(ranges, fill=fill) for i in set(picks)}
        return [each[i][s] for s, i in enumerate(picks)]

    def stage_memory(self, ranges: Sequence[tuple[int, int]]) -> tuple[MemoryBreakdown, ...]:
        picks = self.choose(ranges)
        each = {i: self.models[i].stage_memory(ranges) for i in set(picks)}
        return tuple(each[i][s] for s, i in enumerate(picks))


def _cum_min(cums: Sequence[np.ndarray]) -> np.ndarray:
    """Prefix sums (along the last axis) of the per-layer minimum of several prefix-sum arrays' increments."""
    inc = np.min([np.diff(c, axis=-1) for c in cums], axis=0)
    return np.concatenate((np.zeros(inc.shape[:-1] + (1,)), np.cumsum(inc, axis=-1)), axis=-1)
