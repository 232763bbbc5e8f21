"""Small helpers to validate JSON records field by field and write files atomically."""
from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, TypeAlias

from .errors import PtplanError, SchemaError


# The accessors below are named after the JSON types they return (``f.str("name")``), which shadows
# the builtins inside the class body; annotations use these aliases instead.
_Str: TypeAlias = str
_Int: TypeAlias = int
_Float: TypeAlias = float
_List: TypeAlias = list
_Bool: TypeAlias = bool


class Fields:
    """Typed access to one JSON object; every failure names the field path.

    ``Fields(obj, "plan", "phases[2]")`` then ``f.int("K", min=1)`` raises
    ``SchemaError("plan", "phases[2].K", ...)`` if K is missing, not an int, or < 1.
    """

    def __init__(self, obj: Any, what: _Str, path: _Str = "", allowed: Iterable[_Str] | None = None
                 ) -> None:
        self.what, self.path = what, path
        if not isinstance(obj, dict):
            raise SchemaError(what, path or "<root>", f"expected an object, got {type(obj).__name__}")
        self.obj = obj
        if allowed is not None:
            unknown = sorted(set(obj) - set(allowed))
            if unknown:
                raise SchemaError(what, self._p(unknown[0]), "unknown key",
                                  f"allowed keys: {', '.join(sorted(allowed))}")

    def _p(self, key: _Str) -> _Str:
        key = key if key.strip() else repr(key)  # an empty key is named as such
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: _Str, default: Any = ...) -> Any:
        if key not in self.obj:
            if default is ...:
                raise SchemaError(self.what, self._p(key), "missing")
            return default
        return self.obj[key]

    def raw(self, key: _Str, default: Any = ...) -> Any:
        return self._get(key, default)

    def str(self, key: _Str, default: Any = ..., choices: Iterable[_Str] | None = None) -> _Str:
        v = self._get(key, default)
        if v is default and default is not ...:
            return v
        if not isinstance(v, str):
            raise SchemaError(self.what, self._p(key), f"expected a string, got {v!r}")
        if choices is not None and v not in set(choices):
            raise SchemaError(self.what, self._p(key), f"{v!r} is not one of {sorted(choices)}")
        return v

    def int(self, key: _Str, default: Any = ..., min: _Int | None = None, max: _Int | None = None
            ) -> _Int:
        v = self._get(key, default)
        if v is default and default is not ...:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise SchemaError(self.what, self._p(key), f"expected an integer, got {v!r}")
        if min is not None and v < min:
            raise SchemaError(self.what, self._p(key), f"{v} is below the minimum {min}")
        if max is not None and v > max:
            raise SchemaError(self.what, self._p(key), f"{v:,} is above the maximum {max:,}")
        return v

    def float(self, key: _Str, default: Any = ..., min: _Float | None = None, max: _Float | None = None
              ) -> _Float:
        v = self._get(key, default)
        if v is default and default is not ...:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SchemaError(self.what, self._p(key), f"expected a finite number, got {v!r}")
        if min is not None and v < min:
            raise SchemaError(self.what, self._p(key), f"{v} is below the minimum {min}")
        if max is not None and v > max:
            raise SchemaError(self.what, self._p(key), f"{v} is above the maximum {max}")
        return float(v)

    def bool(self, key: _Str, default: Any = ...) -> _Bool:
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise SchemaError(self.what, self._p(key), f"expected true/false, got {v!r}")
        return v

    def list(self, key: _Str, default: Any = ..., length: _Int | None = None) -> _List:
        v = self._get(key, default)
        if v is default and default is not ...:
            return v
        if not isinstance(v, list):
            raise SchemaError(self.what, self._p(key), f"expected a list, got {type(v).__name__}")
        if length is not None and len(v) != length:
            raise SchemaError(self.what, self._p(key), f"expected {length} entries, got {len(v)}")
        return v

    def floats(self, key: _Str, length: _Int | None = None, min: _Float | None = 0.0,
               max: _Float | None = None) -> _List[_Float]:
        out = []
        for i, x in enumerate(self.list(key, length=length)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise SchemaError(self.what, f"{self._p(key)}[{i}]", f"expected a finite number, got {x!r}")
            if min is not None and x < min:
                raise SchemaError(self.what, f"{self._p(key)}[{i}]", f"{x} is below the minimum {min}")
            if max is not None and x > max:
                raise SchemaError(self.what, f"{self._p(key)}[{i}]", f"{x} is above the maximum {max:g}")
            out.append(float(x))
        return out

    def ints(self, key: _Str, length: _Int | None = None, min: _Int | None = None,
             max: _Int | None = None) -> _List[_Int]:
        out = []
        for i, x in enumerate(self.list(key, length=length)):
            if isinstance(x, bool) or not isinstance(x, int):
                raise SchemaError(self.what, f"{self._p(key)}[{i}]", f"expected an integer, got {x!r}")
            if min is not None and x < min:
                raise SchemaError(self.what, f"{self._p(key)}[{i}]", f"{x} is below the minimum {min}")
            if max is not None and x > max:
                raise SchemaError(self.what, f"{self._p(key)}[{i}]", f"{x} is above the maximum {max:,}")
            out.append(x)
        return out

    def obj_(self, key: _Str, allowed: Iterable[_Str] | None = None, default: Any = ...) -> "Fields":
        v = self._get(key, default)
        return Fields(v, self.what, self._p(key), allowed)

    def objs(self, key: _Str) -> _List["Fields"]:
        return [Fields(x, self.what, f"{self._p(key)}[{i}]") for i, x in enumerate(self.list(key))]


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Read a JSON file (UTF-8, as ``write_json`` writes), turning I/O, encoding and syntax errors into one clear
    PtplanError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PtplanError(f"{what} file {p} is not a JSON text file: byte {e.start} (0x{e.object[e.start]:02x}) is "
                          f"not UTF-8; give the {what} file ptplan wrote") from None
    except FileNotFoundError:
        raise PtplanError(f"{what} file not found: {p}") from None
    except OSError as e:
        raise PtplanError(f"cannot read {what} file {p}: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise PtplanError(f"{what} file {p} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to path via a temporary file in the same folder, so no half-written file remains. Every
    failure to write (no folder, a folder as the path, a read-only folder, a full disk) is one PtplanError
    naming the path, and the temporary file is removed."""
    p = Path(path)
    if os.fspath(path) == "":
        raise PtplanError("output file name is empty; give a file name")
    if p.is_dir():
        raise PtplanError(f"cannot write {p}: it is a folder; give a file name")
    if p.parent and not p.parent.exists():
        raise PtplanError(f"output folder does not exist: {p.parent}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    except OSError as e:
        raise PtplanError(f"cannot write {p}: the folder {p.parent} is not writable ({e.strerror}); "
                          f"write elsewhere") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            full = " (the disk is full: free space or write elsewhere)" if e.errno == errno.ENOSPC else ""
            raise PtplanError(f"cannot write {p}: {e.strerror or e}{full}; nothing was written") from None
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write obj as indented JSON, atomically."""
    write_atomic(path, json.dumps(obj, indent=1) + "\n")
