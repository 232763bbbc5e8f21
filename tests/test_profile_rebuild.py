"""A tool that re-measures a profile's model builds that model, and nothing else (``model_for_profile``).

``bench/profile_working.py`` once rebuilt a profile's model by hand and left out the classifier size, so every
ViT profile (ImageNet's 1000 classes) was re-measured with ``build_model``'s 2-class head and refused as "changed".
Every tool that rebuilds a profile's model now goes through ``model_for_profile``, which checks the profile's
fingerprint (layer names, kinds, blocks, parameter counts); these tests hold it to every shipped profile.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ptplan.executor.profiling.profiler import model_for_profile
from ptplan.executor.profiling.slices import main as slices_main
from ptplan.planner.errors import PtplanError
from ptplan.planner.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "profiles").glob("*.json"))
WORKING = ("backward_working_bytes_per_sample", "accumulate_bytes")


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_profile_rebuilds_to_its_own_structure(path):
    prof = load_profile(path)
    model = model_for_profile(prof, layers=[])  # every weight on meta: no storage
    assert [s.name for s in model.specs] == [r.name for r in prof.layers]
    assert [sum(p.numel() for p in layer.parameters()) for layer in model.layers] == [r.params for r in prof.layers]
    assert model.granularity == prof.model.granularity and model.seq_len == prof.model.seq_len
    assert next(model.parameters()).dtype == getattr(__import__("torch"), prof.model.dtype)


def test_a_profile_of_another_head_is_refused_with_the_layer_that_differs():
    prof = load_profile(ROOT / "profiles" / "bert-tiny_cpu_fp32.json")
    other = dataclasses.replace(prof, model=dataclasses.replace(prof.model, config={**prof.model.config,
                                                                                     "num_labels": 3}))
    with pytest.raises(PtplanError, match=r"does not match the profile.*head: 195 parameters, the profile's 130"):
        model_for_profile(other, layers=[])  # bert-tiny's head with 3 classes: 64 x 3 + 3 = 195 against 64 x 2 + 2


def test_slices_refuse_to_measure_another_model_into_a_profile(tmp_path):
    out = tmp_path / "p.json"
    with pytest.raises(PtplanError, match="does not match the profile"):
        slices_main(["gpt2-tiny", "--base", str(ROOT / "profiles" / "gpt2_cpu_fp32.json"), "--out", str(out)])
    assert not out.exists()


def test_profile_working_fills_a_vit_profile_as_shipped(tmp_path):
    """The bench tool re-measures the shipped ViT profile's working set (1000-class head) and gets the shipped
    numbers back; with a hand-built 2-class model it refused the file."""
    shipped = ROOT / "profiles" / "vit-base_h100_bf16.json"
    d = json.loads(shipped.read_text())
    assert any(layer.get("backward_working_bytes_per_sample") for layer in d["layers"])
    for layer in d["layers"]:
        for key in WORKING:
            layer.pop(key, None)
    bare = tmp_path / shipped.name
    bare.write_text(json.dumps(d))
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_working.py"), "--projected", str(bare),
                        "--out-dir", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    filled = json.loads((out / shipped.name).read_text())["layers"]
    want = json.loads(shipped.read_text())["layers"]
    for key in WORKING:
        assert [layer.get(key, 0) for layer in filled] == [layer.get(key, 0) for layer in want], key
