"""What a benchmark writes: its JSON report (named by benchmark, device and date), table heads, and the host and
commit the report records."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def utc_now() -> str:
    """The report's ``date``: UTC, to the second."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def write_report(report: dict, out_dir: str) -> Path:
    """Write ``report`` as ``<out_dir>/<benchmark>-<device>-<date>.json`` and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{report['benchmark']}-{report['device'].replace(' ', '_')}-{report['date'][:10]}.json"
    path.write_text(json.dumps(report, indent=2))
    return path


def write_labelled_run(out_dir: Path, benchmark: str, label: str, run: dict) -> Path:
    """Keep ``run`` as entry ``label`` of ``<out_dir>/<benchmark>-cpu-<date>.json`` (other labels' runs of the day,
    e.g. the code before a change, stay); returns the path."""
    date = dt.date.today().isoformat()
    path = out_dir / f"{benchmark}-cpu-{date}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    report = json.loads(path.read_text()) if path.exists() else {
        "benchmark": benchmark, "date": date, "device": "cpu", "runs": {}}
    report["runs"][label] = run
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def save_json(path: Path, report: dict) -> None:
    """Write ``report`` to ``path`` through a temporary file, so a run killed meanwhile leaves the last whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def print_table_head(first: str, batches: list) -> None:
    """The first two lines of a markdown table with one column per decode batch size."""
    print(f"| {first} | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---" * (len(batches) + 1) + "|")


def host_facts() -> dict:
    """The host the run's engines share: CPU model, logical CPUs, load (runs on different leases differ)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu_model": model, "logical_cpus": os.cpu_count(), "loadavg": list(os.getloadavg())}


def git_sha() -> str:
    """``$DYNSTEER_GIT_SHA`` if set (a device machine's copy of ``.git`` may be stale), else ``git rev-parse``."""
    if os.environ.get("DYNSTEER_GIT_SHA"):
        return os.environ["DYNSTEER_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if sha:
            return sha + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return os.environ.get("DYNSTEER_GIT_SHA", "unknown (no git; set DYNSTEER_GIT_SHA)")
