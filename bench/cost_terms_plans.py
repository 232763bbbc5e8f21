"""Shipped-profile plans before and after a cost-model change (issue 22 item 2): every phase's K, D, M, strategy,
schedule, slices, predicted iteration and peak memory, for the README's usual settings.

    python bench/cost_terms_plans.py --out /tmp/new.json            # this tree
    python bench/cost_terms_plans.py --compare /tmp/old.json /tmp/new.json

The --compare table lists every phase whose prediction changed (its shape, "cache" where the AutoCache is on), and
each case's whole-plan seconds where they changed (bench/results/cost_terms_plans.json keeps the
comparison of the backward's working set; ``--result FILE`` writes another comparison elsewhere)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # (profile, cluster, batch, strategies, token slices)
    ("bert-large_a100_bf16", "cpu:4", 64, "off", "off"),
    ("bert-large_a100_bf16", "dgx-h100", 256, "auto", "off"),
    ("bert-large_h100_bf16", "h100-4node", 1024, "auto", "off"),
    ("bert-base_rtx5000_fp32", "paper", 512, "off", "off"),
    ("bert-base_rtx5000_fp32", "paper", 512, "auto", "off"),
    ("vit-base_rtx5000_fp32", "paper", 512, "off", "off"),
    ("gpt2_h100_bf16", "dgx-h100", 64, "auto", "off"),
    ("gpt2_a100_bf16", "h100-4node", 256, "auto", "off"),
    ("gpt2_cpu_fp32_slices", "cpu:4", 8, "off", "auto"),
    ("gpt2_cpu_fp32_slices", "cpu:4", 8, "auto", "auto"),
]


def run(out: str) -> None:
    sys.path.insert(0, str(ROOT))
    from ptplan.planner.cluster import get_preset
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import TrainingConfig, make_plan
    from ptplan.planner.profile import load_profile

    rows = []
    for prof_name, cl, batch, strat, sl in CASES:
        prof = load_profile(ROOT / "profiles" / f"{prof_name}.json")
        cfg = TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=batch, allow_extrapolation=True)
        plan = make_plan(prof, get_preset(cl), cfg, FreezePolicy(policy="geometric", alpha=1 / 3),
                         strategies=strat, token_slices=sl)
        for ph in plan.phases:
            rows.append({"case": f"{prof_name} {cl} b{batch} strategies={strat} slices={sl}",
                         "frozen": ph.frozen_blocks, "K": ph.K, "D": ph.D, "M": ph.M, "tp": getattr(ph, "tp", 1),
                         "schedule": ph.schedule, "strategy": ph.strategy_label,
                         "slices": list(getattr(ph, "slices", ()) or ()), "cache": ph.cache,
                         "iteration_s": ph.predicted.iteration_s,
                         "peak_GiB": max(ph.predicted.stage_peak_memory_bytes) / 2**30,
                         "plan_seconds": plan.totals.seconds, "plan_fill_seconds": plan.totals.fill_seconds})
        print(f"{prof_name} {cl}: {len(plan.phases)} phases", flush=True)
    Path(out).write_text(json.dumps(rows, indent=1))


def compare(old: str, new: str, result: Path | None = None) -> None:
    a, b = json.loads(Path(old).read_text()), json.loads(Path(new).read_text())
    key = lambda r: (r["case"], r["frozen"])  # noqa: E731
    old_by = {key(r): r for r in a}
    changed = []
    for r in b:
        o = old_by.get(key(r))
        if o is None:
            continue
        shape = lambda x: f"K{x['K']} D{x['D']} M{x['M']} tp{x['tp']} {x['schedule']} {x['strategy']}" + (  # noqa: E731
            f" slices {','.join(map(str, x['slices']))}" if x["slices"] else "") + (" cache" if x.get("cache") else "")
        if shape(o) != shape(r) or abs(o["iteration_s"] - r["iteration_s"]) > 1e-9 * max(1.0, o["iteration_s"]) \
                or abs(o["peak_GiB"] - r["peak_GiB"]) > 1e-6:
            changed.append({"case": r["case"], "frozen": r["frozen"], "old": shape(o), "new": shape(r),
                            "old_iteration_s": o["iteration_s"], "new_iteration_s": r["iteration_s"],
                            "old_peak_GiB": o["peak_GiB"], "new_peak_GiB": r["peak_GiB"]})
    print(f"{len(changed)} of {len(b)} phases changed")
    totals = {}  # each case's whole plan: predicted seconds (AutoCache fills included), where both runs record it
    for x, side in ((a, "old"), (b, "new")):
        for r in x:
            if "plan_seconds" in r:
                totals.setdefault(r["case"], {})[side] = (r["plan_seconds"], r["plan_fill_seconds"])
    totals = {c: t for c, t in totals.items() if len(t) == 2 and t["old"] != t["new"]}
    for c, t in totals.items():
        print(f"{c}: plan {t['old'][0]:.4g} s (fills {t['old'][1]:.3g} s) -> {t['new'][0]:.4g} s "
              f"(fills {t['new'][1]:.3g} s)")
    for c in changed:
        print(f"{c['case']} f={c['frozen']}: {c['old']} {c['old_iteration_s']:.4g} s {c['old_peak_GiB']:.2f} GiB -> "
              f"{c['new']} {c['new_iteration_s']:.4g} s {c['new_peak_GiB']:.2f} GiB")
    result = result or ROOT / "bench" / "results" / "cost_terms_plans.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps({"phases": len(b), "changed": changed, "plans": totals, "old": old, "new": new},
                                 indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    ap.add_argument("--result", type=Path, help="where --compare writes its table (default "
                                                  "bench/results/cost_terms_plans.json)")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare, result=args.result)
    else:
        run(args.out or "/tmp/cost_terms_plans.json")
