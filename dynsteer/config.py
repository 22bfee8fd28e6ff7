"""Engine-level dynsteer settings, passed as ``LLM(..., additional_config={"dynsteer": {...}})``.

They size the persistent tables allocated at model construction and choose which places get hooks; they reach every
vLLM process through vLLM's own config, so a spawned worker sees the same values as the user's process.

Example:
    >>> from vllm import LLM  # doctest: +SKIP
    >>> llm = LLM("model-dir", additional_config={"dynsteer": DynsteerConfig(max_rows=16).model_dump()})  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from dynsteer.spec import SITES, Site

CONFIG_KEY = "dynsteer"


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
        forward: ``"op"`` runs each site as one opaque custom op (the fused Triton kernel on CUDA, the torch
            reference elsewhere); ``"inline"`` traces the reference's torch ops into the model graph so
            torch.compile can fuse them into neighbouring kernels (fewer launches per step).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_rows: int = Field(default=64, ge=2, le=4096)
    max_clamps: int = Field(default=2, ge=0, le=16)
    max_gates: int = Field(default=2, ge=0, le=8)
    sites: tuple[Site, ...] = SITES
    layers: tuple[int, ...] | None = None
    vectors: dict[str, str] = Field(default_factory=dict)
    require: bool = True
    forward: Literal["op", "inline"] = "op"
    capture_sites: tuple[Site, ...] = ()
    capture_layers: tuple[int, ...] | None = None
    capture_consumers: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"memory": {}})

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
