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

On a GPU a token's values reach the engine core with the output of the step after the token's (the workers do not
wait for the current step's read-back). So a report request's tokens after the first arrive one step late (other
requests' do not): the engine core holds a report request's *final* output until its last values have arrived
(running empty steps while it holds one, which is what lets the workers' read-backs land and be sent), and the
frontend holds a streamed delta until the values of its tokens have arrived, then delivers it (merged with the
deltas that became ready with it).
A request without a report costs one empty-dict check per step in the workers and the engine core, and nothing per
output in the frontend (only a report request's state runs dynsteer's ``make_request_output``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from dynsteer.engine import patching
from dynsteer.engine.keys import PAYLOAD_KEY, REPORT_OUTPUT_ATTR, REPORT_PARAMS_KEY, REPORT_STASH_ATTR
from dynsteer.request.payload import decode_payload
from dynsteer.spec import SteeringValidationError
from dynsteer.trace import ReportValues, merge_reports


# ---- engine core ---------------------------------------------------------------------------------------------------
@dataclass
class _Coverage:
    """How far a request's values have arrived: what :meth:`ReportValues.covered` reads, without the values (the
    engine core forwards them; it keeps none)."""

    prompt_len: int
    upto: int = 0  # every position below has arrived (positions arrive in order)
    done: bool = False

    def add(self, delta: dict) -> None:
        positions = delta.get("position")
        if positions:
            self.upto = max(self.upto, int(positions[-1]) + 1)
        self.done = self.done or bool(delta.get("done"))

    covered = ReportValues.covered


@dataclass
class _Buffer:
    prompt_len: int
    values: _Coverage = field(init=False)
    pending: dict[str, Any] = field(default_factory=dict)  # values not yet sent to the frontend
    tokens: int = 0  # output tokens sent so far
    held: tuple[int, Any] | None = None  # (client index, final EngineCoreOutput) waiting for its values
    freed: bool = False

    def __post_init__(self) -> None:
        self.values = _Coverage(self.prompt_len)


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
            if not buf.pending:  # the usual case (all sent with the last output): the delta is the pending values
                buf.pending = delta  # (the workers hand each step's deltas over and keep none)
                continue
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
    tokens: int = 0  # output tokens received so far
    made: int = 0  # output tokens in the outputs made so far (streamed: held or delivered)
    # streamed deltas waiting for their tokens' values, oldest first: (RequestOutput, first token, end token)
    held: list[tuple[Any, int, int]] = field(default_factory=list)


def patch_output_processor(module: Any) -> None:
    """``vllm.v1.engine.output_processor``: a report request's state (only its: switched on when vLLM adds it, so
    other requests run vLLM's own method) pops report values from ``kv_transfer_params`` and writes each output's
    report on its ``CompletionOutput`` (``RequestState.make_request_output``)."""
    import types

    from vllm.sampling_params import RequestOutputKind

    orig_make = module.RequestState.make_request_output
    orig_new_completion = module.RequestState._new_completion_output
    orig_add_request = module.OutputProcessor.add_request

    def make_request_output(self: Any, new_token_ids: Any, pooling_output: Any, finish_reason: Any,
                            stop_reason: Any, kv_transfer_params: Any = None, *a: Any, **k: Any) -> Any:
        stash = self.__dict__[REPORT_STASH_ATTR]
        if kv_transfer_params and REPORT_PARAMS_KEY in kv_transfer_params:
            kv_transfer_params = dict(kv_transfer_params)
            stash.values.add(kv_transfer_params.pop(REPORT_PARAMS_KEY))
            kv_transfer_params = kv_transfer_params or None
        stash.tokens += len(new_token_ids or ())
        out = orig_make(self, new_token_ids, pooling_output, finish_reason, stop_reason, kv_transfer_params, *a, **k)
        if out is None or self.output_kind != RequestOutputKind.DELTA:  # whole outputs: see _new_completion_output
            return out
        finished = finish_reason is not None
        abort = _abort(finish_reason, stop_reason)
        # Streamed: deltas wait, in order, for their tokens' values; the ones whose values have all arrived go out
        # now, merged into one (a late token holds back only the deltas from its own on).
        stash.held.append((out, stash.made, stash.tokens))
        stash.made = stash.tokens
        ready = 0
        while ready < len(stash.held) and (finished or stash.values.covered(stash.held[ready][2])):
            ready += 1
        if not ready:
            return None
        first, start, _ = stash.held[0]
        end = stash.held[ready - 1][2]
        for later, _, _ in stash.held[1:ready]:
            first.add(later, aggregate=True)
        del stash.held[:ready]
        _write(first, self.request_index, stash.values.json(start, end, finished and not stash.held, abort))
        return first

    def new_completion_output(self: Any, token_ids: Any, finish_reason: Any, stop_reason: Any) -> Any:
        # A whole output (not streamed) carries its whole report, written as vLLM makes it: with n > 1 a parent
        # request hands out its samples' outputs only once all are done, each made by its own request state.
        out = orig_new_completion(self, token_ids, finish_reason, stop_reason)
        if self.output_kind != RequestOutputKind.DELTA:
            stash = self.__dict__[REPORT_STASH_ATTR]
            finished = finish_reason is not None
            report = stash.values.json(0, stash.tokens, finished, _abort(finish_reason, stop_reason))
            if report is not None:
                setattr(out, REPORT_OUTPUT_ATTR, report)
        return out

    @functools.wraps(orig_add_request)
    def add_request(self: Any, request: Any, *a: Any, **k: Any) -> Any:
        out = orig_add_request(self, request, *a, **k)
        kind = _report_kind(request)
        state = self.request_states.get(request.request_id) if kind else None
        if state is not None and REPORT_STASH_ATTR not in state.__dict__:
            values = ReportValues(len(state.prompt_token_ids or ()))
            values.kind = kind
            state.__dict__[REPORT_STASH_ATTR] = _Stash(values)
            patching.Switch(state, "make_request_output", types.MethodType(make_request_output, state),
                            why="a report request's outputs: take dynsteer's values out of kv_transfer_params; "
                                "streamed deltas wait for their tokens' values").set(True)
            patching.Switch(state, "_new_completion_output", types.MethodType(new_completion_output, state),
                            why="a report request's whole output carries its report").set(True)
        return out

    patching.patch(module.OutputProcessor, "add_request", add_request,
                   why="a request that asked for a report gets its report-writing make_request_output")

    from vllm.outputs import RequestOutput

    orig_add = RequestOutput.add

    @functools.wraps(orig_add)
    def add(self: Any, next_output: Any, aggregate: bool) -> None:
        reports = {c.index: r for c in next_output.outputs
                   if (r := getattr(c, REPORT_OUTPUT_ATTR, None)) is not None}
        merged = {c.index: c for c in self.outputs} if reports and aggregate else {}  # (others are appended)
        orig_add(self, next_output, aggregate)
        for index, c in merged.items():
            if index in reports:
                setattr(c, REPORT_OUTPUT_ATTR, merge_reports(getattr(c, REPORT_OUTPUT_ATTR, None), reports[index]))

    patching.patch(RequestOutput, "add", add, why="merged streamed outputs merge their dynsteer reports too")


def _abort(finish_reason: Any, stop_reason: Any) -> str | None:
    """The reason a request was aborted with (a policy's abort rule, a stop): its ``stop_reason``."""
    return stop_reason if str(finish_reason) == "abort" and isinstance(stop_reason, str) else None


def _write(out: Any, index: int, report: dict | None) -> None:
    if report is None:
        return
    for completion in out.outputs:
        if completion.index == index:
            setattr(completion, REPORT_OUTPUT_ATTR, report)


def _report_kind(request: Any) -> str | None:
    """The report a request's payload asks for (``None``: none, or no valid payload: admission refused those)."""
    params = getattr(request, "sampling_params", None)
    payload = ((params.extra_args if params is not None else None) or {}).get(PAYLOAD_KEY)
    if payload is None:
        return None
    try:
        return decode_payload(payload).report  # memoised per payload body
    except SteeringValidationError:
        return None
