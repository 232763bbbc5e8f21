"""Size of the code: the largest functions and classes of planner/, executor/ and cli/, against the limits.

    python bench/code_size.py [--top 15] [--json bench/results/code_size.json]

Lines are counted from a definition's first line (its decorators included) to its last, docstrings and
comments included, as a reader meets them. Limits (issue 21): no function over 80 lines, no class over
300. Prints the largest of each kind and every definition over its limit; writes the same as JSON.
Exit status 0 always: this is a report; tests/test_code_size.py holds the limits.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "executor", "cli")
FUNCTION_LIMIT = 80
CLASS_LIMIT = 300


@dataclass(frozen=True)
class Definition:
    kind: str
    """"function" (methods included) or "class"."""
    name: str
    """Qualified within its module: ``Class.method``, ``outer.<locals>.inner``."""
    path: str
    line: int
    lines: int


def _start(node: ast.AST) -> int:
    decos = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decos)])  # type: ignore[attr-defined]


def definitions(path: Path, root: Path = ROOT) -> list[Definition]:
    """Every function, method and class in one file with its length in lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[Definition] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                name = prefix + child.name
                n = (child.end_lineno or child.lineno) - _start(child) + 1
                out.append(Definition(kind, name, str(path.relative_to(root)), child.lineno, n))
                visit(child, name + ("." if kind == "class" else ".<locals>."))
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def scan(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Definition]:
    defs: list[Definition] = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            defs.extend(definitions(path, root))
    return defs


def over_limits(defs: list[Definition]) -> list[Definition]:
    return [d for d in defs if d.lines > (FUNCTION_LIMIT if d.kind == "function" else CLASS_LIMIT)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=15, help="how many of the largest of each kind to print")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "code_size.json"), help="where to write")
    args = ap.parse_args(argv)
    defs = scan()
    over = over_limits(defs)
    for kind, limit in (("function", FUNCTION_LIMIT), ("class", CLASS_LIMIT)):
        mine = sorted((d for d in defs if d.kind == kind), key=lambda d: -d.lines)
        print(f"\nlargest {kind}s (limit {limit} lines; {sum(d.lines > limit for d in mine)} over)")
        print(f"{'lines':>6}  {'where':<48} name")
        for d in mine[:args.top]:
            print(f"{d.lines:>6}  {d.path + ':' + str(d.line):<48} {d.name}")
    files = sum(1 for p in PACKAGES for _ in (ROOT / p).rglob("*.py"))
    print(f"\n{len(defs)} definitions in {files} files; {len(over)} over their limit")
    Path(args.json).write_text(json.dumps({"function_limit": FUNCTION_LIMIT, "class_limit": CLASS_LIMIT,
                                           "over": [asdict(d) for d in over],
                                           "largest": [asdict(d) for d in sorted(defs, key=lambda d: -d.lines)[:50]]},
                                          indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
