"""The profiler: sane measurements, a valid profile, and the model left exactly as it was found."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.training.config import RunConfig
from ptplan.executor.training.job import build_for_plan, plan_num_labels, with_plan_num_labels
from ptplan.executor.families.models import build_model
from ptplan.executor.profiling.profiler import (DefaultSizes, _layered_step, _split_step, agreement,
                                                default_batch_sizes, estimate_peak_bytes, head_num_labels,
                                                powers_of_two, profile_model, profile_num_labels, static_bytes)
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.profiling.project import _Recorder
from ptplan.planner.errors import PtplanError
from ptplan.planner.plan import save_plan
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


def test_backward_weight_part_lies_within_the_backward(bert):
    _, prof = bert
    for r in prof.layers:
        assert r.backward_weight_s is not None and len(r.backward_weight_s) == len(prof.batch_sizes), r.name
        assert all(0.0 <= w <= b for w, b in zip(r.backward_weight_s, r.backward_s)), r.name
    first = prof.layers[0]  # the embedding's input (token ids) needs no gradient: its backward is all W
    assert first.backward_weight_s == first.backward_s
    for r in prof.layers[1:]:  # every later layer has both an input and a weight gradient
        assert all(0.0 < w < b for w, b in zip(r.backward_weight_s, r.backward_s)), r.name
    split = prof.measurement["backward_split"]
    assert [d["batch_size"] for d in split] == list(prof.batch_sizes)
    for d, j in zip(split, range(len(prof.batch_sizes))):
        assert d["backward_s"] == pytest.approx(sum(r.backward_s[j] for r in prof.layers))
        assert d["input_s"] > 0 and d["weight_s"] > 0
    back = profile_from_json(json.loads(json.dumps(prof.to_json())), source="round trip")
    assert [r.backward_weight_s for r in back.layers] == [r.backward_weight_s for r in prof.layers]


class _FlopClock:
    """The profiler's clock read in FLOPs: a stamp is the FLOPs every aten operation run so far under ``rec`` counted
    (``project._Recorder``, the projection's counter), so the profiler's own marks give FLOPs per layer and part."""

    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec

    def stamp(self) -> float:
        return sum(op.flops for op in self.rec.ops)

    def sync(self) -> None:
        pass

    def seconds(self, a: float, b: float) -> float:
        return b - a


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
def test_split_backward_does_the_whole_backwards_work(name):
    """B and W as the profiler runs and marks them (torch's stage_backward_input, then stage_backward_weight, per
    layer) do per layer exactly the FLOPs of that layer's fused backward, no matmul twice or left out, and give its
    gradients. (Their seconds' agreement depends on the machine: ``bench/split_backward_bench.py`` measures it.)"""
    m = build_model(name, seq_len=SEQ)
    m.train()
    x, labels, mask = m.make_batch(4, torch.Generator().manual_seed(0))
    rec = _Recorder()
    with rec:
        clock = _FlopClock(rec)
        torch.manual_seed(0)  # the same dropout masks in both steps
        fwd, whole = _layered_step(m, clock, x, labels, mask)
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        torch.manual_seed(0)
        b_part, w_part = _split_step(m, clock, x, labels, mask)
    assert sum(whole) == 2 * sum(fwd) > 0  # each matmul's backward: one for the input, one for the weight
    assert [b + w for b, w in zip(b_part, w_part)] == whole
    assert b_part[0] == 0  # the embedding's input (token ids) has no gradient: its backward is all W
    assert all(0 < b < t for b, t in zip(b_part[1:], whole[1:]) if t > 0)  # (a norm layer counts no FLOPs)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


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
    io = prof.measurement["host_io"]  # the AutoCache's host rates, rows of the prefix output at the largest size
    assert io["rows_per_step"] == 2 and io["bytes_per_step"] == 2 * SEQ * H * 4
    assert io["rows_write_bytes_per_s"] > 0 and io["rows_read_bytes_per_s"] > 0
    assert io["weights_to_device_bytes_per_s"] is None  # a CPU streams nothing
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
    # AdamW's two moments are allocated like the bf16 parameter (zeros_like): 2 x 2 = 4 bytes per parameter
    # (was 8: "two fp32 moments", which torch's AdamW does not keep; tests/test_optimizer_bytes.py measures it)
    assert r.param_bytes == 2 * r.params and r.optimizer_bytes == 4 * r.params
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
    io = prof.measurement["host_io"]
    assert all(io[k] > 0 for k in ("rows_write_bytes_per_s", "rows_read_bytes_per_s", "weights_to_device_bytes_per_s"))


# ---- default micro-batch sizes (pure) ------------------------------------------------------------

def test_powers_of_two():
    assert powers_of_two() == (1, 2, 4, 8, 16, 32, 64)
    assert powers_of_two(1) == (1,) and powers_of_two(40) == (1, 2, 4, 8, 16, 32)
    with pytest.raises(PtplanError, match=">= 1"):
        powers_of_two(0)


def test_estimate_is_static_plus_saved_times_b_with_margin():
    assert estimate_peak_bytes(static=1000, saved_per_sample=100, batch_size=8, margin=1.0) == 1800
    assert estimate_peak_bytes(static=1000, saved_per_sample=100, batch_size=8) == 2250  # x 1.25


def test_default_sizes_stop_at_the_memory_limit():
    # (1000 + 100 b) x 1.25 <= 3000  <=>  b <= 14: 1..8 fit, 16 does not, so 16, 32, 64 are skipped
    d = default_batch_sizes(static=1000, saved_per_sample=100, memory_limit_bytes=3000, limit_name="the test limit")
    assert d.sizes == (1, 2, 4, 8) and d.skipped == (16, 32, 64)
    assert d.reason.startswith("skipped micro-batch sizes 16, 32, 64: at 16 the estimated peak")
    assert "the test limit" in d.reason and "\n" not in d.reason
    # the limit exactly at the estimate of 8 keeps 8
    lim = estimate_peak_bytes(static=1000, saved_per_sample=100, batch_size=8)
    assert default_batch_sizes(static=1000, saved_per_sample=100, memory_limit_bytes=lim).sizes[-1] == 8
    assert default_batch_sizes(static=1000, saved_per_sample=100, memory_limit_bytes=lim - 1).sizes[-1] == 4
    # everything fits; no limit known; a smaller largest size
    assert default_batch_sizes(static=1, saved_per_sample=1, memory_limit_bytes=10**9) == DefaultSizes(
        sizes=(1, 2, 4, 8, 16, 32, 64), skipped=())
    assert default_batch_sizes(static=10**12, saved_per_sample=1, memory_limit_bytes=None).skipped == ()
    assert default_batch_sizes(static=1, saved_per_sample=1, memory_limit_bytes=10**9, max_batch=16).sizes[-1] == 16


def test_default_sizes_keep_what_was_measured():
    # nothing fits beyond 1 by the estimate, yet size 1 (and anything measured already) stays
    assert default_batch_sizes(static=10**6, saved_per_sample=10, memory_limit_bytes=1).sizes == (1,)
    d = default_batch_sizes(static=10**6, saved_per_sample=10, memory_limit_bytes=1, measured=4)
    assert d.sizes == (1, 2, 4) and d.skipped == (8, 16, 32, 64) and "sizes 8, 16, 32, 64" in d.reason


# ---- default sizes, provenance and heads on the real profiler ----------------------------------------

def _saved_per_sample(model, b):
    """What the default-size estimate charges per sample: every layer's stash and the largest backward working set."""
    prof = _profile(model, batch_sizes=[b], warmup=0, repeats=1)
    return sum(r.saved_bytes_per_sample for r in prof.layers) + max(r.backward_working_bytes_per_sample
                                                                    for r in prof.layers)


def test_profiler_default_sizes_stop_at_the_limit_given():
    m = build_model("bert-tiny", seq_len=SEQ)
    static = static_bytes(m)
    assert static == sum(p.numel() * (4 + 4 + 8) for p in m.parameters())
    # a limit that holds size 2 by the estimate made after measuring 1, but not 4
    limit = estimate_peak_bytes(static=static, saved_per_sample=_saved_per_sample(m, 1), batch_size=2)
    prof = _profile(m, batch_sizes=None, warmup=0, repeats=1, memory_limit_bytes=limit, max_batch=8)
    assert prof.batch_sizes == (1, 2)
    assert prof.measurement["skipped_batch_sizes"] == [4, 8] and prof.measurement["memory_limit_bytes"] == limit
    assert prof.measurement["skipped_reason"].startswith("skipped micro-batch sizes 4, 8: at 4")
    assert all(len(r.forward_s) == 2 and r.optimizer_s is not None and r.optimizer_s > 0 for r in prof.layers)
    assert len(prof.whole_model.forward_backward_s) == 2
    # a generous limit: every power of two up to the largest
    prof = _profile(m, batch_sizes=None, warmup=0, repeats=1, memory_limit_bytes=2**40, max_batch=4)
    assert prof.batch_sizes == (1, 2, 4) and prof.measurement["skipped_batch_sizes"] == []
    assert "skipped_reason" not in prof.measurement


def test_host_limit_is_used_by_default():
    m = build_model("bert-tiny", seq_len=SEQ)
    prof = _profile(m, batch_sizes=None, warmup=0, repeats=1, max_batch=2)  # bert-tiny fits any host
    assert prof.batch_sizes == (1, 2) and prof.measurement["memory_limit_bytes"] > static_bytes(m)


def test_provenance_command_recorded(bert, tmp_path):
    _, prof = bert
    assert prof.provenance.source == "measured" and prof.provenance.command == ""
    m = build_model("bert-tiny", seq_len=SEQ)
    prof = _profile(m, batch_sizes=[1], warmup=0, repeats=1, command="ptplan profile bert-tiny --seq-len 16")
    assert prof.provenance.command == "ptplan profile bert-tiny --seq-len 16"
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").provenance == prof.provenance


def test_head_num_labels():
    assert head_num_labels("bert-base", None) == 2 and head_num_labels("vit-base", None) == 1000
    assert head_num_labels("vit-tiny", 10) == 10 and head_num_labels("gpt2", None) is None
    with pytest.raises(PtplanError, match="gpt2-medium has a language-model head"):
        head_num_labels("gpt2-medium", 10)
    with pytest.raises(PtplanError, match="at least 1"):
        head_num_labels("bert-tiny", 0)


def _cli_profile(tmp_path, *args):
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli, ["profile", *args, "--batch-sizes", "1", "--warmup", "0", "--repeats", "1",
                                 "--out", str(out), "--quiet"])
    return r, out


def test_cli_records_command_and_num_labels(tmp_path):
    r, out = _cli_profile(tmp_path, "bert-tiny", "--seq-len", "8", "--num-labels", "5")
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert prof.provenance.source == "measured"
    assert prof.provenance.command == (f"ptplan profile bert-tiny --seq-len 8 --batch-sizes 1 --num-labels 5 "
                                       f"--warmup 0 --repeats 1 --out {out} --quiet")
    H = prof.model.config["hidden_size"]
    assert prof.model.config["num_labels"] == 5 and profile_num_labels(prof) == 5
    assert prof.layers[-1].params == 5 * (H + 1) and prof.layers[-1].output_bytes_per_sample == 5 * 4


def test_cli_vit_head_is_imagenet_by_default(tmp_path):
    r, out = _cli_profile(tmp_path, "vit-tiny")
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    H = prof.model.config["hidden_size"]
    assert prof.model.config["num_labels"] == 1000 and prof.layers[-1].params == 1000 * (H + 1)
    # a file written before num_labels was recorded: told from the head's parameter count
    old = dataclasses.replace(prof, model=dataclasses.replace(
        prof.model, config={k: v for k, v in prof.model.config.items() if k != "num_labels"}))
    assert profile_num_labels(old) == 1000


def test_cli_gpt2_refuses_num_labels(tmp_path):
    r, out = _cli_profile(tmp_path, "gpt2-tiny", "--seq-len", "8", "--num-labels", "3")
    assert r.exit_code == 2
    assert "gpt2-tiny has a language-model head" in r.output and not out.exists()
    r, out = _cli_profile(tmp_path, "gpt2-tiny", "--seq-len", "8")
    assert r.exit_code == 0, r.output
    assert "num_labels" not in load_profile(out).model.config and profile_num_labels(load_profile(out)) is None


# ---- a run builds the head its plan's profile measured ----------------------------------------------

def _plan_with_profile(tmp_path, model, prof_path, name="plan.json"):
    plan = make_plan(model, [spec(0, K=1, D=1, M=1, b=2)], samples_per_epoch=4)
    ref = dataclasses.replace(plan.inputs.profile, path=str(prof_path))
    plan = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, profile=ref))
    path = tmp_path / name
    save_plan(plan, path)
    return plan, path


def test_run_uses_the_profiles_num_labels(tmp_path):
    model = build_model("vit-tiny", num_labels=7)
    prof = _profile(model, batch_sizes=[1], warmup=0, repeats=1)
    save_profile(prof, tmp_path / "prof.json")
    plan, path = _plan_with_profile(tmp_path, model, tmp_path / "prof.json")
    assert plan_num_labels(plan, "vit-tiny", str(path)) == 7
    cfg = with_plan_num_labels(RunConfig(plan=str(path), model="vit-tiny"))
    assert cfg.num_labels == 7
    assert build_for_plan(plan, RunConfig(plan=str(path), model="vit-tiny")).layers[-1].classifier.out_features == 7
    # the recorded path relative to the plan's folder also works; no profile file: the family's usual head
    plan2, path2 = _plan_with_profile(tmp_path, model, "prof.json", "plan2.json")
    assert plan_num_labels(plan2, "vit-tiny", str(path2)) == 7
    plan3, _ = _plan_with_profile(tmp_path, model, tmp_path / "missing.json", "plan3.json")
    assert plan_num_labels(plan3, "vit-tiny", None) == 1000
    r = CliRunner().invoke(cli, ["run", str(path), "--model", "vit-tiny", "--nproc-per-node", "1", "--dry-run"])
    assert r.exit_code == 0, r.output
    # an explicit other head is refused by the fingerprint check, before launching
    r = CliRunner().invoke(cli, ["run", str(path), "--model", "vit-tiny", "--nproc-per-node", "1", "--dry-run",
                                 "--num-labels", "3"])
    assert r.exit_code == 2 and "fingerprint" in r.output


def test_run_refuses_num_labels_for_gpt2(tmp_path):
    model = build_model("gpt2-tiny", seq_len=8)
    _, path = _plan_with_profile(tmp_path, model, tmp_path / "none.json")
    r = CliRunner().invoke(cli, ["run", str(path), "--model", "gpt2-tiny", "--nproc-per-node", "1", "--dry-run",
                                 "--num-labels", "3"])
    assert r.exit_code == 2 and "language-model head" in r.output
    r = CliRunner().invoke(cli, ["run", str(path), "--model", "gpt2-tiny", "--nproc-per-node", "1", "--dry-run"])
    assert r.exit_code == 0, r.output


# ---- local model folders: the real name, the family apart, a config alone ----------------------------

def test_profile_records_the_real_model_name_and_family(minilm_dir, tmp_path, monkeypatch):
    """The MiniLM is recorded as itself (its Hugging Face name), with its family (bert) apart; the CLI's
    default file name follows."""
    monkeypatch.chdir(tmp_path)
    prof = _profile(build_model("bert-base", weights=minilm_dir, seq_len=8), batch_sizes=[1], warmup=0, repeats=1)
    assert (prof.model.name, prof.model.family, prof.model.num_blocks) == ("nreimers/MiniLM-L6-H384-uncased",
                                                                           "bert", 6)
    r = CliRunner().invoke(cli, ["profile", str(minilm_dir), "--seq-len", "8", "--batch-sizes", "1", "--warmup", "0",
                                 "--repeats", "1", "--quiet", "--project", "h100", "--dtype", "bf16"])
    assert r.exit_code == 0, r.output
    assert "wrote nreimers--MiniLM-L6-H384-uncased_h100_bf16.json" in r.output
    out = load_profile(tmp_path / "nreimers--MiniLM-L6-H384-uncased_h100_bf16.json")
    assert (out.model.name, out.model.family, out.model.dtype) == ("nreimers/MiniLM-L6-H384-uncased", "bert",
                                                                  "bfloat16")
    assert out.fingerprint() == prof.fingerprint()


@pytest.mark.parametrize("alias, name", [("bf16", "bfloat16"), ("fp16", "float16"), ("FP32", "float32")])
def test_cli_dtype_aliases(alias, name, tmp_path):
    r, out = _cli_profile(tmp_path, "bert-tiny", "--seq-len", "8", "--dtype", alias)
    assert r.exit_code == 0, r.output
    assert load_profile(out).model.dtype == name
    r, _ = _cli_profile(tmp_path, "bert-tiny", "--dtype", "int8")
    assert r.exit_code == 2 and "--dtype 'int8' is not one of float32, bfloat16, float16 (or fp32, bf16, fp16)" in r.output


def test_cli_profiles_a_config_only_folder_and_runs_it(tmp_path):
    """``ptplan profile DIR`` with only a config.json (random init), then ``ptplan run --model DIR`` accepts
    a plan for it; the family comes from the config (a Qwen2 model, with an LM head)."""
    import transformers as tf

    d = tmp_path / "tiny-qwen"
    d.mkdir()
    tf.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=64, vocab_size=128, max_position_embeddings=64).save_pretrained(d)
    assert [p.name for p in d.iterdir()] == ["config.json"]
    r, out = _cli_profile(tmp_path, str(d), "--seq-len", "8")
    assert r.exit_code == 0, r.output
    prof = load_profile(out)
    assert (prof.model.name, prof.model.family, prof.model.num_blocks, prof.num_layers) == ("tiny-qwen", "qwen2", 2, 7)
    model = build_model(str(d), seq_len=8)
    plan, path = _plan_with_profile(tmp_path, model, out)
    assert plan.inputs.profile.model == "tiny-qwen"
    r = CliRunner().invoke(cli, ["run", str(path), "--model", str(d), "--nproc-per-node", "1", "--dry-run"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["run", str(path), "--model", str(d), "--nproc-per-node", "1", "--dry-run",
                                 "--num-labels", "3"])
    assert r.exit_code == 2 and "language-model head" in r.output
