"""The docs' prediction tables, rendered from the bench results that make them, and checked against the docs.

Each table in the docs that a prediction-only bench script makes is marked by a line ``<!-- bench-table: NAME -->``
right above it; ``TABLES`` says which script's JSON renders it and how. ``--check`` renders every marked table
from the results in DIR and lists each that differs from the docs (exit 1); ``--write`` rewrites them in place.
``tests/test_bench_scripts.py`` runs each script on the tree and checks its tables against the fresh output, so a
change that moves a documented prediction fails until the docs say what the code now predicts; the ``TIMED`` tables
(wall-clock seconds, or a 30-minute script) are held to the committed results only.

    python bench/doc_tables.py --check [--results bench/results]
    python bench/doc_tables.py --write [--results bench/results]   (after re-running the scripts)

The ablation table's JSON is ``ptplan ablate ... --json`` (``ABLATE_ARGS``), written as ``ablate.json``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
ABLATE_ARGS = ["vit-base_rtx5000_fp32", "--cluster", "paper", "--alpha", "0.3333", "--epochs", "10"]
MARK = re.compile(r"^<!-- bench-table: ([a-z0-9-]+) -->$")
BAR = "\\|"  # a | inside a markdown table cell


def _x(v: float) -> str:
    return f"{v:.2f}×"


def ablation(d: dict) -> list[str]:
    """docs/results.md: ``ptplan ablate vit-base_rtx5000_fp32 --cluster paper --alpha 0.3333 --epochs 10``."""
    labels = {"freeze-only": "freeze only (static split, K, D, M)",
              "autopipe": "+ AutoPipe (re-split, K ≤ {K}; D fixed)",
              "autopipe-autocache": "+ AutoPipe + AutoCache (D fixed)",
              "autopipe-autodp": "+ AutoPipe + AutoDP (cache off)",
              "full": "+ AutoPipe + AutoDP + AutoCache (ptplan's plan)",
              "greedy-split": "{full} with the paper's greedy parameter balancer",
              "k-halving": "{full} with K halving only",
              "paper-m-table": "{full} with the paper's hard-coded micro-batch table"}
    rows = {r["key"]: r for r in d["rows"]}
    first = rows["no-freeze"]["phases"][0]
    full = rows["full"]["number"]
    out = ["| row | what changed | predicted | speedup | paper |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        label = (f"no freezing: static K = {first['K']} × D = {first['D']}" if r["key"] == "no-freeze" else
                 labels[r["key"]].format(K=d["start_K"], full=full))
        bold = "**" if r["key"] == "full" else ""
        paper = "—" if r["paper_speedup"] is None else f"{bold}{_x(r['paper_speedup'])}{bold}"
        out.append(f"| {r['number']} | {label} | {r['seconds']:,.1f} s | {bold}{_x(r['speedup'])}{bold} | {paper} |")
    return out


def schedules(d: dict) -> list[str]:
    """docs/results.md: ``python bench/schedule_bench.py --part 1``, the projected H100 rows."""
    order = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "looped-bfs", "zb-v"]
    out = ["| model | K | GPipe | 1F1B | interleaved 1F1B | ZB-H1 | looped BFS | ZB-V |",
           "|---|---|---|---|---|---|---|---|"]
    rows = [r for r in d["predictions"] if r["source"] == "h100"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for K in dict.fromkeys(r["K"] for r in rows if r["model"] == model):
            cells = []
            for sched in order:
                r = next(x for x in rows if x["model"] == model and x["K"] == K and x["schedule"] == sched)
                c = f"{r['iteration_s'] * 1e3:.1f} ms, {r['bubble'] * 100:.1f} %"
                if sched == "interleaved-1f1b" or (sched == "looped-bfs" and r["V"] != 2):
                    c += f" (V={r['V']})"
                cells.append(c)
            out.append(f"| {model} | {K} | " + " | ".join(cells) + " |")
    return out


def two_bw(d: dict) -> list[str]:
    """docs/results.md: ``python bench/twobw_bench.py``, nothing frozen: throughput over 1F1B's and the fullest
    rank's peak."""
    out = ["| profile | K | GPipe | 1F1B | 2BW | 2BW + recomputation |", "|---|---|---|---|---|---|"]
    rows = [r for r in d["rows"] if r["frozen_blocks"] == 0]
    for prof in dict.fromkeys(r["profile"] for r in rows):
        for K in dict.fromkeys(r["K"] for r in rows if r["profile"] == prof):
            by = {r["schedule"]: r for r in rows if r["profile"] == prof and r["K"] == K}
            base = by["1f1b"]["samples_per_s"]
            cells = [f"{_x(by[s]['samples_per_s'] / base)}, {by[s]['peak_bytes'] / 2**30:.2f} GiB"
                     for s in ("gpipe", "1f1b", "2bw", "2bw+rc")]
            out.append(f"| {prof} | {K} | " + " | ".join(cells) + " |")
    return out


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 1000 else f"{v:.1f}"


def hybrid(d: dict) -> list[str]:
    """docs/strategies.md: ``python bench/hybrid_bench.py``, the frozen counts the docs show."""
    shown = {"gpt2_h100_bf16": ((0, 11), "gpt2 (projected H100 bf16)"),
             "bert-large_h100_bf16": ((0, 3, 9, 23), "bert-large (projected H100 bf16)")}
    out = ["| case | GPUs | f | hybrid (plan) | pipeline × DP (plan) | plain FSDP | hybrid / pp×dp | hybrid / FSDP |",
           "|---|---|---|---|---|---|---|---|"]

    def plan(x: dict) -> str:
        return f"{_num(x['samples_per_s'])} (K{x['K']} D{x['D']} {x['strategy'].replace('|', BAR)})"

    named = set()
    for c in d["results"]:
        fs, name = shown.get(c["case"], (None, "synthetic GPT 48 × 8192 (39.5 B)"))
        for r in c["rows"]:
            if fs is not None and r["frozen"] not in fs:
                continue
            h, p, f = r["hybrid"], r.get("pp x dp"), r.get("fsdp")
            label = "" if name in named else name
            named.add(name)
            out.append(f"| {label} | {c['gpus']:,} | {r['frozen']} | {plan(h)} | {plan(p) if p else '–'} | "
                       f"{_num(f['samples_per_s']) if f else '–'} | "
                       f"{_x(h['samples_per_s'] / p['samples_per_s']) if p else '–'} | "
                       f"{_x(h['samples_per_s'] / f['samples_per_s']) if f else '–'} |")
    return out


def slices(d: dict) -> list[str]:
    """docs/token-slices.md: ``python bench/terapipe_bench.py`` part 3, b = 1, 4, 32, best over M."""
    ks = d["gpt2_phases_setting"]["K"]
    out = ["| b | " + " | ".join(f"K = {k} unsliced | K = {k} sliced | gain" for k in ks) + " |",
           "|---|" + "---|---|---|" * len(ks)]
    for b in (1, 4, 32):
        cells = []
        for k in ks:
            r = next(x for x in d["gpt2_phases"] if x["K"] == k and x["b"] == b)
            if "best_sliced_s" not in r:  # no M fits the memory
                cells.append("– | – | –")
                continue
            cells.append(f"{r['best_unsliced_s'] * 1e3:.1f} ms | {r['best_sliced_s'] * 1e3:.1f} ms | "
                         f"{_x(r['best_unsliced_s'] / r['best_sliced_s'])}")
        out.append(f"| {b} | " + " | ".join(cells) + " |")
    return out


def published(d: dict) -> list[str]:
    """docs/planning.md: ``python bench/published.py`` (30 minutes: checked against the committed results only),
    the held-out errors by group."""
    labels = {"megatron-t1": "Megatron Table 1",
              "megatron-t2-ptd": "Megatron Table 2, tensor + pipeline + data parallel",
              "megatron-t2-zero3": "Megatron Table 2, ZeRO-3",
              "pipetransformer-speedups": "PipeTransformer speedups (GPipe, 26.6 s per re-partition as the authors "
                                          "logged)"}
    s = d["summary"]
    out = ["| group (held out) | points | median \\|error\\| | max \\|error\\| |", "|---|---|---|---|"]
    for key, g in s["by_group"].items():
        out.append(f"| {labels[key]} | {g['points']} | {100 * g['median_abs_error']:.1f} % | "
                   f"{100 * g['max_abs_error']:.1f} % |")
    out.append(f"| **all held out** (targets: median ≤ 15 %, max ≤ 35 %) | **{s['held_out_priced']}** | "
               f"**{100 * s['median_abs_error']:.1f} %** | **{100 * s['max_abs_error']:.1f} %** |")
    return out


def _pct(v: float) -> str:
    return f"{100 * v:+.1f} %".replace("-", "−")


def gpu_replan(d: dict) -> list[str]:
    """docs/results.md: ``python bench/gpu_replan.py``, the lent H100's runs planned again by this tree."""
    out = ["| model | frozen | step | measured ms | predicted before | predicted now | error before | error now |",
           "|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        out.append(f"| {r['model']} | {r['frozen']} | {r['kind']} | {r['measured_s'] * 1e3:.1f} | "
                   f"{r['old_predicted_s'] * 1e3:.1f} | {r['new_predicted_s'] * 1e3:.1f} | {_pct(r['old_error'])} | "
                   f"{_pct(r['new_error'])} |")
    return out


def planning_speed(d: dict) -> list[str]:
    """docs/results.md: ``python bench/plan_bench.py --repeats 3``, median wall seconds per case (timed: checked
    against the committed results only)."""
    rows = {(r["blocks"], r["gpus"]): r for r in d["rows"]}
    gpus = sorted({g for _, g in rows})
    out = ["| blocks \\ GPUs | " + " | ".join(f"{g:,}" for g in gpus) + " |", "|---" * (len(gpus) + 1) + "|"]
    for b in sorted({b for b, _ in rows}):
        cells = []
        for g in gpus:
            r = rows[(b, g)]
            c = f"{r['median_s']:.2f} s"
            if r["target_s"]:
                c += f" (target < {r['target_s']:g} s: {'met' if r['verdict'] == 'PASS' else 'MISSED'})"
            cells.append(c)
        out.append(f"| {b} | " + " | ".join(cells) + " |")
    return out


def slice_planning(d: dict) -> list[str]:
    """docs/token-slices.md: ``python bench/terapipe_bench.py`` part 1, TeraPipe's slice search at L = 2048, K = 48
    (timed: checked against the committed results only)."""
    out = ["| slice granularity g | planning time | bounds τ evaluated | slices chosen |", "|---|---|---|---|"]
    for r in d["timing"]:
        sl = r["slices"]
        shape = f", non-uniform ({max(sl)} → {min(sl)})" if len(set(sl)) > 2 else ""
        secs = f"{r['median_s']:.3f} s" if r["median_s"] < 0.1 else f"{r['median_s']:.2f} s"
        out.append(f"| {r['granularity']} tokens | {secs} | {r['candidates']:,} | {len(sl)}{shape} |")
    return out


def split_proofs(d: dict) -> list[str]:
    """docs/results.md: ``python bench/split_proofs.py``, how each ``best_split`` call ended (timed: checked against
    the committed results only)."""
    out = ["| schedule | blocks / GPUs | every split scored | AutoPipe's kept (first pass) | proven by the bound "
           "| proven by the chains (after 0 / 1 / 2 scored) | descent (unproven) | CPU s | peak MiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        o = r["outcomes"]
        out.append(f"| {r['schedule']} | {r['blocks']} / {r['gpus']:,} | {o['every split'] + o['one stage']:,} | "
                   f"{o['first pass']:,} | {o['bound']} | {o['chains 0']} / {o['chains 1']} / {o['chains 2']} | "
                   f"{o['descent']} | {r['cpu_s']:.1f} | {r['peak_rss_kib'] / 1024:.0f} |")
    return out


# name: (doc, the JSON in DIR, renderer)
TABLES: dict[str, tuple[str, str, Callable[[dict], list[str]]]] = {
    "ablation": ("docs/results.md", "ablate.json", ablation),
    "schedules": ("docs/results.md", "schedule_bench.json", schedules),
    "two-bw": ("docs/results.md", "twobw_bench.json", two_bw),
    "hybrid": ("docs/strategies.md", "hybrid_bench.json", hybrid),
    "token-slices": ("docs/token-slices.md", "terapipe_bench.json", slices),
    "published": ("docs/planning.md", "published.json", published),
    "gpu-replan": ("docs/results.md", "gpu_replan.json", gpu_replan),
    "planning-speed": ("docs/results.md", "plan_bench.json", planning_speed),
    "slice-planning": ("docs/token-slices.md", "terapipe_bench.json", slice_planning),
    "split-proofs": ("docs/results.md", "split_proofs.json", split_proofs),
}
TIMED = {"published", "planning-speed", "slice-planning", "split-proofs"}
"""Tables of wall-clock seconds, or of a script too long for the tests: held to the committed results only."""


def doc_table(doc: str, name: str) -> tuple[list[str], int, int]:
    """The doc's lines and the [start, end) line range of table ``name`` (the ``|`` lines under its marker)."""
    lines = (ROOT / doc).read_text().split("\n")
    at = [i for i, line in enumerate(lines) if (m := MARK.match(line)) and m.group(1) == name]
    if len(at) != 1:
        raise SystemExit(f"{doc}: {len(at)} markers '<!-- bench-table: {name} -->' (want 1)")
    start = end = at[0] + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    if end == start:
        raise SystemExit(f"{doc}: no table under the marker of '{name}'")
    return lines, start, end


def differences(results: Path, names: list[str] | None = None) -> dict[str, tuple[list[str], list[str]]]:
    """Per table whose rendering from ``results`` differs from the docs: (the docs' lines, the rendered lines)."""
    out = {}
    for name in list(TABLES) if names is None else names:
        doc, src, render = TABLES[name]
        lines, start, end = doc_table(doc, name)
        want = render(json.loads((results / src).read_text()))
        if lines[start:end] != want:
            out[name] = (lines[start:end], want)
    return out


def tables_of(json_name: str) -> list[str]:
    """The tables rendered from results file ``json_name`` that a fresh run must reproduce (not ``TIMED``)."""
    return [n for n, (_, src, _) in TABLES.items() if src == json_name and n not in TIMED]


def report(diff: dict[str, tuple[list[str], list[str]]]) -> str:
    """``differences``' tables as text: each table's lines that differ, the docs' above what the results give."""
    out = []
    for name, (have, want) in diff.items():
        out.append(f"{TABLES[name][0]}: table '{name}' differs from its results ({TABLES[name][1]}):")
        for h, w in zip(have + [""] * len(want), want + [""] * len(have)):
            if h != w:
                out.append(f"  docs: {h}\n  now:  {w}")
    return "\n".join(out)


def write(results: Path) -> list[str]:
    """Rewrite every table that differs from ``results``; their names."""
    diff = differences(results)
    for name, (_, want) in diff.items():
        lines, start, end = doc_table(TABLES[name][0], name)  # read again: one doc may hold several tables
        lines[start:end] = want
        (ROOT / TABLES[name][0]).write_text("\n".join(lines))
    return list(diff)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list the tables that differ from the results; exit 1")
    mode.add_argument("--write", action="store_true", help="rewrite the marked tables from the results")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results",
                    help="the folder of the scripts' JSON (default bench/results)")
    a = ap.parse_args(argv)
    if a.write:
        changed = write(a.results)
        print("rewrote " + (", ".join(changed) if changed else "nothing: every table matches"))
        return 0
    diff = differences(a.results)
    if diff:
        print(report(diff))
    print(f"{len(diff)} of {len(TABLES)} tables differ" if diff else f"all {len(TABLES)} tables match")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
