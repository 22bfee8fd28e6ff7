"""Steering tables: a row write touches only the sites its old and new contents use, and after any sequence of
writes every row holds exactly its last content (independent reference: per site and field, like a fresh write)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynsteer.request.programs import Clamp, MonitorProgram, RowContent, SiteProgram
from dynsteer.steering.tables import SteeringTables

H, K, G, ROWS = 6, 2, 2, 4
SITES = [(layer, site) for layer in range(3) for site in ("pre_attn", "post_block")]


def _arr(draw, shape) -> np.ndarray:
    seed = draw(st.integers(0, 2**31 - 1))
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@st.composite
def programs(draw) -> SiteProgram:
    vec = _arr(draw, H) if draw(st.booleans()) else None
    clamps = [Clamp(_arr(draw, H), float(draw(st.floats(-3, 0))), float(draw(st.floats(0, 3))),
                    float(draw(st.floats(0, 1))), draw(st.integers(-1, G - 1)))
              for _ in range(draw(st.integers(0, K)))]
    slots = draw(st.sets(st.integers(0, G - 1)))
    monitors = {s: MonitorProgram(_arr(draw, H), 2.0 + s, 0.5 * s, 0.1) for s in slots}
    dyn = {s: _arr(draw, H) for s in draw(st.sets(st.integers(0, G - 1)))}
    return SiteProgram(vec=vec, clamps=clamps, monitors=monitors, dyn=dyn)


@st.composite
def contents(draw) -> RowContent:
    keys = draw(st.lists(st.sampled_from(SITES), unique=True, max_size=len(SITES)))
    sites = {k: draw(programs()) for k in keys}
    return RowContent(sites=sites, digest=bytes([draw(st.integers(1, 255))]) if sites else b"")


def expected_field(prog: SiteProgram | None, name: str) -> np.ndarray:
    """What one (row, site) field must hold for ``prog`` (None: the site is untouched)."""
    p = prog or SiteProgram()
    if name == "row_live":
        clamped = any(np.float32(c.strength) != 0 for c in p.clamps)  # as stored: float32
        return np.array((p.vec is not None and bool(np.any(p.vec != 0))) | (clamped << 1) | (bool(p.monitors) << 2)
                        | (bool(p.dyn) << 3))
    if name == "vec":
        return p.vec if p.vec is not None else np.zeros(H, np.float32)
    per_clamp = {"clamp_dir": (np.zeros((K, H)), lambda c: c.direction), "clamp_lo": (np.full(K, -np.inf), lambda c: c.lo),
                 "clamp_hi": (np.full(K, np.inf), lambda c: c.hi),
                 "clamp_strength": (np.zeros(K), lambda c: c.strength), "clamp_gate": (np.full(K, -1), lambda c: c.gate)}
    if name in per_clamp:
        out, get = per_clamp[name]
        out = out.copy()
        for k, c in enumerate(p.clamps):
            out[k] = get(c)
        return out
    if name in ("mon_mask", "dyn_mask"):
        slots = p.monitors if name == "mon_mask" else p.dyn
        return np.array(sum(1 << s for s in slots))
    out = np.zeros((G, H) if name in ("mon_probe", "dyn_vec") else G)
    for s, m in p.monitors.items():
        if name != "dyn_vec":
            out[s] = {"mon_probe": m.probe, "mon_sharp": m.sharpness, "mon_thresh": m.threshold,
                      "mon_floor": m.floor}[name]
    for s, v in p.dyn.items():
        if name == "dyn_vec":
            out[s] = v
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, ROWS - 1), contents()), min_size=1, max_size=8))
def test_every_row_holds_exactly_its_last_content(writes):
    tables = SteeringTables(SITES, H, ROWS, K, max_tokens=8, max_gates=G)
    last: dict[int, RowContent] = {}
    for row, content in writes:
        tables.write_row(row, content)
        last[row] = content
    for row in range(ROWS):
        content = last.get(row)
        for key in SITES:
            prog = content.sites.get(key) if content is not None else None
            for name, tensor in tables.views(*key).items():
                if row == 0 and name == "row_live":
                    continue  # the site's summary, checked below
                got = tensor[row].cpu().numpy()
                np.testing.assert_array_equal(got, expected_field(prog, name).astype(got.dtype),
                                              err_msg=f"{row} {key} {name}")
    for key in SITES:  # row 0's flags: a superset of every row's (ORed in as rows are written), then exact
        live = tables.views(*key)["row_live"].cpu().numpy()
        union = int(np.bitwise_or.reduce(live[1:]))
        assert int(live[0]) & union == union and tables.summaries()[key] == int(live[0])
    rows = sorted(last)
    tables.summarize(np.array([0, *rows[:1]]))
    for key in SITES:
        live = tables.views(*key)["row_live"].cpu().numpy()
        assert int(live[0]) == (int(live[rows[0]]) if rows else 0) == tables.summaries()[key]


def test_a_row_write_uploads_only_the_sites_and_fields_in_use(monkeypatch):
    tables = SteeringTables(SITES, H, ROWS, K, max_tokens=8, max_gates=G)
    uploaded: list[int] = []
    real = tables._upload
    monkeypatch.setattr(tables, "_upload", lambda d, s, t: (uploaded.append(len(d)), real(d, s, t)))
    one = RowContent(sites={SITES[0]: SiteProgram(vec=np.ones(H, np.float32))}, digest=b"a")
    other = RowContent(sites={SITES[3]: SiteProgram(vec=np.ones(H, np.float32))}, digest=b"b")
    tables.write_row(1, one)
    # a plain vector: its own field (float32) and its site's row_live (int32), and that site's summary (row 0's
    # row_live), which gains the row's flag
    assert uploaded == [1, 2]
    uploaded.clear()
    tables.write_row(1, other)  # the old site's vector is reset, the new one written (its summary gains it)
    assert uploaded == [2, 3]
    assert torch.count_nonzero(tables.vec_at(SITES[0], 1)) == 0
    assert torch.equal(tables.vec_at(SITES[3], 1), torch.ones(H))
    # a clamp at the vector's site: the clamp group (4 float32 + clamp_gate int32), the vector (reset there), row_live
    clamp = Clamp(np.eye(H, dtype=np.float32)[0], -1.0, 1.0, 1.0)
    uploaded.clear()
    tables.write_row(1, RowContent(sites={SITES[3]: SiteProgram(clamps=[clamp])}, digest=b"c"))
    assert sorted(uploaded) == [3, 5]  # int32: clamp_gate, row_live and the summary (now flags 1 | 2)
    assert torch.count_nonzero(tables.vec_at(SITES[3], 1)) == 0
    assert tables.views(*SITES[3])["clamp_strength"][1, 0] == 1.0
    # back to nothing: every group it held returns to the defaults
    tables.write_row(1, RowContent(sites={}, digest=b"d"))
    v = tables.views(*SITES[3])
    assert v["clamp_strength"][1].abs().sum() == 0 and torch.all(v["clamp_gate"][1] == -1)
    assert torch.all(v["clamp_lo"][1] == -float("inf")) and torch.count_nonzero(v["clamp_dir"][1]) == 0


def _live(tables: SteeringTables, row: int) -> list[int]:
    return [int(tables.views(*key)["row_live"][row]) for key in SITES]


def test_row_live_follows_each_write():
    """``row_live`` holds, per site, what the row has there (1 vector, 2 clamp strength, 4 monitors, 8 dyn terms),
    and returns to 0 at a site the row no longer touches; other rows stay 0, row 0's entry (the site's summary)
    gathers every flag written there."""
    tables = SteeringTables(SITES, H, ROWS, K, max_tokens=8, max_gates=G)
    a, b = SITES[1], SITES[4]
    ia, ib = SITES.index(a), SITES.index(b)
    ones = np.ones(H, np.float32)
    clamp = Clamp(np.eye(H, dtype=np.float32)[0], -1.0, 1.0, 0.5, gate=1)
    monitor = MonitorProgram(ones / np.sqrt(H), 2.0, 0.0, 0.0)
    tables.write_row(2, RowContent(sites={a: SiteProgram(vec=ones, clamps=[clamp])}, digest=b"a"))
    assert _live(tables, 2) == [3 if i == ia else 0 for i in range(len(SITES))]
    tables.write_row(2, RowContent(sites={b: SiteProgram(monitors={0: monitor})}, digest=b"b"))  # A only before
    assert _live(tables, 2) == [4 if i == ib else 0 for i in range(len(SITES))]
    cases = [(SiteProgram(vec=ones), 1), (SiteProgram(clamps=[clamp]), 2), (SiteProgram(monitors={1: monitor}), 4),
             (SiteProgram(dyn={0: ones}), 8), (SiteProgram(vec=ones, dyn={1: ones}, monitors={0: monitor}), 13),
             # written but a no-op: a zero vector, a zero-strength clamp
             (SiteProgram(vec=np.zeros(H, np.float32), clamps=[Clamp(ones, 0.0, 0.0, 0.0)]), 0)]
    for n, (prog, flags) in enumerate(cases):
        tables.write_row(2, RowContent(sites={a: prog}, digest=bytes([n + 10])))
        assert _live(tables, 2) == [flags if i == ia else 0 for i in range(len(SITES))], n
    assert _live(tables, 1) == _live(tables, 3) == [0] * len(SITES)
    # row 0: each site's summary, every flag written there since (no summarize() yet)
    assert _live(tables, 0) == [15 if i == ia else 4 if i == ib else 0 for i in range(len(SITES))]
    # static tables (no dynamic tier): vector and clamp flags only
    static = SteeringTables(SITES, H, ROWS, K, max_tokens=8)
    static.write_row(1, RowContent(sites={a: SiteProgram(vec=ones, clamps=[Clamp(ones, 0.0, 0.0, 1.0)])}, digest=b"s"))
    assert _live(static, 1) == [3 if i == ia else 0 for i in range(len(SITES))]


def test_summaries_follow_the_batch_rows():
    tables = SteeringTables(SITES, H, ROWS, K, max_tokens=8, max_gates=G)
    a, b = SITES[0], SITES[3]
    tables.write_row(1, RowContent(sites={a: SiteProgram(vec=np.ones(H, np.float32))}, digest=b"a"))
    clamp = Clamp(np.eye(H, dtype=np.float32)[0], -1.0, 1.0, 1.0)
    tables.write_row(2, RowContent(sites={b: SiteProgram(clamps=[clamp])}, digest=b"b"))
    assert tables.summaries()[a] == 1 and tables.summaries()[b] == 2  # ORed in as written
    tables.summarize(np.array([0, 2]))  # a batch reading rows 0 and 2 only
    assert tables.summaries() == {key: (2 if key == b else 0) for key in SITES}
    assert tables.views(*a)["row_live"][0].item() == 0 and tables.views(*b)["row_live"][0].item() == 2
    tables.summarize(np.array([], np.int64))
    assert not any(tables.summaries().values())
    tables.summarize(np.array([1, 2]))
    assert tables.views(*a)["row_live"][0].item() == 1 and tables.views(*b)["row_live"][0].item() == 2
    with pytest.raises(ValueError, match="row 0"):
        tables.write_row(0, RowContent(sites={a: SiteProgram(vec=np.ones(H, np.float32))}, digest=b"z"))


@pytest.mark.parametrize("gates", [0, G])
def test_site_tables_are_the_allocated_tensors_in_the_kernels_order(gates: int) -> None:
    """Each site's ``SiteTables`` (built once, what its hook hands the kernels) holds the very tensors ``views`` and
    ``gate_buffers`` expose, shaped and typed as its layout says; a static engine's leaves the dynamic fields unset.
    The static fields are a prefix of the field list (the static op takes that prefix), and the site's own fields
    precede the shared gate buffers (the fused op's split)."""
    from dynsteer.kernels.site_tables import (DYNAMIC_FIELDS, GATE_FIELDS, LAYOUT, ROW_LIVE, SITE_FIELDS,
                                              STATIC_FIELDS, SiteTables)

    assert DYNAMIC_FIELDS == SiteTables._fields == tuple(LAYOUT)
    assert DYNAMIC_FIELDS[:len(STATIC_FIELDS)] == STATIC_FIELDS and SITE_FIELDS + GATE_FIELDS == DYNAMIC_FIELDS
    assert STATIC_FIELDS == ("vec", "clamp_dir", "clamp_lo", "clamp_hi", "clamp_strength", "row_live")
    assert GATE_FIELDS == ("gate_mul", "gate_add", "gates", "scores") and DYNAMIC_FIELDS[ROW_LIVE] == "row_live"
    tables = SteeringTables(SITES, H, ROWS, K, max_tokens=8, max_gates=gates)
    sizes = dict(R=ROWS, K=K, H=H, G=gates, N=8)
    for key in SITES:
        site = tables.site_tables(*key)
        assert site.dynamic == bool(gates) and site is tables.site_tables(*key)
        own = tables.views(*key)
        assert tuple(own) == (SITE_FIELDS if gates else STATIC_FIELDS)
        for name in DYNAMIC_FIELDS:
            tensor = getattr(site, name)
            if not gates and name not in STATIC_FIELDS:
                assert tensor is None, name
                continue
            assert tensor is (own[name] if name in own else tables.gate_buffers[name]), name
            layout = LAYOUT[name]
            assert tensor.shape == layout.shape(sizes) and tensor.dtype == layout.dtype, name
            assert bool((tensor == layout.fill).all()), name
