"""torchrun entry point: one process of ``ptplan run`` (``python -m ptplan.executor.launch.worker --config JSON``).

A worker dies with torchrun (parent-death signal), says when it starts and how it failed in the
launcher's job folder (``executor/launch/launcher.py``: the launcher turns that into one message), and writes
tracebacks of unexpected failures to stderr, which the launcher sends to the worker log. Started by
hand (torchrun without ``ptplan run``), it prints ``error: rank R: ...`` to stderr instead.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any


class Reporter:
    """This worker's start marker and failure record in the launcher's job folder (none without one)."""

    def __init__(self) -> None:
        from ptplan.executor.launch.launcher import ENV_JOB_DIR, _start_ticks

        self.dir = os.environ.get(ENV_JOB_DIR) or None
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.stem = f"a{self.attempt}-r{self.rank}"
        if self.dir:
            self._write("start", {"rank": self.rank, "attempt": self.attempt, "pid": os.getpid(),
                                  "ticks": _start_ticks(os.getpid())})

    def _write(self, ext: str, record: dict[str, Any]) -> None:
        assert self.dir is not None
        tmp = os.path.join(self.dir, f".{self.stem}.{ext}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, os.path.join(self.dir, f"{self.stem}.{ext}"))
        except OSError:
            pass  # the launcher is gone or its folder too: nothing to tell

    def fail(self, kind: str, exc: BaseException) -> None:
        """Record a failure: ``kind`` "ptplan" (a PtplanError: the message is for the user) or "crash"."""
        message = str(exc) or type(exc).__name__
        if self.dir:
            self._write("json", {"rank": self.rank, "attempt": self.attempt, "pid": os.getpid(), "kind": kind,
                                 "type": type(exc).__name__, "message": message, "time": time.time()})
        else:
            print(f"error: rank {self.rank}: {message}", file=sys.stderr, flush=True)


def _init_process_group(backend: str, timeout_s: float, device) -> None:
    """The default process group from torchrun's environment, its keys apart per restart.

    When the workers use the agent's own store (a static rendezvous, or c10d with a shared store), that
    store outlives a restart and still holds the failed attempt's keys, so restarted gloo workers would
    read dead peers' addresses; the keys then go under ``ptplan/attempt<TORCHELASTIC_RESTART_COUNT>``.
    (``ptplan run`` gives c10d a fresh store per round: ``launch``.)
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    device_id = device if device.type == "cuda" else None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"ptplan/attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout,
                            device_id=device_id)


def run_job(cfg: Any, device: Any) -> tuple[Any, Any]:
    """One worker's training on an initialised default process group: the plan for this world (re-planned when an
    elastic job's world is not the plan's: ``membership.plan_for_world``), this rank's stage of the phase it starts
    in (phase 0's, or the checkpoint's), the data, then ``run_training``. Returns (the run's summary, the config
    it ran: ``cfg.plan`` names the re-planned plan)."""
    import torch.distributed as dist

    from ptplan.planner.plan import load_plan

    from ptplan.executor.data.dataset import load_dataset
    from ptplan.executor.families import model_source
    from ptplan.executor.launch.membership import plan_for_world
    from ptplan.executor.launch.replan import ReplanSettings
    from ptplan.executor.training.job import build_for_plan, file_dataset, make_dataset, samples_needed
    from ptplan.executor.training.loop import run_training, stage_layers, start_phase

    cfg, plan, change = plan_for_world(cfg, load_plan(cfg.plan), ReplanSettings.from_env())
    loaded = None if cfg.data == "synthetic" else file_dataset(plan, cfg)  # the plan's epoch of the file
    # this rank builds only its stage of the phase it starts in (phase 0's, or the checkpoint's)
    first = start_phase(cfg, plan, model_name=model_source(cfg.model, cfg.weights).label,
                        samples=samples_needed(plan, cfg) if loaded is None else len(loaded))
    model = build_for_plan(plan, cfg, layers=stage_layers(plan, first, dist.get_rank()))
    data = loaded if loaded is not None else make_dataset(plan, cfg, model)
    evald = None if cfg.eval_data is None else load_dataset(cfg.eval_data)
    summary = run_training(cfg, plan, model, data, device=device, eval_dataset=evald,
                           callbacks=[change] if change is not None else [])
    return summary, cfg


def main(argv: list[str] | None = None) -> int:
    from ptplan.executor.launch.launcher import die_with_parent

    die_with_parent(signal.SIGKILL)  # torchrun gone (even by SIGKILL) -> this worker goes too
    ap = argparse.ArgumentParser(prog="ptplan.executor.launch.worker", description=__doc__)
    ap.add_argument("--config", required=True, help="RunConfig as JSON (written by `ptplan run`)")
    args = ap.parse_args(argv)
    report = Reporter()

    code = 0
    try:
        import torch
        import torch.distributed as dist

        from ptplan.planner.errors import PtplanError

        from ptplan.executor.training.config import RunConfig
        from ptplan.executor.training.job import pick_device

        try:
            cfg = RunConfig.from_json(args.config)
            device, backend = pick_device(cfg)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            _init_process_group(backend, cfg.timeout_s, device)
            summary, cfg = run_job(cfg, device)
            if report.rank == 0:
                tr = ", ".join(f"{t['from_phase']}->{t['to_phase']} {t['seconds']:.2f} s" for t in summary.transitions)
                loss = ("no step ran (the checkpoint was at the run's end)" if summary.final_loss is None else
                        f"final loss {round(summary.final_loss, 5)}")
                print(f"ptplan run: {summary.steps} steps in {summary.seconds:.1f} s, {loss}; "
                      f"transitions: {tr or 'none'}"
                      + (f"; held-out {summary.evals[-1].words()}" if summary.evals else "")
                      + (f"; exported to {cfg.export}" if cfg.export else ""), flush=True)
            dist.destroy_process_group()
        except PtplanError as e:
            report.fail("ptplan", e)
            code = 2
    except BaseException as e:
        print(f"ptplan run: rank {report.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        report.fail("crash", e)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # do not wait in atexit handlers for peers that may be gone
    return 0


if __name__ == "__main__":
    code = main()  # a failure already left through os._exit; stdout and stderr are flushed
    # Every output is written (the run log is unbuffered, checkpoints and exports closed) and the process group
    # destroyed: skip the interpreter's teardown of torch's C++ state, which can abort a finished worker
    # ("terminate called without an active exception" at exit after a gloo run with sequence parallelism, seen
    # once in several suite runs) and turn a finished job into a failure.
    os._exit(code)
