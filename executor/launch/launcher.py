"""Launching a run: the torchrun command line for this node, running it as the owner of its workers, and one
message for how it ended.

The launcher (``ptplan run``, one per node) owns what its workers start and make:

- **Processes.** torchrun runs in its own session, so the terminal's Ctrl-C reaches the launcher alone,
  with a parent-death signal (SIGTERM when the launcher dies, even by SIGKILL); each worker sets its own
  (SIGKILL when torchrun dies; ``die_with_parent``). SIGINT, SIGTERM and SIGHUP to the launcher are
  forwarded to torchrun, which stops the workers; whatever still runs ``GRACE_S`` later (or at a second
  signal) is killed. After a worker fails, the workers of that attempt that still run ``GRACE_S`` later
  are killed too (a stopped or wedged rank), so a failure ends the job in seconds.
- **Files.** The launcher's *tag* (``owner_tag``: a host hash, its pid and the pid's start time) names
  everything the job makes on this host: the AutoCache folders ``<cache root>/ptplan-<tag>-node<n>``
  (and the same name under ``--cache-spill-dir``), checkpoint temp files ``checkpoint.pt.tmp.<worker tag>``
  and the launcher's job folder ``<temp dir>/ptplan-job-<tag>-*`` (also torchrun's and the workers' TMPDIR, so
  torchrun's log folders go with it). After torchrun exits (whatever the
  reason), the launcher removes its cache folders, the temp files of dead workers and the job folder.
  When the launcher itself dies without doing so (SIGKILL), its janitor (``janitor.py``: a small process
  in its own session that watches a pipe only the launcher holds) stops torchrun and the workers and
  removes the same files, seconds later. A start also removes those whose owner is gone (``sweep``
  without a tag, in ``launch``): what a power cut (or a killed janitor) left.
- **Elastic jobs.** ``--nnodes MIN:MAX`` with a c10d rendezvous lets the node count change while the job runs
  (``Rendezvous.elastic``): torchrun restarts the worker group with the new world, and each worker re-plans for it
  from the plan's profile and settings, which the launcher hands over in ``PTPLAN_REPLAN`` (``replan.py``), and
  resumes from the last sharded checkpoint (``membership.py``); ``replan.check_elastic`` refuses a job that could
  not (no sharded ``--checkpoint-every`` checkpoint, no restarts, a per-pipeline batch, the profile file gone).
- **Messages.** Workers write ``a<attempt>-r<rank>.start`` (their pid) when they start and
  ``a<attempt>-r<rank>.json`` (kind, exception type, message, time) when they fail, into the job folder
  (``PTPLAN_JOB_DIR``); torchrun's output and the workers' stderr (tracebacks) go to the worker log.
  ``summarise`` picks the root cause -- a PtplanError first, then the earliest failure that is not a
  peer's consequence, then a rank that died without a word -- and ``ptplan run`` prints it as one line.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ptplan.planner.errors import PtplanError

from ptplan.executor.runtime.collective import ranks_text

if TYPE_CHECKING:  # the launcher and its janitor import no torch: they start (and clean up) in a blink
    from ptplan.executor.launch.replan import ReplanSettings
    from ptplan.executor.training.config import RunConfig

ENV_JOB_DIR = "PTPLAN_JOB_DIR"
"""The launcher's job folder (workers write their start markers and failures there)."""
ENV_JOB_TAG = "PTPLAN_JOB_TAG"
"""The launcher's tag (``owner_tag``): the node's AutoCache folder is named after it."""
GRACE_S = 5.0
"""Seconds the workers get to exit after a stop signal or a failed rank before they are killed."""
EXIT_SIGNAL_BASE = 128


# ---- owners: who made a file, and are they still there ---------------------------------------------

def host_hash() -> str:
    """8 hex digits naming this host (a file on a shared file system names the host that made it)."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc), None if it does not exist or has ended
    (a zombie: killed, not yet reaped -- a killed torchrun's workers wait for init to reap them); 0 where
    /proc is missing and the process exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # ended; its files are its launcher's to remove
        return None
    return int(fields[19])


def owner_tag(pid: int | None = None) -> str:
    """``j<host hash>-<pid>-<start ticks>``: names a live process uniquely on this host (pids are reused,
    start times are not)."""
    pid = os.getpid() if pid is None else pid
    return f"j{host_hash()}-{pid}-{_start_ticks(pid) or 0}"


_TAG = re.compile(r"j([0-9a-f]{8})-(\d+)-(\d+)")


def tag_is_stale(tag: str) -> bool:
    """Whether the process a tag names has ended (False for tags of other hosts: that host must judge)."""
    m = _TAG.fullmatch(tag)
    if not m or m[1] != host_hash():
        return False
    ticks = _start_ticks(int(m[2]))
    return ticks is None or (ticks != 0 and int(m[3]) != 0 and ticks != int(m[3]))


_CACHE_DIR = re.compile(r"ptplan-(j[0-9a-f]{8}-\d+-\d+)-node\d+")
_JOB_DIR = re.compile(r"ptplan-job-(j[0-9a-f]{8}-\d+-\d+)-.*")
_CKPT_TMP = re.compile(r"checkpoint\.pt\.tmp\.(j[0-9a-f]{8}-\d+-\d+)")


def _remove(path: str) -> int:
    """Remove a file or a folder tree; returns the bytes it held (0 if it was already gone)."""
    size = 0
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            for dirpath, _, files in os.walk(path):
                for f in files:
                    try:
                        size += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                    except OSError:
                        pass
            shutil.rmtree(path, ignore_errors=True)
        else:
            size = os.lstat(path).st_blocks * 512
            os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


def sweep(folders: list[str | None], *, tag: str | None = None) -> tuple[list[str], int]:
    """Remove ptplan's cache folders, job folders and checkpoint temp files in ``folders``: those of
    ``tag`` (this launcher's job, after it ended), or with ``tag=None`` those whose owner has ended.
    Returns (paths removed, bytes freed)."""
    removed, freed = [], 0
    for d in dict.fromkeys(f for f in folders if f):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            m = _CACHE_DIR.fullmatch(name) or _JOB_DIR.fullmatch(name) or _CKPT_TMP.fullmatch(name)
            if m is None:
                continue
            owner = m[1]
            mine = tag is not None and (owner == tag or (_CKPT_TMP.fullmatch(name) is not None and tag_is_stale(owner)))
            if mine or (tag is None and tag_is_stale(owner)):
                path = os.path.join(d, name)
                freed += _remove(path)
                removed.append(path)
    return removed, freed


def job_folders(cfg: RunConfig) -> list[str | None]:
    """Where a run of ``cfg`` leaves files on this host: the cache root, the spill folder, the checkpoint
    folder and the temp folder."""
    from ptplan.executor.cache.autocache import default_root

    return [cfg.cache_dir or default_root(), cfg.cache_spill_dir, cfg.checkpoint_dir, tempfile.gettempdir()]


# ---- the torchrun command line ----------------------------------------------------------------------

_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d+)")


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """torchrun's launch and rendezvous flags, checked on construction (``PtplanError`` naming the flag)."""

    nproc_per_node: int
    nnodes: str = "1"
    """Nodes: ``N``, or ``MIN:MAX`` with an elastic (c10d) rendezvous: when the node count changes, the workers
    re-plan for the new world size and resume from the last sharded checkpoint (``replan.check_elastic``)."""
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_backend: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    """Restarts of the whole worker group on a failure; a restart resumes from the newest checkpoint."""
    rdzv_conf: str | None = None
    """torchrun's ``--rdzv-conf`` (``KEY=VALUE,...``), e.g. ``last_call_timeout=2,keep_alive_interval=1``: how long
    an elastic rendezvous waits for more nodes, and how soon it drops a lost one."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise PtplanError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", self.nnodes)
        if not m:
            raise PtplanError(f"--nnodes {self.nnodes!r}: expected a node count such as 2 (or MIN:MAX such as 2:2)")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if lo < 1:
            raise PtplanError(f"--nnodes must be at least 1, got {self.nnodes!r}")
        if hi < lo:
            raise PtplanError(f"--nnodes {self.nnodes}: MIN is more than MAX; give MIN:MAX such as {hi}:{lo}")
        if lo != hi and (self.rdzv_backend != "c10d" or not self.rdzv_endpoint):
            raise PtplanError(f"--nnodes {self.nnodes}: the node count cannot vary without an elastic rendezvous "
                              f"(the job re-plans when it changes): add --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
                              f"--rdzv-id JOB, or pass --nnodes {hi} with a plan for {hi} x {self.nproc_per_node} "
                              f"processes")
        if self.node_rank is not None and not 0 <= self.node_rank < lo:
            raise PtplanError(f"--node-rank must lie in 0..{lo - 1} for --nnodes {lo}, got {self.node_rank}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise PtplanError(f"--master-port must be a TCP port in 1..65535, got {self.master_port}")
        if self.rdzv_endpoint is not None:
            e = _HOST_PORT.fullmatch(self.rdzv_endpoint)
            if not e or not 1 <= int(e[2]) <= 65535:
                raise PtplanError(f"--rdzv-endpoint {self.rdzv_endpoint!r}: expected HOST:PORT with a port in "
                                  f"1..65535, e.g. node1:29400")
        if self.max_restarts < 0:
            raise PtplanError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if self.rdzv_backend not in (None, "c10d", "static", "etcd", "etcd-v2"):
            raise PtplanError(f"--rdzv-backend {self.rdzv_backend!r}: use c10d (or static)")
        if self.rdzv_conf is not None and not re.fullmatch(r"\w+=[^,=\s]+(,\w+=[^,=\s]+)*", self.rdzv_conf):
            raise PtplanError(f"--rdzv-conf {self.rdzv_conf!r}: expected KEY=VALUE pairs joined by commas, e.g. "
                              f"last_call_timeout=2,join_timeout=60")

    def check_nodes(self) -> None:
        """Several nodes need a rendezvous every node can reach (checked after the world size)."""
        if self.nodes > 1 and not self.rdzv_endpoint and not self.master_addr:
            raise PtplanError(f"--nnodes {self.nodes} needs a rendezvous every node can reach: --rdzv-backend c10d "
                              f"--rdzv-endpoint HOST:PORT --rdzv-id JOB, or --master-addr HOST --master-port PORT "
                              f"--node-rank K")
        if (self.nodes > 1 and self.rdzv_backend in (None, "static") and not self.rdzv_endpoint
                and self.node_rank is None):
            raise PtplanError("a static rendezvous (--master-addr) needs --node-rank on each node; or use "
                              "--rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB")

    @property
    def nodes(self) -> int:
        """The node count the job starts with (MIN of MIN:MAX)."""
        return self.min_nodes

    @property
    def min_nodes(self) -> int:
        return int(self.nnodes.split(":")[0])

    @property
    def max_nodes(self) -> int:
        return int(self.nnodes.split(":")[-1])

    @property
    def elastic(self) -> bool:
        """Whether the node count may change while the job runs (MIN < MAX: the workers re-plan)."""
        return self.max_nodes > self.min_nodes

    def fixed_world(self) -> int:
        """nnodes × nproc_per_node (the node count is fixed: see ``nnodes``)."""
        return self.nodes * self.nproc_per_node


def torchrun_args(rdzv: Rendezvous) -> list[str]:
    nnodes = f"{rdzv.min_nodes}:{rdzv.max_nodes}" if rdzv.elastic else str(rdzv.nodes)
    args = [f"--nproc-per-node={rdzv.nproc_per_node}", f"--nnodes={nnodes}"]
    single = rdzv.nodes == 1 and not rdzv.rdzv_endpoint and not rdzv.master_addr
    if single:
        args.append("--standalone")
    for flag, value in (("--node-rank", rdzv.node_rank), ("--rdzv-endpoint", rdzv.rdzv_endpoint),
                        ("--rdzv-id", rdzv.rdzv_id), ("--rdzv-backend", rdzv.rdzv_backend),
                        ("--master-addr", rdzv.master_addr), ("--master-port", rdzv.master_port),
                        ("--rdzv-conf", rdzv.rdzv_conf)):
        if value is not None:
            args.append(f"{flag}={value}")
    args.append(f"--max-restarts={rdzv.max_restarts}")
    return args


def command(cfg: RunConfig, rdzv: Rendezvous) -> list[str]:
    """``python -m torch.distributed.run <rendezvous> -m ptplan.executor.launch.worker --config <json>``."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(rdzv),
            "-m", "ptplan.executor.launch.worker", "--config", cfg.to_json()]


def worker_log_path(log: str | None, rdzv: Rendezvous) -> str:
    """Where torchrun's output and the workers' tracebacks go: beside the run log, ``<stem>.workers.log``
    (``<stem>.node<k>.workers.log`` or ``<stem>.<host>-<pid>.workers.log`` on several nodes)."""
    base = log or os.path.abspath("run.jsonl")
    stem = base[:-len(".jsonl")] if base.endswith(".jsonl") else base
    if rdzv.max_nodes > 1:
        node = f"node{rdzv.node_rank}" if rdzv.node_rank is not None else f"{socket.gethostname()}-{os.getpid()}"
        stem = f"{stem}.{node}"
    return f"{stem}.workers.log"


# ---- the parent-death signal ------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int, parent: int | None = None) -> None:
    """Ask Linux to send ``sig`` to this process when its parent ends (kept across exec); exit at once if
    the parent (``parent``: its pid, when known) has already gone. A no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if (parent is not None and os.getppid() != parent) or os.getppid() == 1:
        os._exit(EXIT_SIGNAL_BASE + int(sig))


# ---- running torchrun -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    """How ``ptplan run`` ends: its exit code and, unless it succeeded, one line for the user."""

    code: int
    message: str | None
    worker_log: str
    removed: tuple[str, ...] = ()
    """Files and folders the launcher removed after the run (the job's caches, dead workers' temp files)."""
    swept: tuple[str, ...] = ()
    """Files and folders of ended ptplan jobs on this host that the launcher removed before starting
    (``sweep`` with no tag: what a SIGKILL of an earlier launcher or a power cut left)."""


class _Signals:
    """Records SIGINT, SIGTERM and SIGHUP while torchrun runs (the launcher forwards them)."""

    NAMES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        for s in self.NAMES:
            self._old[s] = signal.signal(s, self._on)
        return self

    def _on(self, signum: int, frame: Any) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _read_markers(job_dir: str) -> tuple[dict[tuple[int, int], dict[str, Any]], dict[tuple[int, int], dict[str, Any]]]:
    """({(attempt, rank): start record}, {(attempt, rank): failure record}) from the job folder."""
    starts: dict[tuple[int, int], dict[str, Any]] = {}
    fails: dict[tuple[int, int], dict[str, Any]] = {}
    try:
        names = os.listdir(job_dir)
    except OSError:
        return starts, fails
    for name in names:
        m = re.fullmatch(r"a(\d+)-r(\d+)\.(start|json)", name)
        if not m:
            continue
        try:
            with open(os.path.join(job_dir, name)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        (starts if m[3] == "start" else fails)[(int(m[1]), int(m[2]))] = rec
    return starts, fails


def _kill(pid: int, ticks: int | None, sig: int = signal.SIGKILL) -> None:
    """Signal a worker this launcher started (checked by its start time: pids are reused)."""
    if ticks is not None and _start_ticks(pid) not in (ticks, 0):
        return
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_workers(job_dir: str, attempt: int | None = None, *, wait_s: float = 0.0) -> None:
    """SIGKILL the workers (of one attempt, or all) that started; with ``wait_s``, wait up to that long until
    they have ended (a killed process's files are only safe to remove once it is gone)."""
    starts, fails = _read_markers(job_dir)
    mine = [rec for (a, _), rec in starts.items() if attempt is None or a == attempt]
    for rec in mine:
        _kill(rec["pid"], rec.get("ticks"))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_is_running(rec["pid"], rec.get("ticks")) for rec in mine):
        time.sleep(0.05)


def _is_running(pid: int, ticks: int | None) -> bool:
    """Whether the worker started as (pid, ticks) has not ended yet."""
    now = _start_ticks(pid)
    return now is not None and (ticks is None or now in (ticks, 0))


def _wait(proc: subprocess.Popen, job_dir: str, sigs: _Signals) -> int:
    """Wait for torchrun, forwarding stop signals and killing what outlives ``GRACE_S``."""
    forwarded: float | None = None
    killed = False
    seen_fail: dict[int, float] = {}
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if sigs.received and forwarded is None:
            forwarded = now
            _signal_group(proc.pid, signal.SIGTERM)
        if not killed and forwarded is not None and (len(sigs.received) > 1 or now - forwarded > GRACE_S):
            killed = True
            _signal_group(proc.pid, signal.SIGKILL)
            _kill_workers(job_dir)
        _, fails = _read_markers(job_dir)
        for a in {a for a, _ in fails}:
            first = seen_fail.setdefault(a, now)
            if now - first > GRACE_S:
                _kill_workers(job_dir, attempt=a)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(cfg: RunConfig, rdzv: Rendezvous, *, worker_log: str, replan: ReplanSettings | None = None) -> Outcome:
    """Run torchrun for this node as the owner of its workers (module docstring) and say how it ended.
    ``replan``: an elastic job's re-plan settings, handed to the workers (``replan.ENV_REPLAN``)."""
    tag = owner_tag()
    folders = job_folders(cfg)
    swept, _ = sweep(folders)  # what ended jobs left (their owner is gone): a SIGKILLed launcher, a power cut
    job_dir = tempfile.mkdtemp(prefix=f"ptplan-job-{tag}-")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env[ENV_JOB_DIR], env[ENV_JOB_TAG] = job_dir, tag
    env["TMPDIR"] = job_dir  # torchrun's own log folders and the workers' temp files go with the job folder
    # A fresh store for the workers of every rendezvous round (c10d): the shared one keeps the last round's
    # keys, and restarted gloo workers then connect to dead peers' addresses (connectFullMesh refused).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if replan is not None:
        from ptplan.executor.launch.replan import ENV_REPLAN

        env[ENV_REPLAN] = replan.to_env()
    proc: subprocess.Popen | None = None
    rc = 1
    me = os.getpid()
    sigs = _Signals()
    from ptplan.executor.launch.janitor import Janitor

    janitor = Janitor.start(tag, job_dir, folders)  # cleans up if this process dies without the finally below
    try:
        with sigs, open(worker_log, "w") as logf:
            proc = subprocess.Popen(command(cfg, rdzv), env=env, stderr=logf, start_new_session=True,
                                    preexec_fn=lambda: die_with_parent(signal.SIGTERM, me))
            janitor.agent(proc.pid, _start_ticks(proc.pid))
            rc = _wait(proc, job_dir, sigs)
    finally:
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        _kill_workers(job_dir, wait_s=10.0)
        starts, fails = _read_markers(job_dir)
        removed, _ = sweep(folders, tag=tag)
        shutil.rmtree(job_dir, ignore_errors=True)
        janitor.done()
    outcome = summarise(rc, starts, fails, worker_log=worker_log, signals=sigs.received, cfg=cfg)
    return Outcome(code=outcome.code, message=outcome.message, worker_log=worker_log,
                   removed=tuple(p for p in removed if not p.startswith(job_dir)), swept=tuple(swept))


# ---- one message for how it ended ---------------------------------------------------------------------

_PEER = re.compile(r"closed by peer|reset by peer|Connection reset|Connection refused|Broken pipe|timed out|"
                   r"Timed out|timeout|connectFullMesh|DistNetworkError|DistBackendError|Socket Timeout|"
                   r"NCCL communicator was aborted|has been aborted|No route to host", re.IGNORECASE)


def _exit_codes(worker_log: str) -> dict[int, int]:
    """Per global rank, the exit code torchrun reported for a failed worker (negative: killed by a signal)."""
    try:
        with open(worker_log, errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for m in re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text):
        out[int(m[1])] = int(m[2])
    return out


def _how(code: int | None) -> str:
    if code is None:
        return "no exit status known"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _last_error_line(worker_log: str) -> str | None:
    try:
        with open(worker_log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        m = re.match(r"\s*([A-Za-z_][\w.]*(?:Error|Exception)): (.+)", line)
        if m and "ChildFailedError" not in m[1]:
            return f"{m[1].rsplit('.', 1)[-1]}: {m[2].strip()}"
    return None


def _checkpoint_hint(cfg: RunConfig | None) -> str:
    if cfg is None or not cfg.checkpoint_dir:
        return ""
    from ptplan.executor.training.checkpoint import checkpoint_path

    path = checkpoint_path(cfg.checkpoint_dir)
    return f"; {path} holds the last checkpoint (--resume continues from it)" if os.path.exists(path) else ""


def summarise(rc: int, starts: dict[tuple[int, int], dict[str, Any]], fails: dict[tuple[int, int], dict[str, Any]],
              *, worker_log: str, signals: list[int] = (), cfg: RunConfig | None = None) -> Outcome:  # type: ignore[assignment]
    """The exit code and the one line for a run that ended with torchrun exit code ``rc`` (see the module
    docstring for the order in which causes are picked)."""
    where = f"torchrun's output and the workers' tracebacks are in {worker_log}"
    if signals:
        sig = signal.Signals(signals[0])
        return Outcome(EXIT_SIGNAL_BASE + sig.value,
                       f"stopped by {sig.name}{' (Ctrl-C)' if sig == signal.SIGINT else ''}: every worker was "
                       f"stopped and the job's cache files removed{_checkpoint_hint(cfg)}", worker_log)
    if rc == 0:
        return Outcome(0, None, worker_log)
    if rc < 0:
        return Outcome(1, f"torchrun (the worker agent) was {_how(rc)}; its workers were stopped and the job's cache "
                          f"files removed{_checkpoint_hint(cfg)}", worker_log)
    attempts = {a for a, _ in starts} | {a for a, _ in fails}
    if not attempts:
        last = _last_error_line(worker_log)
        return Outcome(1, f"torchrun failed before any worker started (exit code {rc})"
                          + (f": {last}" if last else "") + f"; {where}", worker_log)
    a = max(attempts)
    restarts = f" (attempt {a + 1}, after {a} restart{'s' if a > 1 else ''})" if a else ""
    told = [(x, f) for (x, _), f in sorted(fails.items()) if x < a and f["kind"] == "ptplan"]
    if told:  # an earlier attempt said why it stopped; a later one that says nothing is told with it
        x, f = told[-1]
        ranks = sorted(r for (y, r), g in fails.items() if y == x and g.get("message") == f["message"])
        before = f"; attempt {x + 1} before it: {ranks_text(ranks)}: {f['message']}"
    else:
        before = ""
    mine = {r: f for (x, r), f in fails.items() if x == a}
    started = {r for (x, r) in starts if x == a}
    ptplan = sorted(((f["time"], r) for r, f in mine.items() if f["kind"] == "ptplan"))
    if ptplan:
        msg = mine[ptplan[0][1]]["message"]
        ranks = [r for r, f in mine.items() if f["kind"] == "ptplan" and f["message"] == msg]
        return Outcome(2, f"{ranks_text(ranks)}: {msg}{restarts}", worker_log)
    own = sorted((f["time"], r) for r, f in mine.items() if not _PEER.search(f"{f['type']}: {f['message']}"))
    if own:
        r = own[0][1]
        f = mine[r]
        return Outcome(1, f"rank {r} failed{restarts}: {f['type']}: {_one_line(f['message'])}; {where}", worker_log)
    silent = sorted(started - set(mine))
    if silent:
        codes = _exit_codes(worker_log)
        # torchrun stops the surviving workers with SIGTERM once one has died: those are not the cause where
        # another silent rank died otherwise (a worker's SIGKILL, out of memory, an exit code)
        torn = [r for r in silent if codes.get(r) == -signal.SIGTERM.value]
        cause = [r for r in silent if r not in torn] or silent
        hows = sorted({_how(codes.get(r)) for r in cause})
        peers = f"; the other ranks then failed waiting for {'it' if len(cause) == 1 else 'them'}" if mine else ""
        torn = [r for r in torn if r not in cause]
        then = f"; torchrun then stopped {ranks_text(torn)} (SIGTERM)" if torn else ""
        return Outcome(1, f"{ranks_text(cause)} stopped without an error message{restarts} ({', '.join(hows)}: "
                          f"killed, out of memory, or stuck past --timeout){peers}{then}{before}; {where}", worker_log)
    if mine:
        t, r = min((f["time"], r) for r, f in mine.items())
        f = mine[r]
        return Outcome(1, f"rank {r} failed{restarts}: {f['type']}: {_one_line(f['message'])}; {where}", worker_log)
    return Outcome(1, f"the workers failed (torchrun exit code {rc}){restarts}{before}; {where}", worker_log)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 3] + "..."
