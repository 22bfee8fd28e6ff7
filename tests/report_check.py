"""Reading a sweep report back for tests: its tables (cells by ``data-col``), a check that they show the CSV's values,
and its layout in headless Chromium (where the selectivity column lands at a given window width)."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from dynsteer.sweep.report_tables import VARIANT_TABLE, short

CHROMIUM = next((b for b in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                 if shutil.which(b)), None)
"""A Chromium on PATH (the test command, scripts/test.sh, installs it: apt-get install chromium), or ``None``."""


class Tables(HTMLParser):
    """Rows of each ``<table id=...>`` (cells by ``data-col``; a row's ``data-variant`` as ``_variant``) and every
    ``<img>``'s ``data-plot`` and ``src``."""

    def __init__(self, text: str = "") -> None:
        super().__init__()
        self.tables: dict[str, list[dict[str, str]]] = {}
        self.images: list[tuple[str, str]] = []
        self._table = self._col = None
        self._row: dict[str, str] | None = None
        if text:
            self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._row = {"_variant": a["data-variant"]} if a.get("data-variant") else {}
        elif tag == "td" and self._row is not None:
            self._col = a.get("data-col")
            if self._col:
                self._row[self._col] = ""
        elif tag == "img":
            self.images.append((a.get("data-plot", ""), a.get("src", "")))

    def handle_endtag(self, tag):
        if tag == "td":
            self._col = None
        elif tag == "tr" and self._row:
            self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._col and self._row is not None:
            self._row[self._col] += data


def check_report_shows_csv(report_html: str, summary_csv: str) -> Tables:
    """Assert that the report's tables show ``summary.csv``'s values (to the report's digits): one row per variant
    with its per-variant figures and per-class sub-columns, and every metric per variant and class."""
    page = Tables(report_html)
    rows = list(csv.DictReader(io.StringIO(summary_csv)))
    by = {(r["variant"], r["class"]): r for r in rows}
    variant_ids = list(dict.fromkeys(r["variant"] for r in rows))
    variants = page.tables["variants"]
    assert [r["_variant"] for r in variants] == variant_ids  # one row per variant, in order
    for r in variants:
        all_row = by[(r["_variant"], "all")]
        assert r["label"] == all_row["label"]
        for col, shown in r.items():
            if col in VARIANT_TABLE:
                assert shown == short(all_row[col]), (r["_variant"], col)
            elif ":" in col:
                metric, cls = col.split(":", 1)
                assert shown == short(by[(r["_variant"], cls)][metric]), (r["_variant"], col)
        assert all(c in r for c in VARIANT_TABLE)
    per_class = page.tables["by-class"]
    assert [(r["_variant"], r["class"]) for r in per_class] == [(r["variant"], r["class"]) for r in rows]
    for r in per_class:
        want = by[(r["_variant"], r["class"])]
        for col, shown in r.items():
            if col not in ("_variant", "class", "label"):
                assert shown == short(want[col]), (r["_variant"], r["class"], col)
    return page


_PROBE = """<script>window.addEventListener("load", function () {
  var th = document.querySelector('th[data-col="selectivity"]');
  var r = th ? th.getBoundingClientRect() : null;
  document.body.setAttribute("data-layout", JSON.stringify({
    left: r ? r.left + window.scrollX : null, right: r ? r.right + window.scrollX : null,
    visible: r ? r.width > 0 && r.height > 0 : false,
    scroll_width: document.documentElement.scrollWidth, inner_width: window.innerWidth}));
});</script>"""


def layout(report: Path, work: Path, width: int = 1280, height: int = 900) -> dict[str, Any]:
    """The selectivity header's box (page coordinates) and the page's scroll width, as headless Chromium lays the
    report out in a ``width``-pixel window."""
    assert CHROMIUM is not None
    probe = work / "layout.html"
    probe.write_text(report.read_text().replace("</body>", _PROBE + "</body>"))
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={work / 'profile-dom'}", f"--window-size={width},{height}", "--dump-dom",
                          probe.resolve().as_uri()], check=True, timeout=120, capture_output=True, text=True).stdout
    m = re.search(r'data-layout="([^"]*)"', out)
    assert m, "the layout script did not run"
    import html

    return json.loads(html.unescape(m.group(1)))


def screenshot(report: Path, work: Path, width: int = 1280, height: int = 2400) -> Path:
    assert CHROMIUM is not None
    shot = work / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={work / 'profile-shot'}", f"--window-size={width},{height}",
                    f"--screenshot={shot}", report.resolve().as_uri()], check=True, timeout=120, capture_output=True)
    return shot
