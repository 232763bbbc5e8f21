"""Synthetic (analytic, not measured) profiles of GPT-style models, for tests and planning benchmarks.

Per-layer times are FLOPs / ``flops_per_s`` plus a fixed ``overhead_s`` per layer call; backward is
twice the forward. These profiles are labelled ``device.kind = "cpu"``, ``device.name =
"synthetic"`` and must never be shipped as measurements.
"""
from __future__ import annotations

from .costs import optimizer_state_bytes
from .profile import DeviceInfo, LayerRecord, ModelInfo, Profile, Provenance, SliceFit, SlicePoint, SliceProfile, \
    WholeModel


def synthetic_profile(*, num_blocks: int = 12, hidden: int = 768, seq_len: int = 128, vocab: int = 50257,
                      batch_sizes: tuple[int, ...] = (1, 2, 4, 8), flops_per_s: float = 50e12,
                      overhead_s: float = 20e-6, dtype_bytes: int = 4, name: str | None = None,
                      heads: int | None = None, slices: bool = False) -> Profile:
    """An attention/MLP-half profile of a GPT-style decoder with ``num_blocks`` blocks (``heads``: recorded in the
    config as ``n_head``; ``slices``: with analytic token-slice costs, ``synthetic_slices``)."""
    h, s = hidden, seq_len
    dtype = "float32" if dtype_bytes == 4 else "bfloat16"
    act = s * h * dtype_bytes

    def rec(i: int, nm: str, kind: str, block: int | None, params: int, fwd_flops: float, saved: int) -> LayerRecord:
        f = tuple(overhead_s + fwd_flops * b / flops_per_s for b in batch_sizes)
        return LayerRecord(index=i, name=nm, kind=kind, block=block, params=params,
                           param_bytes=params * dtype_bytes, grad_bytes=params * dtype_bytes,
                           optimizer_bytes=int(optimizer_state_bytes(params, dtype)), output_bytes_per_sample=act, saved_bytes_per_sample=saved,
                           forward_s=f, backward_s=tuple(2 * x for x in f),
                           nograd_forward_s=tuple(0.95 * x for x in f))

    layers = [rec(0, "embeddings", "embedding", None, vocab * h + s * h, 2.0 * s * h, act)]
    for blk in range(num_blocks):
        attn_flops = 2 * 4 * h * h * s + 2 * 2 * s * s * h
        layers.append(rec(len(layers), f"block{blk}.attn", "attention", blk, 4 * h * h + 6 * h, attn_flops,
                          6 * act + 2 * s * s * (h // 64) * dtype_bytes))
        layers.append(rec(len(layers), f"block{blk}.mlp", "mlp", blk, 8 * h * h + 7 * h, 2 * 8 * h * h * s,
                          10 * act))
    layers.append(rec(len(layers), "final_norm", "norm", None, 2 * h, 5.0 * s * h, act))
    layers.append(rec(len(layers), "head", "head", None, vocab * h, 2.0 * vocab * h * s, s * vocab * dtype_bytes))
    fwd = tuple(sum(r.forward_s[i] for r in layers) for i in range(len(batch_sizes)))
    fb = tuple(3 * x for x in fwd)
    config = {"n_layer": num_blocks, "n_embd": hidden, "n_positions": seq_len, "vocab_size": vocab}
    if heads is not None:
        config["n_head"] = heads
    return Profile(
        model=ModelInfo(name=name or f"synthetic-gpt-{num_blocks}x{hidden}", family="gpt2", num_blocks=num_blocks,
                        seq_len=seq_len, dtype=dtype, granularity="half", config=config),
        device=DeviceInfo(kind="cpu", name="synthetic", memory_bytes=0, torch_version="none", date="1970-01-01"),
        batch_sizes=tuple(batch_sizes), layers=tuple(layers),
        whole_model=WholeModel(forward_s=fwd, forward_backward_s=fb),
        measurement={"synthetic": True, "flops_per_s": flops_per_s, "overhead_s": overhead_s},
        provenance=Provenance(source="synthetic", command="ptplan.planner.synthetic.synthetic_profile"),
        token_slices=synthetic_slices(hidden, flops_per_s, overhead_s) if slices else None)


def synthetic_slices(hidden: int, flops_per_s: float, overhead_s: float) -> SliceProfile:
    """Analytic token-slice costs of one block of ``synthetic_profile`` (both halves), FLOPs / ``flops_per_s``: a
    slice of s tokens after c costs 2·12·h²·s (the dense layers) + 2·2·s·(c + s)·h (its scores and weighted values
    over its c + s keys) FLOPs forward, plus ``overhead_s`` per half; the backward twice that."""
    h, F = hidden, flops_per_s
    fwd = SliceFit(const=2 * overhead_s, per_token=24.0 * h * h / F, per_context=0.0, per_pair=4.0 * h / F,
                   fit_error=0.0, max_error=0.0, per_square=4.0 * h / F)
    bwd = SliceFit(const=2 * fwd.const, per_token=2 * fwd.per_token, per_context=0.0, per_pair=2 * fwd.per_pair,
                   fit_error=0.0, max_error=0.0, per_square=2 * fwd.per_square)

    def t(f: SliceFit, s: int, c: int) -> float:
        return f.const + f.per_token * s + f.per_pair * s * c + f.per_square * s * s

    pts = tuple(SlicePoint(b=1, s=s, c=c, forward_s=t(fwd, s, c), backward_s=t(bwd, s, c))
                for s in (16, 64) for c in (0, 64))
    return SliceProfile(unit="block", points=pts, forward=fwd, backward=bwd, device="synthetic", date="1970-01-01")
