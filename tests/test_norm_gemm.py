"""benchmarks/norm_gemm.py: every add-norm variant computes vLLM's add-norm (Triton's interpreter, CPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run_interpreted

VARIANTS = ("triton", "inplace", "looped", "evict", "pingpong", "looped-plain", "looped-row", "reload", "gap",
            "plain", "late-row")  # "inductor" is the reference compiled


def _interp_worker() -> int:
    import json

    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import norm_gemm

    from dynsteer.kernels.fused_reference import add_rms_norm_reference

    results: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, hidden in ((1, 64), (5, 96), (3, 300)):  # 96 and 300: rows that end inside a chunk / block
            gen = torch.Generator().manual_seed(tokens * hidden)
            h = torch.randn(tokens, hidden, generator=gen).to(dtype)
            r = torch.randn(tokens, hidden, generator=gen).to(dtype)
            w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
            want_n, want_r = add_rms_norm_reference(h, r, w, 1e-5)
            plain_n, plain_r = norm_gemm.add_norm("triton")(h, r, w, 1e-5)
            for name in VARIANTS:
                hh, rr = h.clone(), r.clone()
                got_n, got_r = norm_gemm.add_norm(name, chunk=32)(hh, rr, w, 1e-5)
                # fp32: 1e-5; bf16 as in test_kernels.py (the interpreter's bf16 cast truncates: up to one ulp)
                atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1.6e-2)
                results[f"{name}-{str(dtype)[6:]}-{tokens}x{hidden}"] = {
                    "tol_excess": max(((g.float() - e.float()).abs() - atol - rtol * e.float().abs()).max().item()
                                      for g, e in ((got_n, want_n), (got_r, want_r))),
                    "same_as_triton": bool(torch.equal(got_n, plain_n) and torch.equal(got_r, plain_r)),
                    "wrote_inputs": got_n.data_ptr() == hh.data_ptr() and got_r.data_ptr() == rr.data_ptr(),
                    "inputs_kept": bool(torch.equal(hh, h) and torch.equal(rr, r)),
                }
    print("RESULTS " + json.dumps(results))
    return 0


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_interpreted(__file__, timeout=600)


def test_every_variant_is_the_add_norm(results: dict[str, Any]) -> None:
    assert len(results) == 2 * 3 * len(VARIANTS)
    for case, res in results.items():
        assert res["tol_excess"] <= 0, (case, res)


def test_only_the_inplace_variant_writes_over_its_inputs(results: dict[str, Any]) -> None:
    for case, res in results.items():
        inplace = case.startswith("inplace")
        assert res["wrote_inputs"] is inplace and res["inputs_kept"] is not inplace, case


def test_single_pass_variants_give_dynsteers_bits(results: dict[str, Any]) -> None:
    # the two-pass variants sum the squares in another order (reload normalises the rounded residual); the others
    # are the same math as add_rms_norm_triton
    for case, res in results.items():
        if not case.startswith(("looped", "reload", "late")):
            assert res["same_as_triton"], case


if __name__ == "__main__":
    sys.exit(_interp_worker())
