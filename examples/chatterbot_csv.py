"""Write a real labelled text corpus as a CSV (``text,topic``): the English ChatterBot statements that the PyPI
package ``chatterbot-corpus`` ships (BSD-3-Clause), filed under their topics -- the data of the fine-tuning
walk-through in docs/finetuning.md.

    pip install chatterbot-corpus pyyaml
    python examples/chatterbot_csv.py statements.csv [--topics tech_support,trivia,coding,emotion,ai] [--per-class 200]
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_minilm import TOPICS, statements  # noqa: E402  (the same statements the example trains on)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="CSV file to write (header: text,topic).")
    ap.add_argument("--topics", default=",".join(TOPICS), help="ChatterBot topics, comma-separated.")
    ap.add_argument("--per-class", type=int, default=200, help="At most this many statements per topic.")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    topics = tuple(t.strip() for t in args.topics.split(",") if t.strip())
    rows = statements(topics, args.per_class, args.seed)
    with open(args.out, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "topic"])
        w.writerows((text, topics[label]) for text, label in rows)
    print(f"wrote {len(rows)} statements of {len(topics)} topics ({', '.join(topics)}) to {args.out}")


if __name__ == "__main__":
    main()
