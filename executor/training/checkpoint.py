"""Checkpoint files: the full model, optimizer state by parameter name, position and RNG, bound to the plan;
written atomically, validated on load.

Global rank 0 gathers the model and writes ``<checkpoint dir>/checkpoint.pt`` on its own node. On a resume
(``--resume``, or a torchrun restart) every rank looks at its own ``checkpoint.pt`` and the ranks agree on
one source: the newest valid checkpoint any rank holds (``training``). Each rank builds only its layers of
the checkpoint's phase and fills them from the file mapped into memory (``torch.load(mmap=True)``), reading
only its own layers' tensors, when its own file is the source's (the same ``id``: a shared folder or the
same node); the source rank sends the others theirs.
So a job needs no shared file system: what matters is that rank 0's node kept its folder (a restart
may give rank 0 to another node under c10d; the source is still found wherever it is). With a shared
folder every rank sees the same file.

Contents (``torch.save`` of a dict; read back with ``weights_only=True``)::

    version, id (a random name per save; optional: older files lack it and are read by the source rank only),
    plan_id, plan (the identity the id hashes: profile fingerprint, phases, freeze steps, batch),
    run {samples, seed, shuffle, freeze, freeze_every}, model_name, optimizer, world_size,
    model        {parameter name: tensor}               (canonical names: layers.<i>.<...>)
    optim        {parameter name: {state key: tensor}}  (active parameters only)
    position     {epoch, step_in_epoch, cursor, global_step, frozen_blocks, decided_T, norm_sum, norm_count}
    rng          [per-rank torch RNG states]
    checksums    "zip-crc32" (optional: files written before it lack it and are read unchecked)

Integrity: ``torch.save`` writes a zip archive, one record per tensor storage plus the pickle, and stores each
record's CRC-32 in it (``save_checkpoint`` turns torch's CRC option on for its write and says so in
``checksums``): the checksums live inside the one file that is renamed into place, so the atomic write needs
no second file. ``verify_records`` recomputes them: the launcher's look before launch checks every record
(``load_checkpoint``'s default); in the workers the ranks that read the file split its records
(``resume.find_checkpoint``), so each record is checked once whatever the number of ranks. A record whose bytes
changed after the save (flipped bytes on disk, a bad copy) is one PtplanError naming the file and the record.

Cost, measured on this shared 2-core box (load average 1.8, the file in the page cache): 0.17-0.23 s to check a
524 MB checkpoint (125 float32 tensors of 1024x1024), about 3 GB/s -- small next to reading the file from a disk
at all, and split between the readers in the workers. Measured with::

    python -c "import time, torch; from ptplan.executor.training import checkpoint as c;
    torch.save({f'w{i}': torch.randn(1024, 1024) for i in range(125)}, '/tmp/big.pt');
    t = time.perf_counter(); c.verify_records('/tmp/big.pt', c.CHECKSUMS); print(time.perf_counter() - t)"

(streaming ``zlib.crc32`` over the same file: 0.15-0.19 s; ``hashlib.blake2b`` 0.58 s; ``sha256`` 0.33 s).

A checkpoint resumes only the run it came from: the same plan (``plan_id``), model, optimizer, world
size, data size, seed, order and freeze cadence; anything else is refused with what differs.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import zipfile
from typing import Any, Sequence

import torch

from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import Plan

VERSION = 2
NAME = "checkpoint.pt"
RUN_KEYS = ("samples", "seed", "shuffle", "freeze", "freeze_every")
"""Run settings a resume must keep (they give the position its meaning)."""
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "version": int, "plan_id": str, "plan": dict, "run": dict, "model_name": str, "optimizer": str,
    "world_size": int, "model": dict, "optim": dict, "position": dict, "rng": list}
_POSITION = ("epoch", "step_in_epoch", "cursor", "global_step", "frozen_blocks", "decided_T", "norm_sum",
             "norm_count")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""The errnos of a write that ran out of space."""
CHECKSUMS = "zip-crc32"
"""The ``checksums`` field of a checkpoint whose archive records carry their CRC-32 (``verify_records``)."""
FIX = "delete it (or restore a good copy) and start without --resume"


def checkpoint_path(folder: str | os.PathLike) -> str:
    return os.path.join(os.fspath(folder), NAME)


def plan_identity(plan: Plan) -> dict[str, Any]:
    """What a checkpoint's position depends on in the plan: the profile, every phase's shape and layout, the
    freeze steps and the batch."""
    tr = plan.inputs.training
    return {"profile": plan.inputs.profile.fingerprint,
            "phases": [[p.frozen_blocks, p.frozen_layers, p.K, p.D, p.M, p.micro_batch_size, p.schedule,
                        [list(r) for r in p.partition], [list(r) for r in p.ranks]] for p in plan.phases],
            "freeze_steps": list(plan.freeze_steps), "batch": tr.batch, "batch_policy": tr.batch_policy}


def plan_id(plan: Plan) -> str:
    """A short hash of ``plan_identity``: equal for a plan and its copy, different when any phase differs."""
    text = json.dumps(plan_identity(plan), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_checkpoint(folder: str | os.PathLike, payload: dict[str, Any]) -> str:
    """Write ``payload`` to ``folder/checkpoint.pt`` atomically (temp file, fsync, rename, fsync of the folder).

    The temp file is named after this process (``launch.owner_tag``); it is removed when the write fails
    (a full disk: PtplanError, the previous checkpoint stays), and temp files of processes that have
    ended (killed mid-write) are removed first.
    """
    from ptplan.executor.launch.launcher import owner_tag, sweep

    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise PtplanError(f"cannot create the checkpoint folder {folder}: {e.strerror}") from None
    sweep([os.fspath(folder)])
    path = checkpoint_path(folder)
    tmp = f"{path}.tmp.{owner_tag()}"
    crc = torch.serialization.get_crc32_options()
    try:
        torch.serialization.set_crc32_options(True)  # the records' CRC-32s ``verify_records`` checks (torch's default)
        with open(tmp, "wb") as f:
            torch.save({"version": VERSION, "checksums": CHECKSUMS, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(os.fspath(folder))
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        err = os_error(e)
        if err is not None:
            full = " (the disk is full)" if err.errno in DISK_FULL else ""
            raise PtplanError(f"cannot write the checkpoint {path}: {err.strerror or err}{full}; the temp file "
                              f"was removed and the previous checkpoint, if any, is kept. Free space or pass "
                              f"another --checkpoint-dir, then resume with --resume") from None
        raise
    finally:
        torch.serialization.set_crc32_options(crc)
    return path


def os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind ``e`` (torch's zip writer raises a RuntimeError while handling a failed write)."""
    for _ in range(6):
        if e is None or isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(folder: str | os.PathLike, *, mmap: bool = False, verify: bool = True) -> dict[str, Any]:
    """Read and check ``folder/checkpoint.pt``: one PtplanError for a missing, empty, truncated, garbage or
    older-version file, or one whose fields are not what ``save_checkpoint`` writes.

    ``mmap``: map the tensors instead of reading them (cheap: to look at the position only). ``verify``: also
    check every record's CRC-32 (``verify_records``; a file without ``checksums`` is not checked): the
    launcher's look before launch. The workers pass False and split the records between the ranks that read
    the file (``resume.find_checkpoint``).
    """
    path = checkpoint_path(folder)
    if not os.path.exists(path):
        raise PtplanError(f"no checkpoint at {path}; run without --resume to start from scratch")
    fix = FIX
    size = os.path.getsize(path)
    if size == 0:
        raise PtplanError(f"checkpoint {path} is empty (0 bytes): a write that never finished; {fix}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch/pickle/zip errors for a damaged file
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise PtplanError(f"checkpoint {path} ({size} bytes) cannot be read: it is truncated, damaged or not "
                          f"a ptplan checkpoint ({type(e).__name__}: {reason}); {fix}") from None
    if not isinstance(data, dict):
        raise PtplanError(f"checkpoint {path} holds a {type(data).__name__}, not a ptplan checkpoint; {fix}")
    if data.get("version") != VERSION:
        raise PtplanError(f"checkpoint {path} is of version {data.get('version')!r}, this ptplan reads version "
                          f"{VERSION}; resume with the ptplan that wrote it, or {fix}")
    for key, kind in _FIELDS.items():
        if not isinstance(data.get(key), kind):
            raise PtplanError(f"checkpoint {path}: field {key!r} is missing or not a {getattr(kind, '__name__', kind)}; "
                              f"{fix}")
    missing = [k for k in _POSITION if k not in data["position"]]
    if missing or len(data["rng"]) != data["world_size"]:
        raise PtplanError(f"checkpoint {path}: its position lacks {missing} or its RNG states do not match its "
                          f"world size; {fix}")
    if verify:
        verify_records(path, data.get("checksums"))
    return data


def verify_records(path: str, checksums: Any, share: tuple[int, int] = (0, 1)) -> None:
    """Check the CRC-32 of the archive records of checkpoint ``path`` (``checksums``: its field of that name) that
    are this caller's ``share`` = (k, n): records k, k+n, k+2n, ... in the archive's order (n ranks together check
    each record once). One PtplanError naming the file and the first damaged record; nothing is checked for a
    checkpoint written before checksums (no ``checksums`` field)."""
    if checksums != CHECKSUMS:
        return
    k, n = share
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist()[k::n]:
                try:
                    with z.open(info) as f:
                        while f.read(1 << 20):
                            pass
                except (zipfile.BadZipFile, EOFError, ValueError) as e:  # "Bad CRC-32 for file ...", a torn record
                    end = info.header_offset + info.compress_size
                    raise PtplanError(f"checkpoint {path} is damaged: its record {info.filename} (about bytes "
                                      f"{info.header_offset}-{end}) does not match the CRC-32 written with it "
                                      f"({' '.join(str(e).split())[:120] or type(e).__name__}); its bytes changed "
                                      f"after the save; {FIX}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise PtplanError(f"checkpoint {path} cannot be checked: {type(e).__name__}: {e}; {FIX}") from None


def mismatches(data: dict[str, Any], *, plan: Plan, model_name: str, optimizer: str, world_size: int,
               run: dict[str, Any]) -> list[str]:
    """What keeps checkpoint ``data`` from resuming this run (empty: it can)."""
    out = []
    if data["plan_id"] != plan_id(plan):
        out.append(f"it was written for another plan ({_plan_difference(data['plan'], plan_identity(plan))})")
    if data["model_name"] != model_name:
        out.append(f"it is for model {data['model_name']}, not {model_name}")
    if data["optimizer"] != optimizer:
        out.append(f"it holds {data['optimizer']} state, not {optimizer}")
    if data["world_size"] != world_size:
        out.append(f"it was written by {data['world_size']} processes, not {world_size}")
    for k in RUN_KEYS:
        if data["run"].get(k) != run.get(k):
            out.append(f"its {k} is {data['run'].get(k)!r}, this run's is {run.get(k)!r}")
    return out


def _plan_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    if old.get("profile") != new["profile"]:
        return f"profile fingerprint {old.get('profile')} there, {new['profile']} here"
    po, pn = old.get("phases") or [], new["phases"]
    for i, (a, b) in enumerate(zip(po, pn)):
        if a != b:
            return (f"phase {i} is frozen={a[0]} K={a[2]} D={a[3]} M={a[4]} b={a[5]} there, frozen={b[0]} K={b[2]} "
                    f"D={b[3]} M={b[4]} b={b[5]} here" if a[:6] != b[:6] else f"phase {i}'s partition or layout differs")
    if len(po) != len(pn):
        return f"{len(po)} phases there, {len(pn)} here"
    for k in ("freeze_steps", "batch", "batch_policy"):
        if old.get(k) != new[k]:
            return f"{k} {old.get(k)!r} there, {new[k]!r} here"
    return "the plans differ"


def check_state(data: dict[str, Any], shapes: dict[str, Sequence[int]], state_keys: tuple[str, ...]) -> None:
    """The checkpoint's tensors fit the model (``shapes``: every parameter's full shape by name, whether or
    not this rank holds it): every parameter present with its shape, optimizer state only for known
    parameters with the optimizer's keys and shapes. Reads shapes only (a mapped checkpoint stays unread)."""
    model = data["model"]
    missing = sorted(set(shapes) - set(model))
    extra = sorted(set(model) - set(shapes))
    bad = [n for n in shapes if n in model and (not isinstance(model[n], torch.Tensor)
                                                 or tuple(model[n].shape) != tuple(shapes[n]))]
    if missing or extra or bad:
        raise PtplanError(f"the checkpoint's weights do not fit the model: missing {missing[:3]}, unknown "
                          f"{extra[:3]}, other shapes {bad[:3]}; resume with the model it was written for")
    def fits(name: str, key: str, v: Any) -> bool:
        if not isinstance(v, torch.Tensor):
            return False
        return v.numel() == 1 if key == "step" else tuple(v.shape) == tuple(shapes[name])

    for name, st in data["optim"].items():
        if name not in shapes or not isinstance(st, dict) or sorted(st) != sorted(state_keys) or not all(
                fits(name, k, v) for k, v in st.items()):
            raise PtplanError(f"the checkpoint's optimizer state for {name!r} does not fit the model and optimizer "
                              f"(keys {sorted(st) if isinstance(st, dict) else st!r}, expected {list(state_keys)})")
