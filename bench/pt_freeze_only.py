"""PipeTransformer's ImageNet freeze-only bar (0.95x, PyTorch blog Fig. 9) against three ways of running the frozen
layers (issue 22 item 6; what the paper's code does is read in ``bench/published.py``'s module docstring).

Each is the freeze-only row of ``planner/ablate.py`` -- the no-freeze baseline's K, D, M, b and schedule kept, the
stage costs from ``freeze_only_costs`` (its ``table`` hook picks how the frozen layers are priced), the simulator,
the trajectory walked by ``planner.walk`` -- on ``bench/published.py``'s ImageNet setting (its profile, the paper
cluster, GPipe, batch 400, 10 epochs), under alpha 1/3 (the bench's) and 0.07 (the code's ImageNet sweep from
2021-02-09):

- ``in-place``: ptplan's row (``frozen_in_place_table``): frozen layers stay in their stages, run their no-grad
  forward and no backward. Equals ``ablate``'s freeze-only row (checked here).
- ``input-grad``: as in-place, plus each frozen layer's backward input-gradient part (``backward_s -
  backward_weight_s``): the hypothesis that torch Pipe's fork/join "phony" makes frozen layers' inputs require
  grad. The source refutes it (torch's and the code's ``dependency.py`` fork/join only lanes that already require
  grad); shown for scale only.
- ``moved-out``: what the code does with AutoPipe off: the embedding and frozen blocks leave the Pipe
  (``FrozenLayer``) and run under ``torch.no_grad()`` on the pipeline's first GPU before it, so stage 0 starts each
  iteration with M x the prefix's no-grad forward per micro-batch (its ``setup_s``), and the active layers are split
  over K by the paper's ``partition.greedy_param_partition`` (the static split, the prefix then costing nothing in
  it, where that rule leaves a stage empty: the code would have built an empty partition there).

Each speedup is over ptplan's no-freeze baseline (the bench's) and over the variant's own, nothing frozen
(``unfrozen``): for moved-out that is the greedy split the paper's baseline also ran.

    python bench/pt_freeze_only.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ptplan.planner.ablate import ablate, freeze_only_costs, frozen_in_place_table, start_K_for  # noqa: E402
from ptplan.planner.cluster import Cluster, get_preset  # noqa: E402
from ptplan.planner.config import TrainingConfig  # noqa: E402
from ptplan.planner.costs import CostTable  # noqa: E402
from ptplan.planner.errors import InfeasibleError  # noqa: E402
from ptplan.planner.freeze import FreezePolicy  # noqa: E402
from ptplan.planner.partition import greedy_param_partition  # noqa: E402
from ptplan.planner.plan import Phase  # noqa: E402
from ptplan.planner.planner import make_plan, visits, walk  # noqa: E402
from ptplan.planner.profile import Profile  # noqa: E402
from ptplan.planner.schedule import build_schedule  # noqa: E402
from ptplan.planner.search import Candidate, PhaseSearch  # noqa: E402
from ptplan.planner.simulate import StageCost, simulate  # noqa: E402

PUBLISHED = 0.95
KEY = "pipetransformer-imagenet-freeze-only"
ALPHAS = (1 / 3, 0.07)
Ranges = Sequence[tuple[int, int]]
Variant = Callable[[PhaseSearch, Candidate, Ranges, int], tuple[str, list[StageCost]]]


def input_grad_table(table: CostTable, n0: int) -> CostTable:
    """``frozen_in_place_table`` with each frozen layer's backward its input-gradient part (no weight gradient)."""
    t = frozen_in_place_table(table, n0)
    t._bwd = np.where((np.arange(table.n) < n0)[:, None], table._bwd - table._bww, t._bwd)
    return t


def moved_out_table(table: CostTable, n0: int) -> CostTable:
    """``frozen_in_place_table`` with the frozen layers' forward out of the pipeline (priced as stage 0's setup)."""
    t = frozen_in_place_table(table, n0)
    t._fwd = np.where((np.arange(table.n) < n0)[:, None], 0.0, t._fwd)
    return t


def in_place(search: PhaseSearch, cand: Candidate, static: Ranges, n0: int) -> tuple[str, list[StageCost]]:
    return "static", freeze_only_costs(search, cand, static, n0)


def input_grad(search: PhaseSearch, cand: Candidate, static: Ranges, n0: int) -> tuple[str, list[StageCost]]:
    return "static", freeze_only_costs(search, cand, static, n0, input_grad_table)


def moved_out(search: PhaseSearch, cand: Candidate, static: Ranges, n0: int) -> tuple[str, list[StageCost]]:
    try:
        split = greedy_param_partition(search.t.params[n0:], cand.K).ranges
        ranges, how = [(lo + n0, hi + n0) for lo, hi in split], "greedy"
        ranges[0] = (0, ranges[0][1])
    except InfeasibleError:
        ranges, how = list(static), "static"
    costs = freeze_only_costs(search, cand, ranges, n0, moved_out_table)
    prefix = cand.M * search.t.prefix_nograd_s(n0, cand.b)
    return how, [replace(costs[0], setup_s=costs[0].setup_s + prefix), *costs[1:]]


VARIANTS: dict[str, Variant] = {"in-place": in_place, "input-grad": input_grad, "moved-out": moved_out}


def unfrozen(variant: Variant) -> Variant:
    """``variant`` with nothing frozen: its own no-freeze baseline (the moved-out one splits by the paper's greedy
    balancer, as the paper's baseline did; the others are ptplan's baseline)."""
    return lambda search, cand, static, n0: variant(search, cand, static, 0)


def row_seconds(search: PhaseSearch, base: Phase, table: list[int], cfg: TrainingConfig, freeze: FreezePolicy,
                variant: Variant) -> tuple[float, list[str]]:
    """The freeze-only row's predicted seconds under ``variant``, and per visited frozen count its split and
    iteration."""
    cand = Candidate(K=base.K, D=base.D, M=base.M, b=base.micro_batch_size, cache=False, schedule=base.schedule,
                     V=base.V)
    sched = build_schedule(base.schedule, base.K, base.M, base.V)
    counts = sorted(visits(table, cfg, freeze, search.W))
    phases, notes = [], []
    for f in counts:
        n0 = search.p.frozen_boundary(f)
        how, costs = variant(search, cand, base.partition, n0)
        it = simulate(sched, costs, step_overhead_s=search.c.step_overhead_s).iteration_s
        phases.append(replace(base, predicted=replace(base.predicted, iteration_s=it, fill_iteration_s=0.0),
                              frozen_blocks=f, frozen_layers=n0, notes=()))
        notes.append(f"f={f} {how} {it:.3f} s")
    points = walk(phases, {f: i for i, f in enumerate(counts)}, table, cfg, freeze)
    return float(sum(p.seconds for p in points)), notes


def measure(prof: Profile, cluster: Cluster, training: TrainingConfig, alpha: float) -> list[dict[str, Any]]:
    """Every variant's speedup over the no-freeze baseline under the geometric trajectory of ``alpha``."""
    freeze = FreezePolicy(policy="geometric", alpha=alpha)
    ab = ablate(prof, cluster, training, freeze)
    base_s, ab_row = ab.row("no-freeze").seconds, ab.row("freeze-only").seconds
    assert base_s is not None and ab_row is not None
    cfg = replace(training, start_K=start_K_for(cluster, training), cache="auto")  # as ``ablate`` runs its rows
    plan = make_plan(prof, cluster, cfg, freeze)
    search, table = PhaseSearch(prof, cluster, cfg), list(plan.freeze_steps)
    out = []
    for name, variant in VARIANTS.items():
        secs, notes = row_seconds(search, plan.baseline.phase, table, cfg, freeze, variant)
        own, _ = row_seconds(search, plan.baseline.phase, table, cfg, freeze, unfrozen(variant))
        if name == "in-place" and abs(secs / ab_row - 1) > 1e-9:
            raise AssertionError(f"in-place {secs} s is not ablate's freeze-only row {ab_row} s")
        out.append({"alpha": alpha, "variant": name, "seconds": secs, "baseline_seconds": base_s,
                    "speedup": base_s / secs, "error": base_s / secs / PUBLISHED - 1, "own_baseline_seconds": own,
                    "own_speedup": own / secs, "own_error": own / secs / PUBLISHED - 1, "phases": notes})
    return out


def main(argv: list[str] | None = None) -> int:
    import published

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pt_freeze_only.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    pt = next(p for p in published.other_points() if p.key == KEY)
    s = pt.setting
    prof = published.profile_for(pt, published.Counts(), {}, {})  # the RTX 5000 keeps its default efficiency
    training = TrainingConfig(epochs=s["epochs"], samples_per_epoch=s["samples"], batch=s["batch"],
                              batch_policy="constant-pipeline", allow_extrapolation=True, schedule=s["schedule"])
    rows = [r for a in ALPHAS for r in measure(prof, get_preset(s["like"]), training, a)]
    print("speedup over ptplan's no-freeze baseline, and over the variant's own (nothing frozen, its split)")
    print(f"{'alpha':>6} {'variant':<11} {'speedup':>8} {'vs 0.95x':>9} {'own':>7} {'vs 0.95x':>9}  "
          "phases (split, iteration)")
    for r in rows:
        print(f"{r['alpha']:6.3f} {r['variant']:<11} {r['speedup']:7.2f}x {100 * r['error']:+8.1f} % "
              f"{r['own_speedup']:6.2f}x {100 * r['own_error']:+8.1f} %  " + "; ".join(r["phases"]))
    args.out.write_text(json.dumps({"published": PUBLISHED, "point": KEY, "where": pt.where, "rows": rows,
                                    "command": "python bench/pt_freeze_only.py",
                                    "seconds": time.perf_counter() - t0}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
