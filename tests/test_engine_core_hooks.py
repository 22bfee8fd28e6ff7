"""The engine core runs vLLM's own per-request methods unless a live request needs dynsteer's.

vLLM calls ``allocate_slots``, ``cache_blocks``, ``_update_request_with_output`` and ``Request.update_block_hashes``
once per request and step. dynsteer needs them only for requests waiting for steering rows, requests whose block
hashing a dynamic policy holds back, and steps where the workers stopped a request. Otherwise a step calls no
dynsteer code per request. When such requests come, the hooks come back; when they finish, the hooks go again.
"""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pytest

import dynsteer
from dynsteer import Action, AddVector, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule, SteeringSpec
from dynsteer.engine import frontend, keys, patching, prefix_cache, scheduler as sched_mod
from tests.conftest import make_llm, token_ids, with_inprocess_engine_core

# vLLM calls these once per request and step (hashed_tokens: from dynsteer's cache_blocks hook)
PER_REQUEST_STEP = {"allocate_slots", "cache_blocks", "_update_request_with_output", "update_block_hashes",
                    "hashed_tokens"}
PROMPTS = ["the quick brown fox", "once upon a time there was", "in the beginning", "she opened the door and",
           "a long way from home", "the old man said", "it was a dark night", "we went down to the"]


def engine_core_calls(fn):
    """``fn()`` and the calls it made into dynsteer's engine-core modules (scheduler, prefix cache, admission, the
    patching helper's switches), by function name."""
    files = {sched_mod.__file__, prefix_cache.__file__, frontend.__file__, patching.__file__}
    seen: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in files:
            seen[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, seen


def _vec(h: int, seed: int, scale: float = 6.0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(h).astype(np.float32)
    return (v / np.linalg.norm(v) * scale).astype(np.float32)


def _dynamic(h: int) -> DynamicSteeringPolicy:
    mon = ProbeGate(name="m", layer=1, direction=_vec(h, 7, 1.0), sharpness=2.0, threshold=-10.0)  # fires at once
    act = Action(kind="add", layer=2, vector=_vec(h, 8))
    return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act], scope="this_token")])


def _scenario(path: str) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # max_rows=3 leaves 2 rows: 4 distinct static configurations must wait for rows
    with make_llm(str(path), max_num_seqs=8, enable_prefix_caching=True,
                  **DynsteerConfig(max_rows=3, max_gates=2).engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        state, kvm = sched._dynsteer, sched.kv_cache_manager

        def vllms_own() -> bool:
            from vllm.v1.core.sched.scheduler import Scheduler

            return ("allocate_slots" not in vars(kvm) and "cache_blocks" not in vars(kvm.coordinator)
                    and Scheduler.__dict__["_update_request_with_output"] is sched_mod._STOP_AWARE.original(Scheduler)
                    and Request.update_block_hashes.__module__ == "vllm.v1.request")

        assert vllms_own()
        # 1. unsteered traffic on an idle engine: no per-request call into dynsteer's engine core in any step
        base, calls = engine_core_calls(lambda: token_ids(llm.generate(PROMPTS, params, use_tqdm=False)))
        assert not PER_REQUEST_STEP & set(calls), calls
        # what it did call runs once per step or once per request, not per request and step
        _, calls1 = engine_core_calls(lambda: llm.generate(PROMPTS[:1], params, use_tqdm=False))
        per_step = {k: v for k, v in calls.items() if v > len(PROMPTS) * 2}
        assert all(calls[k] <= calls1.get(k, 0) + 2 for k in per_step), (calls, calls1)

        # 2. steered requests that need rows: the row check runs (some wait), each is steered as when alone
        specs = [SteeringSpec(vectors=[AddVector(layer=1, vector=_vec(st.hidden_size, 20 + i))]) for i in range(4)]
        alone = [token_ids(st.generate(PROMPTS[i], params, steering=s))[0] for i, s in enumerate(specs)]
        waits = state.waits
        both = st.generate(PROMPTS[:4] + PROMPTS[4:], params, steering=specs + [None] * 4)
        assert token_ids(both)[:4] == alone
        assert token_ids(both)[4:] == base[4:]  # unsteered rows beside them are unchanged
        assert state.waits > waits and not state.live and not state.pending
        assert vllms_own()  # the hooks went with the last steered request

        # 3. dynamic policies: hashing held back while they run (their requests are HeldBackRequest), then gone
        seen: list[str] = []
        orig_add = sched.add_request

        def add_request(request, *a, **k):
            seen.append(type(request).__name__)
            return orig_add(request, *a, **k)

        sched.add_request = add_request
        try:
            dyn = st.generate(PROMPTS[:2] + PROMPTS[2:4], params, policy=[_dynamic(st.hidden_size)] * 2 + [None] * 2)
        finally:
            del sched.add_request
        assert seen == ["HeldBackRequest"] * 2 + ["Request"] * 2
        assert token_ids(dyn)[2:] == base[2:4] and token_ids(dyn)[:2] != base[:2]
        assert not state.held and not state.pending and vllms_own()
        # and unsteered traffic afterwards is back to no per-request calls
        again, calls = engine_core_calls(lambda: token_ids(llm.generate(PROMPTS, params, use_tqdm=False)))
        assert again == base and not PER_REQUEST_STEP & set(calls), calls


def test_per_request_hooks_only_while_a_request_needs_them(tiny_llama_path):
    with_inprocess_engine_core(_scenario, str(tiny_llama_path))


def test_only_dynamic_requests_hold_their_hashing_back():
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    prefix_cache.patch_request(Request)
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    plain = Request("p", list(range(40)), SamplingParams(max_tokens=40), None, block_hasher=hasher)
    held = Request("d", list(range(40)), SamplingParams(max_tokens=40, extra_args={keys.DYNAMIC_KEY: 1}), None,
                   block_hasher=hasher)
    assert type(plain) is Request and type(held) is prefix_cache.HeldBackRequest and isinstance(held, Request)
    assert Request.update_block_hashes.__module__ == "vllm.v1.request"  # vLLM's own for every other request
    assert len(plain.block_hashes) == len(held.block_hashes) == 2  # the prompt's full blocks either way
    for _ in range(24):  # 64 tokens: two more full blocks
        plain.append_output_token_ids(5)
        held.append_output_token_ids(5)
    assert len(plain.block_hashes) == 4
    assert len(held.block_hashes) == 2  # nothing reported on: decode blocks wait
    held.__dict__["_dynsteer_acted"].reported = 64
    held.update_block_hashes()
    assert held.block_hashes == plain.block_hashes  # nothing acted: the same hashes once reported
    with pytest.raises(AttributeError):
        prefix_cache.HeldBackRequest.no_such_thing  # noqa: B018 - an ordinary class otherwise
