"""A command that changes a request's decode steering forks the prefix-cache hash of its blocks from the position
the acked step computes first: a later unsteered request whose prompt is that conversation never reads KV computed
under the command (outputs equal an uncached run), while the blocks before it stay shareable."""

from __future__ import annotations

import threading
import time

import numpy as np

from dynsteer.commands import SteerCommand
from dynsteer.config import DynsteerConfig, MonitorConfig
from dynsteer.monitor.client import CommandClient
from dynsteer.spec import AddVector, SteeringSpec
from tests.conftest import make_llm, with_inprocess_engine_core

PROMPT = "the quick brown fox jumps over the lazy dog and then"


def test_commanded_blocks_are_never_served_to_a_request_that_would_compute_them_differently(tiny_llama_path):
    # the monitor thread watches the scheduler, so the engine core runs in the test's process (on GPU, a fresh one)
    with_inprocess_engine_core(_commanded_blocks, tiny_llama_path)


def _commanded_blocks(tiny_llama_path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = DynsteerConfig(monitor=MonitorConfig.private())
    with make_llm(tiny_llama_path, enable_prefix_caching=True, block_size=16, **cfg.engine_kwargs()) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # room to act at 40 on a loaded machine
        vec = np.random.default_rng(1).standard_normal(128).astype(np.float32) * 8
        acks = []

        def monitor() -> None:
            client = CommandClient(cfg.monitor.command_endpoint, "apc")
            while not sched.requests:
                time.sleep(0.001)
            req_id = next(iter(sched.requests))
            while sched.requests.get(req_id) is not None and sched.requests[req_id].num_output_tokens < 40:
                time.sleep(0.001)  # command mid-generation: a few blocks are generated before it
            spec = SteeringSpec(vectors=[AddVector(layer=1, vector=vec, tier="decode")])
            acks.append(client.wait(client.send(SteerCommand(request=req_id, spec=spec)), 30))
            client.close()

        t = threading.Thread(target=monitor)
        t.start()
        first = llm.generate([PROMPT], long)[0]
        t.join()
        assert acks and acks[0].status == "applied", acks
        conversation = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
        follow = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        cached = llm.generate([TokensPrompt(prompt_token_ids=conversation)], follow)[0]
        hit = cached.num_cached_tokens
        llm.reset_prefix_cache()
        fresh = llm.generate([TokensPrompt(prompt_token_ids=conversation)], follow)[0]
    assert list(cached.outputs[0].token_ids) == list(fresh.outputs[0].token_ids)
    # the prompt and the blocks generated before the command were reused; nothing computed under it was
    assert len(first.prompt_token_ids) <= hit < len(conversation) - 16


def test_a_global_command_steers_live_and_later_requests_and_the_cache_never_mixes_epochs(tiny_llama_path):
    """A monitor replaces the global steering mid-generation: live requests change after the acked step, requests
    admitted later run exactly as under the same global set through the API (their prompt blocks are not served from
    the unsteered cache), and clearing it restores unsteered outputs and their cache hits. A bad one is rejected
    naming the field."""
    with_inprocess_engine_core(_global_command, tiny_llama_path)


def _global_command(tiny_llama_path) -> None:
    from vllm import SamplingParams

    import dynsteer
    from dynsteer.commands import GlobalCommand

    # global is granted to nobody by default (MonitorConfig.grants)
    cfg = DynsteerConfig(monitor=MonitorConfig.private(grants={"global": ("global",)}))
    prompts = [PROMPT, "once upon a time there was a", "in the beginning the"]
    vec = np.random.default_rng(2).standard_normal(128).astype(np.float32) * 8
    spec = SteeringSpec(vectors=[AddVector(layer=1, vector=vec)])
    p48 = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with make_llm(tiny_llama_path, enable_prefix_caching=True, block_size=16, **cfg.engine_kwargs()) as llm:
        st = dynsteer.attach(llm)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, p48)]
        with st.steering(spec):
            api = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, p48)]
        assert api != plain
        client = CommandClient(cfg.monitor.command_endpoint, "global")
        acks = []

        def during(n_out: int, command) -> None:
            while not sched.requests:
                time.sleep(0.001)
            req = next(iter(sched.requests.values()))
            while not req.is_finished() and req.num_output_tokens < n_out:
                time.sleep(0.001)
            acks.append(client.wait(client.send(command), 30))

        def run_with(command, n_out: int, batch: list[str]) -> list[list[int]]:
            t = threading.Thread(target=during, args=(n_out, command))
            t.start()
            out = [list(o.outputs[0].token_ids) for o in llm.generate(batch, p48)]
            t.join()
            return out

        live = run_with(GlobalCommand(spec=spec), 16, prompts[:2])
        assert acks[-1].status == "applied", acks
        for got, before in zip(live, plain[:2]):
            assert got[:16] == before[:16] and got != before  # unchanged up to the command, steered after it
        later = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, p48)]
        assert later == api  # as under the API's global: no unsteered prompt block was served
        run_with(GlobalCommand(spec=SteeringSpec(vectors=[AddVector(layer=99, vector=vec)])), 1, prompts[2:])
        assert acks[-1].status == "rejected" and "layer" in acks[-1].error, acks[-1]
        run_with(GlobalCommand(), 1, prompts[2:])
        assert acks[-1].status == "applied"
        again = llm.generate(prompts[:1], p48)[0]
        client.close()
    assert list(again.outputs[0].token_ids) == plain[0]
    assert again.num_cached_tokens > 0  # the unsteered epoch's blocks are shared again
