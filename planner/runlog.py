"""The run-log contract (``run.jsonl``, ``ptplan.runlog/1``): typed records, one reader, used by the writer too.

One JSON object per line, each with a ``type``. ``ptplan run`` (rank 0) writes them through
``executor/training/runlog.py``, which passes every record through ``parse_record`` first, so a record that
this reader would refuse is never written; ``ptplan compare`` and ``ptplan show --run`` read them
with ``read_run_log``. Every field is checked by name (unknown keys are refused); a torn last line
(a run killed while writing) is left out with a warning instead of refusing the whole log.

Record types and their fields are in ``FIELDS``; the three that comparisons use have typed classes:
``Header``, ``Step`` and ``Transition``.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import PtplanError, SchemaError
from .jsonio import Fields
from .records import SCHEMA, StepRecord

Step = StepRecord
"""A step record as read (the writer's class: ``records.StepRecord`` is the one definition)."""


# field -> kind; a trailing "?" marks an optional field. kinds: int, float, str, bool, num (int or
# float), obj (a JSON object), list, any. The writer builds each type with its class in
# planner/records.py (a new type: its row here and one class there; tests/test_run_records.py checks both)
FIELDS: dict[str, dict[str, str]] = {
    "header": {"schema": "str", "plan_fingerprint": "str?", "model": "str", "world_size": "int",
               "backend": "str?", "optimizer": "str?", "lr": "float?", "seed": "int?", "freeze": "str?",
               "freeze_every": "int?", "batch_policy": "str?", "epochs": "int?", "steps_per_epoch": "int?",
               "data": "str?", "samples": "int?", "plan": "str?", "phases": "list", "precision": "str?"},
    "step": {"epoch": "int", "step": "int", "phase": "int", "frozen_blocks": "int", "K": "int", "D": "int",
             "seconds": "float", "samples": "int", "loss": "float", "allreduce_seconds": "float?",
             "memory_sampled": "bool?", "peak_memory_bytes": "int?", "memory": "obj?", "lr": "float?",
             "grad_norm": "float?", "cache_hits": "int?", "cache_refreshes": "int?", "cache_misses": "int?",
             "data_seconds": "float?", "cache_seconds": "float?"},
    "transition": {"step": "int", "from_phase": "int?", "to_phase": "int", "seconds": "float", "parts": "obj",
                   "bytes": "obj?", "from": "obj?", "to": "obj?"},
    "resume": {"step": "int", "epoch": "int", "phase": "int?", "seconds": "float", "parts": "obj?",
               "bytes": "obj?", "source_rank": "int?", "attempt": "int?"},
    "freeze_decision": {"step": "int", "T": "int", "from_frozen": "int", "to_frozen": "int", "alpha": "float",
                        "grad_norms": "list?", "steps_measured": "int"},
    "epoch_end": {"epoch": "int", "steps": "int", "reason": "str"},
    "eval": {"epoch": "int", "step": "int", "phase": "int", "loss": "float", "samples": "int", "seconds": "float",
             "accuracy": "float?", "perplexity": "float?"},
    # a Hugging Face folder written: kind "final" (--export), "best" (--export-best, with the evaluation that
    # made it best) or "model" (--save-model-every)
    "export": {"step": "int", "path": "str", "kind": "str", "loss": "float?", "accuracy": "float?",
               "perplexity": "float?"},
    # --checkpoint-format sharded: a save (seconds: the slowest rank's, the step blocked that long; async: the
    # staging only, and ``checkpoint_written`` when the background write is committed); rss_growth_bytes: per
    # rank, its peak resident size during a synchronous write minus the size before (Linux)
    "checkpoint": {"step": "int", "format": "str", "async": "bool", "path": "str", "seconds": "float",
                   "bytes_max": "int", "bytes_total": "int", "rss_growth_bytes": "list?"},
    "checkpoint_written": {"step": "int", "seconds": "float"},
    # an elastic job's world changed (--nnodes MIN:MAX): the plans before and after (world_size, plan_id, plan
    # file, phases), the step it went on from (after the ``resume`` record), the seconds spent re-planning
    "membership": {"step": "int", "resumed": "bool", "attempt": "int?", "from": "obj", "to": "obj",
                   "replan_seconds": "float?"},
    # need_bytes: the cache's RAM budget (rows at one count, plus refresh_bytes for a second while an epoch
    # refreshes); host_bytes_per_node: what the plan's plan_bytes_per_node counts (rows at one count and the frozen
    # weights kept in host memory, twice on a GPU: page-locked), from the run's model in its dtype (the plan's:
    # plan_dtype) and device; planner/cache_size.py
    "cache_setup": {"job_id": "str", "nodes": "int", "dir": "str", "spill_dir": "str?", "budget_bytes": "int",
                    "need_bytes": "int", "plan_bytes_per_node": "int", "sample_shape": "list", "dtype": "str",
                    "samples": "int", "shard_rows": "int", "phases": "list", "frozen_layers": "list",
                    "allow_nondeterministic": "bool", "notes": "list", "row_bytes": "int?", "refresh_bytes": "int?",
                    "host_bytes_per_node": "int?", "plan_dtype": "str?"},
    "cache": {"epoch": "int", "step": "int", "frozen_layers": "int", "phase_caches": "bool", "hits": "int",
              "refreshes": "int", "misses": "int", "rows_written": "int", "rows_not_cached": "int",
              "slabs_evicted": "int", "bytes_evicted": "int", "slabs_promoted": "int", "disk_full": "int?",
              "ram_bytes": "int",
              "disk_bytes": "int", "ram_slabs": "int", "disk_slabs": "int", "totals": "obj"},
}


POSITIVE = frozenset({("step", "seconds"), ("step", "K"), ("step", "D"), ("step", "samples"),
                      ("header", "world_size"), ("eval", "samples")})
"""Fields that must be > 0: a step takes time and trains samples; a world has a process."""
NON_NEGATIVE_SUFFIXES = ("seconds", "bytes", "step", "epoch", "phase", "frozen_blocks", "samples", "steps", "hits",
                         "misses", "refreshes", "rows_written", "rows_not_cached", "slabs_evicted", "slabs_promoted",
                         "ram_slabs", "disk_slabs", "disk_full", "nodes", "shard_rows", "T", "from_frozen", "to_frozen",
                         "steps_measured", "frozen_layers", "to_phase", "from_phase", "attempt", "source_rank")
"""Numeric fields (by name or name ending) that are never negative: times, sizes, counts and indices."""

NONFINITE_OK = frozenset({"loss", "grad_norm", "perplexity"})
"""Fields that may hold NaN or inf (what a diverging run measured); every other number must be finite."""


def _check(f: Fields, key: str, kind: str) -> Any:
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if optional and f.obj.get(key) is None:
        return None
    if kind == "int":
        return f.int(key)
    if kind == "float":
        v = f.raw(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise SchemaError(f.what, f"{f.path}.{key}", f"expected a number, got {v!r}")
        if not math.isfinite(v):
            if key in NONFINITE_OK:
                return v  # a diverged loss is recorded as NaN or inf; readers decide what to do with it
            raise SchemaError(f.what, f"{f.path}.{key}", f"is {v!r}; a run log holds finite {key}")
        return f.float(key)
    if kind == "str":
        return f.str(key)
    if kind == "bool":
        return f.bool(key)
    if kind == "obj":
        v = f.raw(key)
        if not isinstance(v, dict):
            raise SchemaError(f.what, f"{f.path}.{key}", f"expected an object, got {v!r}")
        return v
    if kind == "list":
        return f.list(key)
    return f.raw(key)  # pragma: no cover - every kind is listed above


def _check_sign(what: str, path: str, kind: str, key: str, v: Any) -> None:
    """``POSITIVE`` fields > 0, ``NON_NEGATIVE_SUFFIXES`` fields >= 0 (NaN passes here where it is allowed)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return
    where = f"{path}.{key}" if path else key
    if (kind, key) in POSITIVE and v <= 0:
        raise SchemaError(what, where, f"is {v!r}; a {kind} record's {key} is greater than 0")
    if key.endswith(NON_NEGATIVE_SUFFIXES) and v < 0:
        raise SchemaError(what, where, f"is {v!r}; it is never negative")


def _check_memory(what: str, path: str, memory: dict[str, Any]) -> None:
    """A step's sampled memory: ``per_rank`` a list of objects with a ``total`` of bytes >= 0 (the length is
    checked against the header's world size by ``read_run_log``)."""
    rows = memory.get("per_rank")
    where = f"{path}.memory.per_rank" if path else "memory.per_rank"
    if rows is None:
        return
    if not isinstance(rows, list) or not rows:
        raise SchemaError(what, where, f"expected a non-empty list of per-rank objects, got {rows!r}")
    for r, row in enumerate(rows):
        total = row.get("total") if isinstance(row, dict) else None
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise SchemaError(what, f"{where}[{r}].total", f"expected bytes >= 0, got {total!r}")


@dataclass(frozen=True, kw_only=True)
class Record:
    """One line of a run log: its type and its checked fields."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    line: int = 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, **{k: v for k, v in self.fields.items()}}


def parse_record(obj: Any, what: str = "run log record", line: int = 0) -> Record:
    """Check one decoded record against ``FIELDS``; SchemaError names the field."""
    top = Fields(obj, what, f"line {line}" if line else "")
    kind = top.str("type", choices=FIELDS)
    spec = FIELDS[kind]
    Fields(obj, what, top.path, allowed=("type", *spec))
    out = {}
    for key, k in spec.items():
        if key in obj or not k.endswith("?"):
            v = _check(top, key, k)
            if key in obj:
                out[key] = v
                _check_sign(what, top.path, kind, key, v)
    if isinstance(out.get("memory"), dict):
        _check_memory(what, top.path, out["memory"])
    for key in ("parts", "bytes"):  # transition and resume: seconds and bytes per part
        if kind in ("transition", "resume") and isinstance(out.get(key), dict):
            for part, v in out[key].items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise SchemaError(what, f"{top.path}.{key}.{part}" if top.path else f"{key}.{part}",
                                      f"expected a finite number >= 0 ({'seconds' if key == 'parts' else 'bytes'}), "
                                      f"got {v!r}")
    if kind == "header" and out["schema"] != SCHEMA:
        raise SchemaError(what, f"{top.path}.schema", f"is {out['schema']!r}, expected {SCHEMA!r}",
                          "The log was written by another version of ptplan run")
    return Record(type=kind, fields=out, line=line)


@dataclass(frozen=True, kw_only=True)
class Header:
    plan_fingerprint: str | None
    model: str
    world_size: int
    phases: tuple[dict[str, Any], ...]
    """Per plan phase: frozen_blocks, K, D, M, b, schedule (as the run read the plan)."""
    plan: str | None = None
    """The plan file the run was given (``ptplan run PLAN``), where recorded."""


@dataclass(frozen=True, kw_only=True)
class RunLog:
    """A run log read and checked: the header (if any), every step, every transition, all records."""

    path: str
    header: Header | None
    steps: tuple[Step, ...]
    transitions: tuple[Record, ...]
    records: tuple[Record, ...]
    warnings: tuple[str, ...] = ()
    resumes: tuple[dict[str, Any], ...] = ()
    """Per ``resume`` record: the step it continues from, its line, and how many step records the failed
    attempt had logged from that step on (``replaced_steps``: left out, the resumed run's count)."""
    memberships: tuple[dict[str, Any], ...] = ()
    """Per ``membership`` record (an elastic job's world changed): the step from which the steps ran the new plan,
    its line, and the record's ``from`` and ``to`` (world_size, plan_id, plan, phases)."""


_REPLAYED = ("step", "transition", "freeze_decision", "cache", "eval", "export")
"""Record types with a ``step`` that a resume from an earlier step writes again."""
_AT_CHECKPOINT = ("cache", "eval", "export")
"""Of those, the types a run may write at the checkpoint's own step before the checkpoint (an epoch's end, an
evaluation, a model export): kept at a resume, and replaced only if the resumed run writes them again."""


def _replay(records: list[Record], resume: Record) -> tuple[list[Record], int]:
    """What the log keeps at a ``resume`` from step s: everything written before the checkpoint (records
    before step s, and cache, eval and export records at step s), and how many step records it drops (the
    failed attempt's steps from s on, which the resumed run runs and logs again)."""
    at = resume.fields["step"]
    kept = [r for r in records if r.type not in _REPLAYED or r.fields["step"] < at
            or (r.type in _AT_CHECKPOINT and r.fields["step"] == at)]
    return kept, sum(1 for r in records if r.type == "step" and r.fields["step"] >= at)


def _once(r: Record) -> tuple[Any, ...] | None:
    """The key under which a record is written once per run (None: may repeat), so that a record a resumed
    run writes again replaces the first run's (its epoch's end, its evaluation at the checkpoint's step)."""
    f = r.fields
    keys = {"cache": ("step", "epoch"), "eval": ("step",), "export": ("step", "kind", "path"), "epoch_end": ("epoch",)}
    return (r.type, *(f.get(k) for k in keys[r.type])) if r.type in keys else None


def _keep_last(records: list[Record]) -> list[Record]:
    """Each ``_once`` key's last record, in the order of the records kept."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for r in reversed(records):
        key = _once(r)
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        out.append(r)
    return out[::-1]


def read_run_log(path: str | os.PathLike, *, require_steps: bool = True) -> RunLog:
    """Read and check ``run.jsonl``; errors name the line and the field. A torn last line is left out
    (with a warning in ``RunLog.warnings``). A ``resume`` record at step s replaces what the log holds
    from step s on (steps, transitions, freeze decisions, cache, eval and export records; ``_replay``): the
    resumed run writes them again (``RunLog.resumes`` says where and how many steps it replaced). A record the
    resumed run writes again at step s (an epoch's end) replaces the first run's (``_keep_last``). ``require_steps``
    False: a log with no step yet reads (a run resumed at its last step; the export's model card)."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().split("\n")
    except OSError as e:
        raise PtplanError(f"cannot read run log {p}: {e.strerror}") from None
    while lines and not lines[-1].strip():
        lines.pop()
    records: list[Record] = []
    warnings: list[str] = []
    resumes: list[dict[str, Any]] = []
    header_line = 0
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            if i == len(lines):
                warnings.append(f"run log {p}: line {i} is cut off (the run stopped while writing it); left out")
                break
            raise PtplanError(f"run log {p} line {i} is not JSON ({e.msg})") from None
        rec = parse_record(obj, what=f"run log {p}", line=i)
        if rec.type == "header" and header_line:
            raise PtplanError(f"run log {p} has a header on line {header_line} and another on line {i}: one run "
                              f"writes one header (a resumed run appends none), so these are two runs' logs in one "
                              f"file; compare each run's own log (lines {header_line}..{i - 1} are the first run's)")
        header_line = header_line or (i if rec.type == "header" else 0)
        if rec.type == "resume":  # the run continues from this step: what the first run logged from it on is replayed
            records, dropped = _replay(records, rec)
            resumes.append({"step": rec.fields["step"], "line": i, "replaced_steps": dropped})
        records.append(rec)
    records = _keep_last(records)
    h0 = next((r for r in records if r.type == "header"), None)
    steps: dict[int, Step] = {}
    world = None if h0 is None else h0.fields["world_size"]
    for r in records:
        if r.type == "membership" and isinstance(r.fields["to"].get("world_size"), int):
            world = r.fields["to"]["world_size"]  # the steps after it ran on the new world
        if r.type == "step":
            f = r.fields
            rows = (f.get("memory") or {}).get("per_rank")
            if world is not None and isinstance(rows, list) and len(rows) != world:
                raise SchemaError(f"run log {p}", f"line {r.line}.memory.per_rank", f"has {len(rows)} entries but the "
                                  f"run's world has {world} ranks (header.world_size or the last membership's)")
            steps[f["step"]] = Step(**f)
    if not steps and require_steps:
        raise PtplanError(f"run log {p} has no step records; was it written by `ptplan run --log`?")
    h = next((r for r in records if r.type == "header"), None)
    header = None if h is None else Header(plan_fingerprint=h.get("plan_fingerprint"), model=h.get("model"),
                                           world_size=h.get("world_size"), phases=tuple(h.get("phases") or ()),
                                           plan=h.get("plan"))
    return RunLog(path=p, header=header, steps=tuple(steps[k] for k in sorted(steps)),
                  transitions=tuple(r for r in records if r.type == "transition"), records=tuple(records),
                  warnings=tuple(warnings), resumes=tuple(resumes),
                  memberships=tuple({"step": r.fields["step"], "line": r.line, "from": r.fields["from"],
                                     "to": r.fields["to"]} for r in records if r.type == "membership"))
