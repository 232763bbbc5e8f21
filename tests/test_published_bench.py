"""bench/published.py's data table (issue 22 item 6): every point cites a source, at most a third are fitted,
Megatron-LM's FLOP count is eq. 3 of the paper, and the table's own aggregates agree with its rows."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pub():
    spec = importlib.util.spec_from_file_location("published_bench", ROOT / "bench" / "published.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["published_bench"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_points_cite_sources_and_at_most_a_third_are_fitted(pub):
    points = pub.megatron_points() + pub.other_points()
    assert len(points) >= 20 and len({p.key for p in points}) == len(points)
    assert all(p.source in pub.SOURCES and p.where and p.published > 0 for p in points)
    assert len({p.source for p in points if not p.fit}) >= 4
    assert 3 * sum(p.fit for p in points) <= len(points)
    assert all(p.kind in pub.PRICE for p in points)


def test_megatron_flops_is_the_papers_equation_3(pub):
    """F = 96·B·s·l·h²(1 + s/6h + V/16lh); the 1 T row: 163 TFLOP/s on 3,072 GPUs is Table 1's 502 PFLOP/s
    aggregate, and an iteration of batch 3,072 then takes F / 502e15 s."""
    cfg = pub._gpt(25600, 160, 128)
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200
    assert pub.megatron_flops(B, cfg) == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))
    row = next(r for r in pub._T1 if r[0] == 1008.0)
    assert row[8] * row[6] / 1e3 == pytest.approx(502.0, rel=0.01)


def test_parameter_counts_match_the_table(pub):
    """Each Table 1 configuration has the parameters its row states (the paper's eq. 2, 12·l·h²·(1 + 13/12h +
    (V + s)/12lh), rounded as the table rounds it), so the configurations are transcribed right."""
    for p, heads, h, l, *_ in pub._T1:
        n = 12 * l * h * h * (1 + 13 / (12 * h)) + (51200 + 2048) * h
        assert round(n / 1e9, 1) == p, p
