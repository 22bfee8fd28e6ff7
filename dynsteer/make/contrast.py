"""Steering vectors from contrastive pairs on a live engine: difference of means (CAA) and PCA of pair differences.

Each side of each pair is sent through the engine once (greedy, one token, thrown away) and its residual is read
through dynsteer's capture API by :func:`dynsteer.probes.collect`, the same collection probe training uses; the
vector at each layer is then :func:`~dynsteer.vectors.directions.mean_difference` or
:func:`~dynsteer.vectors.directions.pca_direction` of the positive and negative rows.

Where the residual is read (``positions``): ``"last"``, the last prompt token (by default under the chat template,
with the generation prompt appended: where the assistant starts answering; for a conversation that ends with an
assistant message, the last token of that message); an integer ``k``, the mean over the last ``k`` prompt tokens;
``"all"``, the mean over all prompt tokens.

Example:
    >>> sv = from_pairs(steerer, [("I love it.", "I hate it.")], layers=[12])   # doctest: +SKIP
    >>> sv.save("joy.safetensors")                                              # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, Union

import numpy as np

from dynsteer.probes.collect import collect
from dynsteer.spec import Site
from dynsteer.vectors.directions import mean_difference, pca_direction, rescale
from dynsteer.vectors.made import SteeringVectors
from dynsteer.vectors.pairs import ContrastPair, parse_pairs, pairs_sha256

PairMethod = Literal["caa", "pca"]
PairPositions = Union[Literal["last", "all"], int]


def _as_pairs(pairs: Iterable[Any]) -> list[ContrastPair]:
    items = [{"positive": p[0], "negative": p[1]} if isinstance(p, (tuple, list)) and len(p) == 2 else p
             for p in pairs]
    return parse_pairs(items)


def render(tok: Any, side: Any, chat_template: bool, where: str) -> Any:
    """One engine prompt: a raw text, or token ids of the chat template rendered once (it already holds the
    special tokens, so tokenising it as text again could add a second BOS)."""
    if not chat_template:
        if not isinstance(side, str):
            raise ValueError(f"{where}: a conversation needs the chat template (drop --no-chat-template)")
        return side
    messages = [{"role": "user", "content": side}] if isinstance(side, str) else list(side)
    if messages[-1]["role"] == "assistant":  # read inside the assistant's answer (the CAA answer-token form)
        text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                       tokenize=False)
    else:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return {"prompt_token_ids": list(tok.encode(text, add_special_tokens=False))}


def _collect_args(positions: PairPositions) -> dict[str, Any]:
    if positions == "last":
        return {"positions": "last_prompt"}
    if positions == "all":
        return {"positions": "all_prompt"}
    if isinstance(positions, (int, np.integer)) and not isinstance(positions, bool) and positions >= 1:
        return {"positions": "all_prompt", "last_k": int(positions)}
    raise ValueError(f"positions: {positions!r}; 'last', 'all' or a count k >= 1 (mean over the last k prompt "
                     f"tokens)")


def from_pairs(steerer: Any, pairs: Iterable[Any], *, layers: Iterable[int], method: PairMethod = "caa",
               site: Site = "post_block", positions: PairPositions = "last", chat_template: bool = True,
               norm: float | None = None, batch_size: int = 32, progress: bool = False) -> SteeringVectors:
    """Make a steering vector per layer from contrastive pairs.

    Args:
        steerer: ``dynsteer.attach(llm)`` of an engine with capture buffers at ``(layers, site)``
            (``DynsteerConfig(capture_sites=(site,))``).
        pairs: :class:`~dynsteer.vectors.pairs.ContrastPair` objects, ``{"positive", "negative"}`` dicts or
            ``(positive, negative)`` tuples; each side a text or a list of ``{"role", "content"}`` messages.
        layers: decoder layers to make a vector for.
        method: ``caa`` (mean of positives − mean of negatives) or ``pca`` (first principal component of the pair
            differences, signed so positives project higher, scaled to the mean difference along it).
        site: residual site.
        positions: ``"last"``, ``"all"`` or ``k`` (mean over the last ``k`` prompt tokens).
        chat_template: render each side with the model's chat template (a text as one user message); ``False``
            sends texts as they are.
        norm: rescale each layer's vector to this L2 norm (``None``: keep the measured length).
        batch_size: prompts per engine pass.
        progress: show a progress bar.

    Raises:
        ValueError: naming the pair and field, the option, or the engine setting that is missing.
    """
    if method not in ("caa", "pca"):
        raise ValueError(f"method: {method!r}; 'caa' or 'pca'")
    pairs = _as_pairs(pairs)
    layers = tuple(int(layer) for layer in layers)
    if not layers:
        raise ValueError("layers: empty; give at least one layer")
    how = _collect_args(positions)
    if method == "pca" and len(pairs) < 2:
        raise ValueError("pairs: PCA needs at least 2 pairs")
    tok = steerer.llm.get_tokenizer() if chat_template else None
    # positives first, then negatives: rows [:n] and [n:] of each layer's matrix
    inputs = [render(tok, p.sides()[k], chat_template, f"pairs[{i}].{name}")
              for k, name in enumerate(("positive", "negative")) for i, p in enumerate(pairs)]
    acts = collect(steerer, inputs, layers=layers, site=site, batch_size=batch_size, progress=progress, **how)
    n = len(pairs)
    make = mean_difference if method == "caa" else pca_direction
    vectors = {layer: rescale(make(acts.X[layer][:n], acts.X[layer][n:]), norm, f"layer {layer}")
               for layer in layers}
    meta: dict[str, Any] = {"n_pairs": n, "positions": positions, "chat_template": chat_template,
                            "data_sha256": pairs_sha256(pairs)}
    if norm is not None:
        meta["rescaled_to"] = float(norm)
    return SteeringVectors(vectors=vectors, site=site, model_id=steerer.shape.model_id, method=method, meta=meta)


def make_caa(steerer: Any, pairs: Sequence[Any], **kwargs: Any) -> SteeringVectors:
    """:func:`from_pairs` with ``method="caa"``."""
    return from_pairs(steerer, pairs, method="caa", **kwargs)


def make_pca(steerer: Any, pairs: Sequence[Any], **kwargs: Any) -> SteeringVectors:
    """:func:`from_pairs` with ``method="pca"``."""
    return from_pairs(steerer, pairs, method="pca", **kwargs)


__all__ = ["PairMethod", "PairPositions", "from_pairs", "make_caa", "make_pca", "render"]
