"""planner/, executor/ and cli/ type-check clean with mypy (torch and transformers unfollowed: their types are Any),
seen as the installed ptplan.* packages (.ci/typecheck)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean_on_planner_executor_and_cli():
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    if shutil.which("bash") is None:
        pytest.skip("needs bash for .ci/typecheck")
    res = subprocess.run(["bash", str(ROOT / ".ci" / "typecheck")], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "Success" in res.stdout
