"""The zero-bubble split backward's seconds against the fused backward's, as the profiler measures both.

The profiler times every layer's backward whole and split as zero-bubble schedules run it (B: torch's
``stage_backward_input``; W: ``stage_backward_weight``). ``tests/test_profiler.py`` proves the split does exactly
the fused backward's FLOPs and gives its gradients; what it costs on top is machine-dependent -- each split layer
walks its autograd graph in Python once more -- so it is measured here, not asserted in a unit test. Per model:
the profile's ``measurement["backward_split"]`` sums, (B + W) / backward, one intra-op thread, CPU-time timer.

    python bench/split_backward_bench.py [--repeats 3] [--out bench/results/split_backward_bench.json]
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

CASES = (("bert-tiny", 16, 8), ("bert-small", 64, 8), ("gpt2-tiny", 16, 8))


def main() -> None:
    from ptplan.executor.families.models import build_model
    from ptplan.executor.profiling.profiler import profile_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "split_backward_bench.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'model':<12} {'seq':>4} {'b':>3} {'B ms':>8} {'W ms':>8} {'B+W ms':>8} {'whole ms':>9} {'ratio':>6}")
    for name, seq, b in CASES:
        prof = profile_model(build_model(name, seq_len=seq), device="cpu", batch_sizes=[b], warmup=1,
                             repeats=args.repeats, progress=False, timer="cpu")
        d = prof.measurement["backward_split"][0]
        ratio = (d["input_s"] + d["weight_s"]) / d["backward_s"]
        rows.append({"model": name, "seq_len": seq, "batch_size": b, **d, "ratio": ratio})
        print(f"{name:<12} {seq:>4} {b:>3} {d['input_s'] * 1e3:>8.2f} {d['weight_s'] * 1e3:>8.2f} "
              f"{(d['input_s'] + d['weight_s']) * 1e3:>8.2f} {d['backward_s'] * 1e3:>9.2f} {ratio:>6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python bench/split_backward_bench.py", "repeats": args.repeats,
                                    "machine": platform.processor() or platform.machine(),
                                    "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
