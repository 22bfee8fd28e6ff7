"""The row pool keeps released configurations until their rows are needed (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from dynsteer.request.payload import encode_payload
from dynsteer.request.compile_spec import compile_phase
from dynsteer.spec import AddVector, ModelShape, SteeringSpec
from dynsteer.steering.rows import RowPool, RowsExhausted
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.tables import SteeringTables

H = 16
SHAPE = ModelShape(num_layers=4, hidden_size=H, sites=("post_block",))


def _content(seed: int):
    v = np.random.default_rng(seed).standard_normal(H).astype(np.float32)
    return compile_phase([("", SteeringSpec(vectors=[AddVector(layer=1, vector=v)]))], "decode", SHAPE)


def test_released_rows_are_revived_and_reused_least_recent_first():
    pool = RowPool(4)  # rows 1..3
    a, b, c, d = (_content(i) for i in range(4))
    ra, new = pool.acquire(a)
    assert new and pool.in_use == 1
    pool.release(a.digest)
    assert pool.in_use == 0 and pool.idle == 1
    assert pool.acquire(a) == (ra, False) and pool.revived == 1 and pool.written == 1  # content kept: no write
    rb, _ = pool.acquire(b)
    rc, _ = pool.acquire(c)
    pool.release(b.digest)  # idle: b, then a
    pool.release(a.digest)
    rd, new = pool.acquire(d)  # no never-used row left: b's (released first) is reused
    assert new and rd == rb
    assert pool.acquire(b) == (ra, True)  # b's content is gone: it takes a's idle row, written anew
    assert pool.written == 5 and pool.revived == 1
    with pytest.raises(RowsExhausted):
        pool.acquire(a)  # every row live (b, c, d)
    assert pool.in_use == 3 and pool.idle == 0 and rc not in (ra, rb)


def test_a_revived_row_steers_as_written_without_a_table_write(monkeypatch):
    tables = SteeringTables([(l, "post_block") for l in range(4)], H, num_rows=4, max_clamps=1, max_tokens=8)
    rt = SteeringRuntime(SHAPE, tables)
    writes = []
    real = tables.write_row
    monkeypatch.setattr(tables, "write_row", lambda row, content: (writes.append(row), real(row, content)))
    v = np.random.default_rng(5).standard_normal(H).astype(np.float32)
    payload = encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=v, tier="decode")]))
    rt.admit("r1", payload, prompt_len=3)
    row = rt.requests["r1"].rows[1]
    rt.release(["r1"])
    rt.admit("r2", payload, prompt_len=3)  # the same configuration again: its idle row, not rewritten
    assert rt.requests["r2"].rows[1] == row and writes == [row]
    np.testing.assert_array_equal(tables.vec_at((1, "post_block"), row).numpy(), v)
    assert rt.describe()["rows_revived"] == 1 and rt.describe()["rows_in_use"] == 1
    assert rt.describe()["rows_written"] == 1


def test_a_catalogue_one_larger_than_the_rows_rewrites_every_row_each_pass():
    # LRU eviction under a cyclic catalogue: each configuration evicts the one needed next. This is what a
    # benchmark mixing modes in one engine measured as per-request overhead before its rows were sized to the
    # catalogue; rows_written is how an operator sees it.
    pool = RowPool(4)  # 3 rows
    contents = [_content(i) for i in range(4)]
    for _ in range(3):
        for c in contents:
            pool.acquire(c)
            pool.release(c.digest)
    assert pool.written == 12 and pool.revived == 0
    pool = RowPool(5)  # rows for the whole catalogue: written once
    for _ in range(3):
        for c in contents:
            pool.acquire(c)
            pool.release(c.digest)
    assert pool.written == 4 and pool.revived == 8


def test_an_unregistered_vector_is_never_served_from_the_compile_memo():
    tables = SteeringTables([(l, "post_block") for l in range(4)], H, num_rows=4, max_clamps=1, max_tokens=8)
    rt = SteeringRuntime(SHAPE, tables)
    v = np.random.default_rng(6).standard_normal(H).astype(np.float32)
    rt.register_vector("joy", v)
    payload = encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector="joy", tier="decode")]))
    rt.admit("r1", payload, prompt_len=3)
    assert rt.requests["r1"].error is None
    np.testing.assert_array_equal(tables.vec_at((1, "post_block"), rt.requests["r1"].rows[1]).numpy(), v)
    rt.release(["r1"])
    rt.unregister_vector("joy")
    assert "joy" not in rt.describe()["named_vectors"]
    entry = rt.admit("r2", payload, prompt_len=3)  # the same payload: its compiled rows were memoised
    assert entry.error is not None and "joy" in str(entry.error) and entry.rows == (0, 0)
    rt.register_vector("joy", -v)  # registered again with other values: the new ones steer
    entry = rt.admit("r3", payload, prompt_len=3)
    assert entry.error is None
    np.testing.assert_array_equal(tables.vec_at((1, "post_block"), entry.rows[1]).numpy(), -v)
