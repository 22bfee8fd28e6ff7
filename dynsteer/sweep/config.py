"""What a sweep is: the base policy or spec, the grid, the labelled prompt set and the sampling settings.

:class:`SweepConfig` is pydantic and has a fingerprint (everything that decides the samples), which an output
directory remembers so that a re-run resumes only the same sweep.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynsteer.policy import DynamicSteeringPolicy
from dynsteer.spec import SteeringSpec
from dynsteer.sweep.grid import GridAxis, GridPathError, apply_point, parse_axis
from dynsteer.sweep.vectorref import resolve_axis_refs, resolve_vector_refs

__all__ = ["BASELINE", "PromptItem", "SweepConfig", "UNLABELLED", "load_prompts", "load_target"]

BASELINE = "v000"
"""The unsteered baseline variant's id."""
UNLABELLED = "unlabelled"
"""The class of prompts without a label."""


class PromptItem(BaseModel):
    """One prompt of the set: a user message (``prompt``) or a whole conversation (``messages``), and its class.

    Attributes:
        prompt: the user message (chat) or raw prompt text (``chat=False``).
        messages: a conversation (``[{"role": ..., "content": ...}]``), instead of ``prompt``.
        label: its class (``None``: ``"unlabelled"``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: Optional[str] = None
    messages: Optional[tuple[dict[str, str], ...]] = None
    label: Optional[str] = None

    @model_validator(mode="after")
    def _one(self) -> "PromptItem":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages (exactly one)")
        return self

    @property
    def cls(self) -> str:
        return self.label if self.label is not None else UNLABELLED

    def text(self) -> str:
        """The prompt as shown in reports (the last message of a conversation)."""
        return self.prompt if self.prompt is not None else self.messages[-1].get("content", "")  # type: ignore


def load_prompts(path: str | Path) -> list[PromptItem]:
    """Read a JSONL prompt file: one object per line, ``{"prompt": ..., "label": ...}`` or ``{"messages": [...],
    "label": ...}`` (``label`` optional; ``text``/``class`` are accepted as aliases); a bare JSON string is a prompt.

    Raises:
        ValueError: naming the line that is not a valid prompt.
    """
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if isinstance(obj, str):
                obj = {"prompt": obj}
            if isinstance(obj, dict):
                obj = {{"text": "prompt", "class": "label"}.get(k, k): v for k, v in obj.items()}
            items.append(PromptItem.model_validate(obj))
        except ValueError as exc:
            raise ValueError(f"{path}:{n}: not a prompt: {exc}") from None
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def load_target(path: str | Path) -> DynamicSteeringPolicy | SteeringSpec:
    """A policy or steering-spec file (YAML or JSON): a policy if it has ``monitors``/``rules``/``controller``.

    Vector fields may reference ``.npy`` or steering-vector files and registered names
    (:mod:`dynsteer.sweep.vectorref`); relative paths there and in monitors' ``probe_file`` are read against the
    file's directory.

    Raises:
        ValueError: not a mapping, a reference that cannot be read, or a field the schema rejects (each naming it).
    """
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping (a DynamicSteeringPolicy or a SteeringSpec)")
    try:
        data = resolve_vector_refs(data, path.parent)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if {"monitors", "rules", "controller", "max_relative_dose"} & set(data):
        monitors = data.get("monitors")
        if isinstance(monitors, list):
            data["monitors"] = [_probe_file_here(m, path.parent) for m in monitors]
        return DynamicSteeringPolicy.model_validate(data)
    return SteeringSpec.model_validate(data)


def _probe_file_here(monitor: Any, base_dir: Path) -> Any:
    """A monitor whose relative ``probe_file`` names a file next to the policy file, made absolute."""
    pf = monitor.get("probe_file") if isinstance(monitor, dict) else None
    if isinstance(pf, str) and not Path(pf).expanduser().is_absolute() and (base_dir / pf).is_file():
        return {**monitor, "probe_file": str((base_dir / pf).resolve())}
    return monitor


class SweepConfig(BaseModel):
    """Everything that defines a sweep (and its fingerprint: change any field but ``batch_size`` and it is another
    sweep).

    Attributes:
        kind: ``policy`` or ``spec``.
        base: the base policy or spec (JSON form; probe-file monitors already loaded, so their ``threshold`` and
            ``sharpness`` can be swept).
        grid: the swept fields (:mod:`dynsteer.sweep.grid`); variants are their cartesian product.
        prompts: the labelled prompt set.
        samples: samples per prompt and variant; sample ``s`` uses seed ``seed + s``.
        seed: the first sample's seed.
        max_tokens, temperature, top_p: sampling (``temperature=0``: greedy).
        chat: apply the model's chat template (``prompt`` becomes a user message).
        target_class: the class the policy should steer (selectivity); ``None``: no selectivity figures.
        leave_alone: classes the policy should leave alone (side effects); default: every class but the target.
        probe_file: a probe file whose probability is the concept score (captured in the same run).
        concept_class: which probe class is the concept (1: the probe's positive class).
        words: a word list for the word concept score.
        batch_size: requests per engine batch (and per resume checkpoint).
        random_control: add, for each variant that adds a vector, its random-direction control
            (:mod:`dynsteer.sweep.control`: every added vector replaced by a seeded random direction of its norm).
        control_seed: the seed of the controls' random directions.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["policy", "spec"]
    base: dict[str, Any]
    grid: tuple[GridAxis, ...] = ()
    prompts: tuple[PromptItem, ...] = Field(min_length=1)
    samples: int = Field(default=1, ge=1)
    seed: int = 0
    max_tokens: int = Field(default=32, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    chat: bool = True
    target_class: Optional[str] = None
    leave_alone: Optional[tuple[str, ...]] = None
    probe_file: Optional[str] = None
    concept_class: Literal[0, 1] = 1
    words: tuple[str, ...] = ()
    batch_size: int = Field(default=64, ge=1)
    registered_vectors: dict[str, str] = Field(default_factory=dict)
    random_control: bool = True
    control_seed: int = 0

    @classmethod
    def build(cls, target: DynamicSteeringPolicy | SteeringSpec, *, grid: Sequence[str | GridAxis] = (),
              prompts: str | Path | Sequence[PromptItem | dict[str, Any] | str], **kwargs: Any) -> "SweepConfig":
        """A config from a policy or spec object, grid strings (``"path=v1,v2"``) and a prompt file or list."""
        if isinstance(target, DynamicSteeringPolicy):
            kind, base = "policy", json.loads(target.resolved().to_json())
        else:
            kind, base = "spec", json.loads(target.model_dump_json())
        if isinstance(prompts, (str, Path)):
            items = load_prompts(prompts)
        else:
            items = [p if isinstance(p, PromptItem) else PromptItem.model_validate(
                {"prompt": p} if isinstance(p, str) else p) for p in prompts]
        axes = [resolve_axis_refs(a if isinstance(a, GridAxis) else parse_axis(a), base) for a in grid]
        if kwargs.get("probe_file") is not None:
            kwargs["probe_file"] = str(Path(kwargs["probe_file"]).resolve())
        cfg = cls(kind=kind, base=base, grid=tuple(axes), prompts=tuple(items), **kwargs)
        cfg.check_paths()
        return cfg

    def check_paths(self) -> None:
        """Fail early on a grid path that addresses no field of the base (values are checked per variant).

        Raises:
            GridPathError: naming the path.
        """
        base = self.target()
        for axis in self.grid:
            try:
                apply_point(base, {axis.path: axis.values[0]})
            except GridPathError:
                raise
            except ValueError as exc:
                if "Extra inputs are not permitted" in str(exc):
                    raise GridPathError(f"grid path {axis.path!r}: no such field") from None

    def target(self) -> DynamicSteeringPolicy | SteeringSpec:
        model = DynamicSteeringPolicy if self.kind == "policy" else SteeringSpec
        return model.model_validate_json(json.dumps(self.base))

    def classes(self) -> list[str]:
        """Prompt classes in order of first appearance."""
        return list(dict.fromkeys(p.cls for p in self.prompts))

    def alone_classes(self) -> list[str]:
        if self.leave_alone is not None:
            return list(self.leave_alone)
        return [c for c in self.classes() if c != self.target_class] if self.target_class is not None else []

    def fingerprint(self) -> str:
        """sha256 of everything that decides the samples (the probe file's bytes included)."""
        # a sweep without controls keeps the fingerprint it had before controls existed (so it still resumes)
        unset = ({"registered_vectors"} if not self.registered_vectors else set()) | (
            {"random_control", "control_seed"} if not self.random_control else set())
        data = self.model_dump(mode="json", exclude={"batch_size"} | unset)
        for axis in data["grid"]:  # fields that are unset keep the fingerprints sweeps had before they existed
            if axis.get("names") is None:
                axis.pop("names", None)
        if self.probe_file is not None:
            data["probe_sha256"] = hashlib.sha256(Path(self.probe_file).read_bytes()).hexdigest()
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
