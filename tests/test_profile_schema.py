"""The profile file contract and ``ptplan profile``'s errors: clear messages naming the field, exit 2, no file."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ptplan.cli.main import cli
from ptplan.planner.errors import PtplanError, SchemaError
from ptplan.planner.families import FAMILY_NAMES
from ptplan.planner.profile import SCHEMA, load_profile, profile_from_json, save_profile
from ptplan.planner.synthetic import synthetic_profile
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



# ---- every field checked on load (the audit: a bad family, memory, measurement or provenance planned, exit 0) ----

SHIPPED = PROFILE_DIR / "bert-tiny_cpu_fp32.json"
SLICED = PROFILE_DIR / "gpt2_cpu_fp32_slices.json"
OPTIONAL = {"provenance", "token_slices", "model.config", "device.threads", "whole_model.peak_memory_bytes",
            "provenance.command", "provenance.device_model", "token_slices.command", "token_slices.timer",
            "token_slices.forward.per_square", "token_slices.backward.per_square"} | {f"layers[1].{k}" for k in (
                "backward_weight_s", "optimizer_s", "backward_working_bytes_per_sample", "accumulate_bytes",
                "backward_stash_bytes_per_sample")}
"""The fields a profile may leave out (``docs/contracts.md``); every other one is required."""


def _shipped(path: Path = SHIPPED) -> dict:
    return json.loads(path.read_text())


def _write(tmp_path: Path, d: dict) -> Path:
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    return p


def _refused(tmp_path: Path, d: dict) -> SchemaError:
    """The one error ``load_profile`` gives for ``d`` written to a file: it names the file and carries a fix."""
    p = _write(tmp_path, d)
    with pytest.raises(SchemaError) as e:
        load_profile(p)
    assert str(e.value).startswith(f"profile {p}: field '{e.value.field}': ") and e.value.fix, str(e.value)
    return e.value


def _records(d: dict) -> list[tuple[str, dict]]:
    """(path, record) of every record the reader types field by field (``model.config`` and ``measurement`` are
    free-form objects, checked as a whole and in the keys a command reads)."""
    out = [("", d)] + [(k, d[k]) for k in ("model", "device", "whole_model", "provenance") if k in d]
    out.append(("layers[1]", d["layers"][1]))
    if "token_slices" in d:
        ts = d["token_slices"]
        out += [("token_slices", ts), ("token_slices.forward", ts["forward"]),
                ("token_slices.backward", ts["backward"]), ("token_slices.points[0]", ts["points"][0])]
    return out


def _every_field() -> list[tuple[Path, str]]:
    out = []
    for base in (SHIPPED, SLICED):
        for rec_path, rec in _records(_shipped(base)):
            for key in rec:
                path = f"{rec_path}.{key}" if rec_path else key
                if base == SHIPPED or path.startswith("token_slices"):
                    out.append((base, path))
    return out


def _at(d: dict, path: str) -> tuple[dict, str]:
    """The record holding ``path`` and the key in it."""
    *parts, key = path.replace("[", ".[").split(".")
    for part in parts:
        d = d[int(part[1:-1])] if part.startswith("[") else d[part]
    return d, key


@pytest.mark.parametrize("base, path", _every_field(), ids=lambda x: x if isinstance(x, str) else x.stem)
def test_every_field_is_typed_and_required_unless_optional(tmp_path, base, path):
    """Table-driven over every field of a shipped profile's records: a value of the wrong type is refused naming
    that field; left out, it is refused as missing unless the contract makes it optional (then the file loads)."""
    d = _shipped(base)
    rec, key = _at(d, path)
    rec[key] = "text" if isinstance(rec[key], dict) else {"bad": 1}
    e = _refused(tmp_path, d)
    assert e.field == path and "got" in e.problem, str(e)
    d = _shipped(base)
    rec, key = _at(d, path)
    del rec[key]
    if path in OPTIONAL:
        load_profile(_write(tmp_path, d))
    else:
        e = _refused(tmp_path, d)
        assert e.field == path and e.problem.startswith("missing"), str(e)


def _set(path: str, value):
    def mutate(d: dict) -> None:
        rec, key = _at(d, path)
        rec[key] = value
    return mutate


@pytest.mark.parametrize("mutate, field, words", [
    # 1. a family the planner and executor do not know
    (_set("model.family", "resnet"), "model.family", ["'resnet'", "bert, vit, gpt2, llama", "backbone's model_type"]),
    (_set("model.family", ""), "model.family", ["''", "one of bert"]),
    (_set("model.family", "deberta-v2"), "model.family", ["'deberta-v2'"]),
    (_set("model.dtype", "int8"), "model.dtype", ["'int8'", "float32"]),
    # 2. the device's memory: positive bytes; 0 (not known) only for a CPU
    (_set("device.memory_bytes", -1), "device.memory_bytes", ["is -1", "positive integer", "or 0 for a CPU"]),
    (_set("device.memory_bytes", -(2**40)), "device.memory_bytes", ["is -1,099,511,627,776"]),
    (_set("device", {**_shipped()["device"], "kind": "cuda", "memory_bytes": 0}), "device.memory_bytes",
     ["is 0", "a CUDA device always reports it"]),
    (_set("device.memory_bytes", 2**61), "device.memory_bytes", ["2,305,843,009,213,693,952", "maximum"]),
    (_set("device.memory_bytes", 1.5e10), "device.memory_bytes", ["15000000000.0"]),
    (_set("device.memory_bytes", True), "device.memory_bytes", ["True"]),
    (_set("device.memory_bytes", "16 GiB"), "device.memory_bytes", ["'16 GiB'"]),
    # 3. measurement and provenance: missing or of the wrong type; the keys a command reads
    (lambda d: d.pop("measurement"), "measurement", ["missing", "ptplan profile", "\"measurement\": {}"]),
    (_set("measurement", []), "measurement", ["expected an object, got list"]),
    (_set("measurement", "timed"), "measurement", ["expected an object, got str"]),
    (_set("measurement", None), "measurement", ["expected an object, got NoneType"]),
    (_set("provenance", ["measured"]), "provenance", ["expected an object, got list"]),
    (_set("provenance", "measured"), "provenance", ["expected an object, got str"]),
    (_set("provenance", None), "provenance", ["expected an object, got NoneType"]),
    (_set("provenance.source", "guessed"), "provenance.source", ["'guessed'", "measured"]),
    (_set("provenance.source", "projected"), "provenance.device_model", ["is None", "--project"]),
    (_set("measurement.action_overhead_s", -0.001), "measurement.action_overhead_s", ["-0.001", "minimum"]),
    (_set("measurement.action_overhead_s", 3600), "measurement.action_overhead_s", ["3600", "maximum"]),
    (_set("measurement.action_overhead_s", "1e-4"), "measurement.action_overhead_s", ["'1e-4'"]),
    (_set("measurement.model_arg", 5), "measurement.model_arg", ["got 5"]),
    (_set("measurement.weights_arg", ["w"]), "measurement.weights_arg", ["['w']"]),
    (_set("measurement.host_io", "fast"), "measurement.host_io", ["got str"]),
    (_set("whole_model.peak_memory_bytes", [1, 2]), "whole_model.peak_memory_bytes", ["2 entries for 7"]),
    (_set("whole_model.peak_memory_bytes", [-1] * 7), "whole_model.peak_memory_bytes[0]", ["-1", "minimum"]),
    (_set("device.unknown_key", 1), "device.unknown_key", ["unknown key", "memory_bytes"]),
    (_set("provenance.note", "x"), "provenance.note", ["unknown key"]),
], ids=lambda x: x[0] if isinstance(x, list) else x if isinstance(x, str) else "")
def test_bad_values_are_refused_with_the_field_value_and_fix(tmp_path, mutate, field, words):
    d = _shipped()
    mutate(d)
    e = _refused(tmp_path, d)
    assert e.field == field, str(e)
    for w in words:
        assert w in str(e), (w, str(e))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_known_family_loads(tmp_path, family):
    d = _shipped()
    d["model"]["family"] = family
    assert load_profile(_write(tmp_path, d)).model.family == family


def test_what_writers_write_still_loads(tmp_path):
    """The documented values the rules keep: a CPU's memory 0 (the profiler writes it where the operating system does
    not report its RAM), a synthetic profile (memory 0, written by ``save_profile`` in tests and benchmarks), a file
    written before provenance existed (read as measured), an empty measurement, a projected profile."""
    d = _shipped()
    d["device"]["memory_bytes"] = 0
    assert load_profile(_write(tmp_path, d)).device.memory_bytes == 0
    syn = synthetic_profile(num_blocks=2)
    save_profile(syn, tmp_path / "syn.json")
    assert load_profile(tmp_path / "syn.json") == syn and syn.device.memory_bytes == 0
    d = _shipped()
    del d["provenance"]
    d["measurement"] = {}
    prof = load_profile(_write(tmp_path, d))
    assert prof.provenance.source == "measured" and prof.measurement == {}
    prof = load_profile(PROFILE_DIR / "bert-tiny_h100_bf16.json")
    assert prof.provenance.source == "projected" and prof.provenance.device_model == "h100"


def test_the_loaders_bounds_are_the_planners():
    """The dtypes a profile may name are the ones the cost model prices; the action overhead it accepts is the one
    the planner charges (``cluster.charged_overheads``)."""
    from ptplan.planner.cluster import MAX_LATENCY_S
    from ptplan.planner.costs import DTYPE_BYTES
    from ptplan.planner.profile import DTYPES, MAX_ACTION_OVERHEAD_S

    assert set(DTYPES) == set(DTYPE_BYTES)
    assert MAX_ACTION_OVERHEAD_S == MAX_LATENCY_S


def test_a_custom_models_profile_loads(tmp_path, one_torch_thread):
    """docs/models.md's "your own model" flow: a Hugging Face backbone with your head through ``custom_model``,
    profiled by ``profile_model`` and saved; its family is the backbone's model_type, which the loader takes."""
    import torch
    import transformers as tf
    from torch import nn

    from ptplan.executor.families.models import LayerSpec, backbone_layers, custom_model
    from ptplan.executor.profiling.profiler import profile_model

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(32, 3)

        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            return self.fc(x.mean(dim=1))

    torch.manual_seed(0)
    bert = tf.BertModel(tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=100), add_pooling_layer=False)
    layers, specs = backbone_layers(bert, "half")
    model = custom_model(layers + [Head()], specs + [LayerSpec("head", "head", None)],
                         nn.functional.cross_entropy, name="my-bert-head", config=bert.config, seq_len=8,
                         num_labels=3)
    prof = profile_model(model, device="cpu", batch_sizes=[1], warmup=0, repeats=1, progress=False)
    save_profile(prof, tmp_path / "mine.json")
    back = load_profile(tmp_path / "mine.json")
    assert (back.model.name, back.model.family, back.num_blocks) == ("my-bert-head", "bert", 1)


@pytest.mark.parametrize("mutate", [_set("model.family", "resnet"),
                                    _set("device", {**_shipped()["device"], "kind": "cuda", "memory_bytes": 0}),
                                    lambda d: d.pop("measurement"), _set("provenance", [])],
                         ids=["family", "memory", "measurement", "provenance"])
def test_cli_plan_refuses_a_bad_profile_in_one_line(tmp_path, monkeypatch, mutate):
    """``ptplan plan BAD.json --cluster cpu:2``: exit 2, one line naming the file and the field, no plan written."""
    d = _shipped()
    mutate(d)
    bad = _write(tmp_path, d)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["plan", str(bad), "--cluster", "cpu:2", "--out", "plan.json"])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: profile {bad}: field '"), res.output
    assert "Traceback" not in res.output and not (tmp_path / "plan.json").exists()

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
