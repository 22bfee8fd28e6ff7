"""A dynamic request's block hashing skips steps that complete no block, with the same hashes (no engine)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from dynsteer.engine import keys, prefix_cache  # noqa: E402


def _run(hasher, seed: int) -> list:
    """Grow a dynamic request token by token, the workers' reports lagging by a random 0-3 tokens."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=500, extra_args={keys.DYNAMIC_KEY: True})
    req = Request(request_id="r", prompt_token_ids=[rng.randrange(1000) for _ in range(37)], sampling_params=params,
                  pooling_params=None, block_hasher=hasher)
    acted = req.__dict__.setdefault("_dynsteer_acted", prefix_cache.ActedState())
    seen = []
    for step in range(150):
        acted.report(max(0, req.num_tokens - rng.randrange(4)), 40 + step if step % 37 == 5 else -1, f"sig{step}")
        req.append_output_token_ids(rng.randrange(1000))
        seen.append(list(req.block_hashes))
    return seen


def test_skipping_blockless_steps_keeps_every_hash():
    prefix_cache.patch_request(Request)
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    fast = get_request_block_hasher(16, fn)
    assert prefix_cache._block_size(fast) == 16  # read from vLLM's closure
    slow = get_request_block_hasher(16, fn)
    slow._dynsteer_block_size = None  # the size unknown: every step calls the hasher
    for seed in range(3):
        a, b = _run(fast, seed), _run(slow, seed)
        assert a == b and len(a[-1]) >= 10
