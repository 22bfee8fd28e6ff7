"""Prefix caching under dynamic steering: the workers report where steering acted, the engine core folds it into the
hashes of the blocks from there on. Blocks generated while nothing acted stay shareable; none computed under steering
is served to a request that would compute it differently."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

import dynsteer
from dynsteer import DynsteerConfig
from dynsteer.engine.prefix_cache import ActedState, fold
from dynsteer.steering.dynamic.tokens import StepTokens, acted_report
from tests.conftest import ON_GPU, make_llm, token_ids, with_inprocess_engine_core
from tests.test_dynamic import ALWAYS, NEVER, policy

BLOCK = 16


# ---- the fold ------------------------------------------------------------------------------------------------------
def test_fold_is_forward_only_and_chained():
    s = ActedState()
    s.report(40, -1, "")
    assert s.fold_at(39) == "" and s.reported == 40  # nothing acted: plain hashes
    s.report(41, 40, "policy-a")
    assert s.fold_at(39) == "" and s.fold_at(40) == fold("", "policy-a") == s.fold_at(10_000)
    s.report(42, 41, "policy-a")  # the same thing acting again changes nothing
    assert len(s.events) == 1
    s.report(60, 55, "policy-b")  # something else acts (a command): chained onto the history
    assert s.fold_at(54) == fold("", "policy-a")
    assert s.fold_at(55) == fold(fold("", "policy-a"), "policy-b") != fold("", "policy-b")
    s.report(45, 44, "policy-c")  # a recomputed position after preemption: history stays in order
    assert [p for p, _ in s.events] == [40, 55, 55] and s.reported == 60


def test_fold_is_deterministic_across_processes():
    """Every rank and the engine core compute the same fold (no per-process hash seed)."""
    code = "from dynsteer.engine.prefix_cache import fold; print(fold(fold('', 'a'), 'b'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == fold(fold("", "a"), "b")


def test_acted_report_finds_each_requests_first_steering_position():
    G = 2
    # tokens of requests 0 (positions 7, 8, 9: resumed), 2 (position 20); request 2's slot 1 only monitors
    req, pos = np.array([0, 0, 0, 2]), np.array([7, 8, 9, 20])
    tok = StepTokens(("a", "b", "c"), req, np.arange(4), pos, np.full(4, -1), np.zeros(4, bool), np.full(4, -1),
                     np.zeros(4, bool), np.array([0b11, 0b11, 0b11, 0b01]), np.array(["sa"] * 3 + ["sc"], object))
    host = np.zeros((4 * G + 1, 4), np.float32)
    host[G + 1, 1] = 0.3  # request a: slot 1 applied at position 8
    host[G + 1, 3] = 0.9  # request c: slot 1 is a monitor without actions: not steering
    rep = acted_report(tok, host, G)
    assert rep.rows(range(len(rep))) == [("a", 10, 8, "sa"), ("c", 21, -1, "sc")]
    assert rep.lo.tolist() == [7, 20]


@settings(max_examples=200, deadline=None)
@given(hst.data())
def test_acted_report_equals_a_per_token_reading(data):
    """Random steps (one token per request, or runs of several: resumed requests) against a plain per-token reading
    of the read-back: a request's upto is its last position + 1, its first acted position the lowest one where a gate
    of a steering slot (a bit of its act mask) is non-zero."""
    G = data.draw(hst.integers(1, 6))
    runs = data.draw(hst.lists(hst.integers(1, 3), min_size=1, max_size=8))
    if data.draw(hst.booleans()):
        runs = [1] * len(runs)  # a decode step
    req = np.repeat(np.arange(len(runs)), runs)
    n = len(req)
    start = np.array(data.draw(hst.lists(hst.integers(0, 50), min_size=len(runs), max_size=len(runs))))
    pos = start[req] + np.concatenate([np.arange(r) for r in runs])
    act = np.array(data.draw(hst.lists(hst.integers(0, 2 ** G - 1), min_size=len(runs), max_size=len(runs))))[req]
    host = np.zeros((4 * G + 1, n), np.float32)
    host[G:2 * G] = np.array(data.draw(hst.lists(hst.sampled_from([0.0, 0.0, 0.5, -1.0]), min_size=G * n,
                                                max_size=G * n)), np.float32).reshape(G, n)
    ids = tuple(f"r{i}" for i in range(len(runs)))
    tok = StepTokens(ids, req, np.arange(n), pos, np.full(n, -1), np.zeros(n, bool), np.full(n, -1),
                     np.zeros(n, bool), act, np.array([f"s{i}" for i in req], object))
    want, want_lo = [], []
    for r in range(len(runs)):
        ks = [k for k in range(n) if req[k] == r]
        hit = [int(pos[k]) for k in ks if any(host[G + g, k] != 0 and act[k] >> g & 1 for g in range(G))]
        want.append((ids[r], int(pos[ks[-1]]) + 1, min(hit) if hit else -1, f"s{r}"))
        want_lo.append(int(pos[ks[0]]))
    rep = acted_report(tok, host, G)
    assert rep.rows(range(len(rep))) == want and rep.lo.tolist() == want_lo
    block = data.draw(hst.sampled_from([1, 4, 16]))
    # folded: acted, or a block's last position (p + 1 a multiple of the block) among the request's positions
    assert rep.to_fold(block) == [i for i, (_, u, a, _) in enumerate(want)
                                  if a >= 0 or any((p + 1) % block == 0 for p in range(want_lo[i], u))]


@settings(max_examples=60, deadline=None)
@given(hst.data())
def test_the_engine_core_folds_only_what_changes_a_hash(data):
    """``_apply_acts`` visits only the columns that can change a hash (steering acted, or a block's last token read
    back); real vLLM requests fed the same decode (1 to 3 tokens per request and step, reports landing up to two
    steps late, steering acting under changing signatures) keep the same block hashes, fold history and
    the same reported extent in whole blocks as requests that fold every column of every report."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from dynsteer.engine.keys import ACTED_ATTR, DYNAMIC_KEY
    from dynsteer.engine.prefix_cache import patch_request
    from dynsteer.engine.scheduler import _apply_acts

    patch_request(Request)
    init_none_hash(sha256_cbor)
    size = data.draw(hst.sampled_from([4, 16]))
    hasher = get_request_block_hasher(size, sha256_cbor)
    n = data.draw(hst.integers(1, 5))
    prompts = [data.draw(hst.integers(1, 40)) for _ in range(n)]
    ids = tuple(f"r{i}" for i in range(n))

    class Scheduler:  # what _apply_acts reads of vLLM's scheduler
        def __init__(self) -> None:
            self.requests = {r: Request(r, [(i * 7 + j) % 900 for j in range(p)],
                                        SamplingParams(max_tokens=10**6, extra_args={DYNAMIC_KEY: 1}), None,
                                        block_hasher=hasher) for i, (r, p) in enumerate(zip(ids, prompts))}

    fast, every = Scheduler(), Scheduler()

    def fold_every_column(reports):
        for rep in reports:
            for req_id, u, a, sig in rep.rows(range(len(rep))):
                request = every.requests[req_id]
                request.__dict__[ACTED_ATTR].report(u, a, sig)
                request.update_block_hashes()

    computed = list(prompts)  # positions < computed[i] have their KV
    pending: list = []
    for step in range(data.draw(hst.integers(1, 40))):
        k = [data.draw(hst.integers(1, 3)) for _ in range(n)]
        for i, r in enumerate(ids):  # the previous step's tokens appended (held-back hashing at each)
            for sched in (fast, every):
                sched.requests[r].append_output_token_ids([step % 500 + 5] * k[i])
        req = np.repeat(np.arange(n), k)
        pos = np.concatenate([np.arange(c, c + ki) for c, ki in zip(computed, k)])
        computed = [c + ki for c, ki in zip(computed, k)]
        m = len(req)
        host = np.zeros((5, m), np.float32)
        host[1] = np.array(data.draw(hst.lists(hst.sampled_from([0.0, 0.0, 0.0, 0.7]), min_size=m, max_size=m)))
        sig = data.draw(hst.sampled_from(["a", "b"]))
        tok = StepTokens(ids, req, np.arange(m), pos, np.full(m, -1), np.zeros(m, bool), np.full(m, -1),
                         np.zeros(m, bool), np.ones(m, np.int64), np.array([sig] * m, object))
        pending.append(acted_report(tok, host, 1))
        landed = data.draw(hst.integers(0, len(pending)))  # read-backs land late, several at once
        if len(pending) > 2:
            landed = max(landed, len(pending) - 2)
        reports, pending = pending[:landed], pending[landed:]
        _apply_acts(fast, reports, size)
        fold_every_column(reports)
        for r in ids:
            a, b = fast.requests[r], every.requests[r]
            assert a.block_hashes == b.block_hashes
            sa, sb = a.__dict__[ACTED_ATTR], b.__dict__[ACTED_ATTR]
            p = a.num_prompt_tokens  # hashing reads max(prompt, reported): equal in whole blocks
            assert sa.events == sb.events and max(p, sa.reported) // size == max(p, sb.reported) // size
    _apply_acts(fast, pending, size)
    fold_every_column(pending)
    for r in ids:
        assert fast.requests[r].block_hashes == every.requests[r].block_hashes
        assert len(fast.requests[r].block_hashes) == computed[ids.index(r)] // size  # every full block hashed


# ---- multi-turn through a real engine ------------------------------------------------------------------------------
def hits(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 5)


def _turns(llm, st, pol, n1: int = 5 * BLOCK):
    """Turn 1 under ``pol``; turn 2's prompt holds turn 1's prompt and output. Returns both turns' tokens, the
    cache hits of turn 2, the first position where turn 1's gate acted (None: never) and turn 1's prompt length."""
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    first = st.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=n1, ignore_eos=True), policy=pol)[0]
    fired = None
    if pol is not None:
        applied = first.trace.applied_gates()
        on = np.flatnonzero(applied != 0)
        fired = int(first.trace.position[on[0]]) if len(on) else None
    turn2 = {"prompt_token_ids": list(first.prompt_token_ids) + list(first.outputs[0].token_ids) + [11, 12, 13]}
    h0 = hits(llm)
    second = st.generate([turn2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), policy=pol)[0]
    return (list(first.outputs[0].token_ids), list(second.outputs[0].token_ids), hits(llm) - h0, fired,
            len(first.prompt_token_ids))


# vLLM's asynchronous scheduling (the GPU default) schedules step n+1 before step n's output, and so its report,
# has come back: on GPU every case also runs with it on, and the engine is checked to really run it.
SCHEDULING = ["async", "sync"] if ON_GPU else ["sync"]


@pytest.fixture(scope="module", params=SCHEDULING)
def multi_turn(request, tiny_llama_path):
    """Each case on an engine with prefix caching on and one with it off (under one scheduling mode)."""
    cfg = DynsteerConfig(max_gates=2)
    asynchronous = request.param == "async"
    out: dict = {}
    crossing = None
    for caching in (True, False):
        with make_llm(tiny_llama_path, enable_prefix_caching=caching, block_size=BLOCK, disable_log_stats=False,
                      async_scheduling=asynchronous, **cfg.engine_kwargs()) as llm:
            assert bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling) == asynchronous
            st = dynsteer.attach(llm)
            cases = {"unsteered": None, "never": policy(st, NEVER), "always": policy(st, ALWAYS)}
            if caching:  # found once; the uncached engine runs the very same policy
                crossing = _midway_crossing(st)
            if crossing is not None:
                cases["midway"] = crossing[0]
            out[caching] = {name: _turns(llm, st, pol) for name, pol in cases.items()}
            out[caching]["_midway_at"] = crossing[1] if crossing is not None else None
    return out


def _midway_crossing(st):
    """A policy whose monitor first crosses its threshold after turn 1's first generated block and before its last,
    and that position: over a few monitor directions, the generated token whose score most exceeds every score
    before it (the gate is 0 below its floor until then)."""
    from dynsteer import Action, DynamicSteeringPolicy, ProbeGate, Rule
    from tests.test_dynamic import ACT_LAYER, MON_LAYER, unit, vec

    def make(direction, threshold, sharpness, floor=0.0):
        mon = ProbeGate(name="m", layer=MON_LAYER, direction=direction, sharpness=sharpness, threshold=threshold)
        act = Action(kind="add", layer=ACT_LAYER, vector=vec(st.hidden_size, 1))
        return DynamicSteeringPolicy(monitors=[mon], rules=[Rule(monitor="m", actions=[act], gate_floor=floor)])

    best = None
    for seed in range(8):
        for sign in (1.0, -1.0):
            direction = sign * unit(st.hidden_size, seed)
            first = st.generate([PROMPT], _params(), policy=make(direction, NEVER, 1.0))[0]
            scores, pos = first.trace.scores().astype(np.float64).ravel(), np.asarray(first.trace.position)
            n0 = len(first.prompt_token_ids)
            for k in range(1, len(scores)):
                gap = scores[k] - scores[:k].max()
                if n0 + BLOCK < pos[k] < n0 + 4 * BLOCK and gap > 0 and (best is None or gap > best[0]):
                    best = (gap, direction, float(scores[k] - gap / 2), int(pos[k]))
        if best is not None and best[0] > 0.05:
            break
    if best is None:
        return None
    return make(best[1], best[2], 1e4, floor=0.5), best[3]


def _params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=5 * BLOCK, ignore_eos=True)


@pytest.mark.parametrize("case", ["unsteered", "never", "always", "midway"])
def test_multi_turn_outputs_with_prefix_caching_equal_outputs_without(multi_turn, case):
    assert case in multi_turn[True], "no monitor direction crosses midway through turn 1"
    cached, uncached = multi_turn[True][case], multi_turn[False][case]
    assert cached[:2] == uncached[:2]  # both turns' tokens


def test_a_gate_that_never_fires_keeps_every_hit(multi_turn):
    runs = multi_turn[True]
    assert runs["never"][3] is None
    unsteered_hits = runs["unsteered"][2]
    assert unsteered_hits >= (runs["unsteered"][4] // BLOCK + 4) * BLOCK  # turn 1's generated blocks are reused
    assert runs["never"][2] == unsteered_hits


def test_blocks_after_the_first_firing_are_never_served(multi_turn):
    runs = multi_turn[True]
    prompt_len = runs["always"][4]
    assert runs["always"][3] == prompt_len  # it acts on the first generated token
    assert runs["always"][2] <= prompt_len // BLOCK * BLOCK  # only blocks wholly in the prompt are reused
    assert "midway" in runs, "no monitor direction crosses midway through turn 1"
    fired = runs["midway"][3]
    assert fired is not None and fired > prompt_len + BLOCK
    # every block before the one holding the first firing is reused; none from it on
    assert runs["midway"][2] == fired // BLOCK * BLOCK


# ---- the global steering changed while a request is in flight ------------------------------------------------------

@pytest.mark.parametrize("change", ["policy", "decode_vector"])
def test_a_global_change_mid_flight_forks_the_live_requests_hashes(tiny_llama_path, change):
    """The workers recompile a live request's rows when the global spec or policy changes; blocks it computes from
    then on must not be served as if computed under what it was admitted with (here: an unsteered follow-up whose
    prompt is the conversation so far equals an uncached run), while blocks from before the change stay shareable."""
    with_inprocess_engine_core(_global_change_mid_flight, tiny_llama_path, change)  # the loop watches the scheduler


def _global_change_mid_flight(tiny_llama_path, change: str) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.test_dynamic import vec

    with make_llm(tiny_llama_path, enable_prefix_caching=True, block_size=BLOCK,
                  **DynsteerConfig(max_gates=2).engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        engine = llm.llm_engine
        sched = engine.engine_core.engine_core.scheduler
        prompt = llm.get_tokenizer().encode(PROMPT)
        engine.add_request("conv", TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(temperature=0.0, max_tokens=5 * BLOCK, ignore_eos=True))
        changed_at = None
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final = out
            req = next(iter(sched.requests.values()), None)  # the only request (vLLM suffixes its id)
            if changed_at is None and req is not None and req.num_output_tokens >= 2 * BLOCK + 5:
                changed_at = req.num_computed_tokens
                if change == "policy":
                    st.set_policy(policy(st, ALWAYS))
                else:
                    st.set_layer_vector(2, vec(st.hidden_size, 1))
        st.clear_policy()
        st.clear_all()
        assert changed_at is not None and final is not None
        conversation = list(final.prompt_token_ids) + list(final.outputs[0].token_ids)
        unsteered = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                                 SamplingParams(temperature=0.0, max_tokens=5 * BLOCK, ignore_eos=True))[0]
        assert list(unsteered.outputs[0].token_ids) != list(final.outputs[0].token_ids)  # the change steered it
        follow = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        cached = llm.generate([TokensPrompt(prompt_token_ids=conversation)], follow)[0]
        llm.reset_prefix_cache()
        fresh = llm.generate([TokensPrompt(prompt_token_ids=conversation)], follow)[0]
    assert list(cached.outputs[0].token_ids) == list(fresh.outputs[0].token_ids)
    # every block wholly before the change is reused, none computed after it
    assert cached.num_cached_tokens == changed_at // BLOCK * BLOCK


# ---- preemption ----------------------------------------------------------------------------------------------------

def test_preempted_requests_keep_their_steering_history_in_the_cache(tiny_llama_path):
    """A KV cache too small for the batch forces a preemption while prefix caching is on (the acted history lives on
    the request, so a resumed request hashes its recomputed blocks as before): outputs, and a second turn over each
    conversation that reuses what is still cached, equal an engine with caching off and room for all."""
    from vllm import SamplingParams

    from tests.test_dynamic import PROMPTS, SyncControllerSpec

    prompts = [f"{p} and then" for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    follow = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = {}
    for name, extra in (("roomy", {"enable_prefix_caching": False}),
                        ("tight", {"enable_prefix_caching": True, "num_gpu_blocks_override": 30})):
        with make_llm(tiny_llama_path, disable_log_stats=False, block_size=BLOCK, **extra,
                      **DynsteerConfig(max_gates=2).engine_kwargs()) as llm:
            st = dynsteer.attach(llm)
            pols = [policy(st, 0.0, sharpness=0.5, controller=SyncControllerSpec(
                kind="ema_latch", alpha=0.5, on=0.0, off=-2.0, scale=1.0)),
                policy(st, NEVER), policy(st, 0.0, scope="rest_of_request"), None]
            first = st.generate(prompts, params, policy=pols)
            turn2 = [{"prompt_token_ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids)} for o in first]
            second = [st.generate([t], follow, policy=[p])[0] for t, p in zip(turn2, pols)]
            metrics = {m.name: m.value for m in llm.get_metrics() if m.name in (
                "vllm:num_preemptions", "vllm:prefix_cache_hits")}
            runs[name] = (first, second, metrics)
            # finished requests leave nothing behind on the workers (the last one, unsteered, is released when the
            # workers hear of its end, with the next step) or in the engine core
            for worker in st.describe():
                assert worker["rows_in_use"] == 0 and worker["live_requests"] <= 1 and worker["dynamic"]["live"] == 0
            core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process engine core only
            if core is not None:
                state = core.scheduler._dynsteer
                assert not (state.holding or state.live or state.stops or state.stopped or state.aborts)
    first_t, second_t, metrics = runs["tight"]
    assert metrics["vllm:num_preemptions"] > 0
    assert metrics["vllm:prefix_cache_hits"] > 0  # cached blocks were served (second turns)
    assert token_ids(first_t) == token_ids(runs["roomy"][0])
    assert token_ids(second_t) == token_ids(runs["roomy"][1])
    for tight, roomy in zip(first_t, runs["roomy"][0]):
        if roomy.trace is not None:
            assert tight.trace.position == roomy.trace.position
