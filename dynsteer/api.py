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
import uuid
from collections.abc import Iterator, Sequence
from typing import Any


from dynsteer.capture.result import Capture, unpack_record
from dynsteer.capture.spec import CaptureSpec
from dynsteer.engine.apc import state_of
from dynsteer.payload import PAYLOAD_KEY, encode_payload
from dynsteer.spec import (AddVector, Ablation, ModelShape, ProjectionClamp, Site, SteeringSpec, Tier,
                           VectorSource, check_vector)
from dynsteer.steering.compile import compile_phase
from dynsteer.vectors import as_vector, pack_vector


def steer_params(sampling_params: Any, spec: SteeringSpec | None, tag: str | None = None,
                 capture: CaptureSpec | None = None) -> Any:
    """A copy of ``sampling_params`` carrying ``spec`` (and ``capture``) for this request (``None``: plain copy).

    Works for any client that submits ``SamplingParams`` (``LLM``, ``AsyncLLM``, ``LLMEngine.add_request``).
    """
    params = sampling_params.clone()
    if (spec is not None and not spec.is_empty()) or capture is not None:
        params.extra_args = {**(params.extra_args or {}), PAYLOAD_KEY: encode_payload(spec, tag, capture)}
    return params


class Steerer:
    """Steering control attached to one ``vllm.LLM``. Create it with :func:`attach`."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        info = self._rpc("dynsteer_describe")
        self.shape = ModelShape.model_validate(info["shape"])
        self._front = state_of(llm)

    # ---- introspection --------------------------------------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """Per-rank runtime state (rows in use, counters, named vectors)."""
        return self.llm.collective_rpc("dynsteer_describe")

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
        for phase in ("prefill", "decode"):
            compile_phase([("global.", spec)], phase, self.shape, self._front.named)
        self.llm.collective_rpc("dynsteer_set_global", args=(encode_payload(spec),))
        self._front.set_global(spec)

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
        """Register a vector on every rank under ``name``; request payloads may then reference it by name."""
        arr = check_vector(as_vector(vector), self.hidden_size, f"vector {name!r}")
        self.llm.collective_rpc("dynsteer_register_vector", args=(name, pack_vector(arr)))
        self._front.register(name, arr)

    # ---- generation ---------------------------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, *,
                 steering: SteeringSpec | Sequence[SteeringSpec | None] | None = None,
                 capture: CaptureSpec | None = None, **kwargs: Any) -> list[Any]:
        """``LLM.generate`` with per-request steering and capture.

        Args:
            prompts: as for ``LLM.generate``.
            sampling_params: one ``SamplingParams`` or one per prompt.
            steering: one spec for all prompts, or one (or ``None``) per prompt.
            capture: capture these places for every prompt; each output then has ``output.capture``
                (a :class:`~dynsteer.capture.result.Capture`).
        """
        params, tags = self._params(prompts, sampling_params, steering, capture=capture)
        return self._with_captures(self.llm.generate(prompts, params, **kwargs), tags)

    def chat(self, messages: Any, sampling_params: Any = None, *,
             steering: SteeringSpec | Sequence[SteeringSpec | None] | None = None,
             capture: CaptureSpec | None = None, **kwargs: Any) -> list[Any]:
        """``LLM.chat`` with per-request steering and capture (``messages``: one conversation or a list)."""
        params, tags = self._params(messages, sampling_params, steering, chat=True, capture=capture)
        return self._with_captures(self.llm.chat(messages, params, **kwargs), tags)

    def set_capture(self, spec: CaptureSpec | None) -> None:
        """Capture every request admitted from now on (results go to the engine's configured consumers)."""
        self.llm.collective_rpc("dynsteer_set_capture", args=(None if spec is None else spec.model_dump(mode="json"),))

    def take_captures(self, tags: Sequence[str]) -> dict[str, Capture]:
        """In-memory captures of finished requests, by payload tag (each can be taken once)."""
        packed = [rec for rank in self.llm.collective_rpc("dynsteer_take_captures", args=(list(tags),)) for rec in rank]
        return {c.tag: c for c in map(unpack_record, packed)}

    def _with_captures(self, outputs: list[Any], tags: list[str] | None) -> list[Any]:
        if tags is None:
            return outputs
        captures = self.take_captures(tags)
        for out, tag in zip(outputs, tags):
            out.capture = captures.get(tag)
        return outputs

    def detach(self) -> None:
        """Clear global steering; the engine keeps running unsteered."""
        self.clear_all()

    # ---- internals ------------------------------------------------------------------------------------------------
    def _params(self, prompts: Any, sampling_params: Any, steering: Any, chat: bool = False,
                capture: CaptureSpec | None = None) -> tuple[Any, list[str] | None]:
        from vllm import SamplingParams

        base = sampling_params or SamplingParams()
        if capture is None and (steering is None or isinstance(steering, SteeringSpec)):
            return steer_params(base, steering), None
        single = isinstance(prompts, (str, dict)) or (chat and prompts and isinstance(prompts[0], dict))
        n = 1 if single else len(prompts)
        specs = [steering] * n if steering is None or isinstance(steering, SteeringSpec) else list(steering)
        if len(specs) != n:
            raise ValueError(f"steering: got {len(specs)} specs for {n} prompts")
        bases = base if isinstance(base, list) else [base] * n
        tags = [f"ds-{uuid.uuid4().hex}" for _ in range(n)] if capture is not None else None
        params = [steer_params(b, s, tags[i] if tags else None, capture) for i, (b, s) in enumerate(zip(bases, specs))]
        return params, tags

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
