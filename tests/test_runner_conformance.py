"""Both runner adapters (v1/CPU and GPU v2) turn the same schedule into the same per-token rows.

v2 orders rows its own way (decodes first) and keeps no SamplingParams map; whatever the order, every token of every
request must read the same table row in both.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dynsteer import AddVector, ModelShape, SteeringSpec
from dynsteer.engine.runner import v1_batch_view, v2_batch_view
from dynsteer.request.payload import encode_payload
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.tables import SteeringTables

H = 8
SHAPE = ModelShape(num_layers=2, hidden_size=H)
# req_id -> (prompt_len, num_computed before this step, tokens scheduled this step, steering tier or None)
SCHEDULE = {
    "prefill-chunk": (40, 16, 16, "prefill"),
    "decode-a": (5, 9, 1, "decode"),
    "last-chunk": (20, 12, 8, "base"),
    "decode-b": (7, 7, 1, None),
    "resumed": (6, 0, 10, "decode"),  # preempted, recomputing prompt + 4 generated tokens
}


def payload(tier):
    if tier is None:
        return None
    v = np.full(H, float(len(tier)), np.float32)
    return encode_payload(SteeringSpec(vectors=[AddVector(layer=1, vector=v, tier=tier)]))


def rows_by_request(rt: SteeringRuntime, order: list[str]) -> dict[str, list[int]]:
    idx = rt.tables.row_index.tolist()
    out, pos = {}, 0
    for req in order:
        n = SCHEDULE[req][2]
        out[req] = idx[pos:pos + n]
        pos += n
    return out


def runtime() -> SteeringRuntime:
    return SteeringRuntime(SHAPE, SteeringTables([(1, "post_block")], H, 16, 1, max_tokens=64))


def test_v1_and_v2_views_give_identical_rows_per_token():
    v1_order = list(SCHEDULE)
    v1 = runtime()
    runner = SimpleNamespace(input_batch=SimpleNamespace(
        num_reqs=len(v1_order), req_ids=v1_order,
        num_computed_tokens_cpu=np.array([SCHEDULE[r][1] for r in v1_order]),
        num_prompt_tokens=np.array([SCHEDULE[r][0] for r in v1_order])))
    sched = np.array([SCHEDULE[r][2] for r in v1_order])
    v1.plan(v1_batch_view(runner, sched), lambda r: payload(SCHEDULE[r][3]))

    v2_order = sorted(SCHEDULE, key=lambda r: (SCHEDULE[r][2] != 1, SCHEDULE[r][2]))  # decodes first
    v2 = runtime()
    qsl = np.concatenate([[0], np.cumsum([SCHEDULE[r][2] for r in v2_order])])
    n = int(qsl[-1])
    batch = SimpleNamespace(num_reqs=len(v2_order), req_ids=v2_order, query_start_loc_np=qsl,
                            num_computed_tokens_np=np.array([SCHEDULE[r][1] for r in v2_order]),
                            num_tokens=n, num_tokens_after_padding=n + 8)
    v2.plan(v2_batch_view(batch, {r: (None, SCHEDULE[r][0]) for r in SCHEDULE}), lambda r: payload(SCHEDULE[r][3]))

    a, b = rows_by_request(v1, v1_order), rows_by_request(v2, v2_order)
    for req in SCHEDULE:
        ta = [v1.tables.vec_at((1, "post_block"), row).tolist() for row in a[req]]
        tb = [v2.tables.vec_at((1, "post_block"), row).tolist() for row in b[req]]
        assert ta == tb, req  # same vector per token (row numbers themselves may differ)
    assert v2.tables.row_index[n:n + 8].tolist() == [0] * 8  # padding reads the zero row
    # phase split inside one chunk: the resumed request's first 6 tokens are prompt, the next 4 generated
    resumed = [v1.tables.vec_at((1, "post_block"), row)[0].item() for row in a["resumed"]]
    assert resumed == [0.0] * 6 + [6.0] * 4
    assert [v1.tables.vec_at((1, "post_block"), row)[0].item() for row in a["prefill-chunk"]] == [7.0] * 16
    assert [v1.tables.vec_at((1, "post_block"), row)[0].item() for row in a["decode-a"]] == [6.0]
    assert a["decode-b"] == [0]
