"""Engine-level dynsteer settings, passed as ``LLM(..., additional_config={"dynsteer": {...}})``.

They size the persistent tables allocated at model construction and choose which places get hooks; they reach every
vLLM process through vLLM's own config, so a spawned worker sees the same values as the user's process.

Example:
    >>> from vllm import LLM  # doctest: +SKIP
    >>> llm = LLM("model-dir", additional_config={"dynsteer": DynsteerConfig(max_rows=16).model_dump()})  # doctest: +SKIP
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from dynsteer.spec import NAME_PATTERN, SITES, Site, SteeringValidationError
from dynsteer.transport.security import CurveKeys, check_endpoint, default_endpoint

CONFIG_KEY = "dynsteer"
CommandOp = Literal["abort", "steer", "threshold", "rule", "global"]


class Limits(BaseModel):
    """Bounds on what one request may send and on what the engine keeps for callers (architecture §10).

    Every limit is enforced where requests are admitted (the frontend, so an oversize request never reaches the
    engine core) and again in the workers. A request over a limit is rejected with an error naming the field.

    Args:
        max_payload_bytes: size of one request's packed payload string.
        max_entries: steering entries, monitors, rules, actions and capture layers of one payload, together.
        max_depth: nesting depth of a payload's decoded body (a budget controller's ``inner`` adds one level).
        max_capture_positions: explicit capture positions of one request.
        max_abs_value: the largest value one configuration may add to any element of the residual, summed over
            its sites (static vectors at their scale, gated vectors at the largest scale their controller can
            output); also bounds clamp ``lo``/``hi``. Keeps steering finite in every dtype and away from overflow.
        max_dyn_scale: the largest ``|dyn_scale|`` a sync controller may output (built-in controllers are checked
            at admission; a custom controller returning more, or a non-finite value, stops its request).
        max_clamp_strength: clamp/ablation strengths above 2 expand the projection instead of moving it toward
            the bound (``p' = (1 − s)·p + s·c``); the default keeps clamps non-expanding.
        cache_bytes: memory the admission and compile memos may hold, each (least recently used dropped first).
        trace_ttl_s: dynamic-steering traces not taken within this time are dropped (and counted).
        max_traces: traces kept at most (oldest dropped first, counted).
        max_named_vectors: named vectors registered at once (``Steerer.register_vector``, the HTTP route).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_payload_bytes: StrictInt = Field(default=4 << 20, ge=1024)
    max_entries: StrictInt = Field(default=256, ge=1)
    max_depth: StrictInt = Field(default=16, ge=4, le=64)
    max_capture_positions: StrictInt = Field(default=1 << 16, ge=1)
    max_abs_value: StrictFloat = Field(default=1e4, gt=0.0, le=1e30)
    max_dyn_scale: StrictFloat = Field(default=100.0, gt=0.0, le=1e30)
    max_clamp_strength: StrictFloat = Field(default=2.0, gt=0.0, le=1e3)
    cache_bytes: StrictInt = Field(default=256 << 20, ge=0)
    trace_ttl_s: StrictFloat = Field(default=600.0, gt=0.0)
    max_traces: StrictInt = Field(default=4096, ge=1)
    max_named_vectors: StrictInt = Field(default=1024, ge=1)


#: The engine's default limits (a payload or command checked without an engine's configuration).
DEFAULT_LIMITS = Limits()

# A payload's shape, checked before any schema validation (request payloads and monitors' commands alike).
#: Lists whose items are a payload's entries (``Limits.max_entries``): a spec's steering entries, a policy's
#: monitors, rules and their actions, a capture's layers. Recognised by key at any depth, so the same walk serves a
#: payload body, a ``{"policy": ...}`` HTTP body and a monitor's command.
ENTRY_KEYS = frozenset({"vectors", "clamps", "ablations", "monitors", "rules", "actions", "layers"})
#: Objects that are not entries (the body and its spec/policy/capture, controllers, inline-vector objects, a custom
#: controller's options) are bounded too, by ``max_entries + OTHER_OBJECTS``: a valid payload holds at most one
#: inline-vector object per entry plus a few wrappers, and the walk before schema validation stays bounded.
OTHER_OBJECTS = 64


def check_shape(body: Any, field: str, limits: Limits) -> None:
    """Reject a decoded body that nests deeper than ``limits.max_depth``, holds more than ``limits.max_entries``
    entries (items of the lists named in :data:`ENTRY_KEYS`, all together) or more than ``max_entries +``
    :data:`OTHER_OBJECTS` other objects, before any schema validation runs (iterative: no recursion for an attacker
    to exhaust). Exactly ``max_entries`` entries pass, whichever sections hold them."""
    entries = objects = 0
    # (node, depth, what it is: "entries" a list of entries, "entry" one entry, "" anything else)
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, role = stack.pop()
        if depth > limits.max_depth:
            raise SteeringValidationError(f"{field}: payload nests deeper than the engine's limit max_depth = "
                                          f"{limits.max_depth}")
        if isinstance(node, dict):
            if role != "entry":
                objects += 1
                if objects > limits.max_entries + OTHER_OBJECTS:
                    raise SteeringValidationError(
                        f"{field}: payload holds more than {limits.max_entries + OTHER_OBJECTS} objects besides "
                        f"its entries (the engine's limit max_entries = {limits.max_entries}, plus "
                        f"{OTHER_OBJECTS})")
            stack.extend((v, depth + 1, "entries" if k in ENTRY_KEYS and isinstance(v, (list, tuple)) else "")
                         for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            if len(node) > limits.max_capture_positions:
                raise SteeringValidationError(f"{field}: payload holds a list of {len(node)} items, over the "
                                              f"engine's limit max_capture_positions = "
                                              f"{limits.max_capture_positions}")
            if role == "entries":
                entries += len(node)
                if entries > limits.max_entries:
                    raise SteeringValidationError(
                        f"{field}: payload holds more than the engine's limit max_entries = {limits.max_entries} "
                        f"entries (steering entries, monitors, rules, actions and capture layers together)")
            item_role = "entry" if role == "entries" else ""
            stack.extend((v, depth + 1, item_role) for v in node if isinstance(v, (dict, list, tuple)))


class StreamSpec(BaseModel):
    """One activation stream of the async tier: which places, requests and positions each step publishes.

    Args:
        places: ``"layer.site"`` names (``"12.post_block"``); each must have a capture buffer
            (``DynsteerConfig.capture_sites``/``capture_layers``).
        requests: ``all``; ``tagged`` (requests whose payload has a tag, optionally starting with ``tag_prefix``);
            ``dynamic`` (requests a dynamic policy steers).
        positions: ``generated`` tokens, ``prompt`` tokens, or ``both``.
        dtype: of the published rows. ``bfloat16`` is rounded on the device and travels as 2 bytes per value (half
            of ``float32``'s bandwidth); monitors get float32 arrays of the rounded values.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    places: tuple[str, ...] = Field(min_length=1, max_length=64)
    requests: Literal["all", "tagged", "dynamic"] = "all"
    tag_prefix: str | None = Field(default=None, max_length=128)
    positions: Literal["generated", "prompt", "both"] = "generated"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @field_validator("places")
    @classmethod
    def _places(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for i, key in enumerate(v):
            layer, _, site = key.partition(".")
            if not layer.isdigit() or site not in SITES:
                raise ValueError(f"places[{i}]: {key!r} is not '<layer>.<site>' (site one of {', '.join(SITES)})")
        return v

    def place_tuples(self) -> list[tuple[int, Site]]:
        return [(int(k.partition(".")[0]), k.partition(".")[2]) for k in self.places]  # type: ignore[misc]


class MonitorConfig(BaseModel):
    """The async tier: activation streams to external monitor services and their commands back (``dynsteer.monitor``).

    The endpoints are given explicitly because every vLLM process reads this config on its own: use
    :meth:`private` for fresh ``ipc://`` endpoints in a directory only this user can enter.

    Trust (architecture §10): a connected monitor is a peer, not the operator. Over ``ipc://`` (socket file 0600) only
    this user's processes connect, and a monitor's name is what it says; any ``tcp://`` endpoint, loopback included,
    needs ``curve`` (other local users can reach loopback), and ``curve.client_names`` binds names to client keys.
    Whatever the transport, a monitor cannot delay a step beyond ``max_block_delay_ms``, take a name another
    connection holds, exhaust subscriber slots or streams, or send commands it was not granted.

    Args:
        endpoint: where TP rank 0 of each worker publishes streams (under pipeline parallelism stage ``k > 0``
            binds ``<endpoint>.pp<k>``, or the tcp port plus ``k``); ``ipc://`` unless ``curve`` is set. Under data
            parallelism replica ``r > 0`` uses :func:`replica_endpoint` of it (``<endpoint>.dp<r>``).
        command_endpoint: where the engine core takes commands (same rules).
        streams: streams declared at engine start.
        allow_declare: let subscribers declare streams of their own (over places with capture buffers).
        max_declared_streams: most streams subscribers may have declared at once; a declared stream is removed
            once no subscriber is registered for it.
        replay_bytes / replay_messages: per stream, the newest messages kept for a restarted monitor to resume.
        spill_dir / spill_bytes: where ``spill`` subscribers' backlog goes (default: a private temp dir), bounded
            per (stream, subscriber).
        spill_total_bytes: bound of every spill ring of a hub together.
        max_held_bytes: per subscriber, bound of its bytes in flight and of its unsent messages that only it keeps
            (the replay buffer evicted them): a subscriber that stops reading pins at most about twice this.
        curve: CURVE keys; required for every ``tcp://`` endpoint.
        subscribers: subscriber names the hub accepts (``None``: any name).
        max_subscribers: most subscribers registered at once (connected or waiting to resume); when it is reached,
            the one silent longest among the disconnected ones makes room.
        subscriber_ttl_s: a disconnected subscriber's queues are kept this long for it to resume, then released.
        block_subscribers: subscriber names allowed the ``block`` overload policy (none by default: ``block``
            lets a monitor hold the engine's steps).
        max_block_delay_ms: the most one engine step waits for ``block`` subscribers, all streams together; a
            hello asking for more is refused.
        grants: command operations each monitor may send, by monitor name; ``"*"`` applies to names not listed.
            ``global`` (replace the engine's global steering) is granted to nobody by default.
        max_commands_per_step: commands the engine core takes per scheduler step (the rest wait for the next).
        max_command_bytes_per_step: the cost of the commands the engine core takes per scheduler step (the rest
            wait): a command costs its size in bytes or the vectors it compiles (4 bytes per hidden element of each
            entry), whichever is more; a ``global`` command ends its step's intake.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str
    command_endpoint: str
    streams: dict[str, StreamSpec] = Field(default_factory=dict)
    allow_declare: StrictBool = False
    max_declared_streams: StrictInt = Field(default=16, ge=0, le=256)
    replay_bytes: StrictInt = Field(default=256 << 20, ge=0)
    replay_messages: StrictInt = Field(default=4096, ge=1)
    spill_dir: str | None = None
    spill_bytes: StrictInt = Field(default=1 << 30, ge=0)
    spill_total_bytes: StrictInt = Field(default=4 << 30, ge=0)
    max_held_bytes: StrictInt = Field(default=64 << 20, ge=1 << 16)
    curve: CurveKeys | None = None
    subscribers: tuple[str, ...] | None = None
    max_subscribers: StrictInt = Field(default=64, ge=1, le=4096)
    subscriber_ttl_s: float = Field(default=300.0, gt=0.0, le=7 * 86400)
    block_subscribers: tuple[str, ...] = ()
    max_block_delay_ms: float = Field(default=50.0, ge=0.0, le=60_000.0)
    grants: dict[str, tuple[CommandOp, ...]] = Field(
        default_factory=lambda: {"*": ("abort", "steer", "threshold", "rule")})
    max_commands_per_step: StrictInt = Field(default=256, ge=1, le=65536)
    max_command_bytes_per_step: StrictInt = Field(default=8 << 20, ge=4096, le=1 << 30)

    def granted(self, monitor: str, op: str) -> bool:
        """Whether monitor ``monitor`` may send command ``op`` (its own grant, else the ``"*"`` grant)."""
        ops = self.grants.get(monitor, self.grants.get("*", ()))
        return op in ops

    @field_validator("streams")
    @classmethod
    def _stream_names(cls, v: dict[str, StreamSpec]) -> dict[str, StreamSpec]:
        for name in v:
            if not NAME_PATTERN.fullmatch(name):
                raise ValueError(f"streams[{name!r}]: not a valid name")
        return v

    @field_validator("subscribers", "block_subscribers")
    @classmethod
    def _subscriber_names(cls, v: tuple[str, ...] | None, info: Any) -> tuple[str, ...] | None:
        for i, name in enumerate(v or ()):
            if not NAME_PATTERN.fullmatch(name):
                raise ValueError(f"{info.field_name}[{i}]: {name!r} is not a valid name")
        return v

    @field_validator("grants")
    @classmethod
    def _grant_names(cls, v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for name in v:
            if name != "*" and not NAME_PATTERN.fullmatch(name):
                raise ValueError(f"grants[{name!r}]: a monitor name or '*'")
        return v

    @model_validator(mode="after")
    def _endpoints(self) -> "MonitorConfig":
        for field in ("endpoint", "command_endpoint"):
            check_endpoint(getattr(self, field), curve=self.curve is not None, field=field)
        return self

    def for_replica(self, replica: int) -> "MonitorConfig":
        """This config as data-parallel replica ``replica`` binds it: both endpoints by :func:`replica_endpoint`."""
        if replica == 0:
            return self
        return self.model_copy(update={"endpoint": replica_endpoint(self.endpoint, replica),
                                       "command_endpoint": replica_endpoint(self.command_endpoint, replica)})

    @classmethod
    def private(cls, **kwargs: Any) -> "MonitorConfig":
        """A config with fresh ``ipc://`` endpoints in a new directory of mode 0700."""
        base = default_endpoint("streams")
        return cls(endpoint=base, command_endpoint=base.rsplit("/", 1)[0] + "/commands", **kwargs)


#: under data parallelism replica ``r`` of a ``tcp://`` endpoint binds its port plus ``r`` times this (pipeline stages
#: take the ports just above each replica's)
REPLICA_PORT_STRIDE = 100


def replica_endpoint(endpoint: str, replica: int) -> str:
    """Where data-parallel replica ``replica`` binds a ``MonitorConfig`` endpoint: replica 0 the endpoint itself,
    replica ``r > 0`` ``<ipc path>.dp<r>``, or the tcp port plus ``r * REPLICA_PORT_STRIDE``."""
    if replica == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + replica * REPLICA_PORT_STRIDE}"
    return f"{endpoint}.dp{replica}"


PARAM_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class PresetParam(BaseModel):
    """A number a request may set when it names a preset (``{"preset": name, "params": {param: value}}``).

    Args:
        default: the value when the request does not set it.
        min: the smallest value a request may set (None: unbounded).
        max: the largest value a request may set (None: unbounded).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    default: StrictFloat | StrictInt
    min: StrictFloat | StrictInt | None = None
    max: StrictFloat | StrictInt | None = None

    @model_validator(mode="after")
    def _bounds(self) -> "PresetParam":
        lo = float("-inf") if self.min is None else self.min
        hi = float("inf") if self.max is None else self.max
        if not lo <= self.default <= hi:
            raise ValueError(f"default {self.default} is outside [{self.min}, {self.max}]")
        return self


class Preset(BaseModel):
    """A named steering configuration the operator registers; requests name it instead of sending it.

    ``spec`` and ``policy`` are a request payload's ``spec`` and ``policy`` as JSON (vectors by registered name, as
    lists or ``{"b64": ...}``), validated against the model when the preset is registered. A string value
    ``"$name"`` anywhere in them is a placeholder for the declared parameter ``name``; a request's
    ``params`` (or the defaults) replace it, e.g. ``{"vectors": [{"layer": 2, "vector": "joy", "scale": "$scale"}]}``
    with ``params: {"scale": {"default": 4.0, "min": 0, "max": 16}}``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: dict[str, Any] | None = None
    policy: dict[str, Any] | None = None
    params: dict[str, PresetParam] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _placeholders(self) -> "Preset":
        for name in self.params:
            if not PARAM_PATTERN.fullmatch(name):
                raise ValueError(f"params: parameter name {name!r} is not letters, digits and '_' (at most 64)")
        used = placeholders({"spec": self.spec, "policy": self.policy})
        if undeclared := sorted(used - set(self.params)):
            raise ValueError(f"'${undeclared[0]}' is not a declared parameter (declare it in params)")
        if unused := sorted(set(self.params) - used):
            raise ValueError(f"params.{unused[0]}: no '${unused[0]}' placeholder uses it")
        return self


def placeholders(obj: Any) -> set[str]:
    """The parameter names of the ``"$name"`` placeholders in a JSON value."""
    found: set[str] = set()
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, str) and node.startswith("$"):
            found.add(node[1:])
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return found


class DynsteerConfig(BaseModel):
    """Engine settings.

    Args:
        max_rows: table rows per hooked site; one per distinct live configuration and phase (row 0 is reserved).
        max_clamps: clamp/ablation slots per row and site (gated clamps of dynamic policies count too).
        max_gates: gate slots per row: how many rules (plus a controller-only monitor) one dynamic policy may
            have. 0 removes the dynamic tier (no monitor tables, the static kernel).
        sites: sites to hook (fewer sites, fewer kernels per step).
        layers: layers to hook (``None``: every decoder layer).
        vectors: named vectors to load in every process at start-up: ``{name: "file.safetensors[:layer]"}``.
        require: fail at model load when the architecture is not supported (default: on whenever this config
            is given; a plain ``LLM`` with dynsteer merely installed only warns).
        capture_sites: sites that get a persistent capture buffer (per-request and global captures choose among
            these places; none: capture off, zero cost).
        capture_layers: layers with capture buffers (``None``: every hooked layer).
        capture_consumers: ``{name: options}`` of consumers built in every worker (``memory``, ``filesystem``
            with ``root``/``layout``, ``zmq`` with ``endpoint``, or an entry point of group
            ``dynsteer.capture_consumers``); ``options["kind"]`` picks the kind when the name is another one.
        forward: ``"auto"`` (default) is ``"fused"`` on CUDA and ``"op"`` elsewhere. ``"op"`` runs each site as
            one opaque custom op (the Triton kernel on CUDA, the torch reference elsewhere). ``"fused"`` runs the
            sites that precede a fused add + RMS norm (vLLM's ``RMSNorm`` or ``GemmaRMSNorm``) inside that norm:
            one kernel for ``post_block`` of layer i-1, ``pre_attn`` of layer i and layer i's input norm, one for
            ``post_attn`` and the mid norm, so a hooked layer adds no launch (other layers fall back to ``"op"``;
            a model's first ``pre_attn`` and last ``post_block`` keep theirs). ``"inline"`` traces the reference's
            torch ops into the model graph for torch.compile to fuse (measured slower on an H200:
            benchmarks/RESULTS.md).
        controllers: custom sync controllers requests may use, ``{name: "package.module:Factory"}``; a policy
            names one with ``SyncControllerSpec(kind="custom", name=...)``. Entry points of the group
            ``dynsteer.controllers`` are registered too. Requests never carry import paths.
        probes: probe files requests may use as monitors, ``{name: path}``, loaded at start-up in every process;
            a monitor names one with ``ProbeGate(probe=name, ...)``. Requests never carry file paths.
        limits: bounds on request payloads and on what the engine keeps (:class:`Limits`).
        presets: named steering configurations requests may use, ``{name: Preset}`` (:class:`Preset`); ``dynsteer
            serve`` also registers them at ``/v1/steering/presets``.
        monitor: the async tier's streams and command channel (:class:`MonitorConfig`; None: off).
        sync_tier: where built-in sync controllers and carried scopes run: ``"device"`` (a kernel after each
            forward; the host never waits) or ``"host"`` (the Python controllers on read-back scores; the host waits
            for every step: for comparison and debugging). Custom controllers always run on the host.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rows: StrictInt = Field(default=64, ge=2, le=4096)
    max_clamps: StrictInt = Field(default=2, ge=0, le=16)
    max_gates: StrictInt = Field(default=2, ge=0, le=8)
    sites: tuple[Site, ...] = SITES
    layers: tuple[int, ...] | None = None
    vectors: dict[str, str] = Field(default_factory=dict)
    require: StrictBool = True
    forward: Literal["auto", "op", "fused", "inline"] = "auto"
    capture_sites: tuple[Site, ...] = ()
    capture_layers: tuple[int, ...] | None = None
    capture_consumers: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"memory": {}})
    controllers: dict[str, str] = Field(default_factory=dict)
    probes: dict[str, str] = Field(default_factory=dict)
    limits: Limits = Field(default_factory=Limits)
    presets: dict[str, Preset] = Field(default_factory=dict)
    sync_tier: Literal["device", "host"] = "device"
    monitor: MonitorConfig | None = None

    @model_validator(mode="after")
    def _stream_places(self) -> "DynsteerConfig":
        if self.monitor is not None:
            for name, stream in self.monitor.streams.items():
                for i, (layer, site) in enumerate(stream.place_tuples()):
                    if site not in self.capture_sites or site not in self.sites or (
                            self.capture_layers is not None and layer not in self.capture_layers) or (
                            self.layers is not None and layer not in self.layers):
                        raise ValueError(f"monitor.streams[{name!r}].places[{i}]: {layer}.{site} has no capture "
                                         f"buffer (add the site to capture_sites and the layer to capture_layers)")
        return self

    @field_validator("controllers", "probes", "vectors", "presets")
    @classmethod
    def _names(cls, v: dict[str, Any], info: Any) -> dict[str, Any]:
        for name in v:
            if not NAME_PATTERN.fullmatch(name):
                raise ValueError(f"{info.field_name}[{name!r}]: names are letters, digits, '.', '_' and '-' "
                                 f"(at most 128, starting with a letter or digit)")
        return v

    def capture_places(self, num_layers: int) -> list[tuple[int, Site]]:
        """The (layer, site) places with capture buffers, for a model of ``num_layers`` layers."""
        layers = range(num_layers) if self.capture_layers is None else self.capture_layers
        hooked = set(range(num_layers) if self.layers is None else self.layers)
        return [(l, s) for l in layers if l in hooked and l < num_layers for s in self.capture_sites
                if s in self.sites]

    @classmethod
    def from_additional(cls, additional: Any) -> "DynsteerConfig":
        """Read ``additional_config["dynsteer"]`` (absent: defaults, without ``require``)."""
        if isinstance(additional, dict) and CONFIG_KEY in additional:
            raw = additional[CONFIG_KEY]
            return raw if isinstance(raw, cls) else cls.model_validate(raw)
        return cls(require=False)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.LLM`` / ``EngineArgs`` carrying this config."""
        return {"additional_config": {CONFIG_KEY: self.model_dump(mode="json")}}
