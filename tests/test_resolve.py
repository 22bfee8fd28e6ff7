"""The precedence rule global < request < command (``dynsteer.request.resolve``), and its three callers agreeing.

A table of every meaningful combination of {no global, global spec, global policy} x {no request, request spec,
request policy} x {no command, steer, clearing steer, threshold, rule}: the effective specs per phase and the
effective policy. Then the frontend's admission, the engine core's command desk and a worker runtime, fed the same
inputs, compile the same rows. No engine.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

import dynsteer.engine.command_desk as desk_module
from dynsteer.commands import CommandEnvelope, RuleCommand, SteerCommand, ThresholdCommand
from dynsteer.config import DynsteerConfig, MonitorConfig
from dynsteer.engine.command_desk import CommandDesk
from dynsteer.engine.frontend import FrontendState
from dynsteer.engine.keys import PAYLOAD_KEY, ROWS_KEY
from dynsteer.engine.scheduler import SchedulerState
from dynsteer.policy import Action, DynamicSteeringPolicy, ProbeGate, Rule
from dynsteer.request.compile_spec import compile_phase
from dynsteer.request.payload import encode_payload
from dynsteer.request.resolve import (COMMAND_POLICY, COMMAND_SPEC, GLOBAL_POLICY, GLOBAL_SPEC, NO_COMMAND,
                                      REQUEST_POLICY, REQUEST_SPEC, Configuration, apply_command, check_global,
                                      resolve)
from dynsteer.spec import AddVector, ModelShape, ProjectionClamp, SteeringSpec, SteeringValidationError
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.tables import SteeringTables

H = 16
SHAPE = ModelShape(num_layers=4, hidden_size=H, sites=("post_block",), max_gates=2, max_clamps=2)
RNG = np.random.default_rng(7)
NAMED = {"v": RNG.standard_normal(H).astype(np.float32)}


def _vec(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(H).astype(np.float32)


def _policy(threshold: float, seed: int, rules: bool = True) -> DynamicSteeringPolicy:
    direction = _vec(seed)
    mon = ProbeGate(name="m", layer=1, site="post_block", direction=direction / np.linalg.norm(direction),
                  sharpness=2.0, threshold=threshold)
    rule = Rule(monitor="m", actions=[Action(kind="add", layer=2, site="post_block", vector=_vec(seed + 1))])
    return DynamicSteeringPolicy(monitors=[mon], rules=[rule] if rules else [])


G_SPEC = SteeringSpec(vectors=[AddVector(layer=0, site="post_block", vector="v", scale=0.5)])  # base tier
R_SPEC = SteeringSpec(vectors=[AddVector(layer=1, site="post_block", vector=_vec(1), tier="decode")],
                      clamps=[ProjectionClamp(layer=2, site="post_block", direction=_vec(2), hi=1.0)])
C_SPEC = SteeringSpec(vectors=[AddVector(layer=3, site="post_block", vector=_vec(3), tier="decode")])
G_POLICY, R_POLICY = _policy(0.5, 10), _policy(-0.5, 20)

GLOBALS = {"no global": Configuration(), "global spec": Configuration(G_SPEC),
           "global policy": Configuration(policy=G_POLICY)}
REQUESTS = {"no request": None, "request spec": Configuration(R_SPEC), "request policy": Configuration(policy=R_POLICY)}
COMMANDS: dict[str, Any] = {
    "no command": None,
    "steer": SteerCommand(request="r", spec=C_SPEC),
    "clearing steer": SteerCommand(request="r", spec=None),
    "threshold": ThresholdCommand(request="r", monitor="m", threshold=3.0),
    "rule": RuleCommand(request="r", rule=0, enabled=False),
}

# Expected, by dimension: which sources' specs apply (both phases; the command's in decode only) and whose policy.
SPECS = {"global spec": [(GLOBAL_SPEC, G_SPEC)], "request spec": [(REQUEST_SPEC, R_SPEC)]}
POLICY = {"global policy": (GLOBAL_POLICY, G_POLICY), "request policy": (REQUEST_POLICY, R_POLICY)}
CASES = list(itertools.product(GLOBALS, REQUESTS, COMMANDS))


@pytest.mark.parametrize(("glob", "req", "cmd"), CASES, ids=[" / ".join(c) for c in CASES])
def test_the_table_of_cases(glob, req, cmd):
    base_policy = POLICY.get(req) or POLICY.get(glob)  # a request's policy replaces the global one, never merges
    command = COMMANDS[cmd]
    patch = NO_COMMAND
    if command is not None:
        if cmd in ("threshold", "rule") and base_policy is None:
            with pytest.raises(SteeringValidationError, match="command.request: the request has no dynamic policy"):
                apply_command(NO_COMMAND, command, GLOBALS[glob], REQUESTS[req])
            return
        patch = apply_command(NO_COMMAND, command, GLOBALS[glob], REQUESTS[req])
    effective = resolve(GLOBALS[glob], REQUESTS[req], patch)

    static = SPECS.get(glob, []) + SPECS.get(req, [])
    assert effective.phase_specs("prefill") == static
    assert effective.phase_specs("decode") == static + ([(COMMAND_SPEC, C_SPEC)] if cmd == "steer" else [])
    if base_policy is None:
        assert effective.policy is None and effective.policy_entry is None and not effective.gates
        return
    field, policy = base_policy
    if cmd == "threshold":
        assert effective.policy_field == COMMAND_POLICY
        assert effective.policy.monitors[0].threshold == 3.0
        assert effective.policy.monitors[0].direction is policy.monitors[0].direction  # only the threshold moved
        assert effective.policy.rules == policy.rules
    elif cmd == "rule":
        assert effective.policy_field == COMMAND_POLICY
        assert not effective.policy.rules[0].enabled and effective.policy.monitors == policy.monitors
    else:
        assert (effective.policy_field, effective.policy) == (field, policy)
    assert effective.gates and effective.gated_policy == (effective.policy_field, effective.policy)


def test_a_later_steer_replaces_the_earlier_and_an_empty_one_clears():
    g, r = GLOBALS["global spec"], REQUESTS["request spec"]
    other = SteeringSpec(vectors=[AddVector(layer=2, site="post_block", vector=_vec(4), tier="decode")])
    patch = apply_command(NO_COMMAND, SteerCommand(request="r", spec=C_SPEC), g, r)
    patch = apply_command(patch, SteerCommand(request="r", spec=other), g, r)
    assert resolve(g, r, patch).command_specs == ((COMMAND_SPEC, other),)
    for clear in (SteerCommand(request="r", spec=None), SteerCommand(request="r", spec=SteeringSpec())):
        cleared = apply_command(patch, clear, g, r)
        assert cleared == NO_COMMAND and cleared.empty
        assert resolve(g, r, cleared) == resolve(g, r)


def test_commands_patch_on_top_of_each_other_and_a_steer_keeps_the_patched_policy():
    g, r = GLOBALS["global policy"], REQUESTS["no request"]
    patch = apply_command(NO_COMMAND, ThresholdCommand(request="r", monitor="m", threshold=1.0), g, r)
    patch = apply_command(patch, RuleCommand(request="r", rule=0, enabled=False), g, r)
    patch = apply_command(patch, SteerCommand(request="r", spec=C_SPEC), g, r)
    effective = resolve(g, r, patch)
    assert effective.policy.monitors[0].threshold == 1.0 and not effective.policy.rules[0].enabled
    assert effective.command_specs == ((COMMAND_SPEC, C_SPEC),)
    assert resolve(g, r).policy is G_POLICY  # the global itself is untouched
    with pytest.raises(SteeringValidationError, match="command.monitor: unknown monitor 'x'"):
        apply_command(patch, ThresholdCommand(request="r", monitor="x", threshold=1.0), g, r)


def test_a_request_policy_that_gates_nothing_still_replaces_the_global_one():
    quiet = _policy(0.0, 30, rules=False)
    effective = resolve(GLOBALS["global policy"], Configuration(policy=quiet))
    assert effective.policy is quiet and not effective.gates
    assert effective.policy_entry == (REQUEST_POLICY, quiet) and effective.gated_policy is None


def test_empty_specs_are_left_out_and_tiers_pick_the_phase():
    prefill_only = SteeringSpec(vectors=[AddVector(layer=0, site="post_block", vector="v", tier="prefill")])
    effective = resolve(Configuration(prefill_only), Configuration(SteeringSpec()))
    assert effective.specs == ((GLOBAL_SPEC, prefill_only),)
    prefill = compile_phase(effective.phase_specs("prefill"), "prefill", SHAPE, NAMED)
    decode = compile_phase(effective.phase_specs("decode"), "decode", SHAPE, NAMED)
    assert prefill.digest and not decode.digest  # prefill steering forks the prompt's cache key; decode is plain


def test_prompt_level_monitors_are_seen():
    policy = _policy(0.0, 40)
    prompt = policy.model_copy(update={"monitors": (policy.monitors[0].model_copy(update={"reads": "prompt_mean"}),)})
    assert not resolve(Configuration(policy=policy)).reads_prompt
    effective = resolve(Configuration(), Configuration(policy=prompt))
    assert effective.reads_prompt and effective.prompt_mean


def test_check_global_names_the_global_fields():
    bad = SteeringSpec(vectors=[AddVector(layer=0, site="post_block", vector="missing")])
    with pytest.raises(SteeringValidationError, match=r"^global\.vectors\[0\]\.vector"):
        check_global(Configuration(bad), SHAPE, NAMED)
    check_global(Configuration(G_SPEC, G_POLICY), SHAPE, NAMED)


# ---- the three callers agree ---------------------------------------------------------------------------------------

class _Params:
    def __init__(self, extra: dict[str, Any]) -> None:
        self.extra_args = extra


class _Request:
    def __init__(self, request_id: str, extra: dict[str, Any]) -> None:
        self.request_id, self.sampling_params = request_id, _Params(extra)
        self.num_computed_tokens, self.num_prompt_tokens, self.cache_salt, self.block_hashes = 12, 8, None, []

    def is_finished(self) -> bool:
        return False

    def update_block_hashes(self) -> None:
        pass


class _Scheduler:
    def __init__(self, request: _Request) -> None:
        self.requests = {request.request_id: request}
        self._dynsteer = SchedulerState(capacity=15)


@pytest.fixture
def desk(monkeypatch):
    state = FrontendState(SHAPE, dict(NAMED))
    monkeypatch.setattr(desk_module, "build_frontend_state", lambda vllm_config: state)
    made = CommandDesk(DynsteerConfig(monitor=MonitorConfig.private()), None)
    yield made
    made.close()


def _runtime() -> SteeringRuntime:
    tables = SteeringTables([(l, "post_block") for l in range(4)], H, num_rows=16, max_clamps=2, max_tokens=16,
                            max_gates=2)
    rt = SteeringRuntime(SHAPE, tables)
    rt.register_vector("v", NAMED["v"])
    return rt


AGREE = [c for c in CASES if not (c[2] in ("threshold", "rule") and "policy" not in c[0] + c[1])]


@pytest.mark.parametrize(("glob", "req", "cmd"), AGREE, ids=[" / ".join(c) for c in AGREE])
def test_frontend_engine_core_and_worker_agree(desk, glob, req, cmd):
    g, r = GLOBALS[glob], REQUESTS[req]
    payload = None if r is None else encode_payload(r.spec, policy=r.policy)
    front = desk.state
    front.set_global(g.spec or SteeringSpec(), front.check_global(g.spec or SteeringSpec(), g.policy))
    salt, static_decode, rows, dynamic, _ = front.admit_uncached(payload)
    prefill, decode = rows.split(",")
    assert salt == prefill  # no prompt-level monitor here: the prompt's cache key is its prefill row
    assert (static_decode == decode) == (not dynamic)

    rt = _runtime()
    rt.set_global(g.spec or SteeringSpec(), g.policy)
    entry = rt.admit("r", payload, prompt_len=4)
    assert entry.error is None, entry.error
    assert (entry.prefill.digest.hex(), entry.decode.digest.hex()) == (prefill, decode)
    assert (rt.registry.effective_policy(entry) is not None) == dynamic

    command = COMMANDS[cmd]
    if command is None:
        return
    extra = {ROWS_KEY: rows} if payload is None else {PAYLOAD_KEY: payload, ROWS_KEY: rows}
    request = _Request("r", extra)
    wire = desk._apply(_Scheduler(request), CommandEnvelope(id="c", monitor="mon", command=command))
    desk_decode = request.sampling_params.extra_args[ROWS_KEY].split(",")[1]
    rt.apply_command(wire["command"])
    entry = rt.requests["r"]
    assert entry.error is None, entry.error
    assert entry.decode.digest.hex() == desk_decode
    assert entry.prefill.digest.hex() == prefill  # commands never touch the prompt's row
    expected = resolve(g, None if r is None else Configuration(r.spec, r.policy),
                       apply_command(NO_COMMAND, command, g, r))
    assert desk_decode == compile_phase(expected.phase_specs("decode"), "decode", SHAPE, NAMED,
                                        expected.gated_policy).digest.hex()
    if cmd == "steer":
        assert desk_decode != decode
    if cmd == "clearing steer":
        assert desk_decode == decode
