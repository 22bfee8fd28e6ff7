"""Tests for the dynamic per-site steering op (in-graph monitors + gated terms): reference, Triton twin, custom op.

As in ``test_kernels.py``, the Triton-vs-reference comparison runs in ONE ``TRITON_INTERPRET=1`` subprocess (this
file run as a script, see ``_interp_worker``) that prints a JSON line of per-case metrics; with a CUDA device the
same cases also run compiled, in-process (the ``gpu`` tests), together with a CUDA-graph replay.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import sys
from typing import Any

import pytest
import torch

from dynsteer.kernels import (ENV_KERNEL, select_impl, steer_site_dyn, steer_site_dyn_reference,
                              steer_site_reference)
from tests.conftest import row_live, run_interpreted, site_args
from tests.test_kernels import capture_slots, expected_stage, untargeted_kept

NUM_ROWS = 8
TAIL = 5  # buffer capacity N = T + TAIL; entries past T must never be touched
STAGE_SENTINEL = 7.0
TAIL_SENTINEL = 10_000  # row_index past T: out of range, so reading it would be caught
STATIC_ROWS = (0, 1, 2)  # rows whose output must equal steer_site's bit for bit (row 2 monitors, changes nothing)
STATIC_ARGS = ("h", "r", "row_index", "vec", "clamp_dir", "clamp_lo", "clamp_hi", "clamp_strength", "row_live")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (T, H, K, G, has_r, dtype name): a covering subset of H {64, 100, 576, 4096} x T {1, 7, 33} x G {1, 2, 3} x
# K {0, 1, 2} x dtypes x r; the interpreter runs each program in Python, so not the full product.
Case = tuple[int, int, int, int, bool, str]
TRITON_CASES: list[Case] = [
    (7, 64, 2, 2, True, "float32"),
    (7, 64, 0, 1, False, "float32"),
    (33, 64, 2, 1, True, "float16"),
    (33, 100, 1, 3, True, "bfloat16"),
    (33, 100, 2, 1, False, "float16"),
    (7, 100, 2, 3, True, "float32"),
    (1, 576, 2, 3, False, "bfloat16"),
    (7, 576, 1, 2, True, "float16"),
    (33, 576, 0, 2, True, "float32"),
    (1, 4096, 2, 2, True, "float32"),
    (7, 4096, 1, 3, False, "bfloat16"),
    (33, 4096, 2, 3, True, "bfloat16"),
    (0, 64, 2, 2, True, "float32"),
]


def _case_id(case: Case) -> str:
    t, hidden, k, g, has_r, dt = case
    return f"T{t}-H{hidden}-K{k}-G{g}-{'r' if has_r else 'nor'}-{dt}"


def make_dyn_inputs(num_tokens: int, hidden: int, num_k: int, num_g: int, has_r: bool, dtype: torch.dtype,
                    seed: int = 0) -> dict[str, Any]:
    """A table exercising every row kind, tokens visiting all rows, and gate buffers holding earlier values.

    Rows: 0 zeros (what unsteered tokens read); 1 static vec + clamps, with NaN probes / dyn vectors and live
    monitor parameters behind cleared masks (skipping must be exact); 2 row 1 plus monitors on every slot (output
    stays static); 3 dyn vectors on every slot only (reads carried gates); 4 monitors + dyn on every slot + clamps
    gated by slot k % G; 5 monitor and dyn on the last slot with floor 0.6, clamp 0 gated by it, clamp 1 static;
    6 ablation clamps gated by slot 0 and nothing else (carried gate); 7 monitor, dyn and gated clamps on slot 0.
    ``row_live`` is consistent with the rest.

    Args:
        num_tokens: T.
        hidden: H.
        num_k: K clamp slots.
        num_g: G gate slots (>= 1).
        has_r: whether to pass a carried residual.
        dtype: dtype of h and r.
        seed: RNG seed.

    Returns:
        Keyword arguments for ``steer_site_dyn``, in the op's argument order.
    """
    gen = torch.Generator().manual_seed(seed)
    R, K, G, H = NUM_ROWS, num_k, num_g, hidden
    n_cap = num_tokens + TAIL
    all_slots = (1 << G) - 1
    h = torch.randn(num_tokens, H, generator=gen).to(dtype)
    r = torch.randn(num_tokens, H, generator=gen).to(dtype) if has_r else None
    vec = torch.randn(R, H, generator=gen)
    vec[0] = vec[6] = 0.0
    dirs = torch.nn.functional.normalize(torch.randn(R, K, H, generator=gen), dim=-1)
    lo = torch.full((R, K), float("-inf"))
    hi = torch.full((R, K), float("inf"))
    strength = torch.zeros(R, K)
    gate_of = torch.full((R, K), -1, dtype=torch.int32)
    dirs[0] = 0.0
    for row in (1, 2, 4, 5, 7):
        if K >= 1:
            lo[row, 0], hi[row, 0], strength[row, 0] = -0.25, 0.25, 1.0
        if K >= 2:
            lo[row, 1], strength[row, 1] = 1.0, 0.5
    lo[6], hi[6], strength[6], gate_of[6] = 0.0, 0.0, 1.0, 0
    gate_of[4] = torch.arange(K, dtype=torch.int32) % G
    if K >= 1:
        gate_of[5, 0] = G - 1
        gate_of[7, 0] = 0

    probe = torch.nn.functional.normalize(torch.randn(R, G, H, generator=gen), dim=-1)
    sharp = 1.0 + 2.0 * torch.rand(R, G, generator=gen)
    thresh = 0.5 * torch.randn(R, G, generator=gen)
    floor = torch.zeros(R, G)
    dyn_vec = torch.randn(R, G, H, generator=gen)
    probe[1] = dyn_vec[1] = float("nan")  # behind cleared masks: must never be read into a result
    floor[5, G - 1] = 0.6
    mon_mask = torch.tensor([0, 0, all_slots, 0, all_slots, 1 << (G - 1), 0, 1], dtype=torch.int32)
    dyn_mask = torch.tensor([0, 0, 0, all_slots, all_slots, 1 << (G - 1), 0, 1], dtype=torch.int32)

    # Host-staged per-token multipliers: decode (1, 0), prefill (0, 0), half, forced on (0, 1), offset.
    choices = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0], [0.0, 1.0], [1.0, 0.25]])
    pick = torch.randint(0, len(choices), (G, n_cap), generator=gen)
    gate_mul, gate_add = choices[pick, 0].contiguous(), choices[pick, 1].contiguous()
    # Values "from an earlier layer": what rows without a monitor for a slot must read and leave alone.
    gates = torch.rand(G, n_cap, generator=gen)
    scores = torch.randn(G, n_cap, generator=gen)

    order = torch.randperm(max(num_tokens, R), generator=gen)[:num_tokens] % R
    row_index = torch.full((n_cap,), TAIL_SENTINEL, dtype=torch.int32)
    row_index[:num_tokens] = order.to(torch.int32)
    return dict(h=h, r=r, row_index=row_index, vec=vec, clamp_dir=dirs, clamp_lo=lo, clamp_hi=hi,
                clamp_strength=strength, row_live=row_live(vec, strength, mon_mask, dyn_mask), clamp_gate=gate_of,
                mon_mask=mon_mask, mon_probe=probe, mon_sharp=sharp, mon_thresh=thresh, mon_floor=floor,
                dyn_mask=dyn_mask, dyn_vec=dyn_vec, gate_mul=gate_mul, gate_add=gate_add, gates=gates, scores=scores,
                stage=stage_buffer(h),
                stage_slot=capture_slots(num_tokens, n_cap, gen))


def stage_buffer(h: torch.Tensor) -> torch.Tensor:
    """A capture buffer with spare rows past T, filled with a sentinel the op must leave there."""
    return torch.full((h.shape[0] + 3, h.shape[1]), STAGE_SENTINEL, dtype=h.dtype, device=h.device)


def later_site(kw: dict[str, Any], seed: int) -> dict[str, Any]:
    """The same table at a later site: new activations, no monitors, same gate buffers (so gates are carried)."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(kw, mon_mask=torch.zeros_like(kw["mon_mask"]))
    out["row_live"] = row_live(kw["vec"], kw["clamp_strength"], out["mon_mask"], kw["dyn_mask"])
    out["h"] = torch.randn(kw["h"].shape, generator=gen).to(kw["h"])
    return out


def clone_buffers(kw: dict[str, Any]) -> dict[str, Any]:
    stage = kw["stage"]
    return dict(kw, gates=kw["gates"].clone(), scores=kw["scores"].clone(),
                stage=None if stage is None else stage.clone())


def monitored(kw: dict[str, Any]) -> torch.Tensor:
    """bool [G, N]: the gates/scores entries this call may write (slot monitored by the token's row, t < T)."""
    num_tokens, num_g = kw["h"].shape[0], kw["gates"].shape[0]
    written = torch.zeros(kw["gates"].shape, dtype=torch.bool)
    rows = kw["row_index"][:num_tokens].long().cpu()
    for s in range(num_g):
        written[s, :num_tokens] = (kw["mon_mask"].cpu()[rows] >> s) & 1 == 1
    return written.to(kw["gates"].device)


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for kernel-vs-reference outputs; bf16 allows one ulp (the interpreter's cast truncates)."""
    if dtype == torch.float32:
        return 1e-4, 1e-5
    if dtype == torch.float16:
        return 2e-3, 2e-3
    return 1e-2, 1.6e-2


def compare_impls(impl: Any, kw: dict[str, Any], static_impl: Any) -> dict[str, Any]:
    """Run ``impl`` and the reference over two sites sharing gate buffers; metrics for the assertions.

    Args:
        impl: the implementation under test (a Triton launcher).
        kw: inputs from ``make_dyn_inputs`` (not modified).
        static_impl: the matching ``steer_site`` implementation, for the static-row bit-identity check.

    Returns:
        JSON-serialisable metrics.
    """
    dtype = kw["h"].dtype
    num_tokens = kw["h"].shape[0]
    atol, rtol = _tolerances(dtype)
    rows = kw["row_index"][:num_tokens].long()
    static = torch.isin(rows, torch.tensor(STATIC_ROWS, device=rows.device))
    got_kw, want_kw = clone_buffers(kw), clone_buffers(kw)
    metrics: dict[str, Any] = {"out_excess": -1.0, "gate_err": 0.0, "score_err": 0.0, "stage_excess": -1.0}
    for step in range(2):
        if step:
            got_kw, want_kw = later_site(got_kw, 99), later_site(want_kw, 99)
        before = got_kw["gates"].clone(), got_kw["scores"].clone()
        got, want = impl(**site_args(got_kw)), steer_site_dyn_reference(**site_args(want_kw))
        untouched = ~monitored(got_kw)
        diff = (got.float() - want.float()).abs()
        if num_tokens:
            excess = (diff - (atol + rtol * want.float().abs())).max().item()
            metrics["out_excess"] = max(metrics["out_excess"], excess)
        metrics["gate_err"] = max(metrics["gate_err"], (got_kw["gates"] - want_kw["gates"]).abs().max().item())
        score_err = (got_kw["scores"] - want_kw["scores"]).abs() / (1 + want_kw["scores"].abs())
        metrics["score_err"] = max(metrics["score_err"], score_err.max().item())
        metrics[f"shape_ok{step}"] = got.shape == kw["h"].shape and got.dtype == dtype
        metrics[f"finite{step}"] = bool(torch.isfinite(got).all())
        metrics[f"untouched_exact{step}"] = bool(
            torch.equal(got_kw["gates"][untouched], before[0][untouched])
            and torch.equal(got_kw["scores"][untouched], before[1][untouched]))
        static_out = static_impl(**site_args({name: got_kw[name] for name in STATIC_ARGS}))
        metrics[f"static_exact{step}"] = torch.equal(got[static], static_out[static])
        static_stage = stage_buffer(got_kw["h"])
        static_impl(**site_args({name: got_kw[name] for name in STATIC_ARGS}
                                | dict(stage=static_stage, stage_slot=got_kw["stage_slot"])))
        metrics[f"static_stage_exact{step}"] = torch.equal(static_stage, want_kw["stage"])
        # Capture: the unsteered residual of the tokens given a slot, compacted into the first rows; the rest
        # untouched.
        got_stage, want_stage = got_kw["stage"], want_kw["stage"]
        if num_tokens:
            stage_diff = (got_stage[:num_tokens].float() - want_stage[:num_tokens].float()).abs()
            excess = (stage_diff - (atol + rtol * want_stage[:num_tokens].float().abs())).max().item()
            metrics["stage_excess"] = max(metrics["stage_excess"], excess)
        metrics[f"stage_exact{step}"] = torch.equal(got_stage, want_stage)
        metrics[f"stage_tail{step}"] = untargeted_kept(got_stage, got_kw["stage_slot"], num_tokens)
    return metrics


def _assert_case_metrics(res: dict[str, Any]) -> None:
    for step in range(2):
        assert res[f"shape_ok{step}"] and res[f"finite{step}"], res
        assert res[f"untouched_exact{step}"], res
        assert res[f"static_exact{step}"], res
        assert res[f"stage_tail{step}"], res
    assert res["out_excess"] <= 0.0 and res["stage_excess"] <= 0.0, res
    assert res["gate_err"] < 1e-5, res
    assert res["score_err"] < 1e-4, res


# ---------------------------------------------------------------------------------------------
# (a) Triton kernel vs reference, in a TRITON_INTERPRET=1 subprocess
# ---------------------------------------------------------------------------------------------


def _interp_worker() -> int:
    """Subprocess body: run the Triton kernel (interpreted) on every case; print JSON metrics."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from dynsteer.kernels.triton_steer import steer_site_dyn_triton, steer_site_triton

    results: dict[str, Any] = {}
    for seed, case in enumerate(TRITON_CASES):
        num_tokens, hidden, num_k, num_g, has_r, dt = case
        kw = make_dyn_inputs(num_tokens, hidden, num_k, num_g, has_r, DTYPES[dt], seed=seed)
        results[_case_id(case)] = compare_impls(steer_site_dyn_triton, kw, steer_site_triton)

    # Through the custom op with the kernel forced: gates are written by the Triton path.
    os.environ[ENV_KERNEL] = "triton"
    kw = make_dyn_inputs(8, 64, 2, 2, True, torch.float32, seed=123)
    got_kw, want_kw = clone_buffers(kw), clone_buffers(kw)
    out = steer_site_dyn(**site_args(got_kw))
    results["op_forced_triton"] = {
        "impl": select_impl(kw["h"], dynamic=True).__name__,
        "out_err": (out - steer_site_dyn_reference(**site_args(want_kw))).abs().max().item(),
        "gate_err": (got_kw["gates"] - want_kw["gates"]).abs().max().item(),
    }
    # Strided everything: h / r column slices, gate buffers transposed (token stride G), table views of wider
    # tensors; exercises every stride argument.
    kw = make_dyn_inputs(9, 64, 2, 3, True, torch.float32, seed=7)
    strided = dict(kw)
    for name in ("h", "r"):
        wide = torch.randn(9, 100)
        wide[:, :64] = kw[name]
        strided[name] = wide[:, :64]
    for name in ("gate_mul", "gate_add", "gates", "scores"):
        strided[name] = kw[name].t().contiguous().t()
    for name in ("clamp_lo", "clamp_hi", "clamp_strength", "clamp_gate", "mon_sharp", "mon_thresh", "mon_floor"):
        strided[name] = kw[name].t().contiguous().t()
    for name in ("mon_mask", "dyn_mask", "row_live"):
        strided[name] = torch.stack([kw[name], kw[name]], dim=1)[:, 1]
    want_kw = clone_buffers(kw)
    out = steer_site_dyn_triton(**site_args(strided))
    want = steer_site_dyn_reference(**site_args(want_kw))
    results["strided"] = {
        "out_err": (out - want).abs().max().item(),
        "gate_err": (strided["gates"] - want_kw["gates"]).abs().max().item(),
        "score_err": (strided["scores"] - want_kw["scores"]).abs().max().item(),
    }
    results["site_live"] = site_live_metrics(steer_site_dyn_triton)
    print("RESULTS " + json.dumps(results))
    return 0


LIVE_ELSEWHERE = (3, 4, 5)  # rows with dyn terms / monitors / gated clamps at site A, nothing at site B


def site_live_metrics(impl: Any, device: str = "cpu") -> dict[str, Any]:
    """Rows live at site A and holding nothing at site B (``row_live`` 0 there): at B the kernel copies their tokens
    bit for bit and leaves their gates / scores alone; the other rows compute what the reference does."""
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v
          for k, v in make_dyn_inputs(33, 576, 2, 2, True, torch.float32, seed=60).items()}
    site_b = dict(kw)
    for name in ("vec", "clamp_strength", "mon_mask", "dyn_mask"):
        site_b[name] = kw[name].clone()
        site_b[name][list(LIVE_ELSEWHERE)] = 0
    site_b["row_live"] = row_live(site_b["vec"], site_b["clamp_strength"], site_b["mon_mask"], site_b["dyn_mask"])
    rows = kw["row_index"][:33].long()
    idle = torch.isin(rows, torch.tensor(LIVE_ELSEWHERE, device=device))
    got_a_kw, got_kw, want_kw = clone_buffers(kw), clone_buffers(site_b), clone_buffers(site_b)
    got_a, got = impl(**site_args(got_a_kw)), impl(**site_args(got_kw))
    want = steer_site_dyn_reference(**site_args(want_kw))
    written = monitored(site_b)
    # the site's summary (row 0's row_live) 0: every token copied, no monitor run, whatever the rows hold
    skip_kw = clone_buffers(dict(kw, row_live=kw["row_live"].clone()))
    skip_kw["row_live"][0] = 0
    skipped = impl(**site_args(skip_kw))
    return {
        "summary_zero_skips": torch.equal(skipped, kw["h"]) and torch.equal(skip_kw["gates"], kw["gates"])
        and torch.equal(skip_kw["scores"], kw["scores"]),
        "flags": [site_b["row_live"][list(LIVE_ELSEWHERE)].tolist(), kw["row_live"][list(LIVE_ELSEWHERE)].tolist()],
        "idle_tokens": int(idle.sum()),
        "idle_exact_at_b": torch.equal(got[idle], kw["h"][idle]),
        "steered_at_a": bool((got_a[idle] != kw["h"][idle]).any(dim=-1).all()),
        "buffers_untouched": torch.equal(got_kw["gates"][~written], kw["gates"][~written])
        and torch.equal(got_kw["scores"][~written], kw["scores"][~written]),
        "out_err": (got - want).abs().max().item(),
        "gate_err": (got_kw["gates"] - want_kw["gates"]).abs().max().item(),
    }


def assert_site_live(res: dict[str, Any]) -> None:
    assert res["flags"][0] == [0, 0, 0] and 0 not in res["flags"][1] and res["idle_tokens"] > 0, res
    assert res["idle_exact_at_b"] and res["steered_at_a"] and res["buffers_untouched"], res
    assert res["out_err"] < 1e-4 and res["gate_err"] < 1e-6, res
    assert res["summary_zero_skips"], res


@pytest.fixture(scope="module")
def interp_results() -> dict[str, Any]:
    return run_interpreted(__file__, timeout=300)


@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_triton_matches_reference(interp_results: dict[str, Any], case: Case) -> None:
    _assert_case_metrics(interp_results[_case_id(case)])


def test_triton_via_forced_op(interp_results: dict[str, Any]) -> None:
    res = interp_results["op_forced_triton"]
    assert res["impl"] == "steer_site_dyn_triton"
    assert res["out_err"] < 1e-4 and res["gate_err"] < 1e-6, res


def test_triton_strided(interp_results: dict[str, Any]) -> None:
    res = interp_results["strided"]
    assert res["out_err"] < 1e-4 and res["gate_err"] < 1e-6 and res["score_err"] < 1e-5, res


def test_triton_row_live_elsewhere_is_identity(interp_results: dict[str, Any]) -> None:
    assert_site_live(interp_results["site_live"])


# ---------------------------------------------------------------------------------------------
# (b) compiled Triton on a GPU (skipped without CUDA)
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _to_cuda(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_cuda_triton_matches_reference(case: Case) -> None:
    from dynsteer.kernels.reference import stash_residual
    from dynsteer.kernels.triton_steer import stash_triton, steer_site_dyn_triton, steer_site_triton

    num_tokens, hidden, num_k, num_g, has_r, dt = case
    kw = _to_cuda(make_dyn_inputs(num_tokens, hidden, num_k, num_g, has_r, DTYPES[dt], seed=TRITON_CASES.index(case)))
    res = compare_impls(steer_site_dyn_triton, kw, steer_site_triton)
    _assert_case_metrics(res)
    # One fp32 add, one rounding: exact on a GPU, for the dynamic and the static kernel.
    assert res["stage_exact0"] and res["stage_exact1"], res
    assert res["static_stage_exact0"] and res["static_stage_exact1"], res
    # The inline mode's capture kernel, and an idle step (every slot -1: nothing stored).
    alone, want = stage_buffer(kw["h"]), stage_buffer(kw["h"])
    stash_triton(kw["h"], kw["r"], alone, kw["stage_slot"])
    stash_residual(kw["h"], kw["r"], want, kw["stage_slot"])
    assert torch.equal(alone, want)
    idle = stage_buffer(kw["h"])
    steer_site_dyn_triton(**site_args(dict(clone_buffers(kw), stage=idle,
                                           stage_slot=torch.full_like(kw["stage_slot"], -1))))
    assert bool((idle == STAGE_SENTINEL).all())


@pytest.mark.gpu
@needs_cuda
def test_cuda_row_live_elsewhere_is_identity() -> None:
    from dynsteer.kernels.triton_steer import steer_site_dyn_triton

    assert_site_live(site_live_metrics(steer_site_dyn_triton, "cuda"))


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured once, replayed over new inputs written in place: gates and outputs follow the new inputs."""
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    kw = _to_cuda(make_dyn_inputs(16, 576, 2, 2, True, torch.bfloat16, seed=31))
    later = dict(later_site(kw, 0), h=kw["h"], stage=stage_buffer(kw["h"]))  # no monitors, its own capture place

    def forward() -> torch.Tensor:  # two sites sharing the gate buffers, as in a forward
        return steer_site_dyn(**site_args(dict(later, h=steer_site_dyn(**site_args(kw)))))

    forward()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        kw["h"].copy_(torch.randn(kw["h"].shape, generator=gen).to(kw["h"].dtype))
        kw["gate_add"].copy_(torch.rand(kw["gate_add"].shape, generator=gen))
        want_kw = clone_buffers(kw)
        want = steer_site_dyn_reference(**site_args(dict(later, h=steer_site_dyn_reference(**site_args(want_kw)),
                                                         gates=want_kw["gates"], scores=want_kw["scores"])))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(kw["gates"], want_kw["gates"], atol=1e-5, rtol=0)
        # Both places' capture buffers hold this replay's unsteered residuals of the tokens with a slot (the second
        # reads the first's output); then the slots change in place and the next replay follows them.
        slot = kw["stage_slot"]
        assert torch.equal(kw["stage"], expected_stage(stage_buffer(kw["h"]), kw["h"], kw["r"], slot))
        mid = steer_site_dyn(**site_args(dict(clone_buffers(kw), stage=stage_buffer(kw["h"]))))
        assert torch.equal(later["stage"], expected_stage(stage_buffer(kw["h"]), mid, kw["r"], slot))
        for buf in (kw["stage"], later["stage"]):
            buf.fill_(STAGE_SENTINEL)
        slot.copy_(capture_slots(16, slot.shape[0], gen).to(slot.device))


# ---------------------------------------------------------------------------------------------
# (c) reference semantics
# ---------------------------------------------------------------------------------------------


def loop_oracle(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract as a per-token float64 loop; returns (out, gates, scores) without touching kw."""
    h, r = kw["h"].double(), kw["r"].double() if kw["r"] is not None else None
    gates, scores = kw["gates"].double().clone(), kw["scores"].double().clone()
    out = torch.empty_like(h)
    for t in range(h.shape[0]):
        i = int(kw["row_index"][t])
        res = h[t] + r[t] if r is not None else h[t]
        for s in range(gates.shape[0]):
            if int(kw["mon_mask"][i]) >> s & 1:
                score = float(res @ kw["mon_probe"][i, s].double())
                g = 1.0 / (1.0 + torch.exp(torch.tensor(-float(kw["mon_sharp"][i, s]) * (score - float(
                    kw["mon_thresh"][i, s]))))).item()
                g = g if g >= float(kw["mon_floor"][i, s]) else 0.0
                scores[s, t] = score
                gates[s, t] = g * float(kw["gate_mul"][s, t]) + float(kw["gate_add"][s, t])
        x = h[t] + kw["vec"][i].double()
        for s in range(gates.shape[0]):
            if int(kw["dyn_mask"][i]) >> s & 1:
                x = x + gates[s, t] * kw["dyn_vec"][i, s].double()
        for k in range(kw["clamp_dir"].shape[1]):
            slot = int(kw["clamp_gate"][i, k])
            gs = float(kw["clamp_strength"][i, k]) * (1.0 if slot < 0 else float(gates[slot, t]))
            if gs != 0:
                u = kw["clamp_dir"][i, k].double()
                p = float((x + r[t] if r is not None else x) @ u)
                c = min(max(p, float(kw["clamp_lo"][i, k])), float(kw["clamp_hi"][i, k]))
                x = x + gs * (c - p) * u
        out[t] = x
    return out, gates, scores


@pytest.mark.parametrize(("num_k", "num_g", "has_r"), [(2, 1, True), (2, 3, False), (1, 2, True), (0, 2, True)])
def test_reference_matches_loop_oracle(num_k: int, num_g: int, has_r: bool) -> None:
    kw = make_dyn_inputs(24, 48, num_k, num_g, has_r, torch.float32, seed=num_k * 10 + num_g)
    for site in range(2):  # the second site reads the gates carried from the first
        if site:
            kw = later_site(kw, seed=5)
        want_out, want_gates, want_scores = loop_oracle(kw)
        out = steer_site_dyn_reference(**site_args(kw))
        torch.testing.assert_close(out.double(), want_out, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(kw["gates"].double(), want_gates, atol=1e-6, rtol=0)
        torch.testing.assert_close(kw["scores"].double(), want_scores, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("has_r", [False, True])
def test_static_rows_equal_steer_site(dtype: torch.dtype, has_r: bool) -> None:
    """Rows without dynamic content (and monitor-only rows) give steer_site's output bit for bit, every shape."""
    for seed, (hidden, num_tokens, num_g, num_k) in enumerate(
            itertools.product((64, 100, 576, 4096), (1, 7, 33), (1, 2, 3), (0, 1, 2))):
        kw = make_dyn_inputs(num_tokens, hidden, num_k, num_g, has_r, dtype, seed=seed)
        rows = torch.tensor(STATIC_ROWS, dtype=torch.int32)
        kw["row_index"][:num_tokens] = rows[torch.arange(num_tokens) % len(rows)]
        out = steer_site_dyn_reference(**site_args(kw))
        static = steer_site_reference(**site_args({name: kw[name] for name in STATIC_ARGS}))
        assert torch.equal(out, static), (hidden, num_k)
        zero = kw["row_index"][:num_tokens] == 0
        assert torch.equal(out[zero], kw["h"][zero])


def monitor_gate(x: torch.Tensor, row_index: torch.Tensor, probe: torch.Tensor, sharpness: torch.Tensor,
                 threshold: torch.Tensor, is_decode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One monitor slot, token by token (float32 ``[T]`` each): ``score = x . probe[row]``, ``gate = sigmoid(sharpness
    * (score - threshold))`` for decode tokens of rows with a monitor (sharpness != 0), else 0."""
    t = x.shape[0]
    rows = row_index[:t].long()
    score = (x.to(torch.float32) * probe.to(torch.float32).index_select(0, rows)).sum(dim=-1)
    s = sharpness.to(torch.float32).index_select(0, rows)
    gate = torch.sigmoid(s * (score - threshold.to(torch.float32).index_select(0, rows)))
    return score, torch.where(is_decode[:t].to(torch.bool) & (s != 0), gate, torch.zeros_like(gate))


@pytest.mark.parametrize("has_r", [False, True])
@pytest.mark.parametrize("num_g", [1, 3])
def test_monitor_matches_monitor_gate(has_r: bool, num_g: int) -> None:
    """gate_mul = 1, gate_add = 0 is the single-slot monitor gate (``monitor_gate``) on decode tokens; (0, 0) is its
    prefill rule."""
    kw = make_dyn_inputs(40, 96, 1, num_g, has_r, torch.float32, seed=17)
    kw["mon_floor"].zero_()
    is_decode = torch.rand(40 + TAIL, generator=torch.Generator().manual_seed(3)) < 0.7
    kw["gate_mul"].copy_(is_decode.float().expand_as(kw["gate_mul"]))
    kw["gate_add"].zero_()
    x = kw["h"] + kw["r"] if has_r else kw["h"]
    steer_site_dyn_reference(**site_args(kw))
    written = monitored(kw)
    for s in range(num_g):
        score, gate = monitor_gate(x, kw["row_index"], kw["mon_probe"][:, s], kw["mon_sharp"][:, s],
                                             kw["mon_thresh"][:, s], is_decode)
        sel = written[s, :40]
        assert sel.any() and (~is_decode[:40] & sel).any() and (is_decode[:40] & sel).any()
        torch.testing.assert_close(kw["scores"][s, :40][sel], score[sel], atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(kw["gates"][s, :40][sel], gate[sel], atol=1e-6, rtol=0)


def test_logistic_probe_identity() -> None:
    """probe = w/|w|, sharpness = |w|, threshold = -b/|w| turns the gate into sigma(w.x + b) (architecture §4)."""
    gen = torch.Generator().manual_seed(21)
    kw = make_dyn_inputs(16, 64, 0, 1, False, torch.float32, seed=21)
    w, b = 0.3 * torch.randn(64, generator=gen), 0.7
    kw["mon_probe"][4, 0], kw["mon_sharp"][4, 0], kw["mon_thresh"][4, 0] = w / w.norm(), w.norm(), -b / w.norm()
    kw["row_index"][:16] = 4
    kw["gate_mul"].fill_(1.0)
    kw["gate_add"].zero_()
    steer_site_dyn_reference(**site_args(kw))
    torch.testing.assert_close(kw["gates"][0, :16], torch.sigmoid(kw["h"] @ w + b), atol=1e-6, rtol=1e-5)


def _one_row(hidden: int = 64, num_k: int = 1, num_g: int = 1, seed: int = 0) -> dict[str, Any]:
    """16 tokens all reading row 4 (monitor + dyn + gated clamps on every slot), decode multipliers."""
    kw = make_dyn_inputs(16, hidden, num_k, num_g, True, torch.float32, seed=seed)
    kw["row_index"][:16] = 4
    kw["gate_mul"].fill_(1.0)
    kw["gate_add"].zero_()
    return kw


def _static_part(kw: dict[str, Any], **overrides: torch.Tensor) -> torch.Tensor:
    return steer_site_reference(**site_args({name: overrides.get(name, kw[name]) for name in STATIC_ARGS}))


def test_floor_zeroes_gate_and_its_terms() -> None:
    kw = _one_row()
    kw["mon_floor"][4, 0] = 2.0  # above any sigmoid: every gate is floored to 0
    kw["gate_add"][0, :4] = 0.3  # ... then gate_add still applies
    out = steer_site_dyn_reference(**site_args(kw))
    assert torch.equal(kw["gates"][0, 4:16], torch.zeros(12))
    assert torch.equal(kw["gates"][0, :4], torch.full((4,), 0.3))
    # Gate 0: the dyn term and the gated clamp are exactly off.
    no_clamp = _static_part(kw, clamp_strength=torch.zeros_like(kw["clamp_strength"]))
    assert torch.equal(out[4:], no_clamp[4:])


def test_floor_keeps_gates_above_it() -> None:
    kw = _one_row(seed=4)
    raw = clone_buffers(kw)
    steer_site_dyn_reference(**site_args(raw))  # floor 0: the raw sigmoid
    floor = float(raw["gates"][0, :16].median())
    kw["mon_floor"][4, 0] = floor
    steer_site_dyn_reference(**site_args(kw))
    keep = raw["gates"][0, :16] >= floor
    assert keep.any() and (~keep).any()
    assert torch.equal(kw["gates"][0, :16], torch.where(keep, raw["gates"][0, :16], 0.0))


def test_gate_mul_and_add() -> None:
    kw = _one_row(num_k=0, seed=2)
    kw["gate_mul"][0, :16] = torch.tensor([0.0, 0.5, 1.0, 2.0]).repeat(4)
    kw["gate_add"][0, :16] = torch.tensor([0.7, 0.0, 0.1, 0.0]).repeat(4)
    raw = clone_buffers(kw)
    raw["gate_mul"], raw["gate_add"] = torch.ones_like(kw["gate_mul"]), torch.zeros_like(kw["gate_add"])
    steer_site_dyn_reference(**site_args(raw))
    out = steer_site_dyn_reference(**site_args(kw))
    g = kw["gates"][0, :16]
    torch.testing.assert_close(g, raw["gates"][0, :16] * kw["gate_mul"][0, :16] + kw["gate_add"][0, :16])
    assert torch.equal(g[::4], torch.full((4,), 0.7))  # mul 0: forced gate
    want = kw["h"] + kw["vec"][4] + g.unsqueeze(-1) * kw["dyn_vec"][4, 0]
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_gated_clamp_scales_strength() -> None:
    """Gate 0 turns the clamp off exactly; gate 1 equals the ungated clamp exactly; gate 0.5 is half strength."""
    kw = _one_row(num_k=1, seed=6)
    kw["dyn_mask"].zero_()
    kw["mon_floor"][4, 0] = 2.0
    for add, strength in ((0.0, 0.0), (1.0, 1.0), (0.5, 0.5)):
        kw["gate_add"].fill_(add)
        out = steer_site_dyn_reference(**site_args(kw))
        cs = kw["clamp_strength"].clone()
        cs[4, 0] = strength
        assert torch.equal(out, _static_part(kw, clamp_strength=cs)), add


def test_gate_computed_here_is_used_here() -> None:
    """A row that monitors and consumes a slot at one site reads this site's gate, not the buffer's old value."""
    kw = _one_row(num_k=0, seed=8)
    kw["gates"].fill_(123.0)
    out = steer_site_dyn_reference(**site_args(kw))
    g = kw["gates"][0, :16]
    assert bool((g < 1.0).all())
    torch.testing.assert_close(out, kw["h"] + kw["vec"][4] + g.unsqueeze(-1) * kw["dyn_vec"][4, 0])


def test_untouched_entries_stay_untouched() -> None:
    kw = make_dyn_inputs(33, 64, 2, 3, True, torch.float32, seed=9)
    before = clone_buffers(kw)
    steer_site_dyn_reference(**site_args(kw))
    written = monitored(kw)
    assert written.any() and (~written).any()
    assert torch.equal(kw["gates"][~written], before["gates"][~written])
    assert torch.equal(kw["scores"][~written], before["scores"][~written])
    assert not torch.equal(kw["gates"][written], before["gates"][written])


def test_gate_carried_across_sites() -> None:
    """Site A only monitors; site B (no monitors) consumes A's gates and leaves the buffers as A wrote them."""
    kw = _one_row(num_k=1, num_g=2, seed=10)
    initial = clone_buffers(kw)
    site_a = dict(kw, dyn_mask=torch.zeros_like(kw["dyn_mask"]), clamp_gate=torch.full_like(kw["clamp_gate"], -1))
    site_b = later_site(kw, seed=11)
    assert torch.equal(steer_site_dyn_reference(**site_args(site_a)), _static_part(site_a))
    after_a = clone_buffers(kw)
    assert not torch.equal(after_a["gates"], initial["gates"])
    want_b, _, _ = loop_oracle(site_b)  # site_b shares kw's buffers, which now hold A's gates
    out_b = steer_site_dyn_reference(**site_args(site_b))
    torch.testing.assert_close(out_b.double(), want_b, atol=1e-5, rtol=1e-5)
    assert torch.equal(kw["gates"], after_a["gates"]) and torch.equal(kw["scores"], after_a["scores"])
    stale = steer_site_dyn_reference(**site_args(dict(site_b, gates=initial["gates"], scores=initial["scores"])))
    assert not torch.allclose(stale, out_b)  # B really depends on what A wrote


# ---------------------------------------------------------------------------------------------
# (d) custom op, dispatch, tracing
# ---------------------------------------------------------------------------------------------


def test_dispatch_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    h = torch.zeros(2, 4)
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    assert select_impl(h, dynamic=True) is steer_site_dyn_reference
    assert select_impl(h) is steer_site_reference
    monkeypatch.setenv(ENV_KERNEL, "reference")
    assert select_impl(h, dynamic=True) is steer_site_dyn_reference
    monkeypatch.setenv(ENV_KERNEL, "bogus")
    with pytest.raises(ValueError):
        select_impl(h, dynamic=True)


@pytest.mark.parametrize("has_r", [False, True])
def test_op_matches_reference_and_mutates(has_r: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    kw = make_dyn_inputs(12, 80, 2, 2, has_r, torch.bfloat16, seed=6)
    want_kw = clone_buffers(kw)
    before = kw["gates"].clone()
    out = torch.ops.dynsteer.steer_site_dyn(*kw.values())
    assert torch.equal(out, steer_site_dyn_reference(**site_args(want_kw)))
    assert torch.equal(kw["gates"], want_kw["gates"]) and torch.equal(kw["scores"], want_kw["scores"])
    assert not torch.equal(kw["gates"], before)


def test_registration_is_idempotent() -> None:
    import dynsteer.kernels.ops as ops

    importlib.reload(ops)
    importlib.reload(ops)
    kw = make_dyn_inputs(4, 32, 1, 1, True, torch.float32, seed=8)
    want_kw = clone_buffers(kw)
    assert torch.equal(ops.steer_site_dyn(**site_args(kw)), steer_site_dyn_reference(**site_args(want_kw)))


def test_opcheck(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    for has_r in (False, True):
        kw = make_dyn_inputs(6, 32, 2, 2, has_r, torch.float32, seed=10)
        torch.library.opcheck(torch.ops.dynsteer.steer_site_dyn.default, tuple(kw.values()))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("has_r", [False, True])
def test_op_traces_under_compile(backend: str, has_r: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sites in one compiled graph share the gate buffers; the mutation is visible after the call."""
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    torch._dynamo.reset()
    kw = make_dyn_inputs(10, 64, 2, 2, has_r, torch.float32, seed=12)
    names = list(kw)

    def two_sites(*args: torch.Tensor | None) -> torch.Tensor:
        a = dict(zip(names, args))
        mid = torch.ops.dynsteer.steer_site_dyn(*(a | {"h": a["h"] * 2.0}).values())
        later = a | {"h": mid, "mon_mask": a["mon_mask"] * 0}
        return torch.ops.dynsteer.steer_site_dyn(*later.values()) + 1.0

    want_kw = clone_buffers(kw)
    want_mid = steer_site_dyn_reference(**site_args(want_kw | {"h": kw["h"] * 2.0}))
    want = steer_site_dyn_reference(**site_args(want_kw | {"h": want_mid, "mon_mask": kw["mon_mask"] * 0})) + 1.0
    compiled = torch.compile(two_sites, backend=backend, fullgraph=True)
    got = compiled(*kw.values())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(kw["gates"], want_kw["gates"], rtol=0, atol=0)
    torch.testing.assert_close(kw["scores"], want_kw["scores"], rtol=0, atol=0)


def test_reference_traces_fullgraph() -> None:
    """The reference compiles with fullgraph=True, its in-place gate writes included (inline forwards trace it;
    their capture is the separate, opaque stash op)."""
    torch._dynamo.reset()
    compiled = torch.compile(steer_site_dyn_reference, backend="aot_eager", fullgraph=True)
    kw = dict(make_dyn_inputs(10, 64, 2, 3, True, torch.bfloat16, seed=13), stage=None, stage_slot=None)
    want_kw = clone_buffers(kw)
    torch.testing.assert_close(compiled(**site_args(kw)), steer_site_dyn_reference(**site_args(want_kw)), rtol=0,
                               atol=0)
    torch.testing.assert_close(kw["gates"], want_kw["gates"], rtol=0, atol=0)
    torch.testing.assert_close(kw["scores"], want_kw["scores"], rtol=0, atol=0)


@pytest.mark.parametrize("has_r", [False, True])
def test_empty_batch(has_r: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    kw = make_dyn_inputs(0, 64, 2, 2, has_r, torch.bfloat16, seed=14)
    before = clone_buffers(kw)
    for out in (steer_site_dyn_reference(**site_args(kw)), steer_site_dyn(**site_args(kw))):
        assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    assert torch.equal(kw["gates"], before["gates"]) and torch.equal(kw["scores"], before["scores"])


if __name__ == "__main__":
    sys.exit(_interp_worker())
