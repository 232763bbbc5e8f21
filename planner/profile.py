"""The profile contract (``ptplan.profile/1``): measured per-layer costs, typed, validated on load.

Legend: L = number of Transformer blocks; a *layer* is one entry of the flat execution-order list
(embedding, blocks or block halves, final norm, head). Freezing works on blocks: with f frozen
blocks, the frozen prefix is every layer before the first layer of block f (the embedding and
blocks 0..f-1). Times are seconds per micro-batch, one value per measured micro-batch size.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import numpy as np

from .errors import PtplanError, SchemaError
from .families import FAMILY_NAMES
from .jsonio import Fields, read_json, write_json

SCHEMA = "ptplan.profile/1"
MAX_SECONDS = 1e6
"""Per layer and micro-batch; larger "measurements" are corrupt (and would overflow plans)."""
MAX_BYTES = 2**60
MAX_BATCH = 1 << 30
LAYER_KINDS = ("embedding", "block", "attention", "mlp", "norm", "head")
GRANULARITIES = ("block", "half")
DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes a profile may be measured in: those the cost model prices (``costs.DTYPE_BYTES``; a test checks they
agree)."""
DEVICE_KINDS = ("cpu", "cuda")
MAX_ACTION_OVERHEAD_S = 60.0
"""``measurement.action_overhead_s`` above this is corrupt (``cluster.MAX_LATENCY_S``, the bound the planner keeps)."""
REPROFILE = ("A profile is written by ptplan: profile the model again with `ptplan profile` (or `ptplan profile "
             "--project`), or use a shipped profile")
"""The fix of a profile error that names none of its own."""



def interp_rows(batch_sizes: np.ndarray, values: np.ndarray, b: float) -> np.ndarray:
    """Seconds at micro-batch size ``b`` for every row of ``values`` (rows = layers, cols = sizes).

    Piecewise-linear between measured sizes; beyond the largest, linear with the last segment's
    slope (proportional scaling if that slope is not positive); below the smallest, linear towards
    the origin but never below proportional scaling.
    """
    bs = batch_sizes
    if len(bs) == 1:
        return values[:, 0] * (b / bs[0])
    if b <= bs[0]:
        slope = (values[:, 1] - values[:, 0]) / (bs[1] - bs[0])
        return np.maximum(values[:, 0] - slope * (bs[0] - b), values[:, 0] * (b / bs[0]))
    if b >= bs[-1]:
        slope = (values[:, -1] - values[:, -2]) / (bs[-1] - bs[-2])
        slope = np.where(slope > 0, slope, values[:, -1] / bs[-1])
        return values[:, -1] + slope * (b - bs[-1])
    j = int(np.searchsorted(bs, b, side="right")) - 1
    t = (b - bs[j]) / (bs[j + 1] - bs[j])
    return values[:, j] * (1 - t) + values[:, j + 1] * t


@dataclass(frozen=True, kw_only=True)
class LayerRecord:
    """One layer of the flat list, with its measured costs."""

    index: int
    """Position in execution order, 0-based."""
    name: str
    """Human name, e.g. ``embeddings``, ``block3.attn``, ``head``."""
    kind: str
    """One of LAYER_KINDS."""
    block: int | None
    """Transformer block this layer belongs to (None for embedding, norm and head)."""
    params: int
    """Number of parameters."""
    param_bytes: int
    """Bytes of the parameters in the profiled dtype."""
    grad_bytes: int
    """Bytes of the parameter gradients."""
    optimizer_bytes: int
    """Bytes of optimizer state (AdamW: two moments per parameter in the parameters' dtype,
    ``costs.optimizer_state_bytes``)."""
    output_bytes_per_sample: int
    """Bytes of this layer's output (the tensor sent to the next stage) for one sample."""
    saved_bytes_per_sample: int
    """Bytes this layer saves for backward for one sample (measured with saved-tensor hooks)."""
    forward_s: tuple[float, ...]
    """Forward seconds with grad enabled, one per profile micro-batch size."""
    backward_s: tuple[float, ...]
    """Backward seconds (input and weight gradients), one per micro-batch size."""
    nograd_forward_s: tuple[float, ...]
    """Forward seconds under no_grad/eval (how a frozen layer runs), one per micro-batch size."""
    backward_weight_s: tuple[float, ...] | None = None
    """Of ``backward_s``, the weight-gradient part (zero-bubble schedules run it as a separate W after
    the input-gradient part B), one per micro-batch size; None where not measured (older profiles)."""
    optimizer_s: float | None = None
    """Seconds of one optimizer (AdamW) step over this layer's parameters; independent of the
    micro-batch size. None in profiles written before the profiler measured it (the planner then
    charges 0 and the plan carries a warning)."""
    backward_working_bytes_per_sample: int = 0
    """Bytes per sample this layer's backward allocates at its peak on top of what is alive when it starts (the
    gradient it receives, its input's gradient, its kernels' temporaries; saved tensors it frees count down; the
    parameter gradients it leaves do not count): ``executor/profiling/live_bytes.py``. 0 in profiles written
    before the profiler measured it."""
    accumulate_bytes: int = 0
    """Bytes more the same backward allocates when its gradients are added into existing ``.grad`` (a later
    micro-batch's: each weight gradient is made apart first), for the layer (not per sample). 0 where not
    measured."""
    backward_stash_bytes_per_sample: int = 0
    """Bytes per sample a split backward's input-gradient half (ZB's B) leaves alive for its weight-gradient half
    (W): the gradients of the weight operations' outputs (``live_bytes.stash_step``). 0 for the first layer, and
    in profiles written before the profiler measured it (the planner then prices no stash)."""


@dataclass(frozen=True, kw_only=True)
class WholeModel:
    """A whole-model step measured directly, to check the per-layer sum against."""

    forward_s: tuple[float, ...]
    forward_backward_s: tuple[float, ...]
    peak_memory_bytes: tuple[int, ...] = ()
    """Peak device memory of one forward+backward (CUDA only; empty on CPU)."""


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    name: str
    """Adapter name, e.g. ``bert-base``."""
    family: str
    """``bert`` | ``vit`` | ``gpt2``."""
    num_blocks: int
    """L, the number of Transformer blocks."""
    seq_len: int
    """Tokens per sample (for ViT: patches + 1)."""
    dtype: str
    """``float32`` | ``bfloat16`` | ``float16``."""
    granularity: str
    """``block`` (one layer per block) or ``half`` (attention and MLP halves)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The Hugging Face config fields used to build the model."""


@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    kind: str
    """``cpu`` | ``cuda``."""
    name: str
    memory_bytes: int
    torch_version: str
    date: str
    """ISO date of the measurement."""
    threads: int = 0
    """torch intra-op threads used (CPU)."""


PROVENANCE_SOURCES = ("measured", "projected", "synthetic")


def structure_fingerprint(layers: Iterable[tuple[str, str, int | None, int]]) -> str:
    """The short hash a profile records of its model's layer structure: each layer's name, kind, block and
    parameter count, in order (``Profile.fingerprint``; the executor hashes a built model with the same)."""
    h = hashlib.sha256()
    for name, kind, block, params in layers:
        h.update(f"{name}|{kind}|{block}|{params};".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where a profile's numbers come from."""

    source: str = "measured"
    """``measured`` (timed on ``device``), ``projected`` (from a device model, not timed) or
    ``synthetic`` (analytic numbers for tests and benchmarks; never ship these)."""
    command: str = ""
    """The command that wrote the profile (empty when unknown, e.g. older files)."""
    device_model: str | None = None
    """For ``projected``: the device model the times come from."""

    def __post_init__(self) -> None:
        if self.source not in PROVENANCE_SOURCES:
            raise PtplanError(f"profile provenance source {self.source!r} is not one of "
                              f"{', '.join(PROVENANCE_SOURCES)}")


@dataclass(frozen=True, kw_only=True)
class SlicePoint:
    """One measured token slice: s tokens of b sequences after c cached tokens, through one decoder block."""

    b: int
    s: int
    c: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True, kw_only=True)
class SliceFit:
    """TeraPipe's linear slice cost t = const + per_token·b·s + per_context·b·c + per_pair·b·s·c seconds, plus
    per_square·b·s² (the slice's attention over its own tokens; 0 in TeraPipe's form)."""

    const: float
    per_token: float
    per_context: float
    per_pair: float
    fit_error: float
    """Median relative error of the fit on the measured points."""
    max_error: float
    """Largest relative error of the fit on the measured points."""
    per_square: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SliceProfile:
    """Token-slice costs (TeraPipe) of one decoder block of a causal LM, measured on a (b, s, c) grid, and
    the linear fits of its forward and backward (``planner/terapipe.py`` turns them into a SliceCost)."""

    unit: str
    """What one measured unit is: ``block`` (a whole Transformer block: attention and MLP)."""
    points: tuple[SlicePoint, ...]
    forward: SliceFit
    backward: SliceFit
    device: str
    """Where the slices were measured (may differ from the layers' device when added to an older profile)."""
    date: str
    command: str = ""
    timer: str = ""

    @property
    def max_tokens(self) -> int:
        """The longest s + c measured: beyond it the fit extrapolates."""
        return max(p.s + p.c for p in self.points)


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A measured profile. Construct via ``load_profile`` or the executor's profiler."""

    model: ModelInfo
    device: DeviceInfo
    batch_sizes: tuple[int, ...]
    """Micro-batch sizes measured, ascending."""
    layers: tuple[LayerRecord, ...]
    whole_model: WholeModel
    measurement: dict[str, Any] = field(default_factory=dict)
    """How it was measured: warmup, repeats, timer, statistic."""
    provenance: Provenance = field(default_factory=Provenance)
    """Measured, projected or synthetic, and the command that wrote it."""
    token_slices: SliceProfile | None = None
    """Causal LMs: a decoder block's token-slice costs (TeraPipe); None where not measured."""
    schema: str = SCHEMA

    # ---- derived views -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        return self.model.num_blocks

    def frozen_boundary(self, frozen_blocks: int) -> int:
        """Index of the first active layer when ``frozen_blocks`` blocks are frozen.

        0 frozen blocks -> 0 (nothing frozen); f >= 1 -> first layer of block f, so the embedding
        freezes with block 0; f == L -> first layer after the last block (norm and head stay active).
        """
        L = self.num_blocks
        if not 0 <= frozen_blocks <= L:
            raise PtplanError(f"frozen block count {frozen_blocks} is outside 0..{L} for {self.model.name}")
        if frozen_blocks == 0:
            return 0
        for rec in self.layers:
            if rec.block is not None and rec.block >= frozen_blocks:
                return rec.index
        # all blocks frozen: first layer after the last block
        last_block_layer = max(r.index for r in self.layers if r.block is not None)
        return last_block_layer + 1

    def _interp(self, values: tuple[float, ...], micro_batch: float) -> float:
        """Seconds at a micro-batch size (see ``interp_rows`` for the rule)."""
        return float(interp_rows(np.asarray(self.batch_sizes, dtype=float),
                                 np.asarray([values], dtype=float), micro_batch)[0])

    def forward_s(self, layer: int, micro_batch: float) -> float:
        return self._interp(self.layers[layer].forward_s, micro_batch)

    def backward_s(self, layer: int, micro_batch: float) -> float:
        return self._interp(self.layers[layer].backward_s, micro_batch)

    def nograd_forward_s(self, layer: int, micro_batch: float) -> float:
        return self._interp(self.layers[layer].nograd_forward_s, micro_batch)

    def identity(self) -> dict[str, Any]:
        """What a plan records to tie itself to this profile."""
        return {
            "model": self.model.name,
            "family": self.model.family,
            "num_blocks": self.model.num_blocks,
            "num_layers": self.num_layers,
            "granularity": self.model.granularity,
            "seq_len": self.model.seq_len,
            "dtype": self.model.dtype,
            "device": self.device.name,
            "device_kind": self.device.kind,
            "fingerprint": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """A short hash of the layer structure (names, kinds, parameter counts), not the timings."""
        return structure_fingerprint((r.name, r.kind, r.block, r.params) for r in self.layers)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (lists, not tuples), ready for json.dumps or the validator."""
        d = json.loads(json.dumps(asdict(self)))
        if d["token_slices"] is None:  # optional: absent, as in files written before it existed
            del d["token_slices"]
        for layer in d["layers"]:  # likewise a working set not measured
            for key in ("backward_working_bytes_per_sample", "accumulate_bytes", "backward_stash_bytes_per_sample"):
                if not layer[key]:
                    del layer[key]
        return {"schema": d.pop("schema"), **d}


HOST_IO_RATES = ("rows_read_bytes_per_s", "rows_write_bytes_per_s", "weights_to_device_bytes_per_s")
"""The rates of ``measurement.host_io`` (``executor/profiling/host_io.py``) the planner charges
(``cluster.measured_host_io``); each a positive number of bytes/s, or null where not measured."""


def _check_host_io(io: Any, source: str) -> None:
    """``measurement.host_io``, when present: an object whose rates are null or finite bytes/s in [1, 1e13]."""
    if io is None:
        return
    if not isinstance(io, dict):
        raise SchemaError(source, "measurement.host_io", f"expected an object, got {type(io).__name__}")
    for key in HOST_IO_RATES:
        v = io.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or not 1.0 <= v <= 1e13):
            raise SchemaError(source, f"measurement.host_io.{key}", f"expected bytes/s in [1, 1e13] or null, got {v!r}"
                              f" (re-profile, or delete measurement.host_io to plan with host_read_bandwidth)")


def _layer_records(top: Fields, source: str, n: int, num_blocks: int) -> list[LayerRecord]:
    """The profile's ``layers``, in order, each with ``n`` timings per list, covering blocks 0..num_blocks-1
    in ascending order; a W part never exceeds its backward."""
    layers = []
    for i, lf in enumerate(top.objs("layers")):
        Fields(lf.obj, source, lf.path, allowed=[f.name for f in LayerRecord.__dataclass_fields__.values()])
        idx = lf.int("index", min=0)
        if idx != i:
            raise SchemaError(source, f"{lf.path}.index", f"is {idx}, expected {i} (layers must be in order)")
        block = lf.raw("block")
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 0):
            raise SchemaError(source, f"{lf.path}.block", f"expected null or a block index, got {block!r}")
        layers.append(LayerRecord(
            index=idx, name=lf.str("name"), kind=lf.str("kind", choices=LAYER_KINDS), block=block,
            params=lf.int("params", min=0, max=MAX_BYTES), param_bytes=lf.int("param_bytes", min=0, max=MAX_BYTES),
            grad_bytes=lf.int("grad_bytes", min=0, max=MAX_BYTES),
            optimizer_bytes=lf.int("optimizer_bytes", min=0, max=MAX_BYTES),
            output_bytes_per_sample=lf.int("output_bytes_per_sample", min=0, max=MAX_BYTES),
            saved_bytes_per_sample=lf.int("saved_bytes_per_sample", min=0, max=MAX_BYTES),
            forward_s=tuple(lf.floats("forward_s", length=n, max=MAX_SECONDS)),
            backward_s=tuple(lf.floats("backward_s", length=n, max=MAX_SECONDS)),
            nograd_forward_s=tuple(lf.floats("nograd_forward_s", length=n, max=MAX_SECONDS)),
            backward_weight_s=None if lf.raw("backward_weight_s", None) is None else tuple(
                lf.floats("backward_weight_s", length=n, max=MAX_SECONDS)),
            optimizer_s=None if lf.raw("optimizer_s", None) is None else lf.float("optimizer_s", min=0.0,
                                                                                   max=MAX_SECONDS),
            backward_working_bytes_per_sample=0 if lf.raw("backward_working_bytes_per_sample", None) is None else
            lf.int("backward_working_bytes_per_sample", min=0, max=MAX_BYTES),
            accumulate_bytes=0 if lf.raw("accumulate_bytes", None) is None else
            lf.int("accumulate_bytes", min=0, max=MAX_BYTES),
            backward_stash_bytes_per_sample=0 if lf.raw("backward_stash_bytes_per_sample", None) is None else
            lf.int("backward_stash_bytes_per_sample", min=0, max=MAX_BYTES),
        ))
    if not layers:
        raise SchemaError(source, "layers", "is empty")
    for r in layers:
        if r.backward_weight_s is not None and any(w > b * (1 + 1e-6) + 1e-9
                                                   for w, b in zip(r.backward_weight_s, r.backward_s)):
            raise SchemaError(source, f"layers[{r.index}].backward_weight_s", f"{list(r.backward_weight_s)} exceeds "
                              f"the whole backward {list(r.backward_s)}", "Profile the model again")
    blocks = sorted({r.block for r in layers if r.block is not None})
    if len(blocks) != num_blocks or blocks != list(range(len(blocks))):  # never builds num_blocks items
        raise SchemaError(source, "layers", f"cover blocks {blocks[:3]}..{blocks[-3:] if blocks else []} "
                          f"but model.num_blocks is {num_blocks}")
    last = -1
    for r in layers:
        if r.block is not None:
            if r.block < last:
                raise SchemaError(source, f"layers[{r.index}].block", "blocks must appear in ascending order")
            last = r.block
    return layers


def profile_from_json(obj: Any, source: str = "profile") -> Profile:
    """Validate a decoded JSON object and build a Profile. Every problem is one SchemaError naming the field, its
    value and the fix (``REPROFILE`` where the check has no fix of its own): the one reader every command's profile
    goes through (``load_profile``; ``save_profile`` and ``make_plan`` check an in-memory profile with it too)."""
    try:
        return _profile(obj, source)
    except SchemaError as e:
        if e.fix:
            raise
        raise SchemaError(e.what, e.field, e.problem, REPROFILE) from None


def _profile(obj: Any, source: str) -> Profile:
    top = Fields(obj, source, allowed=("schema", "model", "device", "batch_sizes", "layers",
                                       "whole_model", "measurement", "provenance", "token_slices"))
    schema = top.str("schema")
    if schema != SCHEMA:
        raise SchemaError(source, "schema", f"is {schema!r}, expected {SCHEMA!r}",
                          "Re-create it with `ptplan profile`")
    model = _model_info(top.obj_("model", allowed=[f for f in ModelInfo.__dataclass_fields__]), source)
    device = _device_info(top.obj_("device", allowed=[f for f in DeviceInfo.__dataclass_fields__]), source)
    bsz = top.ints("batch_sizes", min=1, max=MAX_BATCH)
    if not bsz:
        raise SchemaError(source, "batch_sizes", "is empty", "Profile at least one micro-batch size")
    if sorted(set(bsz)) != bsz:
        raise SchemaError(source, "batch_sizes", f"{bsz} must be strictly ascending")
    n = len(bsz)
    layers = _layer_records(top, source, n, model.num_blocks)
    whole = _whole_model(top.obj_("whole_model", allowed=[f for f in WholeModel.__dataclass_fields__]), source, n)
    meas = _measurement(top, source)
    provenance = _provenance(top, source, device)
    slices = None
    if top.raw("token_slices", None) is not None:
        slices = _slice_profile(top.obj_("token_slices", allowed=[f for f in SliceProfile.__dataclass_fields__]),
                                source)
    return Profile(model=model, device=device, batch_sizes=tuple(bsz), layers=tuple(layers),
                   whole_model=whole, measurement=meas, provenance=provenance, token_slices=slices)


def _model_info(m: Fields, source: str) -> ModelInfo:
    """``model``: ``family`` one the planner and the executor know (``families.FAMILY_NAMES``: every writer records
    one -- ``build_model``'s models, ``custom_model``'s, which take their backbone's, and the synthetic GPT's),
    ``dtype`` one the cost model prices."""
    name, family = m.str("name"), m.str("family")
    if family not in FAMILY_NAMES:
        raise SchemaError(source, "model.family", f"{family!r} is not a model family ptplan plans and runs (one of "
                          f"{', '.join(FAMILY_NAMES)}; a custom model's family is its backbone's model_type)",
                          "Profile a model of one of these families with `ptplan profile`")
    return ModelInfo(name=name, family=family, num_blocks=m.int("num_blocks", min=1), seq_len=m.int("seq_len", min=1),
                     dtype=m.str("dtype", choices=DTYPES), granularity=m.str("granularity", choices=GRANULARITIES),
                     config=dict(m.obj_("config", default={}).obj))


def _device_info(dv: Fields, source: str) -> DeviceInfo:
    """``device``: ``memory_bytes`` the device's memory, positive; 0 (not known) only for a CPU, as the profiler
    writes where the operating system does not report the RAM and synthetic profiles always do."""
    kind = dv.str("kind", choices=DEVICE_KINDS)
    mem = dv.int("memory_bytes", max=MAX_BYTES)
    if mem < 0 or (mem == 0 and kind == "cuda"):
        rule = ("a CUDA device always reports it" if kind == "cuda" else
                "or 0 for a CPU whose operating system did not report it")
        raise SchemaError(source, "device.memory_bytes", f"is {mem:,}; expected the device's memory in bytes, a "
                          f"positive integer ({rule})",
                          "Write the device's memory in bytes, or profile again with `ptplan profile`")
    return DeviceInfo(kind=kind, name=dv.str("name"), memory_bytes=mem, torch_version=dv.str("torch_version"),
                      date=dv.str("date"), threads=dv.int("threads", 0, min=0))


def _whole_model(w: Fields, source: str, n: int) -> WholeModel:
    """``whole_model``: one time per micro-batch size; peaks one per size (CUDA) or none (CPU)."""
    peaks = tuple(w.ints("peak_memory_bytes", min=0, max=MAX_BYTES)) if "peak_memory_bytes" in w.obj else ()
    if peaks and len(peaks) != n:
        raise SchemaError(source, "whole_model.peak_memory_bytes", f"has {len(peaks)} entries for {n} micro-batch "
                          f"sizes; expected one per size (CUDA) or none (CPU)")
    return WholeModel(forward_s=tuple(w.floats("forward_s", length=n, max=MAX_SECONDS * 1e3)),
                      forward_backward_s=tuple(w.floats("forward_backward_s", length=n, max=MAX_SECONDS * 1e3)),
                      peak_memory_bytes=peaks)


def _measurement(top: Fields, source: str) -> dict[str, Any]:
    """``measurement``, required (every writer records one): an object, free-form except the keys a command reads
    -- ``action_overhead_s`` (the planner charges it), ``host_io`` (likewise), ``model_arg`` and ``weights_arg``
    (``ptplan run``'s defaults) -- which are checked."""
    if "measurement" not in top.obj:
        raise SchemaError(source, "measurement", "missing; every profile records how it was measured (an object)",
                          "Profile again with `ptplan profile`, or add \"measurement\": {} where nothing is known")
    ms = top.obj_("measurement")
    ms.float("action_overhead_s", None, min=0.0, max=MAX_ACTION_OVERHEAD_S)
    for key in ("model_arg", "weights_arg"):
        ms.str(key, None)
    _check_host_io(ms.obj.get("host_io"), source)
    return ms.obj


def _provenance(top: Fields, source: str, device: DeviceInfo) -> Provenance:
    """``provenance``, an object; absent only in files written before it existed (2026-11-22), which were
    measured (or synthetic, by the device's name). A projected profile names its device model."""
    if "provenance" not in top.obj:
        return Provenance(source="synthetic" if device.name == "synthetic" else "measured")
    pv = top.obj_("provenance", allowed=[f for f in Provenance.__dataclass_fields__])
    src, dm = pv.str("source", choices=PROVENANCE_SOURCES), pv.str("device_model", None)
    if src == "projected" and not dm:
        raise SchemaError(source, "provenance.device_model", f"is {dm!r}; a projected profile names the device model "
                          f"its times come from", "Project it again with `ptplan profile MODEL --project DEVICE`")
    return Provenance(source=src, command=pv.str("command", ""), device_model=dm)


def _slice_fit(f: Fields) -> SliceFit:
    kw = {k: f.float(k, min=None, max=MAX_SECONDS) for k in ("const", "per_token", "per_context", "per_pair")}
    return SliceFit(**kw, fit_error=f.float("fit_error", min=0.0), max_error=f.float("max_error", min=0.0),
                    per_square=f.float("per_square", 0.0, min=None, max=MAX_SECONDS))


def _slice_profile(ts: Fields, source: str) -> SliceProfile:
    names = [f for f in SliceFit.__dataclass_fields__]
    points = []
    for pf in ts.objs("points"):
        Fields(pf.obj, source, pf.path, allowed=[f for f in SlicePoint.__dataclass_fields__])
        points.append(SlicePoint(b=pf.int("b", min=1, max=MAX_BATCH), s=pf.int("s", min=1), c=pf.int("c", min=0),
                                 forward_s=pf.float("forward_s", min=0.0, max=MAX_SECONDS),
                                 backward_s=pf.float("backward_s", min=0.0, max=MAX_SECONDS)))
    if len(points) < 4:
        raise SchemaError(source, "token_slices.points", f"has {len(points)} points; the fit needs at least 4",
                          "Measure the slices again with `ptplan profile MODEL --slices`")
    return SliceProfile(unit=ts.str("unit", choices=("block",)), points=tuple(points),
                        forward=_slice_fit(ts.obj_("forward", allowed=names)),
                        backward=_slice_fit(ts.obj_("backward", allowed=names)),
                        device=ts.str("device"), date=ts.str("date"), command=ts.str("command", ""),
                        timer=ts.str("timer", ""))


def load_profile(path: str | os.PathLike) -> Profile:
    """Load and validate a profile file. Raises PtplanError/SchemaError with the file and field."""
    return profile_from_json(read_json(path, "profile"), source=f"profile {os.fspath(path)}")


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write a profile atomically (validated first, so an invalid profile is never written)."""
    obj = profile.to_json()
    profile_from_json(json.loads(json.dumps(obj)), source="profile (before writing)")
    write_json(path, obj)
