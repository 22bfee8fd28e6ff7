"""The registry of a worker's live requests and the table rows their compiled configurations hold.

A request's rows compile its effective configuration (:func:`dynsteer.request.resolve.resolve`: the global one, the
request's own and a monitor's commands) per phase. Rows are shared by configuration
(:class:`~dynsteer.steering.rows.RowPool`); compiled contents are memoised per (global configuration, payload
body), since most traffic repeats a few configurations and compiling hashes every vector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

import numpy as np

from dynsteer.config import Limits
from dynsteer.memo import BoundedMemo
from dynsteer.request.compile_spec import compile_phase
from dynsteer.request.payload import config_fingerprint
from dynsteer.request.programs import EMPTY, RowContent
from dynsteer.request.resolve import CommandPatch, Configuration, Effective, check_global, resolve
from dynsteer.spec import ModelShape, SteeringSpec, SteeringValidationError, check_vector
from dynsteer.steering.rows import RowPool, RowsExhausted
from dynsteer.steering.tables import SteeringTables

if TYPE_CHECKING:
    from dynsteer.policy import DynamicSteeringPolicy
    from dynsteer.steering.dynamic.state import DynState


@dataclass
class RequestEntry:
    prompt_len: int
    spec: SteeringSpec | None
    tag: str | None = None
    prefill: RowContent = EMPTY
    decode: RowContent = EMPTY
    rows: tuple[int, int] = (0, 0)
    error: str | None = None
    payload_key: bytes | None = None  # digest of the packed payload body (no tag), if the request sent one (memo key)
    policy: DynamicSteeringPolicy | None = None  # the request's own policy (overrides the global one)
    dyn: DynState | None = None
    trace: bool = False  # keep the trace for the caller (payload's ``trace`` flag)
    report: str | None = None  # payload's ``report``: its read-back values go back with its outputs
    cmd_spec: SteeringSpec | None = None  # a monitor's ``steer`` command: added to its decode tokens
    cmd_policy: DynamicSteeringPolicy | None = None  # its policy as monitors' threshold/rule commands patched it


class RequestRegistry:
    """Live requests by id, the global configuration folded into their rows, and the named vectors they may use.

    Args:
        touch: called whenever a request's rows change (the runtime's per-batch arrays are gathered again).
    """

    def __init__(self, shape: ModelShape, tables: SteeringTables, limits: Limits, touch: Callable[[], None]) -> None:
        self.shape, self.tables, self.limits, self._touch = shape, tables, limits, touch
        self.entries: dict[str, RequestEntry] = {}
        self.pool = RowPool(tables.num_rows)
        self.named: dict[str, np.ndarray] = {}
        self.global_spec = SteeringSpec()
        self.global_policy: DynamicSteeringPolicy | None = None
        # compiled rows by (global configuration, payload body digest), charged what they hold (dynsteer.memo)
        self.compiled: BoundedMemo[list[RowContent]] = BoundedMemo(limits.cache_bytes)
        self._global_key = config_fingerprint(self.global_spec, self.global_policy)

    def register_vector(self, name: str, vector: np.ndarray) -> None:
        """Register (or replace) a named vector; refused, changing nothing, when it would exceed
        ``limits.max_named_vectors`` (every rank holds the same names, so every rank refuses alike)."""
        check_vector(vector, self.shape.hidden_size, f"vector {name!r}")
        limit = self.limits.max_named_vectors
        if name not in self.named and len(self.named) >= limit:
            raise SteeringValidationError(f"name: cannot register {name!r}: {len(self.named)} named vectors are "
                                          f"registered, the engine's limit max_named_vectors = {limit}")
        self.named[name] = np.ascontiguousarray(vector, np.float32)
        self.compiled.clear()

    def unregister_vector(self, name: str) -> None:
        """Forget a named vector (no-op when unknown). Memoised rows compiled with it go too: a later request naming
        it must fail its compile, not reuse a row that still holds the old vector."""
        if self.named.pop(name, None) is not None:
            self.compiled.clear()

    def check_global(self, spec: SteeringSpec, policy: DynamicSteeringPolicy | None) -> None:
        """Compile a global configuration for both phases (raises naming the bad field; changes nothing)."""
        check_global(Configuration(spec, policy), self.shape, self.named)

    def set_global(self, spec: SteeringSpec, policy: DynamicSteeringPolicy | None) -> None:
        """Take a (checked) global configuration; live requests' rows are the caller's to release and assign."""
        self.global_spec, self.global_policy = spec, policy
        self._global_key = config_fingerprint(spec, policy)  # keys compiled: a global set and cleared hits again

    def global_fingerprint(self) -> str:
        """Hex id of the global prefill configuration ('' when prompts are unsteered globally)."""
        return compile_phase(resolve(self.global_config).phase_specs("prefill"), "prefill", self.shape,
                             self.named).digest.hex()

    @property
    def global_config(self) -> Configuration:
        return Configuration(self.global_spec, self.global_policy)

    def effective(self, entry: RequestEntry) -> Effective:
        """The request's effective configuration: the global one, its own, its commands."""
        return resolve(self.global_config, Configuration(entry.spec, entry.policy),
                       CommandPatch(entry.cmd_spec, entry.cmd_policy))

    def effective_policy(self, entry: RequestEntry) -> DynamicSteeringPolicy | None:
        """The policy a request runs under (a command's patch, else its own, else the global one); ``None`` when
        stopped or when the policy gates nothing."""
        if entry.error is not None:
            return None
        effective = self.effective(entry)
        return effective.policy if effective.gates else None

    def assign(self, entry: RequestEntry) -> None:
        """Compile the request's configuration and give it the rows holding it (a stopped request reads row 0).

        Raises:
            SteeringValidationError: a bad field (a vector name unregistered mid-flight, say).
            RowsExhausted: every row holds a live configuration.
        """
        self._touch()
        if entry.error is not None:  # stopped: it runs unsteered until the scheduler finishes it
            entry.prefill, entry.decode, entry.rows = EMPTY, EMPTY, (0, 0)
            return
        effective = self.effective(entry)
        # the memo key: the global configuration alone, or with the payload when the request's own spec or policy
        # counts; a commanded request is not worth memoising
        own = (entry.spec is not None and not entry.spec.is_empty()) or (entry.policy is not None and effective.gates)
        key: bytes | None = entry.payload_key if own else b""
        if entry.cmd_spec is not None or entry.cmd_policy is not None:
            key = None
        contents = self._compile(effective, key)
        entry.rows = self._acquire(contents)
        entry.prefill, entry.decode = contents

    def release(self, entry: RequestEntry) -> None:
        """The request no longer holds its rows (they stay cached for the next request with its configuration)."""
        self._touch()
        self.pool.release(entry.prefill.digest)
        self.pool.release(entry.decode.digest)
        entry.prefill = entry.decode = EMPTY
        entry.rows = (0, 0)

    def _compile(self, effective: Effective, key: Hashable | None) -> list[RowContent]:
        """Both phases' contents, memoised per (global configuration, payload)."""
        key = None if key is None else (self._global_key, key)
        cached = self.compiled.get(key) if key is not None else None
        if cached is None:
            cached = [compile_phase(effective.phase_specs(phase), phase, self.shape, self.named,
                                    effective.gated_policy) for phase in ("prefill", "decode")]
            if key is not None:
                self.compiled.put(key, cached)
        return cached

    def _acquire(self, contents: list[RowContent]) -> tuple[int, int]:
        acquired: list[RowContent] = []
        try:
            rows = []
            for content in contents:
                row, new = self.pool.acquire(content)
                acquired.append(content)
                if new:
                    self.tables.write_row(row, content)
                rows.append(row)
            return rows[0], rows[1]
        except RowsExhausted:
            for content in acquired:
                self.pool.release(content.digest)
            raise

    def describe(self) -> dict[str, int]:
        return {"rows_in_use": self.pool.in_use, "rows_idle": self.pool.idle, "rows_revived": self.pool.revived,
                "rows_written": self.pool.written, "rows_total": self.tables.num_rows - 1}
