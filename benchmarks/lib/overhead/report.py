"""``overhead.py``'s report: the comparisons of its repeats (every mode against ``absent`` and its own reference, on
the whole call and on the decode step, and against the mean of several engines alike), the markdown tables printed
on stdout, and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from lib.overhead.modes import ABSENT_MODES, AA_TARGET_PCT, BY_KEY, EXTRA_PAIRS, IDLE_MODES
from lib.stats import mean_by_repeat, paired


def comparisons(seconds: dict, modes: list[str], batches: list[int]) -> dict:
    """Every mode against absent (with its target where that is its reference), each mode against its own
    reference, and the informative peer pairs."""
    pairs = []
    for k in modes:
        m = BY_KEY[k]
        if k != "absent":
            pairs.append((k, "absent", m.target if m.vs == "absent" else None))
        if m.vs not in (None, "absent"):
            pairs.append((k, m.vs, m.target))
    pairs += [(a, b, None) for a, b in EXTRA_PAIRS]
    out = {}
    for a, b, target in pairs:
        if a not in seconds or b not in seconds:
            continue
        per = {str(bs): paired(seconds[a].get(str(bs), []), seconds[b].get(str(bs), [])) for bs in batches}
        if any(per.values()):
            label = "A/A control: absent2 vs absent" if a == "aa" else f"{BY_KEY[a].label} vs {BY_KEY[b].label}"
            out[label] = {"a": a, "b": b, "target_pct": target, "per_batch": per}
    return out



def pooled(seconds: dict, modes: list[str], batches: list[int]) -> dict | None:
    """Against the mean of the absent engines, repeat by repeat: with three (``aa3`` run), every mode with a target
    against ``absent``; with two idle engines or more (``idle2``, ``idle3``), the idle engines' mean too. One engine
    process can sit a point off another for a whole run; a mean over several draws of that offset is steadier than
    any one. ``None`` when neither applies."""
    def mean(keys: list[str], b: str) -> list[float]:
        return mean_by_repeat([seconds[k].get(b, []) for k in keys])

    absents = [a for a in ABSENT_MODES if a in seconds]
    idles = [k for k in IDLE_MODES if k in seconds]
    if len(absents) < 3 and (len(idles) < 2 or len(absents) < 2):
        return None
    out = {}
    if len(absents) == 3:
        for k in modes:
            m = BY_KEY[k]
            if k in ABSENT_MODES or m.vs != "absent" or m.target is None:
                continue
            per = {b: paired(seconds[k].get(b, []), mean(absents, b)) for b in map(str, batches)}
            if any(per.values()):
                out[f"{m.label} vs the mean of the three absent engines"] = {"a": k, "b": "absent_pool",
                                                                            "target_pct": m.target, "per_batch": per}
    if len(idles) >= 2:
        per = {b: paired(mean(idles, b), mean(absents, b)) for b in map(str, batches)}
        if any(per.values()):
            out[f"idle, mean of {len(idles)} dynsteer engines vs the mean of {len(absents)} absent engines"] = {
                "a": "idle", "b": "absent_pool", "target_pct": BY_KEY["idle"].target, "per_batch": per}
    return out


def step_lists(splits: dict) -> dict:
    """The mean decode step (ms) of every repeat, per mode and batch, shaped like ``seconds``."""
    return {k: {b: [x["step_ms"] for x in xs] for b, xs in per.items()} for k, per in splits.items()}


def split_report(splits: dict, modes: list[str]) -> dict:
    """Per mode and batch: each phase's median over repeats, and its paired median difference from absent's (ms;
    the ramp and tail per call, the step per decode step). Repeats pair by index, as in :func:`comparisons`."""
    out: dict = {}
    for k in modes:
        for b, xs in splits.get(k, {}).items():
            ref = splits.get("absent", {}).get(b, [])
            entry = {}
            for phase in ("ramp_ms", "step_ms", "tail_ms"):
                vals = [x[phase] for x in xs]
                diffs = [x[phase] - r[phase] for x, r in zip(xs, ref)]
                entry[phase] = {"median": round(statistics.median(vals), 4),
                                "vs_absent": round(statistics.median(diffs), 4) if diffs and k != "absent" else None}
            out.setdefault(k, {})[b] = entry
    return out


def status(value: float, target: float | None, aa: float | None, is_aa: bool) -> str:
    if target is None:
        return ""
    if is_aa:
        return "✓" if abs(value) <= target else "✗"
    if value <= target:
        return "✓"
    return "≈" if aa is not None and value <= target + abs(aa) else "✗"


def print_comparisons(title: str, comps: dict, batches: list, verification: dict, first_row: str = "") -> None:
    """One markdown table of comparisons, each cell marked against its target with that table's own A/A."""
    aa = {b: c["median"] for b, c in comps.get("A/A control: absent2 vs absent", {}).get("per_batch", {}).items()
          if c}
    print()
    print(f"| {title} | " + " | ".join(f"batch {b}" for b in batches) + " | target | steering changed tokens |")
    print("|---" * (len(batches) + 3) + "|")
    if first_row:
        print(first_row)
    for label, comp in comps.items():
        a, target, is_aa = comp["a"], comp["target_pct"], comp["a"] in ABSENT_MODES
        cells = []
        for b in batches:
            c = comp["per_batch"].get(str(b))
            cells.append("—" if c is None else
                         f"{c['median']:+.2f} {status(c['median'], target, aa.get(str(b)), is_aa)}".strip())
        tgt = "" if target is None else (f"\\|x\\| ≤ {target:g}" if is_aa else
                                         "≤ 0 (never slower)" if target == 0 else f"≤ +{target:g}")
        ver = verification.get(a, {}).get("steering_changed_tokens")
        vcell = "—" if ver is None else ("yes" if ver else "**NO ⚠**")
        flag = " ⚠ steering not verified" if ver is False else ""
        print(f"| {label}{flag} | " + " | ".join(cells) + f" | {tgt} | {vcell} |")


def print_mode_table(title: str, per_mode: dict, batches: list, cell: Any) -> None:
    """A markdown table, a row per mode and a column per batch: ``cell(mode, batch, entry)`` for each entry present
    (``—`` where none); nothing when ``per_mode`` is empty."""
    if not per_mode:
        return
    print(f"\n| {title} | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---" * (len(batches) + 1) + "|")
    for k, per in per_mode.items():
        cells = [cell(k, str(b), per[str(b)]) if per.get(str(b)) else "—" for b in batches]
        print(f"| {BY_KEY[k].label} | " + " | ".join(cells) + " |")


def print_tables(report: dict) -> None:
    batches = report["args"]["batches"]
    aa = report.get("aa_pct") or {}
    verification = report.get("verification", {})
    tps = report["tokens_per_s"].get("absent", {})
    print_comparisons("comparison (overhead % of the whole call, median of paired ratios)", report["overhead_pct"],
                      batches, verification,
                      "| absent (tok/s) | " + " | ".join(f"{tps.get(str(b), 0):.0f}" for b in batches) + " | | |")
    if report.get("step_overhead_pct"):
        print_comparisons("comparison (overhead % of the mean decode step, median of paired ratios)",
                          report["step_overhead_pct"], batches, verification)
    if report.get("pooled_step_overhead_pct"):
        print_comparisons("comparison (overhead % of the mean decode step against the mean of the absent engines)",
                          report["pooled_step_overhead_pct"], batches, verification)
    skipped = report.get("skipped") or {}
    for name, why in skipped.items():
        print(f"| ({name}: not run: {why}) |" + " |" * (len(batches) + 2))
    # per-step host time
    host = report.get("host_counters") or {}

    def wall_cell(k: str, b: str, xs: list[float]) -> str:
        cell = f"{statistics.median(xs) / report['args']['tokens'] * 1e3:.3f}"
        c = host.get(k, {}).get(b)
        if c and c.get("steps") and c.get("dynamic_steps"):  # dynamic-tier host work, when any
            cell += (f" [{c['host_ms'] / c['steps']:.3f} / {c['controller_ms'] / c['steps']:.3f} / "
                     f"{c['wait_ms'] / c['steps']:.3f}]")
        if c and c.get("takes"):  # capture delivery per call: engine core (take, pack), writer's queue, caller
            n = c["takes"]
            cell += (f" {{take {c['take_ms'] / n:.2f} + pack {c.get('pack_ms', 0) / n:.2f} ms, writer queue "
                     f"{c['take_backlog'] / n:.1f}, caller {c.get('deliver_ms', 0) / n:.2f} ms}}")
        if c and c.get("stream_bytes"):  # what the stream modes' monitor received, over the timed calls
            lost = c.get("stream_rows_want", 0) - c.get("stream_rows", 0)
            cell += (f" <{c['stream_bytes'] / sum(xs) / 1e9:.3f} GB/s"
                     + (f", {100 * c['stream_rows'] / c['stream_rows_want']:.1f} % of rows" if lost else "") + ">")
        if c and c.get("rows_written"):  # rows rewritten in timed calls: the row pool is too small
            cell += f" ({c['rows_written'] / len(xs):.1f} rows)"
        return cell

    print_mode_table("mode: wall ms per step [dynsteer host ms per step: staging / read-back / waiting] {capture per "
                     "call: take_captures + packing ms in the engine core, spool writer queue then, the caller's whole "
                     "delivery ms} <stream modes: GB/s the monitor received, the share of rows where any were "
                     "dropped> (table rows written per timed call)", report["seconds"], batches, wall_cell)
    print_mode_table("mode: CPU busy over the call, frontend / engine core (median; max for the engine core)",
                     report.get("cpu_busy_repeats") or {}, batches,
                     lambda k, b, xs: f"{statistics.median(x['front'] for x in xs):.2f} / "
                                      f"{statistics.median(x['core'] for x in xs):.2f} "
                                      f"({max(x['core'] for x in xs):.2f})")
    print_mode_table("mode: ramp ms / decode step ms / tail ms (paired median difference from absent)",
                     report.get("timing_split") or {}, batches,
                     lambda k, b, e: " / ".join(
                         f"{e[p]['median']:.3f}" + ("" if e[p]["vs_absent"] is None else f" ({e[p]['vs_absent']:+.3f})")
                         for p in ("ramp_ms", "step_ms", "tail_ms")))
    print("\nA/A (absent2 vs absent, paired median): "
          + ", ".join(f"batch {b}: {aa[str(b)]:+.2f} %" for b in batches if str(b) in aa)
          + f" (aim ≤ {AA_TARGET_PCT} %); repeats: {report['repeats_done']}")


def plot(report: dict, path: Path) -> Path | None:
    """Overhead % vs batch size, one line per mode (vs absent), the A/A band shaded: whole calls, mean decode steps
    (when the report has the timing split), and the peers in a panel of their own."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot (re-plot elsewhere with --from-json)")
        return None
    batches = report["args"]["batches"]
    whole, step = report["overhead_pct"], report.get("step_overhead_pct")
    comps = {c["a"]: c for c in whole.values() if c["b"] == "absent" and c["a"] != "aa"}
    peers = {"eager", "hook"}
    panels = [("whole call: dynsteer and hotwire-vllm", whole, [k for k in comps if k not in peers])]
    if step:
        panels.append(("mean decode step: dynsteer and hotwire-vllm", step, [k for k in comps if k not in peers]))
    if any(k in comps for k in peers):
        panels.append(("eager forward-hook peer (and hotwire's workload)", whole,
                       [k for k in comps if k in peers or k in ("hwsteered", "hwload")]))
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels) + 3, 6), squeeze=False)
    colors = plt.get_cmap("tab20")
    for ax, (title, src, keys) in zip(axes[0], panels):
        aa = src.get("A/A control: absent2 vs absent")
        by_mode = {c["a"]: c for c in src.values() if c["b"] == "absent" and c["a"] != "aa"}
        if aa:
            xs = [b for b in batches if aa["per_batch"].get(str(b))]
            med = [abs(aa["per_batch"][str(b)]["median"]) for b in xs]
            ax.fill_between(xs, [-m for m in med], med, color="grey", alpha=0.35,
                            label="A/A: ± |paired median| (absent2 vs absent)")
            ax.fill_between(xs, [aa["per_batch"][str(b)]["q25"] for b in xs],
                            [aa["per_batch"][str(b)]["q75"] for b in xs], color="grey", alpha=0.15,
                            label="A/A: quartiles of paired ratios")
        for i, k in enumerate(keys):
            if k not in by_mode:
                continue
            per = by_mode[k]["per_batch"]
            xs = [b for b in batches if per.get(str(b))]
            ver = report.get("verification", {}).get(k, {}).get("steering_changed_tokens")
            ax.plot(xs, [per[str(b)]["median"] for b in xs], marker="o", color=colors(i % 20),
                    linestyle="--" if ver is False else "-",
                    label=BY_KEY[k].label + (" (steering NOT verified)" if ver is False else ""))
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("decode batch size")
        ax.set_ylabel("overhead vs absent (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{report['device']}, {report['model']}, {report['args']['tokens']} tokens, "
                 f"{report['repeats_done']} repeats ({report['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
