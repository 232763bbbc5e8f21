"""Fill a profile's backward working set (``backward_working_bytes_per_sample``, ``accumulate_bytes``) and the split
backward's stash (``backward_stash_bytes_per_sample``) by measuring them.

Profiles written before the profiler measured the backward's working set or the stash (``executor/profiling/
live_bytes.py``) load with 0 there. This re-runs only the profiler's memory pass (``live_bytes.memory_pass``: one
forward, two backwards and one split backward per layer, no timing) for each profile's model, on the profile's device
kind, at its memory batch size, and writes the profile with the three fields filled, everything else as it was;
``measurement.backward_working`` says how. The output
and saved-for-backward bytes are measured again beside them and must equal the profile's (the same model, kernels
and size), or the profile is left alone and the script exits 1.

    python bench/profile_working.py PROFILE.json... [--device cpu|cuda] [--out-dir DIR]   (default: in place)
    python bench/profile_working.py --projected PROFILE.json...   (projected profiles: the same pass on fake tensors)
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from ptplan.executor.profiling.live_bytes import memory_pass
from ptplan.executor.profiling.profiler import model_for_profile
from ptplan.executor.profiling.project import fake_memory_pass
from ptplan.planner.profile import load_profile


def fill(path: Path, out: Path, device: str, projected: bool) -> bool:
    prof = load_profile(path)
    b = int(prof.measurement.get("memory_batch_size") or max(prof.batch_sizes))
    t0 = time.perf_counter()
    if projected:
        mem = fake_memory_pass(model_for_profile(prof, layers=[]), b)
        how = "live_bytes.memory_pass on fake CPU tensors (as --project counts)"
    else:
        model = model_for_profile(prof).to(device)
        model.train()
        x, labels, mask = model.make_batch(b, torch.Generator().manual_seed(0))
        mem = memory_pass(model, x.to(device), labels.to(device), None if mask is None else mask.to(device), b)
        how = f"live_bytes.memory_pass on {device}" + (f" ({torch.cuda.get_device_name(0)})" if device == "cuda" else "")
    secs = time.perf_counter() - t0
    have_out = [r.output_bytes_per_sample for r in prof.layers]
    have_saved = [r.saved_bytes_per_sample for r in prof.layers]
    if (mem.output, mem.saved) != (have_out, have_saved):
        bad = [i for i, (a, c, d, e) in enumerate(zip(mem.output, have_out, mem.saved, have_saved)) if (a, d) != (c, e)]
        print(f"{path}: output/saved bytes differ from the profile's at layers {bad[:8]} (measured "
              f"{[mem.saved[i] for i in bad[:4]]}, profile {[have_saved[i] for i in bad[:4]]}); left alone")
        return False
    d = json.loads(path.read_text())
    for layer, w, a, st in zip(d["layers"], mem.working, mem.accumulate, mem.stash):
        layer["backward_working_bytes_per_sample"], layer["accumulate_bytes"] = int(w), int(a)
        layer["backward_stash_bytes_per_sample"] = int(st)
    d["measurement"]["backward_working"] = {
        "method": how, "batch_size": b, "seconds": round(secs, 2), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "python bench/profile_working.py " + ("--projected " if projected else f"--device {device} ")
                   + path.name}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d, indent=1) + "\n")
    load_profile(out)  # still a valid profile
    top = max(range(len(mem.working)), key=lambda i: mem.working[i])
    print(f"{path.name}: b={b}, {secs:.1f} s; largest working set {prof.layers[top].name} "
          f"{mem.working[top] * b / 2**20:.1f} MiB per micro-batch of {b}; largest accumulate "
          f"{max(mem.accumulate) / 2**20:.1f} MiB; largest stash {max(mem.stash) * b / 2**20:.1f} MiB -> {out}")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--projected", action="store_true", help="count on fake tensors (projected profiles)")
    ap.add_argument("--out-dir", type=Path, default=None, help="write here (same file names); default: in place")
    a = ap.parse_args()
    ok = True
    for p in a.profiles:
        ok &= fill(p, (a.out_dir / p.name) if a.out_dir else p, a.device, a.projected)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
