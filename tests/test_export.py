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

from ptplan.executor.config import RunConfig
from ptplan.executor.data import TensorDataset
from ptplan.executor.export import check_export_dir
from ptplan.executor.models import build_model
from ptplan.executor.testing import make_plan, run_world, spec
from ptplan.executor.training import Hooks, run_training
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

    from ptplan.executor.runlog import read_records
    from ptplan.executor.training import model_checkpoint_path

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
