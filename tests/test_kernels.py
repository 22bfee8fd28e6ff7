"""Tests for the per-site steering op: reference semantics, Triton twin, custom op, tracing.

The Triton-vs-reference comparison runs in ONE subprocess with ``TRITON_INTERPRET=1``: triton's
``@jit`` picks interpreted vs compiled mode when ``dynsteer.kernels.triton_steer`` is first
imported, and in a shared pytest process another module may have imported it (or set triton
up) already. The subprocess runs this very file as a script (see ``_interp_worker``) and prints
one JSON line of per-case metrics, which the parametrized tests below assert on.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any

import pytest
import torch

from dynsteer.kernels import ENV_KERNEL, SiteTables, select_impl, steer_site, steer_site_reference
from tests.conftest import row_live, run_interpreted, site_args

NUM_ROWS = 6
# Sentinel for row_index entries past T: out of range, so reading them would be caught.
TAIL_SENTINEL = 10_000
STAGE_SENTINEL = 7.0

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (T, H, K, has_r, dtype name); T kept small because the interpreter runs each program in Python.
TRITON_CASES = [
    (12, hidden, k, has_r, dt)
    for hidden, k, has_r, dt in itertools.product((64, 576, 1000), (0, 1, 2), (False, True), ("float32", "bfloat16"))
] + [(9, 576, 2, True, "float16"), (0, 64, 2, True, "float32"), (0, 576, 0, False, "bfloat16")]


def _case_id(case: tuple[int, int, int, bool, str]) -> str:
    t, hidden, k, has_r, dt = case
    return f"T{t}-H{hidden}-K{k}-{'r' if has_r else 'nor'}-{dt}"


def make_inputs(
    num_tokens: int, hidden: int, num_k: int, has_r: bool, dtype: torch.dtype, seed: int = 0
) -> dict[str, Any]:
    """Build a steering table exercising every row kind, plus tokens that visit all rows.

    Rows: 0 zeros; 1 vec only (slots off but with live directions/bounds, so skipping matters);
    2 vec + band clamp [-0.25, 0.25] (+ a half-strength one-sided clamp [1, inf) in slot 1);
    3 ablation (lo = hi = 0, strength 1 in every slot); 4 vec + open bounds (no-op clamp) and a
    zero direction with a finite bound (must not produce nan); 5 vec + upper bound only (<= -1).
    ``row_live`` is consistent with the rest (row 3: clamps only; row 1: the vector only).

    Args:
        num_tokens: T.
        hidden: H.
        num_k: K clamp slots per row.
        has_r: whether to pass a carried residual.
        dtype: dtype of h and r.
        seed: RNG seed.

    Returns:
        Keyword arguments for ``steer_site`` (h, r, row_index, vec, clamp_*, row_live, stage), in its order.
    """
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    r = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if has_r else None
    vec = torch.randn(NUM_ROWS, hidden, generator=gen)
    vec[0] = 0.0
    vec[3] = 0.0
    dirs = torch.nn.functional.normalize(torch.randn(NUM_ROWS, num_k, hidden, generator=gen), dim=-1)
    lo = torch.full((NUM_ROWS, num_k), float("-inf"))
    hi = torch.full((NUM_ROWS, num_k), float("inf"))
    strength = torch.zeros(NUM_ROWS, num_k)
    dirs[0] = 0.0
    lo[1], hi[1] = -0.1, 0.1  # live-looking but strength 0: must be skipped
    if num_k >= 1:
        lo[2, 0], hi[2, 0], strength[2, 0] = -0.25, 0.25, 1.0
        lo[3], hi[3], strength[3] = 0.0, 0.0, 1.0
        strength[4, 0] = 1.0  # (-inf, inf): clip(p) - p == 0
        hi[5, 0], strength[5, 0] = -1.0, 1.0
    if num_k >= 2:
        lo[2, 1], strength[2, 1] = 1.0, 0.5
        dirs[4, 1], lo[4, 1], strength[4, 1] = 0.0, 1.0, 1.0  # zero direction: p = 0, 1 * 0 = 0
    order = torch.randperm(max(num_tokens, NUM_ROWS), generator=gen)[:num_tokens] % NUM_ROWS
    row_index = torch.full((num_tokens + 5,), TAIL_SENTINEL, dtype=torch.int32)
    row_index[:num_tokens] = order.to(torch.int32)
    # The capture buffer has spare rows holding a sentinel the op must leave where no token is sent.
    stage = torch.full((num_tokens + 3, hidden), STAGE_SENTINEL, dtype=dtype)
    return dict(
        h=h, r=r, row_index=row_index, vec=vec, clamp_dir=dirs, clamp_lo=lo, clamp_hi=hi, clamp_strength=strength,
        row_live=row_live(vec, strength), stage=stage, stage_slot=capture_slots(num_tokens, num_tokens + 5, gen),
    )


def capture_slots(num_tokens: int, capacity: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [capacity]: about two thirds of the T tokens, in random order, get consecutive stage rows 0..m-1
    (as the collector compacts a step's captured tokens); the rest -1; entries past T hold row 0, never read."""
    slot = torch.zeros(capacity, dtype=torch.int32)
    slot[:num_tokens] = -1
    chosen = torch.randperm(num_tokens, generator=gen)[: (2 * num_tokens + 2) // 3]
    slot[chosen] = torch.arange(len(chosen), dtype=torch.int32)
    return slot


def expected_stage(before: torch.Tensor, h: torch.Tensor, r: torch.Tensor | None,
                   slot: torch.Tensor | None) -> torch.Tensor:
    """The contract, token by token: row ``slot[t]`` (``t`` without slots) gets float32(h + r) rounded once."""
    want = before.clone()
    full = h if r is None else (h.float() + r.float()).to(before.dtype)
    for t in range(h.shape[0]):
        j = t if slot is None else int(slot[t])
        if 0 <= j < want.shape[0]:
            want[j] = full[t]
    return want


def untargeted_kept(stage: torch.Tensor, slot: torch.Tensor | None, num_tokens: int) -> bool:
    """Whether every stage row no token was sent to still holds the sentinel."""
    keep = torch.ones(stage.shape[0], dtype=torch.bool, device=stage.device)
    targets = torch.arange(num_tokens) if slot is None else slot[:num_tokens].long().cpu()
    keep[targets[(targets >= 0) & (targets < stage.shape[0])].to(stage.device)] = False
    return bool((stage[keep] == STAGE_SENTINEL).all())


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for kernel-vs-reference; bf16 allows one ulp (interpreter truncates, see below)."""
    if dtype == torch.float32:
        return 1e-4, 1e-5
    if dtype == torch.float16:
        return 2e-3, 2e-3
    return 1e-2, 1.6e-2


# ---------------------------------------------------------------------------------------------
# (a) Triton kernel vs reference, in a TRITON_INTERPRET=1 subprocess
# ---------------------------------------------------------------------------------------------


def _interp_worker() -> int:
    """Subprocess body: run the Triton kernel (interpreted) on every case; print JSON metrics."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from dynsteer.kernels.triton_steer import stash_triton, steer_site_triton

    results: dict[str, Any] = {}
    for seed, case in enumerate(TRITON_CASES):
        num_tokens, hidden, num_k, has_r, dt = case
        dtype = DTYPES[dt]
        kw = make_inputs(num_tokens, hidden, num_k, has_r, dtype, seed=seed)
        got_stage, want_stage = kw["stage"].clone(), kw["stage"].clone()
        got = steer_site_triton(**site_args(dict(kw, stage=got_stage)))
        want = steer_site_reference(**site_args(dict(kw, stage=want_stage)))
        unstaged = steer_site_triton(**site_args(dict(kw, stage=None, stage_slot=None)))
        # Without slots every token t goes to row t; with all slots -1 (an idle step) nothing is stored.
        ident_got, ident_want = kw["stage"].clone(), kw["stage"].clone()
        steer_site_triton(**site_args(dict(kw, stage=ident_got, stage_slot=None)))
        steer_site_reference(**site_args(dict(kw, stage=ident_want, stage_slot=None)))
        idle_stage = kw["stage"].clone()
        steer_site_triton(**site_args(dict(kw, stage=idle_stage, stage_slot=torch.full_like(kw["stage_slot"], -1))))
        # The inline mode's separate capture kernel: the same rows.
        alone = kw["stage"].clone()
        stash_triton(kw["h"], kw["r"], alone, kw["stage_slot"])
        atol, rtol = _tolerances(dtype)
        rows = kw["row_index"][:num_tokens].long()
        diff = (got.float() - want.float()).abs()
        excess = (diff - (atol + rtol * want.float().abs())).max().item() if num_tokens else -1.0
        vec_only = rows == 1
        results[_case_id(case)] = {
            "shape_ok": got.shape == kw["h"].shape and got.dtype == dtype,
            "new_tensor": got.data_ptr() != kw["h"].data_ptr() or num_tokens == 0,
            "finite": bool(torch.isfinite(got).all()),
            "max_abs_err": diff.max().item() if num_tokens else 0.0,
            "tol_excess": excess,
            "zero_row_exact": torch.equal(got[rows == 0], kw["h"][rows == 0]),
            # fp32/fp16 casts round identically in both; the interpreter's bf16 cast truncates.
            "vec_only_exact": torch.equal(got[vec_only], want[vec_only]),
            "same_without_stage": torch.equal(got, unstaged),
            "stage_max_err": max((a.float() - b.float()).abs().max().item()
                                 for a, b in ((got_stage, want_stage), (ident_got, ident_want), (alone, want_stage))),
            "stage_tail_kept": untargeted_kept(got_stage, kw["stage_slot"], num_tokens)
            and untargeted_kept(ident_got, None, num_tokens),
            "idle_stores_nothing": bool((idle_stage == STAGE_SENTINEL).all()),
        }

    # Dispatch through the custom op with the kernel forced (only meaningful when interpreted).
    os.environ[ENV_KERNEL] = "triton"
    kw = make_inputs(8, 64, 2, True, torch.float32, seed=123)
    results["op_forced_triton"] = {
        "impl": select_impl(kw["h"]).__name__,
        "max_abs_err": (steer_site(**site_args(kw)) - steer_site_reference(**site_args(kw))).abs().max().item(),
    }
    # Strided rows (h, r are column slices of wider buffers) exercise the stride arguments.
    kw = make_inputs(8, 64, 2, True, torch.float32, seed=7)
    wide_h, wide_r = torch.randn(8, 100), torch.randn(8, 100)
    wide_h[:, :64], wide_r[:, :64] = kw["h"], kw["r"]
    kw_strided = dict(kw, h=wide_h[:, :64], r=wide_r[:, :64])
    results["strided_rows"] = {
        "max_abs_err": (steer_site_triton(**site_args(kw_strided))
                        - steer_site_reference(**site_args(kw))).abs().max().item()
    }
    results.update(site_live_metrics(steer_site_triton))
    print("RESULTS " + json.dumps(results))
    return 0


LIVE_ELSEWHERE = (2, 4, 5)  # rows steered at site A that hold nothing at site B


def site_live_metrics(impl: Any, device: str = "cpu") -> dict[str, Any]:
    """Rows live at one site and not at another (a spec steering other layers): at site B the kernel copies their
    tokens bit for bit (``row_live`` 0), at site A it steers them; the other rows are steered alike at both."""
    out: dict[str, Any] = {}
    for dt in ("float32", "bfloat16"):
        kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v
              for k, v in dict(make_inputs(24, 576, 2, True, DTYPES[dt], seed=50), stage=None, stage_slot=None).items()}
        site_b = dict(kw, vec=kw["vec"].clone(), clamp_strength=kw["clamp_strength"].clone())
        site_b["vec"][list(LIVE_ELSEWHERE)] = 0.0
        site_b["clamp_strength"][list(LIVE_ELSEWHERE)] = 0.0
        site_b["row_live"] = row_live(site_b["vec"], site_b["clamp_strength"])
        rows = kw["row_index"][:24].long()
        idle = torch.isin(rows, torch.tensor(LIVE_ELSEWHERE, device=device))
        got_a, got_b = impl(**site_args(kw)), impl(**site_args(site_b))
        want_b = steer_site_reference(**site_args(site_b))
        atol, rtol = _tolerances(DTYPES[dt])
        excess = ((got_b.float() - want_b.float()).abs() - (atol + rtol * want_b.float().abs())).max().item()
        # Row 0's entry is the site's summary: 0 (no row of the batch holds anything here) copies every token,
        # whatever its row holds; a batch reading only rows that hold nothing here, summarized, equals the reference.
        skip = dict(kw, row_live=kw["row_live"].clone())
        skip["row_live"][0] = 0
        quiet = dict(site_b, row_index=kw["row_index"].clone(), row_live=site_b["row_live"].clone())
        quiet["row_index"][:24] = torch.where(idle, rows, torch.zeros_like(rows)).to(torch.int32)
        quiet["row_live"][0] = 0
        out[f"summary_{dt}"] = {
            "skips_all": torch.equal(impl(**site_args(skip)), kw["h"]),
            "quiet_exact": torch.equal(impl(**site_args(quiet)), kw["h"])
            and torch.equal(steer_site_reference(**site_args(quiet)), kw["h"]),
        }
        out[f"site_live_{dt}"] = {
            "flags_cleared": site_b["row_live"][list(LIVE_ELSEWHERE)].tolist() == [0, 0, 0]
            and bool((kw["row_live"][list(LIVE_ELSEWHERE)] != 0).all()),
            "idle_tokens": int(idle.sum()),
            "idle_exact_at_b": torch.equal(got_b[idle], kw["h"][idle]),
            "steered_at_a": bool((got_a[idle] != kw["h"][idle]).any(dim=-1).all()),
            "others_same": torch.equal(got_b[~idle], got_a[~idle]),
            "tol_excess": excess,
        }
    return out


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_triton_row_live_elsewhere_is_identity(interp_results: dict[str, Any], dt: str) -> None:
    assert_site_live(interp_results[f"site_live_{dt}"])
    assert all(interp_results[f"summary_{dt}"].values()), interp_results[f"summary_{dt}"]


def assert_site_live(res: dict[str, Any]) -> None:
    assert res["flags_cleared"] and res["idle_tokens"] > 0, res
    assert res["idle_exact_at_b"] and res["steered_at_a"] and res["others_same"], res
    assert res["tol_excess"] <= 0.0, res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_row_live_elsewhere_is_identity() -> None:
    from dynsteer.kernels.triton_steer import steer_site_triton

    for name, res in site_live_metrics(steer_site_triton, "cuda").items():
        if name.startswith("summary_"):
            assert all(res.values()), res
        else:
            assert_site_live(res)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, Any]:
    return run_interpreted(__file__, timeout=300)


@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_triton_matches_reference(interp_results: dict[str, Any], case: tuple[int, int, int, bool, str]) -> None:
    res = interp_results[_case_id(case)]
    assert res["shape_ok"] and res["new_tensor"] and res["finite"], res
    assert res["tol_excess"] <= 0.0, res
    assert res["zero_row_exact"], res
    assert res["same_without_stage"] and res["stage_tail_kept"] and res["idle_stores_nothing"], res
    if case[-1] != "bfloat16":
        assert res["vec_only_exact"], res
        assert res["stage_max_err"] == 0.0, res
    else:  # the interpreter truncates bf16 casts: one ulp
        assert res["stage_max_err"] <= 2 ** -7 * 8, res


def test_triton_via_forced_op(interp_results: dict[str, Any]) -> None:
    res = interp_results["op_forced_triton"]
    assert res["impl"] == "steer_site_triton"
    assert res["max_abs_err"] < 1e-4


def test_triton_strided_rows(interp_results: dict[str, Any]) -> None:
    assert interp_results["strided_rows"]["max_abs_err"] < 1e-4


# ---------------------------------------------------------------------------------------------
# (b) reference semantics
# ---------------------------------------------------------------------------------------------


def _proj(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (x.double() * u.double()).sum(-1)


def _single_row_table(hidden: int, num_k: int) -> dict[str, torch.Tensor]:
    """Table with row 0 zeros and row 1 free for a test to fill."""
    return dict(
        vec=torch.zeros(2, hidden),
        clamp_dir=torch.zeros(2, num_k, hidden),
        clamp_lo=torch.full((2, num_k), float("-inf")),
        clamp_hi=torch.full((2, num_k), float("inf")),
        clamp_strength=torch.zeros(2, num_k),
        row_live=torch.zeros(2, dtype=torch.int32),
    )


def _flag(tab: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tab`` with its ``row_live`` recomputed from the filled-in tables."""
    return dict(tab, row_live=row_live(tab["vec"], tab["clamp_strength"]))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("has_r", [False, True])
def test_zero_row_is_bit_identical(dtype: torch.dtype, has_r: bool) -> None:
    kw = make_inputs(16, 96, 2, has_r, dtype, seed=3)
    kw["row_index"][:16] = 0
    out = steer_site_reference(**site_args(kw))
    assert out.dtype == dtype and out.data_ptr() != kw["h"].data_ptr()
    assert torch.equal(out, kw["h"])
    # Same for a row whose slots are off but hold live directions and bounds (row 1 minus vec).
    kw["vec"][1] = 0.0
    kw["row_live"][1] = 0
    kw["row_index"][:16] = 1
    assert torch.equal(steer_site_reference(**site_args(kw)), kw["h"])


@pytest.mark.parametrize("has_r", [False, True])
@pytest.mark.parametrize("bounds", [(-0.3, 0.2), (0.5, float("inf")), (float("-inf"), -0.5), (0.0, 0.0)])
def test_full_clamp_lands_in_bounds(has_r: bool, bounds: tuple[float, float]) -> None:
    gen = torch.Generator().manual_seed(11)
    num_tokens, hidden = 32, 128
    tab = _single_row_table(hidden, 1)
    u = torch.nn.functional.normalize(torch.randn(hidden, generator=gen), dim=0)
    tab["vec"][1] = torch.randn(hidden, generator=gen)
    tab["clamp_dir"][1, 0] = u
    tab["clamp_lo"][1, 0], tab["clamp_hi"][1, 0] = bounds
    tab["clamp_strength"][1, 0] = 1.0
    # Scale so projections straddle the bounds.
    h = 2 * torch.randn(num_tokens, hidden, generator=gen)
    r = torch.randn(num_tokens, hidden, generator=gen) if has_r else None
    row_index = torch.ones(num_tokens, dtype=torch.int32)
    out = steer_site_reference(h, r, row_index, SiteTables(**_flag(tab)))
    full = out + r if r is not None else out
    p = _proj(full, u)
    lo, hi = bounds
    assert bool((p >= lo - 1e-4).all() and (p <= hi + 1e-4).all()), p
    # Only the u component changes relative to h + vec.
    moved = out - (h + tab["vec"][1])
    resid = moved - _proj(moved, u).float().unsqueeze(-1) * u
    assert resid.abs().max() < 1e-5
    # Tokens already inside the band are left untouched (projection unchanged).
    before = _proj(h + tab["vec"][1] + (r if r is not None else 0), u)
    inside = (before >= lo) & (before <= hi)
    assert torch.allclose(p[inside], before[inside], atol=1e-4)


def test_ablation_zeroes_projection_of_full_stream() -> None:
    kw = make_inputs(24, 256, 2, True, torch.float32, seed=5)
    kw["row_index"][:24] = 3  # row 3: ablation (lo = hi = 0) in both slots
    out = steer_site_reference(**site_args(kw))
    # Slots run in order, so the last slot's projection is exactly ablated; slot 0's direction is
    # only partially re-introduced by slot 1 (non-orthogonal random directions).
    assert _proj(out + kw["r"], kw["clamp_dir"][3, 1]).abs().max() < 1e-4
    first_slot = ("clamp_dir", "clamp_lo", "clamp_hi", "clamp_strength")
    kw1 = dict(kw, **{name: kw[name][:, :1] for name in first_slot})
    out1 = steer_site_reference(**site_args(kw1))
    assert _proj(out1 + kw["r"], kw["clamp_dir"][3, 0]).abs().max() < 1e-4
    assert _proj(kw["h"] + kw["r"], kw["clamp_dir"][3, 0]).abs().max() > 0.1  # it did something


def test_half_strength_moves_half_way() -> None:
    gen = torch.Generator().manual_seed(2)
    num_tokens, hidden = 16, 64
    tab = _single_row_table(hidden, 1)
    u = torch.nn.functional.normalize(torch.randn(hidden, generator=gen), dim=0)
    tab["clamp_dir"][1, 0] = u
    tab["clamp_lo"][1, 0], tab["clamp_hi"][1, 0] = 0.0, 0.0
    tab["clamp_strength"][1, 0] = 0.5
    h = torch.randn(num_tokens, hidden, generator=gen)
    r = torch.randn(num_tokens, hidden, generator=gen)
    out = steer_site_reference(h, r, torch.ones(num_tokens, dtype=torch.int32), SiteTables(**_flag(tab)))
    assert torch.allclose(_proj(out + r, u), 0.5 * _proj(h + r, u), atol=1e-5)


def test_sequential_clamps_match_loop() -> None:
    """Non-orthogonal directions: slot 1 sees the output of slot 0 (order matters)."""
    kw = make_inputs(10, 48, 2, True, torch.float32, seed=9)
    gen = torch.Generator().manual_seed(1)
    base = torch.nn.functional.normalize(torch.randn(48, generator=gen), dim=0)
    kw["clamp_dir"][2, 1] = torch.nn.functional.normalize(base + kw["clamp_dir"][2, 0], dim=0)
    kw["clamp_strength"][2] = torch.tensor([1.0, 0.7])
    kw["clamp_lo"][2], kw["clamp_hi"][2] = torch.tensor([-0.1, 0.3]), torch.tensor([0.1, 0.6])
    out = steer_site_reference(**site_args(kw))
    for t in range(10):
        i = int(kw["row_index"][t])
        x = kw["h"][t].double() + kw["vec"][i].double()
        for k in range(2):
            s = float(kw["clamp_strength"][i, k])
            if s != 0:
                u = kw["clamp_dir"][i, k].double()
                p = float((x + kw["r"][t].double()) @ u)
                c = min(max(p, float(kw["clamp_lo"][i, k])), float(kw["clamp_hi"][i, k]))
                x = x + s * (c - p) * u
        assert torch.allclose(out[t].double(), x, atol=1e-5), t


def test_no_nan_from_zero_directions_or_open_bounds() -> None:
    kw = make_inputs(30, 64, 2, True, torch.float32, seed=4)
    out = steer_site_reference(**site_args(kw))
    assert torch.isfinite(out).all()
    rows = kw["row_index"][:30].long()
    # Row 4: open-bounds clamp + zero-direction clamp are both no-ops: out == h + vec exactly.
    sel = rows == 4
    assert torch.equal(out[sel], kw["h"][sel] + kw["vec"][4])


# ---------------------------------------------------------------------------------------------
# (c) custom op, dispatch, tracing
# ---------------------------------------------------------------------------------------------


def test_dispatch_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    h = torch.zeros(2, 4)
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    assert select_impl(h) is steer_site_reference
    monkeypatch.setenv(ENV_KERNEL, "reference")
    assert select_impl(h) is steer_site_reference
    monkeypatch.setenv(ENV_KERNEL, "bogus")
    with pytest.raises(ValueError):
        select_impl(h)


@pytest.mark.parametrize("has_r", [False, True])
def test_op_matches_reference_on_cpu(has_r: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    kw = make_inputs(12, 80, 2, has_r, torch.bfloat16, seed=6)
    want_stage = kw["stage"].clone()
    assert torch.equal(torch.ops.dynsteer.steer_site(*kw.values()),
                       steer_site_reference(**site_args(dict(kw, stage=want_stage))))
    assert torch.equal(kw["stage"], want_stage)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_r", [False, True])
def test_stage_receives_unsteered_residual(dtype: torch.dtype, has_r: bool) -> None:
    """Capture rides the op: the tokens given a slot land, as h + r before steering, in their rows (compacted, in
    the slots' order); every other row is untouched; the steered output is the same as without a buffer."""
    kw = make_inputs(12, 80, 2, has_r, dtype, seed=16)
    before = kw["stage"].clone()
    out = steer_site(**site_args(kw))
    assert torch.equal(kw["stage"], expected_stage(before, kw["h"], kw["r"], kw["stage_slot"]))
    assert 0 < int((kw["stage_slot"][:12] >= 0).sum()) < 12  # some tokens captured, some not
    assert untargeted_kept(kw["stage"], kw["stage_slot"], 12)
    assert torch.equal(out, steer_site(**site_args(dict(kw, stage=None, stage_slot=None))))
    assert not torch.equal(out, kw["h"])  # the table steers these tokens: the buffer saw the input, not the output
    # No slots: token t to row t.
    ident = dict(kw, stage=before.clone(), stage_slot=None)
    steer_site(**site_args(ident))
    assert torch.equal(ident["stage"], expected_stage(before, kw["h"], kw["r"], None))
    # An idle step (every slot -1) stores nothing; a slot past the buffer is ignored.
    idle = dict(kw, stage=before.clone(), stage_slot=torch.full_like(kw["stage_slot"], -1))
    idle["stage_slot"][3] = before.shape[0]
    steer_site(**site_args(idle))
    assert torch.equal(idle["stage"], before)


@pytest.mark.parametrize("has_r", [False, True])
def test_stash_op_matches_the_steering_ops_capture(has_r: bool) -> None:
    """The inline forward's separate capture op writes the same rows as the steering op's capture."""
    kw = make_inputs(12, 80, 2, has_r, torch.bfloat16, seed=17)
    alone = kw["stage"].clone()
    torch.ops.dynsteer.stash_residual(kw["h"], kw["r"], alone, kw["stage_slot"])
    steer_site(**site_args(kw))
    assert torch.equal(alone, kw["stage"])


def test_registration_is_idempotent() -> None:
    import importlib

    import dynsteer.kernels.ops as ops

    importlib.reload(ops)
    importlib.reload(ops)
    kw = make_inputs(4, 32, 1, True, torch.float32, seed=8)
    assert torch.equal(ops.steer_site(**site_args(kw)), steer_site_reference(**site_args(kw)))


def test_opcheck(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    for has_r in (False, True):
        kw = make_inputs(6, 32, 2, has_r, torch.float32, seed=10)
        torch.library.opcheck(torch.ops.dynsteer.steer_site.default, tuple(kw.values()))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("has_r", [False, True])
def test_op_traces_under_compile(backend: str, has_r: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    torch._dynamo.reset()

    def layer(h: torch.Tensor, r: torch.Tensor | None, *table: torch.Tensor) -> torch.Tensor:
        # Surrounding ops make sure the custom op sits inside a real graph.
        out = torch.ops.dynsteer.steer_site(h * 2.0, r, *table)
        return out + 1.0

    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    kw = make_inputs(10, 64, 2, has_r, torch.float32, seed=12)
    args = list(kw.values())
    want = steer_site_reference(**site_args(dict(kw, h=kw["h"] * 2.0))) + 1.0
    torch.testing.assert_close(compiled(*args), want, rtol=0, atol=0)


def test_reference_traces_fullgraph() -> None:
    """The reference's steering has no value-dependent branching: it compiles with fullgraph=True (inline forwards
    trace it; their capture is the separate, opaque stash op)."""
    torch._dynamo.reset()
    compiled = torch.compile(steer_site_reference, backend="aot_eager", fullgraph=True)
    kw = dict(make_inputs(10, 64, 2, True, torch.bfloat16, seed=13), stage=None, stage_slot=None)
    torch.testing.assert_close(compiled(**site_args(kw)), steer_site_reference(**site_args(kw)), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# (d) T == 0
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("has_r", [False, True])
def test_empty_batch(has_r: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    kw = make_inputs(0, 64, 2, has_r, torch.bfloat16, seed=14)
    for out in (steer_site_reference(**site_args(kw)), steer_site(**site_args(kw))):
        assert out.shape == (0, 64) and out.dtype == torch.bfloat16


if __name__ == "__main__":
    sys.exit(_interp_worker())
