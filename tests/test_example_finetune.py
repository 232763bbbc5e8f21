"""``examples/finetune_minilm.py``'s data preparation: real ChatterBot statements tokenized by ``ptplan data`` with the
pretrained MiniLM's tokenizer into the training format that ``ptplan run`` checks (the full example takes minutes;
its measured numbers are in the README and ``bench/results/finetune_minilm.json``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example():
    if importlib.util.find_spec("chatterbot_corpus") is None:
        pytest.skip("chatterbot-corpus is not installed (pip install chatterbot-corpus)")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import finetune_minilm
    finally:
        sys.path.pop(0)
    return finetune_minilm


def test_prepared_data_is_stratified_real_text_the_run_accepts(example, minilm_dir, tmp_path):
    from ptplan.executor.data.dataset import check_data, load_dataset
    from ptplan.executor.families.models import build_model

    topics = ("trivia", "coding", "emotion")
    pairs = example.statements(topics, per_class=20, seed=0)
    assert len(pairs) == 60 and len({t for t, _ in pairs}) == 60 and {y for _, y in pairs} == {0, 1, 2}
    n_train, n_held = example.prepare(tmp_path, minilm_dir, topics, per_class=20, seq_len=16, seed=0)
    assert (n_train, n_held) == (48, 12)
    model = build_model("bert-base", weights=minilm_dir, seq_len=16, num_labels=3, dropout=0.0)
    for name, n in (("train", n_train), ("held", n_held)):
        ds = load_dataset(tmp_path / f"{name}.pt")
        check_data(ds, model, what=name)  # token ids in the vocabulary, labels within 3 classes, 16 tokens
        _, y, m = ds.batch(torch.arange(len(ds)))
        assert len(ds) == n and m.shape == (n, 16)
        assert torch.bincount(y, minlength=3).tolist() == [n // 3] * 3  # 20 % of each topic held out
        assert torch.load(tmp_path / f"{name}.pt", weights_only=True)["meta"]["label_names"] == list(topics)
    with pytest.raises(SystemExit, match="no topic 'nonsense'"):
        example.statements(("nonsense",), per_class=5, seed=0)
