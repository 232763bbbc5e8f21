"""The report renders in headless Chromium with no network: every figure drawn, no console errors; the
M = 64 timeline draws a few dozen shapes; a small model's memory labels and a CPU cluster's words as drawn."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from plan_fixtures import cpu_plan, deep_plan, many_microbatch_plan, vit_paper_plan
from ptplan.planner.report.viz import FIGURES, write_report

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
DRIVER_CANDIDATES = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
WIDTH = 1280


def _find(cands: tuple[str, ...], name: str) -> str | None:
    for c in cands:
        if os.path.exists(c):
            return c
    return shutil.which(name)


def _need(what: str) -> None:
    """Skip with a reason, except on CI (CI=true) where a missing browser is a failure."""
    msg = f"{what} is not available (apt install chromium chromium-driver; pip install selenium)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def driver():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _need("selenium")
    chromium, chromedriver = _find(CHROMIUM_CANDIDATES, "chromium"), _find(DRIVER_CANDIDATES, "chromedriver")
    if not chromium or not chromedriver:
        _need("chromium/chromedriver")
    profile = tempfile.mkdtemp(prefix="ptplan-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
              "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--hide-scrollbars",
              f"--window-size={WIDTH},1000", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(chromedriver), options=opts)
    d.set_page_load_timeout(30)
    d.set_script_timeout(30)
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


RENDERED_JS = """
const divs = document.querySelectorAll('.js-plotly-plot');
let drawn = 0;
divs.forEach(d => { if (d.querySelector('.main-svg') && d._fullLayout) drawn += 1; });
return [divs.length, drawn];
"""

STEPS_JS = """
const done = arguments[arguments.length - 1];
(async () => {
  const out = {};
  for (const div of document.querySelectorAll('.js-plotly-plot')) {
    const sliders = div.layout.sliders || [], menus = div.layout.updatemenus || [];
    const steps = sliders.length ? sliders[0].steps : menus.length ? menus[0].buttons : null;
    if (!steps) continue;
    for (const s of [...steps, steps[0]]) await Plotly.update(div, s.args[0], s.args[1]);
    out[div.id] = steps.length;
  }
  return out;
})().then(done, e => done('error: ' + e));
"""


def test_report_renders_offline(driver, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    report = tmp_path / "report.html"
    plan = vit_paper_plan()
    write_report(plan, report)
    driver.get(report.resolve().as_uri())
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(RENDERED_JS) == [len(FIGURES), len(FIGURES)])
    # every figure div is a distinct plotly plot with its own SVG
    ids = driver.execute_script("return Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => d.id)")
    assert ids == [f"fig-{k}" for k in FIGURES]
    assert driver.execute_script("return typeof Plotly") == "object"
    # nothing was fetched from the network (the page is self-contained)
    fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not [u for u in fetched if u.startswith(("http:", "https:"))], fetched

    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WIDTH, min(int(height) + 40, 16000))
    WebDriverWait(driver, 10).until(lambda d: d.execute_script(RENDERED_JS) == [len(FIGURES), len(FIGURES)])
    driver.execute_script("return new Promise(r => requestAnimationFrame(() => setTimeout(r, 300)))")

    shot = tmp_path / "report_screenshot.png"
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    out_dir = os.environ.get("PTPLAN_SCREENSHOT_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, Path(out_dir) / "report_screenshot.png")

    # every phase selector step applies cleanly (what moving the slider does)
    applied = driver.execute_async_script(STEPS_JS)
    n = len(plan.phases)
    assert applied == {"fig-cluster": n, "fig-timeline": n, "fig-memory": n}

    severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, f"console errors: {severe}"


def test_report_with_a_run_draws_the_comparison_figure(driver, tmp_path):
    """``ptplan show --run``: the predicted-against-measured figure is drawn last, with its error labels."""
    from selenium.webdriver.support.ui import WebDriverWait

    from ptplan.planner.compare import compare, read_run_log
    from ptplan.planner.runlog import SCHEMA as RUNLOG_SCHEMA
    from ptplan.planner.report.viz import COMPARISON

    plan = vit_paper_plan()
    recs = [{"type": "header", "schema": RUNLOG_SCHEMA, "plan_fingerprint": plan.inputs.profile.fingerprint,
             "model": plan.inputs.profile.model, "world_size": plan.world_size,
             "phases": [dict(frozen_blocks=p.frozen_blocks, K=p.K, D=p.D, M=p.M) for p in plan.phases]}]
    step = 0
    for i, ph in enumerate(plan.phases[:3]):
        for k in range(4):
            r = {"type": "step", "epoch": 0, "step": step, "phase": i, "frozen_blocks": ph.frozen_blocks, "K": ph.K,
                 "D": ph.D, "samples": ph.global_batch, "loss": 1.0,
                 "seconds": ph.predicted.iteration_s * (1.1 if k else 3.0)}
            if k == 1:
                r.update(memory_sampled=True, peak_memory_bytes=int(max(ph.predicted.stage_peak_memory_bytes) * 0.8))
            recs.append(r)
            step += 1
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    c = compare(plan, read_run_log(log))
    report = tmp_path / "report.html"
    write_report(plan, report, comparison=c)
    driver.get(report.resolve().as_uri())
    n = len(FIGURES) + 1
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(RENDERED_JS) == [n, n])
    ids = driver.execute_script("return Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => d.id)")
    assert ids == [f"fig-{k}" for k in FIGURES] + [f"fig-{COMPARISON}"]
    bars = driver.execute_script(f"return document.querySelectorAll('#fig-{COMPARISON} .bars .point').length")
    assert bars == 4 * 3  # predicted and measured, time and memory, for 3 phases
    labels = driver.execute_script(f"return Array.from(document.querySelectorAll('#fig-{COMPARISON} .bars text'))"
                                   ".map(t => t.textContent)")
    assert labels.count("-9%") == 3 and labels.count("+25%") == 3, labels  # 1/1.1 - 1 and 1/0.8 - 1
    severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, f"console errors: {severe}"


DRAWN_TEXT_JS = """
const root = document.querySelector(arguments[0]);
const svg = Array.from(root.querySelectorAll('svg text')).map(t => t.textContent);
return [root.innerText, svg];
"""


def test_large_M_timeline_small_memory_and_cpu_words_as_drawn(driver, tmp_path):
    """What a reader sees: the M = 64 timeline as a few dozen bars spanning the iteration; a small model's
    memory labels in MiB/KiB, none '0.0'; a cpu:4 plan's page without the word GPU anywhere it is drawn."""
    from selenium.webdriver.support.ui import WebDriverWait

    plan = many_microbatch_plan()
    report = tmp_path / "m64.html"
    write_report(plan, report)
    driver.get(report.resolve().as_uri())
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(RENDERED_JS) == [len(FIGURES), len(FIGURES)])
    ph = next(p for p in plan.phases if p.timeline)
    bars = driver.execute_script("return document.querySelectorAll('#fig-timeline .bars .point').length")
    assert 0 < bars < 100 and len(ph.timeline) > 1000, bars  # a few dozen shapes, not one per event
    xs = driver.execute_script("""
        const div = document.getElementById('fig-timeline');
        const ends = div._fullData.filter(t => t.visible === true && t.type === 'bar' && t.base)
            .flatMap(t => Array.from(t.x, (w, k) => [t.base[k], t.base[k] + w]));
        return [Math.min(...ends.map(e => e[0])), Math.max(...ends.map(e => e[1]))];""")
    span = (min(e.start for e in ph.timeline) * 1e3, max(e.end for e in ph.timeline) * 1e3)
    assert xs[0] == pytest.approx(span[0], abs=1e-6) and xs[1] == pytest.approx(span[1], rel=1e-6)

    plan = cpu_plan()
    report = tmp_path / "cpu.html"
    write_report(plan, report)
    driver.get(report.resolve().as_uri())
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(RENDERED_JS) == [len(FIGURES), len(FIGURES)])
    text, svg = driver.execute_script(DRAWN_TEXT_JS, "main")
    assert "gpu" not in (text + " ".join(svg)).lower()
    assert "CPU process" in text
    _, labels = driver.execute_script(DRAWN_TEXT_JS, "#fig-memory .scatterlayer")
    assert labels and all(l.endswith(("KiB", "MiB")) and not l.startswith("0.0") for l in labels), labels
    severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, f"console errors: {severe}"


def test_many_phases_dropdown_applies_every_phase(driver, tmp_path):
    """More phases than a slider holds: every dropdown entry of every figure applies without an error."""
    from selenium.webdriver.support.ui import WebDriverWait

    plan = deep_plan()
    report = tmp_path / "deep.html"
    write_report(plan, report)
    driver.get(report.resolve().as_uri())
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(RENDERED_JS) == [len(FIGURES), len(FIGURES)])
    applied = driver.execute_async_script(STEPS_JS)
    n = len(plan.phases)
    assert applied == {"fig-cluster": n, "fig-timeline": n, "fig-memory": n}
    labels = driver.execute_script(DRAWN_TEXT_JS, "#fig-memory .scatterlayer")[1]
    assert len(labels) == plan.phases[0].K  # back on the first phase after the loop
    severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, f"console errors: {severe}"


def test_two_bw_steady_state_and_tensor_parallel_groups_as_drawn(driver, tmp_path):
    """A 2BW plan's timeline is drawn as one shaded steady-state period titled so; a tensor-parallel plan's
    rank grid draws one outline per tp group with the strategy and mesh in its title; every phase step of
    both applies without an error."""
    from selenium.webdriver.support.ui import WebDriverWait
    from test_viz import _pinned_plan

    from ptplan.planner.cluster import get_preset
    from ptplan.planner.config import TrainingConfig
    from ptplan.planner.freeze import FreezePolicy
    from ptplan.planner.planner import make_plan
    from ptplan.planner.synthetic import synthetic_profile

    shapes_js = "return document.querySelectorAll(arguments[0] + ' .shapelayer path').length"
    two_bw = _pinned_plan("gpt2_cpu_fp32", "cpu:4", "2bw", K=4, M=8, batch=32)
    prof = synthetic_profile(num_blocks=2, hidden=32768, seq_len=1024, vocab=32000, batch_sizes=(1, 2, 4))
    tp = make_plan(prof, get_preset("h100-4node"),
                   TrainingConfig(epochs=2, samples_per_epoch=1024, batch=32, allow_extrapolation=True),
                   FreezePolicy(alpha=1 / 3), strategies="auto")
    for name, plan in (("2bw", two_bw), ("tp", tp)):
        report = tmp_path / f"{name}.html"
        write_report(plan, report)
        driver.get(report.resolve().as_uri())
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(RENDERED_JS) == [len(FIGURES), len(FIGURES)])
        ph = plan.phases[0]
        if name == "2bw":
            text, svg = driver.execute_script(DRAWN_TEXT_JS, "#fig-timeline")
            assert any(t.startswith("Flush-free steady state of pipeline 0: one period =") for t in svg), svg[:5]
            assert any(t.startswith("one period:") for t in svg)
            assert driver.execute_script(shapes_js, "#fig-timeline") == ph.K + 3  # idle bands, period, its edges
        else:
            _, svg = driver.execute_script(DRAWN_TEXT_JS, "#fig-cluster")
            assert any(f"{ph.strategy_label} (mesh K × D × tp = {ph.K} × {ph.D} × {ph.tp})" in t for t in svg)
            assert driver.execute_script(shapes_js, "#fig-cluster") == ph.K * ph.D  # one outline per tp group
        applied = driver.execute_async_script(STEPS_JS)
        n = len(plan.phases)
        assert applied == {"fig-cluster": n, "fig-timeline": n, "fig-memory": n}
        severe = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        assert not severe, f"console errors: {severe}"
