"""The profiler: sane measurements, a valid profile, and the model left exactly as it was found."""
from __future__ import annotations

import json

import pytest
import torch

from ptplan.executor.models import build_model
from ptplan.executor.profiler import agreement, profile_model
from ptplan.planner.errors import PtplanError
from ptplan.planner.profile import load_profile, profile_from_json, save_profile

SEQ = 16


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def _profile(model, **kw):
    args = dict(device="cpu", batch_sizes=[1, 2], warmup=1, repeats=2, progress=False)
    args.update(kw)
    return profile_model(model, **args)


@pytest.fixture(scope="module")
def bert():
    torch.set_num_threads(1)
    m = build_model("bert-tiny", seq_len=SEQ)
    return m, _profile(m)


def _hooks(model):
    out = []
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            out.extend(getattr(m, attr).values())
    for p in model.parameters():
        out.extend((getattr(p, "_backward_hooks", None) or {}).values())
        out.extend((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())
    return out


def test_model_left_unchanged():
    m = build_model("gpt2-tiny", seq_len=SEQ)
    # an unusual starting state: some layers frozen, mixed train/eval flags, one stale gradient
    for p in m.layers[1].parameters():
        p.requires_grad_(False)
    m.train()
    m.layers[2].eval()
    stale = torch.full_like(m.layers[4].ln_2.weight, 7.0)
    m.layers[4].ln_2.weight.grad = stale
    before = {k: v.clone() for k, v in m.state_dict().items()}
    flags = [(n, p.requires_grad) for n, p in m.named_parameters()]
    modes = [(n, mod.training) for n, mod in m.named_modules()]
    rng = torch.get_rng_state()

    prof = _profile(m)

    after = m.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [(n, p.requires_grad) for n, p in m.named_parameters()] == flags
    assert [(n, mod.training) for n, mod in m.named_modules()] == modes
    assert m.layers[4].ln_2.weight.grad is stale
    assert all(p.grad is None for n, p in m.named_parameters() if n != "layers.4.ln_2.weight")
    assert _hooks(m) == []
    assert torch.equal(torch.get_rng_state(), rng)
    # frozen layers were still measured with a backward
    assert all(t > 0 for t in prof.layers[1].backward_s)


def test_numbers_are_sane(bert):
    m, prof = bert
    H = m.config.hidden_size
    assert prof.batch_sizes == (1, 2) and prof.num_layers == len(m.layers) == 2 * 4 + 3
    assert [r.name for r in prof.layers] == [s.name for s in m.specs]
    assert [r.kind for r in prof.layers] == [s.kind for s in m.specs]
    total = 0
    for r, layer in zip(prof.layers, m.layers):
        n = sum(p.numel() for p in layer.parameters())
        total += n
        assert r.params == n and r.param_bytes == r.grad_bytes == 4 * n and r.optimizer_bytes == 8 * n
        assert all(t > 0 for t in r.forward_s + r.backward_s + r.nograd_forward_s)
    assert total == sum(p.numel() for p in m.parameters())
    for r in prof.layers[1:-2]:  # the halves: [B, S, H] fp32 out; real activations saved
        assert r.output_bytes_per_sample == SEQ * H * 4
        assert r.saved_bytes_per_sample > SEQ * H * 4
    for r in prof.layers:
        if r.kind == "mlp":  # at least the input, the pre-activation and the activation ([S, H], 2x[S, 4H])
            assert r.saved_bytes_per_sample >= 9 * SEQ * H * 4
    assert prof.layers[-2].output_bytes_per_sample == H * 4  # pooler: [B, H]
    assert prof.layers[-1].output_bytes_per_sample == 2 * 4  # two logits
    assert prof.model.name == "bert-tiny" and prof.model.seq_len == SEQ and prof.model.dtype == "float32"
    assert prof.model.config["hidden_size"] == H
    assert prof.device.kind == "cpu" and prof.device.threads == 1 and prof.device.memory_bytes > 0
    assert prof.measurement["repeats"] == 2 and prof.measurement["statistic"] == "median"
    assert all(t > 0 for t in prof.whole_model.forward_s + prof.whole_model.forward_backward_s)
    assert prof.whole_model.peak_memory_bytes == ()
    rows = agreement(prof)
    assert [b for b, *_ in rows] == [1, 2] and all(s > 0 and w > 0 for _, s, w, _ in rows)


def test_times_grow_with_batch_size():
    m = build_model("bert-tiny", seq_len=64)
    prof = _profile(m, batch_sizes=[1, 16], timer="cpu", repeats=3)
    step = prof.whole_model.forward_backward_s
    assert step[1] > 2 * step[0]
    layer_sum = [sum(r.forward_s[j] + r.backward_s[j] for r in prof.layers) for j in (0, 1)]
    assert layer_sum[1] > 2 * layer_sum[0]
    assert prof.measurement["timer"].startswith("process_time")


def test_vit_and_block_granularity_profile():
    m = build_model("vit-tiny", granularity="block")
    prof = _profile(m, batch_sizes=[2], repeats=1, warmup=0)
    assert [r.kind for r in prof.layers] == ["embedding", "block", "block", "block", "block", "norm", "head"]
    assert prof.model.granularity == "block" and prof.model.seq_len == 17
    profile_from_json(json.loads(json.dumps(prof.to_json())))


def test_bfloat16_bytes():
    m = build_model("bert-tiny", seq_len=SEQ, dtype=torch.bfloat16)
    prof = _profile(m, batch_sizes=[1], repeats=1, warmup=0)
    assert prof.model.dtype == "bfloat16"
    r = prof.layers[2]
    assert r.param_bytes == 2 * r.params and r.optimizer_bytes == 8 * r.params
    assert r.output_bytes_per_sample == SEQ * m.config.hidden_size * 2


def test_validates_and_round_trips(bert, tmp_path):
    _, prof = bert
    assert profile_from_json(json.loads(json.dumps(prof.to_json()))) == prof
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path) == prof


def test_bad_arguments():
    m = build_model("bert-tiny", seq_len=SEQ)
    with pytest.raises(PtplanError, match="positive integers"):
        _profile(m, batch_sizes=[0, 2])
    with pytest.raises(PtplanError, match="no batch sizes"):
        _profile(m, batch_sizes=[])
    with pytest.raises(PtplanError, match="repeats"):
        _profile(m, repeats=0)
    with pytest.raises(PtplanError, match="unsupported device"):
        _profile(m, device="meta")
    torch.set_num_threads(2)
    with pytest.raises(PtplanError, match="needs one torch thread"):
        _profile(m, timer="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_missing_is_a_clear_error():
    m = build_model("bert-tiny", seq_len=SEQ)
    with pytest.raises(PtplanError, match=r"cuda requested but torch.cuda.is_available\(\) is False; use --device cpu"):
        _profile(m, device="cuda")


@pytest.mark.gpu
def test_cuda_profile_with_events():
    m = build_model("gpt2-tiny", seq_len=SEQ)
    prof = _profile(m, device="cuda")
    assert prof.device.kind == "cuda" and prof.measurement["timer"] == "cuda_events"
    assert all(t > 0 for r in prof.layers for t in r.forward_s + r.backward_s)
    assert len(prof.whole_model.peak_memory_bytes) == 2 and all(b > 0 for b in prof.whole_model.peak_memory_bytes)
    assert next(m.parameters()).device.type == "cpu"  # moved back
