"""Per-variant summaries: one row per variant and class (then ``all``), formatted as ``summary.csv`` writes them
(the report shows the same strings): the samples' means, selectivity, doses and steering quality against the
baseline. Metric definitions: :mod:`dynsteer.sweep.metrics`."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from typing import Any

from dynsteer.sweep import metrics as M
from dynsteer.sweep.config import BASELINE, SweepConfig
from dynsteer.sweep.quality import combined_score
from dynsteer.sweep.types import Variant

__all__ = ["QUALITY_COLUMNS", "SUMMARY_METRICS", "VARIANT_COLUMNS", "format_value", "summarize",
           "summary_columns", "summary_csv_text"]


def format_value(v: Any) -> str:
    """How a summary value is written (CSV and report alike): ``""`` for none, 6 significant digits for floats."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.6g}"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, sort_keys=True)
    return str(v)


SUMMARY_METRICS = ("concept_probe", "concept_words", "perplexity", "repeat_4gram", "relevance", "distinct_1",
                   "distinct_2", "changed_rate", "identical_rate", "fire_rate", "gate_rate", "steered_tokens",
                   "applied_dose")
QUALITY_COLUMNS = ("concept_gain", "perplexity_ratio", "relevance_ratio", "combined")
"""Steering quality against the baseline's row of the same class (:mod:`dynsteer.sweep.metrics`)."""
VARIANT_COLUMNS = ("side_effect_identical_rate", "target_steered_rate", "other_steered_rate", "selectivity",
                   "max_relative_dose", "max_peak_dose", "clipped_actions", "control_of", "error")


def summary_columns(cfg: SweepConfig) -> list[str]:
    """The columns of ``summary.csv``, in order."""
    return ["variant", "label", *[a.path for a in cfg.grid], "class", "n", *SUMMARY_METRICS, *QUALITY_COLUMNS,
            *VARIANT_COLUMNS]


def _relevance(rec: dict[str, Any], prompts: list[str]) -> float | None:
    """A sample's ``relevance``, computed for records written before the field existed."""
    if "relevance" in rec or "text" not in rec:
        return rec.get("relevance")
    return M.prompt_overlap(prompts[rec["prompt_index"]], rec["text"])


def _ratio(x: float | None, base: float | None) -> float | None:
    return x / base if x is not None and base is not None and base > 0 else None


def _add_quality(row: dict[str, Any], base: dict[str, Any], concept: str) -> None:
    """``row``'s :data:`QUALITY_COLUMNS` against the baseline's ``base`` row of the same class (raw values), the
    concept score being the ``concept`` column."""
    c, c0 = row.get(concept), base.get(concept)
    row["concept_gain"] = c - c0 if c is not None and c0 is not None else None
    row["perplexity_ratio"] = _ratio(row.get("perplexity"), base.get("perplexity"))
    row["relevance_ratio"] = _ratio(row.get("relevance"), base.get("relevance"))
    ok = row["concept_gain"] is not None and row["perplexity_ratio"] is not None and row["repeat_4gram"] is not None
    row["combined"] = (combined_score(row["concept_gain"], row["perplexity_ratio"], row["repeat_4gram"],
                                      row["relevance_ratio"]) if ok else None)


def summarize(cfg: SweepConfig, variants: list[Variant], records: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per variant and class (then ``all``), formatted with :func:`format_value` (the metrics module's
    definitions: :mod:`dynsteer.sweep.metrics`)."""
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_variant.setdefault(r["variant"], []).append(r)
    alone = set(cfg.alone_classes())
    prompts = [p.text() for p in cfg.prompts]
    rows = []
    for v in variants:
        recs = by_variant.get(v.id, [])

        def rate(sel: Callable[[dict[str, Any]], bool], key: str, recs=recs) -> float | None:
            return M.mean_or_none(r[key] for r in recs if sel(r))

        per_variant = {
            "side_effect_identical_rate": rate(lambda r: r["label"] in alone, "identical") if alone else None,
            "target_steered_rate": (rate(lambda r: r["label"] == cfg.target_class, "changed")
                                    if cfg.target_class is not None else None),
            "other_steered_rate": (rate(lambda r: r["label"] != cfg.target_class, "changed")
                                   if cfg.target_class is not None else None),
            "max_relative_dose": v.max_dose, "max_peak_dose": v.max_peak_dose,
            "clipped_actions": v.clipped if v.doses else None, "control_of": v.control_of, "error": v.error}
        t, o = per_variant["target_steered_rate"], per_variant["other_steered_rate"]
        per_variant["selectivity"] = t - o if t is not None and o is not None else None
        for cls in [*cfg.classes(), "all"]:
            sel = [r for r in recs if cls == "all" or r["label"] == cls]
            row: dict[str, Any] = {"variant": v.id, "label": v.label,
                                   **{a.path: v.point.get(a.path) for a in cfg.grid}, "class": cls, "n": len(sel)}
            for m in ("concept_probe", "concept_words", "perplexity", "repeat_4gram", "distinct_1", "distinct_2",
                      "steered_tokens", "gate_rate", "applied_dose"):
                row[m] = M.mean_or_none(r.get(m) for r in sel)
            row["relevance"] = M.mean_or_none(_relevance(r, prompts) for r in sel)
            row["changed_rate"] = M.mean_or_none(r["changed"] for r in sel)
            row["identical_rate"] = M.mean_or_none(r["identical"] for r in sel)
            row["fire_rate"] = M.mean_or_none(r["fired"] for r in sel)
            row.update(per_variant)
            rows.append(row)
    base = {r["class"]: r for r in rows if r["variant"] == BASELINE}
    concept = "concept_probe" if cfg.probe_file is not None else "concept_words"
    for row in rows:
        _add_quality(row, base.get(row["class"], {}), concept)
    return [{c: format_value(row.get(c)) for c in summary_columns(cfg)} for row in rows]


def summary_csv_text(cfg: SweepConfig, rows: list[dict[str, str]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=summary_columns(cfg), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
