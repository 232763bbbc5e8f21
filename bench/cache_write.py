"""The AutoCache's host side alone: writing a step's rows into a fresh slab, and reading them back.

What a fill step costs on the host besides the prefix's compute: ``ActivationCache.put`` of one step's rows (numpy
copies into a memory-mapped slab on tmpfs, first touch of its pages included) and, for a later hit, ``get``. The
default shape is the lent H100's bert-base / gpt2 runs' (32 samples × 128 tokens × 768, bf16: 6.3 MB per step,
3,200 samples). Medians over the steps; the first put, which creates the slab, apart; each row is read twice (the
first read of a row maps its page into this process, a later epoch's does not).

    python bench/cache_write.py [--batch 32] [--seq 128] [--hidden 768] [--samples 3200] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    from ptplan.executor.cache.autocache import ActivationCache, default_root

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--samples", type=int, default=3200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cache_write.json")
    a = ap.parse_args(argv)
    rows = torch.randn(a.batch, a.seq, a.hidden).to(torch.bfloat16)
    puts, gets = [], []
    with tempfile.TemporaryDirectory(dir=default_root()) as root:
        cache = ActivationCache(root, job_id="bench", create=True, sample_shape=(a.seq, a.hidden), dtype=torch.bfloat16,
                                num_samples=a.samples, budget_bytes=2 * a.samples * rows[0].nbytes)
        steps = [torch.arange(k * a.batch, (k + 1) * a.batch) for k in range(min(a.steps, a.samples // a.batch))]
        for ids in steps:
            t = time.perf_counter()
            cache.put(ids, 4, rows)
            puts.append(time.perf_counter() - t)
        for ids in steps:
            t = time.perf_counter()
            cache.get(ids, 4)
            gets.append(time.perf_counter() - t)
        again = []
        for ids in steps:  # a later epoch's reads (the pages this process touched stay mapped)
            t = time.perf_counter()
            cache.get(ids, 4)
            again.append(time.perf_counter() - t)
        cache.cleanup()
    res = {"command": f"python bench/cache_write.py --batch {a.batch} --seq {a.seq} --hidden {a.hidden} "
                      f"--samples {a.samples}", "bytes_per_step": rows.nbytes, "first_put_s": puts[0],
           "median_put_s": statistics.median(puts[1:]), "median_get_s": statistics.median(gets),
           "median_get_again_s": statistics.median(again), "steps": len(puts)}
    print(f"{rows.nbytes / 1e6:.1f} MB per step: put {res['median_put_s'] * 1e3:.2f} ms (first, creating the slab, "
          f"{puts[0] * 1e3:.1f} ms), get {res['median_get_s'] * 1e3:.2f} ms, get again "
          f"{res['median_get_again_s'] * 1e3:.2f} ms; medians of {len(puts)} steps")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
