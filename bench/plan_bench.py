"""Planning benchmark: how long `make_plan` takes for every phase, blocks {24, 96, 384} x GPUs {8, 1024, 4096}.

Targets (issue 10): all phases of a 384-block model on 4,096 GPUs in under 5 s on this 2-core box,
96 blocks on 1,024 GPUs under 1 s. The model is the synthetic GPT-style profile
(``planner/synthetic.py``: hidden 1024, attention/MLP halves, so 2L + 3 layers) with measured sizes
1..64; the cluster is DGX H100 nodes (8 GPUs each; 8 GPUs = one node); the global batch is 8 per
GPU; 10 epochs of 1,000,000 samples; α = 1/3; the AutoCache on ``auto``. A phase is planned for
every frozen count 0..L (the plan must serve adaptive runs), so 384 blocks means 385 phases.
Also reported: how many candidates (K, M, cache) the bounds let through to the exact split and the
simulator. The ``hybrid`` row is issue 14's target: every phase of a 48-block model (hidden 2048) on
8 DGX H100 nodes (64 GPUs) searched with ``strategies="auto"`` (tensor parallel, FSDP, recomputation),
global batch 1,024, in under 5 s. The ``sliced`` row times token slicing (no target): docs/token-slices.md's
plan, the measured GPT-2 slice profile on ``cpu:4``, batch 4 from K = 4, 4,096 samples per epoch, with
``token_slices`` auto against off (their ratio is what slicing's own searches cost). Prints a table and writes
JSON (default bench/results/plan_bench.json):
wall-clock seconds (median, min, max of the repeats; the targets are on the median), the median CPU
seconds of this process, all its threads (less sensitive to other work on a shared machine), and the
load average at the start and the end.

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

from ptplan.planner.cluster import Cluster
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.planner import TrainingConfig, make_plan
from ptplan.planner.profile import Profile
from ptplan.planner.search import PhaseSearch
from ptplan.planner.synthetic import synthetic_profile

BLOCKS = (24, 96, 384)
GPUS = (8, 1024, 4096)
TARGETS = {(384, 4096): 5.0, (96, 1024): 1.0}
HYBRID = dict(blocks=48, hidden=2048, gpus=64, batch=1024, target_s=5.0)


def synthetic_case(blocks: int, gpus: int, schedule: str = "1f1b"
                   ) -> tuple[Profile, Cluster, TrainingConfig, FreezePolicy]:
    """The module docstring's case: ``make_plan``'s arguments (``bench/split_proofs.py`` plans the same)."""
    prof = synthetic_profile(num_blocks=blocks, hidden=1024, batch_sizes=(1, 2, 4, 8, 16, 32, 64))
    cluster = Cluster.uniform(nodes=gpus // 8, gpus_per_node=8, like="dgx-h100")
    training = TrainingConfig(epochs=10, samples_per_epoch=1_000_000, batch=8 * gpus, schedule=schedule)
    return prof, cluster, training, FreezePolicy(policy="geometric", alpha=1 / 3)


def run_case(blocks: int, gpus: int, repeats: int) -> dict:
    prof, cluster, training, freeze = synthetic_case(blocks, gpus)
    times, cpu, plan = [], [], None
    evaluated = [0]
    real = PhaseSearch.evaluate

    def counting(self, *a, **kw):  # count exact evaluations (split + simulation) without changing them
        evaluated[0] += 1
        return real(self, *a, **kw)

    for r in range(repeats):
        PhaseSearch.evaluate = counting if r == 0 else real
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            plan = make_plan(prof, cluster, training, freeze)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        finally:
            PhaseSearch.evaluate = real
    assert plan is not None
    Ks = [p.K for p in plan.phases]
    target = TARGETS.get((blocks, gpus))
    med = statistics.median(times)
    return {"blocks": blocks, "layers": prof.num_layers, "gpus": gpus, "phases": len(plan.phases),
            "median_s": med, "min_s": min(times), "max_s": max(times), "cpu_median_s": statistics.median(cpu),
            "evaluated": evaluated[0],
            "K_range": [min(Ks), max(Ks)], "cached_phases": sum(p.cache for p in plan.phases),
            "speedup": plan.totals.speedup, "target_s": target,
            "verdict": None if target is None else ("PASS" if med < target else "FAIL")}


def run_hybrid(repeats: int) -> dict:
    """Issue 14's case: every phase searched with strategies (``PhaseSearch.search`` per frozen count)."""
    from ptplan.planner.search import Visit

    h = HYBRID
    prof = synthetic_profile(num_blocks=h["blocks"], hidden=h["hidden"], batch_sizes=(1, 2, 4, 8, 16, 32))
    times, cpu, evaluated = [], [], 0
    for _ in range(repeats):
        s = PhaseSearch(prof, Cluster.uniform(nodes=h["gpus"] // 8, like="dgx-h100"),
                        TrainingConfig(epochs=10, samples_per_epoch=1_000_000, batch=h["batch"]), strategies="auto")
        t0, c0 = time.perf_counter(), time.process_time()
        for f in range(h["blocks"] + 1):
            s.search(f, Visit(samples=1e6))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        evaluated = s.evaluated
    med = statistics.median(times)
    return {"blocks": h["blocks"], "layers": prof.num_layers, "gpus": h["gpus"], "phases": h["blocks"] + 1,
            "strategies": "auto", "median_s": med, "min_s": min(times), "max_s": max(times),
            "cpu_median_s": statistics.median(cpu),
            "evaluated": evaluated, "target_s": h["target_s"], "verdict": "PASS" if med < h["target_s"] else "FAIL"}


def run_sliced(repeats: int) -> dict:
    """docs/token-slices.md's plan with token slices auto and off (``make_plan``, 13 phases)."""
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.profile import load_profile

    prof = load_profile(Path(__file__).resolve().parents[1] / "profiles" / "gpt2_cpu_fp32_slices.json")
    training = TrainingConfig(epochs=10, samples_per_epoch=4096, batch=4, start_K=4)
    out: dict = {"profile": "gpt2_cpu_fp32_slices", "cluster": "cpu:4", "batch": 4, "start_K": 4}
    for mode in ("auto", "off"):
        times, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            plan = make_plan(prof, get_preset("cpu:4"), training, FreezePolicy(policy="geometric", alpha=1 / 3),
                             token_slices=mode)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out[mode] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                     "cpu_median_s": statistics.median(cpu), "phases": len(plan.phases),
                     "sliced_phases": sum(len(getattr(p, "slices", ()) or ()) > 1 for p in plan.phases),
                     "seconds": plan.totals.seconds}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/plan_bench.json")
    args = ap.parse_args()
    load_start = os.getloadavg()
    rows = [run_case(b, g, args.repeats) for b in BLOCKS for g in GPUS]
    print(f"{'blocks':>6} {'layers':>6} {'GPUs':>5} {'phases':>6} {'median s':>9} {'min s':>7} {'max s':>7} "
          f"{'CPU s':>7} {'evaluated':>9} {'K range':>9} {'cached':>6} {'speedup':>8} {'target':>8}")
    for r in rows:
        tgt = f"<{r['target_s']:g} s {r['verdict']}" if r["target_s"] else ""
        print(f"{r['blocks']:>6} {r['layers']:>6} {r['gpus']:>5} {r['phases']:>6} {r['median_s']:>9.3f} "
              f"{r['min_s']:>7.3f} {r['max_s']:>7.3f} {r['cpu_median_s']:>7.3f} {r['evaluated']:>9} {str(r['K_range']):>9} "
              f"{r['cached_phases']:>6} {r['speedup']:>7.2f}x {tgt:>8}")
    hy = run_hybrid(args.repeats)
    print(f"hybrid: {hy['blocks']} blocks on {hy['gpus']} GPUs, strategies auto, {hy['phases']} phases: median "
          f"{hy['median_s']:.3f} s (min {hy['min_s']:.3f}, max {hy['max_s']:.3f}, CPU {hy['cpu_median_s']:.3f}), "
          f"{hy['evaluated']} evaluated, target <{hy['target_s']:g} s {hy['verdict']}")
    sl = run_sliced(args.repeats)
    print(f"sliced: {sl['profile']} on {sl['cluster']}, {sl['auto']['phases']} phases, token slices auto: median "
          f"{sl['auto']['median_s']:.3f} s (CPU {sl['auto']['cpu_median_s']:.3f}), {sl['auto']['sliced_phases']} "
          f"phases sliced; off: {sl['off']['median_s']:.3f} s (CPU {sl['off']['cpu_median_s']:.3f}); auto / off "
          f"{sl['auto']['cpu_median_s'] / sl['off']['cpu_median_s']:.1f}x CPU")
    load_end = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
          f"at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "plan", "machine": platform.machine(), "cpus": os.cpu_count(),
                               "python": platform.python_version(), "repeats": args.repeats,
                               "loadavg_start": list(load_start), "loadavg_end": list(load_end), "rows": rows,
                               "hybrid": hy, "sliced": sl},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
