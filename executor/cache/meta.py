"""The AutoCache's description on disk (``meta.json``): made by a node's creating process, read by the others."""
from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any

from ptplan.planner.cache_size import DEFAULT_SLAB_BYTES, MAX_SHARD_ROWS, shard_rows
from ptplan.planner.errors import PtplanError

from ptplan.executor.cache.store import DTYPES

SCHEMA = "ptplan.cache/1"


def create_meta(root: str, cache_dir: str, job_id: str, given: dict[str, Any]) -> dict[str, Any]:
    """Check the creator's settings, make the directories (removing an earlier run's) and write ``meta.json``."""
    missing = [k for k in ("sample_shape", "dtype", "num_samples", "budget_bytes") if given[k] is None]
    if missing:
        raise PtplanError(f"creating an activation cache needs {', '.join(missing)}")
    shape, n, budget = given["sample_shape"], given["num_samples"], given["budget_bytes"]
    if not shape or any(s < 1 for s in shape):
        raise PtplanError(f"sample_shape must be positive sizes, got {shape}")
    if n < 1:
        raise PtplanError(f"num_samples must be >= 1, got {n}")
    if budget < 0:
        raise PtplanError(f"budget_bytes must be >= 0, got {budget}")
    row = DTYPES[given["dtype"]].itemsize
    for s in shape:
        row *= s
    rows = given["shard_rows"]
    if rows is None:
        rows = shard_rows(row, n)
    elif not 1 <= rows <= MAX_SHARD_ROWS:
        raise PtplanError(f"shard_rows must be in 1..{MAX_SHARD_ROWS}, got {rows}")
    meta = dict(schema=SCHEMA, job_id=job_id, sample_shape=shape, dtype=given["dtype"], num_samples=n,
                shard_rows=min(rows, n), budget_bytes=int(budget), spill_dir=given["spill_dir"])
    if not os.path.isdir(root):
        raise PtplanError(f"cache root {root} is not a directory; create it or pass another root")
    for d in (cache_dir, meta["spill_dir"]):
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)  # a previous run of this job: its rows may be stale
            os.makedirs(d, mode=0o700)
    tmp = os.path.join(cache_dir, f".meta-{uuid.uuid4().hex}")
    with open(tmp, "w") as fh:
        json.dump(meta, fh)
    os.rename(tmp, os.path.join(cache_dir, "meta.json"))
    return meta


def attach_meta(cache_dir: str, given: dict[str, Any]) -> dict[str, Any]:
    """Read the creator's ``meta.json``; every setting given (not None) must agree with it."""
    path = os.path.join(cache_dir, "meta.json")
    try:
        with open(path) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise PtplanError(f"no activation cache at {cache_dir}: the node's creating process "
                          f"(ActivationCache(..., create=True)) must make it before others attach "
                          f"(add a barrier), with the same root and job id") from None
    if meta.get("schema") != SCHEMA:
        raise PtplanError(f"{path}: schema {meta.get('schema')!r}, expected {SCHEMA!r}; remove {cache_dir}")
    for k, v in given.items():
        if v is not None and meta[k] != v:
            raise PtplanError(f"activation cache {cache_dir} has {k}={meta[k]!r} but this process asked for "
                              f"{v!r}; pass the same settings on every process (or none when attaching)")
    return meta
