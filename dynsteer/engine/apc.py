"""Admission in the frontend process: validate per-request payloads and fork the prefix-cache key.

Wraps ``InputProcessor.process_inputs`` (it runs in the process that accepts requests: the ``LLM`` user's process or
the OpenAI server), so a bad payload becomes a ``ValueError`` for that request alone (HTTP 400 on the server) and never
reaches the workers. Prompt KV depends on prefill-tier steering, which vLLM's block hash ignores; folding a
fingerprint of the effective prefill configuration into ``cache_salt`` keeps steered and unsteered prompts apart while
decode-only steering keeps its cache hits.
"""

from __future__ import annotations

import copy
import functools
import inspect
import hashlib
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynsteer.capture.consumers import consumer_class
from dynsteer.config import CONFIG_KEY, DynsteerConfig, Limits
from dynsteer.memo import BoundedMemo, body_digest
from dynsteer.payload import PAYLOAD_KEY, check_envelope, config_fingerprint, decode_payload
from dynsteer.policy import admit_policy
from dynsteer.spec import ModelShape, SteeringSpec, SteeringValidationError
from dynsteer.request.compile_spec import compile_phase

SALT_TAG = "dynsteer:"
DECODE_KEY = "dynsteer_decode_fp"  # set by admission, read by the engine core's block hasher
DYNAMIC_KEY = "dynsteer_dynamic"  # set by admission when a dynamic policy steers the request's decode tokens
ACTED_TAG = "dynsteer:acted:"
ROWS_KEY = "dynsteer_rows"  # set by admission: the table rows a request takes, read by the scheduler (it waits)


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
    version: int = 0  # bumped whenever a named vector changes: keys the admission memo
    # content fingerprint of the global spec and policy (keys the memo too): setting a global and clearing it again
    # leaves earlier admissions valid, so they stay cached
    global_key: bytes = b""

    def __post_init__(self) -> None:
        self._memo = BoundedMemo(self.limits.cache_bytes)
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
            policy = admit_policy(policy, self.probes, self.controllers, "global_policy.")
        pol = None if policy is None else ("global_policy.", policy)
        for phase in ("prefill", "decode"):
            compile_phase([("global.", spec)], phase, self.shape, self.named, pol)
        return policy

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
            the hashes of the blocks from there on (:func:`patch_block_hashing`, DESIGN §5).

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

    def _admit(self, payload: Any) -> tuple[str, str, str, bool, bool]:
        specs = [("global.", self.global_spec)]
        policy = None if self.global_policy is None else ("global_policy.", self.global_policy)
        recompute_prompt = False
        if payload is not None:
            decoded = decode_payload(payload, limits=self.limits)
            specs.append((f"extra_args.{PAYLOAD_KEY}.spec.", decoded.spec))
            if decoded.policy is not None:
                where = f"extra_args.{PAYLOAD_KEY}.policy."
                policy = (where, admit_policy(decoded.policy, self.probes, self.controllers, where))
            if decoded.capture is not None:
                decoded.capture.check(self.shape, self.capture_places, f"extra_args.{PAYLOAD_KEY}.capture",
                                      self.consumers)
                # the last prompt token is always recomputed (it yields the first logits); the others may be cached
                recompute_prompt = decoded.capture.positions not in ("last_prompt", "all_generated")
        prefill, decode = (compile_phase(specs, phase, self.shape, self.named, policy).digest.hex()
                           for phase in ("prefill", "decode"))
        salt = prefill
        if policy is not None and any(m.reads != "token" for m in policy[1].monitors):
            # Prompt-level monitors sit in the prefill row but only read: the KV is that of the policy-free prefill,
            # so the cache key is too (a gated request still shares prompt blocks with unsteered traffic). A mean
            # over the prompt must see every prompt token: such a request never starts from cached blocks.
            salt = compile_phase(specs, "prefill", self.shape, self.named).digest.hex()
            recompute_prompt |= any(m.reads == "prompt_mean" for m in policy[1].monitors)
        needed = len({d for d in (prefill, decode) if d})
        if needed > self.capacity:
            raise SteeringValidationError(
                f"extra_args.{PAYLOAD_KEY}: this configuration needs {needed} steering rows (its prefill and decode "
                f"phases differ); the engine has {self.capacity} (raise DynsteerConfig.max_rows)")
        dynamic = policy is not None and bool(policy[1].rules or policy[1].controller)
        static_decode = compile_phase(specs, "decode", self.shape, self.named).digest.hex() if dynamic else decode
        return salt, static_decode, f"{prefill},{decode}", dynamic, recompute_prompt


def shape_from_vllm_config(vllm_config: Any) -> ModelShape:
    """The model's shape and hooked places as every process sees them (frontend admission and workers alike)."""
    from dynsteer.engine.families import absent_sites

    cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
    text = vllm_config.model_config.hf_config.get_text_config()
    num_layers = int(text.num_hidden_layers)
    layers = None if cfg.layers is None else tuple(l for l in cfg.layers if l < num_layers)
    architecture = (vllm_config.model_config.architectures or ["?"])[0]
    absent = absent_sites(architecture, text)  # e.g. post_attn of a parallel attention + MLP block
    return ModelShape(num_layers=num_layers, hidden_size=int(text.hidden_size),
                      model_id=str(vllm_config.model_config.model), architecture=architecture,
                      sites=tuple(s for s in cfg.sites if s not in absent), absent_sites=tuple(absent.items()),
                      layers=layers, max_clamps=cfg.max_clamps, max_gates=cfg.max_gates,
                      max_abs_value=cfg.limits.max_abs_value, max_dyn_scale=cfg.limits.max_dyn_scale,
                      max_clamp_strength=cfg.limits.max_clamp_strength)


def build_frontend_state(vllm_config: Any) -> FrontendState:
    """What admission validates against, loaded from the engine's config (named vectors, probes, controllers)."""
    from dynsteer.controllers.registry import ControllerRegistry
    from dynsteer.engine.adapters import load_named_vector, load_probes

    shape = shape_from_vllm_config(vllm_config)
    cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
    return FrontendState(shape, {n: load_named_vector(r, shape.hidden_size) for n, r in cfg.vectors.items()},
                         capture_places={p for p in cfg.capture_places(shape.num_layers) if p[1] in shape.sites},
                         consumers=frozenset(cfg.capture_consumers), limits=cfg.limits,
                         probes=load_probes(cfg), controllers=ControllerRegistry(cfg.controllers).names(),
                         capacity=cfg.max_rows - 1)


def frontend_state(input_processor: Any) -> FrontendState:
    state = input_processor.__dict__.get("_dynsteer_frontend")
    if state is None:
        state = input_processor._dynsteer_frontend = build_frontend_state(input_processor.vllm_config)
    return state


def salted(cache_salt: str | None, fingerprint: str) -> str | None:
    if not fingerprint:
        return cache_salt
    return f"{cache_salt or ''}|{SALT_TAG}{fingerprint}"


def check_engine_config(vllm_config: Any) -> None:
    """Frontend, before the engine core starts: reject a bad dynsteer config with an error naming the field.

    The workers check again when they build the model, but in a spawned engine core their message only reaches the
    log; the user's process would merely see that the engine failed to start.
    """
    cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
    for name, options in cfg.capture_consumers.items():
        try:
            consumer_class(options.get("kind", name))
        except ValueError as exc:
            raise ValueError(f"{CONFIG_KEY}.capture_consumers[{name!r}]: {exc}") from None


def patch_input_processor(cls: type) -> None:
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

    cls.__init__ = __init__

    @functools.wraps(orig)
    def process_inputs(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(params, "extra_args", None) or {}
        state = frontend_state(self)
        payload = extra.get(PAYLOAD_KEY)
        if payload is None and state.idle:
            return orig(self, request_id, prompt, params, *args, **kwargs)
        # raises SteeringValidationError naming the field
        prefill_fp, decode_fp, rows, dynamic = state.admit(payload)
        request = orig(self, request_id, prompt, params, *args, **kwargs)
        request.cache_salt = salted(request.cache_salt, prefill_fp)
        if request.sampling_params is not None:
            extra = {**(request.sampling_params.extra_args or {}), ROWS_KEY: rows}
            if decode_fp:
                extra[DECODE_KEY] = decode_fp
            if dynamic:
                extra[DYNAMIC_KEY] = 1
            request.sampling_params.extra_args = extra
        return request

    cls.process_inputs = process_inputs


def patch_block_hashing(module: Any) -> None:
    """Engine core: blocks holding tokens generated under steering hash with what steered them.

    ``cache_salt`` only reaches the first block; generated tokens join the hash chain later. So a block containing
    a token decoded under static decode steering gets the admission's decode fingerprint as an extra key, and a
    block containing a token at or after the first position where a dynamic policy acted gets the fold of what
    acted (:class:`ActedState`, from the workers' reports). The chain then forks from that block on, while pure
    prompt blocks, and blocks generated while nothing acted, keep their (shareable) hashes.
    """
    orig = module.generate_block_hash_extra_keys

    @functools.wraps(orig)
    def generate_block_hash_extra_keys(request: Any, start_token_idx: int, end_token_idx: int, *a: Any, **k: Any):
        extra_keys, mm_idx = orig(request, start_token_idx, end_token_idx, *a, **k)
        if end_token_idx > request.num_prompt_tokens:
            extra = (request.sampling_params and request.sampling_params.extra_args) or {}
            fp = extra.get(DECODE_KEY)
            if fp:
                extra_keys = (*(extra_keys or ()), f"{SALT_TAG}decode:{fp}")
            # a dynamic policy's reports, or monitors' commands (engine.commands) on any request
            acted = request.__dict__.get("_dynsteer_acted") if hasattr(request, "__dict__") else None
            if acted is None and isinstance(request, _Upto):
                acted = request.__dict__["_request"].__dict__.get("_dynsteer_acted")
            fold = acted.fold_at(end_token_idx - 1) if acted is not None else ""
            if fold:
                extra_keys = (*(extra_keys or ()), f"{ACTED_TAG}{fold}")
        return extra_keys, mm_idx

    module.generate_block_hash_extra_keys = generate_block_hash_extra_keys


@dataclass
class ActedState:
    """Engine core, per request with a dynamic policy: how far the workers have reported, and where steering acted.

    ``reported``: tokens whose KV the workers computed and reported on (a block is hashed only once all its tokens
    are, so a block is never cached before its step's report: with asynchronous scheduling too). ``events``:
    ``(position, fold)`` where what acts changed; the fold chains every signature so far (forward only), so a block's
    hash carries the history up to its last token. Lives on the ``Request`` (preemption keeps it; it goes with the
    request).
    """

    reported: int = 0
    events: list[tuple[int, str]] = field(default_factory=list)
    last_signature: str = ""

    def report(self, upto: int, acted_at: int, signature: str) -> None:
        """Positions ``< upto`` are computed and reported; steering acted at ``acted_at`` (``-1``: not in this
        report) under ``signature``."""
        self.reported = max(self.reported, upto)
        if acted_at >= 0 and signature != self.last_signature:
            if self.events and acted_at <= self.events[-1][0]:
                acted_at = self.events[-1][0]  # a recomputed position (preemption): history stays in order
            self.events.append((acted_at, fold(self.events[-1][1] if self.events else "", signature)))
            self.last_signature = signature

    def command(self, position: int, signature: str) -> None:
        """A monitor's command changes what positions ``>= position`` compute (forward only, like a report)."""
        if self.events and position <= self.events[-1][0]:
            position = self.events[-1][0]
        self.events.append((position, fold(self.events[-1][1] if self.events else "", f"command|{signature}")))

    def fold_at(self, position: int) -> str:
        """The fold in effect at ``position`` ('' if nothing acted at or before it)."""
        out = ""
        for pos, f in self.events:
            if pos > position:
                break
            out = f
        return out


def fold(previous: str, signature: str) -> str:
    """Chain ``signature`` onto ``previous`` (deterministic on every process and rank)."""
    return hashlib.sha256(f"{previous}|{signature}".encode()).hexdigest()[:32]


class _Upto:
    """A request seen by vLLM's block hasher as if it had only ``num_tokens`` tokens."""

    def __init__(self, request: Any, num_tokens: int) -> None:
        self.__dict__["_request"], self.__dict__["num_tokens"] = request, num_tokens

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_request"], name)


def _block_size(hasher: Any) -> int | None:
    """The block size vLLM's request block hasher hashes at (its closure's ``hash_block_size``), remembered on the
    function; None if it cannot be read (then every call goes to the hasher, which stops early itself)."""
    size = getattr(hasher, "_dynsteer_block_size", False)
    if size is False:
        try:
            size = inspect.getclosurevars(hasher).nonlocals.get("hash_block_size")
        except (TypeError, ValueError):
            size = None
        size = size if isinstance(size, int) and size > 0 else None
        try:
            hasher._dynsteer_block_size = size
        except AttributeError:  # not a plain function: look it up every time
            pass
    return size


def patch_request(cls: type) -> None:
    """Engine core: a request with a dynamic policy hashes a block only once the workers reported on all its
    tokens (prompt tokens need no report: dynamic steering acts on decode tokens).

    Such a request becomes an instance of a subclass (:class:`HeldBackRequest`) that overrides
    ``update_block_hashes``, set once when it is made; every other request keeps vLLM's own method, so the many
    calls per step (one per request whose tokens grow) pay nothing for dynsteer. The hashes ``__init__`` computes
    before the switch are the same either way: a new request has only prompt tokens.
    """
    if "_dynsteer_patched" in cls.__dict__:
        return
    orig_init, orig_update = cls.__init__, cls.update_block_hashes

    def update_block_hashes(self: Any) -> None:
        if self._block_hasher is None:
            return orig_update(self)
        limit = hash_limit(self, self.__dict__["_dynsteer_acted"])  # made with the switch in __init__
        if limit is not None:  # else no new full block below the limit (most decode steps): no proxy, no hasher call
            self.block_hashes.extend(self._block_hasher(_Upto(self, limit)))

    # a module-level name, so that pickle and copy find the class
    held = type("HeldBackRequest", (cls,), {"update_block_hashes": update_block_hashes, "__module__": __name__,
                                            "__doc__": "A vLLM request with a dynamic policy (see patch_request)."})
    globals()["HeldBackRequest"] = held

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        params = self.sampling_params
        if type(self) is cls and params is not None and DYNAMIC_KEY in (params.extra_args or {}):
            self.__class__ = held
            if self._block_hasher is not None:
                self.__dict__.setdefault("_dynsteer_acted", ActedState())

    cls.__init__ = __init__
    cls._dynsteer_patched = True


def hash_limit(request: Any, acted: ActedState) -> int | None:
    """How many of a dynamic request's tokens may be hashed (computed and reported on; prompt tokens need no
    report), or None when that completes no block beyond those hashed (most decode steps)."""
    limit = min(request.num_tokens, max(request.num_prompt_tokens, acted.reported))
    size = _block_size(request._block_hasher)
    return None if size and (len(request.block_hashes) + 1) * size > limit else limit


def command_event(request: Any, signature: str, hash_block_size: int) -> None:
    """Engine core, when a command is taken at a step: positions from the first one that step computes (decode
    positions only: prompt KV is never recomputed for a command) hash with the command's fold. Hashes of blocks
    holding such positions are dropped and recomputed (none of them is cached yet: a block is cached only once all
    its tokens were scheduled, and the command precedes this step's scheduling)."""
    acted = request.__dict__.setdefault("_dynsteer_acted", ActedState())
    position = max(int(request.num_computed_tokens), int(request.num_prompt_tokens))
    acted.command(position, signature)
    keep = position // hash_block_size
    if len(request.block_hashes) > keep:
        del request.block_hashes[keep:]
        request.update_block_hashes()


def resalt(request: Any, fingerprint: str) -> None:
    """Engine core: add ``fingerprint`` to a request's cache salt and hash its whole chain again (it then shares no
    block with requests salted otherwise; none of its own blocks is cached under the new hashes yet)."""
    request.cache_salt = salted(request.cache_salt, fingerprint)
    del request.block_hashes[:]
    request.update_block_hashes()


def global_change_event(request: Any, signature: str, hash_block_size: int) -> None:
    """Engine core, after the global spec or policy changed while ``request`` is live: the workers recompile its
    rows at once, so what it computes from its first uncomputed position on may differ from what its hashes (keyed
    at admission) promise. A request still in its prompt is re-salted (its whole chain forks: the prompt's rest is
    computed under the new global); one in decode forks from that position like a command. Conservative: blocks
    computed after the change are not shared with requests admitted before or after it, even where the change
    did not act on them; blocks computed before it keep their hashes."""
    if int(request.num_computed_tokens) < int(request.num_prompt_tokens):
        resalt(request, f"global:{signature}")
    else:
        command_event(request, f"global:{signature}", hash_block_size)


def hashed_tokens(request: Any, hash_block_size: int) -> int | None:
    """Tokens of ``request`` covered by block hashes, when a dynamic policy holds its hashing back (else None)."""
    if "_dynsteer_acted" not in request.__dict__:
        return None
    return len(request.block_hashes) * hash_block_size


def state_of(llm: Any) -> FrontendState:
    """The admission state of a ``vllm.LLM`` (or ``AsyncLLM``) in this process."""
    engine = getattr(llm, "llm_engine", llm)
    return frontend_state(engine.input_processor)
