"""``ptplan compare`` prices each step as the kind of step it was: AutoCache fill/refresh steps against the plan's
``fill_iteration_s`` (weighted by the share of rows computed), the others against ``iteration_s``; and the AutoCache's
rows and RAM are the planner's model (``planner/cache_size.py``): a bf16 model's ``cache_setup`` record carries the
plan's dtype and bytes. Hand-written run logs, then one real 1-process CPU run of a bf16 bert-tiny with the cache on."""
from __future__ import annotations

import json
import os

import pytest

from ptplan.planner.cache_size import cache_bytes, rows_bytes, slab_file_bytes
from ptplan.planner.cluster import get_preset
from ptplan.planner.compare import compare, fill_fractions, format_comparison
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.planner import TrainingConfig, make_plan
from ptplan.planner.runlog import SCHEMA as RUNLOG_SCHEMA, read_run_log
from ptplan.planner.synthetic import synthetic_profile


@pytest.fixture(scope="module")
def plan():
    prof = synthetic_profile(num_blocks=4, hidden=64, seq_len=16, vocab=512, flops_per_s=1e9)
    return make_plan(prof, get_preset("cpu:2"), TrainingConfig(epochs=3, samples_per_epoch=64, batch=8, pin_K=2,
                                                               cache="on"),
                     FreezePolicy(policy="manual", manual=(0, 2, 3)))


def _step(plan, epoch: int, step: int, ph: int, seconds: float, **kw) -> dict:
    p = plan.phases[ph]
    return {"type": "step", "epoch": epoch, "step": step, "phase": ph, "frozen_blocks": p.frozen_blocks, "K": p.K,
            "D": p.D, "seconds": seconds, "samples": p.global_batch, "loss": 1.0, **kw}


def _cache(epoch: int, step: int, caches: bool, hits: int = 0, refreshes: int = 0, misses: int = 0) -> dict:
    zero = dict.fromkeys(("rows_not_cached", "slabs_evicted", "bytes_evicted", "slabs_promoted", "ram_bytes",
                          "disk_bytes", "ram_slabs", "disk_slabs"), 0)
    return {"type": "cache", "epoch": epoch, "step": step, "frozen_layers": 0, "phase_caches": caches, "hits": hits,
            "refreshes": refreshes, "misses": misses, "rows_written": misses + refreshes, **zero, "totals": {}}


def _setup(plan, **kw) -> dict:
    """The ``cache_setup`` record of a run of ``plan`` (its caching phases and their frozen-layer counts)."""
    phases = [i for i, p in enumerate(plan.phases) if p.cache and p.frozen_layers]
    return {"type": "cache_setup", "job_id": "j", "nodes": 1, "dir": "/x", "spill_dir": None, "budget_bytes": 8,
            "need_bytes": 8, "plan_bytes_per_node": 4, "sample_shape": [16, 64], "dtype": "float32", "samples": 64,
            "shard_rows": 64, "phases": phases, "frozen_layers": sorted({plan.phases[i].frozen_layers for i in phases}),
            "allow_nondeterministic": False, "notes": [], **kw}


def _log(plan, tmp_path, recs):
    head = {"type": "header", "schema": RUNLOG_SCHEMA, "plan_fingerprint": plan.inputs.profile.fingerprint,
            "model": plan.inputs.profile.model, "world_size": plan.world_size,
            "phases": [dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M) for p in plan.phases]}
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [head, *recs]))
    return read_run_log(path)


def test_fill_epochs_are_compared_with_the_fill_price(plan, tmp_path):
    """The lent-H100 run's case: epochs whose ``cache`` record says every row missed (a fill) or was refreshed,
    timed exactly as the plan prices them, compare at 0 % error; before, their steps were set against the
    steady ``iteration_s`` (there -55..-69 % instead of the fill's own error)."""
    p0, p2, p3 = plan.phases[0], plan.phases[2], plan.phases[3]
    assert p2.cache and p3.cache and p2.predicted.fill_iteration_s > p2.predicted.iteration_s
    recs = [_step(plan, 0, s, 0, p0.predicted.iteration_s) for s in range(4)] + [_cache(0, 4, False)]
    recs += [_step(plan, 1, s, 2, p2.predicted.fill_iteration_s) for s in range(4, 8)] + [_cache(1, 8, True, misses=64)]
    recs += [_step(plan, 2, s, 3, p3.predicted.fill_iteration_s) for s in range(8, 12)]
    recs += [_cache(2, 12, True, refreshes=64)]
    c = compare(plan, _log(plan, tmp_path, recs))
    assert [r.phase for r in c.phases] == [0] and [(r.phase, r.kind) for r in c.fills] == [(2, "fill"), (3, "fill")]
    for r, p in zip(c.fills, (p2, p3)):
        assert r.predicted_iteration_s == pytest.approx(p.predicted.fill_iteration_s) and r.fill_fraction == 1.0
        assert r.iteration_error == pytest.approx(0.0, abs=1e-12) and r.steps == 3
    assert c.median_abs_iteration_error == pytest.approx(0.0, abs=1e-12)
    text = format_comparison(c)
    assert "\n   2f " in text and "cache fill: 100% of the prefix rows computed" in text
    assert [f["kind"] for f in c.to_json()["fills"]] == ["fill", "fill"]


def test_a_fill_row_off_by_more_than_the_threshold_is_explained_and_labelled(plan, tmp_path):
    """A docs walk saw `ptplan compare` list fill rows at -59 % and explain only phase 0: the explanation read the
    steady rows alone, and nothing said what "2f" is. Fill rows are explained with their own terms now, and the
    table says what Nf is."""
    from ptplan.planner.explain import explain

    p0, p2 = plan.phases[0], plan.phases[2]
    recs = [_step(plan, 0, s, 0, p0.predicted.iteration_s) for s in range(4)] + [_cache(0, 4, False)]
    recs += [_step(plan, 1, s, 2, 2.5 * p2.predicted.fill_iteration_s) for s in range(4, 8)]
    recs += [_cache(1, 8, True, misses=64), _setup(plan)]
    c = compare(plan, _log(plan, tmp_path, recs))
    lines = explain(plan, c, None)
    fill = [ln for ln in lines if ln.startswith("  phase 2f (-60.0%): the AutoCache fill differs -- its steps took")]
    assert len(fill) == 1 and "100% of the prefix rows computed and written" in fill[0], lines
    assert not any(ln.startswith("  phase 0 ") for ln in lines), lines  # on its prediction: not listed
    text = format_comparison(c)
    assert "(Nf: phase N's AutoCache fill steps" in text and "it err" in text and "mem err" in text, text


def test_per_step_rows_split_a_phase_into_fill_and_steady_rows(plan, tmp_path):
    """Per-step ``cache_*`` fields (what ``ptplan run`` logs now) beat the epoch's record: steps that read every row
    are steady, a step that computed half its rows is priced halfway to the fill; memory is compared once, on the
    steady row."""
    p2 = plan.phases[2]
    it, fill = p2.predicted.iteration_s, p2.predicted.fill_iteration_s
    half = it + 0.5 * (fill - it)
    recs = [_step(plan, 0, 0, 2, fill, cache_hits=0, cache_refreshes=0, cache_misses=4),  # warm-up: left out
            _step(plan, 0, 1, 2, fill, cache_hits=0, cache_refreshes=0, cache_misses=4, memory_sampled=True,
                  peak_memory_bytes=10 ** 6, memory={"per_rank": [{"total": 10 ** 6}, {"total": 10 ** 6}]}),
            _step(plan, 0, 2, 2, fill, cache_hits=0, cache_refreshes=4, cache_misses=0),
            _step(plan, 0, 3, 2, half, cache_hits=2, cache_refreshes=0, cache_misses=2),
            _cache(0, 4, True, misses=64),  # the epoch says all missed: the per-step fields win
            _step(plan, 1, 4, 2, it, cache_hits=4, cache_refreshes=0, cache_misses=0),
            _step(plan, 1, 5, 2, it, cache_hits=4, cache_refreshes=0, cache_misses=0)]
    log = _log(plan, tmp_path, recs)
    assert fill_fractions(log) == {0: 1.0, 1: 1.0, 2: 1.0, 3: 0.5, 4: 0.0, 5: 0.0}
    c = compare(plan, log)
    (steady,), (fills,) = c.phases, c.fills
    assert steady.steps == 2 and steady.predicted_iteration_s == pytest.approx(it) and steady.iteration_error == 0
    assert fills.steps == 2 and fills.fill_fraction == 0.75  # the memory-sampled step 1 is not timed
    assert fills.predicted_iteration_s == pytest.approx((fill + half) / 2)
    assert steady.measured_peak_memory_bytes == 10 ** 6 and fills.measured_peak_memory_bytes is None


def test_steps_of_a_non_caching_epoch_stay_steady(plan, tmp_path):
    """A ``cache`` record of a phase that does not cache, or a log without cache records: every step is steady."""
    p0 = plan.phases[0]
    recs = [_step(plan, 0, s, 0, p0.predicted.iteration_s) for s in range(3)] + [_cache(0, 3, False, misses=24)]
    log = _log(plan, tmp_path, recs)
    assert fill_fractions(log) == {}
    c = compare(plan, log)
    assert c.fills == () and c.phases[0].kind == "steady" and c.phases[0].iteration_error == 0


def test_slab_sizes_are_the_stores():
    """``cache_size`` is what the store allocates: a slab file per shard, the refresh's second count alike."""
    from ptplan.executor.cache.store import SlabInfo

    for rows, row in ((4, 70), (170, 196608), (1, 1)):
        info = SlabInfo(frozen_layers=1, shard=0, first=0, rows=rows, shape=(row,), dtype="bfloat16", tag="")
        assert info.file_bytes == slab_file_bytes(rows, 2 * row)
    # the lent H100 run: 3200 samples of 128 x 768 float32 in 19 slabs, at two counts
    assert cache_bytes(3200, 128 * 768 * 4, 128 * 768 * 4) == 2 * rows_bytes(3200, 128 * 768 * 4) == 2_516_893_696


def test_the_step_after_an_evaluation_is_a_warm_up_step(plan, tmp_path):
    """An evaluation (or a checkpoint, an export) drains the stage before the next step (2BW's updates, tp/FSDP's
    shards rebuilt by that step): that step is left out like a visit's first."""
    p0 = plan.phases[0]
    it = p0.predicted.iteration_s
    recs = [_step(plan, 0, s, 0, it if s != 3 else 100 * it) for s in range(6)]
    recs.insert(3, {"type": "eval", "epoch": 0, "step": 3, "phase": 0, "loss": 1.0, "samples": 8, "seconds": 0.5})
    (row,) = compare(plan, _log(plan, tmp_path, recs)).phases
    assert row.steps == 4 and row.iteration_error == 0  # steps 1, 2, 4, 5: step 0 warms up, step 3 follows the eval


def test_a_run_in_another_dtype_than_the_profile_is_named(plan, tmp_path):
    """The lent H100 run: float32 parameters (2x the bf16 plan's weights) and float32 AutoCache rows: compare says
    so with the bytes; parameters as planned say nothing."""
    p2 = plan.phases[2]
    weights = [int(m.weights) for m in p2.predicted.stage_memory]
    setup = _setup(plan, dtype="float64")

    def run(scale: int, dtype: str):
        per_rank = [{"total": 10 ** 6, "params": scale * w} for w in weights]
        recs = [{**setup, "dtype": dtype}] + [_step(plan, 0, s, 2, 0.1, memory_sampled=s == 1, **(
            {"peak_memory_bytes": 10 ** 6, "memory": {"per_rank": per_rank}} if s == 1 else {})) for s in range(3)]
        return compare(plan, _log(plan, tmp_path, recs)).mismatches

    assert plan.inputs.profile.dtype == "float32"
    assert run(1, "float32") == ()
    rows, params = run(2, "float64")
    assert "stored float64 rows" in rows and "priced float32" in rows
    assert params.startswith(f"the run's parameters take 2.00x the plan's weights (phase 2: {2 * sum(weights):,} vs ")


def test_a_run_that_cached_other_phases_than_the_plan_is_refused(plan, tmp_path):
    """The ``cache_setup`` record says which phases the run cached and at which frozen-layer counts: a run of another
    plan (other caching phases) is refused with both lists; a run without the AutoCache (``--cache off``) in a phase
    the plan caches is compared, with a note saying its steps computed the prefix."""
    from ptplan.planner.errors import PtplanError

    steps = [_step(plan, 0, s, 2, 0.1) for s in range(3)]
    assert compare(plan, _log(plan, tmp_path, [_setup(plan), *steps])).mismatches == ()
    other = _setup(plan, phases=[2], frozen_layers=[plan.phases[2].frozen_layers])
    with pytest.raises(PtplanError) as e:
        compare(plan, _log(plan, tmp_path, [other, *steps]))
    assert "line 2: the run's AutoCache cached the frozen prefix in phases [2] (frozen layers [5]), but this plan " \
           "caches it in phases [1, 2, 3, 4] (frozen layers [3, 5, 7, 9]); compare the run with the plan it ran" \
           in str(e.value), str(e.value)
    (note,) = compare(plan, _log(plan, tmp_path, steps)).mismatches
    assert "caches the frozen prefix in phases [2], which the run reached, but the run set up no AutoCache" in note
    assert compare(plan, _log(plan, tmp_path, [_step(plan, 0, s, 0, 0.1) for s in range(3)])).mismatches == ()


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny", "llama-tiny"])
def test_rows_are_stored_in_the_dtype_the_prefix_outputs(name):
    """The cache stores rows in the model's parameter dtype (``cache.run.setup_cache``): that is what every cacheable
    prefix outputs, for a bf16 model (bf16) and under ``--precision bf16`` autocast of a float32 model (float32: the
    residual stream leaves each block in float32), so storing never rounds a row."""
    import torch

    from ptplan.executor.data.dataset import SyntheticDataset
    from ptplan.executor.families.models import build_model

    for dtype, amp in ((torch.bfloat16, False), (torch.float32, True)):
        model = build_model(name, seq_len=8, dropout=0.0, dtype=dtype)
        x, _, mask = SyntheticDataset(model, 2).batch(torch.tensor([0, 1]))
        ends = [f for f in range(1, len(model.layers)) if model.specs[f - 1].kind in ("embedding", "block",
                                                                                      "attention", "mlp")]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            got = {model.run_layers(x, 0, f, mask).dtype for f in ends}
        assert got == {next(model.parameters()).dtype} == {dtype}, (name, amp, got)


# ---- a real run: bf16 bert-tiny, one process, the cache on ---------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    import torch

    from ptplan.executor.data.dataset import SyntheticDataset
    from ptplan.executor.families.models import build_model
    from ptplan.executor.launch.local import run_world
    from ptplan.executor.profiling.profiler import profile_model
    from ptplan.executor.training.config import RunConfig
    from ptplan.executor.training.loop import run_training

    tmp = tmp_path_factory.mktemp("bf16run")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("bert-tiny", seq_len=8, dropout=0.0, dtype=torch.bfloat16)
        prof = profile_model(model, device="cpu", batch_sizes=[2, 4], warmup=0, repeats=1, progress=False)
    finally:
        torch.set_num_threads(before)
    plan = make_plan(prof, get_preset("cpu:1"), TrainingConfig(epochs=4, samples_per_epoch=16, batch=4, cache="on"),
                     FreezePolicy(policy="manual", manual=(0, 1, 1, 2)))
    cache_dir = str(tmp / "ram")
    os.makedirs(cache_dir)
    log = str(tmp / "run.jsonl")
    cfg = RunConfig(plan="(test)", model="bert-tiny", epochs=4, progress=False, timeout_s=60, log=log, dropout=0.0,
                    dtype="bfloat16", cache="auto", cache_dir=cache_dir)
    ds = SyntheticDataset(model, 16)

    def worker(rank: int, world: int) -> None:
        run_training(cfg, plan, model, ds)

    res = run_world(1, worker, tmpdir=str(tmp), timeout_s=60, deadline_s=120)
    assert res.ok, res.explain()
    return prof, plan, log


@pytest.mark.multiproc
def test_real_run_fill_steps_are_priced_as_fills(bf16_run):
    """Epoch 1 fills phase 1 (every row missed), epoch 2 reads it (hits), epoch 3 refreshes into phase 2: the steps
    say so, and compare sets epochs 1 and 3 against the fill price, epoch 2 against the steady one."""
    _, plan, log_path = bf16_run
    log = read_run_log(log_path)
    rows = {s.epoch: (s.cache_hits, s.cache_refreshes, s.cache_misses) for s in log.steps}
    assert rows == {0: (None, None, None), 1: (0, 0, 4), 2: (4, 0, 0), 3: (0, 4, 0)}
    c = compare(plan, log)
    by_phase = {p.frozen_blocks: i for i, p in enumerate(plan.phases)}
    p1, p2 = plan.phases[by_phase[1]], plan.phases[by_phase[2]]
    assert [(r.phase, r.steps) for r in c.phases] == [(by_phase[0], 2), (by_phase[1], 4)]  # warm-up, sampled out
    assert c.phases[1].predicted_iteration_s == pytest.approx(p1.predicted.iteration_s)
    assert [(r.phase, r.steps) for r in c.fills] == [(by_phase[1], 2), (by_phase[2], 2)]  # warm-up, sampled out
    for r, p in zip(c.fills, (p1, p2)):
        assert p.predicted.fill_iteration_s > 0
        assert r.predicted_iteration_s == pytest.approx(p.predicted.fill_iteration_s)
    assert c.mismatches == ()  # a bf16 model against its bf16 profile's plan: the same parameter bytes and rows
    # stage 0's AutoCache time, where the phase caches, inside each step's own time (not the epoch's last step's:
    # under load one step's cache time can exceed another step's whole time)
    assert all(s.cache_seconds is None for s in log.steps if s.epoch == 0)
    assert all(s.cache_seconds is not None and 0 < s.cache_seconds <= s.seconds for s in log.steps if s.epoch > 0)
    for p in (p1, p2):
        assert 0 < p.predicted.cache_setup_s < p.predicted.fill_cache_setup_s
    assert c.phases[1].measured_cache_s is not None and c.phases[1].predicted_cache_s == pytest.approx(
        p1.predicted.cache_setup_s)  # epoch 2: every row a hit
    for r, p in zip(c.fills, (p1, p2)):
        assert r.predicted_cache_s == pytest.approx(p.predicted.fill_cache_setup_s)  # every row computed
    assert "AutoCache:" in format_comparison(c) and c.phases[0].measured_cache_s is None


@pytest.mark.multiproc
def test_bf16_cache_setup_equals_the_plans_numbers(bf16_run):
    """The cache stores the bf16 rows the prefix outputs, and its bytes are the plan's: the plan's
    ``cache_host_bytes_per_node`` (rows at one count + the frozen weights kept to fill) equals the run's same sum,
    and ``need_bytes`` is the rows at two counts (the run caches counts 1 and 2: a refresh keeps both)."""
    prof, plan, log_path = bf16_run
    setup = next(r.fields for r in read_run_log(log_path).records if r.type == "cache_setup")
    assert setup["dtype"] == setup["plan_dtype"] == prof.model.dtype == "bfloat16"
    n0 = max(p.frozen_layers for p in plan.phases if p.cache)
    row = prof.layers[n0 - 1].output_bytes_per_sample
    assert setup["row_bytes"] == row == 8 * 64 * 2
    assert setup["need_bytes"] == cache_bytes(16, row, row) == 2 * rows_bytes(16, row)
    assert setup["refresh_bytes"] == rows_bytes(16, row)
    assert setup["host_bytes_per_node"] == setup["plan_bytes_per_node"] == max(
        p.predicted.cache_host_bytes_per_node for p in plan.phases if p.cache)
