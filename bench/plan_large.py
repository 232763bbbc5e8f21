"""Planning a large model with strategies, as a user runs it: ``ptplan plan`` in a subprocess, timed, its peak
host memory read back (the process's own maximum resident set size, ``os.wait4``).

The case: Llama 3.1 70B projected on the H100 device model (bf16, 4,096 tokens:
``ptplan profile llama-3.1-70b --project h100 --dtype bf16 --seq-len 4096``), planned on ``h100-4node`` (32 GPUs)
at batch 512 with ``--strategies auto`` (tensor parallel, sequence parallel, FSDP, recomputation, uniform and
per stage) and the default freeze policy: 81 phases. ``--baseline DIR`` runs the same command first with another
checkout of ptplan (a directory holding the package's files, e.g. ``git worktree add DIR COMMIT``), so the two
are timed back to back on the same machine, and checks both wrote the same plan.

    python bench/plan_large.py [--baseline DIR] [--profile FILE] [--out bench/results/plan_large.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAN_ARGS = ["--cluster", "h100-4node", "--batch", "512", "--strategies", "auto"]
PROFILE_ARGS = ["llama-3.1-70b", "--project", "h100", "--dtype", "bf16", "--seq-len", "4096"]


def run_plan(profile: Path, out: Path, package_dir: Path | None) -> dict:
    """One ``ptplan plan`` in a fresh process (``package_dir``: import ptplan from there instead)."""
    env = dict(os.environ)
    if package_dir is not None:  # a directory named ptplan whose files are the other checkout's
        shim = Path(tempfile.mkdtemp(prefix="ptplan-baseline-"))
        (shim / "ptplan").symlink_to(package_dir.resolve())
        env["PYTHONPATH"] = str(shim)
    log = out.with_suffix(".log")
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "ptplan.cli.main", "plan", str(profile), *PLAN_ARGS, "--out",
                                 str(out)], env=env, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own resource usage
    wall = time.perf_counter() - t0
    text = log.read_text()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"ptplan plan failed ({os.waitstatus_to_exitcode(status)}):\n{text[-2000:]}")
    m = re.search(r"planned (\d+) phases in ([\d.]+) s", text)
    return {"checkout": str(package_dir) if package_dir else "this one", "wall_s": round(wall, 2),
            "planning_s": float(m.group(2)) if m else None, "phases": int(m.group(1)) if m else None,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}  # Linux reports KiB


def same_plan(a: Path, b: Path) -> bool:
    """Whether two plan files agree in everything but their creation time."""
    pa, pb = json.loads(a.read_text()), json.loads(b.read_text())
    for p in (pa, pb):
        p.get("inputs", {}).pop("created", None)
    return pa == pb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="another checkout's directory, planned first")
    ap.add_argument("--profile", type=Path, help="the projected profile (default: projected now, about 25 s)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plan_large.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plan-large-"))
    profile = args.profile
    if profile is None:
        profile = work / "llama-3.1-70b.json"
        subprocess.run([sys.executable, "-m", "ptplan.cli.main", "profile", *PROFILE_ARGS, "--out", str(profile)],
                       check=True, capture_output=True)
    rows = []
    if args.baseline is not None:
        rows.append(run_plan(profile, work / "baseline.json", args.baseline))
    rows.append(run_plan(profile, work / "plan.json", None))
    print(f"{'checkout':<28} {'phases':>6} {'planning s':>10} {'CPU s':>7} {'peak RSS MiB':>12}")
    for r in rows:
        print(f"{r['checkout'][-28:]:<28} {r['phases']:>6} {r['planning_s']:>10.2f} {r['cpu_s']:>7.2f} "
              f"{r['peak_rss_mib']:>12.1f}")
    result = {"command": "python bench/plan_large.py" + (f" --baseline {args.baseline}" if args.baseline else ""),
              "profile_command": "ptplan profile " + " ".join(PROFILE_ARGS), "plan_args": PLAN_ARGS,
              "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg()[0],
              "rows": rows}
    if args.baseline is not None:
        result["same_plan"] = same_plan(work / "baseline.json", work / "plan.json")
        result["speedup"] = round(rows[0]["planning_s"] / rows[1]["planning_s"], 2)
        print(f"same plan: {result['same_plan']}; {result['speedup']}x faster")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
