"""The import structure: import-linter's contracts (pyproject.toml) hold, the rooms of dynsteer/ import each other
without cycles, and outside ``dynsteer.engine`` only vLLM's public user API is imported.

Static checks on the source (grimp parses it; nothing is imported), a few seconds in all.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Cycles between the modules of one package that are still allowed: file circles inside the rooms being split now
# (issue 40, steps 2 and 4). Each entry is a package and the set of its children that import each other in a loop.
# Delete an entry when its refactor lands (pyproject.toml's acyclic_siblings contract ignores the same imports).
ALLOWED_CYCLES: dict[str, list[set[str]]] = {}

# What the user-level rooms may import from vLLM: its public user API (engines, sampling parameters, its version).
PUBLIC_VLLM = re.compile(r"(from vllm import (LLM|SamplingParams)(, (LLM|SamplingParams))*|import vllm)\s*(#.*)?")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("dynsteer", include_external_packages=True, cache_dir=None, exclude_type_checking_imports=True)


def test_import_linter_contracts_hold():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def strongly_connected(nodes: Iterable[str], edges: Mapping[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of size > 1."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def sibling_graph(graph: grimp.ImportGraph, package: str) -> tuple[set[str], dict[str, set[str]], dict]:
    """The children of ``package`` (each with its descendants folded in) and the imports between them, with the
    module-level imports behind each edge. The package's own ``__init__`` is left out (it is not a sibling)."""
    depth = package.count(".") + 1
    children = {m.split(".")[depth] for m in graph.modules if m.startswith(package + ".")}
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], list[str]] = {}
    for m in graph.modules:
        if not m.startswith(package + "."):
            continue
        a = m.split(".")[depth]
        for t in graph.find_modules_directly_imported_by(m):
            if t.startswith(package + ".") and (b := t.split(".")[depth]) != a:
                edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), []).append(f"{m} -> {t}")
    return children, edges, why


def packages(graph: grimp.ImportGraph) -> list[str]:
    return sorted(m for m in graph.modules if m.startswith("dynsteer") and graph.find_children(m))


def test_rooms_import_each_other_without_cycles(graph):
    children, edges, why = sibling_graph(graph, "dynsteer")
    cycles = strongly_connected(children, edges)
    detail = [f"{a} -> {b}: {why[a, b][:3]}" for c in cycles for a in sorted(c) for b in sorted(edges[a] & c)]
    assert not cycles, "rooms of dynsteer/ in an import cycle:\n" + "\n".join(detail)


def test_no_module_cycles_inside_a_room(graph):
    bad = []
    for package in packages(graph):
        if package == "dynsteer":
            continue
        children, edges, why = sibling_graph(graph, package)
        for cycle in strongly_connected(children, edges):
            if cycle not in ALLOWED_CYCLES.get(package, []):
                bad += [f"{package}: {a} -> {b}: {why[a, b][:3]}" for a in sorted(cycle)
                        for b in sorted(edges[a] & cycle)]
    assert not bad, "modules of one package in an import cycle:\n" + "\n".join(bad)


def test_vllm_outside_the_engine_is_its_public_user_api(graph):
    importers = [m for m in graph.find_modules_that_directly_import("vllm")
                 if m != "dynsteer.engine" and not m.startswith("dynsteer.engine.")]
    bad = [f"{m}:{d['line_number']}: {d['line_contents']}" for m in sorted(importers)
           for d in graph.get_import_details(importer=m, imported="vllm")
           if not PUBLIC_VLLM.fullmatch(d["line_contents"].strip())]
    assert not bad, "vLLM internals imported outside dynsteer.engine:\n" + "\n".join(bad)
