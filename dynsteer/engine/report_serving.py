"""Per-request reports on vLLM's OpenAI server: a ``dynsteer`` field on each choice of a request that asked for one.

``/v1/completions`` and ``/v1/chat/completions``, streamed or not, for requests whose payload has ``report``
(:class:`dynsteer.trace.ReportValues` describes the field). The values come with vLLM's ``RequestOutput`` objects
(``CompletionOutput.dynsteer``, written by :mod:`dynsteer.engine.reports`); here they only move onto the response:

* full responses: each choice takes its output's report (choices follow the outputs, prompt by prompt);
* streams: the serving generator's input is tapped, so the report of each output it pulls is pending for that
  choice index, and the next chunk it yields for that index carries it (chunks that carry no token, such as a chat
  stream's opening role chunk, take none). A chunk therefore carries exactly the values of the tokens it delivers
  (the frontend holds a delta until its tokens' values have arrived).

A response without any report is passed through untouched (streams: no chunk is parsed), and a request that carries
no steering at all (no top-level ``steering``, no ``vllm_xargs.dynsteer``) streams through vLLM's generator as it is:
at high concurrency the API server is the busiest process, so an unsteered stream pays nothing per chunk.
"""

from __future__ import annotations

import functools
from typing import Any, AsyncIterator

import msgspec

from dynsteer.engine import patching
from dynsteer.engine.json_steering import FIELD as STEERING_FIELD
from dynsteer.engine.keys import PAYLOAD_KEY, REPORT_OUTPUT_ATTR
from dynsteer.trace import merge_reports

FIELD = "dynsteer"  # the choice field (OpenAI choices allow extra fields in vLLM's protocol models)
# a chunk is parsed and written again once per report delivery: msgspec does it ~5x faster than json, same bytes
_decode, _encode = msgspec.json.Decoder().decode, msgspec.json.Encoder().encode


def may_report(request: Any) -> bool:
    """Whether an OpenAI request carries steering at all (only such a request can ask for a report)."""
    return (getattr(request, "model_extra", None) or {}).get(STEERING_FIELD) is not None or \
        PAYLOAD_KEY in (getattr(request, "vllm_xargs", None) or {})


def _report(output: Any) -> dict | None:
    return getattr(output, REPORT_OUTPUT_ATTR, None)


def _set(choice: Any, report: dict | None) -> None:
    if report is not None:
        setattr(choice, FIELD, report)


class _Tap:
    """Reports of the outputs a stream generator pulled, pending by choice index until a chunk carries them."""

    def __init__(self, per_prompt: int) -> None:
        self.per_prompt = per_prompt
        self.pending: dict[int, dict] = {}

    def note(self, res: Any, prompt_idx: int = 0) -> None:
        for output in res.outputs:
            rep = _report(output)
            if rep is not None:
                i = output.index + prompt_idx * self.per_prompt
                self.pending[i] = merge_reports(self.pending.get(i), rep)

    def inject(self, chunk: str) -> str:
        """``chunk`` (an SSE ``data:`` line) with the pending reports of the choices it carries."""
        if not self.pending or not chunk.startswith("data: {"):
            return chunk
        body = _decode(chunk[len("data: "):])
        changed = False
        for choice in body.get("choices") or ():
            i = choice.get("index")
            delta = choice.get("delta")
            if i in self.pending and not (isinstance(delta, dict) and delta.get("role")):  # a role chunk: no token
                choice[FIELD] = self.pending.pop(i)
                changed = True
        return f"data: {_encode(body).decode()}\n\n" if changed else chunk


def patch_completion_serving(module: Any) -> None:
    """``vllm.entrypoints.openai.completion.serving``: reports on ``/v1/completions`` choices."""
    cls = module.OpenAIServingCompletion
    orig_full, orig_stream = cls.request_output_to_completion_response, cls.completion_stream_generator

    @functools.wraps(orig_full)
    def request_output_to_completion_response(self: Any, final_res_batch: Any, *a: Any, **k: Any) -> Any:
        response = orig_full(self, final_res_batch, *a, **k)
        outputs = [output for res in final_res_batch for output in res.outputs]
        if any(_report(o) is not None for o in outputs):
            for choice, output in zip(response.choices, outputs):
                _set(choice, _report(output))
        return response

    async def reporting_stream(self: Any, request: Any, engine_inputs: Any, result_generator: AsyncIterator[Any],
                               *a: Any, **k: Any) -> AsyncIterator[str]:
        tap = _Tap(1 if request.n is None else request.n)

        async def tapped() -> Any:
            async for prompt_idx, res in result_generator:
                tap.note(res, prompt_idx)
                yield prompt_idx, res

        async for chunk in orig_stream(self, request, engine_inputs, tapped(), *a, **k):
            yield tap.inject(chunk)

    @functools.wraps(orig_stream)
    def completion_stream_generator(self: Any, request: Any, *a: Any, **k: Any) -> AsyncIterator[str]:
        # vLLM's own generator, not a wrapper around it, for a request that cannot ask for a report
        return (reporting_stream if may_report(request) else orig_stream)(self, request, *a, **k)

    patching.patch(cls, "request_output_to_completion_response", request_output_to_completion_response,
                   why="a dynsteer field on each choice of a request that asked for a report")
    patching.patch(cls, "completion_stream_generator", completion_stream_generator,
                   why="a dynsteer field on each streamed choice: the values of the tokens the chunk delivers")


def patch_chat_serving(module: Any) -> None:
    """``vllm.entrypoints.openai.chat_completion.serving``: reports on ``/v1/chat/completions`` choices."""
    cls = module.OpenAIServingChat
    orig_full, orig_stream = cls.chat_completion_full_generator, cls.chat_completion_stream_generator

    @functools.wraps(orig_full)
    async def chat_completion_full_generator(self: Any, request: Any, result_generator: AsyncIterator[Any],
                                             *a: Any, **k: Any) -> Any:
        last: list[Any] = []

        async def tapped() -> Any:
            async for res in result_generator:
                last[:] = [res]
                yield res

        response = await orig_full(self, request, tapped(), *a, **k)
        if last and getattr(response, "choices", None):
            by_index = {o.index: _report(o) for o in last[0].outputs}
            for choice in response.choices:
                _set(choice, by_index.get(choice.index))
        return response

    async def reporting_stream(self: Any, request: Any, result_generator: AsyncIterator[Any],
                               *a: Any, **k: Any) -> AsyncIterator[str]:
        tap = _Tap(1 if request.n is None else request.n)

        async def tapped() -> Any:
            async for res in result_generator:
                tap.note(res)
                yield res

        async for chunk in orig_stream(self, request, tapped(), *a, **k):
            yield tap.inject(chunk)

    @functools.wraps(orig_stream)
    def chat_completion_stream_generator(self: Any, request: Any, *a: Any, **k: Any) -> AsyncIterator[str]:
        return (reporting_stream if may_report(request) else orig_stream)(self, request, *a, **k)

    patching.patch(cls, "chat_completion_full_generator", chat_completion_full_generator,
                   why="a dynsteer field on each choice of a request that asked for a report")
    patching.patch(cls, "chat_completion_stream_generator", chat_completion_stream_generator,
                   why="a dynsteer field on each streamed choice: the values of the tokens the chunk delivers")
