"""Every prediction-only bench script runs to the end on this tree and writes its JSON, and the docs' tables made
from that JSON (``bench/doc_tables.py``) are what the script predicts now.

The docs quote these scripts' tables, and a planner change can break a script without any other test noticing:
``bench/terapipe_bench.py``'s part 3 stopped at a PtplanError from b7f126a (the stage model refused to price
128-token layers at 2048 tokens) to 2026-11-27 while docs/token-slices.md still cited its table. Each script runs
as a user runs it, in its own interpreter, writing to a temporary file (never to ``bench/results``); the scripts
that train or time on this machine (``ptplan run``, profiling, ``published.py``'s 30-minute fit) are not here.
The docs' tables drifted the same way: two audits on 2026-11-27 found the ablation, schedule, hybrid and 2BW tables
behind the planner; a marked table (``<!-- bench-table: NAME -->``) now fails here until the docs are re-rendered
(``python bench/doc_tables.py --write`` after re-running the script with its default output).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import doc_tables  # noqa: E402

SLOW = {"terapipe_bench.py", "pt_freeze_only.py", "schedule_bench.py"}  # over ~20 s here (pyproject's "slow")


@pytest.fixture(scope="module", autouse=True)
def _this_tree():
    """The scripts run from this tree and import ``ptplan``: both must be this tree, or the docs of one checkout
    would be held against another's code (an editable install elsewhere)."""
    import ptplan.planner

    where = Path(ptplan.planner.__file__).resolve()
    assert ROOT in where.parents, f"ptplan is imported from {where}, not this tree {ROOT}: pip install -e {ROOT}"


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


def _drift(results: Path, names: list[str]) -> str:
    return doc_tables.report(doc_tables.differences(results, names))


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s
                                    for s in sorted(SCRIPTS)])
def test_prediction_bench_runs_to_the_end_and_the_docs_say_what_it_predicts(script, tmp_path):
    out = tmp_path / (Path(script).stem + ".json")  # the name its committed result has, for doc_tables
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *SCRIPTS[script], "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert json.loads(out.read_text()), f"{script} wrote an empty result"
    names = doc_tables.tables_of(out.name)
    assert not (drift := _drift(tmp_path, names)), f"the docs no longer say what {script} predicts:\n{drift}"


def test_the_ablation_table_is_what_ptplan_ablate_predicts(tmp_path):
    r = subprocess.run([sys.executable, "-c", "from ptplan.cli.main import main; main()", "ablate",
                        *doc_tables.ABLATE_ARGS, "--json", str(tmp_path / "ablate.json")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert not (drift := _drift(tmp_path, ["ablation"])), drift


def test_every_marked_table_matches_the_committed_results_and_a_changed_cell_is_caught(tmp_path, monkeypatch):
    """bench/results holds what the docs show; and the check is not blind: one cell changed in a copy of the docs
    is reported (with both lines)."""
    assert not doc_tables.differences(ROOT / "bench" / "results"), "python bench/doc_tables.py --check"
    for doc in {d for d, _, _ in doc_tables.TABLES.values()}:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / doc).write_text((ROOT / doc).read_text())
    lines, start, _ = doc_tables.doc_table("docs/results.md", "ablation")
    monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
    lines[start + 2] = lines[start + 2].replace(" s |", "1 s |", 1)
    (tmp_path / "docs" / "results.md").write_text("\n".join(lines))
    assert list(doc_tables.differences(ROOT / "bench" / "results")) == ["ablation"]
