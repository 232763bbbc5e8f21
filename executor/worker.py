"""torchrun entry point: one process of ``ptplan run`` (``python -m ptplan.executor.worker --config JSON``)."""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ptplan.executor.worker", description=__doc__)
    ap.add_argument("--config", required=True, help="RunConfig as JSON (written by `ptplan run`)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from ptplan.planner.errors import PtplanError
    from ptplan.planner.plan import load_plan

    from .config import RunConfig
    from .job import build_for_plan, make_dataset, pick_device
    from .training import run_training

    rank = int(os.environ.get("RANK", "0"))
    code = 0
    try:
        cfg = RunConfig.from_json(args.config)
        cfg = _resume_after_restart(cfg)
        device, backend = pick_device(cfg)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s),
                                device_id=device if device.type == "cuda" else None)
        plan = load_plan(cfg.plan)
        model = build_for_plan(plan, cfg)
        data = make_dataset(plan, cfg, model)
        summary = run_training(cfg, plan, model, data, device=device)
        if rank == 0:
            tr = ", ".join(f"{t['from_phase']}->{t['to_phase']} {t['seconds']:.2f} s" for t in summary.transitions)
            print(f"ptplan run: {summary.steps} steps in {summary.seconds:.1f} s, final loss "
                  f"{summary.final_loss if summary.final_loss is None else round(summary.final_loss, 5)}; "
                  f"transitions: {tr or 'none'}", flush=True)
        dist.destroy_process_group()
    except PtplanError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except BaseException:
        print(f"ptplan run: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)  # do not wait in atexit handlers for peers that may be gone
    return 0


def _resume_after_restart(cfg):
    """After a torchrun restart (--max-restarts), continue from the checkpoint if there is one."""
    from dataclasses import replace

    from .checkpoint import checkpoint_path

    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if restarted and cfg.checkpoint_dir and os.path.exists(checkpoint_path(cfg.checkpoint_dir)):
        return replace(cfg, resume=True)
    return cfg


if __name__ == "__main__":
    sys.exit(main())
