"""A skipped browser test is named in the test run's summary with its reason (tests/conftest.py's
``pytest_terminal_summary``), so a missing chromium does not vanish into one 's'."""
from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


def test_skipped_browser_tests_are_listed_with_their_reason(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    browser: needs headless Chromium\n")
    pytester.makepyfile(test_inner="""
        import pytest

        @pytest.mark.browser
        def test_report_in_chromium():
            pytest.skip("chromium/chromedriver is not available (apt install chromium chromium-driver)")

        def test_plain():
            pytest.skip("something else")
    """)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=2)
    out = result.stdout.str()
    assert "browser tests skipped" in out
    assert "1 browser test(s) did not run: chromium/chromedriver is not available" in out
    assert "test_inner.py::test_report_in_chromium" in out
    assert "test_plain" not in out.split("browser tests skipped")[1]


def test_no_section_when_no_browser_test_was_skipped(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    browser: needs headless Chromium\n")
    pytester.makepyfile(test_inner="""
        import pytest

        @pytest.mark.browser
        def test_ran():
            assert True
    """)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "browser tests skipped" not in result.stdout.str()
