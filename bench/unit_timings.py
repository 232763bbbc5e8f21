"""Timings that used to be wall-clock assertions in unit tests (issue 24), measured here instead: a unit test
passes on any machine, loaded or not; these numbers say how fast the pieces are on the machine that runs this.

- the optimal partition of 200 layers into K = 8, 32, 64 stages (tests/test_partition.py's large call);
- one simulated 1F1B iteration, K = 8, M = 32 (mean of 50) and K = 64, M = 256 (tests/test_simulate.py);
- a TrainingConfig refused on construction (tests/test_plan.py);
- the bounds that replaced hangs: ``ptplan plan`` with --batch 1e9 --samples-per-epoch 1e9 (refused in closed
  form), and the plan reader's schedule checks on a plan with K=2 phases (in-process).

    python bench/unit_timings.py [--out bench/results/unit_timings.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from ptplan.planner.config import TrainingConfig
from ptplan.planner.errors import PtplanError
from ptplan.planner.partition import optimal_partition
from ptplan.planner.schedule import build_schedule
from ptplan.planner.simulate import StageCost, simulate

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]


def _best_of(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def partition_200() -> None:
    rng = random.Random(3)
    n = 200
    costs = [rng.uniform(0.5, 1.5) for _ in range(n)]
    boundary = [rng.uniform(0.0, 0.2) for _ in range(n)]
    memory = [rng.uniform(1.0, 2.0) * GiB for _ in range(n)]
    for K in (8, 32, 64):
        optimal_partition(costs, K, boundary_s=boundary, stage0_extra_s=3.0, memory=memory,
                          stage0_extra_memory=2 * GiB, memory_limit=80 * GiB)


def simulate_once(K: int, M: int) -> Callable[[], object]:
    s = build_schedule("1f1b", K, M)
    costs = [StageCost(forward_s=1e-3, backward_s=2e-3) for _ in range(K)]
    simulate(s, costs)  # compiled once
    return lambda: simulate(s, costs)


def refused_config() -> None:
    try:
        TrainingConfig(epochs=10**9, samples_per_epoch=100, batch=8)
    except PtplanError:
        return
    raise AssertionError("not refused")


def cli_seconds(args: list[str]) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "ptplan.cli.main", *args], capture_output=True, text=True,
                       timeout=600, cwd=os.environ.get("TMPDIR", "/tmp"))
    return time.perf_counter() - t0, r.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "unit_timings.json"))
    a = ap.parse_args()
    rows: list[tuple[str, float, str]] = []
    rows.append(("optimal_partition 200 layers, K = 8, 32, 64", _best_of(partition_200), "s (best of 5)"))
    sim8 = simulate_once(8, 32)
    rows.append(("simulate 1F1B K=8 M=32", statistics.mean(_best_of(sim8, 1) for _ in range(50)), "s (mean of 50)"))
    rows.append(("simulate 1F1B K=64 M=256", _best_of(simulate_once(64, 256)), "s (best of 5)"))
    rows.append(("TrainingConfig(epochs=1e9) refused", _best_of(refused_config), "s (best of 5)"))
    secs, rc = cli_seconds(["plan", "bert-tiny", "--cluster", "cpu:2", "--batch", "1000000000", "--samples-per-epoch",
                            "1000000000", "--out", "unit_timings_plan.json", "--quiet"])
    rows.append((f"ptplan plan --batch 1e9 --samples-per-epoch 1e9 (exit {rc})", secs, "s (process, imports included)"))
    print(f"{'what':<60} {'seconds':>10}  note")
    for what, s, note in rows:
        print(f"{what:<60} {s:>10.4f}  {note}")
    out = {"load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
           "rows": [{"what": w, "seconds": s, "note": n} for w, s, n in rows]}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
