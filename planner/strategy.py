"""Per-stage parallel strategies (issue 14): tensor parallel, sharded data parallel, recomputation.

Legend: K pipeline length, D data-parallel width (replicas of every stage), tp tensor-parallel width
(ranks of one node sharing every layer of a stage, Megatron column/row split), b micro-batch size,
W a layer's weight bytes, G its gradient bytes, out its output bytes per sample. A phase with
tensor-parallel width tp uses K · D · tp GPUs; tp is one per phase (it fixes the mesh and the rank layout),
FSDP and recomputation are per stage: a ``Strategy`` is one stage's, and a phase's stages may differ
(``stage.StageChoice`` picks each stage's; ``phase_label`` writes them).

The stage model (``stage.py``) calls ``strategy_table`` to turn the profile's per-layer costs into the
costs of one shard, and ``gather_layers`` for FSDP's transient; everything else in it is unchanged,
so the default strategy (tp=1, dp, no recomputation) gives exactly the old numbers.

Per layer, with tp > 1 (only layers whose ``kind`` is ``attention``, ``mlp`` or ``block`` split):

    forward  = forward / tp + a · (lat_tp + b · out · per_byte_tp)     a = 1 all-reduce per half
    backward = backward / tp + a · (lat_tp + b · out · per_byte_tp)        (attention or MLP), 2 per block
    no-grad  = no-grad forward / tp + a · (…)                           (the frozen prefix: below)
    W, G     = W / tp, G / tp
    saved    = saved · (u + (1 − u) / tp)     (``tp_saved_share``: the part Megatron's split divides)

The activations saved for backward divide where Megatron's split divides them (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", per layer of hidden h, a heads, s tokens,
b samples, 16-bit: s·b·h·(34 + 5·a·s/h) bytes without tp, s·b·h·(10 + 24/tp + 5·a·s/(h·tp)) with tp, and
s·b·h·(34 + 5·a·s/h)/tp with sequence parallelism). Per half (each owns one LayerNorm, 2·s·b·h):

    attention: 13·sbh + 5·a·s²·b, of which 5·sbh are not split (its LayerNorm input, the QKV input, the
               output dropout's mask) and 8·sbh + 5·a·s²·b are (Q, K, V, scores, softmax and its mask, ...)
    mlp:       21·sbh, of which 5·sbh are not split (LayerNorm input, the first linear's input, the dropout
               mask) and 16·sbh are (the 4h-wide GeLU input and output)
    block:     both: 10·sbh not split, 24·sbh + 5·a·s²·b split

so the measured saved bytes of a layer are scaled by u + (1 − u)/tp with u = unsplit / total of its kind
(the profile measures the total; the ratio is Megatron's). With sequence parallelism (``Strategy.sp``) the
LayerNorm input and the dropout mask divide by tp too; the first linear's input (the all-gathered LayerNorm
output, 2·sbh per half) stays whole: Megatron saves only its shard and all-gathers it again in the backward,
but the runtime's DTensor linear (``executor/runtime/hybrid.py``) keeps the gathered tensor. So under sp u =
2·sbh per half / total (4·sbh per block) -- ``tests/test_sequence_parallel.py`` measures each rank's saved bytes
of tiny GPT-2 and Llama halves within 0.07 of these shares, tp2 and tp2·sp alike --, at the same communication
time: an all-gather and a reduce-scatter of the same bytes replace each all-reduce (a ring all-reduce of B bytes
over tp ranks is a reduce-scatter then an all-gather, 2·(tp − 1) steps of B/tp each; ``strategy_table``'s term is
unchanged). Replicated layers (embedding, norm, head) keep their activations whole.

with lat_tp, per_byte_tp the ring all-reduce over tp ranks of one node (``cluster.allreduce_seconds``).
Embedding, norm and head layers are replicated over the tp ranks (each computes them whole).

With FSDP (ZeRO-3: FSDP2 ``fully_shard`` over the stage's D replicas), per layer:

    forward, no-grad += lat_ag + (W / tp) · per_byte_ag     the weights all-gathered per micro-batch
    backward        += lat_ag + (W / tp) · per_byte_ag      and again for the backward,
                     + lat_ag + (G / tp) · per_byte_ag      then the gradient reduce-scattered, in every
                                                           micro-batch's backward (FSDP2's default:
                                                           gradients stay sharded between micro-batches)
    W, G, optimizer  = sharded: / D
    sync             = none after the pipeline (the runtime skips its flat all-reduce)
    weight-gradient part, stash = 0: under a split backward (ZB-H1, ZB-V) a sharded stage's B runs its whole
                       backward and its W nothing (torch's weight-gradient pass does not run FSDP's gradient
                       hooks), so nothing waits between them
    transient        = 2 · max W / tp (the layer in use and the prefetched one, or its all-gather's flat
                       buffer) + max G / tp (one layer's unsharded gradient, then its reduce-scatter input),
                       each max over the stage's layers (``gather_layers``; stage 0 with an uncached frozen
                       prefix adds 2 · the prefix's largest W / tp, which FSDP gathers in its forward). A rank's
                       sharded layers share FSDP2's list of reduce-scatter inputs in flight, so the next
                       layer's reduce-scatter releases the one before (``executor/runtime/hybrid.shard_layer``)

where a ring all-gather of B bytes costs half a ring all-reduce of B (lat_ag, per_byte_ag: half the
stage's data-parallel all-reduce coefficients). Frozen layers have G = 0 (no gradient, no optimizer
state, no sync) as before; in cached phases the prefix is not held at all.

The frozen prefix (layers [0, n0), run by stage 0 under no_grad before its active layers) is split and
sharded like the active layers when stage 0 runs it (``executor/hybrid.ShardedStage``: its layers' Megatron
twins over the tp group, and ``fully_shard`` over stage 0's data-parallel group when stage 0's strategy has
FSDP), so the stage model prices it from this table too: its weights W / tp (split layers; the embedding
whole) and / D under FSDP, its no-grad forward as above (/ tp plus the forward's all-reduces, plus an
all-gather per layer per micro-batch under FSDP); it has no gradient, optimizer state or reduce-scatter.
Stage 0's chosen strategy (``stage.StageChoice``) decides whether it is FSDP-sharded. A prefix the AutoCache
serves stays whole in host memory, so its cache fill (``stage.cache_setup_s``, the streamed weights) is
priced from the profile's own table (``StageModel.raw``).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cluster import Cluster
from .costs import CostTable
from .errors import PtplanError

TP_KINDS = {"attention": 1, "mlp": 1, "block": 2}
"""Megatron all-reduces per forward (and as many per backward) of a layer of this kind."""
MEGATRON_SAVED = {"attention": (5.0, 8.0, 1.0, 2.0), "mlp": (5.0, 16.0, 0.0, 2.0), "block": (10.0, 24.0, 1.0, 4.0)}
"""Per kind, Megatron's saved activations in units of s·b·h (16-bit): (not split by tp, split by tp, how many
5·a·s/h attention-score terms -- split -- it holds, how much of the unsplit part stays whole with sequence
parallelism as the runtime runs it: the column-parallel linears' gathered input, module docstring)."""
_HIDDEN_KEYS = ("n_embd", "hidden_size", "dim", "d_model")
_HEAD_KEYS = ("n_head", "num_attention_heads", "n_heads")


def _config_int(config: dict, keys: Sequence[str]) -> int | None:
    for k in keys:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def tp_saved_share(table: CostTable, tp: int, sp: bool = False) -> np.ndarray:
    """Per layer, the factor on its saved-for-backward bytes on one of tp ranks (module docstring): 1 for
    replicated layers; u + (1 − u)/tp for split ones, u = Megatron's unsplit share of the layer's kind, with the
    attention-score term 5·a·s/h from the profile's config (left out where the config lacks the width or the
    heads); under sequence parallelism u is only the column-parallel linears' gathered input (``saved_share``)."""
    p = table.profile
    h, a = _config_int(p.model.config, _HIDDEN_KEYS), _config_int(p.model.config, _HEAD_KEYS)
    x = 5.0 * a * p.model.seq_len / h if h and a else 0.0
    out = np.ones(table.n)
    if tp == 1:
        return out
    for i, r in enumerate(p.layers):
        if r.kind in MEGATRON_SAVED:
            out[i] = saved_share(r.kind, tp, sp, x)
    return out


def saved_share(kind: str, tp: int, sp: bool, scores: float) -> float:
    """The factor on a split layer's saved bytes on one of tp ranks: u + (1 − u)/tp, u its unsplit share of
    ``MEGATRON_SAVED[kind]`` (under ``sp`` only the gathered linear inputs), ``scores`` = 5·a·s/h (0 if unknown)."""
    unsplit, split, n_scores, whole_sp = MEGATRON_SAVED[kind]
    u = (whole_sp if sp else unsplit) / (unsplit + split + n_scores * scores)
    return u + (1.0 - u) / tp


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One stage's parallel strategy."""

    tp: int = 1
    """Tensor-parallel width (ranks of one node)."""
    fsdp: bool = False
    """Sharded data parallel (ZeRO-3) over the D replicas instead of plain all-reduce DP."""
    recompute: bool = False
    """Activation recomputation: keep only the stage's input (and its output) per micro-batch."""
    recompute_layers: int = 0
    """With recomputation, Galvatron's layer-wise choice: only the stage's first r active layers are
    recomputed (one checkpoint unit), the others keep their activations; 0 = every layer of the stage."""
    sp: bool = False
    """Sequence parallelism (Megatron's, with tp > 1): LayerNorm and dropout work and activations split over the
    tp ranks too, so a split layer's saved activations divide by tp but for its linears' gathered input
    (``saved_share``), at the same communication time.
    Priced by the stage model; run by ``executor/runtime/hybrid.py`` for the families whose
    ``FamilyFacts.sequence_parallel`` is on (``tp_split.sp_refusal``); ``search_modes`` offers it there."""

    def __post_init__(self) -> None:
        if not isinstance(self.sp, bool) or (self.sp and self.tp == 1):
            raise PtplanError(f"strategy sp={self.sp!r}: sequence parallelism is true or false and needs tp > 1")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1 or self.tp & (self.tp - 1):
            raise PtplanError(f"strategy tp={self.tp!r}: the tensor-parallel width must be a power of two >= 1")
        for name in ("fsdp", "recompute"):
            if not isinstance(getattr(self, name), bool):
                raise PtplanError(f"strategy {name} must be true or false, got {getattr(self, name)!r}")
        r = self.recompute_layers
        if not isinstance(r, int) or isinstance(r, bool) or r < 0 or (r and not self.recompute):
            raise PtplanError(f"strategy recompute_layers={r!r}: recompute the first r >= 1 layers (with "
                              f"recomputation on), or 0 for the whole stage")

    @property
    def label(self) -> str:
        """Short text, e.g. ``tp2·fsdp·rc``; ``dp`` for the default; ``rc2``: the first 2 layers recomputed."""
        parts = ([f"tp{self.tp}"] if self.tp > 1 else []) + (["sp"] if self.sp else []) + \
            (["fsdp"] if self.fsdp else []) + \
            ([f"rc{self.recompute_layers or ''}"] if self.recompute else [])
        return "·".join(parts) or "dp"

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Inverse of ``label``."""
        tp, fsdp, rc, r, sp = 1, False, False, 0, False
        for part in text.split("·"):
            if m := re.fullmatch(r"tp(\d+)", part):
                tp = int(m.group(1))
            elif part == "sp":
                sp = True
            elif part == "fsdp":
                fsdp = True
            elif m := re.fullmatch(r"rc(\d*)", part):
                rc, r = True, int(m.group(1) or 0)
            elif part != "dp":
                raise PtplanError(f"strategy {text!r}: unknown part {part!r}; write e.g. tp2·fsdp·rc or dp")
        return cls(tp=tp, fsdp=fsdp, recompute=rc, recompute_layers=r, sp=sp)

    @property
    def is_default(self) -> bool:
        return self.tp == 1 and not self.fsdp and not self.recompute


def runtime_refusal(schedule: str, st: Strategy, D: int) -> str | None:
    """Why the executor does not run a stage with strategy ``st`` under ``schedule`` with D replicas (None: it does).
    The one list of these: the search leaves such candidates and per-stage options out
    (``candidates.enumerate_candidates``, ``search.PhaseSearch.stage_options``), and ``ptplan run`` refuses a plan
    that has one (``executor/training/validate.check_strategies``)."""
    if schedule == "2bw" and (st.tp > 1 or st.fsdp):
        return (f"2bw with {st.label} is not run by the executor (its 2BW loop runs plain stages, recomputing at "
                f"most: FSDP's and DTensor's hooks are not wired into it)")
    return None


Mode = tuple[int, int, int, bool]
"""One family of search candidates: (tp, FSDP mode, recomputation mode, sequence parallelism); modes 0 off, 1 on
every stage, 2 chosen per stage (``search.Candidate.mode``)."""


def search_modes(tps: Sequence[int], auto: bool, family: str | None, seq_len: int | None) -> tuple[Mode, ...]:
    """The candidate families ``search.PhaseSearch`` tries (its ``modes``): for every tp, every uniform strategy,
    then recomputation chosen per stage with FSDP chosen per stage too, on every stage, or off (``search.py``
    says why); with ``auto`` each tp > 1 family also with sequence parallelism, where ``tp_split.sp_refusal``
    allows it (same communication time, split layers' activations / tp: never slower, smaller or equal
    memory, so it is offered beside plain tp rather than instead of it and the search picks by its objective).
    Without ``auto``: plain data parallel only."""
    from .tp_split import sp_refusal

    if not auto:
        return tuple((t, 0, 0, False) for t in tps)
    fr = ((0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (2, 2), (1, 2))
    sps = {t: (False, True) if sp_refusal(family, seq_len, t) is None else (False,) for t in tps}
    return tuple((t, f, r, sp) for t in tps for sp in sps[t] for f, r in fr)


def search_strategies(modes: Sequence[Mode]) -> tuple[Strategy, ...]:
    """The uniform strategies among ``search_modes`` (the default first): ``search.PhaseSearch.strategies``."""
    return tuple(Strategy(tp=t, fsdp=bool(f), recompute=bool(r), sp=sp) for t, f, r, sp in modes
                 if f < 2 and r < 2)


def phase_label(tp: int, fsdp: Sequence[bool], recompute: Sequence[bool], layers: Sequence[int] = (), *,
                sp: bool = False) -> str:
    """A phase's strategy as text from its stages' FSDP and recomputation flags (and recomputed layer counts,
    0 = all): one strategy for every stage is its ``Strategy.label`` (``tp2·sp·fsdp·rc``, ``dp``); stages that
    differ are listed in stage order, runs of equal ones as ``×n``: ``tp2·sp · stages fsdp·rc2 | fsdp | dp×2``."""
    layers = list(layers) or [0] * len(recompute)
    labels = [Strategy(fsdp=f, recompute=r, recompute_layers=k).label for f, r, k in zip(fsdp, recompute, layers)]
    if len(set(labels)) <= 1:
        return Strategy(tp=tp, fsdp=bool(fsdp) and fsdp[0], recompute=bool(recompute) and recompute[0],
                        recompute_layers=layers[0] if layers else 0, sp=sp).label
    names: list[str] = []
    counts: list[int] = []
    for lb in labels:
        if names and names[-1] == lb:
            counts[-1] += 1
        else:
            names.append(lb)
            counts.append(1)
    body = " | ".join(lb if k == 1 else f"{lb}×{k}" for lb, k in zip(names, counts))
    return " · ".join(([Strategy(tp=tp, sp=sp).label] if tp > 1 else []) + [f"stages {body}"])


def tp_allreduce_coeffs(cluster: Cluster, tp: int) -> tuple[float, float]:
    """(latency s, seconds per byte) of a ring all-reduce over tp ranks of one node; PtplanError if tp
    does not fit in a node."""
    if tp > cluster.gpus_per_node:
        raise PtplanError(f"tp={tp} exceeds the {cluster.gpus_per_node} GPUs of a node; tensor parallelism "
                          f"stays inside a node: use tp <= {cluster.gpus_per_node}")
    if tp == 1:
        return 0.0, 0.0
    ranks = list(range(tp))
    a0 = cluster.allreduce_seconds(ranks, 0.0)
    return a0, (cluster.allreduce_seconds(ranks, 1e9) - a0) / 1e9


def splittable(table: CostTable) -> np.ndarray:
    """Per layer, the all-reduces a Megatron split adds per forward (0: the layer is replicated); read-only."""
    def make() -> np.ndarray:
        a = np.array([TP_KINDS.get(r.kind, 0) for r in table.profile.layers], dtype=float)
        a.flags.writeable = False
        return a
    return table.derived("splittable", make)


def gather_layers(table: CostTable, st: Strategy) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the bytes FSDP gathers (W / tp) and its unsharded gradient (G / tp): the transient's terms
    (module docstring)."""
    div = np.where(splittable(table) > 0, st.tp, 1)
    return table.param_bytes / div, table.grad_bytes / div


def strategy_table(table: CostTable, st: Strategy, D: int, tp_ar: tuple[float, float],
                   dp_ar: tuple[float, float]) -> CostTable:
    """The per-shard cost table of ``table`` under strategy ``st`` (module docstring). ``tp_ar``: the tp
    group's all-reduce (latency, s/byte); ``dp_ar``: the stage's data-parallel all-reduce coefficients."""
    if st.tp == 1 and not st.fsdp:
        return table
    t = copy.copy(table)
    t._cache, t._derived = {}, {}
    a = splittable(table)
    div = np.where(a > 0, st.tp, 1).astype(float)
    bs = table.batch_sizes[None, :]
    comm = a[:, None] * (tp_ar[0] + bs * table.out_per_sample[:, None] * tp_ar[1]) if st.tp > 1 else 0.0
    fwd, bwd, nog = table._fwd / div[:, None] + comm, table._bwd / div[:, None] + comm, table._nog / div[:, None] + comm
    bww = table._bww / div[:, None]
    W, G = table.param_bytes / div, table.grad_bytes / div
    t.accumulate_bytes = table.accumulate_bytes / div  # a split layer's weight gradients are split
    if st.tp > 1:  # a backward's working set divides as the activations it works on
        share = tp_saved_share(table, st.tp, st.sp)
        t.saved_per_sample, t.working_per_sample = table.saved_per_sample * share, table.working_per_sample * share
        t.stash_per_sample = table.stash_per_sample * share
        t.cum_saved, t.cum_stash = _cum(t.saved_per_sample), _cum(t.stash_per_sample)
    sync = G
    if st.fsdp and D > 1:
        ag = (dp_ar[0] + W * dp_ar[1]) / 2.0
        # FSDP2 reduce-scatters each layer's gradient in every micro-batch's backward (half an
        # all-reduce's bytes); there is no sync after the pipeline (the runtime skips its all-reduce)
        rs = np.where(G > 0, (dp_ar[0] + G * dp_ar[1]) / 2.0, 0.0)
        fwd, bwd, nog = fwd + ag[:, None], bwd + (ag + rs)[:, None], nog + ag[:, None]  # frozen: no rs
        sync = np.zeros_like(G)
        # under a split backward (ZB-H1, ZB-V) a sharded stage's B runs its whole backward and its W nothing (torch's
        # weight-gradient pass does not run FSDP's gradient hooks: ``executor/runtime/step.ChunkCompute``'s whole)
        bww = np.zeros_like(bww)
        t.stash_per_sample = np.zeros_like(table.stash_per_sample)
        t.cum_stash = _cum(t.stash_per_sample)
        W, G = W / D, G / D
        opt_div = div * D
    else:
        opt_div = div
    c = table.optimizer_call_s  # a call's fixed cost is paid whole; each layer's own part divides
    t.set_optimizer(np.where(table.optimizer_s > 0, c + (table.optimizer_s - c) / opt_div, 0.0), c)
    t._fwd, t._bwd, t._nog, t._bww = fwd, bwd, nog, bww
    t.param_bytes, t.grad_bytes = W, G
    t.cum_param, t.cum_grad = _cum(W), _cum(G)
    t.cum_sync = _cum(sync)
    t.max_param_upto = np.concatenate(([0.0], np.maximum.accumulate(W)))
    return t


def min_table(a: CostTable, b: CostTable) -> CostTable:
    """Per layer, the smaller of every time, byte and sync term of two cost tables of one profile (e.g. one
    tp width with and without FSDP): any stage built from either table, layer by layer, costs at least this
    one's sums, so ``search.PhaseSearch.lower_bound`` stays a lower bound for a candidate whose stages each
    choose their strategy."""
    t = copy.copy(a)
    t._cache, t._derived = {}, {}
    for name in ("_fwd", "_bwd", "_nog", "param_bytes", "grad_bytes"):
        setattr(t, name, np.minimum(getattr(a, name), getattr(b, name)))
    # the weight-gradient part only shortens a zero-bubble B (backward - W): the least of those, not of each part
    t._bww = np.clip(t._bwd - np.minimum(a._bwd - a._bww, b._bwd - b._bww), 0.0, t._bwd)
    t.set_optimizer(np.minimum(a.optimizer_s, b.optimizer_s), min(a.optimizer_call_s, b.optimizer_call_s))
    t.cum_param, t.cum_grad = _cum(t.param_bytes), _cum(t.grad_bytes)
    t.cum_sync = _cum(np.minimum(np.diff(a.cum_sync), np.diff(b.cum_sync)))
    t.max_param_upto = np.concatenate(([0.0], np.maximum.accumulate(t.param_bytes)))
    return t


def _cum(a: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(a)))
