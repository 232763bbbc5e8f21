"""How the split search settles each candidate's split (issue 22 item 4: the split must minimise the simulated
iteration, or be proven to), on ``bench/plan_bench.py``'s synthetic model and DGX H100 clusters (global batch 8
a GPU, 10 epochs of 10^6 samples, alpha 1/3, the AutoCache on ``auto``): 1F1B, the default, and the schedules
with several stages a rank.

Every call of ``resplit.best_split`` made by ``make_plan`` is counted by how it ended:

- ``one stage``: nothing to split;
- ``every split``: every split scored (``resplit.enumerable``);
- ``first pass``: AutoPipe's split kept without a descent: the branch and bound's first pass, which descends
  later only the candidates near the best (``resplit.GIVE_UP``); a candidate whose AutoPipe split lost to the best
  there is not split further (not a proof that none of its splits could win);
- ``bound``: the stage-by-stage bound listed every split that may win and they were scored
  (``resplit.under``, with AutoPipe's split or the descent's to beat): proven;
- ``chains r``: the proof by the simulator's chains (``resplit._by_forms``) after r scored splits: proven;
- ``descent``: a local optimum, unproven (too many splits stayed under every bound).

Each case runs in its own interpreter (``--case``), so its peak resident memory is its own (``ru_maxrss``); the
CPU seconds are ``make_plan``'s (``time.process_time``), the plan's total its predicted seconds.

    python bench/split_proofs.py [--schedules 1f1b interleaved-1f1b looped-bfs zb-v auto]
        [--cases 24x4096 96x4096 96x1024] [--out bench/results/split_proofs.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
SCHEDULES = ("1f1b", "interleaved-1f1b", "looped-bfs", "zb-v", "auto")
CASES = ("24x4096", "96x4096", "96x1024")
OUTCOMES = ("one stage", "every split", "first pass", "bound", "chains 0", "chains 1", "chains 2", "descent")


def run_case(schedule: str, blocks: int, gpus: int) -> dict:
    """``make_plan`` of one case with ``best_split``'s outcomes counted (module docstring)."""
    from plan_bench import synthetic_case

    from ptplan.planner import resplit
    from ptplan.planner import search as search_mod
    from ptplan.planner.planner import make_plan

    counts: collections.Counter = collections.Counter()
    seen: dict[str, list] = {}

    def hook(name: str):
        real = getattr(resplit, name)

        def wrapped(*a, **kw):
            out = real(*a, **kw)
            seen.setdefault(name, []).append(out is not None)
            return out
        setattr(resplit, name, wrapped)

    for name in ("under", "under_forms", "_every_cut", "_descend"):
        hook(name)
    real_best = search_mod.best_split

    def best(cuts, score, **kw):
        seen.clear()
        out = real_best(cuts, score, **kw)
        u, f = seen.get("under", []), seen.get("under_forms", [])
        if len(cuts) <= 2:
            key = "one stage"
        elif "_every_cut" in seen:
            key = "every split"
        elif any(u):
            key = "bound"
        elif any(f):
            key = f"chains {len(f) - 1}"
        elif "_descend" in seen:
            key = "descent"
        else:
            key = "first pass"
        counts[key] += 1
        return out
    search_mod.best_split = best

    c0 = time.process_time()
    plan = make_plan(*synthetic_case(blocks, gpus, schedule))
    cpu = time.process_time() - c0
    return dict(schedule=schedule, blocks=blocks, gpus=gpus, outcomes={k: counts[k] for k in OUTCOMES},
                calls=sum(counts.values()), cpu_s=round(cpu, 2), plan_total_s=plan.totals.seconds,
                phases=len(plan.phases), peak_rss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--cases", nargs="+", default=list(CASES), help="BLOCKSxGPUS (GPUs a multiple of 8)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "split_proofs.json")
    ap.add_argument("--case", nargs=3, metavar=("SCHEDULE", "BLOCKS", "GPUS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:  # the child: one case, its JSON on stdout
        print(json.dumps(run_case(args.case[0], int(args.case[1]), int(args.case[2]))))
        return
    rows = []
    head = f"{'schedule':<17}{'case':>9}" + "".join(f"{k:>13}" for k in OUTCOMES) + f"{'CPU s':>8}{'peak MiB':>10}"
    print(head)
    for schedule in args.schedules:
        for case in args.cases:
            blocks, gpus = (int(v) for v in case.split("x"))
            done = subprocess.run([sys.executable, __file__, "--case", schedule, str(blocks), str(gpus)],
                                  check=True, capture_output=True, text=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{schedule:<17}{case:>9}" + "".join(f"{row['outcomes'][k]:>13}" for k in OUTCOMES)
                  + f"{row['cpu_s']:>8.1f}{row['peak_rss_kib'] / 1024:>10.0f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(rows=rows, outcomes=list(OUTCOMES), machine=platform.node(),
                                        load_average=list(os.getloadavg()),
                                        command="python bench/split_proofs.py " + " ".join(sys.argv[1:])),
                                   indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
