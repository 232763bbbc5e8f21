"""Words and units for the report: durations, bytes, counts, layer ranges, strategies, phase titles."""
from __future__ import annotations

from typing import Sequence

from ..plan import Phase, Plan


def _time_unit(seconds: float) -> tuple[str, float]:
    """A unit for an axis whose largest value is ``seconds``: (name, seconds per unit)."""
    if seconds >= 3 * 3600:
        return "hours", 3600.0
    if seconds >= 180:
        return "minutes", 60.0
    return "seconds", 1.0


def _duration(seconds: float) -> str:
    """A duration in the unit that fits it: '850 ms', '12.4 s', '3.6 minutes', '2.1 hours'."""
    if seconds < 1:
        return f"{seconds * 1e3:,.3g} ms"
    unit, div = _time_unit(seconds)
    return f"{seconds / div:,.3g} {'s' if unit == 'seconds' else unit}"


BYTE_UNITS = (("B", 1.0), ("KiB", 2.0**10), ("MiB", 2.0**20), ("GiB", 2.0**30), ("TiB", 2.0**40), ("PiB", 2.0**50))


def _byte_unit(largest: float) -> tuple[str, float]:
    """The largest binary unit in which ``largest`` bytes is at least 1: (name, bytes per unit)."""
    name, div = BYTE_UNITS[0]
    for n, d in BYTE_UNITS:
        if largest >= d:
            name, div = n, d
    return name, div


def _num3(x: float) -> str:
    """Three significant digits without a trailing '.0' (never '0.0' for a positive number)."""
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _bytes(b: float) -> str:
    """Bytes in the unit that fits them: '812 KiB', '47.5 MiB', '1.52 GiB' ('0 B' only for nothing)."""
    if b <= 0:
        return "0 B"
    name, div = _byte_unit(b)
    return f"{b:,.0f} B" if name == "B" else f"{_num3(b / div)} {name}"


def _plural(n: int, noun: str) -> str:
    """'1 GPU', '16 GPUs', '4 CPU processes'."""
    word = noun if n == 1 else noun + ("es" if noun.endswith("s") else "s")
    return f"{n:,} {word}"


def _noun(plan: Plan) -> str:
    """What one rank is: 'GPU' or 'CPU process'."""
    return plan.inputs.cluster.device_noun


def _nouns(plan: Plan) -> str:
    return _plural(2, _noun(plan)).split(" ", 1)[1]


def _layers(lo: int, hi: int) -> str:
    """Half-open [lo, hi) as words."""
    return f"layer {lo}" if hi - lo == 1 else f"layers {lo}–{hi - 1}"


def _schedule_name(s: str) -> str:
    return {"gpipe": "GPipe", "1f1b": "1F1B", "2bw": "PipeDream-2BW (flush-free)"}.get(s, s)


def _has_strategy(ph: Phase) -> bool:
    """Whether the phase runs a hybrid strategy (tensor parallel, FSDP or recomputation), not plain DP."""
    return ph.strategy_label != "dp"


def _mesh(ph: Phase) -> str:
    """The phase's device mesh: 'mesh K × D × tp = 4 × 2 × 4' (the tp ranks of a stage inside one node)."""
    return f"mesh K × D × tp = {ph.K} × {ph.D} × {ph.tp}"


def _strategy_words(ph: Phase) -> str:
    """The strategy in words, for hovers and notes: 'tensor parallel over 4 ranks inside one node, FSDP
    (sharded over the D=8 replicas), activation recomputation'; 'plain data parallel' without one."""
    parts = []
    if ph.tp > 1:
        parts.append(f"tensor parallel over {ph.tp} ranks inside one node")
    S = ph.K * ph.V
    fs, rc = [s for s in range(S) if ph.fsdp_at(s)], [s for s in range(S) if ph.recompute_at(s)]
    if fs:
        on = "" if len(fs) == S else f" on stage{'s' if len(fs) > 1 else ''} {_ranges(fs)}"
        parts.append(f"FSDP{on} (sharded over the D={ph.D} replicas)")
    if rc:
        on = "" if len(rc) == S else f" on stage{'s' if len(rc) > 1 else ''} {_ranges(rc)}"
        some = [f"stage {c}: its first {ph.recompute_layers_at(c)} layers" for c in rc if ph.recompute_layers_at(c)]
        parts.append(f"activation recomputation{on}" + (f" ({'; '.join(some)})" if some else ""))
    return ", ".join(parts) or "plain data parallel"


def _position_strategy(ph: Phase, k: int) -> str:
    """The FSDP/recomputation strategy of position k's stages in a phase whose stages differ ('' otherwise):
    ' · fsdp·rc', or per chunk ' · chunks 0: rc, 4: dp'."""
    if not ph.mixed:
        return ""
    chunks = [c for c, pos in enumerate(ph.stage_to_rank()) if pos == k]
    labels = {ph.stage_label(c) for c in chunks}
    if len(labels) == 1:
        return f" · {labels.pop()}"
    return " · chunks " + ", ".join(f"{c}: {ph.stage_label(c)}" for c in chunks)


def _phase_title(i: int, ph: Phase) -> str:
    title = f"phase {i}: {ph.frozen_blocks} frozen blocks · K={ph.K} × D={ph.D} · M={ph.M}"
    if _has_strategy(ph):
        title += f" · {ph.strategy_label} ({_mesh(ph)})"
    if ph.slices:  # TeraPipe: each micro-batch's bar is its token slices' actions, slice by slice
        text = ",".join(map(str, ph.slices))
        title += f" · {len(ph.slices)} token slices {text if len(text) <= 40 else text[:37] + '...'}"
    return title


def _ranges(xs: Sequence[int]) -> str:
    """0, 1, 2, 5 -> '0–2, 5'."""
    out: list[str] = []
    vals = sorted(set(xs))
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}–{vals[j]}")
        i = j + 1
    return ", ".join(out)
