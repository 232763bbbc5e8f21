"""Resume: which checkpoint a run continues from (agreed by every rank), and loading it into the phase it was in.

Also the run's start without one: the phase it starts in (``start_phase``), the layers each rank builds for
it (``stage_layers``) and which ranks' copies as built can be trusted (``built_copies``).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Phase, Plan

from ptplan.executor.runtime.collective import agree
from ptplan.executor.runtime.elastic import ElasticRuntime, phase_index
from ptplan.executor.runtime.optim import ensure_state, state_dtype, state_keys
from ptplan.executor.runtime.transition import Transfer, exchange, holdings, needs, owned_layers
from ptplan.executor.training import checkpoint as ckpt
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.freezing import FreezeSchedule
from ptplan.executor.training.state import Position


def run_id(cfg: RunConfig, samples: int) -> dict[str, Any]:
    """The run settings a checkpoint is bound to (``checkpoint.RUN_KEYS``)."""
    return {"samples": samples, "seed": cfg.seed, "shuffle": cfg.shuffle, "freeze": cfg.freeze,
            "freeze_every": cfg.freeze_every}


def rng_state() -> dict[str, Any]:
    """This process's random-number generators' states (saved per rank in a checkpoint)."""
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def start_phase(cfg: RunConfig, plan: Plan, *, model_name: str, samples: int) -> int:
    """The phase the run starts in: the checkpoint's when it resumes (``find_checkpoint``), else the
    frozen count of step 0's. Collective (every rank calls it, before building its model: ``ptplan run``
    builds each rank's ``stage_layers`` of this phase); ``samples``: the training data's size."""
    source = find_checkpoint(cfg, plan, model_name, dist.get_world_size(), run_id(cfg, samples))
    if source is not None:
        return phase_index(plan, source.frozen_blocks)
    fs = FreezeSchedule(plan, cfg.freeze, num_blocks=plan.inputs.profile.num_blocks, every=cfg.freeze_every,
                        alpha=cfg.alpha)
    return phase_index(plan, fs.planned(0, 0))


def stage_layers(plan: Plan, index: int, rank: int) -> list[int]:
    """The layers ``rank`` holds in phase ``index`` (``transition.holdings``: its stage's active layers, and
    on stage 0 the frozen prefix): what ``build_model(..., layers=...)`` builds on that rank."""
    return sorted(holdings(plan.phases[index], rank, plan.inputs.profile.num_layers, cached_prefix=False))


def built_copies(rt: ElasticRuntime) -> list[frozenset[int]]:
    """Per layer, the ranks whose copy as built can be trusted: every rank that built it when their
    copies agree (two float64 sums of its weights each, all-gathered), else the lowest such rank and
    those that agree with it. Collective; call before the first switch. Empty: no rank built it."""
    v = torch.zeros(rt.n, 3, dtype=torch.float64)
    with torch.no_grad():
        for i, ps in enumerate(rt.layer_params):
            if rt.store.where[i] is None:
                continue
            v[i, 0] = 1.0
            for p in ps:
                d = p.detach().double()
                v[i, 1] += d.sum().cpu()
                v[i, 2] += (d * d).sum().cpu()
    got = [torch.zeros_like(v).to(rt.device) for _ in range(rt.world)]
    dist.all_gather(got, v.to(rt.device))
    got = [g.cpu() for g in got]
    out = []
    for i in range(rt.n):
        built = [r for r in range(rt.world) if got[r][i, 0] == 1.0]
        out.append(frozenset(r for r in built if torch.equal(got[r][i], got[built[0]][i])))
    return out


@dataclass(frozen=True)
class Source:
    """The checkpoint a run resumes from."""

    rank: int
    """The rank whose checkpoint it is (the newest usable; lowest rank on a tie)."""
    step: int
    frozen_blocks: int
    readers: frozenset[int]
    """Ranks whose own checkpoint file is this very one (same ``id``; a shared folder, or one node): each
    reads its own layers from it. The others get theirs from ``rank``."""


def _cannot_resume(cfg: RunConfig, problems: list[str], fix: str = "") -> PtplanError:
    where = ckpt.checkpoint_path(cfg.checkpoint_dir) if cfg.checkpoint_dir else "(no --checkpoint-dir)"
    return PtplanError(f"cannot resume from {where}: " + "; ".join(problems) + fix)


def _my_checkpoint(cfg: RunConfig, plan: Plan, model_name: str, world: int, run: dict[str, Any]
                   ) -> dict[str, Any] | None:
    """This rank's own checkpoint: its step, frozen count and id, or why it cannot resume this run."""
    if not (cfg.checkpoint_dir and os.path.exists(ckpt.checkpoint_path(cfg.checkpoint_dir))):
        return None
    try:
        data = ckpt.load_checkpoint(cfg.checkpoint_dir, mmap=True, verify=False)  # its CRCs: ``find_checkpoint``
        problems = ckpt.mismatches(data, plan=plan, model_name=model_name, optimizer=cfg.optimizer,
                                   world_size=world, run=run)
        if problems:
            raise _cannot_resume(cfg, problems, "; resume with the plan and settings it was written with, or "
                                                "start without --resume (and another --checkpoint-dir)")
        return {"step": int(data["position"]["global_step"]),
                "frozen_blocks": int(data["position"]["frozen_blocks"]), "id": data.get("id"),
                "checksums": data.get("checksums")}
    except PtplanError as e:
        return {"error": str(e)}


def restart_count() -> int:
    """How many times torchrun restarted this job's workers (TORCHELASTIC_RESTART_COUNT; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def find_checkpoint(cfg: RunConfig, plan: Plan, model_name: str, world: int, run: dict[str, Any]) -> Source | None:
    """Whether to resume and from which rank's checkpoint, agreed by every rank (collective).

    Each rank looks at its own ``--checkpoint-dir`` (its node's disk, or a shared folder) and reports the
    checkpoint's step, or why it cannot resume this run. When any rank asks to resume (``--resume``, or
    a torchrun restart: TORCHELASTIC_RESTART_COUNT > 0), the source is the newest usable checkpoint
    (lowest rank on a tie), whichever node holds it. None: start from scratch (no rank asked, or a
    restart before the first checkpoint). Raises the same PtplanError on every rank when ``--resume``
    finds no usable checkpoint on any rank, or when the source's file is damaged: the ranks that read it split
    its records and check their CRC-32s (``checkpoint.verify_records``), each record once whatever the number
    of ranks, before any rank builds its model.
    """
    cfg = cfg.resolved(plan)  # the optimizer a checkpoint is checked against (``plan``: the plan's)
    if cfg.checkpoint_format == "sharded":  # a sharded checkpoint first (any plan of the profile), else a file
        from ptplan.executor.training import sharded

        decided, found = sharded.find(cfg, plan, model_name, world, run)
        if decided:
            return found
    wants = bool(cfg.resume or (restart_count() > 0 and cfg.checkpoint_dir))
    mine = _my_checkpoint(cfg, plan, model_name, world, run) if wants else None
    got: list[Any] = [None] * world
    dist.all_gather_object(got, (wants, cfg.resume, mine))
    if not any(w for w, _, _ in got):
        return None
    usable = [(-m["step"], r) for r, (_, _, m) in enumerate(got) if m and "step" in m]
    if usable:
        step, src = min(usable)
        m = got[src][2]
        readers = {r for r, (_, _, o) in enumerate(got) if o and m["id"] is not None and o.get("id") == m["id"]}
        source = Source(rank=src, step=-step, frozen_blocks=m["frozen_blocks"], readers=frozenset(readers | {src}))
        _check_records(cfg, source, got[dist.get_rank()][2])
        return source
    errors = [(r, m["error"]) for r, (_, _, m) in enumerate(got) if m and "error" in m]
    if errors:
        err = PtplanError(errors[0][1])
        err.rank = errors[0][0]  # type: ignore[attr-defined]
        raise err
    if any(explicit for _, explicit, _ in got):
        dirs = sorted({cfg.checkpoint_dir or "(none)"})
        raise PtplanError(f"--resume: no checkpoint.pt in --checkpoint-dir {', '.join(dirs)} on any node; run "
                          f"without --resume to start from scratch")
    return None


def _check_records(cfg: RunConfig, source: Source, mine: dict[str, Any] | None) -> None:
    """The source file's records, each CRC-checked by one of its readers on every node (a node's readers read its
    own copy, so they share that copy's records; ``mine``: this rank's own checkpoint as ``_my_checkpoint`` saw
    it); every rank raises the first problem (collective)."""
    import socket

    problem = None
    hosts = agree(None, socket.gethostname())  # each node reads its own copy: its readers share that copy's records
    me = dist.get_rank()
    readers = sorted(r for r in source.readers if hosts[r] == hosts[me])
    if cfg.checkpoint_dir and mine is not None and me in readers:
        try:
            ckpt.verify_records(ckpt.checkpoint_path(cfg.checkpoint_dir), mine.get("checksums"),
                                share=(readers.index(me), len(readers)))
        except PtplanError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 -- any failure here is every rank's, never one rank's hang
            problem = f"cannot check {ckpt.checkpoint_path(cfg.checkpoint_dir)}: {type(e).__name__}: {e}"
    agree(problem)


def _open_source(cfg: RunConfig, plan: Plan, rt: ElasticRuntime, source: Source, run: dict[str, Any]
                 ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(this rank's mapped checkpoint when it is a reader, else None; the source's position and RNG states),
    every rank raising the first rank's problem (collective)."""
    data = None
    problem, payload = None, None
    if rt.rank in source.readers:
        assert cfg.checkpoint_dir is not None, "a reader of the source checkpoint has its folder"
        try:
            data = ckpt.load_checkpoint(cfg.checkpoint_dir, mmap=True, verify=False)  # ``find_checkpoint`` did
            problems = ckpt.mismatches(data, plan=plan, model_name=rt.model.name, optimizer=cfg.optimizer,
                                       world_size=rt.world, run=run)
            if data["position"]["global_step"] != source.step:
                problems.append(f"it is at step {data['position']['global_step']} now, not {source.step} (the file "
                                f"changed while the ranks agreed on it)")
            if problems:
                raise _cannot_resume(cfg, problems)
            shapes = {rt.names[id(p)]: rt.store.shapes[id(p)] for ps in rt.layer_params for p in ps}
            ckpt.check_state(data, shapes, state_keys(rt.opt))
            if rt.rank == source.rank:
                payload = {"position": data["position"], "rng": data["rng"]}
        except PtplanError as e:
            problem = str(e)
    return data, agree(problem, payload)[source.rank]


def _copy_own(rt: ElasticRuntime, data: dict[str, Any], held: list[int], owned: list[int]) -> None:
    """A reader: its own layers' weights (``held``) and optimizer state (``owned``) from its mapped file."""
    keys = state_keys(rt.opt)
    with torch.no_grad():
        for i in held:
            for p in rt.layer_params[i]:
                p.copy_(data["model"][rt.names[id(p)]])
        for i in owned:
            for p in rt.layer_params[i]:
                for v, k in zip(ensure_state(rt.opt, p), keys):
                    v.copy_(data["optim"][rt.names[id(p)]][k])


def _send_rest(rt: ElasticRuntime, source: Source, new: Phase, cached: bool, data: dict[str, Any] | None) -> int:
    """The source rank sends the ranks that cannot read its file their layers, tensor by tensor from its
    mapped file; returns the bytes this rank sent."""
    src, keys = source.rank, state_keys(rt.opt)
    active = range(new.frozen_layers, rt.n)
    lacking = [r for r in range(rt.world) if r not in source.readers]
    weights = [Transfer(src=src, dst=r, layers=tuple(sorted(holdings(new, r, rt.n, cached_prefix=cached))))
               for r in lacking]
    state = [Transfer(src=src, dst=r, layers=tuple(i for i in owned_layers(new, r, rt.n) if i in active))
             for r in lacking]

    # the source sends each tensor in the receiver's dtype (this run's; a reader's copy_ converts the same way):
    # a bf16 checkpoint resumed in float32 would otherwise post other message sizes than its receivers
    def weights_of(layers: tuple[int, ...]) -> list[Tensor]:
        if rt.rank == src:
            assert data is not None
            return [data["model"][rt.names[id(p)]].to(p.dtype) for i in layers for p in rt.layer_params[i]]
        return [p.data for i in layers for p in rt.layer_params[i]]

    def state_of(layers: tuple[int, ...]) -> list[Tensor]:
        if rt.rank == src:
            assert data is not None
            return [data["optim"][rt.names[id(p)]][k].to(state_dtype(k, p)) for i in layers
                    for p in rt.layer_params[i] for k in keys]
        return [t for i in layers for p in rt.layer_params[i] for t in ensure_state(rt.opt, p)]

    batched = rt.backend == "nccl"
    sent = exchange([t for t in weights if t.layers], rt.rank, weights_of, rt.device, batched=batched)
    return sent + exchange([t for t in state if t.layers], rt.rank, state_of, rt.device, batched=batched)


def restore(cfg: RunConfig, plan: Plan, rt: ElasticRuntime, source: Source, run: dict[str, Any]
            ) -> tuple[Position, dict[str, Any]]:
    """Fill each rank's layers of the checkpoint's phase (weights, and optimizer state of the active layers
    it owns) from the checkpoint, then enter that phase: a reader of the file (``Source.readers``) copies
    its own layers' tensors from its mapped file (the others' are never read); the source rank sends the
    rest (``_send_rest``). Storage is given first where the phase keeps each layer, so the switch moves
    nothing and a sharded stage (tp, FSDP) is built from the loaded values. Returns the position and the
    ``resume`` record's timing (the switch's, plus the checkpoint's load). A sharded checkpoint
    (``sharded.ShardedSource``) loads resharded into this plan's phase (``sharded.restore``)."""
    from ptplan.executor.training import sharded

    if isinstance(source, sharded.ShardedSource):
        return sharded.restore(cfg, rt, source)
    data, meta = _open_source(cfg, plan, rt, source, run)
    pos = Position(**meta["position"])
    index = phase_index(plan, pos.frozen_blocks)
    new = plan.phases[index]
    t0 = time.perf_counter()
    cached = rt._caches(new)
    held = holdings(new, rt.rank, rt.n, cached_prefix=cached)
    for i, where in held.items():  # storage where the phase keeps the layer, about to be overwritten
        if rt.store.where[i] != where:
            rt.store.place(i, where, keep_values=False)
    active = range(new.frozen_layers, rt.n)
    if data is not None:
        _copy_own(rt, data, list(held), [i for i in owned_layers(new, rt.rank, rt.n) if i in active])
    sent = _send_rest(rt, source, new, cached, data)
    del data
    load_s = time.perf_counter() - t0
    need = needs(new, rt.n)  # every rank that needs a layer now holds it, and its owners its state
    info = rt.switch(index, have_weights=need,
                     have_state=[need[i] if i in active else frozenset() for i in range(rt.n)])
    rng = meta["rng"][rt.rank]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    both = torch.tensor([load_s, sent], dtype=torch.float64, device=rt.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    load_s = float(both[0].item())
    info = {**info, "seconds": info["seconds"] + load_s, "parts": {**info["parts"], "checkpoint": load_s},
            "bytes": {**info["bytes"], "checkpoint_sent_max": int(both[1].item())}}
    return pos, info
