"""Planning, the report and comparisons never import torch; profile and run say what to install."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

BLOCK_TORCH = textwrap.dedent("""
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {blocked}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, _Block())
""")


def _run(code: str, blocked=("torch", "transformers")) -> subprocess.CompletedProcess:
    src = BLOCK_TORCH.format(blocked=set(blocked)) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120)


def test_plan_show_and_compare_run_without_torch(tmp_path):
    plan, report, log = tmp_path / "p.json", tmp_path / "r.html", tmp_path / "run.jsonl"
    code = f"""
        import json, sys
        from click.testing import CliRunner
        from ptplan.cli.main import cli
        r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "cpu:2", "--batch", "8", "--epochs", "2",
                                     "--samples-per-epoch", "64", "--out", {str(plan)!r}, "--report", {str(report)!r}])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(cli, ["show", {str(plan)!r}, "--out", {str(report)!r}])
        assert r.exit_code == 0, r.output
        from ptplan.planner.plan import load_plan
        p = load_plan({str(plan)!r})
        ph = p.phases[0]
        recs = [{{"type": "header", "schema": "ptplan.runlog/1", "plan_fingerprint": p.inputs.profile.fingerprint,
                  "model": "bert-tiny", "world_size": 2,
                  "phases": [dict(frozen_blocks=x.frozen_blocks, K=x.K, D=x.D, M=x.M) for x in p.phases]}}]
        recs += [{{"type": "step", "epoch": 0, "step": i, "phase": 0, "frozen_blocks": 0, "K": ph.K, "D": ph.D,
                   "seconds": 0.1, "samples": ph.global_batch, "loss": 1.0}} for i in range(3)]
        open({str(log)!r}, "w").write("\\n".join(json.dumps(x) for x in recs) + "\\n")
        r = CliRunner().invoke(cli, ["compare", {str(plan)!r}, {str(log)!r}])
        assert r.exit_code == 0, r.output
        assert "torch" not in sys.modules and "transformers" not in sys.modules
        print("ok")
    """
    res = _run(code)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_profile_without_the_executor_dependencies_says_what_to_install(tmp_path):
    code = """
        from click.testing import CliRunner
        from ptplan.cli.main import cli
        r = CliRunner().invoke(cli, ["profile", "bert-tiny", "--out", "x.json"])
        print(r.exit_code)
        print(r.output)
    """
    res = _run(code)
    lines = res.stdout.splitlines()
    assert lines[0] == "2", res.stdout + res.stderr
    assert "needs torch" in res.stdout and "pip install" in res.stdout and "Traceback" not in res.stdout
