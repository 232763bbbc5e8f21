"""Every input, every path (issue 24): each class of bad input the audit found, tried on every command that
takes it, in-process through the CLI. A conforming refusal is exit 2, one line ``error: ...`` naming the input,
no traceback, nothing written.

Classes: unwritable outputs (empty name, a folder, a missing folder, a read-only folder) on every command;
sizes bounded by the inputs (batch, samples per epoch, steps per epoch, freeze cadence, profile batch sizes,
sequence length); data files checked by content (random bytes, long CSV fields, Unicode line breaks, quoted
newlines, unterminated quotes, single-example classes); flags that do not apply.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.profiles import shipped


def _cli(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _conforms(r, *words: str) -> None:
    out = r.output
    assert r.exit_code == 2, out
    assert out.startswith("error: ") and out.count("\n") == 1 and "Traceback" not in out, out
    for w in words:
        assert w in out, (w, out)


@contextlib.contextmanager
def read_only_folder(path: Path) -> Iterator[Path]:
    """A folder no file can be made in: a read-only tmpfs as root (root ignores permissions), else mode 0555."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)], capture_output=True,
                           text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a read-only tmpfs here: {r.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
    else:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inputs")
    plan = d / "plan.json"
    r = _cli("plan", "bert-tiny", "--cluster", "cpu:2", "--epochs", 2, "--samples-per-epoch", 64, "--batch", 16,
             "--out", plan, "--quiet")
    assert r.exit_code == 0, r.output
    from ptplan.planner.plan import load_plan
    from ptplan.planner.runlog import SCHEMA

    p = load_plan(plan)
    recs = [{"type": "header", "schema": SCHEMA, "plan_fingerprint": p.inputs.profile.fingerprint,
             "model": p.inputs.profile.model, "world_size": p.world_size,
             "phases": [dict(frozen_blocks=ph.frozen_blocks, K=ph.K, D=ph.D, M=ph.M) for ph in p.phases]},
            {"type": "step", "epoch": 0, "step": 0, "phase": 0, "frozen_blocks": 0, "K": p.phases[0].K,
             "D": p.phases[0].D, "seconds": 0.1, "samples": 16, "loss": 0.7}]
    log = d / "run.jsonl"
    log.write_text("".join(json.dumps(x) + "\n" for x in recs))
    (d / "texts.csv").write_text("text,label\ngood film,pos\nbad film,neg\n")
    return {"dir": d, "plan": plan, "log": log, "csv": d / "texts.csv"}


def _commands(f: dict[str, Path], out: str) -> list[tuple[str, list[object]]]:
    """(command, argv) writing ``out`` through each command's output option."""
    return [
        ("plan --out", ["plan", "bert-tiny", "--cluster", "cpu:2", "--out", out, "--quiet"]),
        ("plan --report", ["plan", "bert-tiny", "--cluster", "cpu:2", "--out", f["dir"] / "p2.json", "--report", out,
                           "--quiet"]),
        ("show --out", ["show", f["plan"], "--out", out]),
        ("compare --json", ["compare", f["plan"], f["log"], "--json", out]),
        ("ablate --json", ["ablate", "bert-tiny", "--cluster", "cpu:2", "--json", out]),
        ("ablate --report", ["ablate", "bert-tiny", "--cluster", "cpu:2", "--report", out]),
        ("profile --out", ["profile", "bert-tiny", "--seq-len", 8, "--batch-sizes", 1, "--out", out]),
        ("data --out", ["data", f["csv"], "--tokenizer", f["dir"], "--seq-len", 8, "--out", out]),
        ("run --log", ["run", f["plan"], "--model", "bert-tiny", "--nproc-per-node", 2, "--dry-run", "--log", out]),
    ]


def test_every_command_refuses_an_unwritable_output_before_any_work(files, tmp_path):
    """Empty name, a folder, a missing folder (run: made, so a file in its way instead), a read-only folder."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    cases = {"": "is empty", str(tmp_path): "is a folder"}
    tried = 0
    for out, words in cases.items():
        for name, args in _commands(files, out):
            _conforms(_cli(*args), words)
            tried += 1
    for name, args in _commands(files, str(tmp_path / "no" / "such" / "x.out")):
        r = _cli(*args)
        if name == "run --log":  # run makes the log's folders (checked creatable first)
            assert r.exit_code == 0, r.output
            continue
        _conforms(r, "does not exist")
        tried += 1
    for name, args in _commands(files, str(blocker / "sub" / "x.out")):  # a file where a folder would be
        _conforms(_cli(*args))
        tried += 1
    with read_only_folder(tmp_path / "ro") as ro:
        for name, args in _commands(files, str(ro / "x.out")):
            _conforms(_cli(*args), "not writable")
            tried += 1
    assert tried >= 40
    assert not list((tmp_path / "ro").iterdir()) if (tmp_path / "ro").exists() else True


def test_run_makes_the_log_folders_again(files, tmp_path):
    from ptplan.cli.outputs import check_outputs, make_parent_folders

    log = tmp_path / "nodir" / "sub" / "run.jsonl"
    check_outputs([], [("--log", str(log))], make_folders=True)
    make_parent_folders(str(log))
    assert log.parent.is_dir()


def test_write_atomic_turns_every_os_error_into_one_message(tmp_path):
    from ptplan.planner.errors import PtplanError
    from ptplan.planner.jsonio import write_atomic

    for bad in ("", str(tmp_path)):
        with pytest.raises(PtplanError):
            write_atomic(bad, "x")
    with read_only_folder(tmp_path / "ro") as ro:
        with pytest.raises(PtplanError, match="not writable"):
            write_atomic(ro / "x.json", "x")


# ---- sizes bounded by the inputs ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["plan", "bert-tiny", "--cluster", "cpu:2", "--batch", 10**9, "--samples-per-epoch", 10**9], ["1024*2*1*64"]),
    (["ablate", "bert-tiny", "--cluster", "cpu:2", "--batch", 10**9, "--samples-per-epoch", 10**9], ["--batch"]),
    (["plan", "bert-tiny", "--cluster", "cpu:2", "--samples-per-epoch", 10**12], ["shuffled sample order", "GiB"]),
    (["plan", "bert-tiny", "--cluster", "cpu:2", "--freeze-every", 10**12], ["--freeze-every", "optimizer steps"]),
    (["ablate", "bert-tiny", "--cluster", "cpu:2", "--freeze-every", 10**12], ["--freeze-every"]),
    (["profile", "bert-tiny", "--batch-sizes", 100000], ["--batch-sizes", "GiB"]),
])
def test_sizes_are_bounded_by_the_inputs(args, words, tmp_path):
    _conforms(_cli(*args, *(["--out", tmp_path / "o.json"] if args[0] in ("plan", "profile") else [])), *words)
    assert not (tmp_path / "o.json").exists()


def test_schedules_are_bounded_in_closed_form():
    from ptplan.planner.schedule import MICRO_BATCHES_PER_STAGE, ScheduleError, build_schedule, check_sizes

    for name in ("gpipe", "1f1b"):
        with pytest.raises(ScheduleError, match="bubble"):
            check_sizes(name, 2, 2 * MICRO_BATCHES_PER_STAGE + 1)
        with pytest.raises(ScheduleError, match="bubble"):
            build_schedule(name, 2, 10**9)  # refused before one action is built
        check_sizes(name, 2, 2 * MICRO_BATCHES_PER_STAGE)


def test_run_bounds_steps_and_freeze_cadence(files):
    base = ["run", files["plan"], "--model", "bert-tiny", "--nproc-per-node", 2, "--dry-run"]
    _conforms(_cli(*base, "--steps-per-epoch", 100000), "--steps-per-epoch", "64")
    _conforms(_cli(*base, "--freeze-every", 10**12), "--freeze-every")


def test_data_seq_len_is_bounded_by_the_model(minilm_dir, tmp_path):
    src = tmp_path / "t.csv"
    src.write_text("text,label\ngood film,pos\nbad film,neg\n")
    _conforms(_cli("data", src, "--tokenizer", minilm_dir, "--seq-len", 10**9, "--out", tmp_path / "o.pt"),
              "--seq-len", "512")
    assert not (tmp_path / "o.pt").exists()


# ---- data files checked by content ---------------------------------------------------------------------------

def test_random_bytes_as_data_are_one_message(files, tmp_path):
    bad = tmp_path / "rand.pt"
    bad.write_bytes(os.urandom(4096))
    npz = tmp_path / "rand.npz"
    npz.write_bytes(os.urandom(4096))
    base = ["run", files["plan"], "--model", "bert-tiny", "--nproc-per-node", 2, "--dry-run"]
    _conforms(_cli(*base, "--data", bad), "not a readable .pt file")
    _conforms(_cli(*base, "--eval-data", bad), "not a readable .pt file")
    _conforms(_cli(*base, "--data", npz), "not a readable .npz file")


def test_csv_rows_end_at_real_line_breaks_only(tmp_path):
    from ptplan.executor.data.prep import read_rows

    src = tmp_path / "t.csv"
    src.write_text('text,label\nx\x85y,pos\n"good\nfilm",neg\r\nz\u2028w,pos\nf\x0cg,neg\n' + '"' + "a" * 200_000
                   + '",pos\n', encoding="utf-8")
    rows, cols = read_rows(src)
    assert cols == ["text", "label"]
    assert [r["text"][:6] for r in rows] == ["x\x85y", "good\nf", "z\u2028w", "f\x0cg", "aaaaaa"]
    assert len(rows[-1]["text"]) == 200_000  # over the csv module's 131,072 default
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"text": "a\u2028b", "label": 1}\n{"text": "c\x85d", "label": 0}\n', encoding="utf-8")
    assert [r["text"] for r in read_rows(jl)[0]] == ["a\u2028b", "c\x85d"]


def test_an_unterminated_quote_is_named_by_its_line(tmp_path, minilm_dir):
    src = tmp_path / "t.csv"
    src.write_text('text,label\nok,pos\n"broken,neg\nmore,pos\n')
    _conforms(_cli("data", src, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", tmp_path / "o.pt"),
              "line 3", "never closes")


def test_a_class_with_one_example_is_warned(tmp_path, minilm_dir):
    src = tmp_path / "t.csv"
    src.write_text("text,label\na,pos\nb,pos\nc,neg\nd,neg\ne,typo\n")
    r = CliRunner().invoke(cli, ["data", str(src), "--tokenizer", str(minilm_dir), "--seq-len", "8", "--out",
                                 str(tmp_path / "o.pt")])
    assert r.exit_code == 0, r.output
    assert "warning:" in r.output and "'typo' has a single example (row 5)" in r.output, r.output


# ---- flags that do not apply ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["plan", "bert-tiny", "--cluster", "cpu:2", "--freeze", "none", "--freeze-every", 2], ["--freeze-every"]),
    (["plan", "bert-tiny", "--cluster", "cpu:2", "--freeze", "manual", "--manual", "0,1", "--alpha", 0.2],
     ["--alpha"]),
    (["plan", "bert-tiny", "--cluster", "cpu:2", "--manual", "0,1"], ["--manual"]),
    (["ablate", "bert-tiny", "--cluster", "cpu:2", "--freeze", "none", "--alpha", 0.5], ["--alpha"]),
])
def test_flags_that_do_not_apply_are_refused(args, words, tmp_path):
    _conforms(_cli(*args, *(["--out", tmp_path / "o.json"] if args[0] == "plan" else [])), *words)


@pytest.mark.parametrize("extra, words", [
    (["--alpha", 0.3], ["--alpha", "--freeze adaptive"]),
    (["--momentum", 0.5], ["--momentum"]),
    (["--optimizer", "sgd", "--adam-eps", 1e-6], ["--adam-eps"]),
    (["--checkpoint-every", 2], ["--checkpoint-dir"]),
    (["--save-model-dir", "somewhere"], ["--save-model-every"]),
    (["--cache", "off", "--cache-budget", "1GiB"], ["--cache-budget"]),
    (["--eval-batch-size", 8], ["--eval-data"]),
])
def test_run_flags_that_do_not_apply_are_refused(files, extra, words):
    _conforms(_cli("run", files["plan"], "--model", "bert-tiny", "--nproc-per-node", 2, "--dry-run", *extra), *words)


def test_2bw_with_a_freeze_step_every_step_is_warned(tmp_path):
    r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "cpu:2", "--schedule", "2bw", "--freeze-every",
                                 "1", "--out", str(tmp_path / "p.json"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "warning: --schedule 2bw with --freeze-every 1" in r.output, r.output


def test_shipped_profile_untouched():
    json.loads(shipped("bert-tiny_cpu_fp32").read_text())


def test_a_full_disk_under_an_export_is_one_message(tmp_path):
    """--export and --save-model-every write through export_hf: safetensors' failed write (not an OSError) is a
    PtplanError naming the folder, like a checkpoint's and the log's, and no partial folder is left."""
    from ptplan.executor.families.models import build_model
    from ptplan.executor.training.export import export_hf
    from ptplan.planner.errors import PtplanError

    full = tmp_path / "full"
    full.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(full)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        m = build_model("bert-tiny", seq_len=8)
        w = {k: v.detach() for k, v in m.named_parameters()}
        for replace in (False, True):  # --export, and --save-model-every's folders
            with pytest.raises(PtplanError, match="cannot write the export .*free space"):
                export_hf(m, w, full / "exp", replace=replace)
            assert os.listdir(full) == []
    finally:
        subprocess.run(["umount", "-l", str(full)], capture_output=True)
