"""``ptplan data``: a CSV or JSONL file of texts (and labels) tokenized into the training format ``ptplan run`` reads.

The output is a ``.pt`` file holding a dict (``data.load_dataset`` reads it):

- ``inputs``: int64 token ids ``[N, S]``, padded (right) or cut to the sequence length S;
- ``attention_mask``: int64 ``[N, S]``, 1 on real tokens, 0 on padding;
- ``labels``: classification: int64 class ids ``[N]`` in 0..C-1; causal LM: the token ids ``[N, S]``
  with -100 on padding (the model shifts them: position t predicts token t+1, ``models.LayeredModel.loss``);
- ``meta``: plain data: the task, the label names in id order (``label_names[c]`` is the text of class
  c), the sequence length, the tokenizer folder, the source file and how many texts were cut.

Every check runs before anything is written; the files are written next to their destination and
renamed into place, so a refused or failed call leaves nothing behind.
"""
from __future__ import annotations

import csv
import decimal
import json
import os
import random
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptplan.planner.errors import PtplanError

TASKS = ("classification", "causal-lm")
CAUSAL_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
"""Hugging Face ``model_type`` values whose folders default to ``--task causal-lm``."""


@dataclass(frozen=True)
class Prepared:
    """What ``prepare_data`` wrote."""

    task: str
    seq_len: int
    samples: int
    """Rows in ``out``."""
    eval_samples: int = 0
    """Rows in ``eval_out`` (0 without a split)."""
    label_names: list[str] = field(default_factory=list)
    """Classification: the label text of class c at index c (empty for causal LM)."""
    truncated: int = 0
    """Texts longer than ``seq_len`` tokens, cut."""
    warnings: list[str] = field(default_factory=list)
    """What looks wrong but does not stop the file being written (e.g. a class with a single example)."""


@dataclass(frozen=True)
class Table:
    """The rows of a .csv or .jsonl file, as ``read_table`` reads them."""

    rows: list[dict[str, Any]]
    """One dict per row, by column name (a short CSV row's missing fields are None)."""
    columns: list[str]
    """The CSV header, or every key of the JSONL objects in order of first use."""
    lines: list[int]
    """The line of the file (1-based) where each row starts, to name a row in a message."""


def read_rows(path: str | os.PathLike) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a .csv (header line first) or .jsonl (one JSON object per line) file, and its columns
    (``read_table`` without the line numbers)."""
    t = read_table(path)
    return t.rows, t.columns


def read_table(path: str | os.PathLike) -> Table:
    """The rows of a .csv (header line first) or .jsonl (one JSON object per line) file, its columns and the line
    where each row starts.

    Rows end at real line breaks only (``\\n``, ``\\r\\n``, ``\\r``): not at U+0085, U+2028, form feeds or the other
    characters ``str.splitlines`` also breaks at, which occur inside real texts. A CSV is read by the csv module
    from the file opened with ``newline=''``, so a quoted field keeps its line breaks."""
    p = Path(path)
    if not p.is_file():
        raise PtplanError(f"{p}: no such file; give a .csv or .jsonl file of texts")
    suffix = p.suffix.lower()
    if suffix not in (".csv", ".jsonl", ".json", ".ndjson"):
        raise PtplanError(f"{p}: unknown format {suffix or '(no suffix)'}; give a .csv file (header line first) or "
                          f"a .jsonl file (one JSON object per line)")
    try:
        table = _read_csv(p) if suffix == ".csv" else _read_jsonl(p)
    except UnicodeDecodeError as e:
        raise PtplanError(f"{p}: not UTF-8 text ({e.reason}); save it as UTF-8") from None
    if not table.rows:
        raise PtplanError(f"{p} holds no rows; nothing to tokenize")
    return table


def _read_csv(p: Path) -> Table:
    """A CSV's rows as dicts by its header. A field may be as long as the file (the csv module's default limit,
    131,072 characters, is lifted to the file's size for this read); an unterminated quote is named by the line
    where its field starts."""
    old = csv.field_size_limit()
    csv.field_size_limit(max(old, p.stat().st_size + 1))
    rows: list[dict[str, Any]] = []
    columns: list[str] = []
    lines: list[int] = []
    try:
        with open(p, encoding="utf-8-sig", newline="") as fh:
            reader = csv.reader(fh, strict=True)
            start = 1
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as e:
                    if "end of data" in str(e) or "unexpected end" in str(e):
                        raise PtplanError(f"{p} line {start}: a quoted field opens here and never closes (an "
                                          f"unterminated quote runs to the end of the file); close the quote, or "
                                          f"double a quote inside a field (\"\")") from None
                    raise PtplanError(f"{p} line {start}: not valid CSV ({e}); quote the whole field and double "
                                      f"the quotes inside it") from None
                here, start = start, reader.line_num + 1
                if not row:
                    continue
                if not columns:
                    columns = row
                    continue
                if len(row) > len(columns):
                    raise PtplanError(f"{p} line {here}: {len(row)} fields but the header has {len(columns)}; quote "
                                      f"fields that hold commas")
                rows.append(dict(zip(columns, row + [None] * (len(columns) - len(row)))))
                lines.append(here)
    finally:
        csv.field_size_limit(old)
    return Table(rows=rows, columns=columns, lines=lines)


def _read_jsonl(p: Path) -> Table:
    """One JSON object per line; lines end at ``\\n`` only (JSON strings may hold U+2028 and U+0085 raw)."""
    rows: list[dict[str, Any]] = []
    columns: list[str] = []
    lines: list[int] = []
    with open(p, encoding="utf-8-sig", newline="") as fh:
        text = fh.read()
    for i, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PtplanError(f"{p} line {i}: not JSON ({e.msg}); one JSON object per line") from None
        if not isinstance(obj, dict):
            raise PtplanError(f"{p} line {i}: a JSON {type(obj).__name__}, expected an object such as "
                              f'{{"text": "...", "label": "..."}}')
        rows.append(obj)
        lines.append(i)
        columns += [k for k in obj if k not in columns]
    return Table(rows=rows, columns=columns, lines=lines)


def default_task(tokenizer_dir: str | os.PathLike) -> str:
    """``causal-lm`` when the folder's config.json names a decoder-only model type, else ``classification``."""
    cfg = Path(tokenizer_dir) / "config.json"
    try:
        model_type = json.loads(cfg.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "classification"
    return "causal-lm" if model_type in CAUSAL_MODEL_TYPES else "classification"


_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
"""A label that is a decimal number (``3``, ``-0.5``, ``1e3``): classed by its value."""
_NOT_FINITE = ("nan", "inf", "infinity")
"""Labels (lower case, sign dropped) that are no class: a float NaN or infinity as Python's csv and json write it."""


class NotALabel(ValueError):
    """A value that cannot be a class label (its reason as the message); the caller names where it is."""


def _number(text: str) -> decimal.Decimal | None:
    """The value of ``text`` when it is a decimal number (``_NUMBER``), else None."""
    return decimal.Decimal(text) if _NUMBER.fullmatch(text) else None  # exact: a string is never rounded


def label_key(v: Any) -> str:
    """The class a label value belongs to: its text, trimmed, with a number written by its value -- so ``1``,
    ``1.0``, ``"1"``, ``"01"`` and ``"1e0"`` are the one class ``1`` in a CSV and a JSONL file alike (and in a
    --label-map); ``true``/``false`` as JSON writes them; any other text as it is (case kept). Raises NotALabel,
    saying what the value is, for what is not a class: a list or object, an empty or blank value, NaN or an
    infinity (``_NOT_FINITE``)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, dict)):
        raise NotALabel(f"a JSON {'list' if isinstance(v, list) else 'object'} ({json.dumps(v)[:40]})")
    if not isinstance(v, (str, int, float)):
        raise NotALabel(f"a {type(v).__name__} ({str(v)[:40]!r})")
    text = str(v).strip()
    if not text:
        raise NotALabel("an empty value")
    if text.lstrip("+-").lower() in _NOT_FINITE:
        raise NotALabel(f"{text} (not a number: a missing value?)" if text.lstrip("+-").lower() == "nan"
                        else f"{text} (an infinity)")
    d = _number(text)
    if d is None:
        return text
    if d.is_zero():
        return "0"
    try:
        with decimal.localcontext() as ctx:
            ctx.prec = len(text) + 1  # normalize rounds to the precision: keep every digit of a long integer label
            d = d.normalize()
    except decimal.DecimalException:  # an exponent past the context's (1e9999999): the label is its text
        return text
    return format(d, "f") if -30 < d.adjusted() < 30 else str(d)  # 1E+3 -> 1000, 1.50 -> 1.5; 1E+99 kept short


def _sort_key(name: str) -> tuple[int, decimal.Decimal, str]:
    d = _number(name)
    return (1, decimal.Decimal(0), name) if d is None else (0, d, name)


def read_label_map(spec: str) -> list[str]:
    """Label names in class order from ``spec``: a JSON file (a list of names, or {name: id} with ids
    0..C-1), or a .pt file written by ``ptplan data`` (its recorded map, to tokenize more data alike)."""
    p = Path(spec)
    if not p.is_file():
        raise PtplanError(f"--label-map {spec}: no such file; give 'auto', a JSON file (a list of label names, or "
                          f"{{name: id}}) or a .pt file written by ptplan data")
    if p.suffix == ".pt":
        import torch

        try:
            d = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
            raise PtplanError(f"--label-map {spec}: not a readable .pt file ({type(e).__name__}; read with "
                              f"weights_only); give a .pt file written by ptplan data or a JSON file") from None
        names = (d.get("meta") or {}).get("label_names") if isinstance(d, dict) else None
        if not names:
            raise PtplanError(f"--label-map {spec} records no label map (not written by ptplan data for "
                              f"classification)")
        return _map_names(spec, list(names))
    try:
        obj = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise PtplanError(f"--label-map {spec}: not a JSON file ({e})") from None
    if isinstance(obj, list) and obj:
        return _map_names(spec, obj)
    if isinstance(obj, dict) and obj:
        ids = sorted(obj.values()) if all(isinstance(v, int) and not isinstance(v, bool) for v in obj.values()) else None
        if ids != list(range(len(obj))):
            raise PtplanError(f"--label-map {spec}: the ids must be the integers 0..{len(obj) - 1}, each once; got "
                              f"{sorted(obj.values(), key=str)}")
        return _map_names(spec, [k for k, _ in sorted(obj.items(), key=lambda kv: kv[1])])
    raise PtplanError(f"--label-map {spec}: expected a non-empty list of names or a {{name: id}} object")


def _map_names(spec: str, raw: list[Any]) -> list[str]:
    """The class names of a --label-map in class order, each by ``label_key`` (as the file's labels are), once."""
    names = []
    for c, v in enumerate(raw):
        try:
            names.append(label_key(v))
        except NotALabel as e:
            raise PtplanError(f"--label-map {spec}: class {c} is named by {e}, not a label; give each class a name "
                              f"or a number") from None
    for n in names:
        if names.count(n) > 1:
            raise PtplanError(f"--label-map {spec}: the label {n!r} names classes "
                              f"{', '.join(str(c) for c, m in enumerate(names) if m == n)} (a label is one class, and "
                              f"numbers are one label by value: 1, 1.0 and \"1\" are the same); give each label once")
    return names


def _column(rows: list[dict[str, Any]], name: str, what: str, columns: list[str], src: str, hint: str) -> list[Any]:
    if name not in columns:
        raise PtplanError(f"{src} has no {what} column {name!r} (columns: {', '.join(columns) or 'none'}); {hint}")
    out = []
    for i, row in enumerate(rows):
        v = row.get(name)
        if v is None:
            raise PtplanError(f"{src} row {i + 1}: no value in the {what} column {name!r}")
        out.append(v)
    return out


def _split(labels: list[int] | None, n: int, share: float, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids): ``share`` of each class held out (at least one of each class with two or
    more rows; stratified), or of all rows for causal LM; both in a seeded random order."""
    rng = random.Random(seed)
    groups = [list(range(n))] if labels is None else [[i for i in range(n) if labels[i] == c]
                                                       for c in sorted(set(labels))]
    train, held = [], []
    for g in groups:
        rng.shuffle(g)
        k = min(len(g) - 1, max(1, round(share * len(g)))) if len(g) > 1 else 0
        held += g[:k]
        train += g[k:]
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def _load_tokenizer(tokenizer_dir: str | os.PathLike):
    d = Path(tokenizer_dir)
    if not d.is_dir():
        raise PtplanError(f"--tokenizer {d}: no such folder; give a local Hugging Face model or tokenizer folder "
                          f"(with tokenizer.json or vocab files)")
    from transformers import AutoTokenizer

    from ptplan.executor.families.build import _quiet_transformers

    try:
        with _quiet_transformers():
            return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a folder without a tokenizer
        raise PtplanError(f"--tokenizer {d}: no tokenizer could be loaded from it ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); give a folder with tokenizer.json, or "
                          f"vocab.txt / vocab.json and merges.txt") from None


def _tiny_classes(labels: list[int], names: list[str], src: str, column: str) -> list[str]:
    """A warning per class with a single example: usually a corrupted row or a typo in the label column, and a
    class a model cannot learn (nor a split hold out)."""
    counts = [0] * len(names)
    for c in labels:
        counts[c] += 1
    return [f"{src}: class {names[c]!r} has a single example (row {labels.index(c) + 1}); check that row's {column!r} "
            f"column (a typo or a broken row?) before training with {len(names)} classes"
            for c, k in enumerate(counts) if k == 1]


MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")
"""config.json keys that give a model's longest sequence."""


def model_max_tokens(tok: Any, tokenizer_dir: str | os.PathLike) -> tuple[int | None, str]:
    """(the longest sequence the tokenizer and model of ``tokenizer_dir`` take, where that comes from); None when
    neither says (tokenizers report ~1e30 for 'unknown')."""
    limits: list[tuple[int, str]] = []
    m = getattr(tok, "model_max_length", None)
    if isinstance(m, int) and 0 < m < 10**9:
        limits.append((m, "the tokenizer's model_max_length"))
    try:
        cfg = json.loads((Path(tokenizer_dir) / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    for key in MAX_POSITION_KEYS:
        v = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            limits.append((v, f"config.json's {key}"))
            break
    if not limits:
        return None, ""
    most, where = min(limits)
    return most, where


def check_seq_len(seq_len: int, tok: Any, tokenizer_dir: str | os.PathLike, rows: int) -> None:
    """--seq-len within the model's longest sequence, and the padded tensors (ids, mask and labels, int64) within
    the memory available now."""
    most, where = model_max_tokens(tok, tokenizer_dir)
    if most is not None and seq_len > most:
        raise PtplanError(f"--seq-len {seq_len:,} is longer than the model takes: {most:,} tokens ({where} in "
                          f"{tokenizer_dir}); give --seq-len {most} or less")
    from ptplan.executor.profiling.profiler import _available_host_bytes

    need = 3 * 8 * rows * seq_len
    avail = _available_host_bytes()
    if avail is not None and need > avail:
        raise PtplanError(f"--seq-len {seq_len:,}: {rows:,} rows padded to it need {need / 2**30:,.1f} GiB but "
                          f"{avail / 2**30:,.1f} GiB of memory is available; give a shorter --seq-len")


def _save_atomic(items: list[tuple[dict[str, Any], Path]]) -> None:
    """torch.save each (object, path) to a temporary file beside it, then rename all into place."""
    import torch

    tmps: list[tuple[str, Path]] = []
    try:
        for obj, dest in items:
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.absolute().parent)
            os.close(fd)
            tmps.append((tmp, dest))
            torch.save(obj, tmp)
        for tmp, dest in tmps:
            os.replace(tmp, dest)
    except OSError as e:
        raise PtplanError(f"cannot write {tmps[-1][1] if tmps else items[0][1]}: {e.strerror or e}; free space or "
                          f"write elsewhere") from None
    finally:
        for tmp, _ in tmps:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _lines(lines: list[int], most: int = 5) -> str:
    """The first ``most`` of ``lines``, comma-separated, and '...' when there are more."""
    return ", ".join(map(str, lines[:most])) + (", ..." if len(lines) > most else "")


def _class_labels(table: Table, name: str, label_column: str, label_map: str
                  ) -> tuple[list[str], list[int], list[str]]:
    """(label names in class order, each row's class id, warnings) of a classification file, each label classed
    by ``label_key``; PtplanError for a value that is no label, a label outside a given map or a single class."""
    values = _column(table.rows, label_column, "label", table.columns, name,
                     "pass --label-column NAME, or --task causal-lm for language-modelling text without labels")
    raw: list[str] = []
    bad: list[tuple[int, str]] = []
    spelled: dict[str, str] = {}  # a class's name: its label as the file first writes it ("02134", not "2134")
    for line, v in zip(table.lines, values):
        try:
            raw.append(label_key(v))
            spelled.setdefault(raw[-1], str(v).strip() if not isinstance(v, bool) else raw[-1])
        except NotALabel as e:
            bad.append((line, str(e)))
    if bad:
        raise PtplanError(f"{name} line {bad[0][0]}: the label column {label_column!r} holds {bad[0][1]}, not a label"
                          + (f"; {len(bad)} rows in all hold no label (lines {_lines([b for b, _ in bad])})"
                             if len(bad) > 1 else "") + "; give every row one label (a name or a number) or drop the "
                          "rows without one")
    names = sorted(set(raw), key=_sort_key) if label_map == "auto" else read_label_map(label_map)
    ids = {n: c for c, n in enumerate(names)}
    unknown = sorted({v for v in raw if v not in ids}, key=_sort_key)
    if unknown:
        first = raw.index(unknown[0]) + 1
        raise PtplanError(f"{name} row {first}: label {unknown[0]!r} is not in --label-map {label_map} "
                          f"({', '.join(names)})" + (f"; {len(unknown)} unknown labels in all" if len(unknown) > 1
                                                     else "") + "; fix the row or extend the map")
    labels = [ids[v] for v in raw]
    if len(names) < 2:
        raise PtplanError(f"{name}: every row has the label {names[0]!r}; classification needs two classes or more")
    if label_map == "auto":
        names = [spelled[n] for n in names]
    return names, labels, _tiny_classes(labels, names, name, label_column)


def _check_options(task: str, seq_len: int, split: float, eval_out: str | os.PathLike | None, seed: int,
                   text_column: str, label_column: str) -> None:
    """``prepare_data``'s options on their own, before any file is read."""
    if task not in TASKS:
        raise PtplanError(f"unknown --task {task!r}; use one of {', '.join(TASKS)}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise PtplanError(f"--seq-len must be at least 2 tokens, got {seq_len}")
    if split and not 0 < split < 1:
        raise PtplanError(f"--split must lie strictly between 0 and 1 (the held-out share), got {split}")
    if bool(split) != (eval_out is not None):
        raise PtplanError("--split and --eval-out go together: --split 0.2 --eval-out eval.pt holds out 20 % of the "
                          "rows")
    if not 0 <= seed < 2**32:
        raise PtplanError(f"--seed must lie in 0..{2**32 - 1}, got {seed}")
    if task == "classification" and text_column == label_column:
        raise PtplanError(f"--text-column and --label-column are both {text_column!r}: every text would be its own "
                          f"class; name the label column with --label-column NAME (or --task causal-lm for text "
                          f"without labels)")


def _padding_tokenizer(tokenizer: str | os.PathLike, seq_len: int, texts: int) -> Any:
    """The folder's tokenizer, checked against ``seq_len``, padding on the right (with its end token where it has
    no padding token, as decoder-only models do: padding is masked out anyway)."""
    tok = _load_tokenizer(tokenizer)
    check_seq_len(seq_len, tok, tokenizer, texts)
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise PtplanError(f"--tokenizer {tokenizer}: the tokenizer has neither a padding nor an end token; "
                              f"add a pad_token to its tokenizer_config.json")
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def prepare_data(src: str | os.PathLike, *, tokenizer: str | os.PathLike, seq_len: int, out: str | os.PathLike,
                 text_column: str = "text", label_column: str = "label", label_map: str = "auto",
                 task: str | None = None, split: float = 0.0, eval_out: str | os.PathLike | None = None,
                 seed: int = 0) -> Prepared:
    """Tokenize ``src`` (.csv/.jsonl) with the folder ``tokenizer``'s tokenizer into ``out`` (and, with
    ``split`` > 0, that share of the rows, stratified by class, into ``eval_out``), padded or cut to
    ``seq_len`` tokens. ``task`` None: from the folder (``default_task``). Each label is classed by
    ``label_key`` (numbers by value: 1, 1.0 and "1" are one class, in a CSV and a JSONL file alike; lists,
    objects, blanks and NaN are refused) and the classes map to 0..C-1 by ``label_map``: ``auto`` (the
    distinct labels, numbers in numeric order, else sorted) or a file (``read_label_map``); a label outside a
    given map is refused. Empty texts, the text column as the label column and a --seed outside 0..2**32-1
    are refused. Raises PtplanError before writing anything."""
    import torch

    task = task or default_task(tokenizer)
    _check_options(task, seq_len, split, eval_out, seed, text_column, label_column)
    name = os.fspath(src)
    table = read_table(src)
    texts = _column(table.rows, text_column, "text", table.columns, name, "pass --text-column NAME")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise PtplanError(f"{name} row {i + 1}: the text column {text_column!r} holds a "
                              f"{type(t).__name__} ({t!r}), expected text")
    names: list[str] = []
    labels: list[int] | None = None
    notes: list[str] = []
    if task == "classification":
        names, labels, notes = _class_labels(table, name, label_column, label_map)
    tok = _padding_tokenizer(tokenizer, seq_len, len(texts))
    full = tok(texts, truncation=False, add_special_tokens=True)["input_ids"]
    special = tok.num_special_tokens_to_add(pair=False)
    empty = [line for line, t, ids_ in zip(table.lines, texts, full) if not t.strip() or len(ids_) <= special]
    if empty:
        many = len(empty) > 1
        raise PtplanError(f"{name} line{'s' if many else ''} {_lines(empty)}: {len(empty)} text{'s' if many else ''} "
                          f"in the column {text_column!r} {'are' if many else 'is'} empty (blank, or only characters "
                          f"the tokenizer drops): samples of special tokens only; write the text{'s' if many else ''} "
                          f"in or drop {'those rows' if many else 'the row'}")
    truncated = sum(len(ids_) > seq_len for ids_ in full)
    enc = tok(texts, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    inputs = enc["input_ids"].to(torch.int64)
    mask = enc["attention_mask"].to(torch.int64)
    if inputs.shape[1] != seq_len:
        raise PtplanError(f"--tokenizer {tokenizer}: the tokenizer returned {inputs.shape[1]} tokens per text, not "
                          f"{seq_len}")
    if task == "causal-lm":
        y = inputs.masked_fill(mask == 0, -100)
        if bool((mask.sum(1) < 2).any()):
            bad = int((mask.sum(1) < 2).nonzero()[0]) + 1
            raise PtplanError(f"{name} row {bad}: fewer than two tokens, nothing to predict; drop empty texts")
    else:
        assert labels is not None
        y = torch.tensor(labels, dtype=torch.int64)
    meta = {"task": task, "seq_len": seq_len, "tokenizer": os.path.abspath(tokenizer), "source": os.path.abspath(name),
            "label_names": names, "text_column": text_column,
            "label_column": label_column if task == "classification" else None, "truncated": truncated}
    n = inputs.shape[0]
    if eval_out is None:
        _save_atomic([({"inputs": inputs, "attention_mask": mask, "labels": y, "meta": {**meta, "part": "all"}},
                       Path(out))])
        return Prepared(task=task, seq_len=seq_len, samples=n, label_names=names, truncated=truncated,
                        warnings=notes)
    train, held = _split(labels, n, split, seed)
    if not train or not held:
        raise PtplanError(f"{name}: {n} rows cannot be split {1 - split:.0%}/{split:.0%}; give more rows or another "
                          f"--split")

    def part(ix: list[int], what: str) -> dict[str, Any]:
        t = torch.tensor(ix, dtype=torch.int64)
        return {"inputs": inputs[t], "attention_mask": mask[t], "labels": y[t], "meta": {**meta, "part": what}}

    _save_atomic([(part(train, "train"), Path(out)), (part(held, "eval"), Path(eval_out))])
    return Prepared(task=task, seq_len=seq_len, samples=len(train), eval_samples=len(held), label_names=names,
                    truncated=truncated, warnings=notes)
