"""The report's tables: one row per variant (selectivity and doses first), the metrics per variant and class, the
relative doses and example outputs.

Values are ``summary.csv``'s, shown to :data:`DIGITS` significant digits (:func:`short`); each cell keeps its CSV
column name in ``data-col`` and the full value in ``title``. Variants are named by their grid values
(``scale=4, layer=12``), their ids (``v001``) kept for the CSV and ``samples.jsonl``.
"""

from __future__ import annotations

import html
from dynsteer.sweep.config import BASELINE, SweepConfig
from dynsteer.sweep.summary import QUALITY_COLUMNS, SUMMARY_METRICS, format_value
from dynsteer.sweep.types import SweepResult

__all__ = ["BY_CLASS_METRICS", "CONTROL_METRICS", "DIGITS", "VARIANT_TABLE", "by_class_table", "controls_table",
           "doses_table", "examples_table", "short", "variants_table"]

DIGITS = 4
"""Significant digits of the report's numbers (the CSV keeps 6)."""

VARIANT_TABLE = ("selectivity", "target_steered_rate", "other_steered_rate", "side_effect_identical_rate", "combined",
                 "concept_gain", "perplexity_ratio", "repeat_4gram", "relevance_ratio", "max_relative_dose",
                 "max_peak_dose", "clipped_actions")
"""Per-variant columns, in the order the variants table shows them (after the variant's name)."""

PER_CLASS_IN_VARIANTS = ("changed_rate", "concept_probe", "fire_rate")
"""Metrics the variants table shows per class, as compact sub-columns (those with any value; ``concept_words``
stands in for ``concept_probe`` without a probe)."""

BY_CLASS_METRICS = ("n", *SUMMARY_METRICS, *QUALITY_COLUMNS)
"""Columns of the per-class table (after variant and class)."""

_HEAD = {"selectivity": "selectivity", "target_steered_rate": "target steered", "other_steered_rate": "others steered",
         "side_effect_identical_rate": "left alone identical", "max_relative_dose": "max dose",
         "max_peak_dose": "peak dose", "clipped_actions": "clipped", "changed_rate": "changed",
         "identical_rate": "identical", "concept_probe": "concept (probe)", "concept_words": "concept (words)",
         "repeat_4gram": "repeat 4-gram", "distinct_1": "distinct-1", "distinct_2": "distinct-2",
         "fire_rate": "fired", "gate_rate": "gate ≥ 0.5", "steered_tokens": "steered tokens",
         "applied_dose": "applied dose", "vector_norm": "‖v‖", "mean_norm": "mean ‖h‖", "peak_dose": "peak dose",
         "clipped_from": "clipped from", "concept_gain": "concept gain", "perplexity_ratio": "perplexity ratio",
         "relevance_ratio": "relevance ratio", "combined": "combined"}


def short(value: str) -> str:
    """A CSV value shown to :data:`DIGITS` significant digits (integers and text unchanged)."""
    try:
        x = float(value)
    except ValueError:
        return value
    if value.lstrip("-").isdigit():
        return value
    return "nan" if x != x else f"{x:.{DIGITS}g}"


def _th(col: str, **attrs: str) -> str:
    extra = "".join(f' {k}="{html.escape(v)}"' for k, v in attrs.items())
    return f'<th data-col="{html.escape(col)}" title="{html.escape(col)}"{extra}>{html.escape(_HEAD.get(col, col))}</th>'


def _td(col: str, value: str, cls: str = "") -> str:
    shown = short(value)
    title = f' title="{html.escape(value)}"' if shown != value else ""
    klass = f' class="{cls}"' if cls else ""
    return f'<td data-col="{html.escape(col)}"{title}{klass}>{html.escape(shown)}</td>'


def _rows(result: SweepResult) -> dict[tuple[str, str], dict[str, str]]:
    return {(r["variant"], r["class"]): r for r in result.summary}


def _name_cell(label: str, vid: str, rowspan: int = 1) -> str:
    span = f' rowspan="{rowspan}"' if rowspan > 1 else ""
    return f'<td class="name" data-col="label" title="{html.escape(vid)}"{span}>{html.escape(label)}</td>'


def variants_table(cfg: SweepConfig, result: SweepResult) -> str:
    """One row per variant: its name, the per-variant figures, then a few metrics per class (sub-columns)."""
    rows = _rows(result)
    classes = cfg.classes()
    def has(m: str) -> bool:
        return any(r.get(m, "") != "" for r in result.summary if r["class"] != "all")

    per_class = [m if m != "concept_probe" or has(m) else "concept_words" for m in PER_CLASS_IN_VARIANTS]
    per_class = [m for m in per_class if has(m)]
    head1 = '<th rowspan="2" data-col="label" class="name">variant</th>' + "".join(_th(c, rowspan="2") for c in VARIANT_TABLE)
    head1 += "".join(f'<th colspan="{len(classes)}" class="group">{html.escape(_HEAD.get(m, m))}</th>'
                     for m in per_class)
    head2 = "".join(f'<th data-col="{html.escape(m)}:{html.escape(c)}" class="sub">{html.escape(c)}</th>'
                    for m in per_class for c in classes)
    body = []
    for v in result.variants:
        first = rows.get((v.id, "all"), {})
        cells = [_name_cell(v.label, v.id)]
        cells += [_td(c, first.get(c, ""), "key" if c == "selectivity" else "") for c in VARIANT_TABLE]
        cells += [_td(f"{m}:{c}", rows.get((v.id, c), {}).get(m, "")) for m in per_class for c in classes]
        err = f' class="rejected" title="{html.escape(v.error)}"' if v.error else ""
        body.append(f"<tr data-variant=\"{html.escape(v.id)}\"{err}>{''.join(cells)}</tr>\n")
    return (f'<table id="variants"><thead><tr>{head1}</tr><tr>{head2}</tr></thead><tbody>\n{"".join(body)}'
            f"</tbody></table>")


CONTROL_METRICS = ("concept_gain", "perplexity_ratio", "repeat_4gram", "relevance_ratio", "combined")
"""What the controls table shows for each steered variant and its random-direction control (class ``all``)."""


def controls_table(result: SweepResult) -> str:
    """One row per variant that has a random-direction control: each of :data:`CONTROL_METRICS` steered, then
    random (cells' ``data-col``: ``metric:steered`` / ``metric:random``)."""
    rows = _rows(result)
    head1 = '<th rowspan="2" data-col="label" class="name">variant</th>' + "".join(
        f'<th colspan="2" class="group">{html.escape(_HEAD.get(m, m))}</th>' for m in CONTROL_METRICS)
    head2 = "".join(f'<th data-col="{m}:{k}" class="sub">{k}</th>' for m in CONTROL_METRICS
                    for k in ("steered", "random"))
    body = []
    for c in result.variants:
        if c.control_of is None:
            continue
        steered, random = rows.get((c.control_of, "all"), {}), rows.get((c.id, "all"), {})
        label = next((v.label for v in result.variants if v.id == c.control_of), c.control_of)
        cells = [_name_cell(label, c.control_of)] + [_td(f"{m}:{k}", r.get(m, "")) for m in CONTROL_METRICS
                                                     for k, r in (("steered", steered), ("random", random))]
        body.append(f'<tr data-variant="{html.escape(c.control_of)}">{"".join(cells)}</tr>\n')
    return (f'<table id="controls"><thead><tr>{head1}</tr><tr>{head2}</tr></thead><tbody>\n{"".join(body)}'
            f"</tbody></table>")


def by_class_table(cfg: SweepConfig, result: SweepResult) -> str:
    """Every metric per variant and class (then ``all``), the variant named once per group."""
    rows = _rows(result)
    metrics = [m for m in BY_CLASS_METRICS if m == "n" or any(r.get(m, "") != "" for r in result.summary)]
    head = '<th data-col="label" class="name">variant</th><th data-col="class">class</th>' + "".join(_th(m) for m in metrics)
    classes = [*cfg.classes(), "all"]
    body = []
    for v in result.variants:
        for k, c in enumerate(classes):
            r = rows.get((v.id, c), {})
            name = _name_cell(v.label, v.id, len(classes)) if k == 0 else ""
            cells = "".join(_td(m, r.get(m, "")) for m in metrics)
            group = ' class="group"' if k == 0 else ""
            body.append(f'<tr data-variant="{html.escape(v.id)}"{group}>{name}'
                        f'<td data-col="class" class="text">{html.escape(c)}</td>{cells}</tr>\n')
    return f'<table id="by-class"><thead><tr>{head}</tr></thead><tbody>\n{"".join(body)}</tbody></table>'


def doses_table(result: SweepResult) -> str:
    cols = ("where", "layer", "site", "scale", "vector_norm", "mean_norm", "dose", "peak_dose", "clipped_from")
    body = []
    for v in result.variants:
        for d in v.doses:
            vals = {k: format_value(val) for k, val in d.model_dump().items()}
            body.append(f'<tr data-variant="{html.escape(v.id)}">{_name_cell(v.label, v.id)}'
                        + "".join(_td(c, vals.get(c, ""), "text" if c == "where" else "") for c in cols) + "</tr>\n")
    if not body:
        return "<p>No additive actions.</p>"
    head = '<th data-col="label" class="name">variant</th>' + "".join(_th(c) for c in cols)
    return f'<table id="doses"><thead><tr>{head}</tr></thead><tbody>\n{"".join(body)}</tbody></table>'


def examples_table(cfg: SweepConfig, result: SweepResult, max_columns: int) -> str:
    """Sample 0 of the first two prompts of each class: the baseline and up to ``max_columns`` variants."""
    variants = [v for v in result.variants if v.error is None and v.control_of is None][:max_columns + 1]
    recs = {(r["variant"], r["prompt_index"]): r for r in result.records if r["sample"] == 0}
    shown: list[int] = []
    for cls in cfg.classes():
        shown += [i for i, p in enumerate(cfg.prompts) if p.cls == cls][:2]
    head = "<th>prompt</th><th>class</th>" + "".join(
        f'<th title="{html.escape(v.id)}">{html.escape(v.label)}</th>' for v in variants)
    rows = []
    for i in shown:
        cells = []
        for v in variants:
            r = recs.get((v.id, i))
            text = "" if r is None else r["text"]
            mark = "" if r is None or v.id == BASELINE or r["changed"] else " (identical)"
            cells.append(f'<td class="text">{html.escape(text)}{mark}</td>')
        rows.append(f'<tr><td class="text">{html.escape(cfg.prompts[i].text())}</td>'
                    f'<td class="text">{html.escape(cfg.prompts[i].cls)}</td>{"".join(cells)}</tr>')
    return f'<table id="examples"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'

