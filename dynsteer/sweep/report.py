"""A sweep's self-contained HTML report: a table with one row per variant (selectivity first), plots (matplotlib Agg,
embedded as base64 PNG, legends beside the axes), the metrics per class, relative doses, and example outputs side by
side (tables: :mod:`dynsteer.sweep.report_tables`). It is laid out to read at 1,280 px: the variants table's
per-variant figures come first, wide tables scroll inside their box.

Plots:
    * metric vs parameter per class: each metric of :data:`PLOT_METRICS` against the first grid axis, one line per
      class and value of the other axes, the unsteered baseline dashed;
    * gate firing rate per variant and class (policies);
    * probe-score traces: the concept probe's probability per generated token (or, without a probe, the first gate)
      for the first prompt of each class, baseline and every variant;
    * concept vs fluency: each variant's concept gain against its perplexity ratio (class ``all``), its
      random-direction control beside it in another marker, and the Pareto front of all of them.

Random-direction controls (:mod:`dynsteer.sweep.control`) have rows in the tables and a table of their own, steered
and random side by side; the per-metric, gate and trace plots show the grid's variants only.

Nothing in the file depends on time, so a sweep run twice renders byte-identical reports.
"""

from __future__ import annotations

import base64
import html
import io
import json
from typing import Any

from dynsteer.sweep.config import BASELINE, SweepConfig
from dynsteer.sweep.grid import point_label
from dynsteer.sweep.quality import pareto_front
from dynsteer.sweep.report_tables import by_class_table, controls_table, doses_table, examples_table, variants_table
from dynsteer.sweep.types import SweepResult

__all__ = ["PLOT_METRICS", "render_report", "write_report"]

PLOT_METRICS = ("concept_probe", "concept_words", "perplexity", "repeat_4gram", "distinct_2", "changed_rate",
                "applied_dose", "combined")
MAX_EXAMPLE_COLUMNS = 8

_CSS = """
body{font-family:DejaVu Sans,Arial,sans-serif;margin:16px;color:#1b1f24;background:#fff}
h1{font-size:20px}h2{font-size:17px;margin-top:24px;border-bottom:1px solid #ccd;padding-bottom:4px}
.scroll{max-width:100%;overflow-x:auto}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ccd;padding:2px 5px;text-align:right;vertical-align:top;font-variant-numeric:tabular-nums}
th{background:#eef1f6;font-weight:600;max-width:90px;white-space:normal}th.sub{font-weight:normal}
td.name,th.name{text-align:left;white-space:nowrap}td.key{font-weight:bold;background:#f4f8ee}
tr.group td{border-top:2px solid #99a}tr.rejected td{color:#a33}
td.text{text-align:left;max-width:320px;white-space:pre-wrap}
figure{display:inline-block;margin:6px;vertical-align:top}figure img{border:1px solid #dde;max-width:100%}
figcaption{font-size:12px;color:#445;max-width:620px}code{background:#f3f4f6;padding:1px 3px}
dl{font-size:13px}dt{font-weight:bold}dd{margin:0 0 6px 16px}
"""

_DEFINITIONS = [
    ("concept_probe", "mean over generated tokens of the concept probe's probability, on residuals captured in the "
                      "same run"),
    ("concept_words", "fraction of the output's words in the word list"),
    ("perplexity", "exp(−mean log p) of the output under the unsteered model, given the prompt (fluency)"),
    ("repeat_4gram", "fraction of token 4-grams repeating an earlier one (degeneration)"),
    ("distinct_1 / distinct_2", "distinct token n-grams / all n-grams of an output"),
    ("changed_rate / identical_rate", "fraction of samples whose tokens differ from / equal the unsteered run's"),
    ("fire_rate / gate_rate / steered_tokens", "samples the policy acted on; tokens whose gate reached 0.5; tokens "
                                               "steered per sample"),
    ("side_effect_identical_rate", "on the classes to leave alone: fraction byte-identical to unsteered"),
    ("selectivity", "target_steered_rate − other_steered_rate (changed outputs on the target class vs the others)"),
    ("max_relative_dose", "largest |scale|·‖v‖ / mean‖h‖ over the variant's additive actions (peak: × controller "
                          "bound)"),
    ("applied_dose", "mean over generated tokens of the relative dose actually applied (gate × dyn_scale × dose)"),
    ("relevance", "share of the prompt's content words (first five letters, stop words left out) the output uses: a "
                  "lexical prompt-relevance proxy"),
    ("concept_gain", "concept score (probe, else words) minus the unsteered variant's, same class"),
    ("perplexity_ratio / relevance_ratio", "perplexity / relevance over the unsteered variant's, same class"),
    ("combined", "concept_gain × min(1, 1/perplexity_ratio) × (1 − repeat_4gram) × min(1, relevance_ratio)"),
    ("random: …", "the variant above with every added vector replaced by a seeded random direction of the same norm "
                  "(same layer, site, scale, gates: the same dose)"),
]


def controls_html(cfg: SweepConfig, result: SweepResult) -> str:
    """The random-direction controls' section (empty without controls)."""
    if not any(v.control_of for v in result.variants):
        return ""
    return ("<h2>Random-direction controls</h2>\n<p>Each steered variant beside its control: the same dose in a "
            "seeded random direction (class <code>all</code>). A direction that carries the concept gains more than "
            "its control at a similar fluency cost.</p>\n"
            f'<div class="scroll">{controls_table(result)}</div>')


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    # bbox "tight" grows the image to hold a legend placed outside the axes
    fig.savefig(buf, format="png", dpi=80, metadata={"Software": None}, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def _axis_value(v: Any) -> Any:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else json.dumps(v)


def _metric_plots(cfg: SweepConfig, result: SweepResult) -> list[tuple[str, str, str]]:
    import matplotlib.pyplot as plt

    if not cfg.grid:
        return []
    first = cfg.grid[0]
    others = list(cfg.grid[1:])
    xs = [_axis_value(v) for v in first.values]
    numeric = all(isinstance(x, (int, float)) for x in xs)
    rows = result.summary
    plots = []
    for metric in PLOT_METRICS:
        if not any(_num(r[metric]) is not None for r in rows if r["variant"] != BASELINE):
            continue
        fig, ax = plt.subplots(figsize=(5.6, 3.6))
        for ci, cls in enumerate(cfg.classes()):
            color = f"C{ci}"
            base = [_num(r[metric]) for r in rows if r["variant"] == BASELINE and r["class"] == cls]
            if base and base[0] is not None:
                ax.axhline(base[0], color=color, linestyle="--", linewidth=1, label=f"{cls}: unsteered")
            combos: dict[str, list[tuple[Any, float]]] = {}
            for v in result.variants[1:]:
                if v.error is not None or v.control_of is not None:
                    continue
                row = next(r for r in rows if r["variant"] == v.id and r["class"] == cls)
                y = _num(row[metric])
                if y is None:
                    continue
                rest = point_label({a.path: v.point[a.path] for a in others}, others) if others else ""
                x = _axis_value(v.point[first.path])
                combos.setdefault(rest, []).append((x if numeric else xs.index(x), y))
            for k, (rest, pts) in enumerate(combos.items()):
                pts.sort(key=lambda p: p[0])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color,
                        linestyle=["-", ":", "-.", (0, (5, 1))][k % 4],
                        label=f"{cls}" + (f", {rest}" if rest else ""))
        if not numeric:
            ax.set_xticks(range(len(xs)), [first.name(v) for v in first.values])
        ax.set_xlabel(first.path)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} vs {first.path.split('.')[-1]}")
        ax.grid(alpha=0.3)
        _legend_outside(ax)
        plots.append((f"metric-{metric}", f"{metric} against {first.path} per class (dashed: unsteered)", _png(fig)))
    return plots


def _gate_plot(cfg: SweepConfig, result: SweepResult) -> list[tuple[str, str, str]]:
    import matplotlib.pyplot as plt
    import numpy as np

    if cfg.kind != "policy":
        return []
    variants = [v for v in result.variants if v.error is None and v.control_of is None]
    classes = cfg.classes()
    fig, ax = plt.subplots(figsize=(max(5.6, 0.9 * len(variants) + 2), 3.6))
    width = 0.8 / max(len(classes), 1)
    for ci, cls in enumerate(classes):
        ys = []
        for v in variants:
            row = next(r for r in result.summary if r["variant"] == v.id and r["class"] == cls)
            ys.append(_num(row["fire_rate"]) or 0.0)
        ax.bar(np.arange(len(variants)) + ci * width, ys, width, label=cls, color=f"C{ci}")
    ax.set_xticks(np.arange(len(variants)) + width * (len(classes) - 1) / 2,
                  [v.label for v in variants], fontsize=8, rotation=30, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fire_rate (samples steered)")
    ax.set_title("gate firing rate per variant and class")
    _legend_outside(ax)
    return [("gate-fire-rate", "share of samples in which the policy acted, per variant and class", _png(fig))]


def _trace_plot(cfg: SweepConfig, result: SweepResult) -> list[tuple[str, str, str]]:
    import matplotlib.pyplot as plt

    key = "probe_trace" if cfg.probe_file is not None else "gate_trace"
    classes = cfg.classes()
    firsts = [next(i for i, p in enumerate(cfg.prompts) if p.cls == c) for c in classes]
    recs = {(r["variant"], r["prompt_index"]): r for r in result.records if r["sample"] == 0}
    if not any(recs.get((v.id, p), {}).get(key) for v in result.variants for p in firsts):
        return []
    fig, axes = plt.subplots(1, len(classes), figsize=(4.2 * len(classes), 3.2), squeeze=False, sharey=True)
    for ax, cls, p in zip(axes[0], classes, firsts):
        for k, v in enumerate(v for v in result.variants if v.control_of is None):
            tr = recs.get((v.id, p), {}).get(key)
            if tr:
                ax.plot(range(len(tr)), tr, color="k" if v.id == BASELINE else f"C{k % 10}",
                        linestyle="--" if v.id == BASELINE else "-", linewidth=1.2,
                        label=v.label if len(v.label) <= 40 else v.label[:39] + "…")
        ax.set_title(f"{cls}: prompt {p}", fontsize=10)
        ax.set_xlabel("generated token")
        ax.set_ylabel("concept probability" if key == "probe_trace" else "gate")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    _legend_outside(axes[0][-1])
    what = "the concept probe's probability" if key == "probe_trace" else "the first gate"
    return [("probe-traces", f"{what} per generated token, first prompt of each class, sample 0", _png(fig))]


def _pareto_plot(cfg: SweepConfig, result: SweepResult) -> list[tuple[str, str, str]]:
    """Concept gain against perplexity ratio (class ``all``): steered variants, their controls, the unsteered point
    and the Pareto front (lower perplexity ratio and higher gain are better)."""
    import matplotlib.pyplot as plt

    rows = {r["variant"]: r for r in result.summary if r["class"] == "all"}
    pts = []
    for v in result.variants:
        r = rows.get(v.id, {})
        x, y = _num(r.get("perplexity_ratio", "")), _num(r.get("concept_gain", ""))
        if v.error is None and x is not None and y is not None:
            pts.append((v, x, y))
    if not any(v.id != BASELINE for v, _, _ in pts):
        return []
    at = {v.id: (x, y) for v, x, y in pts}
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for v, x, y in pts:  # each control joined to its variant: what the direction adds at the same dose
        if v.control_of in at:
            sx, sy = at[v.control_of]
            ax.plot([sx, x], [sy, y], color="0.75", linewidth=0.8, zorder=1)
    kinds = [("steered", "o", "C0", lambda v: v.id != BASELINE and v.control_of is None),
             ("random direction (same dose)", "X", "C3", lambda v: v.control_of is not None),
             ("unsteered", "*", "k", lambda v: v.id == BASELINE)]
    for name, marker, color, sel in kinds:
        chosen = [(x, y) for v, x, y in pts if sel(v)]
        if chosen:
            ax.scatter([p[0] for p in chosen], [p[1] for p in chosen], marker=marker, color=color, s=46, zorder=3,
                       label=name)
    if sum(v.id != BASELINE and v.control_of is None for v, _, _ in pts) <= 12:
        names: dict[tuple[float, float], list[str]] = {}  # variants on the same spot share one label
        for v, x, y in pts:
            if v.id != BASELINE and v.control_of is None:
                names.setdefault((x, y), []).append(v.label if len(v.label) <= 24 else v.label[:23] + "…")
        for (x, y), labels in names.items():
            ax.annotate("; ".join(labels), (x, y), fontsize=6, xytext=(4, 3), textcoords="offset points")
    front = pareto_front([x for _, x, _ in pts], [y for _, _, y in pts])
    ax.plot([pts[i][1] for i in front], [pts[i][2] for i in front], color="C2", linewidth=1.2, zorder=2,
            drawstyle="steps-post", label="Pareto front")
    ax.set_xlabel("perplexity ratio (steered / unsteered; lower is more fluent)")
    ax.set_ylabel("concept gain over unsteered")
    ax.set_title("concept vs fluency")
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    return [("pareto", "concept gain against perplexity ratio per variant (all classes): steered variants, their "
                       "random-direction controls at the same dose (joined by a grey line) and the Pareto front",
             _png(fig))]


def _legend_outside(ax: Any) -> None:
    """The legend right of the axes, never over the data (``_png`` saves with a tight box that includes it)."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def render_report(result: SweepResult, cfg: SweepConfig) -> str:
    """The report as one HTML string (images inline; no external resources)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    plots = (_pareto_plot(cfg, result) + _metric_plots(cfg, result) + _gate_plot(cfg, result)
             + _trace_plot(cfg, result))
    figures = "\n".join(f'<figure><img alt="{html.escape(name)}" data-plot="{html.escape(name)}" '
                        f'src="data:image/png;base64,{data}"><figcaption>{html.escape(cap)}</figcaption></figure>'
                        for name, cap, data in plots)
    grid = "".join(f"<li><code>{html.escape(a.path)}</code> = {html.escape(', '.join(map(str, a.values)))}</li>"
                   for a in cfg.grid) or "<li>(none)</li>"
    errors = [v for v in result.variants if v.error]
    err_html = ("<h2>Rejected variants</h2><ul>" + "".join(
        f"<li>{html.escape(v.id)} ({html.escape(v.label)}): {html.escape(v.error or '')}</li>" for v in errors)
        + "</ul>") if errors else ""
    defs = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(d)}</dd>" for k, d in _DEFINITIONS)
    classes = ", ".join(f"{c} ({sum(p.cls == c for p in cfg.prompts)})" for c in cfg.classes())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dynsteer sweep report</title><style>{_CSS}</style></head>
<body>
<h1>dynsteer sweep: {html.escape(cfg.kind)}, {len(result.variants) - 1} variants × {len(cfg.prompts)} prompts ×
{cfg.samples} samples</h1>
<p>Prompts by class: {html.escape(classes)}. Target class: {html.escape(str(cfg.target_class))}; left alone:
{html.escape(', '.join(cfg.alone_classes()) or '(none)')}. Sampling: max_tokens {cfg.max_tokens}, temperature
{cfg.temperature:g}, seeds {cfg.seed}…{cfg.seed + cfg.samples - 1}.
Fingerprint <code>{cfg.fingerprint()[:16]}</code>.</p>
<h2>Grid</h2><ul>{grid}</ul>
<h2>Variants</h2>
<p>One row per variant: selectivity and side effects (all classes), relative doses, then a few metrics per class.
Values of <code>summary.csv</code> to 4 significant digits (hover for the full value and the variant's id).</p>
<div class="scroll">{variants_table(cfg, result)}</div>
{err_html}
<h2>Plots</h2>
{figures}
{controls_html(cfg, result)}
<h2>Metrics per class</h2>
<div class="scroll">{by_class_table(cfg, result)}</div>
<h2>Relative doses</h2>
<div class="scroll">{doses_table(result)}</div>
<h2>Examples (sample 0)</h2>
<div class="scroll">{examples_table(cfg, result, MAX_EXAMPLE_COLUMNS)}</div>
<h2>Metric definitions</h2><dl>{defs}</dl>
</body></html>
"""


def write_report(result: SweepResult, cfg: SweepConfig) -> None:
    """Write ``report.html`` into the sweep's directory."""
    text = render_report(result, cfg)
    path = result.report_html
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
