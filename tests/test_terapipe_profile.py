"""Token-slice profiling (executor/profiling/slices.py) and the profile's optional ``token_slices`` field: measured on a
(b, s, c) grid for GPT-2 and Llama blocks, the model left as found, the fit stored with its error, validated on
load (older profiles without it still load), and the shipped gpt2 slice profile is a measured one."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ptplan.executor.families.models import build_model
from ptplan.executor.profiling.slices import profile_slices, with_slices
from ptplan.planner.errors import PtplanError, SchemaError
from ptplan.planner.profile import load_profile, profile_from_json, save_profile
from ptplan.planner.terapipe import profile_slice_cost

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_profile_slices_measures_the_grid_and_leaves_the_model_as_found(name):
    model = build_model(name, seq_len=64, dropout=0.0)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    sp = profile_slices(model, batch_sizes=(1, 2), slice_lengths=(8, 16, 64), contexts=(0, 1024), repeats=3,
                        timer="cpu")
    assert len(sp.points) == 12 and {(p.b, p.s, p.c) for p in sp.points} == {
        (b, s, c) for b in (1, 2) for s in (8, 16, 64) for c in (0, 1024)}
    assert all(p.forward_s > 0 and p.backward_s > 0 for p in sp.points)
    assert sp.max_tokens == 1088 and sp.unit == "block"
    for fit in (sp.forward, sp.backward):
        assert 0 <= fit.fit_error <= fit.max_error
    # a later slice attends to more context: the same slice costs more after 1024 cached tokens
    t = {(p.b, p.s, p.c): p.forward_s + p.backward_s for p in sp.points}
    assert t[(2, 64, 1024)] > 1.2 * t[(2, 64, 0)]
    assert model.training and [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_token_slices_round_trip_and_are_validated(tmp_path):
    base = load_profile(ROOT / "profiles" / "gpt2_cpu_fp32.json")
    assert base.token_slices is None and "token_slices" not in base.to_json()  # older profiles load as before
    model = build_model("gpt2-tiny", seq_len=32, dropout=0.0)
    sp = profile_slices(model, batch_sizes=(1,), slice_lengths=(4, 8, 16), contexts=(0, 16), repeats=1, timer="cpu")
    prof = with_slices(base, sp)
    save_profile(prof, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.token_slices == sp
    obj = json.loads((tmp_path / "p.json").read_text())
    obj["token_slices"]["points"][0]["forward_s"] = -1.0
    with pytest.raises(SchemaError, match=r"token_slices.points\[0\].forward_s"):
        profile_from_json(obj)
    obj = json.loads((tmp_path / "p.json").read_text())
    obj["token_slices"]["points"] = obj["token_slices"]["points"][:3]  # the fit needs 4 (5 with b·s²)
    with pytest.raises(SchemaError, match="the fit needs at least 4"):
        profile_from_json(obj)
    obj = json.loads((tmp_path / "p.json").read_text())
    obj["token_slices"]["forward"]["slope"] = 1.0
    with pytest.raises(SchemaError, match="unknown key"):
        profile_from_json(obj)
    with pytest.raises(PtplanError, match="causal LMs"):
        profile_slices(build_model("bert-tiny"), repeats=1)


def test_shipped_gpt2_slice_profile_is_measured_and_fits():
    prof = load_profile(ROOT / "profiles" / "gpt2_cpu_fp32_slices.json")
    sp = prof.token_slices
    assert sp is not None and prof.provenance.source == "measured" and "slice_profile" in sp.command
    assert sp.max_tokens >= 2048 and len(sp.points) >= 12
    assert sp.forward.fit_error < 0.1 and sp.backward.fit_error < 0.1
    cost = profile_slice_cost(prof, b=1)
    for p in sp.points:  # the stored fit reproduces the measurement within its stated worst error
        if p.b == 1:
            got = float(cost(p.s, p.c))
            assert abs(got - (p.forward_s + p.backward_s)) <= max(sp.forward.max_error, sp.backward.max_error) * (
                p.forward_s + p.backward_s) + 1e-9


def test_cli_profile_slices_stores_the_fit(tmp_path):
    from click.testing import CliRunner

    from ptplan.cli.main import cli

    out = tmp_path / "p.json"
    res = CliRunner().invoke(cli, ["profile", "gpt2-tiny", "--seq-len", "32", "--batch-sizes", "1", "--warmup", "0",
                                   "--repeats", "1", "--threads", "1", "--timer", "cpu", "--slices", "--quiet",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    sp = load_profile(out).token_slices
    assert sp is not None and len(sp.points) == 24 and "--slices" in sp.command
    res = CliRunner().invoke(cli, ["profile", "bert-tiny", "--batch-sizes", "1", "--warmup", "0", "--repeats", "1",
                                   "--slices", "--quiet", "--out", str(tmp_path / "b.json")])
    assert res.exit_code == 2 and "causal LMs" in res.output
