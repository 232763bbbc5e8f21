"""``ptplan data``: tokenize a CSV/JSONL file of texts (and labels) into the .pt file ``ptplan run --data`` reads."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import click

from ptplan.planner.errors import PtplanError


@click.command("data")
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False))
@click.option("--tokenizer", required=True, type=click.Path(),
              help="Local Hugging Face model or tokenizer folder (the --weights folder of the run).")
@click.option("--seq-len", type=int, default=None,
              help="Tokens per sample: pad or cut every text to it (the plan's sequence length).")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="Take the sequence length from this plan's profile instead of --seq-len (give one of the two).")
@click.option("--out", required=True, help="Training file to write (.pt).")
@click.option("--text-column", default="text", show_default=True)
@click.option("--label-column", default="label", show_default=True, help="Classification only.")
@click.option("--label-map", default="auto", show_default=True,
              help="'auto' (the distinct labels: numbers in numeric order, else sorted), a JSON file (a list of "
                   "names in class order, or {name: id}) or a .pt file written by ptplan data (its map). A label "
                   "is its text, trimmed, with numbers by value: 1, 1.0, \"1\" and 01 are one class, in a CSV and "
                   "a JSONL file alike; lists, objects, blanks, NaN and infinities are refused.")
@click.option("--task", type=click.Choice(["classification", "causal-lm"]), default=None,
              help="[default: causal-lm when the folder's config.json is a decoder-only model (gpt2, llama, "
                   "mistral, qwen2), else classification]. causal-lm: no labels, next-token loss on the ids.")
@click.option("--split", type=float, default=0.0, help="Hold out this share of the rows (stratified by class).")
@click.option("--eval-out", default=None,
              help="Held-out file to write with --split (ptplan run --eval-data).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the split (0..2**32-1).")
def data(src: str, tokenizer: str, seq_len: int | None, plan_path: str | None, out: str, text_column: str,
         label_column: str, label_map: str, task: str | None, split: float, eval_out: str | None, seed: int) -> None:
    """Tokenize IN (.csv with a header line, or .jsonl) into the training format of ``ptplan run --data``.

    \b
    ptplan data reviews.csv --tokenizer ./minilm --seq-len 64 --out train.pt --split 0.2 --eval-out eval.pt
    ptplan data corpus.jsonl --tokenizer ./llama --plan plan.json --out lm.pt      (causal LM: no labels)
    """
    from ptplan.cli.main import check_outputs

    if seq_len is None and plan_path is None:
        raise PtplanError("give the sequence length: --seq-len N, or --plan PLAN to use the plan's")
    if plan_path is not None:
        from ptplan.planner.plan import load_plan

        planned = load_plan(plan_path).inputs.profile.seq_len
        if seq_len is not None:
            raise PtplanError(f"--seq-len {seq_len} and --plan {plan_path} (sequence length {planned}) both give the "
                              f"sequence length; give one: --plan alone takes the plan's {planned}")
        seq_len = planned
    assert seq_len is not None
    if label_map != "auto" and not os.path.isfile(label_map):
        raise PtplanError(f"--label-map {label_map}: no such file; give 'auto' or a JSON/.pt file")
    check_outputs([("input", src), ("--label-map file", None if label_map == "auto" else label_map),
                   ("plan", plan_path)], [("--out", out), ("--eval-out", eval_out)])
    if not out.endswith(".pt") or (eval_out is not None and not eval_out.endswith(".pt")):
        raise PtplanError(f"--out {out}{'' if eval_out is None else f' / --eval-out {eval_out}'}: write .pt files "
                          f"(what ptplan run --data reads)")
    from ptplan.executor.data.prep import prepare_data

    with _no_length_warning():  # texts are cut to --seq-len: transformers' "(706 > 512) ... errors" is noise
        got = prepare_data(src, tokenizer=tokenizer, seq_len=seq_len, out=out, text_column=text_column,
                           label_column=label_column, label_map=label_map, task=task, split=split,
                           eval_out=eval_out, seed=seed)
    _umask_permissions(out, eval_out)
    for note in got.warnings:
        click.echo(f"warning: {note}", err=True)
    where = out if eval_out is None else f"{out} and {got.eval_samples} held out to {eval_out}"
    click.echo(f"ptplan data: {got.samples} samples of {got.seq_len} tokens ({got.task}) to {where}")
    if got.truncated:
        click.echo(f"  {got.truncated} texts were longer than {got.seq_len} tokens and were cut")
    if got.task == "classification":
        shown = ", ".join(f"{c}={n}" for c, n in enumerate(got.label_names[:20]))
        more = f", ... ({len(got.label_names)} in all)" if len(got.label_names) > 20 else ""
        click.echo(f"  labels: {shown}{more}; train with --num-labels {len(got.label_names)} "
                   f"(the map is recorded in {out}: --label-map {out} reuses it)")
    click.echo(f"  plan with `ptplan plan PROFILE --data {out}`: {got.samples} samples per epoch, "
               f"{got.seq_len} tokens per sample")


@contextlib.contextmanager
def _no_length_warning() -> Iterator[None]:
    """Silence transformers' "Token indices sequence length is longer than the specified maximum" while
    tokenizing: ptplan data truncates every text to --seq-len itself (and prints how many it cut)."""
    import logging

    log = logging.getLogger("transformers.tokenization_utils_base")
    before = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(before)


def _umask_permissions(*paths: str | None) -> None:
    """Give the written files the permissions of any new file (0666 less the umask), not the 0600 of the
    temporary files they were renamed from."""
    mask = os.umask(0)
    os.umask(mask)
    for p in paths:
        if p is not None and os.path.isfile(p):
            os.chmod(p, 0o666 & ~mask)
