"""Projection at any size (issue 22 item 1): ``--project`` never allocates a weight, and ``--slices`` works with it."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from ptplan.executor.families import build_model
from ptplan.executor.profiling.project import fake_memory_pass, project_profile, swapped
from ptplan.executor.profiling.slices import _block_layers, _counted_point, _kv_shape, project_slices
from ptplan.planner.devices import get_device
from ptplan.planner.errors import PtplanError
from ptplan.planner.profile import load_profile
from ptplan.planner.terapipe import profile_slice_cost


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    yield


def test_a_meta_model_projects_exactly_as_the_real_one_and_the_real_one_is_left_as_found():
    real = build_model("gpt2-tiny", seq_len=16)
    before = {n: p.detach().clone() for n, p in real.named_parameters()}
    meta = build_model("gpt2-tiny", seq_len=16, layers=[])
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    dev = get_device("a100")
    a = project_profile(real, dev, batch_sizes=[1, 2, 4])
    b = project_profile(meta, dev, batch_sizes=[1, 2, 4])
    assert a.layers == b.layers and a.whole_model == b.whole_model
    # the real model still holds its own weights on the CPU (nothing moved to meta, nothing changed)
    assert all(p.device.type == "cpu" and torch.equal(p, before[n]) for n, p in real.named_parameters())
    assert not real.training and {p.device.type for p in meta.parameters()} == {"meta"}


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_the_fake_memory_pass_equals_the_measuring_profilers(name):
    from ptplan.executor.profiling.live_bytes import memory_pass

    real = build_model(name, seq_len=16)
    x, labels, mask = real.make_batch(4)
    assert fake_memory_pass(build_model(name, seq_len=16, layers=[]), 4) == memory_pass(real, x, labels, mask, 4)


def test_counting_allocates_no_parameter_storage():
    """gpt2-large (774 M parameters, 3.1 GB in float32) built and projected in a fresh process: the peak resident
    memory grows by far less than the parameters' bytes (the old path built the model for real: +3 GB)."""
    code = textwrap.dedent("""
        import resource, torch
        from ptplan.executor.families import build_model
        from ptplan.executor.profiling.project import project_profile
        from ptplan.planner.devices import get_device
        torch.set_num_threads(1)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        m = build_model("gpt2-large", seq_len=64, layers=[])
        prof = project_profile(m, get_device("h100"), batch_sizes=[1, 2])
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
        print(sum(r.param_bytes for r in prof.layers), grown * 1024)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    param_bytes, grown = map(int, r.stdout.split()[-2:])
    assert param_bytes > 3 * 10**9
    assert grown < param_bytes / 10, f"peak RSS grew {grown / 2**20:.0f} MiB for {param_bytes / 2**20:.0f} MiB"


def test_slice_operations_are_counted_exactly():
    """One GPT-2 block on a slice of s tokens after c cached ones: the linears 2·b·s·12h² FLOPs, attention scores and
    values 2·2·b·s·(s+c)·h; the backward twice the forward."""
    m = build_model("gpt2-tiny", seq_len=32, layers=[])
    h = m.config.hidden_size
    with swapped(m, lambda t: t.to("meta")):
        for b, s, c in [(1, 8, 0), (2, 8, 16), (2, 4, 24)]:
            f, bw = _counted_point(_block_layers(m), b, s, c, h, *_kv_shape(m))
            want = 2 * b * s * 12 * h * h + 4 * b * s * (s + c) * h
            assert sum(o.flops for o in f) == want
            assert sum(o.flops for o in bw) == 2 * want


def test_projected_slices_fit_and_feed_the_planner():
    m = build_model("gpt2-tiny", seq_len=64, layers=[])
    sp = project_slices(m, get_device("v100"), date="2026-01-01")
    assert sp.unit == "block" and "projected" in sp.timer and sp.device == get_device("v100").name
    assert sp.forward.fit_error < 0.1 and sp.backward.fit_error < 0.1
    by = {(p.b, p.s, p.c): p for p in sp.points}
    assert by[(1, 32, 0)].forward_s < by[(1, 64, 0)].forward_s < by[(2, 64, 0)].forward_s
    assert by[(1, 8, 0)].forward_s < by[(1, 8, 32)].forward_s
    assert {p.device.type for p in m.parameters()} == {"meta"}
    with pytest.raises(PtplanError, match="causal LMs"):
        project_slices(build_model("bert-tiny", seq_len=16, layers=[]), get_device("v100"))


def test_cli_project_with_slices_writes_projected_slice_costs(tmp_path):
    from click.testing import CliRunner

    from ptplan.cli.main import cli

    out = tmp_path / "g.json"
    r = CliRunner().invoke(cli, ["profile", "gpt2-tiny", "--project", "v100", "--dtype", "fp16", "--seq-len", "64",
                                 "--batch-sizes", "1,2", "--slices", "--out", str(out)])
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert prof.provenance.source == "projected" and prof.token_slices is not None
    assert "projected" in prof.token_slices.timer and "--slices" in prof.provenance.command
    cost = profile_slice_cost(prof, 1)
    assert cost(16, 0) > 0


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_attention_is_counted_as_the_gpus_fused_kernel(name):
    """On meta torch falls back to unfused attention (softmax, dropout, masking over b·heads·s² elements); the
    projection counts the fused kernel a GPU runs: one op forward, one backward, with the attention's
    4·b·s²·hidden FLOPs forward, and nothing of the unfused path left."""
    from ptplan.executor.profiling.project import record_layers

    b, s = 2, 16
    m = build_model(name, seq_len=s, layers=[])
    h = m.config.hidden_size
    with swapped(m, lambda t: t.to("meta")):
        ops = record_layers(m, b)
    attn = ops[1]  # the first block's attention half
    names = [o.name for o in attn.forward]
    assert names.count("_scaled_dot_product_efficient_attention") == 1 and "_safe_softmax" not in names
    assert "bmm" not in names and "_softmax" not in names
    fused = next(o for o in attn.forward if o.name == "_scaled_dot_product_efficient_attention")
    assert fused.flops == 4 * b * s * s * h
    assert [o.name for o in attn.backward].count("_scaled_dot_product_efficient_attention_backward") == 1


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "bert-tiny", "vit-tiny"])
def test_repeated_blocks_reuse_their_record_and_it_equals_recording_every_layer(name, monkeypatch):
    """A repeated block takes the record of the second equal one (``project._same_as``); the records equal those of
    recording every layer (fails if the first block's shared-module first-call work, e.g. Llama's rotary cache, were
    copied to every block, or if a block differing in any width were reused)."""
    from ptplan.executor.profiling import project

    def record(memo: bool) -> list:
        if not memo:
            monkeypatch.setattr(project, "_same_as", lambda *a: None)
        m = build_model(name, layers=[])
        with swapped(m, lambda t: t.to("meta")):
            return project.record_layers(m, 2)

    reused = record(True)
    monkeypatch.undo()
    every = record(False)
    assert reused == every
    assert sum(1 for a, b in zip(reused[5:], reused[3:]) if a is b) >= 1  # blocks 3+ share one record
