"""Dependencies: declared = imported (issue 21). Every third-party module that planner/, executor/ and cli/
import is declared in pyproject.toml where that code can rely on it, and every declared run-time
dependency is imported somewhere.

- planner/ and cli/ at module level: core ``dependencies`` only (``ptplan plan`` and ``ptplan show`` must
  work from a plain ``pip install ptplan``); the planner never imports the executor extra (torch).
- cli/ inside a function (the commands that profile or run): core or the ``executor`` extra.
- executor/: core or the ``executor`` extra.
- OPTIONAL modules: imported only inside a function, under ``except ImportError`` that tells the user
  what to install, and declared in some extra (they are not needed to plan or run).
"""
from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from dataclasses import dataclass
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "executor", "cli")
OPTIONAL = {"networkx": "only Cluster.graph() (a view of the cluster for users; the planner does not use it)"}


@dataclass(frozen=True)
class Import:
    module: str
    """Top-level module name."""
    path: str
    line: int
    lazy: bool
    """Inside a function or an ``if TYPE_CHECKING:`` block (not run when the module is imported)."""
    guarded: bool
    """Inside a ``try`` whose handlers catch ImportError."""
    typing_only: bool = False
    """Under ``if TYPE_CHECKING:``: for the type checker only, never run."""


def _catches_import_error(node: ast.Try) -> bool:
    names = {n.id for h in node.handlers for n in ast.walk(h.type) if isinstance(n, ast.Name)} if node.handlers else set()
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def imports(source: str, path: str = "<string>") -> list[Import]:
    """The absolute imports of one file, each with whether it runs at import time."""
    out: list[Import] = []

    def visit(node: ast.AST, lazy: bool, guarded: bool, typing: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend(Import(a.name.split(".")[0], path, child.lineno, lazy, guarded, typing)
                           for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append(Import(child.module.split(".")[0], path, child.lineno, lazy, guarded, typing))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, guarded, typing)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, True, guarded, True)
            elif isinstance(child, ast.Try):
                catches = _catches_import_error(child)
                for part in child.body:
                    visit(ast.Module(body=[part], type_ignores=[]), lazy, guarded or catches, typing)
                for rest in (*child.handlers, *child.orelse, *child.finalbody):
                    visit(rest, lazy, guarded, typing)
            else:
                visit(child, lazy, guarded, typing)

    visit(ast.parse(source, filename=path), False, False, False)
    return out


def third_party(imps: list[Import]) -> list[Import]:
    return [i for i in imps if i.module not in sys.stdlib_module_names and i.module not in ("ptplan", "__future__")]


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string ("PyYAML>=6" -> "pyyaml")."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m, requirement
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in project.get("optional-dependencies", {}).items()}
    return core, extras


@functools.cache
def _providers() -> dict[str, list[str]]:
    return dict(packages_distributions())


def _distribution(module: str) -> str:
    """The distribution that provides a top-level module (installed: the test environment has every extra)."""
    dists = _providers().get(module)
    assert dists, f"{module} is imported but not installed, so no distribution provides it; declare and install it"
    return _name(dists[0])


def _all_imports() -> list[Import]:
    out: list[Import] = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out.extend(third_party(imports(path.read_text(), str(path.relative_to(ROOT)))))
    return out


def test_the_scanner_sees_lazy_guarded_and_type_checking_imports():
    src = ("import numpy as np\nfrom plotly import graph_objects\nfrom .x import y\nimport os\n"
           "if TYPE_CHECKING:\n    import torch\n"
           "def f():\n    try:\n        import networkx\n    except ImportError:\n        raise\n    import tqdm\n")
    got = {(i.module, i.lazy, i.guarded, i.typing_only) for i in third_party(imports(src))}
    assert got == {("numpy", False, False, False), ("plotly", False, False, False), ("torch", True, False, True),
                   ("networkx", True, True, False), ("tqdm", True, False, False)}


def test_every_imported_module_is_declared_where_its_code_can_rely_on_it():
    core, extras = _declared()
    executor = extras.get("executor", set())
    wrong = []
    for i in _all_imports():
        dist = _distribution(i.module)
        pkg = i.path.split("/")[0]
        where = f"{i.path}:{i.line} imports {i.module} ({dist})"
        if i.module in OPTIONAL:
            if not (i.typing_only or (i.lazy and i.guarded)) or not any(dist in e for e in extras.values()):
                wrong.append(f"{where}: optional ({OPTIONAL[i.module]}) -- import it inside a function under "
                             f"except ImportError, and declare it in an extra")
        elif pkg == "planner" and dist in executor - core:
            wrong.append(f"{where}: the planner never imports the executor extra")
        elif (pkg == "executor" or (pkg == "cli" and i.lazy)) and dist not in core | executor:
            wrong.append(f"{where}: declare it in [project] dependencies or the executor extra")
        elif pkg in ("planner", "cli") and dist not in core and not (pkg == "cli" and i.lazy):
            wrong.append(f"{where}: planner/ and cli/ at import time may use only [project] dependencies")
    assert not wrong, "\n".join(wrong)


def test_every_declared_runtime_dependency_is_imported():
    core, extras = _declared()
    imported: dict[str, set[str]] = {}
    for i in _all_imports():
        imported.setdefault(_distribution(i.module), set()).add(i.path.split("/")[0])
    unused_core = sorted(core - set(imported))
    assert not unused_core, f"declared in [project] dependencies but imported nowhere: {unused_core}; remove them"
    unused_executor = sorted(d for d in extras.get("executor", set()) if "executor" not in imported.get(d, set()))
    assert not unused_executor, f"declared in the executor extra but not imported by executor/: {unused_executor}"
