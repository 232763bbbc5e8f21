"""Defaults that fit the user's files (issue 25): ``ptplan data`` prints the sample count, keeps transformers'
"sequence length is longer" warning out of its output and writes files with the umask's permissions; ``ptplan
plan --data`` takes the samples (and checks the sequence length) from the file; ``ptplan run`` takes the model and
the one-node world size from the plan."""
from __future__ import annotations

import csv
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.errors import PtplanError

LONG = " ".join(["word"] * 700)  # more tokens than the MiniLM's 512: transformers warns unless silenced


def _data(tmp_path: Path, minilm_dir: Path, n: int = 40, seq_len: int = 8) -> Path:
    src = tmp_path / "in.csv"
    with open(src, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "label"])
        for i in range(n):
            w.writerow([LONG if i == 0 else f"sentence number {i} about {'cats' if i % 2 else 'dogs'}",
                        "cat" if i % 2 else "dog"])
    out = tmp_path / "train.pt"
    r = CliRunner().invoke(cli, ["data", str(src), "--tokenizer", str(minilm_dir), "--seq-len", str(seq_len),
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_data_prints_the_sample_count_without_the_length_warning_and_with_umask_permissions(minilm_dir, tmp_path):
    import logging

    src = tmp_path / "in.csv"
    src.write_text("text,label\n" + "".join(f"{LONG if i == 0 else 'a short one'},{i % 2}\n" for i in range(10)))
    old = os.umask(0o022)
    try:
        r = CliRunner().invoke(cli, ["data", str(src), "--tokenizer", str(minilm_dir), "--seq-len", "8",
                                     "--out", str(tmp_path / "t.pt"), "--split", "0.2",
                                     "--eval-out", str(tmp_path / "e.pt")])
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert "indexing errors" not in r.output and "longer than the specified maximum" not in r.output
    assert "plan with `ptplan plan PROFILE --data" in r.output and "8 samples per epoch" in r.output
    for f in ("t.pt", "e.pt"):
        assert (tmp_path / f).stat().st_mode & 0o777 == 0o644
    assert logging.getLogger("transformers.tokenization_utils_base").level != logging.ERROR  # restored


def _profile(tmp_path: Path, seq_len: int = 8) -> Path:
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli, ["profile", "bert-tiny", "--seq-len", str(seq_len), "--batch-sizes", "1,2,4",
                                 "--budget", "0.01", "--quiet", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_plan_takes_samples_and_batch_from_the_data_file(minilm_dir, tmp_path):
    data = _data(tmp_path, minilm_dir, n=40)
    prof = _profile(tmp_path)
    r = CliRunner().invoke(cli, ["plan", str(prof), "--cluster", "cpu:2", "--data", str(data), "--epochs", "1",
                                 "--freeze", "none", "--out", str(tmp_path / "plan.json"), "--quiet"])
    assert r.exit_code == 0, r.output
    training = json.loads((tmp_path / "plan.json").read_text())["inputs"]["training"]
    assert training["samples_per_epoch"] == 40 and training["batch"] == 32
    r = CliRunner().invoke(cli, ["plan", str(prof), "--cluster", "cpu:2", "--data", str(data), "--epochs", "1",
                                 "--batch", "8", "--samples-per-epoch", "24", "--out", str(tmp_path / "p2.json"),
                                 "--quiet"])
    assert r.exit_code == 0, r.output
    training = json.loads((tmp_path / "p2.json").read_text())["inputs"]["training"]
    assert training["samples_per_epoch"] == 24 and training["batch"] == 8
    r = CliRunner().invoke(cli, ["plan", str(prof), "--cluster", "cpu:2", "--data", str(data),
                                 "--samples-per-epoch", "41", "--out", str(tmp_path / "p3.json")])
    assert r.exit_code == 2 and "more than the 40 samples" in r.output


def test_plan_refuses_data_of_another_sequence_length(minilm_dir, tmp_path):
    data = _data(tmp_path, minilm_dir, seq_len=12)
    r = CliRunner().invoke(cli, ["plan", str(_profile(tmp_path, seq_len=8)), "--cluster", "cpu:2", "--data",
                                 str(data), "--out", str(tmp_path / "plan.json")])
    assert r.exit_code == 2
    assert "has 12 tokens per sample but the profile was measured at 8" in r.output and "--seq-len 12" in r.output
    assert not (tmp_path / "plan.json").exists()


def test_run_takes_the_model_and_world_size_from_the_plan(minilm_dir, tmp_path):
    from ptplan.cli.run_defaults import model_from_plan, nproc_from_plan
    from ptplan.planner.plan import load_plan

    prof = _profile(tmp_path)
    r = CliRunner().invoke(cli, ["plan", str(prof), "--cluster", "cpu:2", "--batch", "8", "--samples-per-epoch",
                                 "32", "--epochs", "1", "--out", str(tmp_path / "plan.json"), "--quiet"])
    assert r.exit_code == 0, r.output
    plan = load_plan(tmp_path / "plan.json")
    assert model_from_plan(plan, str(tmp_path / "plan.json")) == ("bert-tiny", None)
    assert nproc_from_plan(plan, "1") == plan.world_size == 2
    with pytest.raises(PtplanError, match="--nproc-per-node is needed with --nnodes 2: the plan needs 2"):
        nproc_from_plan(plan, "2")
    r = CliRunner().invoke(cli, ["run", str(tmp_path / "plan.json"), "--dry-run", "--log", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 0, r.output
    assert "--nproc-per-node=2" in r.output and "bert-tiny" in r.output

    # a profile made from a folder records it: the run uses that folder (and its weights), by its path
    meas = json.loads(prof.read_text())
    meas["measurement"]["model_arg"], meas["model"]["name"] = str(minilm_dir), "nreimers/MiniLM-L6-H384-uncased"
    gone = json.loads(json.dumps(meas))
    prof.write_text(json.dumps(meas))
    assert model_from_plan(load_plan(tmp_path / "plan.json"), str(tmp_path / "plan.json")) == (str(minilm_dir), None)
    gone["measurement"]["model_arg"] = str(tmp_path / "no-such-folder")
    prof.write_text(json.dumps(gone))
    plan = load_plan(tmp_path / "plan.json")
    assert model_from_plan(plan, str(tmp_path / "plan.json")) == ("bert-tiny", None)  # the plan's name is known
    hub = replace(plan, inputs=replace(plan.inputs, profile=replace(plan.inputs.profile,
                                                                     model="nreimers/MiniLM-L6-H384-uncased")))
    with pytest.raises(PtplanError, match="no-such-folder, which is gone.*pass --model NAME_OR_FOLDER"):
        model_from_plan(hub, str(tmp_path / "plan.json"))


@pytest.mark.parametrize("case", ["labels-short", "random-bytes"])
def test_plan_refuses_a_data_file_run_would_refuse(tmp_path, case):
    """`ptplan plan --data` read only the inputs' shape: a file whose labels were fewer than its inputs planned at
    exit 0 and `ptplan run` refused it (a CLI audit). plan now reads it with run's reader and checks."""
    import os

    import torch

    bad = tmp_path / "bad.pt"
    if case == "labels-short":
        torch.save({"inputs": torch.randint(1, 1000, (64, 128)), "labels": torch.zeros(10, dtype=torch.long)}, bad)
        want = "dataset tensors disagree on the number of samples: inputs (64, 128), labels (10,)"
    else:
        bad.write_bytes(os.urandom(4096))
        want = "not a readable .pt file"
    r = CliRunner().invoke(cli, ["plan", "bert-tiny", "--cluster", "cpu:2", "--data", str(bad), "--out",
                                 str(tmp_path / "p.json")])
    assert r.exit_code == 2 and want in r.output and r.output.count("\n") == 1, r.output
    assert not (tmp_path / "p.json").exists()
