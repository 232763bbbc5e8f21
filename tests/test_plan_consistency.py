"""The plan reader refuses internally inconsistent plans (``planner/plan_checks.py``): each relation between fields
that the plan's readers rely on -- the trajectory against the epochs, the phases and the freeze steps; the phases'
frozen prefixes; the baseline against the cluster and the batch; the totals against the trajectory; the stored
action lists -- is broken once, and the message must name the field, with no Python error text. Pure and fast:
plans made by the product's planner from the shipped profiles, mutated as JSON."""
from __future__ import annotations

import copy
import json
from typing import Any, Callable

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.cluster import get_preset
from ptplan.planner.config import TrainingConfig
from ptplan.planner.errors import PtplanError, SchemaError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.plan import load_plan, plan_from_json
from ptplan.planner.planner import make_plan
from ptplan.planner.profile import load_profile
from ptplan.planner.schedule import ScheduleError, parse_action
from ptplan.profiles import shipped

BERT = load_profile(shipped("bert-tiny_cpu_fp32"))
# the audit's plan: bert-tiny on cpu:2, K=2, 2 epochs of 256 samples, batch 32, geometric freezing per epoch:
# phases for 0..4 frozen blocks, freeze steps [0, 2], trajectory (epoch 0, phase 0, 8 steps), (epoch 1, phase 2, 8)
EPOCH = make_plan(BERT, get_preset("cpu:2"), TrainingConfig(epochs=2, samples_per_epoch=256, batch=32, pin_K=2),
                  FreezePolicy(alpha=1 / 3)).to_json()
# a freeze step every 3 optimizer steps with the AutoCache on: freeze steps [0, 2, 3, 3, 4], several runs per epoch,
# cache fills in phases 1..4 (phase 0 freezes nothing and does not cache)
STEPS = make_plan(BERT, get_preset("cpu:2"), TrainingConfig(epochs=2, samples_per_epoch=256, batch=32, pin_K=2,
                                                            cache="on"), FreezePolicy(alpha=1 / 3, every=3)).to_json()


def _read(obj: Any) -> Any:
    return plan_from_json(json.loads(json.dumps(obj)), source="plan p.json")


def test_the_unmutated_plans_load():
    for obj in (EPOCH, STEPS):
        plan = _read(obj)
        assert plan.trajectory and plan.trajectory[-1].epoch == plan.inputs.training.epochs - 1
    assert [(t.epoch, t.step, t.phase) for t in _read(STEPS).trajectory] == \
        [(0, 0, 0), (0, 3, 2), (0, 6, 3), (1, 8, 3), (1, 12, 4)]  # what the STEPS cases below rely on


def _swap_phase(j: int, phase: int) -> Callable[[dict], None]:
    """Point trajectory[j] at another phase, its frozen count following (so only the freeze steps disagree)."""
    def edit(o: dict) -> None:
        o["trajectory"][j].update(phase=phase, frozen_blocks=o["phases"][phase]["frozen_blocks"])
    return edit


def _actions(pos: int, text: Callable[[str], str]) -> Callable[[dict], None]:
    def edit(o: dict) -> None:
        o["phases"][0]["actions"][pos] = text(o["phases"][0]["actions"][pos])
    return edit


def _prefix(i: int, frozen_layers: int) -> Callable[[dict], None]:
    """phases[i] with another frozen prefix, its partition moved along (so only the prefix is wrong)."""
    def edit(o: dict) -> None:
        ph = o["phases"][i]
        ph["frozen_layers"] = frozen_layers
        ph["partition"][0][0] = frozen_layers
    return edit


def _baseline_wide(o: dict) -> None:
    o["baseline"]["phase"].update(D=2, ranks=[[0, 1], [2, 3]])


# (mutation, plan, the field the message must name, a word it must hold)
CASES: dict[str, tuple[Callable[[dict], None], dict, str, str]] = {
    # the trajectory against the epochs (audit: an empty trajectory, and epochs=7 with 2 entries, loaded and ran)
    "empty-trajectory": (lambda o: o.update(trajectory=[]), EPOCH, "trajectory", "empty"),
    "more-epochs": (lambda o: o["inputs"]["training"].update(epochs=7), EPOCH, "inputs.training.epochs", "7"),
    "fewer-epochs": (lambda o: o["inputs"]["training"].update(epochs=1), EPOCH, "inputs.training.epochs", "1"),
    "starts-late": (lambda o: o["trajectory"][0].update(epoch=1), EPOCH, "trajectory[0].epoch", "epoch 0"),
    "skips-an-epoch": (lambda o: o["trajectory"][1].update(epoch=2), EPOCH, "trajectory[1].epoch", "2"),
    "epochs-go-back": (lambda o: o["trajectory"][4].update(epoch=0), STEPS, "trajectory[4].epoch", "0"),
    # steps: contiguous from 0
    "first-step": (lambda o: o["trajectory"][0].update(step=1), EPOCH, "trajectory[0].step", "step 0"),
    "step-gap": (lambda o: o["trajectory"][1].update(step=9), EPOCH, "trajectory[1].step", "8"),
    # an epoch's samples
    "too-many-iterations": (lambda o: o["trajectory"][1].update(iterations=9), EPOCH, "trajectory[1].iterations",
                            "256"),
    "too-few-iterations": (lambda o: [o["trajectory"][0].update(iterations=7), o["trajectory"][1].update(step=7)],
                           EPOCH, "trajectory[0].iterations", "256"),
    # trajectory entries against the phases and the freeze steps
    "phase-index": (lambda o: o["trajectory"][1].update(phase=9), EPOCH, "trajectory[1].phase", "9"),
    "phase-count": (lambda o: o["trajectory"][1].update(frozen_blocks=1), EPOCH, "trajectory[1].frozen_blocks", "1"),
    "off-the-freeze-steps": (_swap_phase(1, 4), EPOCH, "trajectory[1].frozen_blocks", "freeze_steps"),
    "freeze-steps-edited": (lambda o: o.update(freeze_steps=[0, 1]), EPOCH, "trajectory[1].frozen_blocks",
                            "freeze_steps"),
    "off-the-freeze-steps-by-step": (_swap_phase(2, 4), STEPS, "trajectory[2].frozen_blocks", "step 6"),
    "fill-without-cache": (lambda o: o["trajectory"][0].update(fill_iterations=1), EPOCH,
                           "trajectory[0].fill_iterations", "cache"),
    "fill-beyond-run": (lambda o: o["trajectory"][1].update(fill_iterations=4), STEPS,
                        "trajectory[1].fill_iterations", "3"),
    # freeze steps
    "no-freeze-steps": (lambda o: o.update(freeze_steps=[]), EPOCH, "freeze_steps", "empty"),
    "phases-cut": (lambda o: [o.update(phases=o["phases"][:2]), o.update(freeze_steps=[0])], EPOCH,
                   "trajectory[1].phase", "2"),
    "freeze-step-without-phase": (lambda o: [o.update(phases=o["phases"][:3]), o.update(freeze_steps=[0, 2, 4])],
                                  EPOCH, "freeze_steps[2]", "no phase"),
    "thaw": (lambda o: o.update(freeze_steps=[2, 0]), EPOCH, "freeze_steps[1]", "thaw"),
    # the phases' frozen prefixes and sizes
    "prefix-without-blocks": (_prefix(0, 3), EPOCH, "phases[0].frozen_layers", "0"),
    "blocks-without-prefix": (_prefix(1, 0), EPOCH, "phases[1].frozen_layers", "0"),
    "prefix-not-growing": (_prefix(2, 3), EPOCH, "phases[2].frozen_layers", "3"),
    "cache-without-prefix": (lambda o: o["phases"][0].update(cache=True), EPOCH, "phases[0].cache", "frozen"),
    "repeated-count": (lambda o: o["phases"][1].update(frozen_blocks=0), EPOCH, "phases", "repeat"),
    "world": (lambda o: o["inputs"]["cluster"].update(gpus_per_node=4), EPOCH, "phases[0]", "4"),
    "timeline-rank": (lambda o: o["phases"][0]["timeline"][0].update(rank=2), EPOCH, "phases[0].timeline[0].rank",
                      "K=2"),
    "timeline-stage": (lambda o: o["phases"][0]["timeline"][0].update(stage=5), EPOCH,
                       "phases[0].timeline[0].stage", "5"),
    "timeline-backwards": (lambda o: o["phases"][0]["timeline"][1].update(start=o["phases"][0]["timeline"][1]["end"]
                                                                          + 1.0),
                           EPOCH, "phases[0].timeline[1].end", "start"),
    "rank-peaks": (lambda o: o["phases"][0]["predicted"].update(rank_peak_memory_bytes=[1]), EPOCH,
                   "phases[0].predicted.rank_peak_memory_bytes", "K=2"),
    # the baseline: a phase of the same cluster, batch and model
    "baseline-world": (_baseline_wide, EPOCH, "baseline.phase", "ranks"),
    "baseline-batch": (lambda o: o["baseline"]["phase"].update(M=8), EPOCH, "baseline.phase.M", "batch"),
    "baseline-prefix": (lambda o: o["baseline"]["phase"].update(frozen_blocks=3), EPOCH,
                        "baseline.phase.frozen_layers", "3"),
    "baseline-memory": (lambda o: o["baseline"]["phase"]["predicted"].update(stage_peak_memory_bytes=[10**15] * 2),
                        EPOCH, "baseline.phase.predicted.stage_peak_memory_bytes[0]", "exceeds"),
    # the totals the report prints beside the trajectory
    "total-seconds": (lambda o: o["totals"].update(seconds=o["totals"]["seconds"] * 2), EPOCH, "totals.seconds",
                      "trajectory"),
    "fill-seconds": (lambda o: o["totals"].update(fill_seconds=1.0), EPOCH, "totals.fill_seconds", "fill"),
    "baseline-seconds": (lambda o: o["baseline"].update(seconds=1.0), EPOCH, "totals.baseline_seconds",
                         "baseline.seconds"),
    # the action lists (audit: '0Z9 garbage' named phases[0].schedule and leaked "invalid literal for int()")
    "garbage-action": (_actions(0, lambda a: "0Z9 garbage"), EPOCH, "phases[0].actions", "'0Z9'"),
    "no-stage-number": (_actions(0, lambda a: "garbage " + a), EPOCH, "phases[0].actions", "'garbage'"),
    "unknown-kind": (_actions(0, lambda a: a.replace("0F1 ", "0X1 ", 1)), EPOCH, "phases[0].actions", "'0X1'"),
    "not-ascii-digit": (_actions(0, lambda a: "\u0660" + a), EPOCH, "phases[0].actions", "ASCII"),
    "stage-out-of-range": (_actions(0, lambda a: a + " 5F0"), EPOCH, "phases[0].actions", "stage 5"),
    "stage-on-two-positions": (_actions(0, lambda a: a + " 1F0"), EPOCH, "phases[0].actions", "position 1"),
    "deadlock": (_actions(0, lambda a: "0RECV_B0 " + a.replace(" 0RECV_B0 ", " ", 1)), EPOCH, "phases[0].actions",
                 "0RECV_B0"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_an_inconsistent_plan_is_refused_naming_the_field(name):
    edit, base, field, needle = CASES[name]
    obj = copy.deepcopy(base)
    edit(obj)
    with pytest.raises(SchemaError) as err:
        _read(obj)
    e = err.value
    msg = str(e)
    assert e.field == field, msg
    assert msg.startswith(f"plan p.json: field '{field}': ") and needle in msg, msg
    assert "Re-run `ptplan plan`" in msg or "ptplan plan" in msg, msg  # the fix
    for leak in ("invalid literal", "index out of range", "Traceback", "KeyError", "object has no attribute"):
        assert leak not in msg, msg


def test_a_cut_trajectory_is_refused_by_every_command(tmp_path):
    """The audit's reproduction: an empty trajectory loaded and was drawn (`show`) and run (`run --dry-run`); every
    command reads plans through ``load_plan``, so each refuses it with one line and exit 2, writing nothing."""
    obj = copy.deepcopy(EPOCH)
    obj["trajectory"] = []
    src = tmp_path / "te.json"
    src.write_text(json.dumps(obj))
    with pytest.raises(SchemaError, match=r"field 'trajectory': is empty"):
        load_plan(src)
    out = tmp_path / "x.html"
    r = CliRunner().invoke(cli, ["show", str(src), "--out", str(out)])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: plan ") and "field 'trajectory'" in r.output and r.output.count("\n") == 1
    assert not out.exists()


def test_epochs_that_disagree_with_the_trajectory_name_both(tmp_path):
    obj = copy.deepcopy(EPOCH)
    obj["inputs"]["training"]["epochs"] = 7
    with pytest.raises(SchemaError) as err:
        _read(obj)
    msg = str(err.value)
    assert "is 7 but the trajectory covers 2 epochs (0..1)" in msg, msg


def test_the_action_parse_error_names_the_token_and_the_field():
    """Audit item 2: ``phases[0].actions = ["0Z9 garbage", ...]`` named ``phases[0].schedule`` and leaked Python's
    ``invalid literal for int() with base 10: ''``; now the actions field, the position and the token."""
    obj = copy.deepcopy(EPOCH)
    obj["phases"][0]["actions"][0] = "0Z9 garbage"
    with pytest.raises(SchemaError) as err:
        _read(obj)
    msg = str(err.value)
    assert err.value.field == "phases[0].actions", msg
    assert "position 0" in msg and "cannot parse action '0Z9'" in msg and "'Z9'" in msg, msg
    obj["phases"][0]["actions"][0] = "garbage 0F0"
    with pytest.raises(SchemaError, match=r"field 'phases\[0\]\.actions': position 0: cannot parse action 'garbage': "
                                          r"it does not start with a stage number"):
        _read(obj)


@pytest.mark.parametrize("text, why", [
    ("0Z9", "'Z9' after stage 0 is not a kind"),
    ("garbage", "does not start with a stage number"),
    ("", "empty"),
    ("2F0 1B0", "one action per token"),
    ("\u0662F0", "ASCII"),
    ("\uff12F0", "ASCII"),
])
def test_parse_action_says_why_a_token_is_not_an_action(text, why):
    with pytest.raises(ScheduleError) as err:
        parse_action(text)
    msg = str(err.value)
    assert msg.startswith(f"cannot parse action {text!r}: ") and why in msg, msg
    assert "e.g. 2F0" in msg and "SEND_F" in msg, msg  # what an action looks like


@pytest.fixture(scope="module")
def sliced_plan(tmp_path_factory) -> dict:
    """A token-sliced GPT-2 plan (`ptplan plan --token-slices auto`, as test_terapipe_plan makes it), as JSON."""
    out = tmp_path_factory.mktemp("sliced") / "p.json"
    r = CliRunner().invoke(cli, ["plan", "gpt2_cpu_fp32_slices", "--cluster", "cpu:4", "--batch", "4", "--start-K", "4",
                                 "--schedule", "gpipe", "--samples-per-epoch", "64", "--epochs", "2",
                                 "--token-slices", "auto", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def test_a_changed_sequence_length_is_refused_where_the_plan_records_it_twice(sliced_plan):
    """The plan records the sequence length in ``inputs.profile.seq_len`` and, in token-sliced phases, as the sum of
    ``slices``; the profile fingerprint hashes layer names, kinds, blocks and parameter counts, none of which
    depend on the sequence length. So a changed length is refused where a phase is sliced (naming that phase's
    slices) -- the one place a second record exists."""
    obj = copy.deepcopy(sliced_plan)
    plan = _read(obj)
    cut = next(i for i, p in enumerate(plan.phases) if p.slices)
    obj["inputs"]["profile"]["seq_len"] = 64
    with pytest.raises(SchemaError) as err:
        _read(obj)
    assert err.value.field == f"phases[{cut}].slices" and "sequence length is 64" in str(err.value)


def test_the_profile_path_is_optional():
    """``inputs.profile.path`` is optional in the contract (``ProfileRef.path``: ``None`` when not recorded); the
    commands that need the profile file (``run --nnodes MIN:MAX`` re-planning, ``run`` without --model) say so
    themselves. A plan without it loads."""
    obj = copy.deepcopy(EPOCH)
    del obj["inputs"]["profile"]["path"]
    assert _read(obj).inputs.profile.path is None
    obj["inputs"]["profile"]["path"] = 3
    with pytest.raises(SchemaError, match=r"field 'inputs\.profile\.path'"):
        _read(obj)


def test_checks_raise_only_schema_errors():
    """Every case above is a SchemaError (the CLI's one line, exit 2), never another PtplanError or a crash."""
    for name, (edit, base, _, _) in CASES.items():
        obj = copy.deepcopy(base)
        edit(obj)
        try:
            _read(obj)
        except SchemaError:
            continue
        except PtplanError as e:  # pragma: no cover - the failure message
            pytest.fail(f"{name}: {type(e).__name__}: {e}")
        pytest.fail(f"{name}: accepted")


def test_a_fill_that_ties_the_steady_iteration_writes_a_plan(tmp_path):
    """PipeDream-2BW's iteration is its steady period, on which the AutoCache's fill changes nothing: the fill and
    steady iterations are simulated apart and may differ by rounding either way (bert-large on cpu:4, batch 64:
    fill_iteration_s fell 2e-17 s under iteration_s in 5 phases, and ``totals.fill_seconds`` at -2e-14 s failed
    the plan's own check before writing). What a fill adds is at least 0 (``Prediction.fill_extra_s``), everywhere
    it is summed."""
    from ptplan.planner.plan import save_plan

    prof = load_profile(shipped("bert-large_a100_bf16"))
    plan = make_plan(prof, get_preset("cpu:4"), TrainingConfig(epochs=10, samples_per_epoch=50_000, batch=64,
                                                                schedule="2bw"), FreezePolicy())
    cached = [p.predicted for p in plan.phases if p.cache]
    assert cached and all(p.fill_extra_s >= 0.0 for p in cached)
    assert plan.totals.fill_seconds >= 0.0
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").totals.fill_seconds == plan.totals.fill_seconds
