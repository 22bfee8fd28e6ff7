"""Where two py-spy recordings of the same process kind differ, per decode step: ``engine_spy.py``'s raw stacks (or
any ``py-spy record -f raw`` files, gzipped or not) of mode A and mode B, each frame's inclusive milliseconds per
step in both and the difference, largest first. Frames under the model's forward can be left out (``--no-forward``:
on a GPU they are launches; on CPU they are the reference ops).

    python3 scripts/dev/spy_diff.py A.txt.gz B.txt.gz --rate 400 --steps 384 [--only dynsteer/ sched/]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from lib.pyspy import read_raw  # noqa: E402


def load(path: Path, skip_forward: bool) -> tuple[int, int, Counter]:
    """(samples, samples under the model's forward, inclusive samples per frame outside it), every thread."""
    incl: Counter = Counter()
    total = forward = 0
    for stacks in read_raw(path).values():
        for frames, n in stacks.items():
            total += n
            if skip_forward and any("model_executor/models/" in fr for fr in frames):
                forward += n
                continue
            for fr in set(frames):
                incl[fr] += n
    return total, forward, incl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rate", type=int, required=True, help="py-spy's samples per second")
    ap.add_argument("--steps", type=int, required=True, help="decode steps each recording covers (calls × tokens)")
    ap.add_argument("--no-forward", action="store_true", help="leave out frames under the model's forward")
    ap.add_argument("--only", nargs="+", help="frames containing one of these strings")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    per_step = 1e3 / args.rate / args.steps
    (ta, fa, ia), (tb, fb, ib) = (load(p, args.no_forward) for p in (args.a, args.b))
    for name, t, f in (("A", ta, fa), ("B", tb, fb)):
        print(f"{name}: {t * per_step:.3f} ms per step sampled, {f * per_step:.3f} under the forward")
    rows = sorted(((ib[k] - ia[k]) * per_step, k) for k in set(ia) | set(ib)
                  if not args.only or any(s in k for s in args.only))
    rows.reverse()
    print("   B − A ms/step (A, B)   frame")
    for diff, k in rows[:args.top]:
        print(f"  {diff:+8.3f} ({ia[k] * per_step:7.3f}, {ib[k] * per_step:7.3f})  {k[:150]}")


if __name__ == "__main__":
    main()
