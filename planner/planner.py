"""Plan assembly: a phase per frozen-block count, the freeze steps, the trajectory with AutoCache fills,
totals against the baselines, and the warnings a user must see.

Legend: L blocks, f frozen blocks, n0 frozen flat layers, K pipeline length, D data-parallel
width, M micro-batches, b micro-batch size, B global batch, N samples per epoch, T freeze step.

``make_plan`` is the whole pipeline, each step a pure function:

1. ``freeze_table``: the frozen count at every freeze step T (per epoch, or every N optimizer steps).
2. ``visits``: how many samples each count is expected to train on, for weighing the AutoCache's
   fill against what it saves.
3. ``trajectory_phases``: the counts the trajectory visits, searched (``search.py``) with the
   AutoCache decided jointly: a cached phase's fill refreshes from the outputs the previous cached
   phase left behind, so caching a short phase can pay for itself later. A dynamic program over
   "which count was cached last" picks cache on/off per visited count to minimise the predicted
   time (with more than ``CACHE_DP_MAX`` visited counts the states are the last visited count or
   none). Then every other count 0..L is searched alone, for runs that leave the trajectory
   (adaptive freezing); counts it never reaches that fit nowhere are left out, and a run that
   reaches one anyway stops with a clear message.
4. ``walk``: the exact trajectory as runs of steps (epoch, first step, count, iterations, of which
   fill iterations), each run priced from its phase's simulated iterations.
5. totals, the baselines (no freezing: the no-freeze phase for every epoch, and with --start-K or
   pins also the best static configuration), and warnings.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import replace
from typing import Any, Callable

import numpy as np

from .cluster import Cluster
from .config import TrainingConfig
from .errors import InfeasibleError, PtplanError
from .freeze import FreezePolicy, freeze_table
from .plan import (Baseline, Phase, Plan, PlanInputs, PlanWarning, Prediction, ProfileRef, TimelineEvent, Totals,
                   TrajectoryPoint)
from .profile import Profile, profile_from_json
from .schedule import splits_backward
from .search import Choice, PhaseSearch, Visit
from .simulate import simulate
from .stage import Links

__all__ = ["TrainingConfig", "make_plan", "phase_from_choice"]

MAX_TIMELINE_EVENTS = 20_000
"""Timelines with more events than this are not stored in the plan (the report says so); the report
merges long ones into blocks (``viz.timeline_figure``)."""
CACHE_DP_MAX = 16
"""Visited counts up to which the AutoCache decision considers every earlier cached count."""
MAX_FREEZE_STEPS = 1_000_000
"""A freeze-step table longer than this means a cadence of a few steps over a very long run whose
count never settles; refuse it rather than store it."""


def _checked_profile(profile: Profile) -> Profile:
    """The profile through its reader, so numbers given through the Python API meet the file's bounds."""
    return profile_from_json(json.loads(json.dumps(profile.to_json())), source=f"profile {profile.model.name}")


def _last_freeze_step(training: TrainingConfig, freeze: FreezePolicy, world: int) -> int:
    """The largest freeze step T a run of this plan can reach."""
    if freeze.every == "epoch":
        return training.epochs - 1
    smallest_B = training.batch if training.batch_policy == "constant-global" else training.batch
    steps = training.epochs * (training.samples_per_epoch // smallest_B)
    return max(0, (steps - 1) // int(freeze.every))


def visits(table: list[int], training: TrainingConfig, freeze: FreezePolicy, world: int) -> dict[int, float]:
    """Samples each frozen count is expected to train on (before the phases fix the global batch;
    constant-pipeline guesses B from the per-pipeline batch and one pipeline per GPU)."""
    N, E = training.samples_per_epoch, training.epochs
    out: dict[int, float] = {}
    if freeze.every == "epoch":
        for e in range(E):
            f = table[min(e, len(table) - 1)]
            out[f] = out.get(f, 0.0) + N
        return out
    B = training.batch if training.batch_policy == "constant-global" else training.batch * world
    steps = E * max(N // B, 1)
    every = int(freeze.every)
    for T in range(len(table)):
        lo, hi = T * every, steps if T == len(table) - 1 else min(steps, (T + 1) * every)
        if hi > lo:
            out[table[T]] = out.get(table[T], 0.0) + (hi - lo) * B
    return out


def walk(phases: list[Phase], index: dict[int, int], table: list[int], training: TrainingConfig,
         freeze: FreezePolicy) -> list[TrajectoryPoint]:
    """The predicted run as runs of optimizer steps at one frozen count (see the module docstring)."""
    N = training.samples_per_epoch
    points: list[TrajectoryPoint] = []
    fill_left: dict[int, int] = {}
    step = 0
    # per freeze step T, the first later freeze step whose count differs (None: the count never changes
    # again), so a run of steps is cut only where the frozen count changes, not at every freeze step
    change_at: list[int | None] = [None] * len(table)
    for T in range(len(table) - 2, -1, -1):
        change_at[T] = T + 1 if table[T + 1] != table[T] else change_at[T + 1]
    for e in range(training.epochs):
        cursor = 0
        while True:
            T = e if freeze.every == "epoch" else step // int(freeze.every)
            f = table[min(T, len(table) - 1)]
            if f not in index:
                raise InfeasibleError(f"the trajectory reaches {f} frozen blocks at epoch {e}, but no configuration "
                                      f"fits there")
            ph = phases[index[f]]
            B = ph.global_batch
            if cursor + B > N:
                if cursor == 0:
                    raise PtplanError(f"an epoch of {N:,} samples holds no full global batch of {B:,} (phase with "
                                      f"{f} frozen blocks); raise --samples-per-epoch or lower --batch")
                break
            run = (N - cursor) // B
            if freeze.every != "epoch":
                nxt = change_at[min(T, len(table) - 1)]
                if nxt is not None:
                    run = min(run, nxt * int(freeze.every) - step)
            if ph.cache and f not in fill_left:
                fill_left[f] = N // B  # one pass over the data: every sample missed once
            fill = min(run, fill_left.get(f, 0))
            if fill:
                fill_left[f] -= fill
            secs = fill * ph.predicted.fill_iteration_s + (run - fill) * ph.predicted.iteration_s
            points.append(TrajectoryPoint(epoch=e, step=step, frozen_blocks=f, phase=index[f], iterations=run,
                                          fill_iterations=fill, seconds=secs))
            step += run
            cursor += run * B
    return points


def trajectory_phases(search: PhaseSearch, counts: list[int], samples: dict[int, float]) -> dict[int, Choice]:
    """The choice for every visited count, with the AutoCache decided by the dynamic program above."""
    mode = search.cfg.cache
    n0 = {f: search.p.frozen_boundary(f) for f in counts}
    # states: n0 of the last cached count (0 = none) -> (seconds so far, choices so far)
    states: dict[int, tuple[float, dict[int, Choice]]] = {0: (0.0, {})}
    for i, f in enumerate(counts):
        new: dict[int, tuple[float, dict[int, Choice]]] = {}

        def offer(state: int, secs: float, picks: dict[int, Choice]) -> None:
            if state not in new or secs < new[state][0]:
                new[state] = (secs, picks)

        plain: Choice | None = None
        err: InfeasibleError | None = None
        if mode != "on" or n0[f] == 0:
            try:
                plain = search.search(f, Visit(samples=samples[f]), cache=False)
            except InfeasibleError as e:
                err = e
        keep = states
        if len(counts) > CACHE_DP_MAX:  # bounded: none cached yet, or the previous visited count
            prev = n0[counts[i - 1]] if i else 0
            keep = {c: v for c, v in states.items() if c in (0, prev)} or states
        for c, (secs, picks) in keep.items():
            if plain is not None:
                offer(c, secs + plain.objective * samples[f], {**picks, f: plain})
            if mode != "off" and n0[f] > 0:
                try:
                    cached = search.search(f, Visit(samples=samples[f], fill_from=c), cache=True)
                except InfeasibleError as e:
                    err = err or e
                    continue
                offer(n0[f], secs + cached.objective * samples[f], {**picks, f: cached})
        if not new:
            assert err is not None
            raise err
        states = new
    return min(states.values(), key=lambda v: v[0])[1]


_RANKS: dict[tuple[int, int], tuple[Links, tuple[tuple[int, ...], ...]]] = {}
"""``_phase_ranks``' memo: (id of a Links, tp) -> (that Links, its rank table). The Links is kept so that an id
is never mistaken for a later object's; a few entries (one per pipeline shape), cleared when it grows."""


def _phase_ranks(links: Links, tp: int) -> tuple[tuple[int, ...], ...]:
    """A phase's rank table: ranks[p][s] of the links' layout, times tp (plain ints). Phases that share a
    pipeline shape share the same Links (``PhaseSearch.links`` memoises them), so the table (4,096 ranks on
    4,096 GPUs) is built once per shape instead of once per phase."""
    key = (id(links), tp)
    hit = _RANKS.get(key)
    if hit is not None and hit[0] is links:
        return hit[1]
    ranks = links.ranks
    if tp == 1 and type(ranks) is tuple and all(type(row) is tuple and all(type(r) is int for r in row)
                                                for row in ranks):
        table = ranks  # already plain ints (``replicate.layout``'s)
    else:
        table = tuple(map(tuple, (np.asarray(ranks, dtype=np.int64) * tp).tolist()))
    if len(_RANKS) >= 64:
        _RANKS.clear()
    _RANKS[key] = (links, table)
    return table


def phase_from_choice(search: PhaseSearch, f: int, ch: Choice, keep_timeline: bool) -> Phase:
    """The plan's Phase for a searched choice (its timeline when ``keep_timeline`` and short enough)."""
    c, sim = ch.cand, ch.sim
    n0 = search.p.frozen_boundary(f)
    timeline: tuple[TimelineEvent, ...] = ()
    if keep_timeline and c.S * c.M * 6 <= MAX_TIMELINE_EVENTS:
        timeline = simulate(search.schedule(c), ch.costs, events=True,
                            step_overhead_s=search.c.step_overhead_s).events
    totals = tuple(m.total for m in ch.memory)
    assert totals == sim.stage_peak_memory_bytes, "simulator and stage model disagree on memory"
    notes = list(ch.notes)
    lo_b, hi_b = search.t.measured_range
    if search.t.extrapolated(c.b):
        notes.append(f"micro-batch size {c.b} is outside the profile's measured {lo_b}..{hi_b}: its times are "
                     f"extrapolated")
    pred = Prediction(
        iteration_s=sim.iteration_s, samples_per_s=c.B / sim.iteration_s if sim.iteration_s > 0 else 0.0,
        bubble_fraction=min(max(sim.bubble_fraction, 0.0), 1.0), allreduce_s=sim.allreduce_s,
        stage_compute_s=tuple(sc.setup_s + c.M * (sc.forward_s + sc.backward_s + sc.prefix_s) for sc in ch.costs),
        stage_peak_memory_bytes=totals, stage_memory=ch.memory,
        rank_peak_memory_bytes=tuple(np.asarray(sim.rank_peak_memory_bytes, dtype=np.int64).tolist()),
        fill_iteration_s=ch.fill_sim.iteration_s if ch.fill_sim is not None else 0.0,
        cache_host_bytes_per_node=int(search.host_bytes_per_node(c, n0, 0)) if c.cache else 0,
        cache_setup_s=ch.costs[0].setup_s if c.cache else 0.0,
        fill_cache_setup_s=ch.fill_costs[0].setup_s if c.cache and ch.fill_costs else 0.0)
    assert ch.links is not None
    sched = search.schedule(c)
    return Phase(frozen_blocks=f, frozen_layers=n0, K=c.K, D=c.D, M=c.M, micro_batch_size=c.b,
                 schedule=c.schedule, partition=ch.ranges, cache=c.cache,
                 ranks=_phase_ranks(ch.links, c.tp),
                 predicted=pred, timeline=timeline, notes=tuple(notes), V=c.V,
                 actions=tuple(" ".join(map(str, acts)) for acts in sched.actions),
                 tp=c.tp, fsdp=tuple(st.fsdp for st in ch.strategies) or c.fsdp,
                 recompute=tuple(st.recompute for st in ch.strategies) or c.recompute,  # one value if all equal
                 recompute_layers=tuple(st.recompute_layers for st in ch.strategies), sp=c.sp)


GPU_MODELS = ("h200", "h100", "a100", "a10", "v100", "p100", "t4", "l40", "l4", "rtx 5000", "rtx 6000", "a6000",
              "mi300", "mi250")
"""GPU model names (lower case, longest match first where one contains another) that tell two devices apart."""


def _gpu_model(name: str) -> str | None:
    """The GPU model a device name names (``GPU_MODELS``), or None when it names none of them."""
    low = name.lower().replace("-", " ").replace("rtx5000", "rtx 5000")
    return next((m for m in sorted(GPU_MODELS, key=len, reverse=True) if m in low), None)


def device_mismatch(profile: Profile, cluster: Cluster) -> str | None:
    """Why a GPU profile does not describe the cluster's devices (a GPU profile on a CPU cluster, or another GPU
    model than the cluster's), or None. (A CPU profile on a GPU cluster has its own warning.)"""
    if profile.device.kind == "cpu" or profile.provenance.source == "synthetic":
        return None
    prof_gpu = _gpu_model(profile.device.name)
    if cluster.device_is_host:
        return (f"the profile was measured on {profile.device.name} (a GPU) but the cluster is {cluster.name} (CPU "
                f"processes): predicted seconds use the GPU's compute speed with the CPU cluster's links and memory; "
                f"profile on this machine (ptplan profile --device cpu) to plan CPU runs")
    clu_gpu = _gpu_model(cluster.gpu_name)
    if prof_gpu is not None and clu_gpu is not None and prof_gpu != clu_gpu:
        return (f"the profile was measured on {profile.device.name} but the cluster {cluster.name} has "
                f"{cluster.gpu_name}: predicted seconds use the profile's GPU speed with the cluster's links and "
                f"memory; use a profile of the cluster's GPU (or ptplan profile --project) for absolute numbers")
    return None


CACHE_TRAFFIC = {"read": "rows read", "write": "rows written", "weights": "frozen weights streamed"}
"""``HostIO``'s fields as the assumed-rates warning names them."""


def _warnings(profile: Profile, cluster: Cluster, training: TrainingConfig, search: PhaseSearch,
              phases: list[Phase], reached: set[int] | None = None) -> list[PlanWarning]:
    """The plan's warnings. ``reached``: the frozen counts a run visits (None: any, an adaptive freeze); a pinned
    K/M that did not fit is only worth a warning there."""
    out = []
    src = profile.provenance.source
    if src == "synthetic":
        out.append(PlanWarning(code="synthetic-profile", message=f"profile {profile.model.name} is synthetic "
                               f"(analytic numbers, not measured): the predictions are illustrations"))
    elif src == "projected":
        out.append(PlanWarning(code="projected-profile", message=f"profile {profile.model.name} was projected from "
                               f"the device model {profile.provenance.device_model!r}, not measured"))
    if profile.device.kind == "cpu" and not cluster.device_is_host and src != "synthetic":
        out.append(PlanWarning(code="cpu-profile-for-gpu-cluster", message=(
            f"the profile was measured on {profile.device.name} (a CPU) but the cluster is {cluster.name} "
            f"({cluster.gpu_name}): predicted seconds use the CPU's compute speed with the cluster's links and memory; "
            f"profile on the target GPU (ptplan profile --device cuda) for absolute numbers")))
    if (why := device_mismatch(profile, cluster)) is not None:
        out.append(PlanWarning(code="profile-device-differs", message=why))
    ext = [p for p in phases if search.t.extrapolated(p.micro_batch_size)]
    if ext:
        lo, hi = search.t.measured_range
        sizes = sorted({p.micro_batch_size for p in ext})
        out.append(PlanWarning(code="extrapolated-micro-batch", message=(
            f"{len(ext)} phase(s) use micro-batch sizes {sizes} outside the profile's measured {lo}..{hi} "
            f"(allowed by --allow-extrapolation): their times are extrapolated; profile those sizes "
            f"(ptplan profile --batch-sizes ...) to measure them")))
    if not search.t.optimizer_measured:
        out.append(PlanWarning(code="missing-optimizer-time", message=(
            "the profile has no optimizer-step times (written before ptplan measured them): the optimizer step "
            "is charged 0 s; profile again for a complete prediction")))
    elif training.optimizer != "adamw":
        out.append(PlanWarning(code="optimizer-time-is-adamw", message=(
            f"the profile timed AdamW's step; the plan charges the same time for {training.optimizer}")))
    split = sorted({p.schedule for p in phases if splits_backward(p.schedule)})
    if split and not search.t.backward_split_measured:
        out.append(PlanWarning(code="missing-backward-split", message=(
            f"schedule {', '.join(split)} splits the backward into B (input gradient) and W (weight gradient), but "
            f"the profile has no backward_weight_s (written before ptplan measured it): B is charged the whole "
            f"backward and W 0 s, so the predicted bubble is not the schedule's; profile again")))
    if split and not search.t.stash_measured:
        out.append(PlanWarning(code="missing-backward-stash", message=(
            f"schedule {', '.join(split)} keeps, for each micro-batch between its B and its W, the gradients its W "
            f"reads, but the profile does not record them (backward_stash_bytes_per_sample: written before ptplan "
            f"measured it): the predicted memory leaves them out (a bert-tiny ZB-H1 last stage held 6 % more); "
            f"profile again")))
    pinned = [p for p in phases if p.notes and any("pinned" in n for n in p.notes)
              and (reached is None or p.frozen_blocks in reached)]
    if pinned:
        out.append(PlanWarning(code="pinned-not-possible", message=(
            f"the pinned K/M did not fit in {len(pinned)} phase(s) (frozen blocks "
            f"{', '.join(str(p.frozen_blocks) for p in pinned[:12])}{'...' if len(pinned) > 12 else ''}); "
            f"those chose freely (see each phase's notes)")))
    assumed = [name for name in ("read", "write", "weights") if name not in search.io.measured
               and not (name == "weights" and cluster.device_is_host)]  # a CPU streams no weights
    if assumed and any(p.cache for p in phases):
        out.append(PlanWarning(code="assumed-cache-host-rates", message=(
            f"the AutoCache's host traffic ({', '.join(CACHE_TRAFFIC[n] for n in assumed)}) is priced at an assumed "
            f"{training.host_read_bandwidth / 1e9:g} GB/s: the profile measured no such rates on this kind of "
            f"device (a lent H200's host measured 3.9 GB/s for rows read, 1.9 for rows written and 54.4 for "
            f"weights); a profile made by ptplan profile on the target machine measures them")))
    if cluster.host_memory_bytes is None and any(p.cache for p in phases):
        need = max(p.predicted.cache_host_bytes_per_node for p in phases)
        out.append(PlanWarning(code="host-memory-unknown", message=(
            f"cluster {cluster.name} does not say how much host RAM a node has, so the AutoCache's need of up to "
            f"{need / 2**30:,.1f} GiB per node was not checked; give host_memory_bytes in a cluster file "
            f"(--cluster FILE; its keys: docs/contracts.md, Cluster)")))
    return out


def _totals(search: PhaseSearch, phases: list[Phase], base_phase: Phase, points: list[TrajectoryPoint],
            training: TrainingConfig) -> Totals:
    """The trajectory's totals against the baseline (phase 0 all the way, static) and the best static plan
    (searched freely when the user pinned K or M, else the baseline itself)."""
    total_s = sum(p.seconds for p in points)
    samples = float(sum(p.iterations * phases[p.phase].global_batch for p in points))
    fill_s = sum(p.fill_iterations * phases[p.phase].predicted.fill_extra_s for p in points)

    def static_seconds(ph: Phase) -> float:
        return training.epochs * (training.samples_per_epoch // ph.global_batch) * ph.predicted.iteration_s

    base_s = static_seconds(base_phase)
    asked = training.start_K is not None or training.pin_K is not None or training.pin_M is not None
    best_static = (phase_from_choice(search, 0, search.search(0, Visit(samples=1.0), free=True), keep_timeline=False)
                   if asked else base_phase)
    best_s = min(static_seconds(best_static), base_s)
    if best_s == base_s:
        best_static = base_phase
    return Totals(seconds=total_s, samples=samples, fill_seconds=fill_s, baseline_seconds=base_s,
                  speedup=base_s / total_s if total_s > 0 else 0.0, best_static_seconds=best_s,
                  best_static_K=best_static.K, best_static_M=best_static.M,
                  speedup_vs_best_static=best_s / total_s if total_s > 0 else 0.0)


def _chosen_phases(search: PhaseSearch, table: list[int], training: TrainingConfig, freeze: FreezePolicy, W: int
                   ) -> tuple[list[int], dict[int, float], dict[int, Choice], str]:
    """(freeze table, visits, the visited counts' choices, why freezing stops early or ""). Where a visited frozen
    count fits nowhere (its frozen prefix too big for stage 0 and, cached, for the host), freezing stops at the
    largest count below it that fits, instead of the whole plan failing (issue 22), and the reason says so."""
    why = ""
    while True:
        expected = visits(table, training, freeze, W)
        try:
            return table, expected, trajectory_phases(search, sorted(expected), expected), why
        except InfeasibleError as e:
            bad = next((f for f in sorted(expected) if not _fits(search, f, expected[f])), 0)
            cap = bad - 1
            while cap > 0 and not _fits(search, cap, float(training.samples_per_epoch)):
                cap -= 1
            if bad == 0 or cap <= 0:
                raise e
            table = [min(x, cap) for x in table]
            lines = [x.strip() for x in str(bad_err(search, bad, expected[bad]) or e).splitlines()]
            first = " ".join(lines[:2] + [x for x in lines if x.startswith("The frozen prefix")])  # headline, why
            why = (f"freezing stops at {cap} of {search.p.num_blocks} blocks: with {bad} frozen, {first}; the plan "
                   f"keeps {cap} frozen from there on (use a cluster with more GPU memory or host memory for the "
                   f"AutoCache to freeze further)")


def _fits(search: PhaseSearch, f: int, samples: float) -> bool:
    """Whether some configuration (the AutoCache as configured) fits with f frozen blocks."""
    return bad_err(search, f, samples) is None


def bad_err(search: PhaseSearch, f: int, samples: float) -> InfeasibleError | None:
    """Why no configuration (the AutoCache as configured) fits with f frozen blocks, or None where one does."""
    try:
        search.search(f, Visit(samples=samples))
    except InfeasibleError as e:
        return e
    return None


def make_plan(profile: Profile, cluster: Cluster, training: TrainingConfig, freeze: FreezePolicy, *,
              profile_path: str | None = None, progress: Callable[[int, int], Any] | None = None,
              strategies: str = "off", token_slices: str = "off") -> Plan:
    """Compute the full plan: a phase per frozen count, the freeze steps, trajectory, totals, baselines.
    ``strategies``: "off" (pipeline x data parallel) or "auto" (also tensor parallel, FSDP and
    recomputation per phase; ``search.PhaseSearch``). ``token_slices``: "off", or "auto" (causal LMs with
    a profile's slice costs): each chosen phase gets TeraPipe token slices where the slice-aware simulation
    says they pay (``terapipe.token_slice_phase``, a pass after the search)."""
    if token_slices not in ("off", "auto"):
        raise PtplanError(f"--token-slices must be off or auto, got {token_slices!r}")
    if token_slices == "auto":
        from .terapipe import require_slice_costs

        require_slice_costs(profile)
    profile = _checked_profile(profile)
    L, W = profile.num_blocks, cluster.world_size
    last_T = _last_freeze_step(training, freeze, W)
    table = freeze_table(freeze, L, min(last_T, MAX_FREEZE_STEPS))
    if len(table) > MAX_FREEZE_STEPS:
        raise PtplanError(f"the freeze cadence gives more than {MAX_FREEZE_STEPS:,} freeze steps before the count "
                          f"settles; freeze less often (--freeze-every) or per epoch")
    search = PhaseSearch(profile, cluster, training, strategies=strategies)
    table, expected, chosen, stopped = _chosen_phases(search, table, training, freeze, W)
    visited = sorted(expected)
    if progress is not None:
        progress(len(visited), L + 1)
    phases: list[Phase] = []
    done = len(visited)

    def sliced(ph: Phase, ch: Choice, keep_timeline: bool) -> Phase:
        if token_slices == "off":
            return ph
        from .terapipe import token_slice_phase

        return token_slice_phase(search, ch, ph, keep_timeline=keep_timeline, max_events=MAX_TIMELINE_EVENTS)

    for f in range(L + 1):
        if f in chosen:
            phases.append(sliced(phase_from_choice(search, f, chosen[f], keep_timeline=True), chosen[f], True))
            continue
        try:
            ch = search.search(f, Visit(samples=float(training.samples_per_epoch)))
        except InfeasibleError:
            if f == 0:
                raise
            ch = None  # unreachable by the planned trajectory and infeasible: left out
        if ch is not None:
            phases.append(sliced(phase_from_choice(search, f, ch, keep_timeline=False), ch, False))
        done += 1
        if progress is not None:
            progress(done, L + 1)
    index = {ph.frozen_blocks: i for i, ph in enumerate(phases)}
    points = walk(phases, index, table, training, freeze)
    base_phase = phases[index[0]]
    totals = _totals(search, phases, base_phase, points, training)
    base_s = totals.baseline_seconds
    ident = profile.identity()
    ref = ProfileRef(**{k: ident[k] for k in ("model", "family", "num_blocks", "num_layers", "granularity",
                                              "seq_len", "dtype", "device", "device_kind", "fingerprint")},
                     source=profile.provenance.source, batch_sizes=tuple(profile.batch_sizes), path=profile_path)
    inputs = PlanInputs(profile=ref, cluster=cluster, training=training, freeze=freeze,
                        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    return Plan(inputs=inputs, phases=tuple(phases), freeze_steps=tuple(table), trajectory=tuple(points),
                totals=totals, baseline=Baseline(phase=replace(base_phase, timeline=()), seconds=base_s),
                warnings=tuple(_warnings(profile, cluster, training, search, phases,
                                         None if freeze.adaptive else set(table)))
                + ((PlanWarning(code="freezing-stopped", message=stopped),) if stopped else ()))
