"""A site hook called eagerly at a site no row of the step touches returns its input without running the op; every
other call runs the op, and both give the reference's values (no engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynsteer.kernels import ops
from dynsteer.kernels.dynamic_reference import steer_site_dyn_reference
from dynsteer.kernels.reference import steer_site_reference
from dynsteer.request.programs import MonitorProgram, RowContent, SiteProgram
from dynsteer.steering.site import SiteHook
from dynsteer.steering.tables import SteeringTables

H, T = 8, 5
SITES = [(layer, site) for layer in range(2) for site in ("pre_attn", "post_block")]


@pytest.mark.parametrize("gates", [0, 2], ids=["static", "dynamic"])
def test_an_idle_site_returns_its_input_and_a_steered_one_runs_the_op(gates, monkeypatch):
    tables = SteeringTables(SITES, H, num_rows=4, max_clamps=1, max_tokens=16, max_gates=gates)
    hooks = {key: SiteHook(tables, *key) for key in SITES}
    rng = np.random.default_rng(0)
    vec = rng.standard_normal(H).astype(np.float32)
    program = SiteProgram(vec=vec, monitors={0: MonitorProgram(rng.standard_normal(H).astype(np.float32), 2.0, 0.1,
                                                                  0.0)} if gates else {})
    tables.write_row(1, RowContent(sites={(1, "post_block"): program}, digest=b"\x01"))
    rows = np.array([0, 1, 0, 1, 0], np.int32)
    tables.row_index[:T] = torch.from_numpy(rows)
    tables.summarize(np.unique(rows))
    calls = []
    for name in ("steer_site", "steer_site_dyn"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _real=real, **k: (calls.append(1), _real(*a, **k))[1])
    for key, hook in hooks.items():  # the ops were bound at construction: rebind to the counting ones
        hook._op = ops.steer_site_dyn if hook.dynamic else ops.steer_site
    h, r = torch.randn(T, H), torch.randn(T, H)
    reference = steer_site_dyn_reference if gates else steer_site_reference
    for key, hook in hooks.items():
        before = [t.clone() for t in hook.site_tables[-2:]] if gates else []
        expected = reference(h.clone(), r, tables.row_index, hook.site_tables)
        if gates:  # the reference wrote gates and scores: put them back for the hook's own call
            for t, b in zip(hook.site_tables[-2:], before):
                t.copy_(b)
        n = len(calls)
        out = hook(h, r)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        if key == (1, "post_block"):
            assert len(calls) == n + 1 and not torch.equal(out, h)  # steered: the op ran
        else:
            assert out is h and len(calls) == n  # idle: no op, the input itself
    tables.summarize(np.array([0], np.int32))  # a step whose tokens all read row 0: every site idle
    assert hooks[(1, "post_block")](h, r) is h
