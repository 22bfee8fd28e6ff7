"""The README and the docs: short, linked, built strictly, and free of development history."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
# a commit hash (7-40 hex digits with a letter and a digit, not part of a number or a word) or a run letter ("run Q")
HISTORY = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w.])|(?<![-\w])[Rr]uns? [A-Z](-[A-Z])?(?![\w/])")
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def _user_texts() -> list[Path]:
    texts = [ROOT / "README.md", *DOCS, *sorted((ROOT / "examples").rglob("*.py"))]
    return texts + sorted((ROOT / "dynsteer").rglob("*.py"))


def test_the_readme_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150: the rest belongs in docs/)"


@pytest.mark.parametrize("path", _user_texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_hashes_or_run_letters(path):
    hits = [f"{i}: {m.group(0)}" for i, line in enumerate(path.read_text().splitlines(), 1)
            for m in HISTORY.finditer(line)]
    assert not hits, f"{path.relative_to(ROOT)} names development history (it belongs in benchmarks/RESULTS.md): {hits}"


def test_the_history_check_catches_what_it_is_for():
    assert HISTORY.search("measured on 9a07e65, H100") and HISTORY.search("see run T-B")
    assert not HISTORY.search("finite = score <= 1.7976931348623157e308") and not HISTORY.search("eps 9.99999974e-06")
    assert not HISTORY.search("a decade added") and not HISTORY.search("Run the tests")
    assert not HISTORY.search("run-to-run A/A noise")


def _block(page: str, lang: str, index: int = 0) -> str:
    import mktestdocs

    return mktestdocs.grab_code_blocks((ROOT / "docs" / page).read_text(), lang=lang)[index]


def test_the_yaml_and_json_blocks_are_what_dynsteer_reads(tmp_path):
    """The data blocks (not executed by test_docs_run) load as the files and bodies they show: the sweeps guide's
    policy file (with the files it names beside it), the vectors guide's pairs, the serving guide's preset."""
    import json

    import numpy as np

    from dynsteer import DynamicSteeringPolicy
    from dynsteer.config import Preset
    from dynsteer.probefile.fileformat import save_probe
    from dynsteer.sweep.config import load_target
    from dynsteer.vectors import save_vector
    from dynsteer.vectors.pairs import read_pairs

    (tmp_path / "policy.yaml").write_text(_block("guides/sweeps.md", "yaml"))
    save_probe(tmp_path / "sentiment-probe.safetensors", np.ones(8), bias=0.0, model_id="m", layer=20)
    save_vector(tmp_path / "positive.safetensors", {20: np.arange(8, dtype=np.float32)})
    policy = load_target(tmp_path / "policy.yaml")
    assert isinstance(policy, DynamicSteeringPolicy) and policy.controller.on == 2.0 and policy.controller.off == 0.0
    np.testing.assert_array_equal(np.asarray(policy.rules[0].actions[0].vector), np.arange(8))

    text, objs, at = _block("guides/vectors.md", "json"), [], 0
    while text[at:].strip():  # one object per line in a file; the page wraps the second
        at += len(text[at:]) - len(text[at:].lstrip())
        obj, at = json.JSONDecoder().raw_decode(text, at)
        objs.append(obj)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(o) + "\n" for o in objs))
    assert len(read_pairs(tmp_path / "pairs.jsonl")) == 2

    preset = Preset.model_validate_json(_block("guides/serving.md", "json"))
    assert preset.params["scale"].default == 4.0


def test_the_design_is_cited_in_the_repository():
    """Code and docs cite the design the repository holds (docs/architecture.md), never a file outside it."""
    texts = [ROOT / "README.md", *DOCS, *sorted((ROOT / "dynsteer").rglob("*.py")),
             *sorted((ROOT / "tests").glob("*.py")), *sorted((ROOT / "examples").rglob("*.py")),
             *sorted((ROOT / "benchmarks").glob("*.py"))]
    stale = re.compile(r"DESIGN(\.md| §)|\.\./shared/")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in texts if p != Path(__file__)
            for i, line in enumerate(p.read_text().splitlines(), 1) if stale.search(line)]
    assert not hits, f"citations of a design outside the repository: {hits}"


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = [target for target, _ in LINK.findall(path.read_text())
              if "://" not in target and not (path.parent / target).exists()]
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


def test_every_docs_page_is_in_the_nav_and_the_site_builds_strictly(tmp_path):
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(ROOT / "docs")) for p in DOCS if str(p.relative_to(ROOT / "docs")) not in nav]
    assert not missing, f"pages outside mkdocs.yml's nav: {missing}"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "guides" / "dynamic" / "index.html").exists()
    # the reference pages are generated from the code: every steering route, the schemas, the API's public names
    from dynsteer.engine.server import SteeringEndpoints

    http = (tmp_path / "site" / "reference" / "http" / "index.html").read_text()
    for route in SteeringEndpoints().router().routes:
        for method in route.methods:
            assert re.search(rf"<code>{method}</code>\s*</td>\s*<td><code>{re.escape(route.path)}</code>", http), (
                method, route.path)
    schema = (tmp_path / "site" / "reference" / "schema" / "index.html").read_text()
    assert "ProjectionClamp" in schema and "target_class" in schema and "\"$defs\"" in schema
    python = (tmp_path / "site" / "reference" / "python" / "index.html").read_text()
    import dynsteer

    missing = [n for n in dynsteer.__all__ if n not in ("SITES", "TIERS") and f'id="dynsteer.{n}"' not in python]
    assert not missing, f"public names without a reference entry: {missing}"
    # a monitor service's API (dynsteer.monitor) and its commands' ack
    import dynsteer.monitor

    missing = [n for n in dynsteer.monitor.__all__ if f'id="dynsteer.monitor.{n}"' not in python]
    assert not missing and 'id="dynsteer.commands.CommandAck"' in python, f"monitor names without an entry: {missing}"
