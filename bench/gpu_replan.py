"""The lent H100's runs against their plans made again by this tree's planner (no GPU needed).

``bench/gpu_check.sh`` planned, ran and compared bert-base, gpt2 (``bench/results/gpu_check/run4``) and vit-base
(``run3``) on one H100: K = 1, D = 1, batch 32, 3 epochs of 100 steps, freezing 0 -> 4 -> 7 blocks, AutoCache on.
This re-makes each plan with the same command (``ptplan plan PROFILE --cluster cluster.json --epochs 3
--samples-per-epoch 3200 --batch 32 --freeze geometric --cache on``) from the same profile (the run's, as
``profiles_used.txt`` names it: the call's own file, else the shipped one) and compares the old and the new plan
with the run's log (``planner.compare``), so a change of the cost model is measured against the GPU without one.

    python bench/gpu_replan.py [--out bench/results/gpu_replan.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gpu_check"
RUNS = {"bert-base": "run4", "gpt2": "run4", "vit-base": "run3"}
"""Each model's last run on the H100 (run4 re-ran bert-base and gpt2 after the working-set fix)."""


def _profile(run: str, model: str) -> Path:
    """The profile the run was planned from, here: the call's own measured file, else the shipped one."""
    used = dict(line.split() for line in (RESULTS / run / "run" / "profiles_used.txt").read_text().splitlines())
    own = RESULTS / run / "profiles" / Path(used[model]).name
    return own if own.is_file() else ROOT / "profiles" / Path(used[model]).name


def replan(model: str, run: str, out: Path) -> Path:
    from ptplan.planner.plan import load_plan

    old = load_plan(str(RESULTS / run / "run" / model / "plan.json"))
    t = old.inputs.training
    cmd = [sys.executable, "-c", "from ptplan.cli.main import main; main()", "plan", str(_profile(run, model)),
           "--cluster",
           str(RESULTS / run / "run" / "cluster.json"), "--epochs", str(t.epochs), "--samples-per-epoch",
           str(t.samples_per_epoch), "--batch", str(t.batch), "--freeze", "geometric", "--cache", "on", "--out",
           str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return out


def rows(model: str, run: str, new_plan: Path) -> list[dict[str, Any]]:
    from ptplan.planner.compare import compare, read_run_log
    from ptplan.planner.plan import load_plan

    d = RESULTS / run / "run" / model
    log = read_run_log(str(d / "run.jsonl"))
    old, new = compare(load_plan(str(d / "plan.json")), log), compare(load_plan(str(new_plan)), log)
    out = []
    for a, b in zip(sorted(old.phases + old.fills, key=lambda r: (r.phase, r.kind)),
                    sorted(new.phases + new.fills, key=lambda r: (r.phase, r.kind))):
        assert (a.phase, a.kind, a.measured_iteration_s) == (b.phase, b.kind, b.measured_iteration_s)
        out.append({"model": model, "run": run, "phase": a.phase, "frozen": a.frozen_blocks, "kind": a.kind,
                    "measured_s": a.measured_iteration_s, "old_predicted_s": a.predicted_iteration_s,
                    "new_predicted_s": b.predicted_iteration_s, "old_error": a.iteration_error,
                    "new_error": b.iteration_error, "measured_MiB": (a.measured_peak_memory_bytes or 0) / 2**20,
                    "old_MiB": a.predicted_peak_memory_bytes / 2**20, "new_MiB": b.predicted_peak_memory_bytes / 2**20})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_replan.json")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    table: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, run in RUNS.items():
            table += rows(model, run, replan(model, run, Path(tmp) / f"{model}.json"))
    hdr = (f"{'model':<10} {'phase':>5} {'frozen':>6} {'step':<7} {'measured ms':>11} {'old ms':>8} {'new ms':>8} "
           f"{'old err':>8} {'new err':>8} {'meas MiB':>9} {'old MiB':>8} {'new MiB':>8}")
    print(hdr + "\n" + "-" * len(hdr))
    for r in table:
        print(f"{r['model']:<10} {r['phase']:>5} {r['frozen']:>6} {r['kind']:<7} {r['measured_s'] * 1e3:>11.1f} "
              f"{r['old_predicted_s'] * 1e3:>8.1f} {r['new_predicted_s'] * 1e3:>8.1f} {r['old_error']:>+8.1%} "
              f"{r['new_error']:>+8.1%} {r['measured_MiB']:>9.1f} {r['old_MiB']:>8.1f} {r['new_MiB']:>8.1f}")
    summary = {k: statistics.median(abs(r[f"{k}_error"]) for r in table) for k in ("old", "new")}
    steady = {k: statistics.median(abs(r[f"{k}_error"]) for r in table if r["kind"] == "steady") for k in ("old", "new")}
    print(f"median |time error| over {len(table)} rows: {summary['old']:.1%} -> {summary['new']:.1%} "
          f"(steady rows {steady['old']:.1%} -> {steady['new']:.1%})")
    res = {"command": "python bench/gpu_replan.py", "rows": table, "median_abs_error": summary,
           "median_abs_error_steady": steady, "seconds": round(time.perf_counter() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
