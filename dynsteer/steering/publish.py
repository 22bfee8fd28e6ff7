"""The worker's side of the async tier: which of a step's tokens each subscribed stream publishes, and publishing
them through the engine's ``StreamHub`` once their rows have landed.

Streams ride on capture: a stream's places are capture buffers, and the capture collector copies the selected rows
out with the step's captures. A pipeline stage publishes its own layers. A stream never aborts generation: a
message that cannot be published is logged and counted (``RuntimeStats.stream_errors``). An engine without a hub
holds a :class:`NullStreamPublisher`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Collection

import numpy as np

from dynsteer.capture.names import Place, place_key
from dynsteer.capture.step import StreamSelection, stream_spec_dtype, stream_wire_dtype
from dynsteer.config import StreamSpec
from dynsteer.steering.stats import RuntimeStats

if TYPE_CHECKING:
    from dynsteer.streams.hub import StreamHub

logger = logging.getLogger("dynsteer")


class StreamPublisher:
    """The engine's streams as the hub holds them (declared by the engine or by subscribers), refreshed when the
    hub's version changes."""

    def __init__(self, hub: StreamHub, stats: RuntimeStats, header: dict[str, Any] | None = None) -> None:
        self.hub, self.stats = hub, stats
        self.header = dict(header or {})  # fixed fields of every frame's header (the data-parallel replica)
        self.specs: dict[str, StreamSpec] = {}  # stream name -> its spec, for streams with places on this worker
        self._places: dict[str, tuple[Place, ...]] = {}  # stream name -> its places this worker holds
        self._hub_version = -1

    def stale(self) -> bool:
        """The hub's streams changed since :meth:`refresh` (a subscriber declared or left one)."""
        return self.hub.version != self._hub_version

    def refresh(self, mine: Collection[Place]) -> None:
        """Take the hub's streams that have places among ``mine`` (this worker's capture places)."""
        self._hub_version = self.hub.version
        specs, places = {}, {}
        for name, raw in self.hub.streams().items():
            spec = StreamSpec.model_validate(raw)
            here = tuple(p for p in spec.place_tuples() if p in mine)  # a pipeline stage publishes its own layers
            if here:
                specs[name], places[name] = spec, here
        self.specs, self._places = specs, places

    def select(self, masks: dict[str, np.ndarray], step: int, ids: tuple[str, ...], req_of_token: np.ndarray,
               position: np.ndarray, is_decode: np.ndarray) -> list[StreamSelection]:
        """This step's tokens of every stream that has a subscriber (``masks``: which requests each publishes;
        vectorised per stream)."""
        out = []
        for name, mask in masks.items():
            if not self.hub.subscribed(name):
                continue
            spec = self.specs[name]
            keep = mask[req_of_token]
            if spec.positions == "generated":
                keep &= is_decode
            elif spec.positions == "prompt":
                keep &= ~is_decode
            tokens = np.flatnonzero(keep)
            if tokens.size:
                out.append(StreamSelection(name, step, self._places[name], stream_wire_dtype(spec.dtype), tokens,
                                           req_of_token[tokens], position[tokens], ids))
        return out

    def publish(self, sel: StreamSelection, values: dict[Place, np.ndarray]) -> None:
        """One stream's rows of one step have landed: one message (header + raw frames)."""
        uniq, inverse = np.unique(sel.req, return_inverse=True)
        meta = {"step": int(sel.step), "req_ids": [sel.req_ids[i] for i in uniq.tolist()],
                "places": [place_key(p) for p in sel.places], "dtype": stream_spec_dtype(sel.dtype), **self.header}
        arrays = [inverse.astype(np.int32), np.ascontiguousarray(sel.positions, np.int64),
                  *(np.ascontiguousarray(values[p]) for p in sel.places)]
        try:
            self.hub.publish(sel.name, meta, arrays)
        except Exception as exc:  # noqa: BLE001 - a stream never aborts generation; the loss is logged and counted
            if isinstance(exc, ValueError) and sel.name not in self.hub.streams():
                return  # a subscriber-declared stream whose last subscriber left since the step was planned
            self.stats.stream_errors += 1
            logger.error("dynsteer: stream %r: publishing step %d failed: %r", sel.name, sel.step, exc)


class NullStreamPublisher:
    """An engine without a hub: no streams, never stale."""

    def __init__(self) -> None:
        self.specs: dict[str, StreamSpec] = {}  # stays empty

    def stale(self) -> bool:
        return False

    def refresh(self, mine: Collection[Place]) -> None:
        pass


def stream_validator(allow_declare: bool,
                     engine_places: Callable[[], Collection[Place]]) -> Callable[[str, dict[str, Any]], None]:
    """What checks a stream a subscriber declares (runs on the hub's I/O thread; raises ValueError naming the
    field): its places must be among ``engine_places()``, the engine's capture places when it is declared."""

    def on_declare(name: str, raw: dict[str, Any]) -> None:
        if not allow_declare:
            raise ValueError("declare: this engine does not let subscribers declare streams "
                             "(MonitorConfig.allow_declare)")
        spec = StreamSpec.model_validate(raw)
        engine = engine_places()
        for i, place in enumerate(spec.place_tuples()):
            if place not in engine:
                raise ValueError(f"declare[{name!r}].places[{i}]: {place[0]}.{place[1]} has no capture buffer")

    return on_declare
