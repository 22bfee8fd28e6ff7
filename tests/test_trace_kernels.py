"""benchmarks/trace_kernels.py: per-kernel medians keyed by the kernel before, with aliases lining up traces."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_kernels  # noqa: E402


def write_trace(path: Path, norm: str, gemm_us: float, steps: int = 20) -> Path:
    """A forward per step: norm, GEMM, SiLU-mul; ``gemm_us`` the GEMM's duration after the norm."""
    events, ts = [], 0.0
    for _ in range(steps):
        for name, dur in ((norm, 2.0), ("nvjet_gemm_TNN", gemm_us), ("triton_poi_fused_mul_silu_1", 2.0),
                          ("nvjet_down_TNT", 40.0)):
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur})
            ts += dur + 0.5
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": ts, "dur": 9.0})  # host: ignored
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_a_kernel_slower_after_another_norm_is_found_under_its_alias(tmp_path: Path) -> None:
    a = write_trace(tmp_path / "a.pt.trace.json.gz", "triton_red_fused_fused_add_rms_norm_0", 85.0)
    b = write_trace(tmp_path / "b.pt.trace.json.gz", "_steer_add_rms_norm_kernel", 86.5)
    rows = trace_kernels.compare([a, b], min_calls=5,
                                 aliases=trace_kernels.parse_aliases(list(trace_kernels.DEFAULT_ALIASES)))
    top = rows[0]
    assert top["key"] == "nvjet_gemm_TNN  after  <add-norm>"
    assert top["calls"] == [20, 20] and top["median_us"] == [85.0, 86.5]
    assert top["diff_us"] == [1.5] and top["total_diff_us"] == [30.0]
    unchanged = {r["key"]: r["diff_us"][0] for r in rows}
    assert unchanged["nvjet_down_TNT  after  <silu-mul>"] == 0.0
    assert not any("aten::mm" in r["key"] for r in rows)


def test_without_aliases_the_norms_do_not_line_up(tmp_path: Path) -> None:
    a = write_trace(tmp_path / "a.json.gz", "triton_red_fused_fused_add_rms_norm_0", 85.0)
    b = write_trace(tmp_path / "b.json.gz", "_steer_add_rms_norm_kernel", 86.5)
    rows = {r["key"]: r for r in trace_kernels.compare([a, b], min_calls=5)}
    gemm = rows["nvjet_gemm_TNN  after  triton_red_fused_fused_add_rms_norm"]
    assert gemm["calls"] == [20, 0] and gemm["median_us"][1] is None and gemm["diff_us"] == [None]


@pytest.mark.parametrize("spec", ["rms_norm", "=x", "rms_norm="])
def test_a_malformed_alias_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="REGEX=NAME"):
        trace_kernels.parse_aliases([spec])
