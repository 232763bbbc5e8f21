"""PipeDream-2BW against GPipe and 1F1B: predicted throughput and peak memory, K = 4, 8, 16.

Legend: K pipeline stages (one pipeline, D = 1), M = 2K micro-batches of b = 4 samples per iteration
(mini-batch), f frozen blocks (their layers run as stage 0's no-grad prefix, one weight version).

For the shipped ``gpt2_cpu_fp32`` and ``bert-large_cpu_fp32`` profiles on the cluster ``cpu:K`` (this
machine as K processes, each with 1/K of its memory), every row is the planner's own model: the
search's stage model for the candidate (``PhaseSearch.model``; 2BW keeps two versions of the active
layers' weights; ``2bw+rc`` adds activation recomputation, which the search itself does not try),
the time-optimal AutoPipe split (``partition.split_stages`` without a memory limit, so every schedule
is priced on its best split and its memory is reported, not enforced: ``fits`` says whether it fits
in 1/K of this machine), and the simulator (``simulate``: GPipe and 1F1B one flushed iteration,
2BW the flush-free steady state per mini-batch). ``samples/s`` = M·b / iteration; ``peak`` the
largest rank's peak; ``w0`` stage 0's weights (every version, the frozen prefix included).

``--window-check``: how close the simulator's 2BW period from the 8-mini-batch window
(``schedule.TWOBW_WINDOW``, mean of its last three mini-batches) is to the mean period over
mini-batches 39..59 of a 60-mini-batch run, on 230 random non-uniform cases (the number quoted in
``schedule.TWOBW_WINDOW``'s docstring).

Part 2 (``--part 2``, real runs, about a minute on a quiet 2-core box): the shipped ``bert-tiny_cpu_fp32``
profile (measured on this machine: AMD EPYC, one thread per process), one plan each for flushed 1F1B
and PipeDream-2BW pinned to K = 2, M = 4 micro-batches of b = 8 on ``cpu:2`` (two processes, one per
core), no freezing; each is run for real (``ptplan run``, gloo; 2BW on its own point-to-point loop,
``executor/runtime/twobw.py``) and its median step time compared with the prediction (``planner.compare``,
first step left out; for 2BW the prediction is the simulator's steady-state period, one mini-batch
per step). Runs during which other processes used the CPU are repeated once (``calibrate``'s rule)
or marked contended. Writes ``bench/results/twobw_bench_runs.json``.

    python bench/twobw_bench.py [--out bench/results/twobw_bench.json] [--window-check]
    python bench/twobw_bench.py --part 2 [--steps 16] [--out bench/results/twobw_bench_runs.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import calibrate

from ptplan.planner.cluster import get_preset
from ptplan.planner.compare import compare, read_run_log
from ptplan.planner.config import TrainingConfig
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.partition import split_stages
from ptplan.planner.plan import save_plan
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import load_profile
from ptplan.planner.schedule import TWOBW_WINDOW, two_bw
from ptplan.planner.search import Candidate, PhaseSearch
from ptplan.planner.simulate import StageCost, simulate
from ptplan.planner.stage import StageModel

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ("gpt2_cpu_fp32", "bert-large_cpu_fp32")
ROWS = (("gpipe", False), ("1f1b", False), ("2bw", False), ("2bw", True))
GiB = float(1 << 30)


def row(prof, K: int, b: int, f: int, schedule: str, recompute: bool) -> dict:
    """One (profile, K, frozen blocks, schedule) prediction."""
    M = 2 * K
    cluster = get_preset(f"cpu:{K}")
    cfg = TrainingConfig(epochs=1, samples_per_epoch=M * b * 8, batch=M * b, schedule=schedule, pin_K=K, pin_M=M,
                         cache="off")
    search = PhaseSearch(prof, cluster, cfg)
    n0 = prof.frozen_boundary(f)
    cand = Candidate(K=K, D=cluster.world_size // K, M=M, b=b, cache=False, schedule=schedule)
    model = search.model(cand, n0)
    if recompute:
        model = StageModel(search.t, replace(model.shape, recompute=True), model.links)
    ranges = split_stages(model, K, 1e18).ranges  # no memory limit: the time-optimal split
    costs = model.stage_costs(ranges)
    sim = simulate(search.schedule(cand), costs, step_overhead_s=cluster.step_overhead_s)
    mem = model.stage_memory(ranges)
    peak = max(sim.rank_peak_memory_bytes)
    return {"profile": prof.model.name, "K": K, "M": M, "b": b, "frozen_blocks": f,
            "schedule": schedule + ("+rc" if recompute else ""), "iteration_s": sim.iteration_s,
            "samples_per_s": M * b / sim.iteration_s, "bubble": sim.bubble_fraction, "peak_bytes": peak,
            "stage0_weights_bytes": mem[0].weights, "stage0_activations_bytes": mem[0].activations,
            "fits": peak <= search.limit, "limit_bytes": search.limit}


def predictions(b: int) -> list[dict]:
    rows = []
    for name in PROFILES:
        prof = load_profile(ROOT / "profiles" / f"{name}.json")
        for f in (0, prof.num_blocks // 2):
            for K in (4, 8, 16):
                if K > prof.num_layers - prof.frozen_boundary(f):
                    continue
                rows += [row(prof, K, b, f, s, rc) for s, rc in ROWS]
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'profile':<11} {'f':>2} {'K':>3} {'M':>3} {'schedule':<8} {'iter ms':>9} {'samples/s':>10} "
          f"{'vs 1F1B':>8} {'bubble':>7} {'peak GiB':>9} {'w0 GiB':>7} {'fits':>5}")
    base: dict[tuple, float] = {}
    for r in rows:
        if r["schedule"] == "1f1b":
            base[(r["profile"], r["frozen_blocks"], r["K"])] = r["samples_per_s"]
    for r in rows:
        ref = base.get((r["profile"], r["frozen_blocks"], r["K"]))
        print(f"{r['profile']:<11} {r['frozen_blocks']:>2} {r['K']:>3} {r['M']:>3} {r['schedule']:<8} "
              f"{r['iteration_s'] * 1e3:>9.1f} {r['samples_per_s']:>10.2f} {r['samples_per_s'] / ref:>7.3f}x "
              f"{r['bubble']:>7.1%} {r['peak_bytes'] / GiB:>9.3f} {r['stage0_weights_bytes'] / GiB:>7.3f} "
              f"{'yes' if r['fits'] else 'no':>5}")


def window_check(cases: int = 230, long: int = 60) -> dict:
    """The simulator's 2BW period from its window against a long run's mean period (module docstring)."""
    worst = 0.0
    rng = random.Random(0)
    for i in range(cases):
        K = rng.choice([2, 3, 4, 6, 8, 16])
        M = rng.choice([m for m in (2, 4, 6, 8, 16, 32) if m >= K])
        ar = rng.choice([0, 1, 10, 40])
        costs = [StageCost(forward_s=rng.uniform(0.5, 2), backward_s=rng.uniform(1, 4), optimizer_s=rng.uniform(0, 1),
                           send_forward_s=rng.uniform(0, 1) if s < K - 1 else 0.0,
                           send_backward_s=rng.uniform(0, 1) if s > 0 else 0.0,
                           allreduce_s=rng.uniform(0, ar)) for s in range(K)]
        got = simulate(two_bw(K, M, TWOBW_WINDOW), costs).iteration_s
        r = simulate(two_bw(K, M, long), costs, events=True)
        starts = [e.start for e in r.events if e.rank == 0 and e.kind == "F" and e.mb % M == 0]
        truth = (starts[-1] - starts[-21]) / 20
        worst = max(worst, abs(got - truth) / truth)
    return {"cases": cases, "window": TWOBW_WINDOW, "long_run": long, "worst_relative_error": worst}


RUN_SCHEDULES = ("1f1b", "2bw")


def runs(args) -> list[dict]:
    """Part 2: 1F1B and 2BW run for real on cpu:2 against their predictions (module docstring)."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prof = load_profile(args.profile)
    cluster = get_preset("cpu:2")
    K, M, b = 2, 4, args.b
    out = []
    for name in RUN_SCHEDULES:
        cfg = TrainingConfig(epochs=1, samples_per_epoch=M * b * args.steps, batch=M * b, schedule=name, pin_K=K,
                             pin_M=M, cache="off")
        plan = make_plan(prof, cluster, cfg, FreezePolicy(policy="none"))
        ph = plan.phases[0]
        if (ph.K, ph.M, ph.micro_batch_size, ph.schedule) != (K, M, b, name):
            sys.exit(f"{name}: the planner chose K={ph.K} M={ph.M} b={ph.micro_batch_size} {ph.schedule}, "
                     f"not K={K} M={M} b={b}")
        plan_path, log_path = work / f"{name}.plan.json", work / f"{name}.run.jsonl"
        save_plan(plan, plan_path)
        for attempt in range(1 + args.retries):
            calibrate.wait_quiet(args.max_wait)
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            foreign = calibrate._sh(["ptplan", "run", str(plan_path), "--model", prof.model.name,
                                     "--nproc-per-node", "2", "--steps-per-epoch", str(args.steps), "--epochs", "1",
                                     "--log", str(log_path), "--no-progress", "--timeout", "120"],
                                    work / f"{name}.run.log")
            wall = time.perf_counter() - t0
            if foreign <= calibrate.FOREIGN_LIMIT:
                break
            print(f"  {name}: other processes used {foreign:.2f} cores; "
                  + ("again" if attempt < args.retries else "kept (contended)"), flush=True)
        comp = compare(plan, read_run_log(log_path), warmup=1).phases[0]
        row = {"schedule": name, "model": prof.model.name, "K": K, "M": M, "b": b, "steps": comp.steps,
               "predicted_s": comp.predicted_iteration_s, "measured_s": comp.measured_iteration_s,
               "error": comp.measured_iteration_s / comp.predicted_iteration_s - 1, "foreign_cores": foreign,
               "contended": foreign > calibrate.FOREIGN_LIMIT, "load_average_1min": load, "wall_s": wall}
        print(f"  {name:<5} predicted {row['predicted_s'] * 1e3:8.1f} ms, measured {row['measured_s'] * 1e3:8.1f} ms "
              f"per iteration ({row['error']:+.1%}, median of {comp.steps} steps)"
              + (f" contended ({foreign:.2f} foreign cores)" if row["contended"] else ""), flush=True)
        out.append(row)
    one, two = out
    print(f"  2BW over 1F1B: predicted {one['predicted_s'] / two['predicted_s']:.3f}x, measured "
          f"{one['measured_s'] / two['measured_s']:.3f}x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("1", "2"), default="1",
                    help="1: predictions (default); 2: real CPU runs of 1F1B and 2BW against their predictions")
    ap.add_argument("--b", type=int, default=None, help="samples per micro-batch (default: 4 in part 1, 8 in part 2)")
    ap.add_argument("--out", default=None, help="default: bench/results/twobw_bench.json (part 1), "
                                                "bench/results/twobw_bench_runs.json (part 2)")
    ap.add_argument("--window-check", action="store_true", help="also check the simulator's 2BW window")
    ap.add_argument("--profile", default=str(ROOT / "profiles" / "bert-tiny_cpu_fp32.json"), help="part 2's profile")
    ap.add_argument("--steps", type=int, default=16, help="part 2: steps per real run (the first is left out)")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "ptplan-twobw-runs"),
                    help="part 2: plans, run logs and worker logs")
    ap.add_argument("--max-wait", type=float, default=60, help="part 2: seconds to wait for a quiet machine")
    ap.add_argument("--retries", type=int, default=1, help="part 2: repeats of a contended run")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.part == "2":
        args.b = args.b or 8
        out_path = args.out or str(ROOT / "bench" / "results" / "twobw_bench_runs.json")
        print(f"real runs: {Path(args.profile).stem}, cpu:2, K=2, M=4, b={args.b}", flush=True)
        result = {"runs": runs(args), "command": " ".join(["python"] + sys.argv),
                  "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        Path(out_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nwrote {out_path} in {time.perf_counter() - t0:.1f} s")
        return
    args.b = args.b or 4
    args.out = args.out or str(ROOT / "bench" / "results" / "twobw_bench.json")
    rows = predictions(args.b)
    print_table(rows)
    out = {"rows": rows, "command": "python bench/twobw_bench.py" + (" --window-check" if args.window_check else ""),
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if args.window_check:
        out["window_check"] = window_check()
        w = out["window_check"]
        print(f"\n2BW window: period within {w['worst_relative_error']:.2%} of a {w['long_run']}-mini-batch run's on "
              f"{w['cases']} random cases (window {w['window']})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
