"""Planning benchmark: how long `make_plan` takes, from a 12-block model to a 96-block model on 1024 GPUs.

Target (issue 3): every phase of a 96-block model on 1024 GPUs planned in under 2 s on a 2-core box.
Prints a table and writes JSON (default bench/results/plan_bench.json).

    python bench/plan_bench.py [--repeats 3] [--out bench/results/plan_bench.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from ptplan.planner.cluster import Cluster, get_preset
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.planner import TrainingConfig, make_plan
from ptplan.planner.synthetic import synthetic_profile



def cases() -> list[tuple[str, object, object, TrainingConfig]]:
    return [
        ("12 blocks, paper cluster (16 GPUs)", synthetic_profile(num_blocks=12, hidden=768),
         get_preset("paper"), TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=512)),
        ("48 blocks, 16 nodes (128 GPUs)", synthetic_profile(num_blocks=48, hidden=2048),
         Cluster.uniform(nodes=16, like="dgx-h100"), TrainingConfig(epochs=10, samples_per_epoch=1_000_000, batch=2048)),
        ("96 blocks, 128 nodes (1024 GPUs)", synthetic_profile(num_blocks=96, hidden=2048),
         Cluster.uniform(nodes=128, like="dgx-h100"),
         TrainingConfig(epochs=10, samples_per_epoch=10_000_000, batch=8192)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/plan_bench.json")
    args = ap.parse_args()
    rows = []
    freeze = FreezePolicy(policy="geometric", alpha=1 / 3)
    for label, prof, cluster, training in cases():
        times, plan = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plan = make_plan(prof, cluster, training, freeze)
            times.append(time.perf_counter() - t0)
        Ks = [p.K for p in plan.phases]
        rows.append({"case": label, "blocks": prof.num_blocks, "layers": prof.num_layers,
                     "gpus": cluster.world_size, "phases": len(plan.phases),
                     "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                     "K_range": [min(Ks), max(Ks)], "speedup": plan.totals["speedup"]})
    print(f"{'case':<36} {'layers':>6} {'GPUs':>5} {'phases':>6} {'median s':>9} {'min s':>7} {'K range':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['case']:<36} {r['layers']:>6} {r['gpus']:>5} {r['phases']:>6} {r['median_s']:>9.3f} "
              f"{r['min_s']:>7.3f} {str(r['K_range']):>9} {r['speedup']:>7.2f}x")
    big = rows[-1]
    verdict = "PASS" if big["median_s"] < 2.0 else "FAIL"
    print(f"target: all phases of a 96-block model on 1024 GPUs < 2 s -> {big['median_s']:.3f} s ({verdict})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "plan", "machine": platform.machine(), "cpus": os.cpu_count(),
                               "python": platform.python_version(), "rows": rows, "target_s": 2.0,
                               "verdict": verdict}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
