"""The plan contract (``ptplan.plan/2``): typed inputs, one phase per frozen-block count, the freeze steps,
the predicted trajectory, totals, baseline and warnings; one reader that validates every field.

Legend: L blocks; f frozen blocks; K pipeline length (stages per pipeline); D data-parallel width
(pipelines); M micro-batches per pipeline per iteration; b micro-batch size (samples); global batch
B = D * M * b; T a freeze step (an epoch, or every N optimizer steps). Layer ranges are half-open
``[lo, hi)`` indices into the profile's flat layer list; a phase's stages cover
``[frozen_layers, num_layers)`` and stage 0 also runs the frozen prefix ``[0, frozen_layers)`` under
no_grad (or reads it from the AutoCache).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from .cluster import Cluster, cluster_from_json
from .config import SCHEDULES, TrainingConfig, training_from_json
from .errors import PtplanError, SchemaError
from .families import TOKEN_SLICE_FAMILIES
from .freeze import FreezePolicy, freeze_from_json
from .jsonio import Fields, read_json, write_json
from .profile import PROVENANCE_SOURCES
from .strategy import phase_label
from .tp_split import sp_refusal

SCHEMA = "ptplan.plan/2"
EVENT_KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "ALLREDUCE", "PREFIX", "CACHE", "UPDATE")


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


@dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """One simulated interval on one rank of pipeline 0 (the other pipelines are identical)."""

    rank: int
    """Position in the pipeline (0..K-1), i.e. the stage-holding rank of pipeline 0."""
    stage: int
    kind: str
    """One of EVENT_KINDS (PREFIX = frozen-prefix no-grad forward; CACHE = reading or filling cached prefix
    outputs; UPDATE = the optimizer step)."""
    mb: int
    """Micro-batch index, -1 where it does not apply (ALLREDUCE, CACHE)."""
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """One stage's predicted peak memory, term by term (bytes); ``total`` is the peak
    (``planner/stage.py`` says what each term holds)."""

    weights: int
    gradients: int
    optimizer: int
    buffers: int
    """Receive buffers, and on stage 0 with the AutoCache the shard's prefix outputs."""
    activations: int
    """In-flight micro-batches x bytes each micro-batch holds until its backward."""
    transient: int
    """The largest transient after the pipeline drained (all-reduce buffer, optimizer temporaries, cache fill)."""
    inflight: int
    total: int


@dataclass(frozen=True, kw_only=True)
class Prediction:
    iteration_s: float
    """Seconds per training iteration (one global batch) in steady state, all-reduce and update included."""
    samples_per_s: float
    bubble_fraction: float
    """Share of the pipeline's rank-time spent idle during the iteration (before the all-reduce)."""
    allreduce_s: float
    """Exposed (non-overlapped) all-reduce seconds at the end of the iteration."""
    stage_compute_s: tuple[float, ...]
    """Per stage: forward+backward seconds of all its micro-batches (prefix included on stage 0)."""
    stage_peak_memory_bytes: tuple[int, ...]
    """Per stage: predicted peak device memory (``stage_memory[s].total``)."""
    stage_memory: tuple[MemoryBreakdown, ...] = ()
    """Per stage: the peak, term by term."""
    rank_peak_memory_bytes: tuple[int, ...] = ()
    """Per pipeline position: its peak with all its stages (chunks) together; with one stage per position
    it equals stage_peak_memory_bytes."""
    fill_iteration_s: float = 0.0
    """With the AutoCache: seconds of an iteration that computes and writes the prefix outputs (the
    phase's first pass over the data); 0 when the phase does not cache."""
    cache_host_bytes_per_node: int = 0
    """Host memory per node the AutoCache needs in this phase (0 when it does not cache)."""
    cache_setup_s: float = 0.0
    """With the AutoCache: stage 0's seconds per steady iteration serving its shard's prefix output (reading the
    rows; ``stage.cache_setup_s``), inside ``iteration_s``; 0 when the phase does not cache."""
    fill_cache_setup_s: float = 0.0
    """With the AutoCache: the same in a fill iteration (the prefix computed, its rows written, its weights
    streamed), inside ``fill_iteration_s``; 0 when the phase does not cache."""

    @property
    def device_peak_memory_bytes(self) -> tuple[int, ...]:
        """Per device (pipeline position): its predicted peak, all its chunks together -- what one GPU must
        hold and what a run measures per rank. Read this, not ``stage_peak_memory_bytes``, wherever a
        device's memory is meant (they differ when a position runs V > 1 chunks)."""
        return self.rank_peak_memory_bytes or self.stage_peak_memory_bytes

    @property
    def peak_memory_bytes(self) -> int:
        """The fullest device's predicted peak (0 for a phase without a prediction)."""
        return max(self.device_peak_memory_bytes, default=0)

    @property
    def fill_extra_s(self) -> float:
        """What a fill iteration costs over a steady one, at least 0: the two are simulated apart, and where the
        fill's extra work is off the critical path (PipeDream-2BW's period) they differ only by rounding, which
        may fall either way."""
        return max(self.fill_iteration_s - self.iteration_s, 0.0)


@dataclass(frozen=True, kw_only=True)
class Phase:
    frozen_blocks: int
    """f, the number of frozen Transformer blocks in this phase."""
    frozen_layers: int
    """Number of flat layers in the frozen prefix (= profile.frozen_boundary(f))."""
    K: int
    D: int
    M: int
    micro_batch_size: int
    schedule: str
    partition: tuple[tuple[int, int], ...]
    """K·V half-open layer ranges (model chunks, i.e. pipeline stages), contiguous, covering
    [frozen_layers, num_layers); chunk c runs on pipeline position ``stage_to_rank[c]``."""
    cache: bool
    """Whether stage 0 reads the frozen prefix's outputs from the AutoCache."""
    ranks: tuple[tuple[int, ...], ...]
    """ranks[p][s] = global rank holding stage s of pipeline p (D rows of K)."""
    predicted: Prediction
    timeline: tuple[TimelineEvent, ...] = ()
    notes: tuple[str, ...] = ()
    V: int = 1
    """Model chunks (virtual stages) per pipeline position: 1, or more for interleaved schedules."""
    actions: tuple[str, ...] = ()
    """The schedule as data: per pipeline position 0..K-1, its actions in order, space-separated in
    ``planner.schedule``'s text form (``2F0 2SEND_F0 ...``); what the simulator priced and what the
    executor runs. Empty in plans written before actions were stored."""
    tp: int = 1
    """Tensor-parallel width of every stage (issue 14): stage s of pipeline p runs on the tp ranks
    ranks[p][s] .. ranks[p][s] + tp - 1 (one node); the phase uses K·D·tp ranks."""
    fsdp: bool | tuple[bool, ...] = False
    """Sharded data parallel (ZeRO-3) over a stage's D replicas instead of a gradient all-reduce: one value for
    every stage, or, in a phase whose stages differ (``ptplan plan --strategies auto`` chooses per stage), one
    per stage (chunk), K·V entries. A tuple is truthy: read it with ``fsdp_at(stage)``, ``any_fsdp`` or
    ``stage_fsdp``. A per-stage tuple whose entries are all equal is stored as that one value."""
    recompute: bool | tuple[bool, ...] = False
    """Activation recomputation: a stage keeps only its input (and its output) per micro-batch. One value, or one per
    stage like ``fsdp``; read it with ``recompute_at(stage)``, ``any_recompute`` or ``stage_recompute``."""
    recompute_layers: tuple[int, ...] = ()
    """Galvatron's layer-wise recomputation: per stage (K·V entries), how many of its first active layers it
    recomputes (one checkpoint unit; the rest keep their activations), 0 = all of them (or no recomputation);
    empty = 0 everywhere (plans written before it load so). Read it with ``recompute_layers_at(stage)``."""
    slices: tuple[int, ...] = ()
    """Token slices (TeraPipe, causal LMs only): each micro-batch's sequence cut into these lengths (in
    tokens, summing to the profile's sequence length), which flow through the pipeline one after another;
    the actions are then ``planner.schedule.terapipe``'s and the prediction the slice-aware simulation.
    Empty: not sliced (plans written before token slicing load with it empty)."""
    sp: bool = False
    """Megatron's sequence parallelism with tp > 1 (``strategy.Strategy.sp``, ``executor/runtime/hybrid.py``): the
    split layers' norms and residual stream on sequence shards; written only when true."""

    def __post_init__(self) -> None:
        S = self.K * self.V
        for name in ("fsdp", "recompute"):
            v = getattr(self, name)
            if isinstance(v, bool):
                continue
            v = tuple(v)
            if len(v) != S or not all(isinstance(x, bool) for x in v):
                raise PtplanError(f"Phase.{name} must be true/false or {S} of them (one per stage, K*V={S}), "
                                  f"got {v!r}")
            object.__setattr__(self, name, v[0] if len(set(v)) == 1 else v)
        r = tuple(self.recompute_layers)
        if r and (len(r) != S or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in r)
                  or any(x and not self.recompute_at(c) for c, x in enumerate(r))):
            raise PtplanError(f"Phase.recompute_layers must be {S} counts >= 0 (one per stage), nonzero only where "
                              f"the stage recomputes, got {r!r}")
        object.__setattr__(self, "recompute_layers", () if not any(r) else r)

    @property
    def world(self) -> int:
        """Ranks the phase uses: K·D·tp."""
        return self.K * self.D * self.tp

    @property
    def stage0_ranks(self) -> tuple[int, ...]:
        """Every rank that runs stage 0 (each pipeline's, its whole tensor-parallel group): the ranks that hold the
        frozen prefix (``executor/runtime/transition.holdings``) and, with the AutoCache, keep it in host memory."""
        return tuple(r for row in self.ranks for r in range(row[0], row[0] + self.tp))

    def fsdp_at(self, stage: int) -> bool:
        """Whether stage (chunk) ``stage`` shards its active layers with FSDP (``fsdp``)."""
        return self.fsdp if isinstance(self.fsdp, bool) else self.fsdp[stage]

    def recompute_at(self, stage: int) -> bool:
        """Whether stage (chunk) ``stage`` recomputes its activations (``recompute``)."""
        return self.recompute if isinstance(self.recompute, bool) else self.recompute[stage]

    def recompute_layers_at(self, stage: int) -> int:
        """How many of stage ``stage``'s first active layers it recomputes: 0 = all (``recompute_layers``)."""
        return self.recompute_layers[stage] if self.recompute_layers else 0

    @property
    def stage_fsdp(self) -> tuple[bool, ...]:
        """``fsdp_at`` of every stage (K·V entries)."""
        return tuple(self.fsdp_at(s) for s in range(self.K * self.V))

    @property
    def stage_recompute(self) -> tuple[bool, ...]:
        """``recompute_at`` of every stage (K·V entries)."""
        return tuple(self.recompute_at(s) for s in range(self.K * self.V))

    @property
    def any_fsdp(self) -> bool:
        return any(self.stage_fsdp)

    @property
    def any_recompute(self) -> bool:
        return any(self.stage_recompute)

    @property
    def mixed(self) -> bool:
        """Whether the stages' strategies differ (``fsdp`` or ``recompute`` stored per stage)."""
        return not (isinstance(self.fsdp, bool) and isinstance(self.recompute, bool)) or \
            len(set(self.recompute_layers)) > 1

    def stage_label(self, stage: int) -> str:
        """One stage's FSDP/recomputation part of the strategy: ``fsdp·rc``, ``fsdp``, ``rc`` or ``dp``."""
        parts = (["fsdp"] if self.fsdp_at(stage) else []) + \
            ([f"rc{self.recompute_layers_at(stage) or ''}"] if self.recompute_at(stage) else [])
        return "·".join(parts) or "dp"

    @property
    def caches_prefix(self) -> bool:
        """The AutoCache serves this phase's frozen prefix: the plan caches it and there is one."""
        return self.cache and self.frozen_layers > 0

    @property
    def strategy_label(self) -> str:
        """Short text of the strategy, e.g. ``tp2·fsdp·rc``; ``dp`` for plain data parallel. A phase whose
        stages differ lists them in stage order, runs of equal stages as ``×n``: ``tp2 · stages
        fsdp·rc | fsdp | dp×2`` (``strategy.phase_label``)."""
        return phase_label(self.tp, self.stage_fsdp, self.stage_recompute,
                           [self.recompute_layers_at(c) for c in range(self.K * self.V)], sp=self.sp)

    @property
    def stages(self) -> int:
        """K·V: model chunks per pipeline."""
        return self.K * self.V

    def stage_to_rank(self) -> tuple[int, ...]:
        """Pipeline position of each stage (chunk): read from the actions (interleaved schedules loop,
        chunk c on position c % K; V-shaped ones fold back), one stage per position without them."""
        if not self.actions:
            return tuple(c % self.K for c in range(self.K * self.V))
        where = [0] * (self.K * self.V)
        for pos, text in enumerate(self.actions):
            for tok in text.split():
                where[int(tok[:len(tok) - len(tok.lstrip("0123456789"))])] = pos
        return tuple(where)
    """Where this phase departs from what was asked (a pinned K or M that did not fit, an
    extrapolated micro-batch size)."""

    @property
    def pipeline_batch(self) -> int:
        return self.M * self.micro_batch_size

    @property
    def global_batch(self) -> int:
        return self.D * self.M * self.micro_batch_size

    def dp_groups(self) -> list[list[int]]:
        """For each stage s, the ranks holding it across pipelines (the data-parallel group)."""
        return [[self.ranks[p][s] for p in range(self.D)] for s in range(self.K)]


@dataclass(frozen=True, kw_only=True)
class TrajectoryPoint:
    """A run of optimizer steps at one frozen count, inside one epoch."""

    epoch: int
    step: int
    """Global optimizer step at which the run starts."""
    frozen_blocks: int
    phase: int
    """Index into Plan.phases."""
    iterations: int
    fill_iterations: int = 0
    """Of ``iterations``, how many fill the AutoCache (the phase's first pass over the data)."""
    seconds: float
    """Predicted seconds of the run: fill iterations x fill_iteration_s + the rest x iteration_s."""


@dataclass(frozen=True, kw_only=True)
class ProfileRef:
    """What a plan records of its profile: identity, provenance and the measured micro-batch sizes."""

    model: str
    family: str
    num_blocks: int
    num_layers: int
    granularity: str
    seq_len: int
    dtype: str
    device: str
    device_kind: str
    fingerprint: str
    source: str = "measured"
    """``measured``, ``projected`` or ``synthetic`` (the profile's provenance)."""
    batch_sizes: tuple[int, ...] = ()
    """The micro-batch sizes the profile measured."""
    path: str | None = None


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    profile: ProfileRef
    cluster: Cluster
    training: TrainingConfig
    freeze: FreezePolicy
    created: str = ""
    """ISO time the plan was made."""


@dataclass(frozen=True, kw_only=True)
class Totals:
    seconds: float
    """Predicted training seconds (transitions not included; ``ptplan compare`` measures them)."""
    samples: float
    fill_seconds: float = 0.0
    """Of ``seconds``, the extra that AutoCache fill iterations cost over steady ones (each phase's at least 0:
    ``Prediction.fill_extra_s``)."""
    baseline_seconds: float
    speedup: float
    """baseline_seconds / seconds."""
    best_static_seconds: float
    best_static_K: int
    best_static_M: int
    speedup_vs_best_static: float


@dataclass(frozen=True, kw_only=True)
class Baseline:
    """No freezing: a static pipeline + data parallel, with its own best K and M."""

    phase: Phase
    seconds: float


WARNING_CODES = ("cpu-profile-for-gpu-cluster", "synthetic-profile", "projected-profile", "extrapolated-micro-batch",
                 "missing-optimizer-time", "optimizer-time-is-adamw", "pinned-not-possible", "host-memory-unknown",
                 "cache-off-host-memory", "missing-backward-split", "profile-device-differs", "freezing-stopped",
                 "assumed-cache-host-rates", "missing-backward-stash")


@dataclass(frozen=True, kw_only=True)
class PlanWarning:
    """Something the user should know before trusting the plan's numbers."""

    code: str
    """One of WARNING_CODES."""
    message: str


@dataclass(frozen=True, kw_only=True)
class Plan:
    inputs: PlanInputs
    phases: tuple[Phase, ...]
    freeze_steps: tuple[int, ...]
    """Frozen-block count at freeze step T = 0, 1, ... (the last entry holds after the end); what a
    run following the plan reads."""
    trajectory: tuple[TrajectoryPoint, ...]
    totals: Totals
    baseline: Baseline
    warnings: tuple[PlanWarning, ...] = ()
    schema: str = SCHEMA

    @property
    def world_size(self) -> int:
        return self.phases[0].world

    def caching_phases(self) -> list[int]:
        """Indices of the phases whose frozen prefix the AutoCache serves (``Phase.caches_prefix``)."""
        return [i for i, ph in enumerate(self.phases) if ph.caches_prefix]

    def phase_index(self, frozen_blocks: int) -> int:
        """Index of the phase for a frozen-block count (every count that can occur has one)."""
        for i, ph in enumerate(self.phases):
            if ph.frozen_blocks == frozen_blocks:
                return i
        have = [p.frozen_blocks for p in self.phases]
        raise PtplanError(f"the plan has no phase for {frozen_blocks} frozen blocks (it has {have}); "
                          f"re-run `ptplan plan` with a freeze policy that can reach it")

    def phase_for(self, frozen_blocks: int) -> Phase:
        return self.phases[self.phase_index(frozen_blocks)]

    def frozen_at(self, T: int) -> int:
        """The planned frozen-block count at freeze step T."""
        if T < 0:
            raise PtplanError(f"freeze step {T} is negative")
        return self.freeze_steps[min(T, len(self.freeze_steps) - 1)]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (lists, not tuples), ready for json.dumps or the validator."""
        d = json.loads(json.dumps(asdict(self)))
        d["inputs"]["cluster"] = self.inputs.cluster.to_json()
        for ph in (*d["phases"], d["baseline"]["phase"]):  # written only where a stage recomputes part of itself
            if not ph["recompute_layers"]:
                del ph["recompute_layers"]
            if not ph["sp"]:
                del ph["sp"]
        return {"schema": d.pop("schema"), **d}


# ---- validation ---------------------------------------------------------------------------
def _memory(f: Fields) -> MemoryBreakdown:
    Fields(f.obj, f.what, f.path, allowed=_names(MemoryBreakdown))
    return MemoryBreakdown(**{k: f.int(k, min=0) for k in _names(MemoryBreakdown)})


def _prediction(f: Fields) -> Prediction:
    Fields(f.obj, f.what, f.path, allowed=_names(Prediction))
    return Prediction(
        iteration_s=f.float("iteration_s", min=0), samples_per_s=f.float("samples_per_s", min=0),
        bubble_fraction=f.float("bubble_fraction", min=0, max=1), allreduce_s=f.float("allreduce_s", min=0),
        stage_compute_s=tuple(f.floats("stage_compute_s")),
        stage_peak_memory_bytes=tuple(f.ints("stage_peak_memory_bytes", min=0)),
        stage_memory=tuple(_memory(m) for m in f.objs("stage_memory")) if "stage_memory" in f.obj else (),
        rank_peak_memory_bytes=tuple(f.ints("rank_peak_memory_bytes", min=0)) if "rank_peak_memory_bytes" in f.obj
        else (),
        fill_iteration_s=f.float("fill_iteration_s", 0.0, min=0),
        cache_host_bytes_per_node=f.int("cache_host_bytes_per_node", 0, min=0),
        cache_setup_s=f.float("cache_setup_s", 0.0, min=0),
        fill_cache_setup_s=f.float("fill_cache_setup_s", 0.0, min=0))


CAUSAL_SLICE_FAMILIES = TOKEN_SLICE_FAMILIES
"""Model families whose phases may carry token slices (their rows in ``families.py``: each family file's
``slice_forward`` in executor/families/)."""


def _slices(f: Fields, *, V: int, tp: int, seq_len: int | None, family: str | None) -> tuple[int, ...]:
    """``Phase.slices``: token lengths >= 1 summing to the sequence length, for a causal family, V = 1, tp = 1."""
    raw = f.list("slices", [])
    if not raw:
        return ()
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in raw):
        raise SchemaError(f.what, f"{f.path}.slices", f"expected token slice lengths >= 1, got {raw!r}")
    if len(raw) < 2:
        raise SchemaError(f.what, f"{f.path}.slices", f"has one slice {raw!r}; a sliced phase has at least 2 (leave "
                          f"the field empty for an unsliced phase)")
    if seq_len is not None and sum(raw) != seq_len:
        raise SchemaError(f.what, f"{f.path}.slices", f"sum to {sum(raw)} tokens but the profile's sequence length "
                          f"is {seq_len}", "Re-run `ptplan plan --token-slices auto`")
    if family is not None and family not in CAUSAL_SLICE_FAMILIES:
        raise SchemaError(f.what, f"{f.path}.slices", f"token slices are for causal LMs "
                          f"({', '.join(CAUSAL_SLICE_FAMILIES)}), not a {family} model",
                          "Re-run `ptplan plan` with --token-slices off")
    if V != 1 or tp != 1:
        raise SchemaError(f.what, f"{f.path}.slices", f"token slices run one stage per position without tensor "
                          f"parallelism, but the phase has V={V}, tp={tp}", "Re-run `ptplan plan`")
    return tuple(raw)


def _per_stage(f: Fields, key: str, *, S: int, D: int) -> bool | tuple[bool, ...]:
    """``Phase.fsdp`` / ``Phase.recompute``: true/false (every stage), or one per stage (K·V entries, booleans;
    FSDP only with D > 1, where there are replicas to shard over)."""
    raw = f.raw(key, False)
    if isinstance(raw, bool):
        return raw
    if not isinstance(raw, list):
        raise SchemaError(f.what, f"{f.path}.{key}", f"expected true/false or a list of {S} of them (one per stage), "
                          f"got {raw!r}", "Re-run `ptplan plan`")
    if len(raw) != S:
        raise SchemaError(f.what, f"{f.path}.{key}", f"has {len(raw)} entries for K*V={S} stages",
                          "Re-run `ptplan plan`")
    for i, x in enumerate(raw):
        if not isinstance(x, bool):
            raise SchemaError(f.what, f"{f.path}.{key}[{i}]", f"expected true/false, got {x!r}", "Re-run `ptplan plan`")
    if key == "fsdp" and D == 1 and any(raw):
        raise SchemaError(f.what, f"{f.path}.fsdp", f"shards stage {raw.index(True)} with FSDP but the phase has D=1 "
                          f"(no replicas to shard over)", "Re-run `ptplan plan`")
    return tuple(raw)


def _recompute_layers(f: Fields, parts: list[tuple[int, int]], recompute: bool | tuple[bool, ...]
                      ) -> tuple[int, ...]:
    """``Phase.recompute_layers``: per stage, 1 <= r < its layer count where it recomputes (its first r
    layers), else 0; empty (the default) = 0 everywhere."""
    raw = f.list("recompute_layers", [])
    if not raw:
        return ()
    key = f"{f.path}.recompute_layers"
    if len(raw) != len(parts):
        raise SchemaError(f.what, key, f"has {len(raw)} entries for K*V={len(parts)} stages", "Re-run `ptplan plan`")
    for i, (r, (lo, hi)) in enumerate(zip(raw, parts)):
        rc = recompute if isinstance(recompute, bool) else recompute[i]
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise SchemaError(f.what, f"{key}[{i}]", f"expected a layer count >= 0, got {r!r}", "Re-run `ptplan plan`")
        if r and not rc:
            raise SchemaError(f.what, f"{key}[{i}]", f"is {r} but stage {i} does not recompute", "Re-run `ptplan plan`")
        if r >= hi - lo:
            raise SchemaError(f.what, f"{key}[{i}]", f"is {r} but stage {i} has {hi - lo} layers (0 recomputes all "
                              f"of them)", "Re-run `ptplan plan`")
    return tuple(raw)


def _phase(f: Fields, num_layers: int, seq_len: int | None = None, family: str | None = None) -> Phase:
    Fields(f.obj, f.what, f.path, allowed=_names(Phase))
    K, D, M = f.int("K", min=1), f.int("D", min=1), f.int("M", min=1)
    V = f.int("V", 1, min=1)
    frozen_layers = f.int("frozen_layers", min=0)
    parts = []
    for i, r in enumerate(f.list("partition", length=K * V)):
        if (not isinstance(r, list) or len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
                or r[0] >= r[1]):
            raise SchemaError(f.what, f"{f.path}.partition[{i}]", f"expected [lo, hi) with lo < hi, got {r!r}")
        parts.append((r[0], r[1]))
    if parts[0][0] != frozen_layers:
        raise SchemaError(f.what, f"{f.path}.partition[0]", f"starts at layer {parts[0][0]} but frozen_layers is "
                          f"{frozen_layers}", "Re-run `ptplan plan`")
    for i in range(1, K * V):
        if parts[i][0] != parts[i - 1][1]:
            raise SchemaError(f.what, f"{f.path}.partition[{i}]", f"starts at {parts[i][0]} but the previous stage "
                              f"ends at {parts[i - 1][1]} (stages must be contiguous)")
    if parts[-1][1] != num_layers:
        raise SchemaError(f.what, f"{f.path}.partition", f"covers layers up to {parts[-1][1]} but the model has "
                          f"{num_layers}", "Run `ptplan plan` again for this profile")
    ranks = f.list("ranks", length=D)
    tp = f.int("tp", 1, min=1)
    if tp & (tp - 1):
        raise SchemaError(f.what, f"{f.path}.tp", f"is {tp}; the tensor-parallel width must be a power of two",
                          "Re-run `ptplan plan`")
    seen: set[int] = set()
    for p, row in enumerate(ranks):
        if not isinstance(row, list) or len(row) != K or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in row):
            raise SchemaError(f.what, f"{f.path}.ranks[{p}]", f"expected {K} integer ranks, got {row!r}")
        seen.update(row)
    if seen != set(range(0, K * D * tp, tp)):
        raise SchemaError(f.what, f"{f.path}.ranks", f"must use each rank 0..{K * D * tp - 1} exactly once"
                          + (f" (as the first rank of each group of tp={tp})" if tp > 1 else ""))
    tl = []
    for e in (f.objs("timeline") if "timeline" in f.obj else []):
        Fields(e.obj, e.what, e.path, allowed=_names(TimelineEvent))
        tl.append(TimelineEvent(rank=e.int("rank", min=0), stage=e.int("stage", min=0),
                                kind=e.str("kind", choices=EVENT_KINDS), mb=e.int("mb", min=-1),
                                start=e.float("start", min=0), end=e.float("end", min=0)))
    pred = _prediction(f.obj_("predicted"))
    for key in ("stage_peak_memory_bytes", "stage_compute_s"):
        if len(getattr(pred, key)) != K * V:
            raise SchemaError(f.what, f"{f.path}.predicted.{key}", f"has {len(getattr(pred, key))} entries for "
                              f"K*V={K * V} stages")
    if pred.stage_memory and len(pred.stage_memory) != K * V:
        raise SchemaError(f.what, f"{f.path}.predicted.stage_memory", f"has {len(pred.stage_memory)} entries for "
                          f"K*V={K * V} stages")
    actions = f.list("actions", [])
    if actions and (len(actions) != K or not all(isinstance(a, str) for a in actions)):
        raise SchemaError(f.what, f"{f.path}.actions", f"expected one string of actions per pipeline position "
                          f"(K={K}), got {len(actions)} entries")
    notes = f.list("notes", [])
    if not all(isinstance(x, str) for x in notes):
        raise SchemaError(f.what, f"{f.path}.notes", "expected a list of strings")
    return Phase(frozen_blocks=f.int("frozen_blocks", min=0), frozen_layers=frozen_layers, K=K, D=D, M=M,
                 micro_batch_size=f.int("micro_batch_size", min=1), schedule=f.str("schedule", choices=SCHEDULES),
                 partition=tuple(parts), cache=f.bool("cache"),
                 ranks=tuple(tuple(r) for r in ranks), predicted=pred, timeline=tuple(tl), notes=tuple(notes),
                 V=V, actions=tuple(actions), tp=tp, fsdp=_per_stage(f, "fsdp", S=K * V, D=D),
                 recompute=_per_stage(f, "recompute", S=K * V, D=D),
                 recompute_layers=_recompute_layers(f, parts, _per_stage(f, "recompute", S=K * V, D=D)),
                 slices=_slices(f, V=V, tp=tp, seq_len=seq_len, family=family), sp=_sp(f, K=K, V=V, tp=tp,
                                                                                        seq_len=seq_len, family=family))


def _sp(f: Fields, *, K: int, V: int, tp: int, seq_len: int | None, family: str | None) -> bool:
    """``Phase.sp``: false when absent; true only where ``tp_split.sp_refusal`` allows it."""
    sp = f.bool("sp", False)
    why = sp_refusal(family, seq_len, tp, K=K, V=V, sliced=bool(f.raw("slices", []))) if sp else None
    if why:
        raise SchemaError(f.what, f"{f.path}.sp", why, "Re-run `ptplan plan`")
    return sp


def _profile_ref(f: Fields) -> ProfileRef:
    Fields(f.obj, f.what, f.path, allowed=_names(ProfileRef))
    path = f.raw("path", None)
    if path is not None and not isinstance(path, str):
        raise SchemaError(f.what, f"{f.path}.path", f"expected a string or null, got {path!r}")
    return ProfileRef(model=f.str("model"), family=f.str("family"), num_blocks=f.int("num_blocks", min=1),
                      num_layers=f.int("num_layers", min=1), granularity=f.str("granularity"),
                      seq_len=f.int("seq_len", min=1), dtype=f.str("dtype"), device=f.str("device"),
                      device_kind=f.str("device_kind"), fingerprint=f.str("fingerprint"),
                      source=f.str("source", "measured", choices=PROVENANCE_SOURCES),
                      batch_sizes=tuple(f.ints("batch_sizes", min=1)) if "batch_sizes" in f.obj else (), path=path)


def _inputs(f: Fields) -> PlanInputs:
    Fields(f.obj, f.what, f.path, allowed=_names(PlanInputs))
    try:
        cluster = cluster_from_json(f.raw("cluster"), source=f"{f.what}: {f.path}.cluster")
    except SchemaError as e:
        raise SchemaError(f.what, f"{f.path}.cluster.{e.field}", e.problem, e.fix) from None
    return PlanInputs(profile=_profile_ref(f.obj_("profile")), cluster=cluster,
                      training=training_from_json(f.obj_("training")), freeze=freeze_from_json(f.obj_("freeze")),
                      created=f.str("created", ""))


def _totals(f: Fields) -> Totals:
    Fields(f.obj, f.what, f.path, allowed=_names(Totals))
    def num(k: str) -> float:
        return f.float(k, 0.0 if k == "fill_seconds" else ..., min=0)

    return Totals(seconds=num("seconds"), samples=num("samples"), fill_seconds=num("fill_seconds"),
                  baseline_seconds=num("baseline_seconds"), speedup=num("speedup"),
                  best_static_seconds=num("best_static_seconds"), best_static_K=f.int("best_static_K", min=1),
                  best_static_M=f.int("best_static_M", min=1), speedup_vs_best_static=num("speedup_vs_best_static"))


def plan_from_json(obj: Any, source: str = "plan") -> Plan:
    """Validate a decoded JSON object and build a Plan; errors name the bad field."""
    top = Fields(obj, source, allowed=_names(Plan))
    schema = top.str("schema")
    if schema != SCHEMA:
        raise SchemaError(source, "schema", f"is {schema!r}, expected {SCHEMA!r}",
                          "Re-create the plan with `ptplan plan` (plans from older versions do not load)")
    inputs = _inputs(top.obj_("inputs"))
    num_layers, num_blocks = inputs.profile.num_layers, inputs.profile.num_blocks
    seq_len, family = inputs.profile.seq_len, inputs.profile.family
    phases = [_phase(p, num_layers, seq_len, family) for p in top.objs("phases")]
    steps: list[int] = top.ints("freeze_steps", min=0, max=num_blocks)
    traj = [_trajectory_point(t) for t in top.objs("trajectory")]
    b = top.obj_("baseline", allowed=("phase", "seconds"))
    baseline = Baseline(phase=_phase(b.obj_("phase"), num_layers, seq_len, family), seconds=b.float("seconds", min=0))
    warnings = []
    for w in top.objs("warnings") if "warnings" in top.obj else []:
        Fields(w.obj, w.what, w.path, allowed=_names(PlanWarning))
        warnings.append(PlanWarning(code=w.str("code", choices=WARNING_CODES), message=w.str("message")))
    plan = Plan(inputs=inputs, phases=tuple(phases), freeze_steps=tuple(steps), trajectory=tuple(traj),
                totals=_totals(top.obj_("totals")), baseline=baseline, warnings=tuple(warnings))
    from .plan_checks import check_plan

    check_plan(source, plan)  # every relation between the fields, in one place
    return plan


def _trajectory_point(t: Fields) -> TrajectoryPoint:
    """One trajectory entry, field by field (how it relates to the phases, epochs and freeze steps:
    ``plan_checks.check_trajectory``)."""
    Fields(t.obj, t.what, t.path, allowed=_names(TrajectoryPoint))
    return TrajectoryPoint(epoch=t.int("epoch", min=0), step=t.int("step", min=0), phase=t.int("phase", min=0),
                           frozen_blocks=t.int("frozen_blocks", min=0), iterations=t.int("iterations", min=0),
                           fill_iterations=t.int("fill_iterations", 0, min=0), seconds=t.float("seconds", min=0))


def load_plan(path: str | os.PathLike) -> Plan:
    """Load and validate a plan file."""
    return plan_from_json(read_json(path, "plan"), source=f"plan {os.fspath(path)}")


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Validate, then write atomically."""
    obj = plan.to_json()
    plan_from_json(json.loads(json.dumps(obj)), source="plan (before writing)")
    write_json(path, obj)
