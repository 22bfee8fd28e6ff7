"""py-spy attached to a benchmark's processes while one call runs, and the summary a report carries.

A raw profile of a busy engine at 1 kHz is tens of MB per process; a report (and a device run's returned files)
needs a few kB: per process and thread, its share of the samples, how many of them lie in dynsteer's code, and the
frames they spend most in. The raw files are gzipped beside the report for a flame graph.

By default py-spy samples only threads that run (``--idle`` off), so a thread's share of a process's samples is
roughly its share of that process's busy time. ``mode="idle"`` samples waiting threads too (where a thread waits:
for the device, a lock, the GIL), ``mode="gil"`` only the thread holding the GIL (who keeps the others waiting). py-spy cannot always tell a thread blocked inside a C call from one running it: a
thread waiting in ``queue.SimpleQueue.get`` (the capture spool writer between items) can show as busy on that line,
so read a thread's top frames before its share.
"""

from __future__ import annotations

import gzip
import shutil
import signal
import subprocess
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

FOCUS = "dynsteer/"
HOST = "vllm/"  # the code dynsteer plugs into: a stack is dynsteer's where a dynsteer frame lies below its last frame


def _in(frame: str, package: str) -> bool:
    return f"({package}" in frame or f"/{package}" in frame


class Sampler:
    """``py-spy record`` (``exe``) attached to a process and every process under it, one raw file each under
    ``out``, named ``<tag>-<process name>-<pid>.txt`` (gzipped on :meth:`stop`)."""

    MODES = {"busy": [], "idle": ["--idle"], "gil": ["--gil"]}

    def __init__(self, exe: str, out: Path, rate: int = 100, mode: str = "busy") -> None:
        if mode not in self.MODES:
            raise ValueError(f"py-spy mode: {mode!r} is not one of {sorted(self.MODES)}")
        self.exe, self.out, self.rate, self.mode = exe, out, rate, mode
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def command(self, pid: int, path: Path) -> list[str]:
        """The ``py-spy record`` command line for process ``pid``, raw stacks per thread into ``path``."""
        return [self.exe, "record", "-p", str(pid), "-f", "raw", "--threads", *self.MODES[self.mode], "-r",
                str(self.rate), "-o", str(path)]

    def start(self, root_pid: int, tag: str) -> None:
        import psutil

        self.out.mkdir(parents=True, exist_ok=True)
        root = psutil.Process(root_pid)
        for p in [root, *root.children(recursive=True)]:
            name = p.name().replace("::", "-").replace(" ", "_").replace("/", "_") or "proc"
            path = self.out / f"{tag}-{name}-{p.pid}.txt"
            self.procs.append((subprocess.Popen(self.command(p.pid, path), stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL), path))
        time.sleep(1.0)  # attached before the call starts

    def stop(self, summarise: bool = True) -> dict[str, Any]:
        """Detach (py-spy writes its file on SIGINT); gzip each raw file and return ``{file name: summary}``
        (:func:`summary`) for the files that were written."""
        for p, _ in self.procs:
            p.send_signal(signal.SIGINT)
        out: dict[str, Any] = {}
        for p, path in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:  # a profiler that hangs must not hang the benchmark
                p.kill()
            if not path.exists():
                continue
            if summarise:
                out[path.name] = summary(path)
            with path.open("rb") as src, gzip.open(path.with_name(path.name + ".gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
            path.unlink()
        self.procs = []
        return out


def read_raw(path: Path) -> dict[str, Counter]:
    """Stacks of a raw py-spy file recorded with ``--threads``: ``{thread: Counter(stack tuple -> samples)}``, a
    thread named by its name where py-spy gave one (``thread (tid): name``), else ``thread <tid>``."""
    opener = gzip.open if path.suffix == ".gz" else open
    stacks: dict[str, Counter] = defaultdict(Counter)
    names: dict[str, str] = {}
    with opener(path, "rt") as f:
        for line in f:
            line = line.rstrip("\n")
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            head = frames[0]
            if head.startswith("thread ("):
                tid, _, name = head[len("thread ("):].partition(")")
                name = name.lstrip(": ").strip()
                if name:
                    names[tid] = name
                frames = frames[1:]
            else:
                tid = "?"
            stacks[tid][tuple(frames)] += int(count)
    return {names.get(tid, f"thread {tid}"): c for tid, c in stacks.items()}


def _short(frame: str) -> str:
    """``func (path/to/file.py:12)`` with the path cut to the part below site-packages or the repository."""
    func, _, where = frame.partition(" (")
    for cut in ("site-packages/", "dist-packages/"):
        if cut in where:
            where = where.split(cut, 1)[1]
    return f"{func} ({where}" if where else func


def summary(path: Path, top: int = 8, focus: str = FOCUS, host: str = HOST) -> dict[str, Any]:
    """Per thread of one process's raw profile: samples, share of the process's samples, the share of its samples
    spent in ``focus`` code, and its ``top`` leaf frames and ``top`` innermost ``focus`` frames (each with its share
    of the thread's samples).

    A sample is spent in ``focus`` code when a ``focus`` frame lies below (is called by) the stack's last ``host``
    frame: a hook that vLLM calls, not an entry point that merely started vLLM (``dynsteer serve`` is on every
    stack of its API server)."""
    threads = read_raw(path)
    total = sum(sum(c.values()) for c in threads.values())
    out: dict[str, Any] = {"samples": total, "threads": {}}
    for name, stacks in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(stacks.values())
        leaves: Counter = Counter()
        inner: Counter = Counter()
        in_focus = 0
        for frames, count in stacks.items():
            if frames:
                leaves[_short(frames[-1])] += count
            last_host = max((i for i, f in enumerate(frames) if _in(f, host)), default=-1)
            mine = [f for f in frames[last_host + 1:] if _in(f, focus)]
            if mine:
                in_focus += count
                inner[_short(mine[-1])] += count
        out["threads"][name] = {
            "samples": n, "share": round(n / total, 4) if total else 0.0,
            "focus_share": round(in_focus / n, 4) if n else 0.0,
            "top_leaves": [[f, round(c / n, 4)] for f, c in leaves.most_common(top)],
            "top_focus": [[f, round(c / n, 4)] for f, c in inner.most_common(top)],
        }
    return out


def print_summaries(title: str, summaries: dict[str, Any], threads: int = 3, frames: int = 5) -> None:
    """The busiest threads of each profiled process, and where their dynsteer samples are."""
    print(f"\n{title}")
    for fname, s in summaries.items():
        print(f"- {fname}: {s['samples']} samples")
        for name, t in list(s["threads"].items())[:threads]:
            print(f"  - {name}: {t['share']:.0%} of the process, {t['focus_share']:.1%} in dynsteer")
            for frame, share in t["top_focus"][:frames]:
                print(f"    - {share:.1%} {frame}")


if __name__ == "__main__":  # summarise raw files where they were recorded (a device run returns the summary only)
    import argparse
    import json

    ap = argparse.ArgumentParser(description="Per-thread summary of py-spy raw files recorded with --threads.")
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--json", type=Path, help="also write the summaries here")
    a = ap.parse_args()
    sums = {f.name: summary(f, top=a.top) for f in a.files}
    print_summaries("py-spy", sums, threads=4, frames=a.top)
    if a.json:
        a.json.write_text(json.dumps(sums, indent=1))
