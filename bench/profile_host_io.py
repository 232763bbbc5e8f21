"""Fill a measured profile's AutoCache host rates (``measurement.host_io``) by measuring them on this machine.

Profiles written before the profiler measured the AutoCache's host traffic (``executor/profiling/host_io.py``) plan
with the config's assumed ``host_read_bandwidth`` for it. This runs only that measurement, on the profile's device
kind, for its model's prefix output rows (``prefix_sample_shape``, the profile's dtype, its largest micro-batch),
and writes the profile with ``measurement.host_io`` filled (with the machine and command), everything else as it
was. Run it on the machine (device and host) the profile describes.

    python bench/profile_host_io.py PROFILE.json... [--device cpu|cuda] [--out-dir DIR]   (default: in place)
"""
from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from ptplan.executor.cache.autocache import prefix_sample_shape
from ptplan.executor.profiling.host_io import measure_host_io
from ptplan.executor.profiling.profiler import model_for_profile
from ptplan.planner.profile import load_profile


def fill(path: Path, out: Path, device: str) -> None:
    prof = load_profile(path)
    if prof.provenance.source != "measured":
        raise SystemExit(f"{path}: a {prof.provenance.source} profile; host rates belong to measured ones")
    dev = torch.device(device)
    model = model_for_profile(prof, layers=[])  # no weights: the shape and dtype are all it gives
    shape = prefix_sample_shape(model)
    io = measure_host_io(dev, shape, next(model.parameters()).dtype, max(prof.batch_sizes))
    io.update(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
              date=datetime.date.today().isoformat(),
              command=f"python bench/profile_host_io.py --device {device} {path.name}")
    d = json.loads(path.read_text())
    d["measurement"]["host_io"] = io
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(d, indent=1) + "\n")
    load_profile(out)  # still a valid profile
    gb = lambda k: "-" if io[k] is None else f"{io[k] / 1e9:.1f}"  # noqa: E731
    print(f"{path.name}: rows of {list(shape)} x {io['rows_per_step']} ({io['bytes_per_step'] / 1e6:.1f} MB): "
          f"write {gb('rows_write_bytes_per_s')} GB/s, read {gb('rows_read_bytes_per_s')} GB/s, weights to the "
          f"device {gb('weights_to_device_bytes_per_s')} GB/s -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("profiles", nargs="+", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out-dir", type=Path, default=None, help="write here (same file names); default: in place")
    a = ap.parse_args()
    for p in a.profiles:
        fill(p, (a.out_dir / p.name) if a.out_dir else p, a.device)


if __name__ == "__main__":
    main()
