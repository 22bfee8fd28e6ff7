"""Contrastive pairs: the data a difference-of-means (CAA) or PCA steering vector is made from.

A pair is ``{"positive": ..., "negative": ...}``; each side is a text or a conversation (a list of
``{"role", "content"}`` messages). A JSONL file holds one pair per line (blank lines are skipped; other keys on a line
are kept out of the vector and out of its data hash).

Example:
    >>> pairs = parse_pairs([{"positive": "I love it.", "negative": "I hate it."}])
    >>> pairs[0].positive, len(pairs_sha256(pairs))
    ('I love it.', 64)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


Side = Union[str, tuple[Message, ...]]


class ContrastPair(BaseModel):
    """A positive and a negative example of one concept: texts, or conversations under the chat template (a
    conversation that ends with an assistant message is read inside that message, the CAA answer-token form)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    positive: Side
    negative: Side

    def sides(self) -> tuple[Any, Any]:
        return _plain(self.positive), _plain(self.negative)


def _plain(side: Side) -> Any:
    return side if isinstance(side, str) else [m.model_dump() for m in side]


def _error_text(exc: ValidationError) -> str:
    e = exc.errors()[0]
    where = ".".join(str(x) for x in e["loc"] if not str(x).startswith(("str", "tuple[")))
    if e["type"] == "missing":
        return f"missing key {where!r}"
    return f"{where or 'pair'}: {e['msg']}"


def parse_pairs(items: Iterable[Any], where: str = "pairs") -> list[ContrastPair]:
    """Validate pairs (dicts or :class:`ContrastPair`); ``ValueError`` names the item and the field."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(item if isinstance(item, ContrastPair) else ContrastPair.model_validate(item))
        except ValidationError as exc:
            raise ValueError(f"{where}[{i}]: {_error_text(exc)}") from None
    if not out:
        raise ValueError(f"{where}: no pairs; give at least one {{'positive': ..., 'negative': ...}}")
    return out


def read_pairs(path: str | Path) -> list[ContrastPair]:
    """Read a JSONL file of pairs. ``ValueError`` names the file, the line (1-based) and the key."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: line {n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}: line {n}: expected an object {{\"positive\": ..., \"negative\": ...}}, "
                                 f"got {type(obj).__name__}")
            try:
                out.append(ContrastPair.model_validate(obj))
            except ValidationError as exc:
                raise ValueError(f"{path}: line {n}: {_error_text(exc)}") from None
    if not out:
        raise ValueError(f"{path}: no pairs (an empty file)")
    return out


def pairs_sha256(pairs: Sequence[ContrastPair]) -> str:
    """SHA-256 of the pairs' content (canonical JSON of ``[[positive, negative], ...]``, in order): the same data
    gives the same hash whatever the file's layout or extra keys."""
    data = [list(p.sides()) for p in pairs]
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode("utf-8")).hexdigest()


__all__ = ["ContrastPair", "Message", "parse_pairs", "pairs_sha256", "read_pairs"]
