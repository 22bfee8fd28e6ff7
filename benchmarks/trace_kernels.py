"""Per-kernel device time of two or more torch-profiler traces side by side, each kernel keyed by the kernel that ran
just before it: where one engine's forward spends time another's does not.

An idle dynsteer engine replaces vLLM's add-norms with its own kernel. Whether that costs shows in the norms
themselves, and in the kernels that read their output (a GEMM's time can depend on what ran before it). Keying each
kernel by its predecessor (name shortened to ``--width`` characters, a digit suffix such as inductor's ``_0`` / ``_1``
dropped) tells the two apart: a GEMM that is slower only after dynsteer's norm is the norm's cost, one slower
everywhere is the lease. ``--alias REGEX=NAME`` names kernels that play one part in every engine alike (default:
every add-norm, vLLM's from inductor or dynsteer's, is ``<add-norm>``; every SiLU-and-mul ``<silu-mul>``), so the
kernels after them line up across traces.

    python3 benchmarks/trace_kernels.py absent--absent-b64.pt.trace.json.gz dynsteer--idle-b64.pt.trace.json.gz
    python3 benchmarks/trace_kernels.py A B C --top 20 --out diff.json   # every trace against the first

Reads the chrome traces ``overhead.py --profile`` writes. The median is over every call of the key in the trace
(prefill and decode alike: compare traces of the same workload), so keys seen fewer than ``--min-calls`` times are
left out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from lib.traces import DEVICE_CATS, load_events

DEFAULT_ALIASES = ("rms_norm=<add-norm>", "mul_silu=<silu-mul>")


def parse_aliases(specs: list[str]) -> list[tuple[re.Pattern, str]]:
    out = []
    for spec in specs:
        pattern, sep, name = spec.partition("=")
        if not sep or not pattern or not name:
            raise ValueError(f"--alias {spec!r}: expected REGEX=NAME")
        out.append((re.compile(pattern), name))
    return out


def short(name: str, width: int, aliases: list[tuple[re.Pattern, str]] = ()) -> str:
    """A kernel's alias if a pattern matches it, else its name cut to ``width`` characters with an inductor-style
    numeric suffix dropped (``..._norm_2``)."""
    for pattern, alias in aliases:
        if pattern.search(name):
            return alias
    return re.sub(r"_\d+$", "", name[:width])


def kernel_calls(path: Path, width: int, aliases: list[tuple[re.Pattern, str]] = ()) -> dict[str, list[float]]:
    """Durations (µs) of every device event in a trace, keyed ``"<kernel>  after  <previous kernel>"``."""
    events = load_events(path)
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS and "dur" in e),
                    key=lambda e: e["ts"])
    calls: dict[str, list[float]] = defaultdict(list)
    prev = "(start)"
    for e in device:
        name = short(str(e["name"]), width, aliases)
        calls[f"{name}  after  {prev}"].append(float(e["dur"]))
        prev = name
    return calls


def compare(traces: list[Path], width: int = 48, min_calls: int = 16,
            aliases: list[tuple[re.Pattern, str]] = ()) -> list[dict]:
    """One row per key seen ``min_calls`` times in the first trace: its calls and median µs in every trace, and the
    difference of each later trace's median from the first's, sorted by the largest total difference per trace."""
    per = [kernel_calls(p, width, aliases) for p in traces]
    rows = []
    for key, base in per[0].items():
        if len(base) < min_calls:
            continue
        meds = [round(statistics.median(c[key]), 3) if c.get(key) else None for c in per]
        diffs = [None if m is None else round(m - meds[0], 3) for m in meds[1:]]
        # total over the first trace's calls: what the difference adds up to in that workload
        totals = [None if d is None else round(d * len(base), 1) for d in diffs]
        rows.append({"key": key, "calls": [len(c.get(key, ())) for c in per], "median_us": meds,
                     "diff_us": diffs, "total_diff_us": totals})
    rows.sort(key=lambda r: -max((abs(t) for t in r["total_diff_us"] if t is not None), default=0.0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path, help="chrome traces (.json or .json.gz); the first is the base")
    ap.add_argument("--width", type=int, default=48, help="characters of a kernel's name kept (default 48)")
    ap.add_argument("--min-calls", type=int, default=16)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--alias", action="append", metavar="REGEX=NAME",
                    help=f"name every kernel matching REGEX as NAME (repeatable; default: {' '.join(DEFAULT_ALIASES)};"
                         " --alias none: no alias)")
    ap.add_argument("--out", type=Path, help="also write every row as JSON")
    args = ap.parse_args()
    if len(args.traces) < 2:
        ap.error("give at least two traces: the base, then those compared with it")
    specs = [] if args.alias == ["none"] else (args.alias or list(DEFAULT_ALIASES))
    try:
        aliases = parse_aliases(specs)
    except (ValueError, re.error) as exc:
        ap.error(str(exc))
    rows = compare(args.traces, args.width, args.min_calls, aliases)
    names = [p.name.split(".pt.trace")[0] for p in args.traces]
    print(f"| kernel after kernel | calls | {names[0]} µs | " + " | ".join(f"{n} µs (diff)" for n in names[1:])
          + " |")
    print("|---|---|---|" + "---|" * (len(names) - 1))
    for r in rows[:args.top]:
        cells = [f"{m} ({d:+.3f})" if m is not None else "—" for m, d in zip(r["median_us"][1:],
                                                                            [d or 0.0 for d in r["diff_us"]])]
        print(f"| {r['key']} | {'/'.join(map(str, r['calls']))} | {r['median_us'][0]} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps({"traces": [p.name for p in args.traces], "width": args.width,
                                        "aliases": specs, "min_calls": args.min_calls, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
