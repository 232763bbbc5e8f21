"""The run log (``run.jsonl``): a header, then one JSON object per step and per transition; rank 0 writes.

Every record is a typed class of ``records.py`` (one per ``type``); ``RunLog.write`` takes it. Records
(``ptplan compare`` reads them)::

    {"type": "header", "schema": "ptplan.runlog/1", "plan_fingerprint", "model", "world_size", ...}
    {"type": "step", "epoch", "step", "phase", "frozen_blocks", "K", "D", "seconds", "samples", "loss",
     "allreduce_seconds", "data_seconds", "cache_seconds"}
    {"type": "transition", "step", "from_phase", "to_phase", "seconds",
     "parts": {"weights", "optimizer_state", "groups", "rebuild"}, "bytes": {...}, ...}

``step`` counts optimizer steps from 0 over the whole run; ``phase`` indexes ``plan.phases``;
``seconds`` is rank 0's wall time of the step (it waits for the step's last collective);
``allreduce_seconds`` the part of it rank 0 spent averaging gradients over its data-parallel group,
``data_seconds`` making its batch and ``cache_seconds`` (caching phases) serving the frozen prefix from the
AutoCache.
On the sampled step of each phase visit (the 2nd) the record also holds ``memory_sampled: true``,
``peak_memory_bytes`` (the largest rank's stage working set) and ``memory`` (the method and every
rank's break-down); see ``executor/runtime/memory.py``. That step's ``seconds`` include the measuring hooks.
Also written: ``freeze_decision`` (adaptive freezing: the norms and the count chosen) and ``resume`` (the
step it continues from: ``planner.runlog`` replaces the records the first run wrote from that step on, so a
reader counts each step, evaluation, cache and export record once; the file keeps both, as they happened).
With the AutoCache (``executor/cache/run.py``): ``cache_setup`` once (directory, budget, the plan's
predicted bytes, accepted determinism notes) and ``cache`` after every epoch: that epoch's ``hits``,
``refreshes``, ``misses``, ``rows_written``, ``rows_not_cached``, ``slabs_evicted``, ``bytes_evicted``,
``slabs_promoted`` and ``disk_full`` (slabs not created because a cache folder's file system was full)
summed over the ranks, the run's ``totals`` of those, and ``ram_bytes``,
``disk_bytes``, ``ram_slabs``, ``disk_slabs`` in use (summed over the nodes, after the eviction).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
from typing import Any, Mapping

from ptplan.planner.errors import PtplanError
from ptplan.planner.runlog import SCHEMA, parse_record

from ptplan.planner.records import RunRecord, StepRecord, TransitionRecord


class RunLog:
    """Appends records to a JSON-lines file, one whole line per write; a no-op without a path.

    A new log (``append=False``) replaces the file only when the first step is logged: a run that fails
    before training leaves an existing log as it was (its records so far are kept in memory). A resumed
    log (``append=True``) is opened at once; a torn last line (a run killed or a disk filled while it was
    written) is cut off first, so the file stays readable. A write that fails (a full disk) is rolled
    back to the last whole line and raised as PtplanError. ``sync`` makes the file durable (fsync); the
    training loop calls it at phase changes, epoch ends and checkpoints, and ``close`` does.

    One job writes a log: the writer holds an exclusive lock (``flock``) on ``.<name>.lock`` beside it from its
    start to ``close`` (or its process's end), and a second writer is refused, naming the first's pid. An audit
    saw a node join a running elastic job (torchrun 2.13's c10d rendezvous) and start a job of its own from step 0
    on the same --log and checkpoint folder: the two overwrote each other's log and checkpoints.
    """

    def __init__(self, path: str | os.PathLike | None, *, append: bool = False, lock_wait_s: float = 0.0) -> None:
        self.path = None if path is None else os.fspath(path)
        self._fd: int | None = None
        self._size = 0
        self._pending: list[bytes] | None = None
        self._lock: int | None = None
        if self.path is None:
            return
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._lock = _hold(self.path, lock_wait_s)
        try:
            if append:
                self._open(truncate=False)
            else:
                self._pending = []
        except BaseException:
            self.close()
            raise

    def _open(self, *, truncate: bool) -> None:
        assert self.path is not None
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0), 0o666)
            size = os.fstat(self._fd).st_size
            if size and not truncate:
                with open(self.path, "rb") as f:  # cut a torn last line
                    f.seek(max(0, size - (1 << 20)))
                    tail = f.read()
                if not tail.endswith(b"\n"):
                    cut = tail.rfind(b"\n")
                    size = size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= len(tail) else size)
                    os.ftruncate(self._fd, size)
            self._size = size
        except OSError as e:
            raise PtplanError(f"cannot open the run log {self.path}: {e.strerror}") from None

    defer = False
    """Keep a write's PtplanError in ``error`` (and write nothing more) instead of raising it: set for the training
    loop, where rank 0 alone writes and raising there would leave the other ranks in the next collective; the loop
    raises it on every rank at its next agreement (``runtime.train_step``'s stop flag, the run's end)."""
    error: str | None = None
    """The deferred write error, if any."""

    def write(self, record: RunRecord | Mapping[str, Any]) -> None:
        """Check the record with the reader's own parser (``planner.runlog``), then append it. The run's writers
        pass typed records (``records.py``); a JSON object (tests, tools) is the same record at the boundary."""
        if self.path is None or self.error is not None:
            return
        try:
            self._write(record)
        except PtplanError as e:
            if not self.defer:
                raise
            self.error = str(e)

    def _write(self, record: RunRecord | Mapping[str, Any]) -> None:
        obj = record.to_json() if isinstance(record, RunRecord) else dict(record)
        rec = parse_record(json.loads(json.dumps(obj, default=_plain)), what="run log record (before writing)")
        line = (json.dumps(rec.to_json(), sort_keys=False) + "\n").encode()
        if self._pending is not None:
            self._pending.append(line)
            if rec.type != "step":
                return
            self._open(truncate=True)
            lines, self._pending = self._pending, None
            for ln in lines:
                self._append(ln)
            return
        self._append(line)

    def _append(self, line: bytes) -> None:
        assert self._fd is not None
        try:
            done = 0
            while done < len(line):
                done += os.pwrite(self._fd, line[done:], self._size + done)
        except OSError as e:
            try:
                os.ftruncate(self._fd, self._size)  # no torn line: the log ends at the last whole record
            except OSError:
                pass
            full = " (the disk is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
            raise PtplanError(f"cannot write the run log {self.path}: {e.strerror}{full}; it ends at the last "
                              f"whole record. Free space, then continue with --resume") from None
        self._size += len(line)

    def sync(self) -> None:
        """Make what was written durable (fsync); a no-op before the first step."""
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError:
                pass

    def header(self, **fields: Any) -> None:
        """A header of some of ``records.HeaderRecord``'s fields (tests and tools; the run writes the record)."""
        self.write({"type": "header", "schema": SCHEMA, **fields})

    def step(self, **fields: Any) -> None:
        """A ``records.StepRecord`` of these fields."""
        self.write(StepRecord(**fields))

    def transition(self, **fields: Any) -> None:
        """A ``records.TransitionRecord`` of these fields as JSON keys (``from``, ``to``: the phases' shapes)."""
        self.write(TransitionRecord.from_json({"type": TransitionRecord.TYPE, **fields}))

    def close(self) -> None:
        """Sync and close, and let another job write the log; a log that never reached a step leaves the file as
        it was."""
        self._pending = None
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def lock_path(log: str) -> str:
    """The lock file of run log ``log``: ``.<name>.lock`` beside it."""
    d, name = os.path.split(log)
    return os.path.join(d, f".{name}.lock")


def _hold(log: str, wait_s: float = 0.0) -> int | None:
    """An exclusive lock on ``lock_path(log)``, held by the returned descriptor; PtplanError naming the holder
    (host and pid) when another process still holds it after ``wait_s`` seconds (polled twice a second: on a
    shared file system a lost node's lock lasts until its lease ends, about 90 s on NFS, so a resuming run waits
    for it, up to --timeout or 120 s; a fresh start does not wait). None where the file system has no locks (the log
    is unguarded)."""
    import socket
    import time

    path = lock_path(log)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise PtplanError(f"cannot open the run log's lock file {path}: {e.strerror}; give a --log path that can "
                          f"be written") from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise PtplanError(f"another process ({holder}) is writing the run log {log}: two jobs on one --log "
                              f"would overwrite each other's records and checkpoints. A node that joins a running "
                              f"elastic job can start a job of its own (torchrun 2.13's c10d rendezvous); start "
                              f"the nodes together, or give this job its own --log and --checkpoint-dir (a lost "
                              f"node's lock on a shared file system ends with its lease)") from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return None
            raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode(), 0)
    return fd


def _plain(x: Any) -> Any:
    """JSON for numpy/torch scalars that slip into records."""
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"run log: {type(x).__name__} is not JSON")


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a run log, in order (for tests and tools; ``planner.compare`` has its own reader)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
