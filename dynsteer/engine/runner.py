"""Per-runner glue: turn each vLLM step into a :class:`BatchView` and keep the request registry in sync.

Two runners exist in vLLM 0.26: the v1 ``GPUModelRunner`` (which the CPU runner derives from) and the GPU v2
``ModelRunner`` (default on GPU). Both get the same contract: release finished/preempted requests when the scheduler
says so, admit new ones on first sight (payload from ``SamplingParams.extra_args``), then fill the row index for the
step's row order, before the forward runs (and so before CUDA-graph replay).
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

import numpy as np

from dynsteer.engine import patching
from dynsteer.engine.adapters import find_runtime
from dynsteer.engine.keys import (ABORTS_ATTR, ACTS_ATTR, COMMANDS_ATTR, PAYLOAD_KEY, REPORTS_ATTR,
                                  RUNNER_REQUESTS_ATTR, RUNTIME_ATTR, STEP_ATTR, STOPS_ATTR)
from dynsteer.steering.runtime import BatchView, SteeringRuntime

logger = logging.getLogger("dynsteer")
_UNSET = object()
# why each runner method is patched (both runners get the same, under their own method names)
_RELEASE = "release finished and preempted requests' rows; apply the step's monitor commands"
_PLAN = "plan the step's steering rows (a BatchView)"
_AFTER_FORWARD = "once the forward is enqueued: start copying captured rows and read-backs out"
_UNSAMPLED = "a step without sampling reports too (stops, acts, report values)"


def runtime_of(runner: Any) -> SteeringRuntime | None:
    """The runtime of ``runner``'s model (None: no model yet, or one dynsteer did not hook)."""
    rt = runner.__dict__.get(RUNTIME_ATTR, _UNSET)
    if rt is _UNSET:
        model = runner.__dict__.get("model")
        if model is None:
            return None
        rt = find_runtime(model)
        setattr(runner, RUNTIME_ATTR, rt)
    return rt


def _payload(sampling_params: Any) -> Any:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(PAYLOAD_KEY)


def attach(output: Any, attr: str, value: Any) -> Any:
    """``output`` (a runner's step output, possibly async-wrapped) carrying ``value`` as ``attr`` for the scheduler.

    Returns the object to hand back to vLLM: the shared empty output is copied rather than mutated.
    """
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy.copy(output)
    for wrapped in ("_model_runner_output", "model_runner_output"):  # v1 async / v2 async wrappers
        inner = getattr(output, wrapped, None)
        if inner is not None:
            if inner is EMPTY_MODEL_RUNNER_OUTPUT:
                inner = copy.copy(inner)
                setattr(output, wrapped, inner)
            setattr(inner, attr, value)
            return output
    setattr(output, attr, value)
    return output


def _report(runner: Any, output: Any) -> Any:
    """Attach to the step's output the requests this rank stopped (the scheduler finishes them), where dynamic
    steering acted (the scheduler folds it into block hashes) and the report values landed (the scheduler forwards
    them to the frontend). A step that samples reports from ``sample_tokens``; one that returns from
    ``execute_model`` without sampling (nothing scheduled: the step telling the workers which requests finished, or
    the steps the scheduler runs while a finished request's report values are in flight) reports from there."""
    rt = runtime_of(runner)
    if rt is None or output is None:
        return output
    acts = rt.take_acts()
    if acts:
        output = attach(output, ACTS_ATTR, acts)
    aborts = rt.take_aborts()
    if aborts:
        output = attach(output, ABORTS_ATTR, aborts)
    if rt.stops:
        output = attach(output, STOPS_ATTR, rt.take_stops())
    reports = rt.take_reports()
    if reports:
        output = attach(output, REPORTS_ATTR, reports)
    return output


def _zero_on_reuse(runner: Any) -> None:
    """Build vLLM's KV-block zeroer on GPU runners when vLLM itself did not (it does only for Mamba models): the
    scheduler asks the workers to zero the blocks of requests dynsteer stopped (``engine.scheduler``). The CPU
    runner zeroes blocks without one."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) != "cuda" or not hasattr(runner, "_init_kv_zero_meta"):
        return
    if getattr(runner, "kv_block_zeroer", None) is None and not hasattr(runner, "_kv_block_zeroer"):
        runner._init_kv_zero_meta()


def _patch_outputs(cls: type) -> None:
    """Both runners: report stopped requests with each step's output; zero stopped requests' blocks on reuse."""
    orig_sample, orig_init_kv = cls.sample_tokens, cls.initialize_kv_cache

    @functools.wraps(orig_sample)
    def sample_tokens(self: Any, *a: Any, **k: Any) -> Any:
        return _report(self, orig_sample(self, *a, **k))

    @functools.wraps(orig_init_kv)
    def initialize_kv_cache(self: Any, *a: Any, **k: Any) -> Any:
        out = orig_init_kv(self, *a, **k)
        _zero_on_reuse(self)
        return out

    patching.patch(cls, "sample_tokens", sample_tokens,
                   why="report the requests this rank stopped or aborted, and where dynamic steering acted")
    patching.patch(cls, "initialize_kv_cache", initialize_kv_cache,
                   why="a KV-block zeroer, so the blocks of requests dynsteer stopped are zeroed before reuse")


def _release(rt: SteeringRuntime, scheduler_output: Any) -> None:
    """Start of a step on this worker: drop finished/preempted requests, apply the step's monitor commands."""
    rt.release(scheduler_output.finished_req_ids, finished=True)
    if scheduler_output.preempted_req_ids:
        rt.release(scheduler_output.preempted_req_ids, finished=False)
    step = getattr(scheduler_output, STEP_ATTR, None)
    commands = getattr(scheduler_output, COMMANDS_ATTR, None)
    if step is not None or commands:
        rt.begin_step(step, commands)


# ---- v1 runner (CPU, and GPU with VLLM_USE_V2_MODEL_RUNNER=0) ---------------------------------------------------
def v1_batch_view(runner: Any, num_scheduled_tokens: np.ndarray) -> BatchView:
    batch = runner.input_batch
    n = batch.num_reqs
    qsl = np.zeros(n + 1, np.int64)
    np.cumsum(num_scheduled_tokens[:n], out=qsl[1:])
    return BatchView(req_ids=batch.req_ids[:n], query_start_loc=qsl,
                     num_computed=batch.num_computed_tokens_cpu[:n], prompt_lens=batch.num_prompt_tokens[:n],
                     num_tokens=int(qsl[-1]), num_tokens_padded=int(qsl[-1]))


def patch_v1_runner(cls: type) -> None:
    orig_update, orig_prepare, orig_forward = cls._update_states, cls._prepare_inputs, cls._model_forward
    _patch_outputs(cls)

    @functools.wraps(orig_update)
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        rt = runtime_of(self)
        if rt is not None:
            _release(rt, scheduler_output)
        return orig_update(self, scheduler_output)

    @functools.wraps(orig_forward)
    def _model_forward(self: Any, *a: Any, **k: Any) -> Any:
        out = orig_forward(self, *a, **k)
        rt = runtime_of(self)
        if rt is not None:
            rt.after_forward()
        return out

    @functools.wraps(orig_prepare)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray, *a: Any, **k: Any):
        out = orig_prepare(self, scheduler_output, num_scheduled_tokens, *a, **k)
        rt = runtime_of(self)
        if rt is not None:
            requests = self.requests
            rt.plan(v1_batch_view(self, num_scheduled_tokens),
                    lambda req_id: _payload(requests[req_id].sampling_params))
        return out

    orig_execute = cls.execute_model

    @functools.wraps(orig_execute)
    def execute_model(self: Any, *a: Any, **k: Any) -> Any:
        return _report(self, orig_execute(self, *a, **k))

    patching.patch(cls, "execute_model", execute_model, why=_UNSAMPLED)
    patching.patch(cls, "_update_states", _update_states, why=_RELEASE)
    patching.patch(cls, "_prepare_inputs", _prepare_inputs, why=_PLAN)
    patching.patch(cls, "_model_forward", _model_forward, why=_AFTER_FORWARD)


# ---- v2 runner (GPU default) -------------------------------------------------------------------------------------
class _PromptLens:
    """A v2 batch's prompt lengths, looked up by index only for the requests the runtime admits (building an array
    of all of them at every step was per-request Python in each decode step)."""

    __slots__ = ("ids", "state")

    def __init__(self, ids: Any, state: dict[str, tuple[Any, int]]) -> None:
        self.ids, self.state = ids, state

    def __getitem__(self, i: int) -> int:
        return self.state[self.ids[i]][1]


def v2_batch_view(input_batch: Any, state: dict[str, tuple[Any, int]]) -> BatchView:
    """``state``: request id -> (payload, prompt length), recorded when vLLM added the request."""
    n = input_batch.num_reqs
    ids = input_batch.req_ids[:n]
    return BatchView(req_ids=ids, query_start_loc=input_batch.query_start_loc_np[: n + 1],
                     num_computed=input_batch.num_computed_tokens_np[:n], prompt_lens=_PromptLens(ids, state),
                     num_tokens=int(input_batch.num_tokens),
                     num_tokens_padded=int(input_batch.num_tokens_after_padding))


def patch_v2_runner(cls: type) -> None:
    """v2 keeps no request → SamplingParams map: record the payload and prompt length when requests are added."""
    orig_finish, orig_add, orig_prepare = cls.finish_requests, cls.add_requests, cls.prepare_inputs
    orig_execute = cls.execute_model
    _patch_outputs(cls)

    def _state(self: Any) -> dict[str, tuple[Any, int]]:
        return self.__dict__.setdefault(RUNNER_REQUESTS_ATTR, {})

    @functools.wraps(orig_finish)
    def finish_requests(self: Any, scheduler_output: Any) -> Any:
        state = _state(self)
        for req_id in scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set()):
            state.pop(req_id, None)
        rt = runtime_of(self)
        if rt is not None:
            _release(rt, scheduler_output)
        return orig_finish(self, scheduler_output)

    @functools.wraps(orig_execute)
    def execute_model(self: Any, *a: Any, **k: Any) -> Any:
        out = orig_execute(self, *a, **k)
        rt = runtime_of(self)
        if rt is not None:
            rt.after_forward()  # the forward is enqueued; a dummy run selected nothing, so this is a no-op
        return _report(self, out)

    @functools.wraps(orig_add)
    def add_requests(self: Any, scheduler_output: Any) -> Any:
        state = _state(self)
        for new in scheduler_output.scheduled_new_reqs:
            state[new.req_id] = (_payload(new.sampling_params), len(new.prompt_token_ids or ()))
        return orig_add(self, scheduler_output)

    @functools.wraps(orig_prepare)
    def prepare_inputs(self: Any, scheduler_output: Any, *a: Any, **k: Any) -> Any:
        input_batch = orig_prepare(self, scheduler_output, *a, **k)
        rt = runtime_of(self)
        if rt is not None:
            state = _state(self)
            view = v2_batch_view(input_batch, state)
            rt.plan(view, lambda req_id: state[req_id][0])
        return input_batch

    patching.patch(cls, "finish_requests", finish_requests, why=_RELEASE)
    patching.patch(cls, "add_requests", add_requests, why="record each new request's payload and prompt length")
    patching.patch(cls, "prepare_inputs", prepare_inputs, why=_PLAN)
    patching.patch(cls, "execute_model", execute_model, why=f"{_AFTER_FORWARD}; {_UNSAMPLED}")
