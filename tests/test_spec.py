"""Schema, payload and row-table logic (no engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynsteer import Ablation, AddVector, ModelShape, ProjectionClamp, SteeringSpec, SteeringValidationError
from dynsteer.config import DynsteerConfig
from dynsteer.request.payload import decode_payload, encode_payload
from dynsteer.request.compile_spec import compile_phase
from dynsteer.spec import check_spec
from dynsteer.steering.runtime import BatchView, SteeringRuntime
from dynsteer.steering.rows import RowPool, RowsExhausted
from dynsteer.steering.tables import SteeringTables
from dynsteer.vectors import load_vector, pack_vector, save_vector, unpack_vector

H = 16
SHAPE = ModelShape(num_layers=4, hidden_size=H)


def vec(seed: int, n: int = H) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_spec_json_and_yaml_round_trip_keeps_vectors_exact():
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=vec(0), scale=2.5, tier="decode")],
                        clamps=[ProjectionClamp(layer=2, site="post_attn", direction=vec(1), lo=-1.0)],
                        ablations=[Ablation(layer=3, direction="refusal")])
    again = SteeringSpec.model_validate_json(spec.model_dump_json())
    assert np.array_equal(again.vectors[0].vector, spec.vectors[0].vector)
    assert again.clamps[0].lo == -1.0 and again.ablations[0].direction == "refusal"
    assert SteeringSpec.from_yaml(spec.to_yaml()).model_dump_json() == spec.model_dump_json()
    assert '"b64"' in spec.model_dump_json()  # never a JSON float list


def test_packed_payload_round_trip_and_is_one_string():
    spec = SteeringSpec(vectors=[AddVector(layer=0, vector=vec(3))])
    packed = encode_payload(spec, tag="req-7")
    assert isinstance(packed, str)
    decoded = decode_payload(packed)
    assert decoded.tag == "req-7"
    assert np.array_equal(decoded.spec.vectors[0].vector, spec.vectors[0].vector)
    assert decode_payload({"spec": spec.model_dump(mode="json")}).spec.model_dump_json() == spec.model_dump_json()


@pytest.mark.parametrize("bad, field", [
    ("ds1:!!!notbase64", "malformed packed payload"),
    ("ds1:" + "QUJD", "malformed packed payload"),
    ("hello", "must start with"),
    ({"spec": {"vectors": [{"layer": 0, "vector": {"b64": "AAA"}}]}}, "vectors[0].vector"),
    ({"spec": {"vectors": [{"layer": -1, "vector": [1.0]}]}}, "vectors[0].layer"),
    ({"spec": {"clamps": [{"layer": 0, "direction": [1.0]}]}}, "clamps[0]"),
    ({"spec": {}, "extra": 1}, "keys"),
    ({"capture": {"layers": []}}, "capture.layers"),
    (12, "expected a packed string"),
])
def test_malformed_payloads_name_the_field(bad, field):
    with pytest.raises(SteeringValidationError, match="extra_args.dynsteer") as err:
        decode_payload(bad)
    assert field in str(err.value)


@pytest.mark.parametrize("spec, field", [
    (SteeringSpec(vectors=[AddVector(layer=9, vector=vec(0))]), "vectors[0].layer"),
    (SteeringSpec(vectors=[AddVector(layer=0, vector=vec(0, H + 1))]), "vectors[0].vector: expected"),
    (SteeringSpec(vectors=[AddVector(layer=0, vector=np.full(H, np.nan, np.float32))]), "NaN"),
    (SteeringSpec(clamps=[ProjectionClamp(layer=0, direction=np.zeros(H), hi=1.0)]), "zero norm"),
    (SteeringSpec(ablations=[Ablation(layer=1, direction="missing")]), "unknown vector name 'missing'"),
])
def test_check_spec_errors_name_the_field(spec, field):
    with pytest.raises(SteeringValidationError) as err:
        check_spec(spec, SHAPE, {}, prefix="request.")
    assert field in str(err.value) and "request." in str(err.value)


def test_unhooked_site_and_layer_are_rejected():
    shape = ModelShape(num_layers=4, hidden_size=H, sites=("post_block",), layers=(1, 2))
    with pytest.raises(SteeringValidationError, match="site 'pre_attn' is not hooked"):
        check_spec(SteeringSpec(vectors=[AddVector(layer=1, site="pre_attn", vector=vec(0))]), shape)
    with pytest.raises(SteeringValidationError, match="layer 3 is not hooked"):
        check_spec(SteeringSpec(vectors=[AddVector(layer=3, vector=vec(0))]), shape)


def test_invalid_entries_rejected_by_schema():
    with pytest.raises(ValueError, match="lo, hi or both"):
        ProjectionClamp(layer=0, direction=vec(0))
    with pytest.raises(ValueError, match="must not exceed"):
        ProjectionClamp(layer=0, direction=vec(0), lo=2.0, hi=1.0)
    with pytest.raises(ValueError, match="finite"):
        AddVector(layer=0, vector=vec(0), scale=float("nan"))
    with pytest.raises(ValueError):
        AddVector(layer=0, site="mlp_out", vector=vec(0))
    with pytest.raises(ValueError):
        DynsteerConfig(max_rows=1)


def test_tiers_compile_per_phase_and_sum():
    a, b = vec(1), vec(2)
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=a), AddVector(layer=1, vector=b, tier="decode", scale=2),
                                 AddVector(layer=2, vector=a, tier="prefill")])
    pre = compile_phase([("", spec)], "prefill", SHAPE)
    dec = compile_phase([("", spec)], "decode", SHAPE)
    assert np.allclose(pre.sites[(1, "post_block")].vec, a) and (2, "post_block") in pre.sites
    assert np.allclose(dec.sites[(1, "post_block")].vec, a + 2 * b) and (2, "post_block") not in dec.sites
    assert pre.digest != dec.digest
    base_only = SteeringSpec(vectors=[AddVector(layer=1, vector=a)])
    assert (compile_phase([("", base_only)], "prefill", SHAPE).digest
            == compile_phase([("", base_only)], "decode", SHAPE).digest)
    assert compile_phase([("", SteeringSpec(vectors=[AddVector(layer=1, vector=a, scale=0)]))], "decode",
                         SHAPE).empty


def test_too_many_clamps_at_one_place_is_an_error():
    shape = ModelShape(num_layers=4, hidden_size=H, max_clamps=1)
    spec = SteeringSpec(ablations=[Ablation(layer=0, direction=vec(1)), Ablation(layer=0, direction=vec(2))])
    with pytest.raises(SteeringValidationError, match="more than 1 clamps"):
        compile_phase([("", spec)], "decode", shape)


def test_row_pool_dedups_refcounts_and_reports_exhaustion():
    pool = RowPool(3)
    c1 = compile_phase([("", SteeringSpec(vectors=[AddVector(layer=0, vector=vec(1))]))], "decode", SHAPE)
    c2 = compile_phase([("", SteeringSpec(vectors=[AddVector(layer=0, vector=vec(2))]))], "decode", SHAPE)
    c3 = compile_phase([("", SteeringSpec(vectors=[AddVector(layer=0, vector=vec(3))]))], "decode", SHAPE)
    r1, new1 = pool.acquire(c1)
    r1b, new1b = pool.acquire(c1)
    assert r1 == r1b and new1 and not new1b and r1 != 0
    r2, _ = pool.acquire(c2)
    with pytest.raises(RowsExhausted):
        pool.acquire(c3)
    pool.release(c1.digest)
    with pytest.raises(RowsExhausted):
        pool.acquire(c3)  # c1 still has one reference
    pool.release(c1.digest)
    r3, new3 = pool.acquire(c3)
    assert r3 == r1 and new3
    assert pool.acquire(compile_phase([("", SteeringSpec())], "decode", SHAPE)) == (0, False)


def _runtime(rows: int = 8) -> SteeringRuntime:
    sites = [(l, s) for l in range(4) for s in ("pre_attn", "post_attn", "post_block")]
    return SteeringRuntime(SHAPE, SteeringTables(sites, H, rows, 2, max_tokens=32))


def test_runtime_plans_rows_per_token_phase_and_zeroes_padding():
    rt = _runtime()
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=vec(1), tier="prefill"),
                                 AddVector(layer=1, vector=vec(2), tier="decode")])
    payloads = {"a": encode_payload(spec), "b": None}
    # a: 3 prompt tokens, chunk covers positions 2..5 (2 prompt + 2 generated, as after a resume); b: decode
    view = BatchView(req_ids=["a", "b"], query_start_loc=np.array([0, 4, 5]), num_computed=np.array([1, 7]),
                     prompt_lens=np.array([3, 4]), num_tokens=5, num_tokens_padded=8)
    rt.tables.row_index.fill_(99)
    rt.plan(view, payloads.get)
    idx = rt.tables.row_index[:8].tolist()
    pre, dec = rt.requests["a"].rows
    assert pre != dec and pre > 0 and dec > 0
    assert idx[:5] == [pre, pre, dec, dec, 0] and idx[5:8] == [0, 0, 0]
    assert torch.allclose(rt.tables.vec_at((1, "post_block"), pre), torch.from_numpy(vec(1)))
    assert torch.allclose(rt.tables.vec_at((1, "post_block"), dec), torch.from_numpy(vec(2)))
    rt.release(["a", "b"])
    assert rt.pool.in_use == 0


def test_runtime_global_change_recompiles_live_requests_and_bad_payload_is_stopped():
    rt = _runtime()
    rt.plan(BatchView(["x", "bad"], np.array([0, 1, 2]), np.array([0, 0]), np.array([1, 1]), 2, 2),
            {"x": None, "bad": "ds1:garbage"}.get)
    assert rt.requests["x"].rows == (0, 0)
    assert rt.requests["bad"].error and rt.stats.rejected == 1
    # the bad request is reported for the scheduler to stop, with the field named; never silently unsteered
    assert rt.take_stops() == {"bad": "dynsteer: extra_args.dynsteer: malformed packed payload "
                                      "(Error: Incorrect padding)"}
    assert rt.take_stops() == {}
    rt.set_global(SteeringSpec(vectors=[AddVector(layer=0, vector=vec(5))]))
    row = rt.requests["x"].rows[0]
    assert row > 0 and rt.requests["bad"].rows == (0, 0)  # a stopped request takes no row
    assert torch.allclose(rt.tables.vec_at((0, "post_block"), row), torch.from_numpy(vec(5)))
    with pytest.raises(SteeringValidationError, match="global.vectors\\[0\\].layer"):
        rt.set_global(SteeringSpec(vectors=[AddVector(layer=7, vector=vec(5))]))
    assert rt.requests["x"].rows[0] == row  # a rejected global spec changes nothing


def test_vector_file_and_packing_round_trip(tmp_path):
    v = vec(4)
    assert np.array_equal(unpack_vector(pack_vector(v)), v)
    save_vector(tmp_path / "v.safetensors", {3: v, 5: -v}, model_id="m", method="test")
    loaded, meta = load_vector(tmp_path / "v.safetensors")
    assert np.array_equal(loaded[3], v) and np.array_equal(loaded[5], -v) and meta["model_id"] == "m"


def test_specs_compare_and_hash_by_value():
    a = SteeringSpec(vectors=[AddVector(layer=1, vector=vec(0))])
    b = SteeringSpec(vectors=[AddVector(layer=1, vector=vec(0).copy())])
    c = SteeringSpec(vectors=[AddVector(layer=1, vector=vec(1))])
    assert a == b and hash(a) == hash(b) and a != c and len({a, b, c}) == 2
