"""Property tests of the three contracts' readers (issue 24): valid profiles, plans and run logs, mutated
at a random place (a key dropped or added, a value replaced by another JSON value, a number scaled, negated or
made huge, a list cut or grown), then read as every command reads them, in-process:

- profile: ``profile_from_json`` (``ptplan plan`` / ``ablate`` / ``run`` read profiles through it);
- plan: ``plan_from_json`` (``show``, ``compare``, ``run``, ``data --plan``), then what they do with an accepted
  plan (the plan table, ``compare`` with a valid run log);
- run log: ``read_run_log`` then ``compare`` with its plan (``compare``, ``show --run``).

Each reader either accepts the file — and then what the commands do with it runs without a traceback — or
raises PtplanError, which the CLI prints as one message with exit 2. A mutation known to be invalid (an
unknown key in a typed record, a required field dropped, a number where a text is expected) must be refused
with the field named. 1,000 mutated files per contract, derandomised so CI sees the same files every run.
"""
from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

set_hypothesis_home_dir(tempfile.mkdtemp(prefix="ptplan-hypothesis-"))  # no .hypothesis folder in the checkout

from ptplan.cli.plan_cmd import format_plan_table
from ptplan.planner.cluster import get_preset
from ptplan.planner.compare import compare, format_comparison
from ptplan.planner.errors import PtplanError, SchemaError
from ptplan.planner.freeze import FreezePolicy
from ptplan.planner.plan import plan_from_json
from ptplan.planner.planner import TrainingConfig, make_plan
from ptplan.planner.profile import profile_from_json
from ptplan.planner.runlog import SCHEMA as RUNLOG_SCHEMA, read_run_log
from ptplan.profiles import shipped

EXAMPLES = 1000
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

PROFILE = json.loads(shipped("bert-tiny_cpu_fp32").read_text())
PLAN_OBJ = make_plan(profile_from_json(copy.deepcopy(PROFILE)), get_preset("cpu:2"),
                     TrainingConfig(epochs=2, samples_per_epoch=64, batch=8, schedule="1f1b", pin_K=2),
                     FreezePolicy(policy="manual", manual=(0, 2))).to_json()
PLAN = plan_from_json(copy.deepcopy(PLAN_OBJ))


def _log_records() -> list[dict[str, Any]]:
    """A valid run log of PLAN: header, a transition, steps (one sampling memory) and an eval."""
    recs: list[dict[str, Any]] = [
        {"type": "header", "schema": RUNLOG_SCHEMA, "plan_fingerprint": PLAN.inputs.profile.fingerprint,
         "model": PLAN.inputs.profile.model, "world_size": PLAN.world_size,
         "phases": [dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M) for p in PLAN.phases]}]
    step = 0
    for ph in range(len(PLAN.phases)):
        p = PLAN.phases[ph]
        if ph:
            recs.append({"type": "transition", "step": step, "from_phase": ph - 1, "to_phase": ph, "seconds": 0.01,
                         "parts": {"weights": 0.004, "rebuild": 0.006}})
        for i in range(3):
            r: dict[str, Any] = {"type": "step", "epoch": 0, "step": step, "phase": ph,
                                 "frozen_blocks": p.frozen_blocks, "K": p.K, "D": p.D, "seconds": 0.05 + 0.01 * i,
                                 "samples": p.global_batch, "loss": 1.0, "allreduce_seconds": 0.001}
            if i == 1:
                r.update(memory_sampled=True, peak_memory_bytes=10**6,
                         memory={"method": "cpu", "per_rank": [{"total": 10**6 - k} for k in range(PLAN.world_size)]})
            recs.append(r)
            step += 1
    recs.append({"type": "eval", "epoch": 0, "step": step, "phase": len(PLAN.phases) - 1, "loss": 0.7,
                 "samples": 10, "seconds": 0.2, "accuracy": 0.5})
    return recs


LOG = _log_records()

# ---- mutations ------------------------------------------------------------------------------------------

EXTREMES = [0, -1, 1, 2, 10**18, -10**18, 10**30, 0.0, -0.5, 1e-300, 1e308, math.inf, -math.inf, math.nan, "", "x",
            None, True, False, [], {}, [0], {"a": 1}]
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=True, allow_infinity=True),
              st.text(max_size=6), st.sampled_from(EXTREMES)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)

FREE_FORM = ("memory", "parts", "bytes", "from", "to", "totals", "phases", "measurement", "config", "notes",
             "grad_norms", "sample_shape", "frozen_layers", "command", "extra")
"""Keys whose values are free-form objects or lists (an unknown key inside them is not a schema error)."""


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return list(node)
    if isinstance(node, list):
        return list(range(len(node)))
    return []


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> tuple[Any, str, str]:
    """(a mutated deep copy of ``base``, the mutation kind, the path's last key). Kinds: ``unknown-key``
    (a key added to a typed object: must be refused), ``drop`` (a key or list entry removed), ``replace``
    (a value replaced by any JSON value), ``number`` (a number negated, scaled or made extreme), ``list``
    (a list cut, grown or its entries swapped)."""
    obj = copy.deepcopy(base)
    node, key, parent, free = obj, "<root>", None, False
    depth = draw(st.integers(0, 9))  # mostly down to a leaf: where the numbers are
    for _ in range(depth):
        kids = _children(node)
        if not kids:
            break
        k = draw(st.sampled_from(kids))
        parent, key, node = node, k, node[k]
        free = free or (isinstance(key, str) and key in FREE_FORM)
    kinds = ["unknown-key", "drop", "replace"] + (["number"] * 3 if isinstance(node, (int, float)) else []) + \
        (["list"] * 2 if isinstance(node, list) else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "unknown-key" and isinstance(node, dict) and not free:
        node["zz_unknown"] = draw(json_values)
        return obj, kind, "zz_unknown"
    if parent is None:
        return draw(json_values), "replace", "<root>"
    if kind == "drop":
        del parent[key]
        return obj, kind, str(key)
    if kind == "number" and isinstance(node, (int, float)) and not isinstance(node, bool):
        how = draw(st.sampled_from(["neg", "zero", "huge", "tiny", "scale"]))
        new = {"neg": -node - 1, "zero": 0, "huge": 10**18 if isinstance(node, int) else 1e300,
               "tiny": -10**18 if isinstance(node, int) else -1e-300,
               "scale": node * draw(st.sampled_from([10**12, -1, 3]))}[how]
        parent[key] = new
        return obj, kind, str(key)
    if kind == "list" and isinstance(node, list) and node:
        how = draw(st.sampled_from(["cut", "grow", "swap"]))
        if how == "cut":
            parent[key] = node[:draw(st.integers(0, len(node) - 1))]
        elif how == "grow":
            parent[key] = node + [copy.deepcopy(node[-1])]
        else:
            parent[key] = list(reversed(node))
        return obj, kind, str(key)
    parent[key] = draw(json_values)
    return obj, "replace", str(key)


def _json_round_trip(obj: Any) -> Any:
    """What a reader sees of ``obj`` written as a file (NaN and inf as json writes them)."""
    return json.loads(json.dumps(obj))


def _refused(e: PtplanError, kind: str, key: str) -> None:
    event(f"{kind}: refused")
    msg = str(e)
    assert msg and "Traceback" not in msg
    if isinstance(e, SchemaError):
        assert e.field, msg
    if kind == "unknown-key":
        assert "zz_unknown" in msg, msg


# ---- the three contracts ----------------------------------------------------------------------------------

@FUZZ
@given(mutated(PROFILE))
def test_profile_reader_accepts_or_names_the_field(case: tuple[Any, str, str]) -> None:
    obj, kind, key = case
    try:
        prof = profile_from_json(_json_round_trip(obj))
    except PtplanError as e:
        _refused(e, kind, key)
        return
    event(f"{kind}: accepted")
    assert kind != "unknown-key", f"accepted an unknown key: {key}"
    # what the planner does first with a profile it accepted: its layers' times at every measured size
    for b in prof.batch_sizes:
        for i in range(prof.num_layers):
            t = prof.forward_s(i, b) + prof.backward_s(i, b)
            assert math.isfinite(t) and t >= 0


@FUZZ
@given(mutated(PLAN_OBJ))
def test_plan_reader_accepts_or_names_the_field(case: tuple[Any, str, str]) -> None:
    obj, kind, key = case
    try:
        plan = plan_from_json(_json_round_trip(obj))
    except PtplanError as e:
        _refused(e, kind, key)
        return
    event(f"{kind}: accepted")
    assert kind != "unknown-key", f"accepted an unknown key: {key}"
    format_plan_table(plan)  # what `ptplan plan`/`show` print of it
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.jsonl")
        with open(path, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in LOG))
        try:
            format_comparison(compare(plan, read_run_log(path)))  # `ptplan compare` with the valid log
        except PtplanError:
            pass  # a plan mutated into another valid plan is not the log's plan: refused, with a message


@FUZZ
@given(st.data())
def test_run_log_reader_accepts_or_names_the_field(data: st.DataObject) -> None:
    line = data.draw(st.integers(0, len(LOG) - 1))
    rec, kind, key = data.draw(mutated(LOG[line]))
    recs = LOG[:line] + [rec] + LOG[line + 1:]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.jsonl")
        with open(path, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
        try:
            log = read_run_log(path)
            format_comparison(compare(PLAN, log))
        except PtplanError as e:
            _refused(e, kind, key)
            return
    event(f"{kind}: accepted")
    assert kind != "unknown-key", f"accepted an unknown key: {key}"


# ---- fixed cases the issue names -------------------------------------------------------------------------

def _plan_with(edit) -> dict[str, Any]:
    obj = copy.deepcopy(PLAN_OBJ)
    edit(obj)
    return obj


def _two_stage_phase(obj: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in obj["phases"] if p["K"] == 2)


def _deadlock(obj: dict[str, Any]) -> None:
    """Position 0 waits for micro-batch 0's gradient before it sends micro-batch 0 forward."""
    ph = _two_stage_phase(obj)
    toks = ph["actions"][0].split()
    toks.remove("0RECV_B0")
    ph["actions"][0] = " ".join(["0RECV_B0", *toks])


def _no_send(obj: dict[str, Any]) -> None:
    ph = _two_stage_phase(obj)
    ph["actions"][0] = " ".join(t for t in ph["actions"][0].split() if t != "0SEND_F0")


@pytest.mark.parametrize("edit, field", [
    (_no_send, ".actions"),
    (_deadlock, ".actions"),
    (lambda o: o["phases"][0].update(M=o["phases"][0]["M"] * 3), ".M"),
    (lambda o: o["phases"][0]["predicted"].update(stage_peak_memory_bytes=[10**18] * o["phases"][0]["K"]),
     "stage_peak_memory_bytes[0]"),
    (lambda o: o["inputs"]["training"].update(samples_per_epoch=10**12), "inputs.training.samples_per_epoch"),
])
def test_every_plan_reader_refuses_what_run_refuses(edit, field, tmp_path) -> None:
    """A plan whose action lists miss a SEND or deadlock, whose M does not split the batch, whose memory is
    10^18 bytes, or whose epoch cannot be held: refused by the one reader, so by show and compare as by run."""
    from click.testing import CliRunner

    from ptplan.cli.main import cli

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_plan_with(edit)))
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in LOG))
    for args in (["show", str(bad), "--out", str(tmp_path / "r.html")], ["compare", str(bad), str(log)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2, (args, r.output)
        assert r.output.startswith("error: plan ") and field in r.output and r.output.count("\n") == 1, r.output
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("line, edit, field", [
    (2, {"seconds": -0.5}, "seconds"),
    (2, {"seconds": 0}, "seconds"),
    (3, {"memory": {"method": "cpu", "per_rank": [{"total": 5}]}}, "memory.per_rank"),
    (3, {"memory": {"method": "cpu", "per_rank": [{"nototal": 5}, {"total": 1}]}}, "per_rank[0].total"),
    (1, {"seconds": -1.0}, "seconds"),
])
def test_every_run_log_reader_refuses_what_it_must(line, edit, field, tmp_path) -> None:
    from click.testing import CliRunner

    from ptplan.cli.main import cli

    recs = copy.deepcopy(LOG)
    recs[line].update(edit)
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN_OBJ))
    for args in (["compare", str(plan), str(log)], ["show", str(plan), "--run", str(log), "--out",
                                                     str(tmp_path / "r.html")]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 2 and field in r.output and r.output.count("\n") == 1, (args, r.output)
