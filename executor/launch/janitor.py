"""The launcher's janitor: a small process that cleans up after ``ptplan run`` when it dies without doing so.

``launch`` starts it (``Janitor.start``) in its own session, holding the read end of a pipe whose write end
only the launcher has. The launcher tells it torchrun's pid (``agent <pid> <ticks>``) and, once it has
cleaned up itself, ``done``. When the pipe reaches its end without ``done`` -- the launcher was killed, even
by SIGKILL, which no handler sees -- the janitor does what the launcher's ``finally`` would have done:
stops torchrun and the workers that started (SIGTERM, then SIGKILL after ``GRACE_S``), waits until they
have ended, and removes the job's files (``launcher.sweep`` with the launcher's tag: the node's AutoCache
folder, dead workers' checkpoint temp files, the job folder). So ``kill -9`` of the launcher leaves nothing
in /dev/shm or the temp folder seconds later, without waiting for another run on the host.

    python -m ptplan.executor.launch.janitor --tag TAG --job-dir DIR --folder F [--folder F ...]

It imports no torch (it starts in a fraction of a second) and writes nothing but what it removes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import IO

GRACE_S = 3.0
"""Seconds torchrun and the workers get to end after SIGTERM before the janitor kills them."""


class Janitor:
    """The launcher's handle on its janitor process (``start``, then ``agent``, then ``done``)."""

    def __init__(self, proc: subprocess.Popen | None) -> None:
        self.proc = proc

    @classmethod
    def start(cls, tag: str, job_dir: str, folders: list[str | None]) -> "Janitor":
        """Start the janitor for the job ``tag`` (a handle that does nothing if it cannot start)."""
        args = [sys.executable, "-m", "ptplan.executor.launch.janitor", "--tag", tag, "--job-dir", job_dir]
        for f in dict.fromkeys(f for f in folders if f):
            args += ["--folder", f]
        try:
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)  # not in the terminal's group: Ctrl-C stops the launcher
        except OSError:
            return cls(None)
        return cls(proc)

    def _tell(self, line: str) -> None:
        stdin: IO[bytes] | None = self.proc.stdin if self.proc is not None else None
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(line.encode() + b"\n")
            stdin.flush()
        except OSError:
            pass  # the janitor is gone: nothing to tell

    def agent(self, pid: int, ticks: int | None) -> None:
        """torchrun's pid and start time (the janitor stops it if the launcher dies)."""
        self._tell(f"agent {pid} {ticks or 0}")

    def done(self) -> None:
        """The launcher has cleaned up: the janitor exits without doing anything."""
        if self.proc is None:
            return
        self._tell("done")
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


def _wait_ended(alive: list[tuple[int, int | None]], seconds: float) -> None:
    from ptplan.executor.launch.launcher import _is_running

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_is_running(pid, t) for pid, t in alive):
        time.sleep(0.05)


def clean_up(tag: str, job_dir: str, folders: list[str], agent: tuple[int, int | None] | None) -> list[str]:
    """Stop torchrun and the workers that started (their start markers in ``job_dir``), wait until they have
    ended, then remove the job's files; returns the paths removed."""
    from ptplan.executor.launch.launcher import _kill, _kill_workers, _read_markers, _signal_group, sweep

    workers = [(rec["pid"], rec.get("ticks")) for rec in _read_markers(job_dir)[0].values()]
    if agent is not None:
        _kill(agent[0], agent[1], signal.SIGTERM)  # torchrun stops its workers (it has had SIGTERM already)
    _wait_ended(workers + ([agent] if agent else []), GRACE_S)
    if agent is not None:
        _kill(agent[0], agent[1], signal.SIGKILL)
        _signal_group(agent[0], signal.SIGKILL)
    _kill_workers(job_dir, wait_s=GRACE_S)  # SIGKILL what still runs, and wait until it has ended
    removed, _ = sweep(list(folders), tag=tag)
    if os.path.isdir(job_dir):
        shutil.rmtree(job_dir, ignore_errors=True)
        removed.append(job_dir)
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ptplan.executor.launch.janitor", description=__doc__)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--folder", action="append", default=[])
    args = ap.parse_args(argv)
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(s, signal.SIG_IGN)
    agent: tuple[int, int | None] | None = None
    for raw in sys.stdin.buffer:
        words = raw.decode(errors="replace").split()
        if words == ["done"]:
            return 0
        if len(words) == 3 and words[0] == "agent":
            agent = (int(words[1]), int(words[2]) or None)
    clean_up(args.tag, args.job_dir, args.folder, agent)  # the launcher ended without "done"
    return 0


if __name__ == "__main__":
    sys.exit(main())
