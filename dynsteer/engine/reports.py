"""Per-request reports (payload ``report``) from the workers to the caller: the engine core's relay and the frontend.

The path of a report's values:

1. the workers send each step's landed values (``REPORTS_ATTR`` on the runner output; read back off the step path,
   ``dynsteer.steering.dynamic.reports``);
2. the engine core (:class:`ReportRelay`, run by the scheduler patch) buffers them per request and nests what is new
   under ``REPORT_PARAMS_KEY`` of the next ``EngineCoreOutput``'s ``kv_transfer_params`` (merged with whatever a KV
   connector put there). vLLM's output has no free slot; that dict is the one it carries untouched to the frontend;
3. the frontend (:func:`patch_output_processor`) pops them from ``kv_transfer_params`` before vLLM reads them, keeps
   them on the request's state (:class:`~dynsteer.trace.ReportValues`) and writes the report on each
   ``CompletionOutput`` it makes (``CompletionOutput.dynsteer``): the whole report on a final-only output, the
   values of the tokens it delivers on a streamed delta.

Read-backs land a step or so after their token. So a report request costs one step of latency where its values are
late, and only then: the engine core holds a report request's *final* output until its last values have arrived
(running empty steps while it holds one, which is what lets the workers' read-backs land and be sent), and the
frontend holds a streamed delta until the values of its tokens have arrived, delivering it merged with the next one.
A request without a report costs one empty-dict check per step in the workers and the engine core, and nothing per
request.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from dynsteer.engine import patching
from dynsteer.engine.keys import REPORT_OUTPUT_ATTR, REPORT_PARAMS_KEY, REPORT_STASH_ATTR
from dynsteer.trace import ReportValues, merge_reports


# ---- engine core ---------------------------------------------------------------------------------------------------
@dataclass
class _Buffer:
    prompt_len: int
    values: ReportValues = field(init=False)  # only for coverage: upto and done
    pending: dict[str, Any] = field(default_factory=dict)  # values not yet sent to the frontend
    tokens: int = 0  # output tokens sent so far
    held: tuple[int, Any] | None = None  # (client index, final EngineCoreOutput) waiting for its values
    freed: bool = False

    def __post_init__(self) -> None:
        self.values = ReportValues(self.prompt_len)


class ReportRelay:
    """Engine core: report values by request, forwarded with the request's outputs."""

    def __init__(self) -> None:
        self.buffers: dict[str, _Buffer] = {}
        self.held: set[str] = set()  # requests whose final output waits for its values

    def fold(self, scheduler: Any, deltas: dict[str, dict[str, Any]] | None) -> None:
        """Buffer the workers' deltas (before vLLM frees the requests this output finishes)."""
        for req_id, delta in (deltas or {}).items():
            buf = self.buffers.get(req_id)
            if buf is None:
                request = scheduler.requests.get(req_id)
                if request is None:
                    continue  # gone (aborted by its client): nobody reads it
                buf = self.buffers[req_id] = _Buffer(int(request.num_prompt_tokens))
            buf.values.add(delta)
            for key, value in delta.items():
                if isinstance(value, list) and key in buf.pending and key in ("position", "score", "applied"):
                    buf.pending[key].extend(value)
                else:
                    buf.pending[key] = list(value) if isinstance(value, list) else value

    def deliver(self, outputs: dict[int, Any], outputs_cls: type) -> None:
        """Attach buffered values to this step's outputs of report requests; hold a final output whose values have
        not all arrived; release the held ones whose have."""
        for client, eco in outputs.items():
            keep = []
            for out in eco.outputs:
                buf = self.buffers.get(out.request_id)
                if buf is None:
                    keep.append(out)
                    continue
                buf.tokens += len(out.new_token_ids)
                if out.finish_reason is not None and not buf.values.covered(buf.tokens):
                    buf.held = (client, out)
                    self.held.add(out.request_id)
                    continue
                self._attach(out, buf)
                keep.append(out)
            eco.outputs[:] = keep
        for req_id in [r for r in self.held if self.buffers[r].values.covered(self.buffers[r].tokens)]:
            buf = self.buffers[req_id]
            client, out = buf.held
            self.held.discard(req_id)
            self._attach(out, buf)
            outputs.setdefault(client, outputs_cls()).outputs.append(out)
        for req_id in [r for r, b in self.buffers.items() if b.freed and r not in self.held]:
            del self.buffers[req_id]  # finished: its final output went out (or its client aborted it)

    def freed(self, req_id: str) -> None:
        """vLLM freed the request (finished or aborted): its buffer goes once its final output is out."""
        buf = self.buffers.get(req_id)
        if buf is not None:
            buf.freed = True

    def _attach(self, out: Any, buf: _Buffer) -> None:
        if out.finish_reason is not None:
            self.buffers.pop(out.request_id, None)
        if not buf.pending:
            return
        out.kv_transfer_params = {**(out.kv_transfer_params or {}), REPORT_PARAMS_KEY: buf.pending}
        buf.pending = {}


# ---- frontend ------------------------------------------------------------------------------------------------------
@dataclass
class _Stash:
    values: ReportValues
    tokens: int = 0  # output tokens made so far
    sent: int = 0  # output tokens whose values went out (streamed deltas)
    held: Any = None  # a streamed RequestOutput waiting for its tokens' values


def patch_output_processor(module: Any) -> None:
    """``vllm.v1.engine.output_processor``: pop report values from ``kv_transfer_params`` and write each output's
    report on its ``CompletionOutput`` (``RequestState.make_request_output``)."""
    from vllm.sampling_params import RequestOutputKind

    state_cls = module.RequestState
    orig_make = state_cls.make_request_output

    @functools.wraps(orig_make)
    def make_request_output(self: Any, new_token_ids: Any, pooling_output: Any, finish_reason: Any,
                            stop_reason: Any, kv_transfer_params: Any = None, *a: Any, **k: Any) -> Any:
        stash = self.__dict__.get(REPORT_STASH_ATTR)
        if kv_transfer_params and REPORT_PARAMS_KEY in kv_transfer_params:
            kv_transfer_params = dict(kv_transfer_params)
            delta = kv_transfer_params.pop(REPORT_PARAMS_KEY)
            kv_transfer_params = kv_transfer_params or None
            if stash is None:
                stash = self.__dict__[REPORT_STASH_ATTR] = _Stash(ReportValues(len(self.prompt_token_ids or ())))
            stash.values.add(delta)
        out = orig_make(self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params, *a, **k)
        if stash is None:
            return out
        stash.tokens += len(new_token_ids or ())
        if out is None:
            return None
        finished = finish_reason is not None
        abort = stop_reason if finished and str(finish_reason) == "abort" and isinstance(stop_reason, str) else None
        if self.output_kind != RequestOutputKind.DELTA:  # the whole output so far
            _write(out, self.request_index, stash.values.json(0, stash.tokens, finished, abort))
            return out
        if stash.held is not None:  # a delta held for its values goes out with this one
            stash.held.add(out, aggregate=True)
            out, stash.held = stash.held, None
        if not finished and not stash.values.covered(stash.tokens):
            stash.held = out
            return None
        _write(out, self.request_index, stash.values.json(stash.sent, stash.tokens, finished, abort))
        stash.sent = stash.tokens
        return out

    patching.patch(state_cls, "make_request_output", make_request_output,
                   why="take dynsteer's report values out of kv_transfer_params; write each output's report")

    from vllm.outputs import RequestOutput

    orig_add = RequestOutput.add

    @functools.wraps(orig_add)
    def add(self: Any, next_output: Any, aggregate: bool) -> None:
        reports = {c.index: r for c in next_output.outputs
                   if (r := getattr(c, REPORT_OUTPUT_ATTR, None)) is not None}
        orig_add(self, next_output, aggregate)
        if reports and aggregate:
            for c in self.outputs:
                if c.index in reports:
                    setattr(c, REPORT_OUTPUT_ATTR, merge_reports(getattr(c, REPORT_OUTPUT_ATTR, None),
                                                                 reports[c.index]))

    patching.patch(RequestOutput, "add", add, why="merged streamed outputs merge their dynsteer reports too")


def _write(out: Any, index: int, report: dict | None) -> None:
    if report is None:
        return
    for completion in out.outputs:
        if completion.index == index:
            setattr(completion, REPORT_OUTPUT_ATTR, report)
