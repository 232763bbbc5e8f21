"""The run log (``run.jsonl``): a header, then one JSON object per step and per transition; rank 0 writes.

Records (``ptplan compare`` reads them)::

    {"type": "header", "schema": "ptplan.runlog/1", "plan_fingerprint", "model", "world_size", ...}
    {"type": "step", "epoch", "step", "phase", "frozen_blocks", "K", "D", "seconds", "samples", "loss",
     "allreduce_seconds"}
    {"type": "transition", "step", "from_phase", "to_phase", "seconds",
     "parts": {"weights", "optimizer_state", "groups", "rebuild"}, "bytes": {...}, ...}

``step`` counts optimizer steps from 0 over the whole run; ``phase`` indexes ``plan.phases``;
``seconds`` is rank 0's wall time of the step (it waits for the step's last collective);
``allreduce_seconds`` the part of it rank 0 spent averaging gradients over its data-parallel group.
On the sampled step of each phase visit (the 2nd) the record also holds ``memory_sampled: true``,
``peak_memory_bytes`` (the largest rank's stage working set) and ``memory`` (the method and every
rank's break-down); see ``executor/memory.py``. That step's ``seconds`` include the measuring hooks.
Also written: ``freeze_decision`` (adaptive freezing: the norms and the count chosen) and ``resume``.
With the AutoCache (``executor/cache_run.py``): ``cache_setup`` once (directory, budget, the plan's
predicted bytes, accepted determinism notes) and ``cache`` after every epoch: that epoch's ``hits``,
``refreshes``, ``misses``, ``rows_written``, ``rows_not_cached``, ``slabs_evicted``, ``bytes_evicted``,
``slabs_promoted`` summed over the ranks, the run's ``totals`` of those, and ``ram_bytes``,
``disk_bytes``, ``ram_slabs``, ``disk_slabs`` in use (summed over the nodes, after the eviction).
"""
from __future__ import annotations

import json
import os
from typing import Any, TextIO

from ptplan.planner.runlog import SCHEMA, parse_record


class RunLog:
    """Appends records to a JSON-lines file, one flushed line each; a no-op without a path."""

    def __init__(self, path: str | os.PathLike | None, *, append: bool = False) -> None:
        self._f: TextIO | None = None
        if path is not None:
            d = os.path.dirname(os.fspath(path))
            if d:
                os.makedirs(d, exist_ok=True)
            self._f = open(path, "a" if append else "w", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        """Check the record with the reader's own parser (``planner.runlog``), then append it."""
        if self._f is not None:
            rec = parse_record(json.loads(json.dumps(record, default=_plain)), what="run log record (before writing)")
            self._f.write(json.dumps(rec.to_json(), sort_keys=False) + "\n")
            self._f.flush()

    def header(self, **fields: Any) -> None:
        self.write({"type": "header", "schema": SCHEMA, **fields})

    def step(self, *, epoch: int, step: int, phase: int, frozen_blocks: int, K: int, D: int, seconds: float,
             samples: int, loss: float, **extra: Any) -> None:
        self.write({"type": "step", "epoch": epoch, "step": step, "phase": phase, "frozen_blocks": frozen_blocks,
                    "K": K, "D": D, "seconds": seconds, "samples": samples, "loss": loss, **extra})

    def transition(self, *, step: int, from_phase: int | None, to_phase: int, seconds: float,
                   parts: dict[str, float], **extra: Any) -> None:
        self.write({"type": "transition", "step": step, "from_phase": from_phase, "to_phase": to_phase,
                    "seconds": seconds, "parts": parts, **extra})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _plain(x: Any) -> Any:
    """JSON for numpy/torch scalars that slip into records."""
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"run log: {type(x).__name__} is not JSON")


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a run log, in order (for tests and tools; ``planner.compare`` has its own reader)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
