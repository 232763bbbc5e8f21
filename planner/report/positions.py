"""What each pipeline position (rank of a pipeline) runs and holds: its chunks, layers and memory terms."""
from __future__ import annotations

from ..plan import MemoryBreakdown, Phase
from .style import MEMORY_TERMS
from .text import _layers


def _stack(m: MemoryBreakdown) -> dict[str, int]:
    """The terms that add up to the peak: activations and the transient never coexist (the transient
    comes after the pipeline drained), so only the larger of the two is stacked."""
    out = {k: int(getattr(m, k)) for k, _, _ in MEMORY_TERMS}
    if out["activations"] >= out["transient"]:
        out["transient"] = 0
    else:
        out["activations"] = 0
    return out


def _position_chunks(ph: Phase) -> list[list[int]]:
    """Per pipeline position (rank of a pipeline), the chunks (stages) it runs: [k] when V = 1."""
    out: list[list[int]] = [[] for _ in range(ph.K)]
    for c, k in enumerate(ph.stage_to_rank()):
        out[k].append(c)
    return out


def _position_layers(ph: Phase, k: int) -> str:
    """The layers position k runs, chunk by chunk ("layers 3–5, 9–11" with V > 1)."""
    parts = [_layers(*ph.partition[c]) for c in _position_chunks(ph)[k]]
    return parts[0] if len(parts) == 1 else "chunks " + ", ".join(
        f"{c}: {w}" for c, w in zip(_position_chunks(ph)[k], parts))


def _position_memory(ph: Phase) -> tuple[list[int], list[dict[str, int]] | None, list[int]]:
    """Per position: the peak (bytes), its stacked terms (None without a break-down) and micro-batches in
    flight. V = 1: the stage's own numbers. V > 1: a rank holds V chunks, whose fixed terms add up and
    whose activations peak together as the simulator tracked them (``rank_peak_memory_bytes``); the
    activations (or the transient, whichever is larger) are the rest of the rank's peak."""
    mems, peaks = ph.predicted.stage_memory, ph.predicted.stage_peak_memory_bytes
    if ph.V == 1:
        return (list(peaks), [_stack(m) for m in mems] if mems else None,
                [m.inflight for m in mems] if mems else [0] * ph.K)
    chunks = _position_chunks(ph)
    rank_peaks = list(ph.predicted.rank_peak_memory_bytes) or [sum(peaks[c] for c in cs) for cs in chunks]
    if not mems:
        return rank_peaks, None, [0] * ph.K
    terms, inflight = [], []
    for k, cs in enumerate(chunks):
        t = {key: sum(int(getattr(mems[c], key)) for c in cs) for key, _, _ in MEMORY_TERMS}
        fixed = t["weights"] + t["gradients"] + t["optimizer"] + t["buffers"]
        rest = max(rank_peaks[k] - fixed, 0)
        after = t["transient"]
        t["activations"], t["transient"] = (0, rest) if after >= rest and after > 0 else (rest, 0)
        terms.append(t)
        inflight.append(sum(mems[c].inflight for c in cs))
    return rank_peaks, terms, inflight
