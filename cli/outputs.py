"""The one output-path check every command runs before any work: each output is a non-empty file name, not a
folder, not an input nor another output, in a folder that exists (or can be made) and is writable."""
from __future__ import annotations

import os
import tempfile
from typing import Sequence

from ptplan.planner.errors import PtplanError


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (after links and relative parts), existing or not."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def nearest_existing(folder: str) -> str:
    """``folder`` itself when it exists, else its nearest existing ancestor."""
    d = os.path.abspath(folder or ".")
    while not os.path.exists(d):
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return d


def folder_problem(folder: str) -> str | None:
    """Why no file can be created in the existing path ``folder`` (None: one can). Tries it: a probe file is
    made and removed, so a read-only file system or a folder without write permission is seen as such (root
    passes ``os.access`` on both)."""
    if not os.path.isdir(folder):
        return f"{folder} is a file, not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".ptplan-probe-", dir=folder)
    except OSError as e:
        return f"the folder {folder} is not writable ({e.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


def _check_one(what: str, out: str, make_folders: bool) -> None:
    if out == "" or not out.strip():
        raise PtplanError(f"{what} is empty; give a file name")
    if os.path.isdir(out):
        raise PtplanError(f"{what} {out} is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(out))
    base = nearest_existing(folder)
    if base != folder and not make_folders:
        raise PtplanError(f"output folder does not exist: {os.path.dirname(out)} (for {what} {out}); create it or "
                          f"write elsewhere")
    why = folder_problem(base)
    if why is not None:
        made = "" if base == folder else f" (the folder {folder} would be made in {base})"
        raise PtplanError(f"{what} {out}: {why}{made}; write elsewhere")
    if os.path.exists(out) and (not os.path.isfile(out) or not os.access(out, os.W_OK)):
        raise PtplanError(f"{what} {out} exists and is not a writable file; remove it or write elsewhere")


def check_outputs(inputs: Sequence[tuple[str, str | None]], outputs: Sequence[tuple[str, str | None]], *,
                  make_folders: bool = False) -> None:
    """Every command's output guard, called before anything is read or written: no output is empty, one of the
    inputs or another output, or an existing folder; each one's folder exists (``make_folders``: or can be made
    under its nearest existing ancestor) and a file can be created there. ``inputs``/``outputs``: (what, path)
    pairs, e.g. ("plan", "plan.json") and ("--out", "report.html"); None paths are skipped. Raises PtplanError
    with the fix."""
    seen: list[tuple[str, str]] = []
    for what, out in outputs:
        if out is None:
            continue
        out = os.fspath(out)
        if out.strip():
            for name, src in inputs:
                if src is not None and same_file(out, os.fspath(src)):
                    raise PtplanError(f"{what} {out} is the {name} itself: it is also an input, and writing there "
                                      f"would destroy the {name}. Give {what} another file name")
            for other, path in seen:
                if same_file(out, path):
                    raise PtplanError(f"{other} and {what} are the same file ({out}); give them different names")
        _check_one(what, out, make_folders)
        seen.append((what, out))


def make_parent_folders(*paths: str | None) -> None:
    """Create the folders of outputs that ``check_outputs(..., make_folders=True)`` accepted."""
    for p in paths:
        if p is None:
            continue
        folder = os.path.dirname(os.path.abspath(p))
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise PtplanError(f"cannot make the folder {folder} for {p}: {e.strerror}; write elsewhere") from None
