"""AutoCache storage: memory-mapped slab files of fixed-size per-sample rows, shared by a node's processes.

A **slab** holds the frozen prefix's output for one contiguous range ("shard") of sample ids at one
frozen-layer count. File layout (offsets in bytes)::

    [0, 4096)            header: magic b"PTPLSLB1", u32 length, JSON (frozen_layers, shard, first,
                         rows, row_bytes, shape, dtype, tag)
    [4096, DATA)         validity flags: one byte per row (1 = row written), padded to 4096
    [DATA, DATA + R*rb)  R rows of row_bytes each

Concurrency protocol (no locks on the hot path):

- A slab is created whole: a temporary file is ``posix_fallocate``-d to full size (so a full tmpfs
  fails here with ENOSPC instead of a SIGBUS later), its header written, then renamed into place
  under an exclusive ``flock`` on the store's lock file. Whoever opens the final name sees a
  complete header and all flags zero.
- A writer writes the row data with ``os.pwritev`` (into the page cache that every process's mmap of the
  file shares), **then** sets the row's flag with ``os.pwrite``. A reader reads the flags with ``os.pread``,
  **then** copies the rows through its mmap. The system calls order the data before the flag on both sides,
  so a reader never sees a flag whose row is not yet fully written (no torn rows). A writer that dies mid-row leaves the flag at 0.
- Rows are written once. Two processes that write the same row at once (only possible if the
  caller lets two ranks process one sample) each write a full, valid computation of it.
- Removing a slab is ``unlink``: processes that still map it keep reading valid data; each process
  notices the file is gone (or replaced: different inode) on its next access and unmaps it.

Placement: slabs go to ``ram_dir`` (tmpfs, e.g. /dev/shm) while the slabs there total at most
``budget_bytes``, otherwise to ``spill_dir`` (disk), otherwise nowhere (the rows are not cached).
"""
from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ptplan.planner.cache_size import HEADER_BYTES, round_up as _round_up, slab_file_bytes
from ptplan.planner.errors import PtplanError

MAGIC = b"PTPLSLB1"
_NAME = re.compile(r"^f(\d{4})-s(\d{6})\.slab$")
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                                  "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (one of DTYPES)."""
    for k, v in DTYPES.items():
        if v == dtype:
            return k
    raise PtplanError(f"the activation cache stores {', '.join(DTYPES)} tensors, not {dtype}")


def slab_name(frozen_layers: int, shard: int) -> str:
    return f"f{frozen_layers:04d}-s{shard:06d}.slab"


@dataclass(frozen=True)
class SlabInfo:
    """What a slab holds (its header)."""

    frozen_layers: int
    shard: int
    first: int
    """Sample id of row 0."""
    rows: int
    shape: tuple[int, ...]
    """Per-sample tensor shape."""
    dtype: str
    tag: str
    """Fingerprint of the prefix weights that produced the rows."""

    @property
    def row_bytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * DTYPES[self.dtype].itemsize

    @property
    def data_offset(self) -> int:
        return HEADER_BYTES + _round_up(self.rows)

    @property
    def file_bytes(self) -> int:
        """``cache_size.slab_file_bytes``: what the planner prices a slab at."""
        return slab_file_bytes(self.rows, self.row_bytes)

    def header(self) -> bytes:
        body = json.dumps({"frozen_layers": self.frozen_layers, "shard": self.shard, "first": self.first,
                           "rows": self.rows, "shape": list(self.shape), "dtype": self.dtype,
                           "tag": self.tag}).encode()
        out = MAGIC + len(body).to_bytes(4, "little") + body
        if len(out) > HEADER_BYTES:
            raise PtplanError(f"slab header of {len(out)} bytes does not fit in {HEADER_BYTES}; use a shorter tag")
        return out


def _read_header(fd: int, path: str) -> SlabInfo:
    raw = os.pread(fd, HEADER_BYTES, 0)
    if raw[:8] != MAGIC:
        raise PtplanError(f"{path} is not a ptplan cache slab (bad magic); remove the cache directory")
    n = int.from_bytes(raw[8:12], "little")
    d = json.loads(raw[12:12 + n])
    return SlabInfo(frozen_layers=d["frozen_layers"], shard=d["shard"], first=d["first"], rows=d["rows"],
                    shape=tuple(d["shape"]), dtype=d["dtype"], tag=d["tag"])


class Slab:
    """One open slab file: its mmap, a tensor view of its rows, and flag I/O through the descriptor."""

    def __init__(self, path: str, fd: int, info: SlabInfo, tier: str) -> None:
        self.path, self.fd, self.info, self.tier = path, fd, info, tier
        self.ino = os.fstat(fd).st_ino
        self.mm = mmap.mmap(fd, info.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # Rows as bytes: copies go through numpy (single-threaded memcpy per row, any dtype), which
        # stays fast on a loaded machine where torch's OpenMP index kernels stall.
        self.rows = np.frombuffer(self.mm, dtype=np.uint8, count=info.rows * info.row_bytes,
                                  offset=info.data_offset).reshape(info.rows, info.row_bytes)

    @classmethod
    def open(cls, path: str, tier: str) -> "Slab":
        fd = os.open(path, os.O_RDWR)
        try:
            return cls(path, fd, _read_header(fd, path), tier)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def create(path: str, info: SlabInfo) -> None:
        """Write a complete, empty slab at ``path`` (atomically: temporary file, then rename).

        Raises OSError(ENOSPC) when the file system cannot hold it; leaves nothing behind then.
        """
        tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, info.file_bytes)
            os.pwrite(fd, info.header(), 0)
            os.rename(tmp, path)
        except BaseException:
            with _ignore_missing():
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)

    # ---- flags -------------------------------------------------------------------------------
    def valid(self, local: np.ndarray | None = None) -> np.ndarray:
        """Bool flags of rows ``local`` (int64 indices, any order; all rows if None), from one pread."""
        if local is None:
            lo, hi = 0, self.info.rows
        else:
            if local.size == 0:
                return np.zeros(0, dtype=bool)
            lo, hi = int(local.min()), int(local.max()) + 1
        flags = np.frombuffer(os.pread(self.fd, hi - lo, HEADER_BYTES + lo), dtype=np.uint8).astype(bool)
        return flags if local is None else flags[local - lo]

    def _set_valid(self, local: np.ndarray) -> None:
        """Set the flags of rows ``local``: one pwrite per run of consecutive rows (never a
        read-modify-write, so flags other processes set at the same time are never cleared)."""
        for a, b, row in self._runs(np.unique(local)):
            os.pwrite(self.fd, b"\x01" * (b - a), HEADER_BYTES + row)

    # ---- rows --------------------------------------------------------------------------------
    def read(self, local: np.ndarray) -> np.ndarray:
        """A copy of rows ``local`` as bytes ``[n, row_bytes]``; call only after ``valid`` said they are written.
        Through the map (a descriptor's ``preadv`` measured slower: 1.33 ms against 0.83-0.94 ms for 6.3 MB)."""
        return self.rows.take(local, axis=0)

    @staticmethod
    def _runs(local: np.ndarray) -> list[tuple[int, int, int]]:
        """(a, b, row) per run of ``local`` (ascending): positions a..b-1 hold the consecutive rows row, row + 1, ..."""
        breaks = (np.nonzero(np.diff(local) != 1)[0] + 1).tolist()
        return [(a, b, int(local[a])) for a, b in zip([0, *breaks], [*breaks, local.size])]

    def _write_run(self, data: np.ndarray, row: int) -> None:
        """Write ``data`` (whole rows, contiguous) at the slab's row ``row``, resuming where ``pwritev`` wrote less."""
        view = data.data.cast("B")
        off, done = self.info.data_offset + row * self.info.row_bytes, 0
        while done < view.nbytes:
            n = os.pwritev(self.fd, [view[done:]], off + done)
            if n <= 0:
                raise OSError(f"cache slab {self.path}: pwritev wrote nothing at offset {off + done}")
            done += n

    def write(self, local: np.ndarray, data: np.ndarray) -> None:
        """Write rows (bytes ``[n, row_bytes]``), then publish their flags (data strictly before flags).

        The rows go in through the descriptor, one ``pwritev`` per run of consecutive rows, not through the map:
        storing into a fresh MAP_SHARED page faults it in first, one fault per 4 KiB page, and those faults were
        most of a fill step's cache write (6.3 MB of rows: 3.6-4.2 ms through the map, 1.6-1.9 ms so;
        ``bench/cache_write.py`` on the CPU box). Other processes' maps see the same page-cache pages."""
        if data.shape != (local.size, self.info.row_bytes) or data.dtype != np.uint8:
            raise ValueError(f"slab {self.path}: rows must be uint8 [{local.size}, {self.info.row_bytes}], got "
                             f"{data.dtype} {list(data.shape)}")
        if local.size == 0:
            return
        order = np.argsort(local, kind="stable")
        if not np.array_equal(order, np.arange(order.size)):
            local, data = local[order], data[order]
        data = np.ascontiguousarray(data)
        for a, b, row in self._runs(local):
            self._write_run(data[a:b], row)
        self._set_valid(local)

    def close(self) -> None:
        self.rows = np.empty((0, 0), dtype=np.uint8)  # release the buffer export before closing the map
        try:
            self.mm.close()
        finally:
            os.close(self.fd)


class _ignore_missing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, et, ev, tb) -> bool:
        return et is not None and issubclass(et, FileNotFoundError)


class SlabStore:
    """The slab files of one cache: RAM-tier directory, optional spill directory, budget, lock."""

    def __init__(self, ram_dir: str, spill_dir: str | None, budget_bytes: int) -> None:
        self.ram_dir, self.spill_dir, self.budget_bytes = ram_dir, spill_dir, int(budget_bytes)
        self._open: dict[tuple[int, int], Slab] = {}
        self.full: dict[str, int] = {}
        """Per directory: slabs this process could not create there because its file system was full."""

    # ---- naming and listing ------------------------------------------------------------------
    def _dirs(self) -> list[tuple[str, str]]:
        out = [("ram", self.ram_dir)]
        if self.spill_dir is not None:
            out.append(("disk", self.spill_dir))
        return out

    def listing(self) -> dict[tuple[int, int], tuple[str, str]]:
        """Every slab present: (frozen_layers, shard) -> (tier, path)."""
        out: dict[tuple[int, int], tuple[str, str]] = {}
        for tier, d in self._dirs():
            try:
                names = os.listdir(d)
            except FileNotFoundError:
                continue
            for n in names:
                m = _NAME.match(n)
                if m:
                    out.setdefault((int(m[1]), int(m[2])), (tier, os.path.join(d, n)))
        return out

    def usage(self) -> dict[str, int]:
        """Bytes of slab files per tier (allocated: slabs are fallocated whole) and slab counts."""
        out = {"ram_bytes": 0, "disk_bytes": 0, "ram_slabs": 0, "disk_slabs": 0}
        for (_, _), (tier, path) in self.listing().items():
            with _ignore_missing():
                out[f"{tier}_bytes"] += os.stat(path).st_blocks * 512
                out[f"{tier}_slabs"] += 1
        return out

    def _ram_reserved(self) -> int:
        total = 0
        for n in os.listdir(self.ram_dir):
            if _NAME.match(n):
                with _ignore_missing():
                    total += os.stat(os.path.join(self.ram_dir, n)).st_size
        return total

    # ---- opening -----------------------------------------------------------------------------
    def get(self, frozen_layers: int, shard: int, where: tuple[str, str] | None = None) -> Slab | None:
        """The open slab for (frozen_layers, shard), or None if no such file exists (now).

        ``where``: (tier, path) from a fresh ``listing``, to skip looking the file up.
        """
        key = (frozen_layers, shard)
        slab = self._open.get(key)
        if slab is not None:
            try:
                if os.stat(slab.path).st_ino == slab.ino:
                    return slab
            except FileNotFoundError:
                pass
            self._drop(key)  # removed or replaced by another process
        if where is None:
            where = self._locate(frozen_layers, shard)
            if where is None:
                return None
        try:
            slab = Slab.open(where[1], where[0])
        except FileNotFoundError:
            return None
        self._open[key] = slab
        return slab

    def _locate(self, frozen_layers: int, shard: int) -> tuple[str, str] | None:
        name = slab_name(frozen_layers, shard)
        for tier, d in self._dirs():
            p = os.path.join(d, name)
            if os.path.exists(p):
                return tier, p
        return None

    def get_or_create(self, info: SlabInfo) -> Slab | None:
        """Open the slab, creating it (RAM if the budget allows, else disk) if absent; None: no room."""
        slab = self.get(info.frozen_layers, info.shard)
        if slab is not None:
            return slab
        with self.locked():
            if self._locate(info.frozen_layers, info.shard) is None:
                name = slab_name(info.frozen_layers, info.shard)
                if not self._create_in(self.ram_dir, name, info, check_budget=True):
                    if self.spill_dir is None or not self._create_in(self.spill_dir, name, info, check_budget=False):
                        return None
        return self.get(info.frozen_layers, info.shard)

    def _create_in(self, d: str, name: str, info: SlabInfo, *, check_budget: bool) -> bool:
        if check_budget and self._ram_reserved() + info.file_bytes > self.budget_bytes:
            return False
        try:
            Slab.create(os.path.join(d, name), info)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                if d not in self.full:
                    print(f"ptplan: warning: the activation cache's folder {d} is full ({e.strerror}): rows that "
                          f"do not fit are recomputed each time (same results, slower); give it room, lower "
                          f"--cache-budget, or pass --cache-spill-dir", flush=True)
                self.full[d] = self.full.get(d, 0) + 1
                return False
            raise
        return True

    def locked(self):
        """Exclusive node-wide lock (flock on ``ram_dir/.lock``) for creating, moving and removing slabs."""
        return _FileLock(os.path.join(self.ram_dir, ".lock"))

    # ---- removing and moving -----------------------------------------------------------------
    def _drop(self, key: tuple[int, int]) -> None:
        slab = self._open.pop(key, None)
        if slab is not None:
            slab.close()

    def remove(self, keys: list[tuple[int, int]]) -> tuple[int, int]:
        """Unlink these slabs (wherever they are); returns (slabs, bytes) that this call unlinked. The
        processes of a node may evict the same slab at once (each saw it superseded): only the one whose
        unlink succeeds counts it."""
        removed = freed = 0
        listing = self.listing()
        for key in keys:
            self._drop(key)
            if key in listing:
                path = listing[key][1]
                with _ignore_missing():
                    size = os.stat(path).st_blocks * 512
                    os.unlink(path)
                    removed, freed = removed + 1, freed + size
        return removed, freed

    def promote(self, keys: list[tuple[int, int]]) -> int:
        """Move complete (all rows valid) spilled slabs among ``keys`` into RAM while the budget allows.

        Complete slabs are never written again, so a copy is exact; readers that still map the
        spilled file keep reading it until they notice the move. Returns the number moved.
        """
        if self.spill_dir is None:
            return 0
        moved = 0
        with self.locked():
            listing = self.listing()
            for key in keys:
                tier_path = listing.get(key)
                if tier_path is None or tier_path[0] != "disk":
                    continue
                slab = self.get(*key, where=tier_path)
                if slab is None or not bool(slab.valid().all()):
                    continue
                size = os.stat(tier_path[1]).st_size
                if self._ram_reserved() + size > self.budget_bytes:
                    break
                dst = os.path.join(self.ram_dir, slab_name(*key))
                tmp = os.path.join(self.ram_dir, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
                try:
                    with open(tmp, "wb") as out:
                        os.posix_fallocate(out.fileno(), 0, size)
                        out.write(slab.mm[:size])
                    os.rename(tmp, dst)
                except OSError as e:
                    with _ignore_missing():
                        os.unlink(tmp)
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):
                        break
                    raise
                self._drop(key)
                with _ignore_missing():
                    os.unlink(tier_path[1])
                moved += 1
        return moved

    def close(self) -> None:
        for key in list(self._open):
            self._drop(key)

    def destroy(self) -> None:
        """Close every slab and remove both directories with everything in them."""
        self.close()
        for _, d in self._dirs():
            shutil.rmtree(d, ignore_errors=True)


class _FileLock:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> "_FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)


def tree_bytes(path: str | os.PathLike) -> int:
    """Allocated bytes of every file under ``path`` (0 if it does not exist)."""
    p = Path(path)
    if not p.exists():
        return 0
    return sum(f.stat().st_blocks * 512 for f in p.rglob("*") if f.is_file())
