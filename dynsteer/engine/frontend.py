"""Admission in the frontend process: validate per-request payloads and fork the prefix-cache key.

Wraps ``InputProcessor.process_inputs`` (it runs in the process that accepts requests: the ``LLM`` user's process or
the OpenAI server), so a bad payload becomes a ``ValueError`` for that request alone (HTTP 400 on the server) and never
reaches the workers. Prompt KV depends on prefill-tier steering, which vLLM's block hash ignores; folding a
fingerprint of the effective prefill configuration into ``cache_salt`` keeps steered and unsteered prompts apart while
decode-only steering keeps its cache hits (:mod:`dynsteer.engine.prefix_cache` keys the blocks generated later).
What admission found rides the request to the engine core in ``extra_args`` (:mod:`dynsteer.engine.keys`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from dynsteer.capture.consumers import consumer_class
from dynsteer.config import DynsteerConfig, Limits
from dynsteer.controllers.registry import ControllerRegistry
from dynsteer.engine import patching
from dynsteer.engine.build import load_named_vector, load_probes, shape_from_vllm_config
from dynsteer.engine.combinations import check_combinations
from dynsteer.engine.keys import CONFIG_KEY, DECODE_KEY, DYNAMIC_KEY, FRONTEND_ATTR, PAYLOAD_KEY, ROWS_KEY, SOURCE_KEY
from dynsteer.engine.prefix_cache import salted
from dynsteer.memo import BoundedMemo, body_digest
from dynsteer.policy import admit_policy
from dynsteer.request.compile_spec import compile_phase
from dynsteer.request.json_form import check_preset, is_packed, pack_json
from dynsteer.request.payload import check_envelope, config_fingerprint, decode_payload
from dynsteer.request.resolve import GLOBAL_POLICY, REQUEST_POLICY, Configuration, Effective, check_global, resolve
from dynsteer.spec import ModelShape, SteeringSpec, SteeringValidationError

# An admission made off the event loop for the request this task is adding (engine.admission): its memo key and
# result, used by process_inputs when the memo could not keep it (an entry over the budget, or evicted meanwhile).
HANDED: ContextVar[tuple[Any, Any] | None] = ContextVar("dynsteer_handed_admission", default=None)


@dataclass
class FrontendState:
    """What admission needs: the model's shape, named vectors and the global spec (kept in sync by the API)."""

    shape: ModelShape
    named: dict[str, np.ndarray] = field(default_factory=dict)
    global_spec: SteeringSpec = field(default_factory=SteeringSpec)
    global_policy: Any = None  # DynamicSteeringPolicy applied to requests without their own
    capture_places: set = field(default_factory=set)
    limits: Limits = field(default_factory=Limits)
    probes: dict[str, Any] = field(default_factory=dict)  # registered probe files, loaded
    controllers: Any = field(default_factory=set)  # names of registered custom controllers
    # names of the configured capture consumers (None: not known, e.g. a state built by hand; then unchecked)
    consumers: frozenset[str] | None = None
    capacity: int = 63  # table rows requests can take (max_rows - 1)
    # Admission results per (named-vector version, global configuration, digest of the packed payload body):
    # validation compiles every vector, which for a large batch of requests would otherwise dominate
    # LLM.generate's submission loop (and requests trickling into the engine core start their prefill in several
    # steps instead of one). Keyed by a digest and charged what each entry holds (dynsteer.memo), so a client's
    # payloads never stay in memory, and the memo within Limits.cache_bytes.
    _memo: BoundedMemo = field(init=False, repr=False)
    # admissions under way off the event loop, by memo key (engine.admission; the loop's thread only)
    _pending: dict = field(init=False, repr=False, default_factory=dict)
    presets: dict = field(default_factory=dict)  # {name: Preset}; replaced, never changed in place (snapshots)
    presets_version: int = 0  # bumped whenever a preset changes: keys the JSON-form memo
    # packed payloads of JSON forms (dynsteer.request.json_form) by (presets version, digest of the form, field)
    _packed: BoundedMemo = field(init=False, repr=False)
    version: int = 0  # bumped whenever a named vector changes: keys the admission memo
    # content fingerprint of the global spec and policy (keys the memo too): setting a global and clearing it again
    # leaves earlier admissions valid, so they stay cached
    global_key: bytes = b""

    def __post_init__(self) -> None:
        self._memo = BoundedMemo(self.limits.cache_bytes)
        self._packed = BoundedMemo(self.limits.cache_bytes)
        self.global_key = config_fingerprint(self.global_spec, self.global_policy)

    def check_register(self, name: str, field: str = "name") -> None:
        """Raise :class:`SteeringValidationError` naming ``field`` when registering ``name`` would exceed
        ``limits.max_named_vectors`` (replacing a registered name is fine). Call it before anything changes."""
        limit = self.limits.max_named_vectors
        if name not in self.named and len(self.named) >= limit:
            raise SteeringValidationError(
                f"{field}: cannot register {name!r}: {len(self.named)} named vectors are registered, the engine's "
                f"limit max_named_vectors = {limit} (replace or delete one first)")

    def register(self, name: str, vector: np.ndarray) -> None:
        """Record a named vector (already registered on the workers); cached admissions become stale."""
        self.check_register(name)
        self.named[name] = vector
        self.version += 1

    def set_global(self, spec: SteeringSpec, policy: Any = None) -> None:
        """Record the global spec and policy (already applied on the workers); admissions are memoised per global
        configuration, so those made under another one are not used until it comes back."""
        self.global_spec, self.global_policy = spec, policy
        self.global_key = config_fingerprint(spec, policy)

    def check_global(self, spec: SteeringSpec, policy: Any) -> Any:
        """Validate a global spec and policy as the workers will; returns the policy with registered probes
        resolved. Raises :class:`SteeringValidationError` naming the field."""
        if policy is not None:
            policy = admit_policy(policy, self.probes, self.controllers, GLOBAL_POLICY)
        check_global(Configuration(spec, policy), self.shape, self.named)
        return policy

    def pack(self, payload: Any, field: str = f"extra_args.{PAYLOAD_KEY}") -> Any:
        """``payload`` in the packed form (None and packed strings as they are; a JSON form converted, memoised).
        Raises :class:`SteeringValidationError` naming the field under ``field``."""
        if payload is None or is_packed(payload):
            return payload
        key = self.pack_key(payload, field)
        hit = self.packed(key)
        return hit if hit is not None else self.pack_fill(key, payload, field)

    def packed(self, key: Any) -> str | None:
        """The memoised packed form under a :meth:`pack_key` key (None: not held, or no key)."""
        return None if key is None else self._packed.get(key)

    def pack_fill(self, key: Any, payload: Any, field: str) -> str:
        """Pack the JSON form ``payload`` and remember it under ``key`` (taken with this state; None: not
        memoised)."""
        packed = pack_json(payload, field, self.presets, self.limits)
        if key is not None:
            self._packed.put(key, packed)
        return packed

    def pack_key(self, payload: Any, field: str) -> tuple[int, bytes, str] | None:
        """The JSON-form memo key of ``payload`` (None: not memoised, an object msgpack cannot encode)."""
        if isinstance(payload, str):
            return self.presets_version, body_digest(payload), field
        try:
            text = msgspec.msgpack.encode(payload, enc_hook=_array_bytes, order="sorted")
        except (TypeError, NotImplementedError, RecursionError, OverflowError, ValueError):
            return None
        return self.presets_version, b"o" + hashlib.sha256(text).digest(), field  # (as memo.body_digest)

    def set_preset(self, name: str, preset: Any, fit: bool = True, field: str | None = None) -> None:
        """Register (or replace, or with None remove) a preset after checking it with its default parameters
        against the payload schema and (``fit``) the model as it is now: its vectors registered, its layers there.
        Raises :class:`SteeringValidationError` naming the field under ``field`` (default ``presets.<name>``, as in
        the config; the preset route's body is ``body``)."""
        if preset is not None:
            field = field or f"presets.{name}"
            check_preset(name, preset, self.limits, field)
            try:
                if fit:
                    self.admit_uncached(pack_json({"preset": name}, field, {name: preset}, self.limits))
            except SteeringValidationError as exc:
                raise renamed(exc, field) from None
        presets = {k: v for k, v in self.presets.items() if k != name}
        if preset is not None:
            presets[name] = preset
        self.presets = presets
        self.presets_version += 1

    @property
    def idle(self) -> bool:
        """Nothing global: requests without a payload need no admission."""
        return self.global_spec.is_empty() and self.global_policy is None

    def admit(self, payload: Any) -> tuple[str, str, str, bool]:
        """Validate ``payload`` (None: no per-request steering).

        Returns:
            hex fingerprints of the effective prefill and the *static* decode configuration ('' where that phase is
            unsteered), the table rows the request takes (``"prefill,decode"`` digests, for the scheduler), and
            whether a dynamic policy may steer its decode tokens.
            A request that captures prompt positions gets a unique prefill fingerprint: prefix-cache hits skip
            the forward for cached tokens, and there would be nothing to capture for them. A dynamic policy is not
            part of the decode fingerprint: the workers report where it acted, and the engine core folds that into
            the hashes of the blocks from there on (:func:`~dynsteer.engine.prefix_cache.patch_block_hashing`,
            architecture §5).

        The payload's size and tag are checked on every call, memo hit or not.
        """
        key = self.memo_key(payload)
        cached = None if key is None else self._memo.get(key)
        if cached is None:
            handed = HANDED.get()
            if handed is not None and handed[0] == key:
                cached = handed[1]
            else:
                cached = self.admit_uncached(payload)
                if key is not None:
                    self._memo.put(key, cached)
        prefill, decode, rows, dynamic, recompute_prompt = cached
        if recompute_prompt:  # prompt capture, or a prompt-mean monitor
            prefill = f"{prefill}recompute-{uuid.uuid4().hex}"
        return prefill, decode, rows, dynamic

    def memo_key(self, payload: Any) -> tuple[int, bytes, bytes] | None:
        """The memo key of ``payload`` under the current configuration (None for a JSON-object payload: not
        memoised). Checks the payload's envelope, so a memo hit too rejects an oversize payload or a bad tag (the
        tag stays outside the body, the memo's key)."""
        if payload is None:
            return self.version, self.global_key, b""
        if not isinstance(payload, str):
            return None
        packed, _ = check_envelope(payload, f"extra_args.{PAYLOAD_KEY}", self.limits)
        return self.version, self.global_key, body_digest(packed)

    def holds(self, key: Any) -> bool:
        """Whether the memo holds an admission under ``key``."""
        return key in self._memo

    def admit_uncached(self, payload: Any) -> tuple[str, str, str, bool, bool]:
        """:meth:`_admit` with any unexpected failure reported as a validation error naming the payload."""
        try:
            return self._admit(payload)
        except SteeringValidationError:
            raise
        except Exception as exc:  # noqa: BLE001 - a 400 naming the payload, never a 500 or a dead server
            raise SteeringValidationError(f"extra_args.{PAYLOAD_KEY}: cannot be admitted ({exc!r})") from None

    def snapshot(self) -> "FrontendState":
        """A copy that admits as this state does now, whatever changes later (named vectors are copied; the rest
        is immutable or fixed at engine start); it shares the memo. Admission off the event loop runs on one, so a
        result always matches the key taken with it, even when a vector or the global changes meanwhile."""
        snap = copy.copy(self)
        snap.named = dict(self.named)
        return snap

    def fill(self, key: Any, payload: Any) -> tuple[str, str, str, bool, bool]:
        """Admit ``payload`` and remember the result under ``key`` (taken with this state); returns it, raises as
        :meth:`admit` does."""
        result = self.admit_uncached(payload)
        self._memo.put(key, result)
        return result

    def effective(self, decoded: Any) -> Effective:
        """A request's effective configuration as admission sees it (:func:`~dynsteer.request.resolve.resolve`:
        the global configuration, then the request's own, its policy admitted with registered probes resolved).
        ``decoded``: the request's decoded payload (None: it has none). Raises :class:`SteeringValidationError`
        naming the field."""
        request = None
        if decoded is not None:
            policy = None if decoded.policy is None else admit_policy(decoded.policy, self.probes, self.controllers,
                                                                      REQUEST_POLICY)
            request = Configuration(decoded.spec, policy)
        return resolve(Configuration(self.global_spec, self.global_policy), request)

    def _admit(self, payload: Any) -> tuple[str, str, str, bool, bool]:
        decoded = None if payload is None else decode_payload(payload, limits=self.limits)
        effective = self.effective(decoded)
        recompute_prompt = False
        if decoded is not None and decoded.capture is not None:
            decoded.capture.check(self.shape, self.capture_places, f"extra_args.{PAYLOAD_KEY}.capture",
                                  self.consumers)
            # the last prompt token is always recomputed (it yields the first logits); the others may be cached
            recompute_prompt = decoded.capture.positions not in ("last_prompt", "all_generated")
        prefill, decode = (compile_phase(effective.phase_specs(phase), phase, self.shape, self.named,
                                         effective.policy_entry).digest.hex() for phase in ("prefill", "decode"))
        salt = prefill
        if effective.reads_prompt:
            # Prompt-level monitors sit in the prefill row but only read: the KV is that of the policy-free prefill,
            # so the cache key is too (a gated request still shares prompt blocks with unsteered traffic). A mean
            # over the prompt must see every prompt token: such a request never starts from cached blocks.
            salt = compile_phase(effective.phase_specs("prefill"), "prefill", self.shape, self.named).digest.hex()
            recompute_prompt |= effective.prompt_mean
        needed = len({d for d in (prefill, decode) if d})
        if needed > self.capacity:
            raise SteeringValidationError(
                f"extra_args.{PAYLOAD_KEY}: this configuration needs {needed} steering rows (its prefill and decode "
                f"phases differ); the engine has {self.capacity} (raise DynsteerConfig.max_rows)")
        dynamic = effective.gates
        static_decode = (compile_phase(effective.phase_specs("decode"), "decode", self.shape, self.named).digest.hex()
                         if dynamic else decode)
        return salt, static_decode, f"{prefill},{decode}", dynamic, recompute_prompt


def renamed(exc: SteeringValidationError, field: str) -> SteeringValidationError:
    """``exc`` naming ``field`` where it names the payload by its default field (a JSON form converted from the
    top-level ``steering`` field is admitted packed)."""
    default, msg = f"extra_args.{PAYLOAD_KEY}", str(exc)
    if field == default or not msg.startswith(default):
        return exc
    return SteeringValidationError(field + msg[len(default):])


def payload_field(extra: dict) -> str:
    """The field a request's payload came from, as its errors name it."""
    return extra.get(SOURCE_KEY) or f"extra_args.{PAYLOAD_KEY}"


def _array_bytes(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return np.ascontiguousarray(obj, dtype="<f4").tobytes()
    raise NotImplementedError(type(obj).__name__)


def build_frontend_state(vllm_config: Any) -> FrontendState:
    """What admission validates against, loaded from the engine's config (named vectors, probes, controllers)."""
    shape = shape_from_vllm_config(vllm_config)
    cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
    state = FrontendState(shape, {n: load_named_vector(r, shape.hidden_size) for n, r in cfg.vectors.items()},
                          capture_places={p for p in cfg.capture_places(shape.num_layers) if p[1] in shape.sites},
                          consumers=frozenset(cfg.capture_consumers), limits=cfg.limits,
                          probes=load_probes(cfg), controllers=ControllerRegistry(cfg.controllers).names(),
                          capacity=cfg.max_rows - 1)
    for name, preset in cfg.presets.items():
        try:
            # the schema only: a preset may name a vector registered later (each request's admission checks the fit)
            state.set_preset(name, preset, fit=False)
        except SteeringValidationError as exc:
            raise ValueError(f"{CONFIG_KEY}.{exc}") from None
    return state


def frontend_state(input_processor: Any) -> FrontendState:
    """The admission state of this process's ``InputProcessor`` (built from the engine's config on first use)."""
    state = input_processor.__dict__.get(FRONTEND_ATTR)
    if state is None:
        state = build_frontend_state(input_processor.vllm_config)
        setattr(input_processor, FRONTEND_ATTR, state)
    return state


def check_engine_config(vllm_config: Any) -> None:
    """Frontend, before the engine core starts: reject a bad dynsteer config with an error naming the field.

    The workers check again when they build the model, but in a spawned engine core their message only reaches the
    log; the user's process would merely see that the engine failed to start.
    """
    cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
    check_combinations(vllm_config, cfg)  # vLLM options dynsteer cannot steer correctly with this config
    for name, options in cfg.capture_consumers.items():
        try:
            consumer_class(options.get("kind", name))
        except ValueError as exc:
            raise ValueError(f"{CONFIG_KEY}.capture_consumers[{name!r}]: {exc}") from None


def patch_input_processor(cls: type) -> None:
    """Check the engine's dynsteer config before the engine core starts, and admit every request's payload."""
    orig = cls.process_inputs
    orig_init = cls.__init__

    @functools.wraps(orig_init)
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        check_engine_config(vllm_config)
        orig_init(self, vllm_config, *args, **kwargs)
        cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
        if cfg.monitor is not None and cfg.monitor.curve is None:  # the frontend serves /metrics
            from dynsteer.streams.metrics import register_stream_metrics

            register_stream_metrics(cfg.monitor.endpoint)

    patching.patch(cls, "__init__", __init__,
                   why="a bad dynsteer config fails in the user's process, naming the field; /metrics of streams")

    @functools.wraps(orig)
    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(params, "extra_args", None) or {}
        state = frontend_state(self)
        payload = extra.get(PAYLOAD_KEY)
        if payload is None and state.idle:
            return orig(self, request_id, prompt, params, *args, **kwargs)
        field = payload_field(extra)
        try:  # raises SteeringValidationError naming the field
            payload = state.pack(payload, field)  # a JSON form: the engine core and workers see it packed
            prefill_fp, decode_fp, rows, dynamic = state.admit(payload)
        except SteeringValidationError as exc:
            raise renamed(exc, field) from None
        request = orig(self, request_id, prompt, params, *args, **kwargs)
        request.cache_salt = salted(request.cache_salt, prefill_fp)
        if request.sampling_params is not None:
            extra = {k: v for k, v in (request.sampling_params.extra_args or {}).items() if k != SOURCE_KEY}
            extra[ROWS_KEY] = rows
            if payload is not None:
                extra[PAYLOAD_KEY] = payload
            if decode_fp:
                extra[DECODE_KEY] = decode_fp
            if dynamic:
                extra[DYNAMIC_KEY] = 1
            request.sampling_params.extra_args = extra
        return request

    patching.patch(cls, "process_inputs", process_inputs,
                   why="admission: validate the request's payload, salt its cache key, tell the engine core its rows")


def state_of(llm: Any) -> FrontendState:
    """The admission state of a ``vllm.LLM`` (or ``AsyncLLM``) in this process."""
    engine = getattr(llm, "llm_engine", llm)
    return frontend_state(engine.input_processor)
