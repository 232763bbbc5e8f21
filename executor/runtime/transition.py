"""Moving layers (weights and optimizer state) between ranks: who holds what, who needs what, and the sends.

A rank holds storage only for the layers of its own chunks (``holdings``; one stage when V = 1, V
chunks at one pipeline position otherwise): the active layers of its chunks' ranges on the device,
and at position 0 (which runs chunk 0) the frozen prefix -- on the device when it recomputes it, in
host memory when the AutoCache serves it (``planner/stage.py``). Every other layer has no storage on
that rank (``executor/runtime/stage.py``'s ``LayerStore``). So a layer is needed (``needs``) exactly by the
ranks of its chunk's position across pipelines, the data-parallel group (frozen layers: by the
ranks at position 0; with tensor parallelism every rank of each position's tp group -- each holds
full copies between phases, ``hybrid`` splits them while the phase runs), and once a phase starts,
the ranks holding a current copy of a layer are exactly the ranks that need it. A transition, a resume and a gather to rank 0 are the same operation: for each
layer, send it from a current holder to every rank that needs it and lacks it, coalesced into one
flat buffer per (source, destination, dtype), with sources chosen to balance bytes sent; the
receiver allocates the layer before the exchange and a sender that no longer needs it frees it
after (``runtime.ElasticRuntime``).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ptplan.planner.plan import Phase


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """One message: layers sent from ``src`` to ``dst`` (global ranks)."""

    src: int
    dst: int
    layers: tuple[int, ...]


def layer_owner_stage(phase: Phase, layer: int) -> int | None:
    """The stage (chunk) whose range holds ``layer`` in ``phase``; None for a frozen-prefix layer."""
    for s, (lo, hi) in enumerate(phase.partition):
        if lo <= layer < hi:
            return s
    if layer < phase.frozen_layers:
        return None
    raise ValueError(f"layer {layer} is outside the phase's partition {phase.partition}")


def needs(phase: Phase, num_layers: int) -> list[frozenset[int]]:
    """For each layer, the ranks that need a current copy to train in ``phase``."""
    groups = phase.dp_groups()
    where = phase.stage_to_rank()
    out = []
    for i in range(num_layers):
        s = layer_owner_stage(phase, i)
        out.append(frozenset(r + j for r in groups[0 if s is None else where[s]] for j in range(phase.tp)))
    return out


HOST, DEVICE = "host", "device"
"""Where a rank keeps a layer it holds: host memory, or the device it computes on."""


def holdings(phase: Phase, rank: int, num_layers: int, *, cached_prefix: bool) -> dict[int, str]:
    """The layers ``rank`` holds in ``phase`` and where (``DEVICE`` or ``HOST``); others it does not hold.

    Its stage's active layers live on the device. Stage 0 also holds the frozen prefix: on the device
    when it recomputes it, in host memory when ``cached_prefix`` (the AutoCache serves the prefix's
    output, and a cache fill streams those layers through the device one at a time). These are the full
    layers a switch moves; inside a phase with tp or FSDP a split or sharded layer (the prefix's too) keeps
    only its shard (``hybrid.ShardedStage``), which is gathered back before the next switch.
    """
    held = {i: DEVICE for i in owned_layers(phase, rank, num_layers)}
    if rank in phase.stage0_ranks:
        held.update({i: HOST if cached_prefix else DEVICE for i in range(phase.frozen_layers)})
    return held


def sources(transfers: Sequence[Transfer], rank: int) -> set[int]:
    """The layers ``rank`` sends in ``transfers``."""
    return {i for t in transfers if t.src == rank for i in t.layers}


def owned_layers(phase: Phase, rank: int, num_layers: int) -> list[int]:
    """The active layers this rank trains in ``phase`` (its chunks' ranges, ascending)."""
    where = phase.stage_to_rank()
    for row in phase.ranks:
        for k, r in enumerate(row):
            if r <= rank < r + phase.tp:  # the ranks of a tensor-parallel group hold the same layers
                return [i for c, (lo, hi) in enumerate(phase.partition) if where[c] == k for i in range(lo, hi)]
    raise ValueError(f"rank {rank} is not in the phase's layout {phase.ranks}")


def plan_transfers(have: Sequence[frozenset[int]], need: Sequence[frozenset[int]],
                   sizes: Sequence[int]) -> list[Transfer]:
    """Messages that bring every layer from a rank in ``have`` to every rank in ``need`` lacking it.

    Sources are picked greedily per (layer, destination) as the holder that has sent the fewest
    bytes so far (ties: lowest rank), so replicas of an old stage share the sending.
    """
    assert len(have) == len(need) == len(sizes)
    sent: dict[int, int] = defaultdict(int)
    pairs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for layer in range(len(need)):
        missing = sorted(need[layer] - have[layer])
        if not missing:
            continue
        if not have[layer]:
            raise ValueError(f"layer {layer} is needed by ranks {missing} but no rank holds it")
        for dst in missing:
            src = min(sorted(have[layer]), key=lambda r: (sent[r], r))
            sent[src] += sizes[layer]
            pairs[(src, dst)].append(layer)
    return [Transfer(src=s, dst=d, layers=tuple(ls)) for (s, d), ls in sorted(pairs.items())]


BUCKET_BYTES = 1 << 20
"""Tensors at least this big travel as they are (no copy); smaller ones are packed per dtype."""


def _messages(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor | None, list[torch.Tensor]]]:
    """Split one transfer's tensors into wire messages: (a big tensor travelling alone, or None for a packed
    buffer, the tensors it carries). The layout is a function of the tensors' sizes and dtypes alone, which both
    sides share; where and how each side keeps a tensor (its device, its strides) must not change it: a receiver
    holding host storage (``gather``'s rank 0) and a sender holding the layer on its GPU post the same messages.
    Whether a big tensor is sent or received in place is each side's own choice (``_in_place``)."""
    out: list[tuple[torch.Tensor | None, list[torch.Tensor]]] = []
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() * t.element_size() >= BUCKET_BYTES:
            out.append((t, [t]))
        else:
            small.setdefault(t.dtype, []).append(t)
    for _, group in sorted(small.items(), key=lambda kv: str(kv[0])):
        out.append((None, group))
    return out


def _in_place(t: torch.Tensor, device: torch.device) -> bool:
    """Whether this side can hand ``t`` itself to the backend (on the wire device, contiguous)."""
    return t.device == device and t.is_contiguous()


def exchange(transfers: Sequence[Transfer], rank: int, tensors_of: Callable[[tuple[int, ...]], list[torch.Tensor]],
             device: torch.device, *, batched: bool = False) -> int:
    """Run this rank's side of ``transfers``; returns the bytes this rank sent.

    ``tensors_of(layers)`` gives, on both sides, the same-shaped tensors in the same order: the
    sender reads them, the receiver overwrites them in place. Big tensors are sent and received in
    place; small ones are packed into one flat buffer per dtype. ``batched`` uses
    ``batch_isend_irecv`` (NCCL); otherwise plain ``isend``/``irecv`` (gloo).
    """
    ops: list[tuple[str, torch.Tensor, int, int]] = []
    landing: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    sent = 0
    for t in transfers:
        if rank not in (t.src, t.dst):
            continue
        for tag, (whole, group) in enumerate(_messages(tensors_of(t.layers))):
            if t.src == rank:
                if whole is not None:
                    buf = whole.detach() if _in_place(whole, device) else whole.detach().to(device).contiguous()
                else:
                    buf = torch.cat([x.detach().reshape(-1).to(device) for x in group])
                ops.append(("send", buf, t.dst, tag))
                sent += buf.numel() * buf.element_size()
            elif whole is not None and _in_place(whole, device):
                ops.append(("recv", whole.detach(), t.src, tag))
            else:  # packed, or a big tensor this side keeps elsewhere: land in a buffer, copy after
                buf = torch.empty(sum(x.numel() for x in group), dtype=group[0].dtype, device=device)
                ops.append(("recv", buf, t.src, tag))
                landing.append((buf, group))
    if batched:
        p2p = [dist.P2POp(dist.isend if k == "send" else dist.irecv, buf, peer, tag=tag) for k, buf, peer, tag in ops]
        works = dist.batch_isend_irecv(p2p) if p2p else []
    else:
        works = [(dist.isend if k == "send" else dist.irecv)(buf, peer, tag=tag) for k, buf, peer, tag in ops]
    for w in works:
        w.wait()
    with torch.no_grad():
        for flat, group in landing:
            off = 0
            for x in group:
                n = x.numel()
                x.copy_(flat[off:off + n].view_as(x))
                off += n
    return sent
