"""A process's peak resident memory over a stretch of code (a checkpoint save), sampled from ``/proc/self/statm``.

``PeakRss`` samples the resident set size from a daemon thread every ``interval_s`` while its ``with`` block runs
and reports the peak's growth over the size at entry (``growth``: bytes). Linux only: elsewhere ``growth`` is
None. Sampling misses a peak shorter than the interval; a save's staging buffers live for the write's
duration (milliseconds to seconds), far longer than the default 1 ms."""
from __future__ import annotations

import os
import threading
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int | None:
    """This process's resident set size now (None where /proc is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class PeakRss:
    """``with PeakRss() as m: ...`` then ``m.growth``: the largest resident size seen minus the size at entry."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.start: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = rss_bytes()
            if now is not None and self.peak is not None and now > self.peak:
                self.peak = now
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRss:
        self.start = self.peak = rss_bytes()
        if self.start is not None:
            self._thread = threading.Thread(target=self._sample, name="ptplan-peak-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        now = rss_bytes()
        if now is not None and self.peak is not None:
            self.peak = max(self.peak, now)

    @property
    def growth(self) -> int | None:
        """Peak minus the size at entry, in bytes (None without /proc)."""
        if self.start is None or self.peak is None:
            return None
        return max(self.peak - self.start, 0)


def trim() -> None:
    """Give the allocator's free pages back to the system (glibc ``malloc_trim(0)``; nothing elsewhere), so a
    ``PeakRss`` entered next counts memory a stretch allocates even where earlier frees left pages resident
    (freed layers of an earlier phase would otherwise be reused unseen)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        return
