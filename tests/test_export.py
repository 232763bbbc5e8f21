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
