"""Every prediction-only bench script runs to the end on this tree and writes its JSON.

The docs quote these scripts' tables, and a planner change can break a script without any other test noticing:
``bench/terapipe_bench.py``'s part 3 stopped at a PtplanError from b7f126a (the stage model refused to price
128-token layers at 2048 tokens) to 2026-11-27 while docs/token-slices.md still cited its table. Each script runs
as a user runs it, in its own interpreter, writing to a temporary file (never to ``bench/results``); the scripts
that train or time on this machine (``ptplan run``, profiling, ``published.py``'s 30-minute fit) are not here.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = {  # script: its arguments besides --out (each predicts only; seconds on this 2-core box, 2026-11-27)
    "twobw_bench.py": ["--part", "1"],  # 0.5 s
    "host_io_plans.py": [],  # 0.4 s
    "gpu_replan.py": [],  # 1.1 s: the lent GPUs' stored runs re-planned
    "cost_terms_plans.py": [],  # 13 s
    "hybrid_bench.py": [],  # 9 s
    "schedule_bench.py": ["--part", "1"],  # 20 s
    "terapipe_bench.py": ["--repeats", "1"],  # 30 s, parts 1-3 (part 4 runs processes: --measure)
    "gpu_compare.py": [],  # 14 s: projection against the lent H100's stored profiles
    "pt_freeze_only.py": [],  # 21 s
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_prediction_bench_runs_to_the_end(script, tmp_path):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *SCRIPTS[script], "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert json.loads(out.read_text()), f"{script} wrote an empty result"
