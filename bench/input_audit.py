"""Bad inputs per command, and how many conform (issue 24's table for the README's "Failures and recovery").

Conforming: exit 2, exactly one line ``error: ...`` (warnings aside), no traceback, and no output file written.
Every case runs in-process through the CLI (click's runner), on the shipped bert-tiny profile and a plan made
here; ``run`` cases stop at ``--dry-run`` (everything is checked before any process starts). Mutated contract
files (profile, plan, run log: 1,000 each) are counted by tests/test_contract_fuzz.py, not here.

    python bench/input_audit.py [--out bench/results/input_audit.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from click.testing import CliRunner

from ptplan.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], check=True)
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", str(path)])
    else:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)


def outputs(d: Path, plan: Path, log: Path, csv: Path, ro: Path) -> dict[str, list[list[str]]]:
    """Per command: its output options given an empty name, a folder, a missing folder, a file in the way, a
    read-only folder, and the input itself."""
    bad = ["", str(d), str(d / "no" / "x.out"), str(csv / "sub" / "x.out"), str(ro / "x.out")]
    fixed = {
        "plan": [["plan", "bert-tiny", "--cluster", "cpu:2", "--quiet", "--out", o] for o in bad]
        + [["plan", "bert-tiny", "--cluster", "cpu:2", "--quiet", "--out", str(d / "p.json"), "--report", o]
           for o in bad],
        "show": [["show", str(plan), "--out", o] for o in bad + [str(plan)]],
        "compare": [["compare", str(plan), str(log), "--json", o] for o in bad + [str(log)]],
        "ablate": [["ablate", "bert-tiny", "--cluster", "cpu:2", opt, o] for o in bad for opt in ("--json", "--report")],
        "profile": [["profile", "bert-tiny", "--seq-len", "8", "--batch-sizes", "1", "--out", o] for o in bad],
        "data": [["data", str(csv), "--tokenizer", str(d), "--seq-len", "8", "--out", o] for o in bad + [str(csv)]],
        "run": [["run", str(plan), "--model", "bert-tiny", "--nproc-per-node", "2", "--dry-run", "--log", o]
                for o in ["", str(d), str(csv / "sub" / "x.out"), str(ro / "x.out"), str(plan)]],
    }
    return fixed


def others(d: Path, plan: Path, log: Path) -> dict[str, list[list[str]]]:
    rand = d / "rand.pt"
    rand.write_bytes(os.urandom(4096))
    run = ["run", str(plan), "--model", "bert-tiny", "--nproc-per-node", "2", "--dry-run"]
    p = ["plan", "bert-tiny", "--cluster", "cpu:2", "--quiet", "--out", str(d / "o.json")]
    a = ["ablate", "bert-tiny", "--cluster", "cpu:2"]
    bad_plan = json.loads(plan.read_text())
    bad_plan["phases"][0]["M"] *= 3
    (d / "badM.json").write_text(json.dumps(bad_plan))
    bad_plan = json.loads(plan.read_text())
    bad_plan["phases"][0]["predicted"]["stage_peak_memory_bytes"][0] = 10**18
    (d / "mem.json").write_text(json.dumps(bad_plan))
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    recs[1]["seconds"] = -1.0
    (d / "neg.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {
        "plan": [p + ["--batch", "1000000000", "--samples-per-epoch", "1000000000"],
                 p + ["--samples-per-epoch", str(10**12)], p + ["--freeze-every", str(10**12)],
                 p + ["--freeze", "none", "--freeze-every", "2"], p + ["--freeze", "none", "--alpha", "0.5"],
                 p + ["--manual", "0,1"]],
        "ablate": [a + ["--batch", "1000000000", "--samples-per-epoch", "1000000000"],
                   a + ["--freeze-every", str(10**12)], a + ["--freeze", "none", "--alpha", "0.5"]],
        "profile": [["profile", "bert-tiny", "--batch-sizes", "100000", "--out", str(d / "o.json")]],
        "show": [["show", str(d / "badM.json"), "--out", str(d / "r.html")],
                 ["show", str(d / "mem.json"), "--out", str(d / "r.html")],
                 ["show", str(plan), "--run", str(d / "neg.jsonl"), "--out", str(d / "r.html")]],
        "compare": [["compare", str(d / "badM.json"), str(log)], ["compare", str(d / "mem.json"), str(log)],
                    ["compare", str(plan), str(d / "neg.jsonl")]],
        "run": [run + ["--data", str(rand)], run + ["--eval-data", str(rand)], run + ["--steps-per-epoch", "100000"],
                run + ["--freeze-every", str(10**12)], run + ["--alpha", "0.3"], run + ["--momentum", "0.5"],
                run + ["--checkpoint-every", "2"], run + ["--save-model-dir", str(d / "m")],
                run + ["--cache", "off", "--cache-budget", "1GiB"], run[:1] + [str(d / "badM.json")] + run[2:]],
    }


def conforms(args: list[str], before: set[str], d: Path) -> bool:
    r = CliRunner().invoke(cli, args)
    lines = [ln for ln in r.output.splitlines() if not ln.startswith(("warning:", "note:"))]
    written = {str(p) for p in d.rglob("*")} - before
    return (r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.output
            and not written)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "input_audit.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        plan, log, csv = d / "plan.json", d / "run.jsonl", d / "t.csv"
        r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "cpu:2", "--epochs", "2", "--samples-per-epoch",
                                     "64", "--batch", "16", "--out", str(plan), "--quiet"])
        assert r.exit_code == 0, r.output
        p = json.loads(plan.read_text())
        ph = p["phases"][0]
        log.write_text(json.dumps({"type": "header", "schema": "ptplan.runlog/1", "model": "bert-tiny",
                                   "world_size": 2, "phases": [dict(frozen_blocks=x["frozen_blocks"], K=x["K"],
                                                                    D=x["D"], M=x["M"]) for x in p["phases"]]}) + "\n"
                       + json.dumps({"type": "step", "epoch": 0, "step": 0, "phase": 0, "frozen_blocks": 0,
                                     "K": ph["K"], "D": ph["D"], "seconds": 0.1, "samples": 16, "loss": 0.7}) + "\n")
        csv.write_text("text,label\ngood,pos\nbad,neg\n")
        table: dict[str, dict[str, int]] = {}
        with read_only(d / "ro") as ro:
            groups = {"outputs": outputs(d, plan, log, csv, ro), "sizes, files and flags": others(d, plan, log)}
            for group, cases in groups.items():
                for cmd, argvs in cases.items():
                    row = table.setdefault(cmd, {"tried": 0, "conform": 0})
                    for argv in argvs:
                        before = {str(x) for x in d.rglob("*")}
                        ok = conforms(argv, before, d)
                        row["tried"] += 1
                        row["conform"] += ok
                        if not ok:
                            print(f"does not conform: {' '.join(argv)}")
    print(f"{'command':<10} {'tried':>6} {'conform':>8}")
    for cmd, row in table.items():
        print(f"{cmd:<10} {row['tried']:>6} {row['conform']:>8}")
    total = {k: sum(r[k] for r in table.values()) for k in ("tried", "conform")}
    print(f"{'all':<10} {total['tried']:>6} {total['conform']:>8}")
    Path(a.out).write_text(json.dumps({"commands": table, "total": total}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
