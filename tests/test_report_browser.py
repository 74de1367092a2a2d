"""The report can be read in a real browser: `results/report.html` (Snakemake's report, made
as `make demo` makes it) opened in headless Chromium at 1400x900 shows, on its landing page,
the statistics of `results/stats/summary.md` as tables: records in, kept and rejected per
stage with the rejection reasons, per category and overall, first, then lengths, reasoning,
generation, conversations and token coverage.

What is checked is what the browser laid out, not DOM text: a script appended to a copy of the
report (tests/report_measure.js) waits for React to render the page and prints the element
boxes it measures. The page's top is on screen, the first table (records per stage) is whole
on the first screen, no table or paragraph is cut at the right or scrolled sideways, and every
row of summary.md is a row of cells on the page. `make test` installs Chromium (`make
test-deps`, as root); without it the test skips, except under CI=true where it fails.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import copy_run, failed, snakemake

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    # `make test` installs it (as root); CI must not pass this test by skipping it.
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is not installed under CI=true: make test-deps installs it")
    pytest.skip("chromium not installed (apt-get install chromium)")


MEASURE_JS = Path(__file__).with_name("report_measure.js")
VIEWPORT = (1400, 900)


def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The body rows of the table under `## heading...` in summary.md, as the cells a browser
    shows (Markdown's ** and backticks are markup, not text)."""
    section = markdown.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [
        [cell.strip().replace("**", "").replace("`", "") for cell in row.strip("|").split("|")]
        for row in rows
    ]


def measure(chromium: str, report: Path, tmp_path: Path) -> dict:
    """Open a copy of the report with the measuring script appended; return what it printed."""
    page = report.read_text()
    end = page.rindex("</body>")
    measured = tmp_path / "measured.html"
    measured.write_text(page[:end] + f"<script>{MEASURE_JS.read_text()}</script>" + page[end:])
    # A fresh profile folder and no sandbox (tests run as root in containers); the virtual
    # time budget lets the page's scripts run before the DOM is printed.
    proc = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'chromium-profile'}",
            f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
            "--virtual-time-budget=20000",
            "--dump-dom",
            measured.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.search(r'<pre id="tokenmill-measure">(.*?)</pre>', proc.stdout, re.S)
    assert found, "the landing page never showed #tokenmill-stats:\n" + proc.stdout[-2000:]
    return json.loads(html.unescape(found.group(1)))


def test_report_shows_the_statistics_as_tables_on_screen(demo_workdir, tmp_path):
    chromium = browser()
    run = copy_run(demo_workdir, tmp_path / "demo")
    made = snakemake(run, "--report", "results/report.html")
    assert made.returncode == 0, failed(made)
    m = measure(chromium, run / "results" / "report.html", tmp_path)
    width, height = m["viewport"]["width"], m["viewport"]["height"]
    assert width == VIEWPORT[0] and 0 < height <= VIEWPORT[1], m["viewport"]

    # The page's top is on screen at scroll position 0 (not centred out of reach).
    assert 0 <= m["page_top"]["top"] < height, m["page_top"]
    tables = {t["heading"]: t for t in m["tables"]}
    first = m["tables"][0]
    assert first["heading"] == "Records per stage", list(tables)
    # The first table, whole, on the first screen.
    assert first["box"]["top"] >= 0 and first["box"]["bottom"] <= height, first["box"]
    # Nothing is cut at the right or scrolled sideways.
    for t in m["tables"]:
        assert not t["clipped_by"], (t["heading"], t["clipped_by"])
        assert t["box"]["right"] <= width, (t["heading"], t["box"])
    assert all(p["right"] <= width for p in m["texts"]), m["texts"]

    # Every row of summary.md's tables is a row of cells on the page.
    summary = (run / "results" / "stats" / "summary.md").read_text()
    for heading in ("Records per stage", "Generation", "Token coverage (loss-masked tokens)"):
        assert tables[heading]["rows"] == table_rows(summary, heading), heading
    assert any("truncated:" in row[-1] for row in first["rows"])  # the demo's merge rejects
