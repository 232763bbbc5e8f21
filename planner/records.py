"""Typed run-log records: one frozen dataclass per record ``type`` of ``planner/runlog.py``'s ``FIELDS``.

The one definition of each record, for both sides: every writer of ``run.jsonl`` (the executor) builds one of these
and the reader (``runlog.read_run_log``) returns its steps as ``StepRecord``. Torch-free, like the rest of
``planner/``. Every writer and hands it to ``RunLog.write``; ``to_json`` is the JSON
boundary (the dict ``planner.runlog.parse_record`` checks). Two rules make ``to_json`` the dict the writers
built before these classes existed:

- a field whose default is ``None`` is left out while it is ``None`` (an optional key a writer adds only when
  it has a value: a step's ``lr``, a checkpoint's ``rss_growth_bytes``);
- a field without a default is always written, ``None`` as JSON ``null`` (``freeze_decision.grad_norms``
  before any norm was measured).

A JSON key that is not a Python name (``from``, ``async``) is the field's ``metadata["key"]`` (``key("from")``).

Adding a record kind is one class here: subclass ``RunRecord`` with ``TYPE = "<type>"`` and one field per key,
in a ``@dataclass(frozen=True, kw_only=True)``; the subclass registers itself in ``KINDS``. The reader's
contract is the kind's row in ``planner.runlog.FIELDS`` (which the class must match: ``tests/test_run_records.py``
checks the keys, which are optional, and that an instance passes ``parse_record`` and round-trips).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

SCHEMA = "ptplan.runlog/1"
"""The run log's schema tag (every header record carries it)."""

KINDS: dict[str, type[RunRecord]] = {}
"""Record type -> its class (every subclass of ``RunRecord`` registers itself)."""


def key(name: str) -> dict[str, str]:
    """Field metadata for a JSON key that is not a Python name."""
    return {"key": name}


def json_key(f: dataclasses.Field[Any]) -> str:
    """The JSON key of a record field."""
    return str(f.metadata.get("key", f.name))


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One line of ``run.jsonl``; subclasses set ``TYPE`` and declare the fields."""

    TYPE: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if not cls.TYPE or cls.TYPE in KINDS:
            raise TypeError(f"{cls.__name__}: TYPE must be a new record type, got {cls.TYPE!r}")
        KINDS[cls.TYPE] = cls

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this record (``type`` first, then the fields; see the module's two rules)."""
        out: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.default is None:
                continue
            out[json_key(f)] = v
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RunRecord:
        """The record of a JSON object of this ``type`` (keys as ``to_json`` writes them); TypeError on an unknown
        or missing key."""
        if obj.get("type") != cls.TYPE:
            raise TypeError(f"{cls.__name__} reads type {cls.TYPE!r}, not {obj.get('type')!r}")
        by_key = {json_key(f): f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(obj) - set(by_key) - {"type"})
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown keys {unknown}")
        return cls(**{by_key[k]: v for k, v in obj.items() if k != "type"})


def record_from_json(obj: Mapping[str, Any]) -> RunRecord:
    """The typed record of a run-log JSON object (its ``type`` picks the class); TypeError if none fits."""
    cls = KINDS.get(str(obj.get("type")))
    if cls is None:
        raise TypeError(f"no run-log record class for type {obj.get('type')!r}; known: {sorted(KINDS)}")
    return cls.from_json(obj)


@dataclass(frozen=True, kw_only=True)
class HeaderRecord(RunRecord):
    """The run's first record: what ran (plan, model, world, settings) and the plan's phases as read."""

    TYPE: ClassVar[str] = "header"
    schema: str = SCHEMA
    plan_fingerprint: str | None
    model: str
    world_size: int
    backend: str | None
    optimizer: str | None
    lr: float | None
    seed: int | None
    freeze: str | None
    freeze_every: int | None
    batch_policy: str | None
    epochs: int | None
    steps_per_epoch: int | None
    data: str | None
    samples: int | None
    plan: str | None
    phases: list[dict[str, Any]]
    """Per plan phase: frozen_blocks, K, D, M, b, schedule."""
    precision: str | None = None
    """Written only when not fp32."""


@dataclass(frozen=True, kw_only=True)
class StepRecord(RunRecord):
    """One optimizer step (rank 0's wall time; ``samples`` the global batch)."""

    TYPE: ClassVar[str] = "step"
    epoch: int
    step: int
    phase: int
    frozen_blocks: int
    K: int
    D: int
    seconds: float
    samples: int
    loss: float
    allreduce_seconds: float | None = None
    memory_sampled: bool | None = None
    peak_memory_bytes: int | None = None
    memory: dict[str, Any] | None = None
    lr: float | None = None
    grad_norm: float | None = None
    cache_hits: int | None = None
    """Rows rank 0 read from the AutoCache in this step (logged when it served any; older logs: None)."""
    cache_refreshes: int | None = None
    """Rows rank 0 refreshed from a smaller cached count (only the layers between the two counts ran)."""
    cache_misses: int | None = None
    """Rows rank 0 computed through the whole frozen prefix (and wrote, budget permitting)."""
    data_seconds: float | None = None
    """Seconds rank 0 spent producing its share of the batch (the data set's ``batch``: reading, collating, making
    synthetic samples), part of ``seconds``; no plan prices it (older logs: None)."""
    cache_seconds: float | None = None
    """Seconds rank 0 spent serving its shard's frozen-prefix output from the AutoCache (reads, refreshes, fills
    and writes), part of ``seconds``: the plan's ``cache_setup_s`` / ``fill_cache_setup_s`` (None where rank 0 did
    not: a phase that does not cache; older logs)."""

    @property
    def fill_fraction(self) -> float | None:
        """The share of the step's rows that the prefix computed (refreshed or missed), None when not logged."""
        h, r, m = self.cache_hits, self.cache_refreshes, self.cache_misses
        if h is None or r is None or m is None or h + r + m == 0:
            return None
        return (r + m) / (h + r + m)


@dataclass(frozen=True, kw_only=True)
class TransitionRecord(RunRecord):
    """A phase change: what moved and the seconds per part."""

    TYPE: ClassVar[str] = "transition"
    step: int
    from_phase: int | None
    to_phase: int
    seconds: float
    parts: dict[str, float]
    bytes: dict[str, int] | None = None
    from_: dict[str, int] | None = field(default=None, metadata=key("from"))
    to: dict[str, int] | None = None


@dataclass(frozen=True, kw_only=True)
class ResumeRecord(RunRecord):
    """A run continued from a checkpoint at ``step`` (the reader replaces what the log holds from it on)."""

    TYPE: ClassVar[str] = "resume"
    step: int
    epoch: int
    seconds: float
    phase: int | None = None
    parts: dict[str, float] | None = None
    bytes: dict[str, int] | None = None
    source_rank: int | None = None
    attempt: int | None = None


@dataclass(frozen=True, kw_only=True)
class FreezeDecisionRecord(RunRecord):
    """An adaptive freeze decision: the norms measured and the count chosen."""

    TYPE: ClassVar[str] = "freeze_decision"
    step: int
    T: int
    from_frozen: int
    to_frozen: int
    alpha: float
    grad_norms: list[float] | None
    steps_measured: int


@dataclass(frozen=True, kw_only=True)
class EpochEndRecord(RunRecord):
    """An epoch that ended before ``--steps-per-epoch`` (and why)."""

    TYPE: ClassVar[str] = "epoch_end"
    epoch: int
    steps: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class EvalRecord(RunRecord):
    """An evaluation on the held-out data."""

    TYPE: ClassVar[str] = "eval"
    epoch: int
    step: int
    phase: int
    loss: float
    samples: int
    seconds: float
    accuracy: float | None = None
    perplexity: float | None = None


@dataclass(frozen=True, kw_only=True)
class ExportRecord(RunRecord):
    """A Hugging Face folder written: ``kind`` "final", "best" (with the evaluation that made it best) or "model"."""

    TYPE: ClassVar[str] = "export"
    step: int
    path: str
    kind: str
    loss: float | None = None
    accuracy: float | None = None
    perplexity: float | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointRecord(RunRecord):
    """A sharded checkpoint save (``seconds``: the slowest rank's; async: the staging only)."""

    TYPE: ClassVar[str] = "checkpoint"
    step: int
    format: str
    async_: bool = field(metadata=key("async"))
    path: str
    seconds: float
    bytes_max: int
    bytes_total: int
    rss_growth_bytes: list[int] | None = None
    """Per rank: peak resident size during a synchronous write minus the size before."""


@dataclass(frozen=True, kw_only=True)
class CheckpointWrittenRecord(RunRecord):
    """An async checkpoint's background write committed (seconds from the save's start)."""

    TYPE: ClassVar[str] = "checkpoint_written"
    step: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class MembershipRecord(RunRecord):
    """An elastic job's world changed: the plans before and after, the step it went on from."""

    TYPE: ClassVar[str] = "membership"
    step: int
    resumed: bool
    attempt: int | None
    from_: dict[str, Any] = field(metadata=key("from"))
    to: dict[str, Any]
    replan_seconds: float | None


@dataclass(frozen=True, kw_only=True)
class CacheSetupRecord(RunRecord):
    """The AutoCache as set up (once, at the start)."""

    TYPE: ClassVar[str] = "cache_setup"
    job_id: str
    nodes: int
    dir: str
    spill_dir: str | None
    budget_bytes: int
    need_bytes: int
    plan_bytes_per_node: int
    sample_shape: list[int]
    dtype: str
    samples: int
    shard_rows: int
    phases: list[int]
    frozen_layers: list[int]
    allow_nondeterministic: bool
    notes: list[str]
    row_bytes: int | None = None
    refresh_bytes: int | None = None
    host_bytes_per_node: int | None = None
    plan_dtype: str | None = None


@dataclass(frozen=True, kw_only=True)
class CacheRecord(RunRecord):
    """The AutoCache after an epoch: that epoch's counters summed over the ranks, the run's totals, usage."""

    TYPE: ClassVar[str] = "cache"
    epoch: int
    step: int
    frozen_layers: int
    phase_caches: bool
    hits: int
    refreshes: int
    misses: int
    rows_written: int
    rows_not_cached: int
    slabs_evicted: int
    bytes_evicted: int
    slabs_promoted: int
    disk_full: int | None = None
    ram_bytes: int
    disk_bytes: int
    ram_slabs: int
    disk_slabs: int
    totals: dict[str, int]
