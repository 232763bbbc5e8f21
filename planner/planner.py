"""Plan assembly: for every frozen-block count choose K, M, partition and D, predict, add the baseline.

Legend: L blocks, f frozen blocks, n flat layers, K pipeline length, D = world/K data-parallel
width, M micro-batches per pipeline, b micro-batch size, B global batch.

How one phase is chosen (all from measured costs, no constants from the paper):
1. for every K that divides the world size and is at most the number of active layers (or the
   pinned K), D = world/K and the per-pipeline batch follows from the batch policy;
2. for every valid M (divides the per-pipeline batch; M >= K for 1F1B; at most ``max_m_factor``*K)
   the optimal partition at that M's micro-batch size is computed (AutoPipe), and the iteration is
   estimated in closed form — steady state (M-1)*slowest stage + one pass through all stages +
   the slowest exposed all-reduce — and checked against memory;
3. the best few (K, M) by estimate are simulated exactly with the discrete-event simulator (the
   schedule as data); the fastest that fits in memory wins.
Predicted totals do not include transition time (the executor measures it; see ``ptplan compare``).

Terms added after comparing predictions with real runs (``bench/calibrate.py``, ``ptplan compare``):
- **optimizer step**: each stage's AdamW step (the profile's per-layer ``optimizer_s``) runs after
  its all-reduce and before the iteration ends; it was missing from every prediction (2-4 % of a
  CPU step of bert-small, more with few micro-batches per step).
- **framework overheads** (the cluster's ``action_overhead_s`` and ``step_overhead_s``, measured by
  ``bench/overhead_bench.py``): the pipelining schedule's own work lengthens every forward and
  backward of a K > 1 pipeline; a fixed cost is paid once per step.
- **concurrency** (the cluster's ``concurrency_slowdown``, measured by ``bench/overhead_bench.py``):
  on a CPU "cluster" the processes share caches and memory bandwidth, and a synchronous step waits
  for the slowest; every compute time of a multi-process cpu:N plan is scaled by it (1 on GPUs).
  Two-process runs were 10-20 % slower than predicted before; one-process runs were not.
- **gradient all-reduce**: the cpu preset's link is what the runtime's flatten + all-reduce + copy
  back reaches (0.52 GB/s), not the estimate it had (2.5 GB/s): the runs' ``allreduce_seconds``
  were 2-5x the prediction.
- **receive buffers**: torch.distributed.pipelining keeps one activation buffer per micro-batch on
  every stage but the first and one gradient buffer per micro-batch on every stage but the last, for
  the whole phase (``executor/memory.py`` found them: M x boundary bytes each), so a stage's fixed
  memory grows with M.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from .cluster import Cluster
from .costs import CostTable
from .errors import InfeasibleError, PtplanError
from .freeze import FreezePolicy, trajectory
from .partition import optimal_partition
from .plan import (BATCH_POLICIES, SCHEDULES, Baseline, Phase, Plan, Prediction, TimelineEvent,
                   TrajectoryPoint)
from .profile import Profile
from .replicate import layout
from .schedule import build_schedule
from .simulate import StageCost, simulate

GiB = 1024 ** 3
MAX_TIMELINE_EVENTS = 6000
"""Timelines with more events than this are not stored in the plan (the report says so)."""


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """What the user trains: epochs, data, batch, schedule and planner knobs."""

    epochs: int
    """Number of epochs; one freeze decision per epoch."""
    samples_per_epoch: int
    """Training samples per epoch (the last partial global batch is dropped)."""
    batch: int
    """Global batch B under ``constant-global``; per-pipeline batch under ``constant-pipeline``."""
    batch_policy: str = "constant-global"
    """``constant-global`` (same optimisation as the baseline) or ``constant-pipeline`` (the paper's)."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``gpipe`` or ``1f1b``."""
    optimizer: str = "adamw"
    """Recorded for the executor; optimizer-state bytes come from the profile."""
    pin_K: int | None = None
    """Use this pipeline length in every phase (when it fits), instead of searching."""
    pin_M: int | None = None
    """Use this micro-batch count in every phase, instead of searching."""
    start_K: int | None = None
    """Start from this pipeline length (the paper starts with one pipeline per node) and only compress:
    the no-freeze phase and the baseline use it, later phases choose any K <= start_K."""
    cache: str = "off"
    """AutoCache: ``off``, ``on`` (whenever something is frozen) or ``auto`` (when it pays)."""
    memory_fraction: float = 0.9
    """Share of each GPU's memory the plan may fill (the rest: framework context, allocator slack)."""
    max_m_factor: int = 8
    """Search M up to this many times K (the paper searched K..6K)."""
    host_read_bandwidth: float = 10e9
    """Bytes/s for reading cached prefix outputs from host memory onto the device (AutoCache)."""

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise PtplanError(f"epochs must be at least 1, got {self.epochs}")
        if self.samples_per_epoch < 1:
            raise PtplanError(f"samples per epoch must be at least 1, got {self.samples_per_epoch}")
        if self.batch < 1:
            raise PtplanError(f"batch must be at least 1, got {self.batch}")
        if self.batch_policy not in BATCH_POLICIES:
            raise PtplanError(f"unknown batch policy {self.batch_policy!r}; use one of {', '.join(BATCH_POLICIES)}")
        if self.schedule not in SCHEDULES:
            raise PtplanError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if self.cache not in ("off", "on", "auto"):
            raise PtplanError(f"unknown cache mode {self.cache!r}; use off, on or auto")
        if not 0 < self.memory_fraction <= 1:
            raise PtplanError(f"memory fraction must be in (0, 1], got {self.memory_fraction}")
        if self.pin_K is not None and self.pin_K < 1:
            raise PtplanError(f"pinned K must be at least 1, got {self.pin_K}")
        if self.start_K is not None and self.start_K < 1:
            raise PtplanError(f"start K must be at least 1, got {self.start_K}")
        if self.start_K is not None and self.pin_K is not None:
            raise PtplanError("give either a pinned K (--pipeline-length) or a start K (--start-K), not both")
        if self.pin_M is not None and self.pin_M < 1:
            raise PtplanError(f"pinned M must be at least 1, got {self.pin_M}")


@dataclass
class _Candidate:
    K: int
    D: int
    M: int
    b: int
    ranges: tuple[tuple[int, int], ...]
    estimate_s: float
    est_peak: float
    cache: bool


@dataclass
class _KInfo:
    """Per pipeline length: rank layout and per-stage link / all-reduce coefficients."""

    ranks: tuple[tuple[int, ...], ...]
    link_lat: np.ndarray
    """Latency of the link from stage s to s+1 (K-1 entries)."""
    link_bw: np.ndarray
    ar_lat: np.ndarray
    """All-reduce seconds of stage s's data-parallel group = ar_lat[s] + bytes * ar_per_byte[s]."""
    ar_per_byte: np.ndarray


def _divisors(x: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(x)) + 1) if x % d == 0]
    return sorted(set(small + [x // d for d in small]))


class _PhasePlanner:
    """Evaluates (K, M) candidates for one profile + cluster + training config."""

    def __init__(self, profile: Profile, cluster: Cluster, cfg: TrainingConfig) -> None:
        self.p, self.c, self.cfg = profile, cluster, cfg
        self.t = CostTable(profile, time_scale=cluster.concurrency_slowdown)
        self.n = profile.num_layers
        self.world = cluster.world_size
        self.limit = cluster.gpu_memory_bytes * cfg.memory_fraction
        self._k: dict[int, _KInfo] = {}
        self._schedules: dict[tuple, Any] = {}
        t = self.t
        self.cum_state = np.concatenate([[0.0], np.cumsum(t.train_state_bytes)])
        self.cum_grad = np.concatenate([[0.0], np.cumsum(t.grad_bytes)])
        self.cum_saved = np.concatenate([[0.0], np.cumsum(t.saved_per_sample)])
        self.cum_param = np.concatenate([[0.0], np.cumsum(t.param_bytes)])
        self.cum_opt = np.concatenate([[0.0], np.cumsum(t.optimizer_s)])

    # -- batch policy -------------------------------------------------------------------------
    def pipeline_batch(self, D: int) -> int | None:
        if self.cfg.batch_policy == "constant-global":
            return self.cfg.batch // D if self.cfg.batch % D == 0 else None
        return self.cfg.batch

    def m_candidates(self, K: int, bp: int) -> list[int]:
        if self.cfg.pin_M is not None:
            ms = [self.cfg.pin_M] if bp % self.cfg.pin_M == 0 else []
        else:
            ms = [m for m in _divisors(bp) if m <= max(self.cfg.max_m_factor * K, 1)]
        if self.cfg.schedule == "1f1b":
            ms = [m for m in ms if m >= K]
        return ms

    def kinfo(self, K: int) -> _KInfo:
        """Layout and communication coefficients for pipeline length K (cached per plan).

        Stage groups all-reduce at about the same time at the end of an iteration, so each is
        costed as one of K concurrent groups sharing the nodes' inter-node links.
        """
        if K not in self._k:
            c = self.c
            ranks = layout(c, K)
            row = ranks[0]
            links = [c.link(row[s], row[s + 1]) for s in range(K - 1)]
            D = len(ranks)
            lat, per = [], []
            for s in range(K):
                group = [ranks[p][s] for p in range(D)]
                a = c.allreduce_seconds(group, 0.0, concurrent=K)
                lat.append(a)
                per.append((c.allreduce_seconds(group, 1e9, concurrent=K) - a) / 1e9)
            self._k[K] = _KInfo(ranks=ranks, link_lat=np.array([x[1] for x in links]),
                                link_bw=np.array([x[0] for x in links]), ar_lat=np.array(lat),
                                ar_per_byte=np.array(per))
        return self._k[K]

    def inflight(self, K: int, M: int) -> np.ndarray:
        s = np.arange(K)
        return np.minimum(K - s, M) if self.cfg.schedule == "1f1b" else np.full(K, M)

    # -- costs ----------------------------------------------------------------------------------
    def _use_cache(self, n0: int, b: int) -> bool:
        if n0 == 0 or self.cfg.cache == "off":
            return False
        if self.cfg.cache == "on":
            return True
        read = self.t.out_per_sample[n0 - 1] * b / self.cfg.host_read_bandwidth
        return read < self.t.prefix_nograd_s(n0, b)

    def _prefix_s(self, n0: int, b: int, use_cache: bool) -> float:
        if n0 == 0:
            return 0.0
        if use_cache:
            return float(self.t.out_per_sample[n0 - 1] * b / self.cfg.host_read_bandwidth)
        return self.t.prefix_nograd_s(n0, b)

    def partition(self, n0: int, K: int, M: int, b: int) -> tuple[tuple[int, int], ...] | None:
        """AutoPipe: the optimal partition of the active layers at micro-batch size b."""
        t = self.t
        fwd, bwd, _ = t.at(b)
        active = slice(n0, self.n)
        layer_s = (fwd + bwd)[active]
        boundary = None
        if K > 1:  # forward activation out of layer i plus its gradient back, over the pipeline link
            ki = self.kinfo(K)
            boundary = 2 * (ki.link_lat.max() + t.out_per_sample[active] * b / ki.link_bw.min())
        prefix_s = self._prefix_s(n0, b, self._use_cache(n0, b))
        worst = int(self.inflight(K, M).max())
        mem = (t.train_state_bytes + t.saved_per_sample * b * worst + t.out_per_sample * b * 2)[active]
        try:
            part = optimal_partition(layer_s, K, boundary_s=boundary, stage0_extra_s=prefix_s, memory=mem,
                                     stage0_extra_memory=float(self.cum_param[n0]), memory_limit=self.limit)
        except InfeasibleError:
            try:  # the conservative memory bound failed; the exact per-stage check decides
                part = optimal_partition(layer_s, K, boundary_s=boundary, stage0_extra_s=prefix_s)
            except InfeasibleError:
                return None
        return tuple((lo + n0, hi + n0) for lo, hi in part.ranges)

    def estimate(self, n0: int, K: int, M: int, b: int, ranges) -> tuple[float, float, bool]:
        """(closed-form iteration seconds, peak bytes on the fullest GPU, cache on) for one candidate."""
        t, ki = self.t, self.kinfo(K)
        fwd, bwd, _ = t.at(b)
        lo = np.fromiter((r[0] for r in ranges), dtype=np.int64, count=K)
        hi = np.fromiter((r[1] for r in ranges), dtype=np.int64, count=K)
        cf = np.concatenate([[0.0], np.cumsum(fwd + bwd)])
        use_cache = self._use_cache(n0, b)
        per_mb = cf[hi] - cf[lo]
        per_mb[0] += self._prefix_s(n0, b, use_cache)
        comm = 0.0
        if K > 1:
            out = t.out_per_sample[hi[:-1] - 1] * b
            comm = float(2 * (ki.link_lat + out / ki.link_bw).sum())
        if K > 1:
            per_mb += 2 * self.c.action_overhead_s
        ar = ki.ar_lat + (self.cum_grad[hi] - self.cum_grad[lo]) * ki.ar_per_byte if len(ki.ranks) > 1 else np.zeros(K)
        opt = self.cum_opt[hi] - self.cum_opt[lo]
        est = float(per_mb.sum() + (M - 1) * per_mb.max() + comm + (ar + opt).max() + self.c.step_overhead_s)
        peak = (self.cum_state[hi] - self.cum_state[lo] + self.inflight(K, M) * (self.cum_saved[hi] - self.cum_saved[lo]) * b
                + 2 * t.out_per_sample[hi - 1] * b + self._recv_buffers(K, M, b, lo, hi))
        peak[0] += self.cum_param[n0]
        return est, float(peak.max()), use_cache

    def _recv_buffers(self, K: int, M: int, b: int, lo, hi):
        """Receive buffers per stage: torch.distributed.pipelining keeps, for the whole phase, one
        activation buffer per micro-batch on every stage but the first and one gradient buffer per
        micro-batch on every stage but the last (measured: ``executor/memory.py``'s ``buffers``)."""
        if K == 1:
            return np.zeros(np.shape(lo))
        out = self.t.out_per_sample
        s = np.arange(K)
        lo, hi = np.asarray(lo), np.asarray(hi)
        return M * b * (np.where(s > 0, out[lo - 1], 0.0) + np.where(s < K - 1, out[hi - 1], 0.0))

    def stage_costs(self, n0: int, K: int, M: int, b: int, ranges, use_cache: bool) -> list[StageCost]:
        """The simulator's per-stage costs for one candidate."""
        t, ki = self.t, self.kinfo(K)
        fwd, bwd, _ = t.at(b)
        D = len(ki.ranks)
        prefix_s = self._prefix_s(n0, b, use_cache)
        ovh = self.c.action_overhead_s if K > 1 else 0.0
        buffers = self._recv_buffers(K, M, b, [r[0] for r in ranges], [r[1] for r in ranges])
        out = []
        for s, (lo, hi) in enumerate(ranges):
            send_f = ki.link_lat[s] + t.out_per_sample[hi - 1] * b / ki.link_bw[s] if s < K - 1 else 0.0
            send_b = ki.link_lat[s - 1] + t.out_per_sample[lo - 1] * b / ki.link_bw[s - 1] if s > 0 else 0.0
            ar = ki.ar_lat[s] + (self.cum_grad[hi] - self.cum_grad[lo]) * ki.ar_per_byte[s] if D > 1 else 0.0
            fixed = self.cum_state[hi] - self.cum_state[lo] + (self.cum_param[n0] if s == 0 else 0.0) + buffers[s]
            out.append(StageCost(
                forward_s=float(fwd[lo:hi].sum()) + ovh, backward_s=float(bwd[lo:hi].sum()) + ovh,
                prefix_s=prefix_s if s == 0 else 0.0, send_forward_s=float(send_f), send_backward_s=float(send_b),
                allreduce_s=float(ar), optimizer_s=float(t.optimizer_s[lo:hi].sum()), fixed_bytes=int(fixed),
                activation_bytes_per_mb=int((self.cum_saved[hi] - self.cum_saved[lo]) * b),
                output_bytes_per_mb=int(t.out_per_sample[hi - 1] * b)))
        return out

    def schedule(self, K: int, M: int):
        key = (self.cfg.schedule, K, M)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(self.cfg.schedule, K, M)
        return self._schedules[key]

    # -- one phase ----------------------------------------------------------------------------
    def k_candidates(self, f: int, n_active: int, free: bool) -> list[int]:
        """Pipeline lengths to try: the pinned one, start_K for the no-freeze phase, else every divisor."""
        if self.cfg.pin_K is not None:
            return [self.cfg.pin_K]
        if self.cfg.start_K is not None and not free:
            if f == 0:
                return [self.cfg.start_K]
            return [k for k in _divisors(self.world) if k <= min(n_active, self.cfg.start_K)]
        return [k for k in _divisors(self.world) if k <= n_active]

    def phase(self, f: int, keep_timeline: bool, simulate_top: int = 3, free: bool = False) -> Phase:
        """The best configuration for f frozen blocks (``free``: ignore start_K)."""
        n0 = self.p.frozen_boundary(f)
        n_active = self.n - n0
        Ks = self.k_candidates(f, n_active, free)
        cands: list[_Candidate] = []
        reasons: list[str] = []
        for K in Ks:
            if self.world % K or K > n_active:
                reasons.append(f"K={K}: must divide the world size {self.world} and be at most the "
                               f"{n_active} active layers")
                continue
            D = self.world // K
            bp = self.pipeline_batch(D)
            if bp is None:
                reasons.append(f"K={K}: global batch {self.cfg.batch} does not split over D={D} pipelines")
                continue
            ms = self.m_candidates(K, bp)
            if not ms:
                need = f"M >= K={K} for 1F1B" if self.cfg.schedule == "1f1b" else "a divisor"
                reasons.append(f"K={K}: per-pipeline batch {bp} has no valid micro-batch count ({need})")
                continue
            # one partition per K at a middle M; every M is then estimated on it (costs scale with b)
            m_ref = ms[len(ms) // 2]
            ranges = self.partition(n0, K, m_ref, bp // m_ref)
            if ranges is None:
                reasons.append(f"K={K}: no partition of the {n_active} active layers fits")
                continue
            best_k = None
            for M in ms:
                est, peak, cache = self.estimate(n0, K, M, bp // M, ranges)
                if peak > self.limit:
                    reasons.append(f"K={K}, M={M}: needs {peak / GiB:.2f} GiB on the fullest GPU")
                    continue
                cand = _Candidate(K=K, D=D, M=M, b=bp // M, ranges=ranges, estimate_s=est, est_peak=peak,
                                  cache=cache)
                if best_k is None or est / (D * M * cand.b) < best_k.estimate_s / (D * best_k.M * best_k.b):
                    best_k = cand
            if best_k is not None:
                cands.append(best_k)
        if not cands:
            raise self._infeasible(f, n0, reasons)
        cands.sort(key=lambda x: (x.estimate_s / (x.D * x.M * x.b), x.K, x.M))
        best = None
        for cand in cands[:simulate_top]:
            ranges = self.partition(n0, cand.K, cand.M, cand.b) or cand.ranges
            costs = self.stage_costs(n0, cand.K, cand.M, cand.b, ranges, cand.cache)
            sim = simulate(self.schedule(cand.K, cand.M), costs, step_overhead_s=self.c.step_overhead_s)
            if max(sim.stage_peak_memory_bytes) > self.limit:
                reasons.append(f"K={cand.K}, M={cand.M}: simulated peak {max(sim.stage_peak_memory_bytes) / GiB:.2f} "
                               f"GiB exceeds the limit")
                continue
            key = sim.iteration_s / (cand.D * cand.M * cand.b)
            if best is None or key < best[0]:
                best = (key, cand, ranges, costs, sim)
        if best is None:
            raise self._infeasible(f, n0, reasons)
        _, cand, ranges, costs, sim = best
        return self._to_phase(f, n0, cand, ranges, costs, sim, keep_timeline)

    def _to_phase(self, f, n0, cand: _Candidate, ranges, costs, sim, keep_timeline: bool) -> Phase:
        timeline: tuple[TimelineEvent, ...] = ()
        if keep_timeline and cand.K * cand.M * 6 <= MAX_TIMELINE_EVENTS:
            timeline = tuple(simulate(self.schedule(cand.K, cand.M), costs, events=True,
                                      step_overhead_s=self.c.step_overhead_s).events)
        B = cand.D * cand.M * cand.b
        pred = Prediction(
            iteration_s=sim.iteration_s, samples_per_s=B / sim.iteration_s if sim.iteration_s > 0 else 0.0,
            bubble_fraction=min(max(sim.bubble_fraction, 0.0), 1.0), allreduce_s=sim.allreduce_s,
            stage_compute_s=tuple(cand.M * (sc.forward_s + sc.backward_s + sc.prefix_s) for sc in costs),
            stage_peak_memory_bytes=tuple(int(x) for x in sim.stage_peak_memory_bytes),
            cache_host_bytes=self._cache_bytes(n0) if cand.cache else 0)
        return Phase(frozen_blocks=f, frozen_layers=n0, K=cand.K, D=cand.D, M=cand.M, micro_batch_size=cand.b,
                     schedule=self.cfg.schedule, partition=ranges, cache=cand.cache, ranks=self.kinfo(cand.K).ranks,
                     predicted=pred, timeline=timeline)

    def _cache_bytes(self, n0: int) -> int:
        """Host bytes of the AutoCache: every node caches the prefix output of every sample."""
        return int(self.cfg.samples_per_epoch * self.t.out_per_sample[n0 - 1] * self.c.nodes)

    def _infeasible(self, f: int, n0: int, reasons: list[str]) -> InfeasibleError:
        shown = "\n  ".join(reasons[:8]) + (f"\n  (+{len(reasons) - 8} more)" if len(reasons) > 8 else "")
        prefix = (f" The frozen prefix alone holds {self.cum_param[n0] / GiB:.2f} GiB of weights on stage 0."
                  if n0 else "")
        return InfeasibleError(
            f"no pipeline configuration fits with {f} frozen blocks on {self.c.name} "
            f"({self.world} GPUs x {self.c.gpu_memory_bytes / GiB:.1f} GiB, {self.cfg.memory_fraction:.0%} usable):\n  "
            f"{shown}\n{prefix}Fix: use a cluster with more or larger GPUs, a smaller batch, a batch divisible by more "
            f"data-parallel widths, or pin a different --pipeline-length / --micro-batches.")


def make_plan(profile: Profile, cluster: Cluster, training: TrainingConfig, freeze: FreezePolicy,
              *, profile_path: str | None = None, progress: Any = None) -> Plan:
    """Compute the full plan: a phase per reachable frozen count, the trajectory, totals, baseline."""
    L = profile.num_blocks
    traj = trajectory(freeze, L, training.epochs)
    pp = _PhasePlanner(profile, cluster, training)
    on_traj = set(traj)
    phases: list[Phase] = []
    counts = list(range(L + 1))
    for f in counts:
        try:
            phases.append(pp.phase(f, keep_timeline=f in on_traj))
        except InfeasibleError:
            if f == 0 or f in on_traj:
                raise
            # unreachable by the planned trajectory and infeasible: leave it out (adaptive runs that
            # reach it get a clear error from Plan.phase_for)
        if progress is not None:
            progress(f + 1, len(counts))
    index = {ph.frozen_blocks: i for i, ph in enumerate(phases)}
    points: list[TrajectoryPoint] = []
    total_s = total_samples = 0.0
    for e, f in enumerate(traj):
        ph = phases[index[f]]
        iters = training.samples_per_epoch // ph.global_batch
        if iters < 1:
            raise PtplanError(f"an epoch of {training.samples_per_epoch} samples holds no full global batch of "
                              f"{ph.global_batch} (phase with {f} frozen blocks); raise --samples-per-epoch or lower --batch")
        secs = iters * ph.predicted.iteration_s
        points.append(TrajectoryPoint(epoch=e, frozen_blocks=f, phase=index[f], iterations=iters, seconds=secs))
        total_s += secs
        total_samples += iters * ph.global_batch
    def static_seconds(ph: Phase) -> float:
        return training.epochs * (training.samples_per_epoch // ph.global_batch) * ph.predicted.iteration_s

    base_phase = phases[index[0]]
    base_s = static_seconds(base_phase)
    best_static = pp.phase(0, keep_timeline=False, free=True) if training.start_K is not None else base_phase
    best_static_s = static_seconds(best_static)
    inputs = {
        "profile": {**profile.identity(), **({"path": profile_path} if profile_path else {})},
        "cluster": cluster.to_json(),
        "training": asdict(training),
        "freeze": freeze.to_json() if hasattr(freeze, "to_json") else asdict(freeze),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    totals = {"seconds": total_s, "samples": total_samples, "baseline_seconds": base_s,
              "speedup": base_s / total_s if total_s > 0 else 0.0,
              "best_static_seconds": best_static_s, "best_static_K": best_static.K, "best_static_M": best_static.M,
              "speedup_vs_best_static": best_static_s / total_s if total_s > 0 else 0.0}
    return Plan(inputs=json.loads(json.dumps(inputs)), phases=tuple(phases), trajectory=tuple(points), totals=totals,
                baseline=Baseline(phase=base_phase, seconds=base_s))
