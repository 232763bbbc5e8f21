"""Re-plan on membership change, timed: two ``ptplan run`` launchers on this machine (``--nnodes 1:2``, c10d on
loopback, 1 bert-tiny process each, ``--rdzv-conf last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2``),
node 1's launcher SIGKILLed after the first sharded checkpoint; the survivor restarts alone, re-plans for 1
process and resumes (tests/test_elastic_membership.py's scenario).

Prints, per repeat: the step resumed from, seconds from the kill to the run log's ``membership`` record (the
survivor's worker failed on the lost peer, torchrun re-rendezvoused, the new worker started, re-planned and
loaded the checkpoint) and to its first new step, the re-plan's and the resume's own seconds; writes
bench/results/elastic_bench.json.

    python bench/elastic_bench.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from test_elastic_membership import make_job, two_nodes_one_killed

    rows = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
            folder = Path(tmp)
            got = two_nodes_one_killed(folder, make_job(folder))
            recs = [json.loads(x) for x in (folder / "run.jsonl").read_text().splitlines()]
            m = next(r for r in recs if r["type"] == "membership")
            res = next(r for r in recs if r["type"] == "resume")
            rows.append({"repeat": i, "exit": got["code"], "resumed_step": m["step"],
                         "kill_to_membership_s": round(got["membership_s"], 2),
                         "kill_to_first_new_step_s": round(got["first_new_step_s"], 2),
                         "replan_s": round(m["replan_seconds"], 3), "resume_s": round(res["seconds"], 3),
                         "from": f"{m['from']['world_size']} procs", "to": f"{m['to']['world_size']} procs"})
    print(f"{'repeat':>6} {'exit':>4} {'resumed':>7} {'kill->membership s':>18} {'kill->first step s':>18} "
          f"{'re-plan s':>9} {'resume s':>8}")
    for r in rows:
        print(f"{r['repeat']:>6} {r['exit']:>4} {r['resumed_step']:>7} {r['kill_to_membership_s']:>18.2f} "
              f"{r['kill_to_first_new_step_s']:>18.2f} {r['replan_s']:>9.3f} {r['resume_s']:>8.3f}")
    med = statistics.median(r["kill_to_first_new_step_s"] for r in rows)
    print(f"median kill -> first new step: {med:.2f} s (load {os.getloadavg()[0]:.1f})")
    out = HERE / "results" / "elastic_bench.json"
    out.write_text(json.dumps({"command": "python bench/elastic_bench.py --repeats %d" % args.repeats, "rows": rows,
                               "median_kill_to_first_new_step_s": med, "load_1min": os.getloadavg()[0]}, indent=1)
                   + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
