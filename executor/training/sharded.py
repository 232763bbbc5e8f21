"""Sharded checkpoints (torch.distributed.checkpoint): every rank writes its own layers, any plan of the profile reads them.

``--checkpoint-format sharded``. A save is collective: each rank passes DCP only what it holds in the current
phase -- its stage's weights (stage 0: also the frozen prefix) under their canonical names (``layers.<i>.<...>``)
and the optimizer state of the active layers it trains, as ``optim.<name>.<state key>`` -- and DCP writes them in
parallel, one file per rank; a tensor several ranks hold (data-parallel replicas, a tensor-parallel group after
the gather) is written once (DCP's save planner de-duplicates equal keys). No rank gathers the model. A stage
with FSDP or tp passes the DTensors it trains (``in_place``): each rank writes only its own shards, and a load
into any other layout reads the slices it needs; a tp copy whose layout is not the layer's (GPT-2's Conv1D
weights train transposed) is first gathered back into its full layers (``ElasticRuntime.drain``: its own stage).

Layout under ``--checkpoint-dir``::

    sharded-step00000012/   DCP's files (.metadata, __<rank>_0.distcp) of the save after 12 optimizer steps
    sharded.json            the commit point, written by rank 0 (temp file, fsync, rename) after every rank's
                            files are complete; older step folders are removed after it

``sharded.json`` holds: schema, id, folder, the plan (``checkpoint.plan_identity``: profile fingerprint,
phases, freeze steps, batch) and its id, model, optimizer and its state keys, world size, the phase it was in
(index, frozen blocks and layers, K, D, global batch), the run settings (``checkpoint.RUN_KEYS``), the
position (``state.Position``), per-rank RNG states (base64 of ``torch.get_rng_state``), the bytes each rank
passed to DCP, the save's seconds, and ``files``: every file of the save (``.metadata`` and each
``__<rank>_<n>.distcp``) with its size and ``zlib.crc32``, each file hashed right after the save by the rank
that wrote it (``record_files``).

Resume (``find``, ``restore``): every rank must see the same ``sharded.json`` (one folder every rank sees: a
shared file system, or one node). Any plan made from the same profile can continue it -- another world size,
K, D, strategy -- if it has a phase for the checkpoint's frozen count with the same global batch (same step,
same data order: the epoch's order and the cursor are global), and the same freeze steps under a planned
freeze. Each rank allocates the layers it holds in that phase of the new plan and loads exactly those keys
(DCP reads the needed bytes from whichever rank's file holds them). RNG states are restored per rank when
the world size is the same; otherwise each rank is re-seeded from the seed, its rank and the step.

``--async-checkpoint``: ``dcp.async_save`` on a dedicated gloo group; the step waits only for DCP's copy of
the rank's tensors (staging), the write runs in a thread, and ``sharded.json`` is committed when it is done
(at the next save, or at the run's end; a run that fails keeps the previous
committed checkpoint).

Integrity (``read_meta``, ``find``): before a resume reads anything, every file the DCP ``.metadata`` places
tensors in must exist and reach the end of its last item (its storage_data: relative path, offset, length), and
every file ``files`` lists must have its recorded size and CRC-32; the first file that does not is named in one
PtplanError. The launcher's look before launch (``read_meta`` outside a process group) checks every checksum;
the workers (``find``) split the files between the ranks, so each file is hashed once whatever the number of
ranks. A ``sharded.json`` written before checksums (no ``files``) is read without them (its layout is still
checked). A load that fails all the same (a file that changed after the checks) is one PtplanError naming DCP's
first underlying error (``_load``), not DCP's ``CheckpointException``.

Cost of the checksums: ``file_crc32`` reads 524 MB from the page cache in 0.17-0.20 s on this shared 2-core box
(load average 1.8), about 3 GB/s; at a save each rank hashes only the files it wrote, at a resume each file is
hashed once before launch and once across the workers. Measured with::

    python -c "import time, torch; from ptplan.executor.training import sharded as s;
    torch.save({f'w{i}': torch.randn(1024, 1024) for i in range(125)}, '/tmp/big.pt');
    t = time.perf_counter(); s.file_crc32('/tmp/big.pt'); print(time.perf_counter() - t)"
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
import uuid
import zlib
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Plan

from ptplan.executor.runtime.elastic import ElasticRuntime, phase_index
from ptplan.executor.runtime.hybrid import local
from ptplan.executor.runtime.optim import ensure_state, state_keys
from ptplan.executor.runtime.transition import holdings, needs, owned_layers
from ptplan.executor.runtime.collective import agree, ranks_text
from ptplan.planner.records import CheckpointRecord, CheckpointWrittenRecord
from ptplan.executor.training.rss import PeakRss, trim
from ptplan.executor.training import checkpoint as ckpt
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.resume import Source, restart_count, rng_state
from ptplan.executor.training.state import Position, RunContext

SCHEMA = "ptplan.checkpoint.sharded/1"
META = "sharded.json"
PREFIX = "sharded-step"


def meta_path(folder: str | os.PathLike) -> str:
    return os.path.join(os.fspath(folder), META)


def step_folder(folder: str | os.PathLike, step: int) -> str:
    return os.path.join(os.fspath(folder), f"{PREFIX}{step:08d}")


def in_place(rt: ElasticRuntime) -> bool:
    """Whether DCP can write this rank's split or sharded layers as they train (``hybrid.ShardedStage``: FSDP's
    and tp's DTensors under the canonical names, each rank its own shards): every copy keeps its layer's layout.
    A family whose tp copy reorders or transposes a weight (GPT-2's fused Conv1D) is gathered first instead."""
    st = rt.sharded
    return st is not None and not st.back and not any(st._frozen_back.values())


def _weights(rt: ElasticRuntime, i: int) -> list[tuple[str, Tensor]]:
    """Layer i's weights by canonical name: its split or sharded copy's (DTensors) while the stage has one, else
    the layer's own."""
    st = rt.sharded
    copy = st.copies.get(i) if st is not None else None
    if copy is None:
        return [(rt.names[id(p)], p.detach()) for p in rt.layer_params[i]]
    by_name = dict(copy.named_parameters())
    return [(rt.names[id(p)], by_name[n].detach()) for n, p in rt.model.layers[i].named_parameters()]


def local_state(rt: ElasticRuntime) -> dict[str, Tensor]:
    """What this rank holds in its current phase, by canonical key: its layers' weights, and the optimizer
    state of the active layers it trains (the tensors themselves: no copy). In a stage with FSDP or tp
    (``in_place``) the weights and state are the DTensors training uses: each rank passes only its shards."""
    ph = rt.phase
    assert ph is not None
    keys = state_keys(rt.opt)
    st = rt.sharded
    out: dict[str, Tensor] = {}
    for i in sorted(holdings(ph, rt.rank, rt.n, cached_prefix=rt._caches(ph))):
        out.update(_weights(rt, i))
    for i in owned_layers(ph, rt.rank, rt.n):
        if i >= ph.frozen_layers:
            for p in rt.layer_params[i]:
                q = st.live.get(id(p), p) if st is not None else p
                for k, v in zip(keys, ensure_state(rt.opt, q)):
                    out[f"optim.{rt.names[id(p)]}.{k}"] = v
    return out


def nbytes(state: dict[str, Tensor]) -> int:
    """The bytes this rank holds of ``state`` (a DTensor: its local shards)."""
    return sum(local(t).numel() * t.element_size() for t in state.values())


def _encode_rng(state: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in state.items()}


def _decode_rng(state: dict[str, str]) -> dict[str, Tensor]:
    return {k: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8) for k, v in state.items()}


def _write_json(path: str, data: dict[str, Any]) -> None:
    """``path`` replaced atomically by ``data`` (temp file, fsync, rename, fsync of the folder)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise PtplanError(f"cannot write the checkpoint metadata {path}: {e.strerror or e}; the previous checkpoint, "
                          f"if any, is kept. Free space or pass another --checkpoint-dir") from None
    ckpt._fsync_dir(os.path.dirname(path))


def _metadata(ctx: RunContext, folder: str, rng: list[Any], sizes: list[int]) -> dict[str, Any]:
    rt, ph, plan = ctx.rt, ctx.rt.phase, ctx.plan
    assert ph is not None and rt.phase_index is not None
    return {"schema": SCHEMA, "id": uuid.uuid4().hex, "folder": os.path.basename(folder),
            "plan_id": ckpt.plan_id(plan), "plan": ckpt.plan_identity(plan), "model_name": rt.model.name,
            "optimizer": ctx.cfg.optimizer, "state_keys": list(state_keys(rt.opt)), "world_size": rt.world,
            "phase": {"index": rt.phase_index, "frozen_blocks": ph.frozen_blocks, "frozen_layers": ph.frozen_layers,
                      "K": ph.K, "D": ph.D, "tp": ph.tp, "global_batch": ph.global_batch},
            "global_batch": {str(p.frozen_blocks): p.global_batch for p in plan.phases},
            "run": ctx.run_id, "position": asdict(ctx.pos), "rng": rng, "bytes": sizes}


def check_shared(folder: str, rank: int, *, wait_s: float = 2.0) -> None:
    """Collective: every rank sees the file rank 0 writes in ``folder`` (a sharded checkpoint is one folder every
    rank sees: a shared file system, or one node), else the same PtplanError on every rank, naming the ranks
    that do not see it. A rank that does not see it at once looks again for ``wait_s`` (a network file system's
    attribute cache)."""
    problem = name = None
    if rank == 0:
        name = f".ptplan-shared-{uuid.uuid4().hex}"
        try:
            os.makedirs(folder, exist_ok=True)
            open(os.path.join(folder, name), "w").close()
        except OSError as e:
            problem = f"cannot write in the checkpoint folder {folder}: {e.strerror or e}"
    probe = os.path.join(folder, agree(problem, name)[0])
    deadline = time.monotonic() + wait_s
    while not os.path.exists(probe) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = agree(None, os.path.exists(probe))
    if rank == 0:
        os.unlink(probe)
    blind = [r for r, s in enumerate(seen) if not s]
    if blind:
        raise PtplanError(f"a sharded checkpoint must be one folder every rank sees, but ranks {blind} of {len(seen)} "
                          f"do not see the file rank 0 wrote in {folder} (a folder on each node's own disk?); put "
                          f"--checkpoint-dir on a file system every node shares (NFS, Lustre, ...), or use "
                          f"--checkpoint-format single (global rank 0 writes the whole model on its node)")


def write_failed(e: BaseException, folder: str, rank: int) -> PtplanError | None:
    """The PtplanError for a DCP write that failed on some rank for want of space or another OS error (DCP raises
    its ``CheckpointException``, with every failing rank's error, on every rank), or None for another failure
    (re-raised as it is). Rank 0 removes the incomplete step folder; ``sharded.json`` still names the last
    committed one."""
    failures = getattr(e, "failures", None) or {rank: (e, None)}
    errs = {r: ckpt.os_error(x) for r, (x, _) in sorted(failures.items())}
    bad = {r: x for r, x in errs.items() if x is not None}
    if not bad:
        return None
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    first = next(iter(bad.values()))
    full = " (the disk is full)" if first.errno in ckpt.DISK_FULL else ""
    return PtplanError(f"cannot write the checkpoint {folder}: {first.strerror or first} on ranks {sorted(bad)}{full}; "
                       f"the incomplete folder was removed and the previous checkpoint, if any, is kept "
                       f"({META} still names it). Free space or pass another --checkpoint-dir, then resume with "
                       f"--resume")


class ShardedWriter:
    """Writes a run's sharded checkpoints (every rank holds one; ``save`` and ``wait`` are collective)."""

    def __init__(self) -> None:
        self.checked = False
        """Whether every rank was seen to share the checkpoint folder (``check_shared``, at the first save)."""
        self.pending: tuple[Future[Any], dict[str, Any], float] | None = None
        """An async save in flight: (DCP's future, the metadata to commit, when it started)."""
        self.group: Any = None
        """The gloo group async saves run their collectives on (not the training's)."""

    def save(self, ctx: RunContext) -> CheckpointRecord:
        """Write the checkpoint of ``ctx``'s position; returns the ``checkpoint`` record (rank 0 writes it to the
        run log)."""
        cfg, rt = ctx.cfg, ctx.rt
        assert cfg.checkpoint_dir is not None
        self.wait(ctx)
        t0 = time.perf_counter()
        trim()  # freed pages back to the system first: the growth below is what the save allocates
        with PeakRss() as rss:  # this rank's host memory from before a gather (if any) to the end of DCP's write
            if in_place(rt):  # FSDP/tp shards written as they are (2BW's updates done first)
                assert rt.schedule is not None
                rt.schedule.drain()
            else:  # 2BW's updates done; a tp copy in another layout gathered into this stage's full layers
                rt.drain()
            state = local_state(rt)
            rng: list[Any] = [None] * rt.world
            dist.all_gather_object(rng, _encode_rng(rng_state()))
            sizes: list[Any] = [None] * rt.world
            dist.all_gather_object(sizes, nbytes(state))
            folder = step_folder(cfg.checkpoint_dir, ctx.pos.global_step)
            problem = None
            if rt.rank == 0:
                try:
                    os.makedirs(cfg.checkpoint_dir, exist_ok=True)
                    shutil.rmtree(folder, ignore_errors=True)  # a save of this step that never committed
                except OSError as e:
                    problem = f"cannot create the checkpoint folder {cfg.checkpoint_dir}: {e.strerror}"
            agree(problem)
            if not self.checked:
                check_shared(cfg.checkpoint_dir, rt.rank)
                self.checked = True
            meta = _metadata(ctx, folder, rng, sizes)
            if cfg.async_checkpoint:
                if self.group is None:
                    self.group = dist.new_group(backend="gloo")
                fut = dcp.async_save(state, checkpoint_id=folder, process_group=self.group)
                assert isinstance(fut, Future)
                self.pending = (fut, meta, t0)
                blocked = time.perf_counter() - t0
                return CheckpointRecord(step=ctx.pos.global_step, format="sharded", async_=True, path=folder,
                                        seconds=_slowest(blocked, rt), bytes_max=max(sizes), bytes_total=sum(sizes))
            try:
                saved = dcp.save(state, checkpoint_id=folder)
            except BaseException as e:
                err = write_failed(e, folder, rt.rank)
                if err is None:
                    raise
                raise err from None
        meta["files"] = record_files(folder, saved, rt.rank, rt.world)
        seconds = _slowest(time.perf_counter() - t0, rt)
        growth: list[Any] = [None] * rt.world
        dist.all_gather_object(growth, rss.growth)
        meta["seconds"] = seconds
        self._commit(ctx, meta)
        # rss_growth_bytes per rank: its peak resident size during the write minus before (None: not measured)
        return CheckpointRecord(step=ctx.pos.global_step, format="sharded", async_=False, path=folder,
                                seconds=seconds, bytes_max=max(sizes), bytes_total=sum(sizes),
                                rss_growth_bytes=growth if all(g is not None for g in growth) else None)

    def wait(self, ctx: RunContext) -> None:
        """Finish an async save in flight: every rank waits for its write, rank 0 commits the metadata and
        logs a ``checkpoint_written`` record with the seconds from the save's start."""
        if self.pending is None:
            return
        fut, meta, t0 = self.pending
        self.pending = None
        folder = os.path.join(ctx.cfg.checkpoint_dir or "", meta["folder"])
        try:
            saved = fut.result()
        except BaseException as e:
            err = write_failed(e, folder, ctx.rank)
            if err is None:
                raise
            raise err from None
        meta["files"] = record_files(folder, saved, ctx.rank, dist.get_world_size())
        meta["seconds"] = time.perf_counter() - t0
        self._commit(ctx, meta)
        ctx.log.write(CheckpointWrittenRecord(step=meta["position"]["global_step"], seconds=meta["seconds"]))

    def _commit(self, ctx: RunContext, meta: dict[str, Any]) -> None:
        """Rank 0 (after every rank's files are complete) replaces ``sharded.json`` and removes older step
        folders; every rank raises rank 0's error. DCP's save (or its future) returns on rank 0, the
        coordinator, only after every rank's write result reached it."""
        problem = None
        folder = ctx.cfg.checkpoint_dir
        assert folder is not None
        if ctx.rank == 0:
            try:
                _write_json(meta_path(folder), meta)
                for name in os.listdir(folder):
                    if name.startswith(PREFIX) and name != meta["folder"]:
                        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
            except PtplanError as e:
                problem = str(e)
            except OSError as e:  # listing the folder: still raised on every rank
                problem = f"cannot update the checkpoint folder {folder}: {e.strerror or e}"
        agree(problem)


def _slowest(seconds: float, rt: ElasticRuntime) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ---- integrity: the files of a save, their sizes and checksums ------------------------------------

MD = ".metadata"
"""DCP's metadata file in a save's folder (written by the coordinator, rank 0)."""


def file_crc32(path: str) -> int:
    """``zlib.crc32`` of the file at ``path``, read in 1 MiB chunks."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _writer(name: str, index: int, world: int) -> int:
    """The rank that hashes file ``name`` (``index``-th of the save's files, sorted) after a save: the rank that
    wrote it, whose page cache holds it (DCP names rank r's files ``__r_<n>.distcp``; ``.metadata``: rank 0),
    else by position."""
    m = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
    if m and int(m[1]) < world:
        return int(m[1])
    return 0 if name == MD else index % world


def record_files(folder: str, saved: Any, rank: int, world: int) -> dict[str, dict[str, int]]:
    """Every file of the save in ``folder`` by name: {"bytes", "crc32"} (``files`` in ``sharded.json``), each
    hashed by the rank that wrote it (``saved``: what ``dcp.save`` returned, its ``Metadata``). Collective: the
    same dict on every rank, or the same PtplanError (a file that cannot be read back)."""
    md = saved if isinstance(saved, Metadata) else dcp.FileSystemReader(folder).read_metadata()
    names = sorted({info.relative_path for info in md.storage_data.values()} | {MD})
    mine: dict[str, dict[str, int]] = {}
    problem = None
    try:
        for i, name in enumerate(names):
            if _writer(name, i, world) == rank:
                path = os.path.join(folder, name)
                mine[name] = {"bytes": os.path.getsize(path), "crc32": file_crc32(path)}
    except OSError as e:
        problem = (f"cannot read back the checkpoint file {e.filename} to record its checksum: {e.strerror or e}; "
                   f"the previous checkpoint, if any, is kept ({META} still names it)")
    out: dict[str, dict[str, int]] = {}
    for part in agree(problem, mine):
        out.update(part)
    return out


def _damaged(path: str) -> str:
    return f"restore a good copy of {os.path.dirname(path)}, or start without --resume (and another --checkpoint-dir)"


def check_layout(data: str) -> None:
    """Every file the save in folder ``data`` places tensors in (its ``.metadata``'s storage_data: DCP's
    ``_StorageInfo``, relative path, offset and length) exists and reaches the end of its last item; else one
    PtplanError naming the first file that does not (missing, empty or truncated), or the unreadable
    ``.metadata``. Reads the metadata and stats the files: no tensor bytes."""
    md_path = os.path.join(data, MD)
    try:
        items = list(dcp.FileSystemReader(data).read_metadata().storage_data.values())
        ends: dict[str, int] = {}
        count: dict[str, int] = {}
        for info in items:
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
            count[info.relative_path] = count.get(info.relative_path, 0) + 1
    except Exception as e:  # a torn, empty or foreign .metadata: whatever DCP's reader (pickle) raises for it
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise PtplanError(f"sharded checkpoint {md_path} cannot be read ({type(e).__name__}: {reason}): the save's "
                          f"metadata is truncated or damaged; {_damaged(md_path)}") from None
    for name in sorted(ends):
        path = os.path.join(data, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise PtplanError(f"sharded checkpoint file {path} is missing (its .metadata places {count[name]} "
                              f"tensor item(s) in it); {_damaged(path)}") from None
        except OSError as e:
            raise PtplanError(f"sharded checkpoint file {path} cannot be read: {e.strerror or e}; "
                              f"{_damaged(path)}") from None
        if size < ends[name]:
            what = "empty (0 bytes)" if size == 0 else f"{size} bytes"
            raise PtplanError(f"sharded checkpoint file {path} is {what}, but its .metadata places tensor items up "
                              f"to byte {ends[name]}: it is truncated; {_damaged(path)}")


def checksum_problem(data: str, meta: dict[str, Any], share: tuple[int, int] = (0, 1)) -> str | None:
    """Why the files of the save in folder ``data`` are not as ``meta["files"]`` recorded them (size and
    ``zlib.crc32``), checking this caller's ``share`` = (k, n) of them (the k-th, (k+n)-th, ... in name order; n
    ranks together check each file once), else None. None as well for a checkpoint written before checksums (no
    ``files``). A reason, not an exception, so that ``agree`` raises it on every rank."""
    files = meta.get("files")
    if files is None:
        return None
    where = os.path.join(os.path.dirname(data), META)
    if not isinstance(files, dict) or not all(isinstance(v, dict) and isinstance(v.get("bytes"), int)
                                              and isinstance(v.get("crc32"), int) for v in files.values()):
        return (f"sharded checkpoint {where}: its 'files' field is damaged; delete it (or restore a good copy) and "
                f"start without --resume")
    k, n = share
    for name in sorted(files)[k::n]:
        path = os.path.join(data, os.path.basename(name))
        want = files[name]
        try:
            size = os.path.getsize(path)
            crc = file_crc32(path) if size == want["bytes"] else None
        except FileNotFoundError:
            return f"sharded checkpoint file {path} is missing ({META} lists it); {_damaged(path)}"
        except OSError as e:
            return f"sharded checkpoint file {path} cannot be read: {e.strerror or e}; {_damaged(path)}"
        if crc is None:
            return (f"sharded checkpoint file {path} is {size} bytes, but {where} recorded {want['bytes']} when it "
                    f"was saved; {_damaged(path)}")
        if crc != want["crc32"]:
            return (f"sharded checkpoint file {path} is damaged: its CRC-32 is {crc:08x}, {where} recorded "
                    f"{want['crc32']:08x} when it was saved (its bytes changed since); {_damaged(path)}")
    return None


# ---- resume ------------------------------------------------------------------------------------

FIX = ("; plan again from the checkpoint's profile and settings (ptplan plan with that profile and another --cluster), or start without "
        "--resume (and another --checkpoint-dir)")


def resume_problems(meta: dict[str, Any], *, plan: Plan, model_name: str, optimizer: str, freeze: str,
                    run: dict[str, Any]) -> list[str]:
    """What keeps the sharded checkpoint ``meta`` from continuing in ``plan`` (empty: it can). The plan may
    differ in world size, layout and strategy; it may not differ in what the position means."""
    out = []
    old = meta["plan"]
    new = ckpt.plan_identity(plan)
    if old["profile"] != new["profile"]:
        out.append(f"it was written for profile {old['profile']}, this plan is of profile {new['profile']}")
    if meta["model_name"] != model_name:
        out.append(f"it is for model {meta['model_name']}, not {model_name}")
    if meta["optimizer"] != optimizer:
        out.append(f"it holds {meta['optimizer']} state, not {optimizer}")
    for k in ckpt.RUN_KEYS:
        if meta["run"].get(k) != run.get(k):
            out.append(f"its {k} is {meta['run'].get(k)!r}, this run's is {run.get(k)!r}")
    frozen = int(meta["position"]["frozen_blocks"])
    here = {p.frozen_blocks: p.global_batch for p in plan.phases}
    if frozen not in here:
        out.append(f"it is at {frozen} frozen blocks, and this plan has no phase for that (phases for "
                   f"{sorted(here)} frozen blocks)")
    for f, gb in sorted((int(k), v) for k, v in meta["global_batch"].items()):
        if f in here and here[f] != gb:
            out.append(f"its phase with {f} frozen blocks trains on a global batch of {gb} samples, this plan's on "
                       f"{here[f]} (plan with --batch {gb} and the constant global batch policy)")
            break
    if freeze == "planned" and old["freeze_steps"] != new["freeze_steps"]:
        out.append(f"its planned freeze steps are {old['freeze_steps']}, this plan's are {new['freeze_steps']}")
    return out


@dataclass(frozen=True)
class ShardedSource(Source):
    """A sharded checkpoint every rank reads its own part of (``readers``: all)."""

    meta: dict[str, Any] = field(compare=False, hash=False)
    folder: str = field(compare=False)


def read_meta(folder: str | os.PathLike, *, checksums: bool | None = None, files: bool = True) -> dict[str, Any]:
    """``folder/sharded.json``, checked: one PtplanError for a damaged file, a missing DCP folder, or a save
    whose files are missing, truncated (``check_layout``) or, with ``checksums``, not as recorded
    (``checksum_problem``). ``checksums`` None: checked outside a process group (the launcher's look before
    launch), not in a worker (``find`` splits them between the ranks). ``files`` False: the pointer alone, for a
    reader of its records that does not resume from it (``membership``: the resume checks the files)."""
    path = meta_path(folder)
    fix = "delete it (or restore a good copy) and start without --resume"
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise PtplanError(f"sharded checkpoint {path} cannot be read ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        raise PtplanError(f"{path} is not a ptplan sharded checkpoint of schema {SCHEMA}; {fix}")
    data = os.path.join(os.fspath(folder), str(meta.get("folder")))
    if not os.path.exists(os.path.join(data, MD)):
        raise PtplanError(f"sharded checkpoint {path} names {data}, which holds no DCP .metadata; {fix}")
    if not files:
        return meta
    check_layout(data)
    if checksums is None:
        checksums = not (dist.is_available() and dist.is_initialized())
    problem = checksum_problem(data, meta) if checksums else None
    if problem:
        raise PtplanError(problem)
    return meta


def find(cfg: RunConfig, plan: Plan, model_name: str, world: int, run: dict[str, Any]
         ) -> tuple[bool, ShardedSource | None]:
    """Whether to resume from a sharded checkpoint (collective; every rank gets the same answer or the same
    PtplanError). (False, None): no rank sees one -- the caller looks for a single-file checkpoint. First, with a
    ``--checkpoint-dir``, every rank must see the same folder (``check_shared``: one node, or a shared file
    system)."""
    if cfg.checkpoint_dir:  # before any training: a folder the ranks do not share is refused now, not at a save
        check_shared(cfg.checkpoint_dir, dist.get_rank())
    restarted = restart_count() > 0
    wants = bool(cfg.resume or (restarted and cfg.checkpoint_dir))
    mine: dict[str, Any] | None = None
    if wants and cfg.checkpoint_dir and os.path.exists(meta_path(cfg.checkpoint_dir)):
        try:
            mine = {"meta": read_meta(cfg.checkpoint_dir, checksums=False)}  # split below
        except PtplanError as e:
            mine = {"error": str(e)}
    got: list[Any] = [None] * world
    dist.all_gather_object(got, (wants, mine))
    if not any(w for w, _ in got) or all(m is None for _, m in got):
        return False, None
    agree(next((m["error"] for _, m in got if m and "error" in m), None))
    ids = [m["meta"]["id"] if m else None for _, m in got]
    if len(set(ids)) != 1:
        seen = {i: [r for r, x in enumerate(ids) if x == i] for i in dict.fromkeys(ids)}
        raise PtplanError("a sharded checkpoint must be one folder every rank sees, but the ranks see different "
                          "ones (" + "; ".join(f"ranks {rs}: {'none' if i is None else 'id ' + i}" for i, rs in
                                               seen.items()) + "); put --checkpoint-dir on a shared file system, or "
                          "use --checkpoint-format single")
    meta = next(m["meta"] for _, m in got if m)
    data = os.path.join(cfg.checkpoint_dir or "", meta["folder"])  # each file's checksum on one rank
    agree(checksum_problem(data, meta, share=(dist.get_rank(), world)))
    problems = resume_problems(meta, plan=plan, model_name=model_name, optimizer=cfg.optimizer, freeze=cfg.freeze,
                               run=run)
    if problems:
        raise PtplanError(f"cannot resume from {meta_path(cfg.checkpoint_dir or '')}: " + "; ".join(problems) + FIX)
    pos = meta["position"]
    return True, ShardedSource(rank=0, step=int(pos["global_step"]), frozen_blocks=int(pos["frozen_blocks"]),
                               readers=frozenset(range(world)), meta=meta,
                               folder=os.path.join(cfg.checkpoint_dir or "", meta["folder"]))


def _wanted(rt: ElasticRuntime, index: int) -> dict[str, Tensor]:
    """Storage for what this rank holds in phase ``index`` (weights; optimizer state of its active layers),
    allocated where the phase keeps it, by canonical key: what it loads."""
    new = rt.plan.phases[index]
    for i, where in holdings(new, rt.rank, rt.n, cached_prefix=rt._caches(new)).items():
        if rt.store.where[i] != where:
            rt.store.place(i, where, keep_values=False)
    out: dict[str, Tensor] = {}
    keys = state_keys(rt.opt)
    for i in sorted(holdings(new, rt.rank, rt.n, cached_prefix=rt._caches(new))):
        for p in rt.layer_params[i]:
            out[rt.names[id(p)]] = p.data
    for i in owned_layers(new, rt.rank, rt.n):
        if i >= new.frozen_layers:
            for p in rt.layer_params[i]:
                for k, v in zip(keys, ensure_state(rt.opt, p)):
                    out[f"optim.{rt.names[id(p)]}.{k}"] = v
    return out


def _check_keys(folder: str, want: dict[str, Tensor]) -> str | None:
    """Why the checkpoint in ``folder`` cannot fill ``want`` (a missing key or another shape, or its metadata
    unreadable here), else None: a reason, not an exception, so that ``agree`` raises it on every rank."""
    try:
        have = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as e:  # a missing, torn or foreign .metadata file: whatever DCP's reader raises for it
        return f"cannot read the sharded checkpoint's metadata in {folder}: {e}; check that folder (every rank reads it)"
    missing = [k for k in want if k not in have]
    bad = [k for k in want if k in have and tuple(getattr(have[k], "size", ())) != tuple(want[k].shape)]
    if missing or bad:
        return (f"the sharded checkpoint {folder} does not fit this model: missing {missing[:3]}, other shapes "
                f"{bad[:3]}; resume with the model and optimizer it was written for")
    return None


def _load(want: dict[str, Tensor], folder: str) -> None:
    """``dcp.load`` of ``want`` from ``folder`` (collective). DCP raises its ``CheckpointException`` on every
    rank, holding each failing rank's error and traceback; it becomes one PtplanError naming the first
    underlying error (a missing file's FileNotFoundError, a truncated file's EOFError, ...) and the ranks."""
    try:
        dcp.load(want, checkpoint_id=folder)
    except CheckpointException as e:
        failures = sorted((getattr(e, "failures", None) or {}).items())
        if not failures:
            raise
        cause = failures[0][1][0]
        reason = " ".join(str(cause).split())[:300]
        if not reason and isinstance(cause, EOFError):
            reason = "a file ends before the tensors its .metadata places in it (truncated)"
        raise PtplanError(f"cannot read the sharded checkpoint {folder} ({ranks_text([r for r, _ in failures])}): "
                          f"{type(cause).__name__}{': ' + reason if reason else ''}; restore a good copy of that "
                          f"folder, or start without --resume (and another --checkpoint-dir)") from None


def restore(cfg: RunConfig, rt: ElasticRuntime, source: ShardedSource) -> tuple[Position, dict[str, Any]]:
    """Load the checkpoint into this plan's phase for its frozen count (collective): each rank allocates and
    loads only what it holds there (DCP reads those bytes from whichever files hold them), then the phase
    is entered with nothing to move. Returns the position and the ``resume`` record's timing."""
    meta = source.meta
    pos = Position(**meta["position"])
    index = phase_index(rt.plan, pos.frozen_blocks)
    new = rt.plan.phases[index]
    t0 = time.perf_counter()
    want = _wanted(rt, index)
    agree(_check_keys(source.folder, want))
    _load(want, source.folder)
    read = nbytes(want)
    del want
    load_s = time.perf_counter() - t0
    active = range(new.frozen_layers, rt.n)
    need = needs(new, rt.n)
    info = rt.switch(index, have_weights=need,
                     have_state=[need[i] if i in active else frozenset() for i in range(rt.n)])
    if meta["world_size"] == rt.world:
        rng = _decode_rng(meta["rng"][rt.rank])
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:  # another world: no per-rank stream to continue; a fresh one per rank and step
        torch.manual_seed(cfg.seed * 1009 + rt.rank + 7919 * (pos.global_step + 1))
    both = torch.tensor([load_s, read], dtype=torch.float64, device=rt.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    load_s = float(both[0].item())
    info = {**info, "seconds": info["seconds"] + load_s, "parts": {**info["parts"], "checkpoint": load_s},
            "bytes": {**info["bytes"], "checkpoint_read_max": int(both[1].item())},
            "from": {"world_size": meta["world_size"], "plan_id": meta["plan_id"], **meta["phase"]}}
    return pos, info
