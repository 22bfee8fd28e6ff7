"""mkdocs hook: reference sections generated from the code when the site is built, so they cannot go stale.

A page marks a section with an HTML comment, replaced in the rendered page (the Markdown source keeps the comment):

* ``<!-- generated: json-schema dotted.path.Model -->``: the pydantic model's JSON schema (``model_json_schema()``);
* ``<!-- generated: http-routes -->``: the steering routes as :class:`dynsteer.engine.server.SteeringEndpoints`
  registers them (method, path, body model, the handler's docstring).
"""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

MARK = re.compile(r"<!-- generated: ([a-z-]+)(?: ([\w.]+))? -->")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARK.sub(lambda m: render(m.group(1), m.group(2)), markdown)


def render(kind: str, arg: str | None) -> str:
    if kind == "json-schema":
        module, _, name = (arg or "").rpartition(".")
        model = getattr(importlib.import_module(module), name)
        return "```json\n" + json.dumps(model.model_json_schema(), indent=2) + "\n```"
    if kind == "http-routes":
        return routes_table()
    raise ValueError(f"unknown generated section {kind!r}")


def routes() -> list[tuple[str, str, str, str]]:
    """(method, path, body model name or '', first docstring line) of every steering route, in registration order."""
    from dynsteer.engine.server import SteeringEndpoints

    out = []
    for route in SteeringEndpoints().router().routes:
        body = route.body_field.field_info.annotation.__name__ if route.body_field is not None else ""
        doc = (route.endpoint.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        out.extend((method, route.path, body, doc) for method in sorted(route.methods))
    return out


def routes_table() -> str:
    rows = ["| method | path | body | what it does |", "|---|---|---|---|"]
    rows += [f"| `{m}` | `{p}` | {f'[`{b}`](#{b.lower()})' if b else '—'} | {d} |" for m, p, b, d in routes()]
    return "\n".join(rows)
