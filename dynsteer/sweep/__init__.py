"""Sweeps: a policy or steering spec, a grid over its fields, a labelled prompt set, one engine, metrics and a report.

* :mod:`dynsteer.sweep.grid` — ``path=v1,v2`` axes applied to pydantic models;
* :mod:`dynsteer.sweep.metrics` — the per-sample metrics and their definitions;
* :mod:`dynsteer.sweep.config` — :class:`SweepConfig`, prompt and policy/spec files;
* :mod:`dynsteer.sweep.vectorref` — vectors in those files and grids by file (``.npy``, safetensors) or name;
* :mod:`dynsteer.sweep.control` — each steered variant's random-direction control (same norm, place, scale, gates);
* :mod:`dynsteer.sweep.quality` — concept gain, fluency, the combined score, the Pareto front;
* :mod:`dynsteer.sweep.runner` — :func:`run_sweep` (resumable, reproducible), ``samples.jsonl``;
* :mod:`dynsteer.sweep.summary` — ``summary.csv``: per variant and class;
* :mod:`dynsteer.sweep.report` — the self-contained HTML report (its tables: :mod:`dynsteer.sweep.report_tables`).
"""

from dynsteer.sweep.grid import GridAxis, apply_point, grid_points, parse_axis
from dynsteer.sweep.config import PromptItem, SweepConfig, load_prompts, load_target
from dynsteer.sweep.runner import SweepInterrupted, SweepMismatchError, SweepResult, run_sweep

__all__ = ["GridAxis", "PromptItem", "SweepConfig", "SweepInterrupted", "SweepMismatchError", "SweepResult",
           "apply_point", "grid_points", "load_prompts", "load_target", "parse_axis", "run_sweep"]
