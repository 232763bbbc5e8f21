"""``ptplan compare``: predicted against measured per phase (pure, on hand-written run logs), the report
figure, and one real two-process run whose log carries peak memory (multi-process, gloo)."""
from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.cluster import get_preset
from ptplan.planner.compare import compare, format_comparison, read_run_log
from ptplan.planner.errors import PtplanError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.plan import save_plan
from ptplan.planner.planner import TrainingConfig, make_plan
from ptplan.planner.runlog import SCHEMA as RUNLOG_SCHEMA, RunLog
from ptplan.planner.synthetic import synthetic_profile
from ptplan.planner.report.viz import COMPARISON, FIGURES, build_figures, report_html


@pytest.fixture(scope="module")
def plan():
    prof = synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512, flops_per_s=1e9)
    return make_plan(prof, get_preset("cpu:2"), TrainingConfig(epochs=2, samples_per_epoch=64, batch=8, pin_K=2),
                     FreezePolicy(policy="manual", manual=(0, 2)))


def _records(plan, secs: dict[int, list[float]], mem: dict[int, int] | None = None, fingerprint=None) -> list[dict]:
    """Run-log records: header (its phases as ``ptplan run`` writes them), then per phase the given step seconds;
    step 2 of each phase samples memory."""
    fp = fingerprint or plan.inputs.profile.fingerprint
    recs = [{"type": "header", "schema": RUNLOG_SCHEMA, "plan_fingerprint": fp, "model": plan.inputs.profile.model,
             "world_size": plan.world_size, "plan": "/runs/plan.json",
             "phases": [dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M, b=p.micro_batch_size,
                             schedule=p.schedule) for p in plan.phases]}]
    step, prev = 0, None
    for ph, ss in secs.items():
        p = plan.phases[ph]
        if prev is not None:
            recs.append({"type": "transition", "step": step, "from_phase": prev, "to_phase": ph, "seconds": 0.01,
                         "parts": {"weights": 0.004, "rebuild": 0.006}})
        prev = ph
        for i, s in enumerate(ss):
            r = {"type": "step", "epoch": 0, "step": step, "phase": ph, "frozen_blocks": p.frozen_blocks, "K": p.K,
                 "D": p.D, "seconds": s, "samples": p.global_batch, "loss": 1.0, "allreduce_seconds": 0.0}
            if i == 1 and mem is not None:
                per_rank = [{"total": mem[ph] - 1000 * k} for k in range(p.K * p.D)]
                r.update(memory_sampled=True, peak_memory_bytes=mem[ph], memory={"per_rank": per_rank})
            recs.append(r)
            step += 1
    return recs


def _write(path, recs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _log(tmp_path, recs) -> RunLog:
    """The records through the run-log reader, as ``ptplan compare`` reads them."""
    return read_run_log(_write(tmp_path / "run.jsonl", recs))


def test_medians_errors_and_left_out_steps(plan, tmp_path):
    pred = [p.predicted.iteration_s for p in plan.phases]
    # first step (warm-up) and the memory-sampled second step are slow outliers and must be left out
    secs = {0: [9.0, 9.0, pred[0] * 2, pred[0] * 2, pred[0] * 4], 2: [9.0, 9.0, pred[2], pred[2] * 0.5, pred[2]]}
    mem = {0: plan.phases[0].predicted.stage_peak_memory_bytes[0] // 2, 2: max(plan.phases[2].predicted.stage_peak_memory_bytes)}
    c = compare(plan, _log(tmp_path, _records(plan, secs, mem)))
    r0, r2 = c.phases
    assert (r0.phase, r0.steps, r2.phase, r2.steps) == (0, 3, 2, 3)
    assert r0.measured_iteration_s == pytest.approx(pred[0] * 2)
    assert r0.iteration_error == pytest.approx(-0.5)
    assert r2.iteration_error == pytest.approx(0.0)
    assert r0.measured_samples_per_s == pytest.approx(plan.phases[0].global_batch / (pred[0] * 2))
    assert r0.measured_peak_memory_bytes == mem[0]
    assert r0.memory_error == pytest.approx(max(plan.phases[0].predicted.stage_peak_memory_bytes) / mem[0] - 1)
    assert r2.memory_error == pytest.approx(0.0)
    assert len(r0.measured_stage_memory_bytes) == plan.phases[0].K  # per stage, from the per-rank rows
    assert c.median_abs_iteration_error == pytest.approx(0.25)
    assert len(c.transitions) == 1
    text = format_comparison(c)
    assert "median |error|: iteration time 25.0%" in text and "-50.0%" in text and "0 -> 2" in text


def test_a_position_over_its_prediction_is_noted_behind_a_fuller_one(plan, tmp_path):
    """The mem err column compares each side's fullest device; a pipeline position measured above its own
    prediction while another position is the fullest (ZB-H1's last stage behind stage 0, measured 6 % over) is
    named with its numbers, and ``stage_memory_errors`` gives every position's error."""
    p = plan.phases[0]
    pred = p.predicted.device_peak_memory_bytes
    full = max(range(p.K), key=lambda s: pred[s])
    other = next(s for s in range(p.K) if s != full)
    got = {full: pred[full], other: int(pred[other] * 1.25)}
    recs = _records(plan, {0: [9.0, 1.0, 1.0]}, {0: max(got.values())})

    def per_rank(total):
        rows = [None] * (p.K * p.D)
        for row in p.ranks:
            for s, rank in enumerate(row):
                rows[rank] = {"total": total(s)}
        return {"per_rank": rows}

    recs[2]["memory"] = per_rank(got.get)
    c = compare(plan, _log(tmp_path, recs))
    r = c.phases[0]
    errs = r.stage_memory_errors
    assert errs[full] == pytest.approx(0.0) and errs[other] == pytest.approx(1 / 1.25 - 1, abs=1e-6)
    assert [x[0] for x in r.under_predicted_positions(0.05)] == [other]
    text = format_comparison(c)
    assert (f"note: phase 0, pipeline position {other}: measured {got[other] / 2**20:.2f} MiB against "
            f"{pred[other] / 2**20:.2f} MiB predicted (-20.0%)") in text
    # within 5 %: no note
    recs[2]["memory"] = per_rank(lambda s: int(pred[s] * 1.04))
    assert "pipeline position" not in format_comparison(compare(plan, _log(tmp_path, recs)))


def test_a_phase_with_only_the_memory_sampled_step_is_timed_on_it(plan, tmp_path):
    c = compare(plan, _log(tmp_path, _records(plan, {0: [9.0, 2.0]}, {0: 1 << 20})))
    r = c.phases[0]
    assert r.steps == 1 and r.measured_iteration_s == 2.0 and r.timed_with_memory_hooks
    assert "timed on the memory-sampled step" in format_comparison(c)
    again = _log(tmp_path, _records(plan, {0: [9.0, 2.0, 1.0]}, {0: 1 << 20}))
    assert not compare(plan, again).phases[0].timed_with_memory_hooks


def test_the_input_time_is_the_median_of_the_timed_steps_and_noted_when_large(plan, tmp_path):
    recs = _records(plan, {0: [9.0, 1.0, 1.0, 1.0]})
    steps = [r for r in recs if r["type"] == "step"]
    for r, d in zip(steps, (8.0, 0.5, 0.01, 0.2)):
        r["data_seconds"] = d
    c = compare(plan, _log(tmp_path, recs), warmup=1)
    assert c.phases[0].measured_data_s == pytest.approx(0.2)  # the warm-up step's 8 s left out with it
    assert "input: 200.0 ms of the step made the batch" in format_comparison(c)
    steps[3]["data_seconds"] = 0.04
    c = compare(plan, _log(tmp_path, recs), warmup=1)
    assert c.phases[0].measured_data_s == pytest.approx(0.04) and "input:" not in format_comparison(c)  # < 5 %
    old = [{k: v for k, v in r.items() if k != "data_seconds"} for r in recs]
    assert compare(plan, _log(tmp_path, old)).phases[0].measured_data_s is None  # a log from before the field


def test_warmup_zero_and_missing_memory(plan, tmp_path):
    c = compare(plan, _log(tmp_path, _records(plan, {0: [1.0, 3.0]})), warmup=0)
    assert c.phases[0].steps == 2 and c.phases[0].measured_iteration_s == 2.0
    assert c.phases[0].measured_peak_memory_bytes is None and c.median_abs_memory_error is None
    assert "peak memory not measured" in format_comparison(c)


def test_mismatched_run_log_is_refused(plan, tmp_path):
    with pytest.raises(PtplanError, match="fingerprint"):
        compare(plan, _log(tmp_path, _records(plan, {0: [1.0, 1.0, 1.0]}, fingerprint="0123456789abcdef")))
    bad = _records(plan, {0: [1.0, 1.0, 1.0]})
    bad[0]["phases"][0]["K"] = 7
    with pytest.raises(PtplanError, match="phase 0 ran with K=7 where this plan's phase 0 has K=2"):
        compare(plan, _log(tmp_path, bad))
    recs = _records(plan, {0: [1.0, 1.0, 1.0]})
    recs[2]["phase"] = 99
    with pytest.raises(PtplanError, match="phase 99 but the plan has"):
        compare(plan, _log(tmp_path, recs))
    recs = _records(plan, {0: [1.0, 1.0, 1.0]})
    recs[2]["D"] = 5
    with pytest.raises(PtplanError, match="with D=5 but the plan's phase 0 has D=1"):
        compare(plan, _log(tmp_path, recs))
    with pytest.raises(PtplanError, match="run more steps"):
        compare(plan, _log(tmp_path, _records(plan, {0: [1.0]})))


@pytest.fixture(scope="module")
def b4_plan(plan):
    """The fixture's plan with 4 samples per micro-batch instead of 1: the same frozen blocks, K, D and M per phase,
    a global batch of 32 instead of 8 (the audit's case: the run of one plan compared with another)."""
    other = make_plan(synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512, flops_per_s=1e9),
                      get_preset("cpu:2"), TrainingConfig(epochs=2, samples_per_epoch=256, batch=32, pin_K=2, pin_M=8),
                      FreezePolicy(policy="manual", manual=(0, 2)))
    same = [(p.frozen_blocks, p.K, p.D, p.M) for p in plan.phases]
    assert [(p.frozen_blocks, p.K, p.D, p.M) for p in other.phases] == same
    assert {(p.micro_batch_size, p.global_batch) for p in plan.phases} == {(1, 8)}
    assert {(p.micro_batch_size, p.global_batch) for p in other.phases} == {(4, 32)}
    return other


def test_a_run_of_another_micro_batch_size_is_refused(plan, b4_plan, tmp_path):
    """Frozen blocks, K, D and M agree but b does not: refused (it compared at +400 % time, blaming the profile),
    naming the phase, both b and global batches, and the plan the run ran; a log whose header predates b is
    refused by its steps' samples (the global batch)."""
    recs = _records(plan, {0: [1.0, 1.0, 1.0]})
    with pytest.raises(PtplanError) as e:
        compare(b4_plan, _log(tmp_path, recs))
    assert str(e.value).endswith("is not a run of this plan: phase 0 ran with b=1 (global batch 8) where this plan's "
                                 "phase 0 has b=4 (global batch 32); compare the run with the plan it ran "
                                 "(/runs/plan.json, as its header says)"), str(e.value)
    for ph in recs[0]["phases"]:
        del ph["b"], ph["schedule"]
    with pytest.raises(PtplanError, match=r"step 0 \(line 2\) ran phase 0 with samples=8 but the plan's phase 0 has "
                                          r"samples=32 \(D=1 x M=8 x b=4\); compare the run with the plan it ran"):
        compare(b4_plan, _log(tmp_path, recs))
    assert compare(plan, _log(tmp_path, recs)).phases[0].steps == 2  # its own plan: compared


def test_compare_and_show_refuse_a_run_of_another_plan_with_one_message(plan, b4_plan, tmp_path):
    pp = tmp_path / "plan-b4.json"
    save_plan(b4_plan, pp)
    log = _write(tmp_path / "run.jsonl", _records(plan, {0: [1.0, 1.0, 1.0]}))
    html = tmp_path / "mis.html"
    for args in (["compare", str(pp), log], ["show", str(pp), "--run", log, "--out", str(html)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        assert r.output.count("\n") == 1 and "phase 0 ran with b=1 (global batch 8)" in r.output, r.output
    assert not html.exists()


@pytest.mark.parametrize("edit, want", [
    (lambda h: h["phases"][1].update(schedule="gpipe"), "phase 1 ran with schedule='gpipe' where this plan's phase 1 "
                                                        "has schedule='1f1b'"),
    (lambda h: h["phases"][0].update(M=4, b=2), "phase 0 ran with M=4, b=2 (global batch 8) where this plan's phase 0 "
                                                "has M=8, b=1 (global batch 8)"),
    (lambda h: h.update(world_size=4), "the run had 4 processes and this plan has 2"),
    (lambda h: h["phases"].pop(), "the run's plan has 4 phases and this plan 5"),
])
def test_every_field_the_header_records_of_a_phase_is_compared(plan, tmp_path, edit, want):
    recs = _records(plan, {0: [1.0, 1.0, 1.0]})
    edit(recs[0])
    with pytest.raises(PtplanError) as e:
        compare(plan, _log(tmp_path, recs))
    assert want in str(e.value) and "compare the run with the plan it ran" in str(e.value), str(e.value)


@pytest.mark.parametrize("line, edit, want", [
    (3, dict(frozen_blocks=99), "step 1 (line 3) ran phase 0 with frozen_blocks=99 but the plan's phase 0 has "
                                "frozen_blocks=0"),
    (3, dict(K=1, D=2), "ran phase 0 with K=1, D=2 but the plan's phase 0 has K=2, D=1"),
    (3, dict(samples=16), "ran phase 0 with samples=16 but the plan's phase 0 has samples=8 (D=1 x M=8 x b=1)"),
    (3, dict(phase=99), "step 1 (line 3) refers to phase 99 but the plan has 5 phases"),
    (5, dict(to_phase=7), "line 5 (transition at step 3) refers to phase 7 but the plan has 5 phases"),
    (5, {"to": {"frozen_blocks": 3, "K": 2, "D": 1}}, "line 5 (transition at step 3): its to phase 2 ran with "
                                                      "frozen_blocks=3 where the plan's phase 2 has frozen_blocks=2"),
])
def test_every_field_a_step_or_transition_records_of_its_phase_is_compared(plan, tmp_path, line, edit, want):
    """A step's phase index, frozen blocks, K, D and samples (the global batch), a transition's phase indices and
    shapes: each must be the plan's phase's (a step of 99 frozen blocks was compared before)."""
    recs = _records(plan, {0: [1.0, 1.0, 1.0], 2: [1.0, 1.0, 1.0]})
    assert recs[line - 1]["type"] == ("step" if line == 3 else "transition")
    recs[line - 1].update(edit)
    with pytest.raises(PtplanError) as e:
        compare(plan, _log(tmp_path, recs))
    assert want in str(e.value) and "compare the run with the plan it ran" in str(e.value), str(e.value)


def test_a_log_with_two_headers_is_refused_naming_both_lines(plan, tmp_path):
    """Two runs' logs in one file (a second header): refused by the reader, not compared as one run."""
    recs = _records(plan, {0: [1.0, 1.0, 1.0]})
    path = _write(tmp_path / "run.jsonl", recs + recs)
    with pytest.raises(PtplanError, match=r"has a header on line 1 and another on line 5: .* compare each run's own "
                                          r"log \(lines 1\.\.4 are the first run's\)"):
        read_run_log(path)
    pp = tmp_path / "plan.json"
    save_plan(plan, pp)
    r = CliRunner().invoke(cli, ["compare", str(pp), path])
    assert r.exit_code == 2 and "line 1 and another on line 5" in r.output and "Traceback" not in r.output, r.output


def test_cli_table_json_and_errors(plan, tmp_path):
    pp = tmp_path / "plan.json"
    save_plan(plan, pp)
    pred = plan.phases[0].predicted.iteration_s
    log = _write(tmp_path / "run.jsonl", _records(plan, {0: [1.0, 1.0, pred, pred]}, {0: 1 << 20}))
    out = tmp_path / "cmp.json"
    r = CliRunner().invoke(cli, ["compare", str(pp), log, "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "pred s/it" in r.output and "median |error|: iteration time 0.0%" in r.output
    data = json.loads(out.read_text())
    assert data["phases"][0]["measured_peak_memory_bytes"] == 1 << 20 and data["median_abs_iteration_error"] == 0
    bad = _write(tmp_path / "bad.jsonl", _records(plan, {0: [1.0, 1.0, 1.0]}, fingerprint="ffffffffffffffff"))
    r = CliRunner().invoke(cli, ["compare", str(pp), bad])
    assert r.exit_code == 2 and "fingerprint" in r.output
    # a broken line inside the log is refused (only a torn last line is left out, with a warning)
    (tmp_path / "junk.jsonl").write_text("{not json\n" + (tmp_path / "run.jsonl").read_text())
    r = CliRunner().invoke(cli, ["compare", str(pp), str(tmp_path / "junk.jsonl")])
    assert r.exit_code == 2 and "line 1 is not JSON" in r.output


def test_report_figure_and_show_run(plan, tmp_path):
    c = compare(plan, _log(tmp_path, _records(plan, {0: [1.0, 1.0, 0.5, 0.5], 2: [1.0, 1.0, 0.2]},
                                              {0: 1 << 20, 2: 1 << 19})))
    figs = build_figures(plan, c)
    assert list(figs) == [*FIGURES, COMPARISON]
    fig = figs[COMPARISON]
    assert [t.name for t in fig.data] == ["Predicted", "Measured", "Predicted", "Measured"]
    assert len(fig.data[1].x) == 2 and fig.data[1].text[0] == f"{c.phases[0].iteration_error:+.0%}"
    assert list(build_figures(plan)) == list(FIGURES)  # without a run: the five figures only
    html = report_html(plan, comparison=c)
    assert html.count('class="plotly-graph-div"') == len(FIGURES) + 1 and 'id="fig-comparison"' in html
    pp = tmp_path / "plan.json"
    save_plan(plan, pp)
    log = _write(tmp_path / "run.jsonl", _records(plan, {0: [1.0, 1.0, 0.5]}))
    r = CliRunner().invoke(cli, ["show", str(pp), "--run", log, "--out", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output
    assert 'id="fig-comparison"' in (tmp_path / "r.html").read_text()


# ---- a real run: the log carries peak memory and compares without error ------------------------------

@pytest.mark.multiproc
def test_real_run_logs_peak_memory_and_compares(tmp_path):
    import torch

    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.data.dataset import SyntheticDataset
    from ptplan.executor.families.models import build_model
    from ptplan.executor.profiling.profiler import profile_model
    from ptplan.executor.training.runlog import read_records
    from ptplan.executor.launch.local import run_world
    from ptplan.executor.training.loop import run_training

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("bert-tiny", seq_len=8, dropout=0.0)
        prof = profile_model(model, device="cpu", batch_sizes=[1, 2], warmup=0, repeats=1, progress=False)
    finally:
        torch.set_num_threads(before)
    plan = make_plan(prof, get_preset("cpu:2"), TrainingConfig(epochs=2, samples_per_epoch=32, batch=4, pin_K=2),
                     FreezePolicy(policy="manual", manual=(0, 2)))
    log = str(tmp_path / "run.jsonl")
    cfg = RunConfig(plan="(test)", model="bert-tiny", steps_per_epoch=3, epochs=2, progress=False, timeout_s=60,
                    log=log, dropout=0.0)
    ds = SyntheticDataset(model, 3 * 4)

    def worker(rank: int, world: int) -> None:
        run_training(cfg, plan, model, ds)

    res = run_world(2, worker, tmpdir=str(tmp_path), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    steps = [r for r in read_records(log) if r["type"] == "step"]
    sampled = [r for r in steps if r.get("memory_sampled")]
    assert [r["step"] for r in sampled] == [1, 4]  # the 2nd step of each phase
    for r in sampled:
        rows = r["memory"]["per_rank"]
        assert len(rows) == 2 and r["peak_memory_bytes"] == max(x["total"] for x in rows)
        for x in rows:
            assert x["params"] > 0 and x["grads"] > 0 and x["optimizer"] == pytest.approx(2 * x["grads"], rel=0.01)
            assert x["activations"] > 0 and x["buffers"] > 0  # K=2: both stages hold receive buffers
            assert x["total"] == x["params"] + x["grads"] + x["optimizer"] + x["buffers"] + x["activations"]
    assert all(0 <= r["data_seconds"] <= r["seconds"] for r in steps)  # the batch is made inside the step
    c = compare(plan, read_run_log(log))
    assert [r.phase for r in c.phases] == [0, 2] and all(r.steps == 1 for r in c.phases)
    assert all(r.measured_data_s is not None for r in c.phases)
    assert all(r.measured_peak_memory_bytes for r in c.phases)
    assert c.median_abs_memory_error < 0.25  # the plan's memory model matches what the stage holds
    assert os.path.getsize(log) > 0


@pytest.mark.parametrize("edit, field, want", [
    (lambda r: r[1].update(bogus=1), "line 2.bogus", "unknown key"),
    (lambda r: r[1].update(K="two"), "line 2.K", "integer"),
    (lambda r: r[1].pop("loss"), "line 2.loss", "missing"),
    (lambda r: r[1].update(seconds=float("nan")), "line 2.seconds", "finite"),
    (lambda r: r[0].update(world_size=1.5), "line 1.world_size", "integer"),
    (lambda r: r[1].update(type="stepp"), "line 2", "type"),
])
def test_run_log_records_are_checked_field_by_field(plan, tmp_path, edit, field, want):
    """The run log's one reader (planner/runlog.py) refuses a bad record naming the line and the field, and
    ``ptplan compare`` turns it into one message with exit code 2."""
    recs = _records(plan, {0: [1.0, 1.0, 1.0]})
    edit(recs)
    path = _write(tmp_path / "run.jsonl", recs + _records(plan, {0: [1.0]})[1:])  # the bad line is not the last
    with pytest.raises(PtplanError) as e:
        read_run_log(path)
    assert field in str(e.value) and want in str(e.value), str(e.value)
    pp = tmp_path / "plan.json"
    save_plan(plan, pp)
    r = CliRunner().invoke(cli, ["compare", str(pp), path])
    assert r.exit_code == 2 and field in r.output, r.output
