"""Projected profiles (executor/profiling/project.py): exact operation counts on the meta device, a device model's roofline."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ptplan.executor.profiling.live_bytes import memory_pass
from ptplan.executor.families.models import build_model
from ptplan.executor.profiling.profiler import model_for_profile
from ptplan.executor.profiling.project import Op, count_model, op_seconds, project_profile, record_layers, time_counted
from ptplan.planner.cluster import get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.devices import DEVICES, get_device
from ptplan.planner.errors import PtplanError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import load_profile, save_profile


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


def test_projected_profile_is_valid_marked_and_has_the_measured_memory(tmp_path):
    prof = project_profile(build_model("bert-tiny", seq_len=16), get_device("h100"), batch_sizes=[1, 2, 4],
                           command="ptplan profile bert-tiny --project h100")
    save_profile(prof, tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    assert again == prof
    assert prof.provenance.source == "projected" and prof.provenance.device_model == "h100"
    assert prof.device.kind == "cuda" and prof.device.name == DEVICES["h100"].name
    # memory fields are the measuring profiler's, not projected
    m = build_model("bert-tiny", seq_len=16)
    x, labels, mask = m.make_batch(4)
    mem = memory_pass(m, x, labels, mask, 4)
    assert [r.output_bytes_per_sample for r in prof.layers] == mem.output
    assert [r.saved_bytes_per_sample for r in prof.layers] == mem.saved
    assert [r.backward_working_bytes_per_sample for r in prof.layers] == mem.working
    assert [r.param_bytes for r in prof.layers] == [sum(p.numel() * 4 for p in layer.parameters())
                                                   for layer in m.layers]
    for r in prof.layers:  # times grow with the micro-batch size and are positive
        assert 0 < r.forward_s[0] <= r.forward_s[-1] and 0 < r.backward_s[0] <= r.backward_s[-1]
        assert r.optimizer_s is not None and r.optimizer_s > 0
    assert prof.whole_model.forward_backward_s[-1] == pytest.approx(
        sum(r.forward_s[-1] + r.backward_s[-1] for r in prof.layers))


@pytest.mark.parametrize("name", ["bert-tiny", "vit-tiny", "gpt2-tiny"])
def test_projection_never_allocates_its_inputs(name):
    """The projection counts on the meta device, its micro-batch too (``make_batch(meta=True)``): a batch of 10^10
    samples (terabytes of ids or pixels) projects. Before, the batch was made on the CPU and moved: a
    RuntimeError from the allocator, a traceback at exit 1 from `ptplan profile --project --batch-sizes`."""
    kw = {} if name.startswith("vit") else {"seq_len": 16}
    prof = project_profile(build_model(name, **kw), get_device("h100"), batch_sizes=[1, 10**10])
    for rec in prof.layers[1:-1]:  # b = 1 is mostly launch latency: far from 10^10 x, but far above it
        assert math.isfinite(rec.forward_s[1]) and rec.forward_s[1] > 100 * rec.forward_s[0]


def test_matmul_flops_are_counted_exactly():
    """BERT's MLP half at b samples of s tokens, hidden h, intermediate 4h: two matmuls of 2*b*s*h*4h FLOPs
    forward, twice that backward (input and weight gradients)."""
    b, s, h = 4, 16, 64
    m = build_model("bert-tiny", seq_len=s).to("meta")
    ops = record_layers(m, b)
    mlp = ops[2]
    assert sum(o.flops for o in mlp.forward) == 2 * (2 * b * s * h * 4 * h)
    assert sum(o.flops for o in mlp.backward) == 2 * 2 * (2 * b * s * h * 4 * h)
    assert all(o.bytes > 0 for o in mlp.forward)


def test_roofline_of_one_operation():
    dev = get_device("a100")
    e = dev.efficiency
    big = Op(name="mm", flops=1e12, bytes=1e6)
    t = op_seconds(big, dev, "bfloat16")
    peak = dev.matmul_peak("bfloat16")
    expect = e.launch_s + 1e12 / (peak * e.matmul_max * 1e12 / (1e12 + peak * e.matmul_half_s))
    assert t == pytest.approx(expect)
    copy = Op(name="add", flops=0.0, bytes=8e9)
    assert op_seconds(copy, dev, "bfloat16") == pytest.approx(e.launch_s + 8e9 / (dev.memory_bandwidth * e.memory))
    assert op_seconds(big, dev, "float32") > t  # fp32 matmuls run on the CUDA cores


def test_a_dtype_the_device_lacks_is_refused():
    with pytest.raises(PtplanError, match="no bfloat16"):
        project_profile(build_model("bert-tiny", seq_len=16, dtype=torch.bfloat16), get_device("rtx5000"),
                        batch_sizes=[1])
    with pytest.raises(PtplanError, match="unknown device model 'tpu'"):
        get_device("tpu")


def test_plans_from_projected_profiles_say_so():
    prof = project_profile(build_model("bert-tiny", seq_len=16), get_device("h100"), batch_sizes=[1, 2, 4, 8])
    plan = make_plan(prof, get_preset("dgx-h100"), TrainingConfig(epochs=2, samples_per_epoch=512, batch=64),
                     FreezePolicy())
    codes = {w.code for w in plan.warnings}
    assert "projected-profile" in codes and "cpu-profile-for-gpu-cluster" not in codes
    assert plan.inputs.profile.source == "projected"


def test_cli_projects_and_refuses_a_dtype_the_device_lacks(tmp_path):
    from click.testing import CliRunner

    from ptplan.cli.main import cli

    out = tmp_path / "bt.json"
    r = CliRunner().invoke(cli, ["profile", "bert-tiny", "--project", "a100", "--dtype", "bfloat16", "--seq-len", "16",
                                 "--batch-sizes", "1,2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert prof.provenance.source == "projected" and "--project a100" in prof.provenance.command
    bad = tmp_path / "no.json"
    r = CliRunner().invoke(cli, ["profile", "bert-tiny", "--project", "rtx5000", "--dtype", "bfloat16",
                                 "--out", str(bad)])
    assert r.exit_code == 2 and "no bfloat16" in r.output and not bad.exists()


PROFILES = Path(__file__).resolve().parents[1] / "profiles"
PROJECTED = sorted(p for p in PROFILES.glob("*.json")
                   if json.loads(p.read_text())["provenance"]["source"] == "projected")


def _same_record(a, b) -> bool:
    """Two layer records alike: integers exactly, seconds to 1e-12 relative (a refactor that only reorders a sum
    moves the last bit; the re-projection of 2026-11-27 changed attention's times by up to 3.8x)."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, tuple) and x and isinstance(x[0], float):
            if len(x) != len(y) or not all(math.isclose(u, v, rel_tol=1e-12, abs_tol=0.0) for u, v in zip(x, y)):
                return False
        elif isinstance(x, float):
            if not math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("model", sorted({p.name.split("_")[0] for p in PROJECTED}))
def test_shipped_projected_profiles_are_what_the_projection_writes_today(model):
    """Every shipped projected profile equals what ``--project`` computes now for its model, device and dtype (the
    files were once left behind when attention became the fused kernel: every plan from them priced attention
    1.1-3.8x too slow). Counted once per dtype and batch sizes, timed per device; every layer record, the
    whole-model sums and the FLOP count must be the file's (seconds to 1e-12). A file made with another torch
    (major.minor) than this one is skipped, each on its own. Stale files: re-project them with the command in
    their provenance."""
    here = torch.__version__.split("+")[0].rsplit(".", 1)[0]
    counted: dict = {}
    checked = 0
    for path in (p for p in PROJECTED if p.name.split("_")[0] == model):
        prof = load_profile(path)
        if prof.device.torch_version.split("+")[0].rsplit(".", 1)[0] != here:
            continue
        key = (prof.model.dtype, tuple(prof.batch_sizes))
        if key not in counted:
            counted[key] = count_model(model_for_profile(prof, layers=[]), prof.batch_sizes)
        fresh = time_counted(counted[key], get_device(prof.provenance.device_model),
                             command=prof.provenance.command, date=prof.device.date)
        stale = [a.name for a, b in zip(prof.layers, fresh.layers) if not _same_record(a, b)]
        assert not stale and len(prof.layers) == len(fresh.layers), \
            f"{path.name} is stale in {stale[:4]}: re-run `{prof.provenance.command}` to profiles/"
        for a, b in ((prof.whole_model.forward_s, fresh.whole_model.forward_s),
                     (prof.whole_model.forward_backward_s, fresh.whole_model.forward_backward_s)):
            assert all(math.isclose(u, v, rel_tol=1e-12) for u, v in zip(a, b)), path.name
        assert prof.measurement["flops_at_largest_batch"] == fresh.measurement["flops_at_largest_batch"], path.name
        checked += 1
    if not checked:
        pytest.skip(f"every shipped {model} file was counted with another torch than {torch.__version__}")
