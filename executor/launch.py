"""Launching a run: the torchrun command line for this node, and running it."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from .config import RunConfig


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """torchrun's launch and rendezvous flags (passed through unchanged)."""

    nproc_per_node: int
    nnodes: str = "1"
    """Nodes, or ``MIN:MAX`` (the world size must still equal the plan's K*D)."""
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_backend: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    """Restarts of the whole worker group on a failure; use with --resume to continue from the checkpoint."""

    def fixed_world(self) -> int | None:
        """nnodes × nproc_per_node when the node count is fixed, else None."""
        try:
            return int(self.nnodes) * self.nproc_per_node
        except ValueError:
            return None


def torchrun_args(rdzv: Rendezvous) -> list[str]:
    args = [f"--nproc-per-node={rdzv.nproc_per_node}", f"--nnodes={rdzv.nnodes}"]
    single = rdzv.nnodes == "1" and not rdzv.rdzv_endpoint and not rdzv.master_addr
    if single:
        args.append("--standalone")
    for flag, value in (("--node-rank", rdzv.node_rank), ("--rdzv-endpoint", rdzv.rdzv_endpoint),
                        ("--rdzv-id", rdzv.rdzv_id), ("--rdzv-backend", rdzv.rdzv_backend),
                        ("--master-addr", rdzv.master_addr), ("--master-port", rdzv.master_port)):
        if value is not None:
            args.append(f"{flag}={value}")
    args.append(f"--max-restarts={rdzv.max_restarts}")
    return args


def command(cfg: RunConfig, rdzv: Rendezvous) -> list[str]:
    """``python -m torch.distributed.run <rendezvous> -m ptplan.executor.worker --config <json>``."""
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(rdzv),
            "-m", "ptplan.executor.worker", "--config", cfg.to_json()]


def launch(cfg: RunConfig, rdzv: Rendezvous) -> int:
    """Run torchrun for this node and wait; returns its exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(command(cfg, rdzv), env=env).returncode
