"""The search's candidates (step 1 of ``search.py``): every (K, M, cache, schedule, strategy) the constraints
allow. Functions of the ``PhaseSearch`` they are given, which subclasses may narrow (its ``k_options``,
``modes``, ``schedules``)."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .candidate import Candidate
from .config import INTERLEAVED_V
from .errors import PtplanError
from .replicate import divisors
from .schedule import ScheduleError, check_sizes, stage_to_rank
from .strategy import runtime_refusal
from .tp_split import sp_refusal

if TYPE_CHECKING:
    from .config import TrainingConfig
    from .search import PhaseSearch


def valid_lengths(world: int, layers: int) -> list[int]:
    """The pipeline lengths K a phase can take: a divisor of the GPUs (equal pipelines) of at most its layers."""
    return [k for k in divisors(world) if k <= layers]


def check_pins(cfg: TrainingConfig, world: int, layers: int) -> None:
    """Refuse a pinned K or M that no phase can take, before any search (``PhaseSearch``): K must divide the GPUs
    and be at most the model's layers; M must divide some pipeline's batch (the global batch over a data-parallel
    width that divides the GPUs, or the per-pipeline batch). A pin some phases cannot take is theirs to drop
    (``pipeline_lengths``; the M rule in ``enumerate_candidates``), with a note."""
    if cfg.pin_K is not None:
        ks = valid_lengths(world, layers)
        if cfg.pin_K not in ks:
            raise PtplanError(f"-K {cfg.pin_K} fits no phase: a pipeline length must divide the {world} GPUs and be "
                              f"at most the model's {layers} layers; valid: {', '.join(map(str, ks))}")
    if cfg.pin_M is not None:
        pipes = sorted({cfg.batch // d for d in divisors(world) if cfg.batch % d == 0}
                       if cfg.batch_policy == "constant-global" else {cfg.batch})
        if not any(p % cfg.pin_M == 0 for p in pipes):
            ms = sorted({m for p in pipes for m in divisors(p)})
            shown = ", ".join(map(str, ms[:16])) + (", ..." if len(ms) > 16 else "")
            raise PtplanError(f"-M {cfg.pin_M} fits no phase: M micro-batches must divide a pipeline's batch "
                              f"({', '.join(map(str, pipes))} samples for a global batch of {cfg.batch} on {world} "
                              f"GPUs); valid: {shown}")


def pipeline_lengths(search: PhaseSearch, f: int, n_active: int, *, free: bool) -> tuple[list[int], list[str]]:
    """Pipeline lengths to try, and notes when a pinned K cannot be used here."""
    ks = valid_lengths(search.W, n_active)
    cfg = search.cfg
    if cfg.pin_K is not None and not free:
        if cfg.pin_K in ks:
            return [cfg.pin_K], []
        why = (f"only {n_active} active layers" if cfg.pin_K > n_active else
               f"K={cfg.pin_K} does not divide the {search.W} GPUs")
        return ks, [f"pinned K={cfg.pin_K} not possible ({why}); K chosen freely"]
    if cfg.start_K is not None and not free:
        if f == 0:
            if cfg.start_K not in ks:
                raise PtplanError(f"--start-K {cfg.start_K} must divide the {search.W} GPUs and be at most the "
                                  f"{n_active} layers; valid: {', '.join(map(str, ks))}")
            return [cfg.start_K], []
        return [k for k in ks if k <= cfg.start_K], []
    return ks, []


def schedule_shapes(search: PhaseSearch, K: int, M: int, n_active: int) -> list[tuple[str, int]]:
    """(schedule, V) pairs that exist for K positions and M micro-batches and leave every stage a layer."""
    out = []
    for name in (search.schedules if K > 1 else search.schedules[:1]):
        for V in (INTERLEAVED_V if name in ("interleaved-1f1b", "looped-bfs") else
                  (2,) if name == "zb-v" else (1,)):
            if K * V > n_active:
                continue
            try:
                check_sizes(name, K, M, V)
            except ScheduleError:
                continue
            out.append((name, V))
    return out


def sp_runs(search: PhaseSearch, tp: int, name: str, K: int, V: int) -> bool:
    """Whether the runtime runs sequence parallelism over tp ranks with this schedule, K and V: where
    ``tp_split.sp_refusal`` allows it (the plan loader refuses the rest, e.g. V chunks on one position at K = 1),
    and no rank holds two consecutive stages (``executor/runtime/hybrid.py`` gathers the sequence only where a
    rank's run of split layers ends, so touching chunks, as zb-v's turn on its last position, would pass a
    sequence shard between them)."""
    if sp_refusal(search.p.model.family, search.p.model.seq_len, tp, K=K, V=V) is not None:
        return False
    ranks = stage_to_rank(name, K, V)
    return all(a != b for a, b in zip(ranks, ranks[1:]))


def _left_out(cand: Candidate) -> str | None:
    """Why a candidate is not searched: a stage strategy it must offer that the executor does not run
    (``strategy.runtime_refusal``; a per-stage choice of which one option is refused would only repeat the uniform
    candidate), or 2BW with recomputation chosen per stage (``assign.py`` chooses stage strategies by a bound that
    2BW's steady state does not obey)."""
    if cand.schedule == "2bw" and cand.recompute_per_stage:
        return ("2bw with recomputation chosen per stage left out (the search does not choose 2BW's strategies per "
                "stage)")
    for st in cand.options:
        why = runtime_refusal(cand.schedule, st, cand.D)
        if why is not None:
            return f"{cand.schedule} with {st.label} left out: {why}"
    return None


def enumerate_candidates(search: PhaseSearch, f: int, n0: int, *, free: bool = False, pin_k: bool = True,
                         cache: bool | None = None) -> tuple[list[Candidate], list[str], list[str]]:
    """(candidates, reasons some K or M were left out, notes for the phase). ``cache``: only
    candidates with (True) or without (False) the AutoCache; None: as the training config says."""
    cfg, n_active = search.cfg, search.n - n0
    ks, notes = search.k_options(f, n_active, free=free or not pin_k)
    lo_b, hi_b = search.t.measured_range
    if n0 == 0:
        caches = [False]
    elif cache is not None:
        caches = [cache]
    else:
        caches = [False] if cfg.cache == "off" else [True] if cfg.cache == "on" else [False, True]
    out: list[Candidate] = []
    reasons: list[str] = []
    pin_m_used = cfg.pin_M is None
    for (tp, fm, rm, sp), K in ((md, K) for md in search.modes for K in ks if (search.W // md[0]) % K == 0):
        D = search.W // (K * tp)
        if fm and D == 1 or (fm, rm) == (0, 2) and D > 1:  # FSDP shards over replicas (none at D = 1)
            continue
        bp = search.pipeline_batch(D)
        if bp is None:
            reasons.append(f"K={K}: global batch {cfg.batch} does not split over D={D} pipelines")
            continue
        ms = [m for m in divisors(bp) if search.shapes(K, m, n_active)]
        if not cfg.allow_extrapolation:
            outside = [m for m in ms if not lo_b <= bp // m <= hi_b]
            ms = [m for m in ms if lo_b <= bp // m <= hi_b]
            if outside and not ms:
                reasons.append(f"K={K}: every micro-batch size for {bp} samples per pipeline is outside the "
                               f"profile's measured {lo_b}..{hi_b} (profile larger sizes, or allow extrapolation)")
        if cfg.pin_M is not None and cfg.pin_M in ms:
            ms = [cfg.pin_M]
            pin_m_used = True
        if not ms:
            if not reasons or not reasons[-1].startswith(f"K={K}:"):
                reasons.append(f"K={K}: {bp} samples per pipeline have no micro-batch count that "
                               f"{'/'.join(search.schedules)} can run (e.g. 1F1B needs M >= K={K})")
            continue
        for M in ms:
            for name, V in search.shapes(K, M, n_active):
                if sp and not sp_runs(search, tp, name, K, V):
                    continue
                cand = Candidate(K=K, D=D, M=M, b=bp // M, cache=False, schedule=name, V=V, tp=tp, sp=sp, fsdp=fm == 1,
                                 recompute=rm == 1, fsdp_per_stage=fm == 2, recompute_per_stage=rm == 2)
                why = _left_out(cand)
                if why is not None:
                    if f"K={K}: {why}" not in reasons:
                        reasons.append(f"K={K}: {why}")
                    continue
                out += [replace(cand, cache=cache) for cache in caches]
    if not pin_m_used:
        notes.append(f"pinned M={cfg.pin_M} not possible here; M chosen freely")
    return out, reasons, notes
