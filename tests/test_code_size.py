"""Size limits (issue 21): no function in planner/, executor/ or cli/ over 80 lines, no class over 300.

``bench/code_size.py`` measures (a definition's lines from its first decorator to its last line); this test
holds the limits. ALLOWED lists the definitions still over their limit, with their length when the list
was written: the test fails when a listed one grows, when a definition not listed goes over, and when a
listed one is no longer over (remove it: the list only shrinks). Keys are ``path:qualified name``.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, int] = {}


def _code_size():
    spec = importlib.util.spec_from_file_location("ptplan_bench_code_size", ROOT / "bench" / "code_size.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_no_definition_is_over_its_limit_except_the_listed_ones():
    cs = _code_size()
    over = {f"{d.path}:{d.name}": d for d in cs.over_limits(cs.scan())}
    new = [f"{k} ({d.kind}, {d.lines} lines, line {d.line})" for k, d in over.items() if k not in ALLOWED]
    grew = [f"{k}: {over[k].lines} lines, listed at {n}" for k, n in ALLOWED.items() if k in over and over[k].lines > n]
    done = [k for k in ALLOWED if k not in over]
    assert not new, (f"over the limit ({cs.FUNCTION_LIMIT} lines a function, {cs.CLASS_LIMIT} a class): {new}; "
                     f"split it into well-named helpers")
    assert not grew, f"listed as still over the limit, and grown since: {grew}; shrink it"
    assert not done, f"no longer over the limit (well done): {done}; remove them from ALLOWED in {__file__}"


def test_the_measure_counts_decorators_docstrings_and_nested_definitions(tmp_path):
    cs = _code_size()
    src = ("import functools\n\n\n@functools.cache\ndef f(x):\n    \"\"\"Doc.\"\"\"\n    def g():\n        return x\n"
           "    return g\n\n\nclass C:\n    def m(self):\n        pass\n")
    (tmp_path / "pkg").mkdir()
    path = tmp_path / "pkg" / "m.py"
    path.write_text(src)
    got = {(d.kind, d.name, d.lines) for d in cs.definitions(path, tmp_path)}
    assert got == {("function", "f", 6), ("function", "f.<locals>.g", 2), ("class", "C", 3), ("function", "C.m", 2)}
    assert [d.name for d in cs.over_limits([cs.Definition("function", "big", "x.py", 1, 81),
                                            cs.Definition("function", "ok", "x.py", 1, 80),
                                            cs.Definition("class", "K", "x.py", 1, 301)])] == ["big", "K"]
