"""The registry of a worker's live requests and the table rows their compiled configurations hold.

A request's rows compile ``global + request`` (and, for the decode phase, a monitor's ``steer`` command) per phase,
with its effective dynamic policy (a command's patch, over the request's own, over the global one) in the decode
row. Rows are shared
by configuration (:class:`~dynsteer.steering.rows.RowPool`); compiled contents are memoised per (global
configuration, payload body), since most traffic repeats a few configurations and compiling hashes every vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

import numpy as np

from dynsteer.config import Limits
from dynsteer.memo import BoundedMemo
from dynsteer.request.payload import PAYLOAD_KEY, config_fingerprint
from dynsteer.request.compile_spec import compile_phase
from dynsteer.request.programs import EMPTY, RowContent
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

    def check_global(self, spec: SteeringSpec, policy: DynamicSteeringPolicy | None) -> None:
        """Compile a global configuration for both phases (raises naming the bad field; changes nothing)."""
        for phase in ("prefill", "decode"):
            compile_phase([("global.", spec)], phase, self.shape, self.named,
                          None if policy is None else ("global_policy.", policy))

    def set_global(self, spec: SteeringSpec, policy: DynamicSteeringPolicy | None) -> None:
        """Take a (checked) global configuration; live requests' rows are the caller's to release and assign."""
        self.global_spec, self.global_policy = spec, policy
        self._global_key = config_fingerprint(spec, policy)  # keys compiled: a global set and cleared hits again

    def global_fingerprint(self) -> str:
        """Hex id of the global prefill configuration ('' when prompts are unsteered globally)."""
        return compile_phase([("global.", self.global_spec)], "prefill", self.shape, self.named).digest.hex()

    def effective_policy(self, entry: RequestEntry) -> DynamicSteeringPolicy | None:
        """The policy a request runs under (a command's patch, else its own, else the global one); ``None`` when
        stopped or when the policy gates nothing."""
        if entry.error is not None:
            return None
        policy = entry.cmd_policy if entry.cmd_policy is not None else (
            entry.policy if entry.policy is not None else self.global_policy)
        return policy if policy is not None and (policy.rules or policy.controller) else None

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
        specs = [("global.", self.global_spec)]
        key: bytes | None = b""  # the global configuration alone
        if entry.spec is not None and not entry.spec.is_empty():
            specs.append((f"extra_args.{PAYLOAD_KEY}.spec.", entry.spec))
            key = entry.payload_key
        policy = self.effective_policy(entry)
        if entry.policy is not None and policy is not None:
            key = entry.payload_key
        extra: list[tuple[str, SteeringSpec]] = []
        if entry.cmd_spec is not None or entry.cmd_policy is not None:
            key = None  # commanded: not worth memoising
            if entry.cmd_spec is not None:
                extra = [("command.spec.", entry.cmd_spec)]
        contents = self._compile(specs, key, policy, extra)
        entry.rows = self._acquire(contents)
        entry.prefill, entry.decode = contents

    def release(self, entry: RequestEntry) -> None:
        """The request no longer holds its rows (they stay cached for the next request with its configuration)."""
        self._touch()
        self.pool.release(entry.prefill.digest)
        self.pool.release(entry.decode.digest)
        entry.prefill = entry.decode = EMPTY
        entry.rows = (0, 0)

    def _compile(self, specs: list[tuple[str, SteeringSpec]], key: Hashable | None,
                 policy: DynamicSteeringPolicy | None = None,
                 decode_extra: list[tuple[str, SteeringSpec]] = ()) -> list[RowContent]:
        """Both phases' contents, memoised per (global configuration, payload). ``decode_extra``: specs added to
        the decode phase only (a monitor's ``steer`` command)."""
        key = None if key is None else (self._global_key, key)
        cached = self.compiled.get(key) if key is not None else None
        if cached is None:
            pol = None if policy is None else (f"extra_args.{PAYLOAD_KEY}.policy.", policy)
            cached = [compile_phase(specs, "prefill", self.shape, self.named, pol),
                      compile_phase([*specs, *decode_extra], "decode", self.shape, self.named, pol)]
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
