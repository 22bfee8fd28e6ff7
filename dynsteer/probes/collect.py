"""Collect residual-stream activations for probe training from a live vLLM engine, through the capture API.

Each batch of prompts is one engine pass (greedy, ``max_tokens=1``): the prompt is prefilled, one token is sampled
and thrown away, and the capture buffers return the residual at the selected prompt positions. The engine must have
capture buffers at the requested places: build it with
``LLM(..., **DynsteerConfig(capture_sites=("post_block",)).engine_kwargs())``.

Example:
    >>> acts = collect(steerer, sentences, labels, layers=range(4, 30, 2))   # doctest: +SKIP
    >>> acts.X[10].shape                                                      # doctest: +SKIP
    (60, 576)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynsteer.capture.spec import CaptureSpec, Positions
from dynsteer.spec import Site


@dataclass
class Activations:
    """Per-layer activation matrices with optional labels.

    Attributes:
        X: ``{layer: [n_samples, hidden] float32}``. With ``positions="last_prompt"`` (the default) each row is the
            residual at the prompt's last token; with a multi-position selector (``all_prompt``, explicit positions)
            each row is the MEAN over that prompt's selected positions, so every prompt gives exactly one row.
        y: labels ``[n_samples]`` or ``None``.
        site: the residual site the rows were read at.
        model_id: the engine's model id (its path or hub name).
        hidden_size: the model's hidden size.
        positions: the position selector used.
        n_positions: how many positions were averaged for each sample, ``[n_samples]``.
    """

    X: dict[int, np.ndarray]
    y: np.ndarray | None
    site: Site
    model_id: str
    hidden_size: int
    positions: Positions = "last_prompt"
    n_positions: np.ndarray | None = None

    @property
    def layers(self) -> list[int]:
        return sorted(self.X)

    def __len__(self) -> int:
        return len(next(iter(self.X.values()))) if self.X else 0

    def subset(self, idx: np.ndarray | Sequence[int]) -> "Activations":
        """The same activations restricted to samples ``idx`` (e.g. a train or test split)."""
        idx = np.asarray(idx)
        return Activations(X={k: v[idx] for k, v in self.X.items()}, y=None if self.y is None else self.y[idx],
                           site=self.site, model_id=self.model_id, hidden_size=self.hidden_size,
                           positions=self.positions,
                           n_positions=None if self.n_positions is None else self.n_positions[idx])


def chat_prompts(llm: Any, prompts: Sequence[str]) -> list[dict[str, list[int]]]:
    """Wrap each prompt as a single user message with the engine tokenizer's chat template.

    Returns token-id prompts (``{"prompt_token_ids": [...]}``): the rendered template already holds any BOS/special
    tokens, so tokenising it again as plain text could add a second BOS.
    """
    tok = llm.get_tokenizer()
    out = []
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        out.append({"prompt_token_ids": list(tok.encode(text, add_special_tokens=False))})
    return out


def collect(steerer: Any, prompts: Sequence[str], labels: Sequence[Any] | np.ndarray | None = None, *,
            layers: Iterable[int], site: Site = "post_block", positions: Positions = "last_prompt",
            batch_size: int = 32, progress: bool = True, chat: bool = False) -> Activations:
    """Run ``prompts`` through the engine and return their residuals at ``layers`` × ``site``.

    Args:
        steerer: ``dynsteer.attach(llm)`` of an engine with capture buffers at ``(layers, site)``.
        prompts: input texts.
        labels: one label per prompt (kept as ``Activations.y``), or ``None``.
        layers: decoder layers to read.
        site: residual site (``pre_attn``, ``post_attn``, ``post_block``).
        positions: ``last_prompt`` (one row per prompt), ``all_prompt`` or explicit absolute positions (mean over
            the selected positions; positions past the prompt are dropped by the capture, since only one token
            is generated and it is never fed back).
        batch_size: prompts per engine pass.
        progress: show a tqdm progress bar over batches.
        chat: wrap each prompt as a user message with the model's chat template (generation prompt appended), so the
            residual is read where the assistant would start answering.

    Raises:
        ValueError: label count differs from prompt count, the places have no capture buffers, or a prompt captured
            no position.
    """
    from tqdm.auto import tqdm
    from vllm import SamplingParams

    prompts = list(prompts)
    layers = tuple(int(layer) for layer in layers)
    y = None if labels is None else np.asarray(labels)
    if y is not None and len(y) != len(prompts):
        raise ValueError(f"got {len(y)} labels for {len(prompts)} prompts")
    if positions in ("all_generated",):
        raise ValueError("positions='all_generated' captures nothing with max_tokens=1; use a prompt selector")
    spec = CaptureSpec(layers=layers, sites=(site,), positions=positions)
    spec.check(steerer.shape, steerer.capture_places)  # fail before the first batch, naming the config fix
    inputs: list[Any] = chat_prompts(steerer.llm, prompts) if chat else prompts
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rows: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
    counts: list[int] = []
    batches = range(0, len(inputs), batch_size)
    for start in tqdm(batches, desc="collect", unit="batch", disable=not progress):
        outs = steerer.generate(inputs[start:start + batch_size], params, capture=spec, use_tqdm=False)
        for i, out in enumerate(outs):
            cap = out.capture
            if cap is None or cap.status == "error" or len(cap.positions) == 0:
                why = "no capture" if cap is None else (cap.errors or "no positions selected")
                raise ValueError(f"prompt {start + i}: nothing captured ({why})")
            counts.append(len(cap.positions))
            for layer in layers:
                # float64 accumulation for the mean; stored as float32 like the capture itself
                rows[layer].append(cap[(layer, site)].astype(np.float64).mean(0).astype(np.float32))
    X = {layer: np.stack(r) if r else np.zeros((0, steerer.hidden_size), np.float32) for layer, r in rows.items()}
    return Activations(X=X, y=y, site=site, model_id=steerer.shape.model_id, hidden_size=steerer.hidden_size,
                       positions=positions, n_positions=np.asarray(counts, dtype=np.int64))


def align(capture: Any, trace: Any, place: tuple[int, str]) -> tuple[np.ndarray, np.ndarray]:
    """Line a request's captured rows up with its dynamic trace: ``(X, at)`` where ``X[i]`` is the residual
    captured at ``place`` for the position ``trace.position[at[i]]``, for every position both hold, in position
    order (a trace covers generated tokens fed back; a capture may cover more, or fewer when it was partial).
    ``probe.predict_proba(X)`` then lines up with ``trace.gates()[at]``."""
    cpos = np.asarray(capture.positions, np.int64)
    tpos = np.asarray(trace.position, np.int64)
    _, ci, ti = np.intersect1d(cpos, tpos, assume_unique=True, return_indices=True)
    return np.asarray(capture[place], np.float64)[ci], ti


__all__ = ["Activations", "align", "chat_prompts", "collect"]
