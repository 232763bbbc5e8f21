"""The profile file contract and ``ptplan profile``'s errors: clear messages naming the field, exit 2, no file."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.errors import PtplanError, SchemaError
from ptplan.planner.profile import SCHEMA, load_profile, profile_from_json, save_profile
from ptplan.profiles import PROFILE_DIR


def _layer(i: int, name: str, kind: str, block: int | None) -> dict:
    return {"index": i, "name": name, "kind": kind, "block": block, "params": 10, "param_bytes": 40,
            "grad_bytes": 40, "optimizer_bytes": 80, "output_bytes_per_sample": 64,
            "saved_bytes_per_sample": 128, "forward_s": [0.001, 0.002], "backward_s": [0.002, 0.004],
            "nograd_forward_s": [0.0008, 0.0015]}


def _valid() -> dict:
    return {
        "schema": SCHEMA,
        "model": {"name": "bert-tiny", "family": "bert", "num_blocks": 1, "seq_len": 16, "dtype": "float32",
                  "granularity": "half", "config": {"hidden_size": 64}},
        "device": {"kind": "cpu", "name": "test cpu", "memory_bytes": 1 << 30, "torch_version": "2.13.0",
                   "date": "2026-01-01", "threads": 1},
        "batch_sizes": [1, 2],
        "layers": [_layer(0, "embeddings", "embedding", None), _layer(1, "block0.attn", "attention", 0),
                   _layer(2, "block0.mlp", "mlp", 0), _layer(3, "pooler", "norm", None),
                   _layer(4, "head", "head", None)],
        "whole_model": {"forward_s": [0.004, 0.008], "forward_backward_s": [0.012, 0.024]},
        "measurement": {"warmup": 1, "repeats": 2},
    }


def _field_error(obj: dict) -> SchemaError:
    with pytest.raises(SchemaError) as e:
        profile_from_json(obj, "profile p.json")
    return e.value


def test_round_trip(tmp_path):
    d = _valid()
    prof = profile_from_json(copy.deepcopy(d))
    assert json.loads(json.dumps(prof.to_json())) == {
        **d, "whole_model": {**d["whole_model"], "peak_memory_bytes": []},
        "layers": [{**x, "optimizer_s": None, "backward_weight_s": None} for x in d["layers"]],
        "provenance": {"source": "measured", "command": "", "device_model": None}}
    assert all(r.optimizer_s is None for r in prof.layers)  # optional: profiles written before it still load
    assert prof.provenance.source == "measured"  # files without provenance were measured
    d["layers"][0]["optimizer_s"] = 0.002
    assert profile_from_json(copy.deepcopy(d)).layers[0].optimizer_s == 0.002
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == prof


def test_corrupt_json(tmp_path):
    p = tmp_path / "p.json"
    p.write_text('{"schema": "ptplan.profile/1", "layers": [')
    with pytest.raises(PtplanError, match=r"is not valid JSON \(line 1"):
        load_profile(p)
    with pytest.raises(PtplanError, match="profile file not found"):
        load_profile(tmp_path / "missing.json")


def test_wrong_schema_string():
    d = _valid()
    d["schema"] = "ptplan.profile/0"
    e = _field_error(d)
    assert e.field == "schema" and "ptplan.profile/1" in str(e) and "ptplan profile" in str(e)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["layers"][3].pop("forward_s"), "layers[3].forward_s"),
    (lambda d: d["layers"][3]["forward_s"].__setitem__(1, "fast"), "layers[3].forward_s[1]"),
    (lambda d: d["layers"][2]["backward_s"].pop(), "layers[2].backward_s"),
    (lambda d: d["layers"][1].__setitem__("params", 1.5), "layers[1].params"),
    (lambda d: d["layers"][1].__setitem__("kind", "conv"), "layers[1].kind"),
    (lambda d: d["layers"][1].__setitem__("block", "0"), "layers[1].block"),
    (lambda d: d["layers"][4].__setitem__("index", 7), "layers[4].index"),
    (lambda d: d["layers"][0].__setitem__("surprise", 1), "layers[0].surprise"),
    (lambda d: d["model"].pop("seq_len"), "model.seq_len"),
    (lambda d: d["device"].__setitem__("kind", "tpu"), "device.kind"),
    (lambda d: d.__setitem__("batch_sizes", [2, 1]), "batch_sizes"),
    (lambda d: d["whole_model"]["forward_backward_s"].__setitem__(0, -1.0), "whole_model.forward_backward_s[0]"),
])
def test_bad_fields_are_named(mutate, field):
    d = _valid()
    mutate(d)
    e = _field_error(d)
    assert e.field == field
    assert f"field '{field}'" in str(e) and "profile p.json" in str(e)


def test_save_refuses_an_invalid_profile(tmp_path):
    prof = profile_from_json(_valid())
    bad = prof.__class__(**{**prof.__dict__, "batch_sizes": (1,)})  # two timings per layer, one size
    with pytest.raises(SchemaError, match="forward_s"):
        save_profile(bad, tmp_path / "p.json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("path", sorted(PROFILE_DIR.glob("*.json")), ids=lambda p: p.name)
def test_shipped_profiles_are_valid(path):
    """Named MODEL_DEVICE_DTYPE: the device kind when measured, the device model when projected."""
    prof = load_profile(path)
    where = prof.provenance.device_model if prof.provenance.source == "projected" else prof.device.kind
    assert prof.provenance.source in ("measured", "projected")
    assert path.name.startswith(f"{prof.model.name}_{where}_")
    assert prof.model.granularity == "half"
    assert prof.provenance.command.startswith("ptplan profile") or prof.provenance.command == ""
    # every field measured (issue 10): the optimizer step and the backward's weight-gradient part per layer
    assert all(r.optimizer_s is not None for r in prof.layers if r.params), path.name
    assert all(r.backward_weight_s is not None for r in prof.layers), path.name
    if prof.model.family == "vit":  # ImageNet-1k's 1000-class head, as published, not a 2-class stand-in
        assert prof.layers[-1].params == prof.layers[-2].params // 2 * 1000 + 1000, prof.layers[-1].params


# ---- the CLI -----------------------------------------------------------------------------------

@pytest.fixture
def run(tmp_path, monkeypatch):
    """Invoke ``ptplan`` in an empty folder; restore torch's thread count afterwards."""
    import torch

    n = torch.get_num_threads()
    monkeypatch.chdir(tmp_path)

    def invoke(*args: str):
        return CliRunner().invoke(cli, ["profile", *args])

    yield invoke
    torch.set_num_threads(n)


def _no_files(tmp_path: Path) -> bool:
    return [p for p in tmp_path.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("args, message", [
    (["bert-huge"], "error: unknown model 'bert-huge'; choose one of bert-tiny, bert-base"),
    (["bert-tiny", "--batch-sizes", "1,x"], "error: --batch-sizes must be a comma-separated list of positive"),
    (["bert-tiny", "--batch-sizes", "2,0"], "error: --batch-sizes must be positive, got 0"),
    (["bert-tiny", "--batch-sizes", ""], "error: --batch-sizes must be a comma-separated list"),
    (["bert-tiny", "--out", "no/such/dir/p.json"], "error: output folder does not exist: no/such/dir"),
    (["bert-tiny", "--repeats", "0"], "error: --repeats must be >= 1"),
    (["bert-tiny", "--device", "tpu"], "error: unknown device 'tpu'"),
    (["bert-tiny", "--seq-len", "4096"], "error: sequence length 4096 is outside 1..512"),
    (["bert-tiny", "--weights", "no-such-folder"], "error: weights folder not found: no-such-folder"),
    (["bert-tiny", "--threads", "2", "--timer", "cpu", "--seq-len", "8", "--batch-sizes", "1"],
     "error: the cpu timer needs one torch thread"),
])
def test_cli_errors_exit_2_without_a_file(run, tmp_path, args, message):
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert message in res.stderr
    assert _no_files(tmp_path)


def test_cli_cuda_unavailable(run, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    res = run("bert-tiny", "--device", "cuda")
    assert res.exit_code == 2
    assert "cuda requested but torch.cuda.is_available() is False; use --device cpu" in res.stderr
    assert _no_files(tmp_path)


def test_cli_writes_a_valid_profile_and_prints_the_check(run, tmp_path):
    res = run("bert-tiny", "--seq-len", "16", "--batch-sizes", "2,1", "--warmup", "0", "--repeats", "1", "--quiet")
    assert res.exit_code == 0, res.output + res.stderr
    out = tmp_path / "bert-tiny_cpu_fp32.json"  # the default name
    prof = load_profile(out)
    assert prof.batch_sizes == (1, 2) and prof.model.seq_len == 16
    assert prof.device.threads == 1  # the CPU default, as torchrun runs each process
    assert "block0.attn" in res.stdout and f"wrote {out.name}" in res.stdout
    for b in (1, 2):
        assert f"batch {b}: per-layer sum " in res.stdout
    assert "vs whole-model step" in res.stdout
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary file left
