"""What dynamic steering did to one request: per generated token, each gate slot's score, gate and applied gate
(the trace), and the per-request report a request asks for with its payload's ``report`` (:class:`ReportValues`).

Returned with the outputs as ``output.trace`` by :meth:`dynsteer.Steerer.generate` when a policy is active.

Example:
    >>> t = DynamicTrace(tag="a", monitors=["m"], scopes=["this_token"], position=[5, 6],
    ...                  score=[[0.1], [2.0]], gate=[[0.2], [0.9]], applied=[[0.2], [0.9]], scale=[1.0, 1.0])
    >>> t.fired("m").tolist()
    [False, True]
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict


class DynamicTrace(BaseModel):
    """One request's dynamic-steering trace (one row per generated token whose forward ran).

    Attributes:
        tag: the request's payload tag.
        monitors: the monitor read by each gate slot (one slot per rule, then the controller's monitor when no
            rule reads it).
        scopes: each slot's rule scope (``"monitor"``: a controller-only slot).
        position: sequence position of each traced token (the token fed to that step's forward).
        score: ``[tokens][slots]`` the monitor's ``x·probe``.
        gate: ``[tokens][slots]`` ``σ(sharpness·(score − threshold))`` (0 below the rule's floor).
        applied: ``[tokens][slots]`` the gate that multiplied the slot's actions (scope and controller applied).
        scale: the sync controller's ``dyn_scale`` in effect at each token (1 without a controller).
    """

    model_config = ConfigDict(frozen=True)

    tag: str
    monitors: list[str]
    scopes: list[str]
    position: list[int]
    score: list[list[float]]
    gate: list[list[float]]
    applied: list[list[float]]
    scale: list[float]

    def _slot(self, monitor: str | int) -> int:
        return monitor if isinstance(monitor, int) else self.monitors.index(monitor)

    def scores(self, monitor: str | int = 0) -> np.ndarray:
        """Scores of one slot (by monitor name or slot index), one per traced token."""
        return np.asarray(self.score, np.float64).reshape(len(self.position), -1)[:, self._slot(monitor)]

    def gates(self, monitor: str | int = 0) -> np.ndarray:
        return np.asarray(self.gate, np.float64).reshape(len(self.position), -1)[:, self._slot(monitor)]

    def applied_gates(self, monitor: str | int = 0) -> np.ndarray:
        return np.asarray(self.applied, np.float64).reshape(len(self.position), -1)[:, self._slot(monitor)]

    def fired(self, monitor: str | int = 0, at: float = 0.5) -> np.ndarray:
        """Tokens whose gate reached ``at``."""
        return self.gates(monitor) >= at

    def __len__(self) -> int:
        return len(self.position)


class ReportValues:
    """A request's report (payload ``report``) as its values arrive, and its JSON form.

    Values arrive per *read-back token* (the token fed to a forward, at ``position``); a report gives them per
    *generated token*, like logprobs: generated token ``i`` (at position ``prompt_len + i``) carries the values of
    the forward that produced it, the one fed position ``prompt_len + i − 1`` (the trace's row at that position). The
    first generated token comes from the prompt's forward, which no gate steers: its entry is ``null``; so are the
    entries of a request that ran without a dynamic state.

    The JSON form (``dynsteer`` on an OpenAI choice, ``CompletionOutput.dynsteer`` in Python)::

        {"report": "tokens", "monitors": ["m"],          # "tokens" reports: one entry per generated token
         "score": [null, [0.31], ...],                    # each gate slot's probe score (null: no value)
         "gate": [null, [0.88], ...],                     # each gate slot's applied gate
         "summary": {"acted": true, "tokens_steered": 12, "abort": null,     # on the final output only
                     "rules": [{"monitor": "m", "scope": "this_token", "acts": true, "max_gate": 0.97,
                                "max_score": 1.2, "last_score": 0.4}]}}

    A ``"summary"`` report has ``report`` and ``summary`` only. Slots are as in :class:`DynamicTrace` (one per rule,
    then the controller's monitor when no rule reads it); a prompt-level gate has no per-token score (``null``).
    """

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.kind = "summary"
        self.monitors: list[str] = []
        self.scopes: list[str] = []
        self.acts: list[bool] = []
        self.values: dict[int, tuple[list, list]] = {}  # position -> (scores, applied gates)
        self.upto = 0  # every position below has arrived (positions arrive in order)
        self.done = False

    def add(self, delta: dict) -> None:
        """Fold a delta the workers sent (``dynsteer.steering.dynamic.reports``)."""
        self.kind = delta.get("report", self.kind)
        for key in ("monitors", "scopes", "acts"):
            if key in delta:
                setattr(self, key, list(delta[key]))
        for pos, score, applied in zip(delta.get("position", ()), delta.get("score", ()), delta.get("applied", ())):
            self.values[int(pos)] = ([None if s != s else float(s) for s in score], [float(a) for a in applied])
            self.upto = max(self.upto, int(pos) + 1)
        self.done = self.done or bool(delta.get("done"))

    def covered(self, tokens: int) -> bool:
        """Whether the values of generated tokens ``[0, tokens)`` have all arrived (or none will come)."""
        return self.done or tokens <= 1 or self.upto >= self.prompt_len + tokens - 1

    def json(self, start: int, stop: int, final: bool, abort: str | None = None) -> dict | None:
        """The report of generated tokens ``[start, stop)`` (a streamed chunk's, or the whole output's), with the
        summary when ``final``; ``None`` when there is nothing to say (a summary report's chunk before the last)."""
        out: dict = {"report": self.kind}
        if self.kind == "tokens":
            rows = [self.values.get(self.prompt_len + i - 1) for i in range(start, stop)]
            out["monitors"] = self.monitors
            out["score"] = [None if r is None else r[0] for r in rows]
            out["gate"] = [None if r is None else r[1] for r in rows]
        elif not final:
            return None
        if final:
            out["summary"] = self.summary(abort)
        return out

    def summary(self, abort: str | None = None) -> dict:
        """Whether steering acted, on how many tokens, and per slot its largest applied gate and its scores."""
        rows = [self.values[p] for p in sorted(self.values)]
        steered = sum(1 for _, applied in rows if any(a != 0 for a, acts in zip(applied, self.acts) if acts))
        rules = []
        for g, monitor in enumerate(self.monitors):
            scores = [r[0][g] for r in rows if r[0][g] is not None]
            rules.append({"monitor": monitor, "scope": self.scopes[g] if g < len(self.scopes) else None,
                          "acts": bool(self.acts[g]) if g < len(self.acts) else False,
                          "max_gate": max((r[1][g] for r in rows), default=None),
                          "max_score": max(scores, default=None), "last_score": scores[-1] if scores else None})
        return {"acted": steered > 0, "tokens_steered": steered, "abort": abort, "rules": rules}


def merge_reports(first: dict | None, then: dict | None) -> dict | None:
    """Two consecutive chunks' reports as one (their tokens concatenated; the later summary)."""
    if first is None or then is None:
        return then if first is None else first
    out = dict(first)
    for key in ("score", "gate"):
        if key in then:
            out[key] = [*first.get(key, []), *then[key]]
    if "summary" in then:
        out["summary"] = then["summary"]
    return out
