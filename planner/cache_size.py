"""The AutoCache's host memory, one model for the planner and the runtime (torch-free).

The runtime (``executor/cache``) stores a frozen count's rows (one per sample: the prefix's output, in the dtype
the prefix outputs) in slabs of about ``DEFAULT_SLAB_BYTES``: a ``HEADER_BYTES`` header, one flag byte per row
rounded up to a page, and the rows rounded up to a page. The planner (``PhaseSearch.host_bytes_per_node``) prices
the same slabs from the profile's output bytes per sample, and ``ptplan run``'s ``cache_setup`` record sets the
runtime's numbers beside the plan's, both from these functions:

- ``rows_bytes``: every sample's rows at one frozen count;
- ``cache_bytes``: the RAM budget: rows at the phase's count plus, while an epoch refreshes rows cached at a smaller
  count into it (a slab at the old count goes only once all its rows are refreshed), the rows at that count;
- ``host_bytes``: ``cache_bytes`` plus the frozen weights the node's stage-0 ranks keep in host memory to fill it
  (``Phase.predicted.cache_host_bytes_per_node``), page-locked on a GPU (``PINNED_ROUNDING``).
"""
from __future__ import annotations

import math

__all__ = ["DEFAULT_SLAB_BYTES", "HEADER_BYTES", "MAX_SHARD_ROWS", "PAGE", "PINNED_ROUNDING", "cache_bytes",
           "host_bytes", "rows_bytes", "shard_rows", "slab_file_bytes"]

PAGE = 4096
HEADER_BYTES = PAGE
DEFAULT_SLAB_BYTES = 64 << 20
MAX_SHARD_ROWS = 16384
PINNED_ROUNDING = 2.0
"""The most host memory page-locked weights take per byte: a GPU rank keeps its frozen prefix page-locked
(``executor/runtime/stage.py: LayerStore.pin``), and torch's page-locked allocator rounds each tensor up to a power
of two (under twice its bytes; bert-base's weight tensors: 1.70 times)."""


def round_up(n: int, k: int = PAGE) -> int:
    return (n + k - 1) // k * k


def shard_rows(row_bytes: int, samples: int, cap: int | None = None) -> int:
    """Samples per slab: about ``DEFAULT_SLAB_BYTES`` of rows, fewer under a small budget ``cap`` (at least 16
    slabs fit in it, so a small budget still caches part of the data), at most ``samples``."""
    if row_bytes < 1 or samples < 1:
        raise ValueError(f"row_bytes and samples must be >= 1, got {row_bytes} and {samples}")
    rows = max(1, min(MAX_SHARD_ROWS, DEFAULT_SLAB_BYTES // row_bytes))
    if cap:
        rows = max(1, min(rows, cap // (16 * row_bytes)))
    return min(rows, samples)


def slab_file_bytes(rows: int, row_bytes: int) -> int:
    """One slab's file: header, a flag byte per row (page-rounded), the rows (page-rounded)."""
    return HEADER_BYTES + round_up(rows) + round_up(rows * row_bytes)


def rows_bytes(samples: int, row_bytes: int, cap: int | None = None, rows_per_slab: int | None = None) -> int:
    """Every sample's row at one frozen count, as slab files (``rows_per_slab`` None: ``shard_rows``)."""
    if samples < 1 or row_bytes < 1:
        return 0
    rows = rows_per_slab or shard_rows(row_bytes, samples, cap)
    full, rest = divmod(samples, rows)
    return full * slab_file_bytes(rows, row_bytes) + (slab_file_bytes(rest, row_bytes) if rest else 0)


def cache_bytes(samples: int, row_bytes: int, refresh_row_bytes: int = 0, cap: int | None = None) -> int:
    """The cache's RAM: every row at the phase's count, plus (``refresh_row_bytes`` > 0: an epoch refreshing rows
    cached at a smaller count) every row at that count, both in slabs sized for ``row_bytes``."""
    rows = shard_rows(row_bytes, samples, cap) if samples >= 1 and row_bytes >= 1 else 1
    return (rows_bytes(samples, row_bytes, rows_per_slab=rows)
            + (rows_bytes(samples, refresh_row_bytes, rows_per_slab=rows) if refresh_row_bytes else 0))


def host_bytes(samples: int, row_bytes: int, weight_bytes: float, stage0_ranks: int,
               refresh_row_bytes: int = 0, *, pinned: bool = False) -> int:
    """``cache_bytes`` plus the frozen prefix's weights (``weight_bytes``) each of the node's ``stage0_ranks``
    keeps in host memory to fill the cache (times ``PINNED_ROUNDING`` where ``pinned``: a GPU's ranks)."""
    weights = weight_bytes * (PINNED_ROUNDING if pinned else 1.0)
    return cache_bytes(samples, row_bytes, refresh_row_bytes) + int(math.ceil(stage0_ranks * weights))
