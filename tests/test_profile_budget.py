"""``ptplan profile --budget``: repeats cut to a target time, every micro-batch size still measured, the rounds
and the machine's load recorded (issue 25: profiling defaults that fit a CPU)."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ptplan.executor.profiling.profiler import budget_rounds


def test_budget_rounds_keeps_everything_that_fits_and_cuts_the_rest():
    assert budget_rounds(100.0, 1.0, 2, 5, first=True) == (2, 5)       # 7 rounds fit
    assert budget_rounds(7.0, 1.0, 2, 5, first=False) == (2, 5)
    assert budget_rounds(4.5, 1.0, 2, 5, first=True) == (1, 3)         # 4 fit: one warm-up, 3 timed
    assert budget_rounds(4.5, 1.0, 2, 5, first=False) == (0, 4)        # later sizes run warm code
    assert budget_rounds(0.1, 1.0, 2, 5, first=True) == (1, 1)         # nothing fits: still one timed round
    assert budget_rounds(0.0, 1.0, 0, 3, first=True) == (0, 1)
    assert budget_rounds(10.0, 0.0, 2, 5, first=True) == (2, 5)


def test_a_small_budget_measures_every_size_with_fewer_rounds(one_torch_thread):
    from ptplan.executor.families.models import build_model
    from ptplan.executor.profiling.profiler import profile_model

    model = build_model("bert-tiny", seq_len=16)
    prof = profile_model(model, device="cpu", batch_sizes=[1, 2, 4], warmup=2, repeats=5, progress=False,
                         budget_s=0.01)
    assert prof.batch_sizes == (1, 2, 4)
    rounds = [(r["batch_size"], r["warmup"], r["repeats"]) for r in prof.measurement["rounds_per_size"]]
    assert rounds == [(1, 1, 1), (2, 0, 1), (4, 0, 1)]
    assert prof.measurement["budget_s"] == 0.01
    load = prof.measurement["load_average"]
    assert set(load) == {"before", "after", "seconds"} and load["seconds"] >= 0
    exact = profile_model(model, device="cpu", batch_sizes=[1], warmup=1, repeats=2, progress=False)
    assert exact.measurement["rounds_per_size"] == [{"batch_size": 1, "warmup": 1, "repeats": 2}]
    assert exact.measurement["budget_s"] is None


@pytest.mark.parametrize("args, budget", [([], 120.0), (["--budget", "0.5"], 30.0), (["--budget", "0"], None),
                                          (["--repeats", "2"], None), (["--repeats", "2", "--budget", "1"], 60.0)])
def test_cli_budget_default_and_exact_counts(tmp_path, args, budget, monkeypatch):
    import ptplan.executor.profiling.profiler as profiler
    from ptplan.cli.main import cli

    seen = {}
    real = profiler.profile_model

    def spy(model, **kw):
        seen["budget_s"] = kw["budget_s"]
        return real(model, **{**kw, "budget_s": 0.0})  # fast: one round per size

    monkeypatch.setattr(profiler, "profile_model", spy)
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli, ["profile", "bert-tiny", "--seq-len", "8", "--batch-sizes", "1,2", "--quiet",
                                 "--out", str(out), *args])
    assert r.exit_code == 0, r.output
    assert seen["budget_s"] == budget
    meas = json.loads(out.read_text())["measurement"]
    assert meas["model_arg"] == "bert-tiny" and meas["weights_arg"] is None


@pytest.mark.parametrize("budget", ["-1", "nan", "inf", "1e309"])
def test_cli_refuses_a_budget_that_is_not_a_finite_number_of_minutes(tmp_path, budget):
    """inf (and 1e309, which is inf) was a ValueError traceback after 5 s of profiling: inf // round_s is NaN."""
    from ptplan.cli.main import cli

    r = CliRunner().invoke(cli, ["profile", "bert-tiny", "--budget", budget, "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "--budget must be a finite number of minutes >= 0" in r.output, r.output
    assert not (tmp_path / "p.json").exists()
