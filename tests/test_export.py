"""``--export``: the trained model as a Hugging Face folder that ``from_pretrained`` loads and that predicts
what the executor's model predicts.

Each case forks 2 gloo processes running K=2,D=1 -> K=1,D=2 (one block frozen) for 4 steps with
``export`` set; rank 0 also saves its final snapshot. The exported folder is loaded with transformers'
Auto classes (``AutoModelForSequenceClassification`` for BERT, ``AutoModelForImageClassification`` for
ViT, ``AutoModelForCausalLM`` for GPT-2: its untied LM head included) and its logits on a fresh batch
are compared with the executor's model holding the snapshot (``run_layers`` over every layer).
"""
from __future__ import annotations

import os

import pytest
import torch

from ptplan.executor.training.config import RunConfig
from ptplan.executor.data.dataset import TensorDataset
from ptplan.executor.training.export import check_export_dir
from ptplan.executor.families.models import build_model
from ptplan.executor.handplan import make_plan, spec
from ptplan.executor.launch.local import run_world
from ptplan.executor.training.loop import Hooks, run_training
from ptplan.planner.errors import PtplanError

pytestmark = pytest.mark.multiproc


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    yield


def _build(name: str):
    kw = {} if name.startswith("vit") else {"seq_len": 8}
    return build_model(name, granularity="half", dropout=0.0, seed=0, num_labels=3, **kw)


@pytest.mark.parametrize("name", ["bert-tiny", "vit-tiny", "gpt2-tiny", "llama-tiny"])
def test_exported_folder_loads_and_predicts_as_the_executor(name, tmp_path):
    import transformers as tf

    model = _build(name)
    plan = make_plan(model, [spec(0, K=2, D=1, M=2, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1])
    data = TensorDataset(*model.make_batch(32, generator=torch.Generator().manual_seed(1)))
    out = tmp_path / "exported"
    cfg = RunConfig(plan="(test)", model=name, optimizer="adamw", lr=1e-2, seed=0, freeze_every=2, steps_per_epoch=4,
                    epochs=1, progress=False, timeout_s=60, log=str(tmp_path / "run.jsonl"), export=str(out))

    def worker(rank: int, world: int) -> None:
        def save(event, step, weights):
            if event == "final":
                torch.save(weights, tmp_path / "final.pt")

        run_training(cfg, plan, model, data, hooks=Hooks(snapshots=True, on_snapshot=save))

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"] if name in \
        ("gpt2-tiny", "llama-tiny") else sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".exported.tmp-")]
    ref = _build(name)
    final = torch.load(tmp_path / "final.pt")
    ref.load_state_dict(final, strict=False)
    start = _build(name)
    assert any(not torch.equal(final[k], v) for k, v in start.state_dict().items() if k in final)  # it trained
    auto = {"bert-tiny": tf.AutoModelForSequenceClassification, "vit-tiny": tf.AutoModelForImageClassification,
            "gpt2-tiny": tf.AutoModelForCausalLM, "llama-tiny": tf.AutoModelForCausalLM}[name]
    hf = auto.from_pretrained(out, local_files_only=True).eval()
    x, _, m = ref.make_batch(4, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = ref.run_layers(x, 0, len(ref.layers), m)
        if name == "vit-tiny":
            got = hf(pixel_values=x).logits
        else:
            got = hf(input_ids=x, attention_mask=m).logits
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    if name == "gpt2-tiny":
        assert hf.config.tie_word_embeddings is False
        assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)  # both trained apart


def test_export_destination_is_checked(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(PtplanError, match="exists and is not an empty folder"):
        check_export_dir(tmp_path / "full")
    with pytest.raises(PtplanError, match="cannot create it"):
        check_export_dir(tmp_path / "missing" / "deeper")
    check_export_dir(tmp_path / "new")


def _hf_eval(folder, x, y, m) -> tuple[float, float]:
    """(accuracy, mean loss) of the Hugging Face folder on a held-out batch, computed by transformers alone."""
    import transformers as tf

    hf = tf.AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        logits = hf(input_ids=x, attention_mask=m).logits
    return (logits.argmax(-1) == y).float().mean().item(), torch.nn.functional.cross_entropy(logits, y).item()


def test_export_best_and_model_only_checkpoints(tmp_path):
    """--save-model-every 1 writes each step's model as a Hugging Face folder; --export-best writes the one
    whose held-out accuracy (then loss) is best -- checked here with transformers alone on the same data."""
    from safetensors.torch import load_file

    from ptplan.executor.training.runlog import read_records
    from ptplan.executor.training.loop import model_checkpoint_path

    name = "bert-tiny"
    model = _build(name)
    plan = make_plan(model, [spec(0, K=2, D=1, M=2, b=2), spec(1, K=1, D=2, M=1, b=2)], trajectory=[0, 1])
    x, y, m = model.make_batch(64, generator=torch.Generator().manual_seed(1))
    y = x[:, 1] % 3  # the class: the first word's id mod 3
    held = TensorDataset(x[40:], y[40:], m[40:])
    out, ck = tmp_path / "best", tmp_path / "models"
    cfg = RunConfig(plan="(test)", model=name, optimizer="adamw", lr=3e-3, seed=0, freeze_every=3, steps_per_epoch=6,
                    epochs=1, progress=False, timeout_s=60, log=str(tmp_path / "run.jsonl"), export=str(out),
                    export_best=True, eval_data="held.pt", eval_every=1, save_model_every=1, save_model_dir=str(ck))

    def worker(rank: int, world: int) -> None:
        run_training(cfg, plan, model, TensorDataset(x[:40], y[:40], m[:40]), eval_dataset=held)

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    recs = read_records(tmp_path / "run.jsonl")
    evals = {r["step"]: r for r in recs if r["type"] == "eval"}
    assert sorted(evals) == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(ck)) == [os.path.basename(model_checkpoint_path(str(ck), s)) for s in range(1, 7)]
    scores = {}
    for s, e in evals.items():
        folder = model_checkpoint_path(str(ck), s)
        assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]  # the model only
        acc, loss = _hf_eval(folder, *held.batch(torch.arange(len(held))))
        assert acc == pytest.approx(e["accuracy"], abs=1e-6) and loss == pytest.approx(e["loss"], rel=1e-4)
        scores[s] = (acc, -loss)
    best = max(scores, key=lambda s: (scores[s], -s))  # the first of equals: a later tie does not replace it
    assert [r["step"] for r in recs if r["type"] == "export" and r["kind"] == "model"] == list(range(1, 7))
    exports = [r for r in recs if r["type"] == "export" and r["kind"] != "model"]
    assert exports[-1]["step"] == best and all(r["kind"] == "best" for r in exports)
    assert [r["step"] for r in exports] == sorted(r["step"] for r in exports)
    got = load_file(out / "model.safetensors")
    want = load_file(os.path.join(model_checkpoint_path(str(ck), best), "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    print(f"export-best: step {best} of 6 (accuracy, -loss per step: {scores})")
    assert best < 6 and len({tuple(v) for v in scores.values()}) > 1  # an earlier step than the last one won
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n or ".old-" in n]


# ---- done-when (issue 12): a 10-class image task and a Llama-family LM, through the CLI -------------------

def _cli(*args: str, timeout: int = 300) -> str:
    """``ptplan run`` in its own process (launcher, torchrun, workers); ``profile``, ``plan`` and ``data`` in this
    one through click's CliRunner (same command objects and arguments, no Python start or torch import each;
    profile's one thread is this module's ``one_torch_thread``)."""
    import subprocess
    import sys

    if args[0] != "run":
        from click.testing import CliRunner

        from ptplan.cli.main import cli

        res = CliRunner().invoke(cli, list(map(str, args)), catch_exceptions=False)
        assert res.exit_code == 0, f"ptplan {args[0]} failed:\n{res.output[-3000:]}"
        return res.output
    r = subprocess.run([sys.executable, "-m", "ptplan.cli.main", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"ptplan {args[0]} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r.stdout


def _executor_model(name: str, ck, **kw):
    """The executor's model holding the weights of the run's last checkpoint (written after the last step)."""
    from ptplan.executor.training import checkpoint as ckpt

    model = build_model(name, dropout=0.0, **kw)
    model.load_state_dict(ckpt.load_checkpoint(str(ck))["model"], strict=True)
    return model.eval()


@pytest.mark.slow
def test_digits_vit_ten_classes_through_the_cli(tmp_path):
    """scikit-learn's 8x8 digits (shipped in the package), upsampled to vit-tiny's 32x32: profile, plan and run
    through the CLI with --num-labels 10 (2 processes, a freezing plan, 2 epochs); the export loads with
    AutoModelForImageClassification and predicts what the executor's model predicts, and its held-out accuracy
    is the one the run logged."""
    import transformers as tf

    datasets = pytest.importorskip("sklearn.datasets")
    from ptplan.executor.training.runlog import read_records

    digits = datasets.load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    x = torch.nn.functional.interpolate(x, size=32, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - 0.5) / 0.5
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    tr, ev = order[:256], order[256:384]
    torch.save({"inputs": x[tr].contiguous(), "labels": y[tr]}, tmp_path / "train.pt")
    torch.save({"inputs": x[ev].contiguous(), "labels": y[ev]}, tmp_path / "eval.pt")
    assert sorted(set(y[tr].tolist())) == list(range(10))
    _cli("profile", "vit-tiny", "--num-labels", 10, "--batch-sizes", "4,8,16", "--warmup", 0, "--repeats", 1,
         "--threads", 1, "--quiet", "--out", tmp_path / "prof.json")
    _cli("plan", tmp_path / "prof.json", "--cluster", "cpu:2", "--epochs", 2, "--samples-per-epoch", 256, "--batch",
         16, "--quiet", "--out", tmp_path / "plan.json")
    out = _cli("run", tmp_path / "plan.json", "--model", "vit-tiny", "--num-labels", 10, "--nproc-per-node", 2,
               "--data", tmp_path / "train.pt", "--eval-data", tmp_path / "eval.pt", "--lr", "1e-3", "--dropout", 0,
               "--export", tmp_path / "exported", "--checkpoint-dir", tmp_path / "ck", "--log", tmp_path / "run.jsonl",
               "--no-progress", "--timeout", 120)
    assert "ptplan run: 32 steps" in out, out
    recs = read_records(tmp_path / "run.jsonl")
    assert len({(r["K"], r["D"]) for r in recs if r["type"] == "step"}) >= 1
    final = [r for r in recs if r["type"] == "eval"][-1]
    hf = tf.AutoModelForImageClassification.from_pretrained(tmp_path / "exported", local_files_only=True).eval()
    assert hf.config.num_labels == 10
    ref = _executor_model("vit-tiny", tmp_path / "ck", num_labels=10)
    xe, ye = x[ev], y[ev]
    with torch.no_grad():
        got = hf(pixel_values=xe).logits
        want = ref.run_layers(xe, 0, len(ref.layers), None)
    assert got.shape == (128, 10) and torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    acc = (got.argmax(-1) == ye).float().mean().item()
    assert acc == pytest.approx(final["accuracy"], abs=1e-9), (acc, final)
    print(f"digits vit-tiny: held-out accuracy {acc:.1%} after 2 epochs; export equals the executor's model")


@pytest.mark.slow
def test_llama_tiny_causal_lm_through_the_cli(tmp_path):
    """Text tokenized by ``ptplan data`` (a BPE tokenizer trained here, in a Llama folder), llama-tiny profiled,
    planned and trained through the CLI (2 processes, 2 epochs); the export loads with AutoModelForCausalLM and
    gives the executor's logits on the real (unpadded) tokens, and the run's held-out loss."""
    import json

    import transformers as tf
    from test_data_cmd import TEXTS, make_bpe_folder

    from ptplan.executor.data.dataset import load_dataset
    from ptplan.executor.training.runlog import read_records

    parts = [t for ts in TEXTS.values() for t in ts]
    lines = [f"{a}, then {b}" for a in parts for b in parts if a != b][:120]
    tok = make_bpe_folder(tmp_path / "tok", lines)
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    _cli("profile", "llama-tiny", "--seq-len", 16, "--batch-sizes", "4,8", "--warmup", 0, "--repeats", 1,
         "--threads", 1, "--quiet", "--out", tmp_path / "prof.json")
    _cli("plan", tmp_path / "prof.json", "--cluster", "cpu:2", "--epochs", 2, "--samples-per-epoch", 96, "--batch",
         8, "--quiet", "--out", tmp_path / "plan.json")
    out = _cli("data", tmp_path / "corpus.jsonl", "--tokenizer", tok, "--plan", tmp_path / "plan.json", "--out",
               tmp_path / "train.pt", "--split", 0.2, "--eval-out", tmp_path / "eval.pt")
    assert "96 samples of 16 tokens (causal-lm)" in out and "24 held out" in out, out
    out = _cli("run", tmp_path / "plan.json", "--model", "llama-tiny", "--nproc-per-node", 2, "--data",
               tmp_path / "train.pt", "--eval-data", tmp_path / "eval.pt", "--lr", "3e-3", "--export",
               tmp_path / "exported", "--checkpoint-dir", tmp_path / "ck", "--log", tmp_path / "run.jsonl",
               "--no-progress", "--timeout", 120)
    assert "ptplan run: 24 steps" in out, out
    evals = [r for r in read_records(tmp_path / "run.jsonl") if r["type"] == "eval"]
    assert evals[-1]["loss"] < evals[0]["loss"]  # it learned
    hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True).eval()
    ref = _executor_model("llama-tiny", tmp_path / "ck", seq_len=16)
    ds = load_dataset(tmp_path / "eval.pt")
    x, y, m = ds.inputs, ds.labels, ds.attention_mask
    with torch.no_grad():
        res = hf(input_ids=x, attention_mask=m, labels=y)
        want = ref.run_layers(x, 0, len(ref.layers), m)
    real = m.bool()
    assert torch.allclose(res.logits[real], want[real], atol=1e-5, rtol=1e-5), (res.logits[real] - want[real]).abs().max()
    assert torch.equal(res.logits[real].argmax(-1), want[real].argmax(-1))
    assert res.loss.item() == pytest.approx(evals[-1]["loss"], rel=1e-4), (res.loss.item(), evals[-1])
    print(f"llama-tiny: held-out loss {evals[0]['loss']:.3f} -> {evals[-1]['loss']:.3f}; export equals the executor")
