"""The OpenAI server's report plumbing (dynsteer.engine.report_serving), without a server: which streams it taps and
what a tapped chunk becomes. The served behaviour is tests/test_reports.py's."""

from __future__ import annotations

import asyncio
import json
import types

from dynsteer.engine import report_serving
from dynsteer.engine.keys import REPORT_OUTPUT_ATTR


class Request:
    def __init__(self, steering=None, vllm_xargs=None, n=None):
        self.model_extra = {} if steering is None else {"steering": steering}
        self.vllm_xargs, self.n = vllm_xargs, n


def _serving_module():
    class OpenAIServingCompletion:
        def request_output_to_completion_response(self, batch, *a, **k):
            return None

        async def completion_stream_generator(self, request, engine_inputs, result_generator, *a, **k):
            async for _, res in result_generator:
                yield "data: " + json.dumps({"id": "c", "choices": [
                    {"index": o.index, "text": o.text, "logprobs": None} for o in res.outputs]},
                    separators=(",", ":")) + "\n\n"
            yield "data: [DONE]\n\n"

    return types.SimpleNamespace(OpenAIServingCompletion=OpenAIServingCompletion)


def _results(reports):
    async def gen():
        for i, rep in enumerate(reports):
            out = types.SimpleNamespace(index=0, text=f"t{i}")
            if rep is not None:
                setattr(out, REPORT_OUTPUT_ATTR, rep)
            yield 0, types.SimpleNamespace(outputs=[out])
    return gen()


async def _collect(agen):
    return [chunk async for chunk in agen]


def test_a_request_without_steering_streams_through_vllms_own_generator():
    module = _serving_module()
    original = module.OpenAIServingCompletion.completion_stream_generator
    report_serving.patch_completion_serving(module)
    serving = module.OpenAIServingCompletion()
    plain = serving.completion_stream_generator(Request(), None, _results([None]))
    assert plain.ag_code is original.__code__  # no wrapper between vLLM's generator and the response
    steered = serving.completion_stream_generator(Request(steering={"report": "tokens"}), None, _results([None]))
    assert steered.ag_code is not original.__code__
    packed = serving.completion_stream_generator(Request(vllm_xargs={"dynsteer": "ds1:x"}), None, _results([None]))
    assert packed.ag_code is not original.__code__
    asyncio.run(_collect(plain)), asyncio.run(_collect(steered)), asyncio.run(_collect(packed))


def test_a_tapped_chunk_carries_its_report_and_is_otherwise_unchanged():
    module = _serving_module()
    report_serving.patch_completion_serving(module)
    serving = module.OpenAIServingCompletion()
    reports = [{"report": "tokens", "monitors": ["m"], "score": [None], "gate": [None]}, None,
               {"report": "tokens", "monitors": ["m"], "score": [[0.25]], "gate": [[0.5]]}]
    chunks = asyncio.run(_collect(serving.completion_stream_generator(
        Request(steering={"report": "tokens"}), None, _results(reports))))
    bodies = [json.loads(c[len("data: "):]) for c in chunks[:-1]]
    assert chunks[-1] == "data: [DONE]\n\n"
    assert [b["choices"][0].get("dynsteer") for b in bodies] == reports
    for b in bodies:  # the rest is vLLM's chunk, byte for byte once the field is taken out
        b["choices"][0].pop("dynsteer", None)
    assert [json.dumps(b, separators=(",", ":")) for b in bodies] == \
        [json.dumps({"id": "c", "choices": [{"index": 0, "text": f"t{i}", "logprobs": None}]}, separators=(",", ":"))
         for i in range(3)]
    assert all(c.endswith("\n\n") for c in chunks)
