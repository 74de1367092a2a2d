"""The report shows its numbers in a real browser: `results/report.html` (Snakemake's report,
made as `make demo` makes it) opened in headless Chromium shows, on its landing page, the
statistics tables of `results/stats/summary.md`: records in, kept and rejected per stage with
the rejection reasons, per category and overall, and the token-coverage table.

Chromium runs the report's JavaScript (React renders the page) and `--dump-dom` prints the DOM
it built; the numbers must be in it as text, not behind a `data:` URL. `make test` installs
Chromium (`make test-deps`, as root); without it the test skips, except under CI=true where it
fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser

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


class AppText(HTMLParser):
    """The text inside the element with id="app", scripts and styles left out."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0  # elements open inside #app (0: outside)
        self.skip = 0
        self.parts: list[str] = []

    @classmethod
    def of(cls, dom: str) -> str:
        parser = cls()
        parser.feed(dom)
        return "".join(parser.parts)

    def handle_starttag(self, tag, attrs):
        if self.depth or dict(attrs).get("id") == "app":
            self.depth += tag not in VOID
            self.skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        if self.depth and tag not in VOID:
            self.depth -= 1
            self.skip -= tag in ("script", "style")

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.parts.append(data)


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source"}


def table_rows(markdown: str, heading: str) -> list[str]:
    """The body rows of the table under the `## heading...` section of summary.md."""
    section = markdown.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return rows[2:]  # past the header and the |---| line


def test_report_shows_the_statistics_in_chromium(demo_workdir, tmp_path):
    chromium = browser()
    run = copy_run(demo_workdir, tmp_path / "demo")
    made = snakemake(run, "--report", "results/report.html")
    assert made.returncode == 0, failed(made)

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
            "--virtual-time-budget=20000",
            "--dump-dom",
            (run / "results" / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # What the page shows: the text React rendered into <div id="app">, not the report's data
    # scripts (which hold the same numbers as JavaScript strings).
    text = AppText.of(proc.stdout)
    assert "Dataset statistics" in text, text[:2000]  # the menu rendered

    summary = (run / "results" / "stats" / "summary.md").read_text()
    stages = table_rows(summary, "Records per stage")
    coverage = table_rows(summary, "Token coverage")
    assert stages and coverage
    # Every row of the per-category counts (in, kept, rejected, reasons) and of the coverage
    # table is in the page as the browser rendered it.
    missing = [row for row in stages + coverage if row not in text]
    assert not missing, missing[:5]
    assert "truncated:" in text  # the demo's merge rejects truncated outputs
