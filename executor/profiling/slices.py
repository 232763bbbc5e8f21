"""Token-slice profiler (TeraPipe): time one decoder block on a slice of s tokens after c cached tokens, on a
grid of (b, s, c), and fit TeraPipe's linear cost model to the forward and the backward. ``project_slices``
does the same for a device nobody here has: each point's operations counted on the meta device and timed by
the device model's roofline, as ``project.py`` times the layers.

Legend: b samples, s tokens in the slice, c earlier tokens of the same sequence whose keys and values
the slice attends to (its context).

A point runs block 0 of the model (its attention and MLP halves, or the whole block) with
``executor/runtime/sliced.py``'s slice-aware layers, exactly as the token-sliced executor does: the context's
keys and values are leaf tensors that require grad, so the backward also computes their gradients
(the s·c term). The model is left as found (grads, flags, modes, RNG).

    python -m ptplan.executor.profiling.slices gpt2 --base profiles/gpt2_cpu_fp32.json \\
        --out profiles/gpt2_cpu_fp32_slices.json --slice-lengths 64,256,1024,2048 \\
        --contexts 0,512,1024   # adds token_slices to an existing profile
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import shlex
import statistics
import sys
from typing import Sequence

import torch

from ptplan.planner.devices import DeviceModel
from ptplan.planner.errors import PtplanError
from ptplan.planner.profile import Profile, SliceFit, SlicePoint, SliceProfile, load_profile, save_profile
from ptplan.planner.terapipe import fit_slice_cost

from ptplan.executor.families import CAUSAL_FAMILIES, LayeredModel
from ptplan.executor.profiling.profiler import _Clock, _cpu_name, _preserved, model_for_profile, resolve_device
from ptplan.executor.profiling.project import FusedAttention, Op, _Recorder, op_seconds, swapped
from ptplan.executor.runtime.sliced import is_attention, slice_forward


def default_grid(seq_len: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(b, s, c) values for a model of ``seq_len`` tokens: b 1, 2; s L/32, L/8, L/2, L; c 0, L/4, L/2."""
    L = max(seq_len, 32)
    return (1, 2), (L // 32, L // 8, L // 2, L), (0, L // 4, L // 2)


def _block_layers(model: LayeredModel) -> list[torch.nn.Module]:
    layers = [m for m, sp in zip(model.layers, model.specs) if sp.block == 0]
    if not any(is_attention(m) for m in layers):
        raise PtplanError(f"{model.name}: block 0 has no attention layer that token slicing can run")
    return layers


def _kv_shape(model: LayeredModel) -> tuple[int, int]:
    """(key/value heads, head dimension) of the model's attention."""
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return getattr(cfg, "num_key_value_heads", None) or heads, head_dim


def _point(layers: Sequence[torch.nn.Module], clock: _Clock, b: int, s: int, c: int, hidden: int,
           kv_heads: int, head_dim: int, warmup: int, repeats: int, gen: torch.Generator) -> tuple[float, float]:
    p = next(layers[0].parameters())
    x0 = torch.randn(b, s, hidden, generator=gen).to(p.device, p.dtype)
    pasts = [None if c == 0 else tuple(torch.randn(b, kv_heads, c, head_dim, generator=gen).to(p.device, p.dtype)
                                       for _ in range(2)) for m in layers if is_attention(m)]
    fw, bw = [], []
    for i in range(warmup + repeats):
        x = x0.clone().requires_grad_(True)
        past = [None if q is None else tuple(t.clone().requires_grad_(True) for t in q) for q in pasts]
        clock.sync()
        t0 = clock.stamp()
        j = 0
        h = x
        for m in layers:
            h, kv = slice_forward(m, h, c, past[j] if is_attention(m) else None)
            if kv is not None:
                j += 1
        clock.sync()
        t1 = clock.stamp()
        h.backward(torch.ones_like(h))
        clock.sync()
        t2 = clock.stamp()
        for m in layers:
            for q in m.parameters():
                q.grad = None
        if i >= warmup:
            fw.append(clock.seconds(t0, t1))
            bw.append(clock.seconds(t1, t2))
    return statistics.median(fw), statistics.median(bw)


def fit_points(points: Sequence[SlicePoint], part: str, *, square: bool = True) -> SliceFit:
    """The fit of ``part`` (``forward_s`` or ``backward_s``) over the points: TeraPipe's terms plus b·s²
    (``square``), minimising relative errors, coefficients >= 0 (``planner.terapipe.fit_slice_cost``)."""
    pts = [(q.b, q.s, q.c, getattr(q, part)) for q in points]
    f = fit_slice_cost(pts, square=square, relative=True, nonnegative=True)
    errs = [abs(float(dataclasses.replace(f, b=b)(s, c)) - t) / max(t, 1e-12) for b, s, c, t in pts]
    return SliceFit(const=f.const, per_token=f.per_token, per_context=f.per_context, per_pair=f.per_pair,
                    fit_error=float(f.fit_error or 0.0), max_error=max(errs), per_square=f.per_square)


def _grid(model: LayeredModel, batch_sizes: Sequence[int] | None, slice_lengths: Sequence[int] | None,
          contexts: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The (b, s, c) grid asked for (``default_grid`` where not given), checked."""
    if model.family not in CAUSAL_FAMILIES:
        raise PtplanError(f"token slices are for causal LMs ({', '.join(CAUSAL_FAMILIES)}), not {model.name}")
    db, ds, dc = default_grid(model.seq_len)
    bs, ss, cs = tuple(batch_sizes or db), tuple(slice_lengths or ds), tuple(contexts or dc)
    if min(bs) < 1 or min(ss) < 1 or min(cs) < 0:
        raise PtplanError(f"slice grid needs b >= 1, s >= 1, c >= 0; got b={bs}, s={ss}, c={cs}")
    if len(set(ss)) < 3 or len(set(cs)) < 2:
        raise PtplanError(f"the slice fit needs at least 3 slice lengths and 2 contexts, got s={ss}, c={cs}")
    return bs, ss, cs


def _counted_point(layers: Sequence[torch.nn.Module], b: int, s: int, c: int, hidden: int, kv_heads: int,
                   head_dim: int) -> tuple[list[Op], list[Op]]:
    """The aten operations (forward, backward) of one slice of s tokens after c cached ones through ``layers``,
    whose parameters are on the meta device; the backward computes the input's, the context's and the weights'
    gradients (as ``_point`` does), through ``torch.autograd.grad`` so nothing accumulates between points."""
    p = next(layers[0].parameters())
    meta = dict(device="meta", dtype=p.dtype, requires_grad=True)
    x = torch.empty(b, s, hidden, **meta)
    past = [None if c == 0 else (torch.empty(b, kv_heads, c, head_dim, **meta),
                                 torch.empty(b, kv_heads, c, head_dim, **meta)) for m in layers if is_attention(m)]
    fwd, bwd = _Recorder(), _Recorder()
    with FusedAttention(), fwd:  # attention as the GPU's fused kernel, as the projected layers count it
        h, j = x, 0
        for m in layers:
            h, kv = slice_forward(m, h, c, past[j] if is_attention(m) else None)
            if kv is not None:
                j += 1
    seed = torch.ones_like(h)
    leaves = [x] + [t for q in past if q is not None for t in q] + [q for m in layers for q in m.parameters()
                                                                     if q.requires_grad]
    with bwd:
        torch.autograd.grad(h, leaves, grad_outputs=seed, allow_unused=True)
    return fwd.ops, bwd.ops


def project_slices(model: LayeredModel, device: DeviceModel, *, batch_sizes: Sequence[int] | None = None,
                   slice_lengths: Sequence[int] | None = None, contexts: Sequence[int] | None = None,
                   command: str = "", date: str = "") -> SliceProfile:
    """``profile_slices`` for a device nobody here has: each grid point's operations are counted on the meta device
    and timed by ``device``'s roofline (``project.op_seconds``, as the projected layers are), and TeraPipe's model
    fitted to them. The model's parameters may be on meta (nothing is allocated); it is left as found."""
    bs, ss, cs = _grid(model, batch_sizes, slice_lengths, contexts)
    layers = _block_layers(model)
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(
        next(layers[0].parameters()).dtype)
    if dtype is None:
        raise PtplanError(f"cannot project a {next(layers[0].parameters()).dtype} model; use float32, bfloat16 or "
                          "float16")
    device.matmul_peak(dtype)

    def secs(ops: Sequence[Op]) -> float:
        return sum(op_seconds(op, device, dtype) for op in ops)

    points = []
    with swapped(model, lambda t: t.to("meta")):
        for b in bs:
            for s in ss:
                for c in cs:
                    f, bw = _counted_point(layers, b, s, c, model.config.hidden_size, *_kv_shape(model))
                    points.append(SlicePoint(b=b, s=s, c=c, forward_s=secs(f), backward_s=secs(bw)))
    return SliceProfile(unit="block", points=tuple(points), forward=fit_points(points, "forward_s"),
                        backward=fit_points(points, "backward_s"), device=device.name, date=date, command=command,
                        timer=f"projected: aten operations counted on the meta device, timed by the {device.key} "
                              "roofline (planner/devices.py)")


def profile_slices(model: LayeredModel, *, device: str = "cpu", batch_sizes: Sequence[int] | None = None,
                   slice_lengths: Sequence[int] | None = None, contexts: Sequence[int] | None = None,
                   warmup: int = 1, repeats: int = 3, timer: str = "wall", command: str = "") -> SliceProfile:
    """Time block 0 of a causal LM on every (b, s, c) of the grid (default ``default_grid``) and fit
    TeraPipe's linear model to the forward and the backward; the model is left unchanged."""
    if warmup < 0 or repeats < 1:
        raise PtplanError(f"warmup must be >= 0 and repeats >= 1, got {warmup}, {repeats}")
    bs, ss, cs = _grid(model, batch_sizes, slice_lengths, contexts)
    dev = resolve_device(device)
    clock = _Clock(dev, timer)
    layers = _block_layers(model)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    points = []
    with _preserved(model, dev), torch.random.fork_rng(devices=[]):
        for b in bs:
            for s in ss:
                for c in cs:
                    f, bw = _point(layers, clock, b, s, c, hidden, *_kv_shape(model), warmup, repeats, gen)
                    points.append(SlicePoint(b=b, s=s, c=c, forward_s=f, backward_s=bw))
    name = _cpu_name() if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    return SliceProfile(unit="block", points=tuple(points), forward=fit_points(points, "forward_s"),
                        backward=fit_points(points, "backward_s"), device=name, date=_dt.date.today().isoformat(),
                        command=command, timer=("cuda_events" if dev.type == "cuda" else
                                                "process_time (CPU time, 1 thread)" if timer == "cpu" else
                                                "perf_counter (wall)"))


def with_slices(profile: Profile, slices: SliceProfile) -> Profile:
    """The profile with its ``token_slices`` set (the layers' numbers untouched)."""
    if profile.model.family not in CAUSAL_FAMILIES:
        raise PtplanError(f"token slices are for causal LMs, not {profile.model.name}")
    return dataclasses.replace(profile, token_slices=slices)


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise PtplanError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Add measured token-slice costs (TeraPipe) to a causal LM's profile.")
    ap.add_argument("model", help="the base profile's model: its preset name, or the folder it was profiled from")
    ap.add_argument("--base", required=True, help="the profile to add token_slices to (its layers stay as they are)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", default="1,2")
    ap.add_argument("--slice-lengths", default="64,256,1024,2048")
    ap.add_argument("--contexts", default="0,512,1024")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timer", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--refit", action="store_true",
                    help="do not measure: refit the base profile's stored token_slices points with this code's fit")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = load_profile(args.base)
    cmd = shlex.join(["python", "-m", "ptplan.executor.profiling.slices", *(argv if argv is not None else sys.argv[1:])])
    if args.refit:
        if base.token_slices is None:
            raise PtplanError(f"{args.base} has no token_slices to refit")
        old = base.token_slices
        sp = dataclasses.replace(old, forward=fit_points(old.points, "forward_s"),
                                 backward=fit_points(old.points, "backward_s"), command=f"{old.command}; {cmd}")
        save_profile(with_slices(base, sp), args.out)
        _report(sp, args.out)
        return
    model = model_for_profile(base, model=args.model)  # the base profile's model, checked against it
    sp = profile_slices(model, batch_sizes=_ints(args.batch_sizes), slice_lengths=_ints(args.slice_lengths),
                        contexts=_ints(args.contexts), warmup=args.warmup, repeats=args.repeats, timer=args.timer,
                        command=cmd)
    save_profile(with_slices(base, sp), args.out)
    _report(sp, args.out)


def _report(sp: SliceProfile, out: str) -> None:
    for f, name in ((sp.forward, "forward"), (sp.backward, "backward")):
        print(f"{name}: t = {f.const:.3e} + {f.per_token:.3e} b·s + {f.per_context:.3e} b·c + {f.per_pair:.3e} b·s·c "
              f"+ {f.per_square:.3e} b·s² s (median error {100 * f.fit_error:.1f} %, max {100 * f.max_error:.1f} %)")
        lin = fit_points(sp.points, f"{name}_s", square=False)
        print(f"  TeraPipe's form alone (no b·s²): median error {100 * lin.fit_error:.1f} %, max "
              f"{100 * lin.max_error:.1f} %")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
