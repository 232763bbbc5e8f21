"""Where an AutoCache fill step's time goes on a GPU: the fill path taken apart, part by part.

A fill step on stage 0 (``serve_prefix``) streams the frozen prefix's weights from host memory through the device
one layer at a time, runs the prefix, copies its rows to the host and writes them into the cache's memory-mapped
slabs; a refresh step reads rows cached at a smaller count, sends them to the device and runs the layers between.
The lent H100's bert-base and gpt2 runs paid about 21.5 ms per fill or refresh step that no term of the plan
priced (docs/results.md). This script measures, on one device, for one model at the runs' shape (batch 32 × 128
tokens, bf16):

- the raw copies: host to device of the prefix's weights from pageable and from pinned memory, device to host of
  one step's rows;
- the prefix's forward with its weights on the device (compute alone), streamed from pageable host memory (how
  the runtime keeps them) and streamed from pinned memory;
- ``ActivationCache.put`` of the rows from the device (copy included) and from the host;
- the whole ``ActivationCache.prefix_forward`` at a fill, a refresh and a hit (fresh sample ids per step), each
  also with its parts timed (``get``, ``lookup_partial``, the layers, ``put``; the device synchronised around each);
- the plan's own fill term for the same step (``planner/stage.py: cache_setup_s`` from the profile, when given).

Wall-clock medians over ``--steps`` steps after two untimed ones, the device synchronised before and after each
(the step sees the same: ``put`` waits for the rows). Usage::

    python bench/fill_path.py --device cuda --models bert-base gpt2 --out fill_path.json
    python bench/fill_path.py --device cpu --models bert-tiny --fill-blocks 1 --refresh-blocks 2 --steps 3
        (a rehearsal on a CPU: nothing is streamed)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from ptplan.executor.profiling.host_io import median_seconds, sync

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _timed_parts(cache: Any, model: Any, dev: torch.device, parts: dict[str, float]) -> Iterator[None]:
    """Time the cache's ``get``, ``lookup_partial`` and ``put`` and the model's ``run_layers`` inside the block
    (each synchronised around), adding seconds to ``parts``."""
    saved = {}

    def wrap(obj: Any, name: str) -> None:
        fn = getattr(obj, name)
        saved[(obj, name)] = fn

        def timed(*a: Any, **kw: Any) -> Any:
            sync(dev)
            t = time.perf_counter()
            out = fn(*a, **kw)
            sync(dev)
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
            return out
        setattr(obj, name, timed)

    for name in ("get", "lookup_partial", "put"):
        wrap(cache, name)
    wrap(model, "run_layers")
    try:
        yield
    finally:
        for (obj, name) in saved:
            delattr(obj, name)  # the instance attribute goes; the class's method shows again


def _place(layers: Any, where: str, dev: torch.device) -> None:
    """Every parameter and buffer of ``layers`` on the device, in pageable host memory or in pinned host memory."""
    with torch.no_grad():
        for layer in layers:
            for t in [*layer.parameters(), *layer.buffers()]:
                if where == "device":
                    t.data = t.data.to(dev)
                else:
                    host = t.data.to("cpu")
                    t.data = host.pin_memory() if where == "pinned" and dev.type == "cuda" else host.clone()


def measure(name: str, dev: torch.device, *, batch: int, seq: int, fill_blocks: int, refresh_blocks: int,
            steps: int, cache_root: str, profile: str | None) -> dict[str, Any]:
    from ptplan.executor.cache.autocache import ActivationCache
    from ptplan.executor.families import build_model

    dtype = torch.bfloat16
    t0 = time.perf_counter()
    model = build_model(name, seq_len=seq, dtype=dtype)
    build_s = time.perf_counter() - t0
    blocks = [s.block for s in model.specs]
    if not 0 < fill_blocks < refresh_blocks <= model.num_blocks:
        raise SystemExit(f"{name} has {model.num_blocks} blocks: give 0 < --fill-blocks < --refresh-blocks <= "
                         f"{model.num_blocks} (got {fill_blocks}, {refresh_blocks})")
    # the frozen layer count of a prefix of k blocks: every layer up to the last one of block k - 1
    cut = lambda k: max(i for i, b in enumerate(blocks) if b is not None and b == k - 1) + 1  # noqa: E731
    f, g = cut(fill_blocks), cut(refresh_blocks)
    model.layers[f:].to(dev)
    gen = torch.Generator().manual_seed(0)
    x, _, mask = model.make_batch(batch, gen)
    x, mask = x.to(dev), None if mask is None else mask.to(dev)
    weight_bytes = {k: sum(p.numel() * p.element_size() for layer in model.layers[lo:hi] for p in layer.parameters())
                    for k, (lo, hi) in {"fill": (0, f), "refresh": (f, g)}.items()}
    res: dict[str, Any] = {"model": name, "batch": batch, "seq_len": seq, "dtype": "bfloat16", "build_s": build_s,
                           "fill_layers": f, "refresh_layers": g, "fill_blocks": fill_blocks,
                           "refresh_blocks": refresh_blocks, "prefix_weight_bytes": weight_bytes["fill"],
                           "refresh_weight_bytes": weight_bytes["refresh"]}
    # raw copies
    w = torch.empty(weight_bytes["fill"], dtype=torch.uint8)
    wp = w.pin_memory() if dev.type == "cuda" else w
    res["h2d_pageable_s"] = median_seconds(lambda k: w.to(dev), dev, steps)
    res["h2d_pinned_s"] = median_seconds(lambda k: wp.to(dev, non_blocking=True), dev, steps)
    with torch.no_grad():
        _place(model.layers[:g], "device", dev)
        rows = model.run_layers(x, 0, f, mask)
    res["row_bytes_per_step"] = rows.numel() * rows.element_size()
    res["d2h_rows_s"] = median_seconds(lambda k: rows.to("cpu"), dev, steps)
    # the prefix's forward, three ways
    for where in ("device", "pageable", "pinned"):
        _place(model.layers[:g], where, dev)
        with torch.no_grad():
            res[f"prefix_{where}_s"] = median_seconds(lambda k: model.run_layers(x, 0, f, mask), dev, steps)
            res[f"refresh_layers_{where}_s"] = median_seconds(lambda k: model.run_layers(rows, f, g, mask), dev, steps)
    _place(model.layers[:g], "pageable", dev)  # as the runtime keeps a cached prefix
    n = 8 * (steps + 2) * batch
    with tempfile.TemporaryDirectory(dir=cache_root) as root:
        cache = ActivationCache(root, job_id="fill-path", create=True, sample_shape=tuple(rows.shape[1:]),
                                dtype=dtype, num_samples=n, budget_bytes=4 * n * rows[0].numel() * rows.element_size())
        ids = lambda base, k: torch.arange(base + k * batch, base + (k + 1) * batch)  # noqa: E731
        span = (steps + 2) * batch
        raw = ActivationCache(root, job_id="fill-path-put", create=True, sample_shape=tuple(rows.shape[1:]),
                              dtype=dtype, num_samples=n, budget_bytes=n * rows[0].numel() * rows.element_size())
        res["put_from_device_s"] = median_seconds(lambda k: raw.put(ids(0, k), f, rows), dev, steps)
        host_rows = rows.cpu()
        res["put_from_host_s"] = median_seconds(lambda k: raw.put(ids(span, k), f, host_rows), dev, steps)
        raw.cleanup()
        serve = lambda base, count: (lambda k: cache.prefix_forward(  # noqa: E731
            model, x, mask, ids(base, k), count, micro_batch_size=batch))
        cache.prefix_forward(model, x, mask, ids(7 * span, 0), f, micro_batch_size=batch)  # the first-use checks
        cache.prefix_forward(model, x, mask, ids(7 * span, 0), g, micro_batch_size=batch)
        for case, base, count in (("fill", 2 * span, f), ("refresh", 2 * span, g), ("hit", 2 * span, g),
                                  ("fill_again", 3 * span, f)):
            res[f"serve_{case}_s"] = median_seconds(serve(base, count), dev, steps)
        for where in ("pinned", "device"):
            _place(model.layers[:g], where, dev)
            res[f"serve_fill_{where}_s"] = median_seconds(serve((4 if where == "pinned" else 5) * span, f), dev, steps)
        _place(model.layers[:g], "pageable", dev)
        for case, base, count in (("fill", 6 * span, f), ("refresh", 6 * span, g)):
            parts: dict[str, float] = {}
            with _timed_parts(cache, model, dev, parts):
                for k in range(steps):
                    serve(base, count)(k)
            res[f"parts_{case}"] = {k: v / steps for k, v in parts.items()}
        cache.cleanup()
    if profile:
        res["plan"] = _plan_terms(profile, f, g, batch)
    return res


def _plan_terms(profile_path: str, f: int, g: int, b: int) -> dict[str, float]:
    """The plan's fill and refresh set-up for one micro-batch of b on a GPU (``cache_setup_s``), and its parts."""
    from ptplan.planner.costs import CostTable
    from ptplan.planner.profile import load_profile
    from ptplan.planner.cluster import PRESETS, measured_host_io
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.stage import cache_setup_s

    prof = load_profile(profile_path)
    io = measured_host_io(PRESETS["dgx-h100"], prof, TrainingConfig.host_read_bandwidth)  # measured, else the default
    bw = io.weights
    table = CostTable(prof)
    out = table.out_per_sample
    tm = table.at(b)
    return {"profile": profile_path, "host_io": vars(io),
            "fill_s": cache_setup_s(table, f, 1, b, io, device_is_host=False, fill_from=0),
            "refresh_s": cache_setup_s(table, g, 1, b, io, device_is_host=False, fill_from=f),
            "fill_compute_s": float(tm.cum_nograd[f]),
            "refresh_compute_s": float(tm.cum_nograd[g] - tm.cum_nograd[f]),
            "fill_stream_s": float(table.cum_param[f]) / bw,
            "refresh_stream_s": float(table.cum_param[g] - table.cum_param[f]) / bw,
            "rows_s": b * float(out[f - 1]) / io.write}


def _print(r: dict[str, Any]) -> None:
    ms = lambda k: f"{r[k] * 1e3:8.2f}" if k in r else "       -"  # noqa: E731
    mb = r["prefix_weight_bytes"] / 1e6
    print(f"\n{r['model']}: batch {r['batch']} x {r['seq_len']} tokens, fill = layers [0, {r['fill_layers']}) "
          f"({mb:.1f} MB of weights), refresh = [{r['fill_layers']}, {r['refresh_layers']}) "
          f"({r['refresh_weight_bytes'] / 1e6:.1f} MB), rows {r['row_bytes_per_step'] / 1e6:.1f} MB per step")
    print(f"  copies: host->device {mb:.0f} MB pageable {ms('h2d_pageable_s')} ms "
          f"({r['prefix_weight_bytes'] / r['h2d_pageable_s'] / 1e9:.1f} GB/s), pinned {ms('h2d_pinned_s')} ms "
          f"({r['prefix_weight_bytes'] / r['h2d_pinned_s'] / 1e9:.1f} GB/s); rows device->host {ms('d2h_rows_s')} ms")
    print("  ms per step           weights on device   streamed pageable   streamed pinned")
    print(f"  prefix forward (fill)          {ms('prefix_device_s')}            {ms('prefix_pageable_s')}          "
          f"{ms('prefix_pinned_s')}")
    print(f"  refresh layers                 {ms('refresh_layers_device_s')}            "
          f"{ms('refresh_layers_pageable_s')}          {ms('refresh_layers_pinned_s')}")
    print(f"  prefix_forward, fill           {ms('serve_fill_device_s')}            {ms('serve_fill_s')}          "
          f"{ms('serve_fill_pinned_s')}")
    print(f"  put: rows from device {ms('put_from_device_s')} ms, from host {ms('put_from_host_s')} ms; "
          f"prefix_forward refresh {ms('serve_refresh_s')} ms, hit {ms('serve_hit_s')} ms, "
          f"fill again {ms('serve_fill_again_s')} ms")
    for case in ("fill", "refresh"):
        p = r.get(f"parts_{case}", {})
        print(f"  {case} step's parts (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in p.items()))
    if "plan" in r:
        p = r["plan"]
        print(f"  the plan's terms (ms): fill {p['fill_s'] * 1e3:.2f} (compute {p['fill_compute_s'] * 1e3:.2f}, "
              f"weights {p['fill_stream_s'] * 1e3:.2f}, rows {p['rows_s'] * 1e3:.2f}); "
              f"refresh {p['refresh_s'] * 1e3:.2f}")


def main(argv: list[str] | None = None) -> None:
    from ptplan.executor.cache.autocache import default_root

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", nargs="+", default=["bert-base", "gpt2"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--fill-blocks", type=int, default=4, help="blocks frozen at the fill (the runs' 4)")
    ap.add_argument("--refresh-blocks", type=int, default=7, help="blocks frozen after the refresh (the runs' 7)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--cache-root", default=None, help="where the cache's slabs go (default: the AutoCache's own)")
    ap.add_argument("--profiles", nargs="*", default=[], help="a profile per model, for the plan's terms")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fill_path.json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "command": "python bench/fill_path.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:])}
    results = []
    for i, m in enumerate(a.models):
        r = measure(m, dev, batch=a.batch, seq=a.seq, fill_blocks=a.fill_blocks, refresh_blocks=a.refresh_blocks,
                    steps=a.steps, cache_root=a.cache_root or default_root(),
                    profile=a.profiles[i] if i < len(a.profiles) else None)
        _print(r)
        results.append(r)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
