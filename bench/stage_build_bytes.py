"""What a rank's build holds (issue 10): parameter bytes materialised and peak host memory of ``build_model`` for each
stage of a 4-stage plan, against the whole model.

Each build runs in its own fresh Python process (``python -c``) so that its peak resident memory (``ru_maxrss``)
is its own: the interpreter, torch and transformers, the module tree and the built layers. Bytes materialised =
the parameters not on the meta device right after ``build_model`` returns. The stages are ``stage_layers`` of
phase 0 of a K=4, D=1 plan with an even partition (``executor.handplan.make_plan``), at half granularity.

    python bench/stage_build_bytes.py [--model bert-base] [--stages 4] [--seq 128]

Writes bench/results/stage_build_bytes.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(1)
from ptplan.executor.families import build_model
name, seq, layers = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
t0 = time.perf_counter()
m = build_model(name, seq_len=seq, layers=layers)
secs = time.perf_counter() - t0
held = sum(p.numel() * p.element_size() for p in m.parameters() if p.device.type != "meta")
total = sum(p.numel() * p.element_size() for p in m.parameters())
built = sorted(i for i, l in enumerate(m.layers) if any(p.device.type != "meta" for p in l.parameters()))
print(json.dumps({"held_bytes": held, "model_bytes": total, "built": built, "seconds": secs,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _run(name: str, seq: int, layers) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(seq), json.dumps(layers)], check=True,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert-base")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "stage_build_bytes.json"))
    args = ap.parse_args()

    from ptplan.executor.families import build_model
    from ptplan.executor.handplan import make_plan, spec
    from ptplan.executor.training.loop import stage_layers

    shell = build_model(args.model, seq_len=args.seq, layers=[])
    plan = make_plan(shell, [spec(0, K=args.stages, D=1, M=args.stages, b=1)])
    rows = []
    base = _run(args.model, args.seq, [])
    rows.append({"what": "nothing (module tree only)", **base})
    for r in range(args.stages):
        rows.append({"what": f"stage {r}", "partition": list(plan.phases[0].partition[r]),
                     **_run(args.model, args.seq, stage_layers(plan, 0, r))})
    rows.append({"what": "whole model", **_run(args.model, args.seq, None)})
    mib = 1 << 20
    print(f"{args.model}, seq {args.seq}, {args.stages} stages (half granularity, {len(shell.layers)} layers)")
    print(f"{'build':28s} {'params MiB':>11s} {'of model':>9s} {'peak RSS MiB':>13s} {'seconds':>8s}")
    for row in rows:
        print(f"{row['what']:28s} {row['held_bytes'] / mib:11.1f} {row['held_bytes'] / row['model_bytes']:9.1%} "
              f"{row['peak_rss_bytes'] / mib:13.1f} {row['seconds']:8.2f}")
    result = {"model": args.model, "seq_len": args.seq, "stages": args.stages, "rows": rows,
              "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv])}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
