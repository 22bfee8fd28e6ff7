"""The user-facing control surface for a ``vllm.LLM``: global steering, named vectors, per-request steering.

Example:
    >>> from vllm import LLM, SamplingParams                       # doctest: +SKIP
    >>> import dynsteer                                              # doctest: +SKIP
    >>> llm = LLM("model-dir")                                       # doctest: +SKIP
    >>> steerer = dynsteer.attach(llm)                               # doctest: +SKIP
    >>> steerer.set_layer_vector(15, vector, scale=4.0)              # every request, every token
    >>> with steerer.steering(other_spec):                           # temporarily, restored on exit
    ...     outs = steerer.generate(prompts, SamplingParams(max_tokens=32))
    >>> outs = steerer.generate(prompts, params, steering=[spec_a, None])  # per request, one batch
    >>> steerer.detach()
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


from dynsteer.capture.result import Capture, host_id, merge_captures, unpack_records
from dynsteer.capture.spec import CaptureSpec
from dynsteer.engine import keys
from dynsteer.engine.frontend import state_of
from dynsteer.request.payload import PAYLOAD_KEY, ReportKind, encode_payload, with_tag
from dynsteer.policy import DynamicSteeringPolicy, RelativeDoseLimit
from dynsteer.spec import (AddVector, Ablation, ModelShape, ProjectionClamp, Site, SteeringSpec,
                           SteeringValidationError, Tier, VectorSource, check_name, check_vector)
from dynsteer.trace import DynamicTrace
from dynsteer.vectors import as_vector, pack_vector

PolicyArg = DynamicSteeringPolicy | Sequence[DynamicSteeringPolicy | None] | None


def steer_params(sampling_params: Any, spec: SteeringSpec | None, tag: str | None = None,
                 capture: CaptureSpec | None = None, policy: DynamicSteeringPolicy | None = None, *,
                 payload: str | None = None) -> Any:
    """A copy of ``sampling_params`` carrying ``spec`` (and ``capture``, ``policy``) for this request.

    Works for any client that submits ``SamplingParams`` (``LLM``, ``AsyncLLM``, ``LLMEngine.add_request``).
    With nothing to carry it is a plain copy. ``payload``: an already packed body to reuse instead of encoding.
    """
    params = sampling_params.clone()
    if payload is None and ((spec is not None and not spec.is_empty()) or capture is not None or policy is not None
                            or tag is not None):
        payload = encode_payload(spec, None, capture, policy)
    if payload is not None:
        params.extra_args = {**(params.extra_args or {}), PAYLOAD_KEY: with_tag(payload, tag)}
    return params


class Steerer:
    """Steering control attached to one ``vllm.LLM``. Create it with :func:`attach`."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        info = self._rpc(keys.RPC_DESCRIBE)
        self.shape = ModelShape.model_validate(info["shape"])
        self._front = state_of(llm)
        self._dose_limit: RelativeDoseLimit | None = None

    # ---- introspection --------------------------------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """Per-rank runtime state (rows in use, counters, named vectors)."""
        return self.llm.collective_rpc(keys.RPC_DESCRIBE)

    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def capture_places(self) -> set[tuple[int, str]]:
        """The (layer, site) places this engine has capture buffers for (DynsteerConfig.capture_sites/layers)."""
        return set(self._front.capture_places)

    # ---- global spec ----------------------------------------------------------------------------------------------
    def export_steering_spec(self) -> SteeringSpec:
        """The current global spec (immutable; safe to keep and re-apply later)."""
        return self._front.global_spec

    def apply_steering_spec(self, spec: SteeringSpec) -> None:
        """Replace the global spec on every rank (validated first: a bad spec changes nothing)."""
        self._set_global(spec, self._front.global_policy)

    # ---- global dynamic policy ------------------------------------------------------------------------------------
    def set_policy(self, policy: DynamicSteeringPolicy | None) -> None:
        """Apply ``policy`` to every request without its own (``None`` removes it); validated first.

        Probe-file monitors are loaded here. Requests already running switch to the new policy at their next step.
        """
        self._set_global(self._front.global_spec, None if policy is None else self._dose_checked(policy.resolved()))

    def set_dose_limit(self, limit: RelativeDoseLimit | float | str | os.PathLike[str] | Any | None, *,
                       mode: str = "clip") -> RelativeDoseLimit | None:
        """The ``max_relative_dose`` of every policy this steerer sends without one of its own (``None`` removes it).

        ``limit``: a relative dose (a number, with ``mode`` ``clip`` or ``reject``), a :class:`RelativeDoseLimit`, or
        a dose recommendation: the JSON file ``dynsteer dose recommend --out`` writes, or the
        :class:`~dynsteer.sweep.dose_search.DoseRecommendation` ``recommend_dose`` returns (its recommended dose).
        A policy's own ``max_relative_dose`` wins. Returns the limit now in force.

        Raises:
            ValueError: a recommendation without a dose (no dose it tried kept replies fluent), or a file that is not
                one.
        """
        if limit is None or isinstance(limit, RelativeDoseLimit):
            self._dose_limit = limit
            return limit
        if isinstance(limit, (str, os.PathLike)):
            import json

            try:
                limit = json.loads(Path(limit).read_text())["dose"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"limit: {limit} is not a dose recommendation file ({exc})") from None
            if limit is None:
                raise ValueError("limit: the recommendation has no dose (no dose it tried kept replies fluent)")
        elif hasattr(limit, "dose") and hasattr(limit, "steps"):
            if limit.dose is None:
                raise ValueError("limit: the recommendation has no dose (no dose it tried kept replies fluent)")
            limit = limit.dose
        self._dose_limit = RelativeDoseLimit.model_validate({"limit": limit, "mode": mode})
        return self._dose_limit

    def export_policy(self) -> DynamicSteeringPolicy | None:
        """The current global policy."""
        return self._front.global_policy

    def clear_policy(self) -> None:
        self.set_policy(None)

    @contextlib.contextmanager
    def policy(self, policy: DynamicSteeringPolicy) -> Iterator["Steerer"]:
        """Apply ``policy`` globally for the duration of the block; the previous policy is restored even on error."""
        previous = self.export_policy()
        self.set_policy(policy)
        try:
            yield self
        finally:
            self.set_policy(previous)

    def _set_global(self, spec: SteeringSpec, policy: DynamicSteeringPolicy | None) -> None:
        admitted = self._front.check_global(spec, policy)  # raises naming the field; nothing changes then
        self.llm.collective_rpc(keys.RPC_SET_GLOBAL, args=(encode_payload(spec, policy=policy),))
        self._front.set_global(spec, admitted)

    @contextlib.contextmanager
    def steering(self, spec: SteeringSpec) -> Iterator["Steerer"]:
        """Apply ``spec`` globally for the duration of the block; the previous spec is restored even on error."""
        previous = self.export_steering_spec()
        self.apply_steering_spec(spec)
        try:
            yield self
        finally:
            self.apply_steering_spec(previous)

    def set_layer_vector(self, layer: int, vector: VectorSource | None, *, site: Site = "post_block",
                         tier: Tier = "base", scale: float = 1.0) -> None:
        """Set (replace) the additive vector at ``(layer, site, tier)``; ``None`` clears it."""
        spec = self.export_steering_spec().without(layer, site, ("add",), tier)
        if vector is not None:
            spec = spec.merged(SteeringSpec(vectors=(AddVector(layer=layer, site=site, tier=tier,
                                                               vector=self._vec(vector), scale=scale),)))
        self.apply_steering_spec(spec)

    def set_layer_projection_cap(self, layer: int, vector: VectorSource, *, min: float | None = None,
                                 max: float | None = None, site: Site = "post_block", tier: Tier = "base",
                                 strength: float = 1.0) -> None:
        """Clamp the projection on ``vector``'s direction into ``[min, max]`` at ``(layer, site, tier)``."""
        clamp = ProjectionClamp(layer=layer, site=site, tier=tier, direction=self._vec(vector), lo=min, hi=max,
                                strength=strength)
        self.apply_steering_spec(self.export_steering_spec().without(layer, site, ("clamp",), tier).merged(SteeringSpec(clamps=(clamp,))))

    def set_layer_ablation(self, layer: int, vector: VectorSource, *, scale: float = 1.0,
                           site: Site = "post_block", tier: Tier = "base") -> None:
        """Ablate ``vector``'s direction at ``(layer, site, tier)``; ``scale`` < 1 removes only that fraction."""
        ablation = Ablation(layer=layer, site=site, tier=tier, direction=self._vec(vector), strength=scale)
        self.apply_steering_spec(self.export_steering_spec().without(layer, site, ("ablate",), tier).merged(
            SteeringSpec(ablations=(ablation,))))

    def clear_layer_vector(self, layer: int, site: Site | None = None) -> None:
        self.apply_steering_spec(self.export_steering_spec().without(layer, site, ("add",)))

    def clear_layer_projection_cap(self, layer: int, site: Site | None = None) -> None:
        self.apply_steering_spec(self.export_steering_spec().without(layer, site, ("clamp",)))

    def clear_layer_ablation(self, layer: int, site: Site | None = None) -> None:
        self.apply_steering_spec(self.export_steering_spec().without(layer, site, ("ablate",)))

    def clear_all(self) -> None:
        """Remove every global entry (named vectors stay registered)."""
        self.apply_steering_spec(SteeringSpec())

    clear_all_vectors = clear_all

    # ---- named vectors ----------------------------------------------------------------------------------------------
    def register_vector(self, name: str, vector: Any) -> None:
        """Register a vector on every rank under ``name``; request payloads may then reference it by name.

        Raises:
            SteeringValidationError: naming ``name`` (a malformed name, or a new name over the engine's
                ``Limits.max_named_vectors``) or the vector; nothing changes anywhere then.
        """
        try:
            check_name(name, "vector name")
        except ValueError as exc:
            raise SteeringValidationError(f"name: {exc}") from None
        arr = check_vector(as_vector(vector), self.hidden_size, f"vector {name!r}")
        self._front.check_register(name)  # before the workers change (they would refuse too, rank by rank)
        self.llm.collective_rpc(keys.RPC_REGISTER_VECTOR, args=(name, pack_vector(arr)))
        self._front.register(name, arr)

    # ---- generation ---------------------------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, *,
                 steering: SteeringSpec | Sequence[SteeringSpec | None] | None = None,
                 capture: CaptureSpec | None = None, policy: PolicyArg = None, report: ReportKind | None = None,
                 **kwargs: Any) -> list[Any]:
        """``LLM.generate`` with per-request steering, dynamic policies and capture.

        Args:
            prompts: as for ``LLM.generate``.
            sampling_params: one ``SamplingParams`` or one per prompt.
            steering: one spec for all prompts, or one (or ``None``) per prompt.
            capture: capture these places for every prompt; each output then has ``output.capture``
                (a :class:`~dynsteer.capture.result.Capture`).
            policy: a dynamic policy for all prompts, or one (or ``None``: the global policy, if any) per prompt.
                With a request or global policy, each output has ``output.trace`` (a
                :class:`~dynsteer.trace.DynamicTrace`, or ``None`` for a request that ran without one).
            report: ``"summary"`` or ``"tokens"``: each ``CompletionOutput`` has ``.dynsteer``, the request's
                report (see :class:`~dynsteer.trace.ReportValues`).
        """
        params, tags = self._params(prompts, sampling_params, steering, capture=capture, policy=policy,
                                    report=report)
        return self._with_results(self.llm.generate(prompts, params, **kwargs), tags, capture, policy)

    def chat(self, messages: Any, sampling_params: Any = None, *,
             steering: SteeringSpec | Sequence[SteeringSpec | None] | None = None,
             capture: CaptureSpec | None = None, policy: PolicyArg = None, report: ReportKind | None = None,
             **kwargs: Any) -> list[Any]:
        """``LLM.chat`` with per-request steering, policies, capture and reports (``messages``: one conversation or a
        list)."""
        params, tags = self._params(messages, sampling_params, steering, chat=True, capture=capture, policy=policy,
                                    report=report)
        return self._with_results(self.llm.chat(messages, params, **kwargs), tags, capture, policy)

    def set_capture(self, spec: CaptureSpec | None) -> None:
        """Capture every request admitted from now on (results go to the engine's configured consumers)."""
        self.llm.collective_rpc(keys.RPC_SET_CAPTURE, args=(None if spec is None else spec.model_dump(mode="json"),))

    def take_captures(self, tags: Sequence[str]) -> dict[str, Capture]:
        """In-memory captures of finished requests, by payload tag (each can be taken once)."""
        replies = self.llm.collective_rpc(keys.RPC_TAKE_CAPTURES, args=(list(tags), host_id()))
        return merge_captures(unpack_records([rec for rank in replies for rec in rank]))

    def take_traces(self, tags: Sequence[str], all_ranks: bool = False) -> Any:
        """Dynamic-steering traces of finished requests, by payload tag (each can be taken once).

        Args:
            all_ranks: return one ``{tag: trace}`` dict per rank (every rank decides on its own; they must agree).
        """
        per_rank = [{t["tag"]: DynamicTrace.model_validate(t) for t in rank}
                    for rank in self.llm.collective_rpc(keys.RPC_TAKE_TRACES, args=(list(tags),))]
        return per_rank if all_ranks else per_rank[0]

    def _with_results(self, outputs: list[Any], tags: list[str] | None, capture: Any, policy: Any) -> list[Any]:
        if tags is None:
            return outputs
        if capture is not None:
            captures = self.take_captures(tags)
            for out, tag in zip(outputs, tags):
                out.capture = captures.get(tag)
        if policy is not None or self._front.global_policy is not None:
            traces = self.take_traces(tags)
            for out, tag in zip(outputs, tags):
                out.trace = traces.get(tag)
        return outputs

    def detach(self) -> None:
        """Clear global steering; the engine keeps running unsteered."""
        self.clear_all()

    def wait_for_subscribers(self, stream: str, n: int = 1, timeout_s: float = 30.0) -> list[str]:
        """Block until at least ``n`` monitors are connected to ``stream``, and return their names: the start
        handshake (frames published before a monitor subscribes are not delivered to it, so send the traffic it
        should watch after this returns).

        Raises:
            ValueError: ``n`` / ``timeout_s`` out of range, or an engine without a stream hub or with CURVE.
            LookupError: the engine has no stream ``stream``.
            TimeoutError: fewer than ``n`` after ``timeout_s`` (the message names those connected).
        """
        from dynsteer.engine.build import hub_endpoints
        from dynsteer.streams.readiness import wait_for_subscribers

        engine = getattr(self.llm, "llm_engine", self.llm)
        return wait_for_subscribers(hub_endpoints(engine.vllm_config), stream, n, timeout_s)

    # ---- internals ------------------------------------------------------------------------------------------------
    def _params(self, prompts: Any, sampling_params: Any, steering: Any, chat: bool = False,
                capture: CaptureSpec | None = None, policy: PolicyArg = None,
                report: ReportKind | None = None) -> tuple[Any, list[str] | None]:
        from vllm import SamplingParams

        base = sampling_params or SamplingParams()
        tagged = capture is not None or policy is not None or self._front.global_policy is not None
        if not tagged and report is None and (steering is None or isinstance(steering, SteeringSpec)):
            return steer_params(base, steering), None
        single = isinstance(prompts, (str, dict)) or (chat and prompts and isinstance(prompts[0], dict))
        n = 1 if single else len(prompts)
        specs = self._per_prompt("steering", steering, SteeringSpec, n)
        policies = self._per_prompt("policy", policy, DynamicSteeringPolicy, n)
        checked: dict[int, Any] = {}  # the dose guardrail, once per distinct policy object
        for p in policies:
            if id(p) not in checked:
                checked[id(p)] = self._dose_checked(p)
        policies = [checked[id(p)] for p in policies]
        bases = base if isinstance(base, list) else [base] * n
        tags = [f"ds-{uuid.uuid4().hex}" for _ in range(n)] if tagged else None
        trace = policy is not None or self._front.global_policy is not None  # traces are collected after generate
        bodies: dict[tuple[int, int], str] = {}  # one encoding per distinct (spec, policy) object in this call
        params = []
        for i, (b, s, p) in enumerate(zip(bases, specs, policies)):
            body = bodies.get((id(s), id(p)))
            if body is None:
                body = bodies[(id(s), id(p))] = encode_payload(s, None, capture, p, trace=trace, report=report)
            params.append(steer_params(b, None, tags[i] if tags else None, payload=body))
        return params, tags

    @staticmethod
    def _per_prompt(name: str, value: Any, one: type, n: int) -> list[Any]:
        if value is None or isinstance(value, one):
            return [value] * n
        values = list(value)
        if len(values) != n:
            raise ValueError(f"{name}: got {len(values)} entries for {n} prompts")
        return values

    @property
    def named_vectors(self) -> dict[str, Any]:
        """The vectors registered with :meth:`register_vector`, by name."""
        return dict(self._front.named)

    def _dose_checked(self, policy: DynamicSteeringPolicy | None) -> DynamicSteeringPolicy | None:
        """``policy`` after its ``max_relative_dose`` guardrail (its own, else :meth:`set_dose_limit`'s;
        :func:`dynsteer.dose.admit_dose`): unchanged without one, clipped (with a warning naming each action) or
        rejected (``SteeringValidationError``)."""
        if policy is None:
            return policy
        if policy.max_relative_dose is None:
            if self._dose_limit is None:
                return policy
            policy = policy.model_copy(update={"max_relative_dose": self._dose_limit})
        import warnings

        from dynsteer.dose import admit_dose

        admitted, report = admit_dose(self, policy)
        for e in report:
            if e.clipped_from is not None:
                warnings.warn(f"max_relative_dose: {e.where}.scale clipped from {e.clipped_from:g} to {e.scale:.4g} "
                              f"(relative dose {e.peak_dose:.4g})", stacklevel=3)
        return admitted

    def _vec(self, vector: VectorSource) -> VectorSource:
        return vector if isinstance(vector, str) else as_vector(vector)

    def _rpc(self, method: str, *args: Any) -> Any:
        results = self.llm.collective_rpc(method, args=args)
        return results[0]


def attach(llm: Any) -> Steerer:
    """Attach dynsteer's controls to a running ``vllm.LLM`` (dynsteer's plugin must have loaded in its workers).

    Raises:
        UnsupportedArchitectureError: the model's architecture has no adapter.
    """
    return Steerer(llm)
