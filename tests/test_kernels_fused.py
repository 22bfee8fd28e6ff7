"""Tests for ``steer_add_rms_norm`` (steering sites fused into the add + RMS norm that follows them).

The reference is checked against its definition (the separate site ops, then vLLM's own ``fused_add_rms_norm``);
the Triton kernel against the reference on random tables with every row kind, in ONE ``TRITON_INTERPRET=1``
subprocess (this file run as a script), and, with a CUDA device, compiled and under CUDA-graph replay.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dynsteer.kernels import ENV_KERNEL, SiteTables, steer_site_dyn_reference, steer_site_reference
from dynsteer.kernels.fused_reference import add_rms_norm_reference, steer_add_rms_norm_reference
from dynsteer.kernels.ops import steer_add_rms_norm
from tests.conftest import run_interpreted
from tests.test_kernels_dynamic import DTYPES, STAGE_SENTINEL, make_dyn_inputs, stage_buffer

STATIC_FIELDS = ("vec", "clamp_dir", "clamp_lo", "clamp_hi", "clamp_strength", "row_live")
DYN_FIELDS = STATIC_FIELDS + ("clamp_gate", "mon_mask", "mon_probe", "mon_sharp", "mon_thresh", "mon_floor",
                              "dyn_mask", "dyn_vec")
GATE_BUFS = ("gate_mul", "gate_add", "gates", "scores")

# (T, H, K, G (0: static tables), sites "ab" / "a" / "b", dtype, capture, Gemma's norm (1 + w))
Case = tuple[int, int, int, int, str, str, bool, bool]
CASES: list[Case] = [
    (7, 64, 2, 2, "ab", "float32", True, False),
    (7, 64, 0, 1, "a", "float32", False, False),
    (33, 100, 1, 3, "ab", "bfloat16", True, False),
    (33, 100, 2, 0, "ab", "float16", True, False),
    (1, 576, 2, 2, "b", "bfloat16", False, False),
    (9, 576, 2, 0, "a", "float32", True, False),
    (7, 4096, 2, 2, "ab", "bfloat16", True, False),
    (33, 4096, 1, 0, "ab", "bfloat16", False, False),
    (0, 64, 2, 2, "ab", "float32", True, False),
    (9, 100, 2, 2, "ab", "float32", True, True),
    (7, 1152, 1, 0, "ab", "bfloat16", False, True),
]


def _case_id(case: Case) -> str:
    t, hidden, k, g, sites, dt, cap, gemma = case
    return f"T{t}-H{hidden}-K{k}-G{g}-{sites}-{dt}{'-cap' if cap else ''}{'-gemma' if gemma else ''}"


def make_fused_inputs(num_tokens: int, hidden: int, num_k: int, num_g: int, sites: str, dtype: torch.dtype,
                      capture: bool, seed: int = 0, gemma: bool = False) -> dict[str, Any]:
    """Two sites with their own tables (every row kind of ``make_dyn_inputs``), one row index, shared gate buffers;
    ``num_g == 0``: static tables (6 per site, no gate buffers)."""
    a = make_dyn_inputs(num_tokens, hidden, num_k, max(num_g, 1), True, dtype, seed=seed)
    b = make_dyn_inputs(num_tokens, hidden, num_k, max(num_g, 1), True, dtype, seed=seed + 1000)
    if not num_g:  # static tables flag no monitors / dyn terms
        a["row_live"], b["row_live"] = a["row_live"] & 3, b["row_live"] & 3
    fields = DYN_FIELDS if num_g else STATIC_FIELDS
    gen = torch.Generator().manual_seed(seed + 7)
    weight = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    return dict(
        h=a["h"], r=a["r"], weight=weight, eps=1e-5, row_index=a["row_index"],
        tabs_a=[a[f] for f in fields] if "a" in sites else [],
        tabs_b=[b[f] for f in fields] if "b" in sites else [],
        gate_bufs=[a[f] for f in GATE_BUFS] if num_g else [],
        stage_a=stage_buffer(a["h"]) if capture else None, stage_b=stage_buffer(a["h"]) if capture else None,
        stage_slot=a["stage_slot"] if capture else None, unit_offset=gemma)


def clone_state(kw: dict[str, Any]) -> dict[str, Any]:
    out = dict(kw, gate_bufs=[g.clone() for g in kw["gate_bufs"]])
    for name in ("stage_a", "stage_b"):
        out[name] = None if kw[name] is None else kw[name].clone()
    return out


def separate_ops(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: the two sites as the separate ops run them, then vLLM's fused_add_rms_norm."""
    from vllm.ir.ops.layernorm import fused_add_rms_norm

    x = kw["h"]
    for tabs, stage in ((kw["tabs_a"], kw["stage_a"]), (kw["tabs_b"], kw["stage_b"])):
        if tabs:
            fn = steer_site_dyn_reference if len(tabs) == len(DYN_FIELDS) else steer_site_reference
            extra = kw["gate_bufs"] if len(tabs) == len(DYN_FIELDS) else []
            x = fn(x, kw["r"], kw["row_index"], SiteTables(*tabs, *extra), stage, kw["stage_slot"])
    weight = kw["weight"].float() + 1.0 if kw["unit_offset"] else kw["weight"]  # as GemmaRMSNorm calls it
    return fused_add_rms_norm(x, kw["r"], weight, kw["eps"])


def _tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol). float32 cases check the arithmetic tightly. In 16 bits each site's output and the sum are
    rounded (and interpreted casts truncate): up to three ulps of the operands (|h|, |r| up to ~12) apart, which
    cancellation in h + r turns into an absolute error."""
    if dtype == torch.float32:
        return 1e-4, 1e-5
    if dtype == torch.float16:
        return 3e-2, 4e-3
    return 0.2, 2.5e-2


def compare(impl: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """Run ``impl`` and the reference on copies of the state; metrics for the assertions (JSON-serialisable)."""
    got_kw, want_kw = clone_state(kw), clone_state(kw)
    got, want = impl(**got_kw), steer_add_rms_norm_reference(**want_kw)
    dtype = kw["h"].dtype
    atol, rtol = _tolerances(dtype)
    num_tokens = kw["h"].shape[0]
    m: dict[str, Any] = {"shapes": all(g.shape == kw["h"].shape and g.dtype == dtype for g in got)}
    for name, g, w in (("normed", got[0], want[0]), ("resid", got[1], want[1])):
        d = (g.float() - w.float()).abs() - (atol + rtol * w.float().abs())
        m[f"{name}_excess"] = d.max().item() if num_tokens else -1.0
        m[f"{name}_finite"] = bool(torch.isfinite(g).all())
    m["gate_err"] = max([(g - w).abs().max().item() for g, w in zip(got_kw["gate_bufs"], want_kw["gate_bufs"])]
                        or [0.0])
    m["stage_excess"] = -1.0
    for name in ("stage_a", "stage_b"):
        if kw[name] is not None and num_tokens:
            d = (got_kw[name].float() - want_kw[name].float()).abs()
            m["stage_excess"] = max(m["stage_excess"], (d - (atol + rtol * want_kw[name].float().abs())).max().item())
            m[f"{name}_sentinel_kept"] = bool(((got_kw[name] == STAGE_SENTINEL) == (want_kw[name] == STAGE_SENTINEL))
                                              .all())
    # Idle tokens (row 0 at both sites): the residual is h + r rounded once, bit for bit.
    idle = kw["row_index"][:num_tokens] == 0
    plain = (kw["h"].float() + kw["r"].float()).to(dtype)
    m["idle_resid_exact"] = bool(torch.equal(got[1][idle], plain[idle]))
    return m


def _assert_metrics(m: dict[str, Any], dtype: str, rounds_to_nearest: bool) -> None:
    """``rounds_to_nearest``: compiled (the interpreter's casts truncate, so its 16-bit roundings differ by an ulp)."""
    assert m["shapes"] and m["normed_finite"] and m["resid_finite"], m
    assert m["normed_excess"] <= 0 and m["resid_excess"] <= 0 and m["stage_excess"] <= 0, m
    # the second site's monitors read the first site's rounded output: 16-bit rounding moves its scores
    assert m["gate_err"] < (1e-5 if dtype == "float32" else 2e-2), m
    if dtype == "float32" or rounds_to_nearest:
        assert m["idle_resid_exact"], m
    assert all(v for k, v in m.items() if k.endswith("sentinel_kept")), m


# ---- reference semantics -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reference_is_separate_ops_then_vllm_norm(case: Case) -> None:
    """Bit for bit: the reference is the two site ops followed by vLLM 0.26's fused_add_rms_norm."""
    num_tokens, hidden, num_k, num_g, sites, dt, cap, gemma = case
    kw = make_fused_inputs(num_tokens, hidden, num_k, num_g, sites, DTYPES[dt], cap, seed=CASES.index(case),
                           gemma=gemma)
    got_kw, want_kw = clone_state(kw), clone_state(kw)
    got = steer_add_rms_norm_reference(**got_kw)
    want = separate_ops(want_kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for g, w in zip(got_kw["gate_bufs"], want_kw["gate_bufs"]):
        assert torch.equal(g, w)
    for name in ("stage_a", "stage_b"):
        if kw[name] is not None:
            assert torch.equal(got_kw[name], want_kw[name])


def test_norm_reference_is_vllms() -> None:
    from vllm.ir.ops.layernorm import fused_add_rms_norm

    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES.values():
        x, r = (torch.randn(5, 96, generator=gen).to(dtype) for _ in range(2))
        w = torch.randn(96, generator=gen).to(dtype)
        got, want = add_rms_norm_reference(x, r, w, 1e-6), fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        # Gemma's module, whose forward_native passes w.float() + 1 to the same op
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm

        norm = SimpleNamespace(weight=w, variance_epsilon=1e-6)  # what forward_native reads (no vLLM config needed)
        got, want = add_rms_norm_reference(x, r, w, 1e-6, unit_offset=True), GemmaRMSNorm.forward_native(norm, x, r)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_op_validates_and_dispatches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The custom op runs the reference on CPU; the Triton launcher names what is wrong with its inputs."""
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    kw = make_fused_inputs(6, 64, 2, 2, "ab", torch.float32, True, seed=4)
    got_kw, want_kw = clone_state(kw), clone_state(kw)
    got = steer_add_rms_norm(**got_kw)
    want = steer_add_rms_norm_reference(**want_kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got_kw["stage_b"], want_kw["stage_b"])
    pytest.importorskip("triton")
    from dynsteer.kernels.triton_fused import steer_add_rms_norm_triton

    with pytest.raises(ValueError, match="tabs_b must hold 6"):
        steer_add_rms_norm_triton(**dict(kw, tabs_b=kw["tabs_b"][:7]))
    with pytest.raises(ValueError, match="row_live"):
        steer_add_rms_norm_triton(**dict(kw, tabs_b=kw["tabs_b"][:5] + [kw["tabs_b"][5].float()] + kw["tabs_b"][6:]))
    with pytest.raises(ValueError, match="weight"):
        steer_add_rms_norm_triton(**dict(kw, weight=kw["weight"][:10]))
    with pytest.raises(ValueError, match="gate buffers"):
        steer_add_rms_norm_triton(**dict(kw, gate_bufs=kw["gate_bufs"][:2]))


def test_op_under_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Traced and functionalized (AOT autograd), the op still updates the gate buffers and capture stages in place
    and returns what eager returns."""
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    kw = make_fused_inputs(6, 64, 2, 2, "ab", torch.float32, True, seed=8)
    eager_kw, compiled_kw = clone_state(kw), clone_state(kw)
    want = steer_add_rms_norm(**eager_kw)
    torch._dynamo.reset()
    got = torch.compile(steer_add_rms_norm, backend="aot_eager", fullgraph=True)(**compiled_kw)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(compiled_kw["gate_bufs"], eager_kw["gate_bufs"]))
    assert torch.equal(compiled_kw["stage_a"], eager_kw["stage_a"]) and torch.equal(compiled_kw["stage_b"],
                                                                                      eager_kw["stage_b"])
    assert not torch.equal(eager_kw["gate_bufs"][2], kw["gate_bufs"][2])  # the monitors did write gates


def written_tables(num_g: int, device: str = "cpu") -> tuple[Any, list[Any]]:
    """Two sites' tables as ``SteeringTables.write_row`` fills them (``row_live`` included), rows live at one site and
    not the other: 1 a vector at A; 2 a clamp at B; 3 a monitor at A and its gated vector at B (static tables: a
    vector at A, a clamp at B); 4 vectors at both."""
    import numpy as np

    from dynsteer.request.programs import Clamp, MonitorProgram, RowContent, SiteProgram
    from dynsteer.steering.tables import SteeringTables

    hidden, sites = 64, [(0, "post_attn"), (1, "pre_attn")]
    a, b = sites
    rng = np.random.default_rng(num_g)

    def vec() -> np.ndarray:
        return (rng.standard_normal(hidden) * 2).astype(np.float32)

    u = rng.standard_normal(hidden).astype(np.float32)
    clamp = Clamp(u / np.linalg.norm(u), -0.2, 0.2, 1.0)
    tables = SteeringTables(sites, hidden, 5, 2, max_tokens=16, device=device, max_gates=num_g)
    third = ({a: SiteProgram(monitors={0: MonitorProgram(clamp.direction, 3.0, 0.1, 0.0)}),
              b: SiteProgram(dyn={0: vec()})} if num_g else
             {a: SiteProgram(vec=vec()), b: SiteProgram(clamps=[clamp])})
    for row, content in ((1, {a: SiteProgram(vec=vec())}), (2, {b: SiteProgram(clamps=[clamp])}), (3, third),
                         (4, {a: SiteProgram(vec=vec()), b: SiteProgram(vec=vec())})):
        tables.write_row(row, RowContent(sites=content, digest=bytes([row])))
    names = DYN_FIELDS if num_g else STATIC_FIELDS
    return tables, [[tables.views(*key)[n] for n in names] for key in sites]


def written_tables_metrics(impl: Any, num_g: int, device: str = "cpu") -> dict[str, Any]:
    """The fused kernel on ``written_tables``: equal to the reference with both sites; with site B alone, the tokens
    of row 1 (nothing at B) get the same outputs, bit for bit, as with row 0 (unsteered). With the sites' summaries
    narrowed to a batch (``SteeringTables.summarize``): equal to the reference where the batch's rows hold nothing at
    one site; with every summary 0, no token steered at all."""
    import numpy as np

    tables, (tabs_a, tabs_b) = written_tables(num_g, device)
    gen = torch.Generator().manual_seed(num_g)
    h, r = (torch.randn(15, 64, generator=gen).to(device) for _ in range(2))
    tables.row_index[:15] = torch.arange(15, dtype=torch.int32) % 5
    if num_g:
        tables.gate_buffers["gate_mul"].fill_(1.0)
    bufs = list(tables.gate_buffers.values())
    kw = dict(h=h, r=r, weight=torch.ones(64, device=device), eps=1e-5, row_index=tables.row_index, tabs_a=tabs_a,
              tabs_b=tabs_b, gate_bufs=bufs, stage_a=None, stage_b=None, stage_slot=None, unit_offset=False)
    got_kw, want_kw = clone_state(kw), clone_state(kw)
    got, want = impl(**got_kw), steer_add_rms_norm_reference(**want_kw)
    alone = impl(**clone_state(dict(kw, tabs_a=[])))
    unsteered = impl(**clone_state(dict(kw, tabs_a=[], row_index=torch.zeros_like(tables.row_index))))
    rows = tables.row_index[:15].long()
    flags = [[int(t[5][row]) for row in range(5)] for t in (tabs_a, tabs_b)]
    # A batch reading rows 0 and 2 only (nothing at A): summarized, site A is skipped for every token, B is not.
    pair = dict(kw, row_index=tables.row_index.clone())
    pair["row_index"][:15] = torch.tensor([0, 2] * 7 + [0], dtype=torch.int32)
    tables.summarize(np.array([0, 2]))
    summaries = [int(tabs_a[5][0]), int(tabs_b[5][0])]
    pair_got_kw, pair_want_kw = clone_state(pair), clone_state(pair)
    pair_got, pair_want = impl(**pair_got_kw), steer_add_rms_norm_reference(**pair_want_kw)
    # Every summary 0 (as after summarize([])): no token is steered, whatever its row holds.
    tables.summarize(np.array([], np.int64))
    skipped = impl(**clone_state(kw))
    return {
        "summaries": summaries,
        "pair_err": max((g - w).abs().max().item() for g, w in zip(pair_got, pair_want)),
        "pair_steered_at_b": not torch.equal(pair_got[1][1::2], impl(**clone_state(dict(
            pair, row_index=torch.zeros_like(tables.row_index))))[1][1::2]),
        "all_zero_skips": all(torch.equal(x, y) for x, y in zip(skipped, unsteered)),
        "flags": flags,
        "err": max((g - w).abs().max().item() for g, w in zip(got, want)),
        "gate_err": max([(g - w).abs().max().item() for g, w in zip(got_kw["gate_bufs"], want_kw["gate_bufs"])]
                        or [0.0]),
        "idle_exact": all(torch.equal(x[rows <= 1], y[rows <= 1]) for x, y in zip(alone, unsteered)),
        "steered": not torch.equal(got[1][rows == 1], unsteered[1][rows == 1]),
    }


@pytest.mark.parametrize("num_g", [0, 2])
def test_write_row_flags_each_site(num_g: int) -> None:
    """``write_row`` sets each site's flags from what it writes (the kernels' half is checked interpreted)."""
    tables, (tabs_a, tabs_b) = written_tables(num_g)
    want_a = [0, 1, 0, 4 if num_g else 1, 1]
    want_b = [0, 0, 2, 8 if num_g else 2, 1]
    want_a[0], want_b[0] = 5 if num_g else 1, 11 if num_g else 3  # row 0: each site's summary (OR of the rows)
    assert tabs_a[5].tolist() == want_a and tabs_b[5].tolist() == want_b


@pytest.mark.parametrize("num_g", [0, 2])
def test_triton_on_written_tables(interp_results: dict[str, Any], num_g: int) -> None:
    assert_written_tables(interp_results[f"written_tables_G{num_g}"], num_g)


def assert_written_tables(res: dict[str, Any], num_g: int) -> None:
    assert res["flags"][0] == [5 if num_g else 1, 1, 0, 4 if num_g else 1, 1], res
    assert res["err"] < 1e-4 and res["gate_err"] < 1e-6 and res["idle_exact"] and res["steered"], res
    assert res["summaries"] == [0, 2], res  # row 2 holds a clamp at B only
    assert res["pair_err"] < 1e-4 and res["pair_steered_at_b"] and res["all_zero_skips"], res


# ---- idle sites in eager calls: the add-norm alone ----------------------------------------------------------------


def test_op_takes_the_plain_add_norm_only_where_both_sites_are_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op's eager call skips the sites (``site_summary``) only when the host summaries of both are 0 and nothing
    is captured; the result is bit for bit the full reference's. Tables it was not told about always run in full."""
    import numpy as np

    import dynsteer.kernels.fused_reference as fused_reference

    monkeypatch.delenv(ENV_KERNEL, raising=False)
    full_calls = []
    full = fused_reference.steer_add_rms_norm_reference
    monkeypatch.setattr(fused_reference, "steer_add_rms_norm_reference",
                        lambda *a, **k: full_calls.append(1) or full(*a, **k))
    tables, (tabs_a, tabs_b) = written_tables(2)
    gen = torch.Generator().manual_seed(3)
    h, r = torch.randn(15, 64, generator=gen), torch.randn(15, 64, generator=gen)
    tables.row_index[:15] = torch.tensor([0, 2] * 7 + [0], dtype=torch.int32)  # row 2: a clamp at B only
    tables.gate_buffers["gate_mul"].fill_(1.0)
    kw = dict(h=h, r=r, weight=torch.ones(64), eps=1e-5, row_index=tables.row_index, tabs_a=tabs_a, tabs_b=tabs_b,
              gate_bufs=list(tables.gate_buffers.values()))

    def run(**over: Any) -> tuple[bool, bool]:
        """(took the full path, equal bit for bit to the full reference)"""
        args = clone_state(dict(dict(kw, stage_a=None, stage_b=None, stage_slot=None, unit_offset=False), **over))
        before = len(full_calls)
        got = steer_add_rms_norm(**args)
        took_full = len(full_calls) > before
        want = full(**clone_state(args))
        return took_full, all(torch.equal(g, w) for g, w in zip(got, want))

    assert run() == (True, True)  # after write_row: summaries are supersets, nothing idle
    tables.summarize(np.array([0, 2]))  # A holds nothing for these rows, B a clamp
    assert run() == (True, True)
    assert run(tabs_b=[]) == (False, True)  # site A alone: idle
    assert run(tabs_a=[]) == (True, True)
    tables.summarize(np.array([0]))
    tables.row_index[:15] = 0  # the batch reads row 0 only
    assert run() == (False, True)
    assert run(stage_a=stage_buffer(h)) == (True, True)  # captured: the full kernel writes the stage
    other = make_fused_inputs(15, 64, 2, 2, "ab", torch.float32, False, seed=5)
    other["row_index"].zero_()
    other["tabs_a"][5].zero_()
    other["tabs_b"][5].zero_()  # summary 0, but not tables the op was told about
    before = len(full_calls)
    steer_add_rms_norm(**clone_state(other))
    assert len(full_calls) == before + 1


PLAIN_CASES = [(64, "float32", False), (100, "bfloat16", False), (576, "float16", False), (1152, "bfloat16", True),
               (4096, "bfloat16", False)]


def plain_norm_metrics(full: Any, plain: Any, device: str = "cpu") -> dict[str, bool]:
    """The add-norm kernel vs the full kernel at two idle sites (summaries 0, dynamic tables, a row written at A),
    bit for bit, for several widths and dtypes, with Gemma's norm too."""
    import numpy as np

    from dynsteer.request.programs import RowContent, SiteProgram
    from dynsteer.steering.tables import SteeringTables

    out = {}
    for hidden, dt, gemma in PLAIN_CASES:
        dtype = DTYPES[dt]
        sites = [(0, "post_attn"), (1, "pre_attn")]
        tables = SteeringTables(sites, hidden, 3, 2, max_tokens=24, device=device, max_gates=2)
        vec = np.random.default_rng(hidden).standard_normal(hidden).astype(np.float32)
        tables.write_row(1, RowContent(sites={sites[0]: SiteProgram(vec=vec)}, digest=b"1"))
        tables.summarize(np.array([0]))
        names = DYN_FIELDS
        tabs_a, tabs_b = ([tables.views(*key)[n] for n in names] for key in sites)
        gen = torch.Generator().manual_seed(hidden)
        h, r = ((torch.randn(19, hidden, generator=gen) * 4).to(dtype).to(device) for _ in range(2))
        weight = (1.0 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
        got = plain(h, r, weight, 1e-6, gemma)
        want = full(h, r, weight, 1e-6, tables.row_index, tabs_a, tabs_b, list(tables.gate_buffers.values()),
                    None, None, None, gemma)
        out[f"H{hidden}-{dt}{'-gemma' if gemma else ''}"] = all(torch.equal(g, w) for g, w in zip(got, want))
    return out


# ---- Triton (interpreted) vs reference ---------------------------------------------------------------------------


def _interp_worker() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from dynsteer.kernels.triton_fused import add_rms_norm_triton, steer_add_rms_norm_triton

    results = {}
    for seed, case in enumerate(CASES):
        num_tokens, hidden, num_k, num_g, sites, dt, cap, gemma = case
        kw = make_fused_inputs(num_tokens, hidden, num_k, num_g, sites, DTYPES[dt], cap, seed=seed, gemma=gemma)
        results[_case_id(case)] = compare(steer_add_rms_norm_triton, kw)
    for num_g in (0, 2):
        results[f"written_tables_G{num_g}"] = written_tables_metrics(steer_add_rms_norm_triton, num_g)
    results["plain_norm"] = plain_norm_metrics(steer_add_rms_norm_triton, add_rms_norm_triton)
    print("RESULTS " + json.dumps(results))
    return 0


@pytest.fixture(scope="module")
def interp_results() -> dict[str, Any]:
    return run_interpreted(__file__, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_matches_reference(interp_results: dict[str, Any], case: Case) -> None:
    _assert_metrics(interp_results[_case_id(case)], case[5], rounds_to_nearest=False)


def test_triton_plain_norm_equals_the_full_kernel_at_idle_sites(interp_results: dict[str, Any]) -> None:
    res = interp_results["plain_norm"]
    assert len(res) == len(PLAIN_CASES) and all(res.values()), res


# ---- compiled on a GPU ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda(kw: dict[str, Any]) -> dict[str, Any]:
    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.cuda()
        if isinstance(v, list):
            return [t.cuda() for t in v]
        return v
    return {k: move(v) for k, v in kw.items()}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cuda_matches_reference(case: Case) -> None:
    from dynsteer.kernels.triton_fused import steer_add_rms_norm_triton

    num_tokens, hidden, num_k, num_g, sites, dt, cap, gemma = case
    kw = _cuda(make_fused_inputs(num_tokens, hidden, num_k, num_g, sites, DTYPES[dt], cap, seed=CASES.index(case),
                                 gemma=gemma))
    _assert_metrics(compare(steer_add_rms_norm_triton, kw), dt, rounds_to_nearest=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_g", [0, 2])
def test_cuda_on_written_tables(num_g: int) -> None:
    from dynsteer.kernels.triton_fused import steer_add_rms_norm_triton

    assert_written_tables(written_tables_metrics(steer_add_rms_norm_triton, num_g, "cuda"), num_g)


@pytest.mark.gpu
@needs_cuda
def test_cuda_plain_norm_equals_the_full_kernel_at_idle_sites() -> None:
    from dynsteer.kernels.triton_fused import add_rms_norm_triton, steer_add_rms_norm_triton

    res = plain_norm_metrics(steer_add_rms_norm_triton, add_rms_norm_triton, "cuda")
    assert len(res) == len(PLAIN_CASES) and all(res.values()), res


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_holds_the_full_kernel_at_idle_sites(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured while both sites are idle, the graph still holds the full kernel: a row written afterwards steers
    on replay, and eager calls at idle sites give the graph's bits."""
    import numpy as np

    from dynsteer.request.programs import RowContent, SiteProgram

    monkeypatch.delenv(ENV_KERNEL, raising=False)
    tables, (tabs_a, tabs_b) = written_tables(2, "cuda")
    tables.summarize(np.array([0]))
    tables.gate_buffers["gate_mul"].fill_(1.0)
    gen = torch.Generator().manual_seed(9)
    h, r = (torch.randn(8, 64, generator=gen).cuda() for _ in range(2))
    tables.row_index.zero_()
    kw = dict(h=h, r=r, weight=torch.ones(64, device="cuda"), eps=1e-5, row_index=tables.row_index, tabs_a=tabs_a,
              tabs_b=tabs_b, gate_bufs=list(tables.gate_buffers.values()))
    eager = steer_add_rms_norm(**kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = steer_add_rms_norm(**kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    vec = np.full(64, 3.0, np.float32)
    tables.write_row(1, RowContent(sites={tables.sites[0]: SiteProgram(vec=vec)}, digest=b"late"))
    tables.row_index[:8] = 1
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[1], (h + r + 3.0), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured once; replays follow new activations and row indices written in place."""
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    kw = _cuda(make_fused_inputs(16, 576, 2, 2, "ab", torch.bfloat16, True, seed=11))
    steer_add_rms_norm(**kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = steer_add_rms_norm(**kw)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        kw["h"].copy_(torch.randn(kw["h"].shape, generator=gen).to(kw["h"].dtype))
        kw["row_index"][:16].copy_(torch.randint(0, 8, (16,), generator=gen, dtype=torch.int32))
        want_kw = clone_state(kw)
        want = steer_add_rms_norm_reference(**want_kw)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out[0].float(), want[0].float(), atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(out[1].float(), want[1].float(), atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(kw["gate_bufs"][2], want_kw["gate_bufs"][2], atol=1e-5, rtol=0)


TRACED_CASES = [CASES[i] for i in (0, 3, 6, 9)]  # dynamic + capture, static + capture, 4096 wide bf16, Gemma


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", TRACED_CASES, ids=_case_id)
def test_cuda_inductor_launches_the_traced_kernel_itself(monkeypatch: pytest.MonkeyPatch, case: Case) -> None:
    """Under torch.compile (inductor, dynamic shapes) a fused site pair is the traced op, whose kernel launch
    inductor emits in its own code (no call back into the op); outputs, gate buffers and capture stages equal the
    eager op's bit for bit, for two chained norms (the second reads the gates the first wrote)."""
    from torch._inductor.utils import run_and_get_code

    from dynsteer.kernels import ops

    monkeypatch.delenv(ENV_KERNEL, raising=False)
    monkeypatch.delenv(ops.ENV_FUSED_LAUNCH, raising=False)
    num_tokens, hidden, num_k, num_g, sites, dt, cap, gemma = case
    kw = _cuda(make_fused_inputs(num_tokens, hidden, num_k, num_g, sites, DTYPES[dt], cap, seed=40 + hidden,
                                 gemma=gemma))

    def two(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        normed, res = steer_add_rms_norm(**kw)
        return steer_add_rms_norm(**dict(kw, h=normed, r=res))

    eager_kw, compiled_kw = clone_state(kw), clone_state(kw)
    want = two(eager_kw)
    torch._dynamo.reset()
    seen: list[str] = []

    def backend(gm: Any, example: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx

        seen.extend(str(n.target) for n in gm.graph.nodes)
        return compile_fx(gm, example)

    fn = torch.compile(two, backend=backend, dynamic=True, fullgraph=True)
    got, codes = run_and_get_code(fn, compiled_kw)
    torch.cuda.synchronize()
    assert any("steer_add_rms_norm_traced" in t for t in seen), seen
    code = "\n".join(codes)
    assert "_steer_add_rms_norm_kernel" in code and "dynsteer.steer_add_rms_norm" not in code
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(g, w) for g, w in zip(compiled_kw["gate_bufs"], eager_kw["gate_bufs"]))
    for name in ("stage_a", "stage_b"):
        assert (compiled_kw[name] is None) == (eager_kw[name] is None)
        assert compiled_kw[name] is None or torch.equal(compiled_kw[name], eager_kw[name])
    if cap:
        assert not torch.equal(eager_kw["stage_a"], kw["stage_a"])  # the kernel did capture


def test_traced_op_only_while_compiling_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager calls (and CPU tensors, and the forced reference, and DYNSTEER_FUSED_LAUNCH=opaque) keep the opaque op."""
    from dynsteer.kernels import ops

    pytest.importorskip("triton")  # the traced op is registered where Triton is importable
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    cpu = torch.zeros(2, 4)
    assert hasattr(torch.ops.dynsteer, "steer_add_rms_norm_traced")
    assert not ops.use_traced_fused(cpu)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not ops.use_traced_fused(cpu)
    fake_cuda = SimpleNamespace(is_cuda=True)
    assert ops.use_traced_fused(fake_cuda)
    monkeypatch.setenv(ENV_KERNEL, "reference")
    assert not ops.use_traced_fused(fake_cuda)
    monkeypatch.delenv(ENV_KERNEL)
    monkeypatch.setenv(ops.ENV_FUSED_LAUNCH, "opaque")
    assert not ops.use_traced_fused(fake_cuda)


if __name__ == "__main__":
    sys.exit(_interp_worker())
