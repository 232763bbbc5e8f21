"""Pipeline schedules side by side: predicted iteration time and bubble, and real CPU runs against the prediction.

Legend: K pipeline positions (ranks), V chunks per position, M micro-batches, b samples per micro-batch.

Part 1 (predictions, instant): for the shipped bert-base and gpt2 profiles, on K = 4 and 8 positions
(one pipeline, D = 1), M = 2K micro-batches of b samples, every schedule the planner generates --
GPipe, 1F1B, interleaved 1F1B (V picked by the search among 2 and 4), ZB-H1, looped BFS (V = 2) and
ZB-V (V = 2) -- planned with K and M pinned (``make_plan``), with the phase's predicted iteration
time, bubble fraction and peak stage memory. Two profile sources each: the CPU profile measured on
this machine (``*_cpu_fp32``, cluster ``cpu:K``) and the projected H100 bf16 profile
(``*_h100_bf16``, an H100 node with K GPUs). Profiles without ``backward_weight_s`` (measured before
the profiler split the backward) predict zero-bubble schedules with W = 0 s; the table marks them.

Part 2 (real runs, about 5 minutes on a quiet 2-core box): ``bert-small`` profiled here
(``calibrate.profile``: merged rounds, one thread, CPU timer), then for each schedule a plan pinned
to K = 2, M = 4 on ``cpu:2`` (two processes, one per core) is run for real (``ptplan run``, gloo) and
compared with its prediction (``planner.compare``: median step time, first step left out). Runs
during which other processes used the CPU are repeated (``calibrate``'s rule) or marked contended.

    python bench/schedule_bench.py [--part 1|2|both] [--steps 12] [--out bench/results/schedule_bench.json]

With one ``--part``, an existing ``--out`` keeps the other part's results.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import calibrate
from ptplan.planner.cluster import get_preset
from ptplan.planner.compare import compare, read_run_log
from ptplan.planner.errors import PtplanError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.plan import save_plan
from ptplan.planner.planner import TrainingConfig, make_plan
from ptplan.planner.profile import load_profile
from ptplan.planner.schedule import splits_backward

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "looped-bfs", "zb-v")
RUN_SCHEDULES = SCHEDULES
"""Schedules the executor runs (ZB-V's lists receive out of send order between two ranks: refused)."""


def _cluster(source: str, K: int):
    if source == "cpu":
        return get_preset(f"cpu:{K}")
    base = get_preset("dgx-h100")
    return replace(base, name=f"h100x{K}", nodes=1, gpus_per_node=K)


def _phase(prof, cluster, schedule: str, K: int, M: int, b: int, *, epochs: int = 1, steps: int = 8):
    cfg = TrainingConfig(epochs=epochs, samples_per_epoch=M * b * steps, batch=M * b, schedule=schedule, pin_K=K,
                         pin_M=M, cache="off")
    plan = make_plan(prof, cluster, cfg, FreezePolicy(policy="manual", manual=(0,) * epochs))
    return plan, plan.phases[0]


def predictions(b: int) -> list[dict]:
    rows = []
    for model in ("bert-base", "gpt2"):
        for source in ("cpu", "h100"):
            path = ROOT / "profiles" / f"{model}_{source}_{'fp32' if source == 'cpu' else 'bf16'}.json"
            prof = load_profile(path)
            split = all(r.backward_weight_s is not None for r in prof.layers)
            for K in (4, 8):
                cluster = _cluster(source, K)
                base = None
                for name in SCHEDULES:
                    row = {"model": model, "source": source, "K": K, "M": 2 * K, "b": b, "schedule": name,
                           "backward_split": split}
                    try:
                        _, ph = _phase(prof, cluster, name, K, 2 * K, b)
                    except PtplanError as e:
                        row["error"] = str(e).splitlines()[0][:120]
                        rows.append(row)
                        continue
                    if ph.K != K or ph.M != 2 * K or ph.schedule != name:
                        row["error"] = f"planner chose K={ph.K} M={ph.M} {ph.schedule} (pin did not fit)"
                        rows.append(row)
                        continue
                    pr = ph.predicted
                    base = pr.iteration_s if name == "1f1b" else base
                    row.update(V=ph.V, iteration_s=pr.iteration_s, bubble=pr.bubble_fraction,
                               peak_gib=pr.peak_memory_bytes / 2**30)
                    rows.append(row)
                for row in rows[-len(SCHEDULES):]:
                    if base and "iteration_s" in row:
                        row["vs_1f1b"] = row["iteration_s"] / base
    return rows


def print_predictions(rows: list[dict]) -> None:
    print(f"{'model':<10} {'profile':<9} {'K':>2} {'M':>3} {'schedule':<17} {'V':>2} {'iter ms':>10} "
          f"{'bubble':>7} {'vs 1F1B':>8} {'peak GiB':>9}")
    for r in rows:
        src = r["source"] + ("" if r["backward_split"] or not splits_backward(r["schedule"]) else "*")
        head = f"{r['model']:<10} {src:<9} {r['K']:>2} {r['M']:>3} {r['schedule']:<17}"
        if "error" in r:
            print(f"{head}    {r['error']}")
            continue
        print(f"{head} {r['V']:>2} {r['iteration_s'] * 1e3:>10.2f} {r['bubble']:>7.1%} {r.get('vs_1f1b', 1):>7.3f}x "
              f"{r['peak_gib']:>9.2f}")
    if any(not r["backward_split"] for r in rows):
        print("* profile without backward_weight_s: the zero-bubble schedule is predicted with W = 0 s")


def runs(args) -> list[dict]:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prof_path = work / "bert-small_cpu_fp32.json"
    if not (args.reuse_profile and prof_path.exists()):
        print(f"profiling bert-small ({args.profile_rounds} rounds) ...", flush=True)
        prof_path = calibrate.profile("bert-small", work, "1,2,4,8", args.max_wait, args.profile_rounds)
    prof = load_profile(prof_path)
    cluster = get_preset("cpu:2")
    out = []
    for name in RUN_SCHEDULES:
        plan, ph = _phase(prof, cluster, name, 2, 4, args.b, steps=args.steps)
        plan_path, log_path = work / f"{name}.plan.json", work / f"{name}.run.jsonl"
        save_plan(plan, plan_path)
        for attempt in range(1 + args.retries):
            calibrate.wait_quiet(args.max_wait)
            t0 = time.perf_counter()
            foreign = calibrate._sh(["ptplan", "run", str(plan_path), "--model", "bert-small", "--nproc-per-node", "2",
                                     "--steps-per-epoch", str(args.steps), "--epochs", "1", "--log", str(log_path),
                                     "--no-progress", "--timeout", "120"], work / f"{name}.run.log")
            wall = time.perf_counter() - t0
            if foreign <= calibrate.FOREIGN_LIMIT:
                break
            print(f"  {name}: other processes used {foreign:.2f} cores; "
                  + ("again" if attempt < args.retries else "kept (contended)"), flush=True)
        comp = compare(plan, read_run_log(log_path), warmup=1).phases[0]
        row = {"schedule": name, "K": ph.K, "V": ph.V, "M": ph.M, "b": ph.micro_batch_size,
               "predicted_s": comp.predicted_iteration_s, "measured_s": comp.measured_iteration_s,
               "error": comp.measured_iteration_s / comp.predicted_iteration_s - 1, "foreign_cores": foreign,
               "contended": foreign > calibrate.FOREIGN_LIMIT, "wall_s": wall}
        print(f"  {name:<17} V={ph.V} predicted {row['predicted_s'] * 1e3:8.1f} ms, measured "
              f"{row['measured_s'] * 1e3:8.1f} ms ({row['error']:+.1%})" + (" contended" if row["contended"] else ""),
              flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("1", "2", "both"), default="both")
    ap.add_argument("--b", type=int, default=4, help="Samples per micro-batch.")
    ap.add_argument("--steps", type=int, default=12, help="Steps per real run (the first is left out).")
    ap.add_argument("--profile-rounds", type=int, default=3)
    ap.add_argument("--reuse-profile", action="store_true", help="Use the bert-small profile already in --work.")
    ap.add_argument("--work", default=str(ROOT / "bench" / "results" / "schedules"))
    ap.add_argument("--max-wait", type=float, default=120)
    ap.add_argument("--retries", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "schedule_bench.json"))
    args = ap.parse_args()
    command = " ".join(["python"] + sys.argv)
    result: dict = {"command": command}
    if args.part != "both" and Path(args.out).exists():  # one part: the other part's results in --out are kept
        result = json.loads(Path(args.out).read_text())
        result[f"command_part{args.part}"] = command
    if args.part in ("1", "both"):
        rows = predictions(args.b)
        print_predictions(rows)
        result["predictions"] = rows
    if args.part in ("2", "both"):
        print("\nreal runs: bert-small, cpu:2, K=2, M=4")
        result["runs"] = runs(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
