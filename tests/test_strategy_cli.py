"""``ptplan plan --strategies`` (issue 14): the memory-bound model refused off and planned auto, the plan's
strategy fields round-trip and are validated on load, and ``ptplan run``'s check refuses what the executor
does not run (tensor parallelism for a family it does not split; strategies in 2BW phases)."""
from __future__ import annotations

import re

import json

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.errors import PtplanError
from ptplan.planner.jsonio import SchemaError
from ptplan.planner.plan import load_plan, save_plan
from ptplan.planner.profile import save_profile
from ptplan.planner.synthetic import synthetic_profile

ARGS = ["--cluster", "h100-4node", "--batch", "32", "--samples-per-epoch", "1024", "--epochs", "2",
        "--allow-extrapolation"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    d = tmp_path_factory.mktemp("strategies")
    prof = d / "big.json"
    save_profile(synthetic_profile(num_blocks=2, hidden=32768, seq_len=1024, vocab=32000, batch_sizes=(1, 2, 4)), prof)
    off = CliRunner().invoke(cli, ["plan", str(prof), *ARGS, "--out", str(d / "off.json")])
    auto = CliRunner().invoke(cli, ["plan", str(prof), *ARGS, "--strategies", "auto", "--out", str(d / "auto.json")])
    return d, off, auto


def test_off_refuses_the_memory_bound_model_and_auto_plans_it(planned):
    d, off, auto = planned
    assert off.exit_code == 2, off.output
    assert "layer 2 alone needs" in off.output and "--strategies auto" in off.output
    assert not (d / "off.json").exists()
    assert auto.exit_code == 0, auto.output
    assert "strategy" in auto.output and "tp" in auto.output
    plan = load_plan(d / "auto.json")
    # every phase that trains or holds a 34 GB MLP half on its GPUs splits or shards it (a phase that trained
    # just the head with the whole frozen prefix in the AutoCache could run plain data parallel; this plan
    # runs that phase's prefix split over tp2 instead, uncached)
    for ph in plan.phases:
        assert ph.tp > 1 or ph.fsdp or (ph.cache and ph.frozen_layers >= 5), ph
    assert plan.world_size == 32 and all(ph.world == 32 for ph in plan.phases)
    assert all(ph.predicted.peak_memory_bytes <= 80 * 2**30 * 0.9 for ph in plan.phases)


def test_strategy_fields_round_trip_and_are_validated(planned, tmp_path):
    d, _, _ = planned
    plan = load_plan(d / "auto.json")
    save_plan(plan, tmp_path / "again.json")
    again = load_plan(tmp_path / "again.json")
    assert [(p.tp, p.fsdp, p.recompute, p.ranks) for p in again.phases] == \
        [(p.tp, p.fsdp, p.recompute, p.ranks) for p in plan.phases]
    raw = json.loads((d / "auto.json").read_text())
    raw["phases"][0]["tp"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(SchemaError, match="power of two"):
        load_plan(tmp_path / "bad.json")
    raw["phases"][0]["tp"] = 1  # then the ranks no longer cover the world
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(SchemaError):
        load_plan(tmp_path / "bad.json")


def test_run_accepts_the_strategies_it_runs_and_refuses_the_rest(planned):
    """The executor runs recomputation, FSDP and tensor parallelism for every family, tp x FSDP on a 2-D mesh
    included (tests/test_hybrid_runtime.py, tests/test_tp_families.py): the synthetic GPT's plan (tp8, stage 0
    recomputing its first layers) passes ``ptplan run``'s check, and so does it with tp x FSDP on every stage
    where D > 1, and for ViT and Llama; for a family without a split (a custom model's) it is refused with the
    fix, and so is 2BW with it."""
    import dataclasses

    from ptplan.executor.training.validate import check_strategies, check_world

    d, _, _ = planned
    check_world(load_plan(d / "auto.json"), 32)
    plan = load_plan(d / "auto.json")
    plan = dataclasses.replace(plan, phases=tuple(dataclasses.replace(ph, fsdp=True, recompute_layers=())
                                                  if ph.D > 1 and ph.tp > 1 else ph for ph in plan.phases))
    assert any(ph.tp > 1 and ph.fsdp for ph in plan.phases)
    check_world(plan, 32)

    def as_family(family):
        return dataclasses.replace(plan, inputs=dataclasses.replace(
            plan.inputs, profile=dataclasses.replace(plan.inputs.profile, family=family)))

    check_strategies(as_family("vit"))
    check_strategies(as_family("llama"))
    from ptplan.executor.runtime.hybrid import tp_families

    assert {"bert", "roberta", "distilbert", "vit", "gpt2", "llama", "mistral", "qwen2"} <= set(tp_families())
    with pytest.raises(PtplanError, match=r"plan phase 0 \(0 frozen blocks, tp\d.*\): the executor splits "
                                          + re.escape(", ".join(tp_families())) + r" layers for tensor "
                                          r"parallelism but this plan's model is a custom.*--strategies off"):
        check_strategies(as_family("custom"))
    twobw = dataclasses.replace(plan, phases=tuple(dataclasses.replace(ph, schedule="2bw") for ph in plan.phases))
    with pytest.raises(PtplanError, match=r"2bw with tp\d.*fsdp.* is not run by the executor"):
        check_strategies(twobw)


def test_report_draws_a_plan_with_tensor_parallel_groups(planned):
    from ptplan.planner.report.viz import report_html

    d, _, _ = planned
    html = report_html(load_plan(d / "auto.json"))
    assert "Rank 31" in html  # every rank of every tp group is drawn, not only each group's first


def test_table_and_report_show_each_phase_mesh(planned, tmp_path):
    """The CLI table gives each phase's mesh K×D×tp beside its strategy, and ``ptplan show`` names both in
    the report (titles and the phase table)."""
    d, _, auto = planned
    plan = load_plan(d / "auto.json")
    lines = auto.output.splitlines()
    head = next(line for line in lines if line.lstrip().startswith("phase") and "strategy" in line)
    assert "mesh K×D×tp" in head
    col = head.index("mesh K×D×tp")
    for i, ph in enumerate(plan.phases):
        row = next(line for line in lines if line.startswith(f"{i:>4}") and ph.strategy_label in line)
        assert row[col:].split()[0] == f"{ph.K}×{ph.D}×{ph.tp}", row
        assert ph.K * ph.D * ph.tp == plan.world_size
    out = CliRunner().invoke(cli, ["show", str(d / "auto.json"), "--out", str(tmp_path / "r.html")])
    assert out.exit_code == 0, out.output
    # the figures' titles sit in plotly's JSON: with orjson installed plotly writes '·' and '×' as they are,
    # without it (json) as \u00b7 and \u00d7 -- the same text either way
    html = (tmp_path / "r.html").read_text().replace("\\u00b7", "·").replace("\\u00d7", "×")
    # every phase splits: the head-only phase (both blocks frozen) runs its prefix split tp2, uncached
    assert all(ph.tp > 1 for ph in plan.phases)
    for ph in plan.phases:
        if ph.strategy_label != "dp":
            assert f"{ph.strategy_label} (mesh K × D × tp = {ph.K} × {ph.D} × {ph.tp})" in html
        assert f"{ph.K} × {ph.D} × {ph.tp}: " in html
    assert "Strategy (mesh K × D × tp)" in html
