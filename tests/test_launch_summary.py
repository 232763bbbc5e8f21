"""``launcher.summarise`` names the cause of a failed job from torchrun's report and the workers' records (fast: the
real launches are in ``tests/test_robustness_launch.py``)."""
from __future__ import annotations

import pytest

from ptplan.executor.launch.launcher import summarise

TORCHRUN_FAILURES = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Failures:
[1]:
  time      : 2026-11-27_19:10:01
  host      : box
  rank      : {other} (local_rank: {other})
  exitcode  : {other_code} (pid: 1234)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_19:10:01
  host      : box
  rank      : {dead} (local_rank: {dead})
  exitcode  : {dead_code} (pid: 1235)
============================================================
"""


def _log(tmp_path, dead: int, dead_code: int, other: int, other_code: int) -> str:
    log = tmp_path / "run.workers.log"
    log.write_text(TORCHRUN_FAILURES.format(dead=dead, dead_code=dead_code, other=other, other_code=other_code))
    return str(log)


STARTS = {(0, 0): {"pid": 1}, (0, 1): {"pid": 2}}


def test_a_rank_torn_down_by_torchrun_is_not_blamed_with_the_one_that_died(tmp_path):
    """kill -9 of rank 1: torchrun then SIGTERMs rank 0 before it writes a word (a race the real test lost under
    load: 'ranks 0-1 stopped ... (killed by SIGKILL, killed by SIGTERM ...)'). Rank 1 is the cause, rank 0 is named
    as stopped by torchrun."""
    out = summarise(1, STARTS, {}, worker_log=_log(tmp_path, 1, -9, 0, -15))
    assert out.code == 1
    assert out.message.startswith("rank 1 stopped without an error message (killed by SIGKILL: "), out.message
    assert "torchrun then stopped rank 0 (SIGTERM)" in out.message and "SIGTERM:" not in out.message


SILENT = "ranks 0-1 stopped without an error message"


@pytest.mark.parametrize("codes, want", [((-15, -15), f"{SILENT} (killed by SIGTERM"),
                                         ((-9, -9), f"{SILENT} (killed by SIGKILL"),
                                         ((-9, 1), f"{SILENT} (exit code 1, killed by SIGKILL")])
def test_ranks_that_all_died_alike_or_otherwise_are_all_named(tmp_path, codes, want):
    """Every silent rank SIGTERMed (from outside: nothing else to blame), or none of them: all are named."""
    out = summarise(1, STARTS, {}, worker_log=_log(tmp_path, 1, codes[0], 0, codes[1]))
    assert out.message.startswith(want), out.message
    assert "torchrun then stopped" not in out.message


def test_a_dead_rank_whose_peer_failed_waiting_is_named_with_the_peer(tmp_path):
    fails = {(0, 0): {"kind": "other", "type": "DistBackendError", "message": "Connection closed by peer",
                      "time": 1.0}}
    out = summarise(1, STARTS, fails, worker_log=_log(tmp_path, 1, -9, 0, 1))
    assert out.message.startswith("rank 1 stopped without an error message (killed by SIGKILL: "), out.message
    assert "the other ranks then failed waiting for it" in out.message


def test_a_silent_last_attempt_is_told_with_the_earlier_attempts_reason(tmp_path):
    """A job refused by the run log's lock (another job writes it), then restarted by torchrun and torn down when
    the store went away: the summary said only "rank 0 stopped without an error message (attempt 2 ...)". The
    earlier attempt's reason is told with it."""
    starts = {(0, 0): {"pid": 1}, (1, 0): {"pid": 2}}
    fails = {(0, 0): {"kind": "ptplan", "message": "another process (host box, pid 7) is writing the run log x",
                      "time": 1.0, "type": "PtplanError"}}
    log = tmp_path / "run.workers.log"
    log.write_text("")
    out = summarise(1, starts, fails, worker_log=str(log))
    assert out.code == 1 and "rank 0 stopped without an error message (attempt 2, after 1 restart)" in out.message
    assert "; attempt 1 before it: rank 0: another process (host box, pid 7) is writing the run log x" in out.message
