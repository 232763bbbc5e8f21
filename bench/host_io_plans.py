"""The shipped measured CUDA profiles' plans in the lent GPU's run setting, for comparing two trees' pricing of the
AutoCache (its host rates, the page-locked weights' host memory).

One GPU (``dgx-h100`` cut to one device, as ``bench/gpu_check.sh`` plans its runs), 3 epochs of 3,200 samples, batch
32, geometric freezing, ``--cache on``: per phase on the trajectory, the frozen blocks, whether it caches, the
steady and the fill iteration and the AutoCache's host memory per node.

    python bench/host_io_plans.py --out NEW.json                      # this tree
    PYTHONPATH=/tmp/old python OLD_TREE/bench/host_io_plans.py ...     # another tree (a package folder of links)
    python bench/host_io_plans.py --compare OLD.json NEW.json [--result bench/results/host_io_plans.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("bert-base", "gpt2", "vit-base", "bert-large", "llama-3.2-1b")


def plans(root: Path) -> dict[str, list[dict]]:
    from ptplan.planner.cluster import cluster_from_json, get_preset
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import make_plan
    from ptplan.planner.profile import load_profile

    one = cluster_from_json({**get_preset("dgx-h100").to_json(), "name": "one-device", "gpus_per_node": 1,
                             "nics_per_node": 1})
    cfg = TrainingConfig(epochs=3, samples_per_epoch=3200, batch=32, cache="on")
    out = {}
    for m in MODELS:
        plan = make_plan(load_profile(root / "profiles" / f"{m}_cuda_bf16.json"), one, cfg, FreezePolicy())
        on = {t.phase for t in plan.trajectory}
        out[m] = [{"frozen_blocks": p.frozen_blocks, "cache": p.cache, "iteration_s": p.predicted.iteration_s,
                   "fill_iteration_s": p.predicted.fill_iteration_s,
                   "cache_host_bytes_per_node": p.predicted.cache_host_bytes_per_node}
                  for i, p in enumerate(plan.phases) if i in on]
    return out


def compare(old: dict, new: dict) -> list[dict]:
    rows = []
    print(f"{'model':<13} {'f':>3} {'steady ms':>17} {'fill ms':>17} {'host GiB':>15}")
    for m in new:
        for a, b in zip(old[m], new[m]):
            rows.append({"model": m, "old": a, "new": b})
            fill = (f"{a['fill_iteration_s'] * 1e3:7.2f} -> {b['fill_iteration_s'] * 1e3:6.2f}"
                    if a["fill_iteration_s"] else f"{'-':>17}")
            print(f"{m:<13} {a['frozen_blocks']:>3} {a['iteration_s'] * 1e3:7.2f} -> {b['iteration_s'] * 1e3:6.2f} "
                  f"{fill} {a['cache_host_bytes_per_node'] / 2**30:6.3f} -> {b['cache_host_bytes_per_node'] / 2**30:5.3f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    ap.add_argument("--result", type=Path, default=ROOT / "bench" / "results" / "host_io_plans.json")
    a = ap.parse_args()
    if a.compare:
        old, new = (json.loads(p.read_text()) for p in a.compare)
        a.result.write_text(json.dumps({"command": "python bench/host_io_plans.py --compare OLD NEW",
                                        "rows": compare(old, new)}, indent=1))
        print(f"wrote {a.result}")
        return
    res = plans(ROOT)
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.write_text(text)
        print(f"wrote {a.out}")
    else:
        print(text)


if __name__ == "__main__":
    main()
