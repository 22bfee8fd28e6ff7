"""Collect residual-stream activations for probe training from a live vLLM engine, through the capture API.

Two collections, for two places a probe reads:

* :func:`collect`: one row per prompt, read in the prompt (its last token by default), raw text or under the chat
  template (``chat=True``): what a prompt-level gate reads.
* :func:`collect_generated`: one row per generated token, read while the model writes its own reply (under the chat
  template by default): what a per-token monitor reads. Decode-time residuals differ from prefill ones (cosine
  about 0.97), so a probe fitted on prompts can classify prompts well and still gate replies badly; rows carry
  the prompt index as ``groups``, so that :func:`~dynsteer.probes.layer_sweep` keeps one reply's tokens in one fold.

For :func:`collect`, each batch of prompts is one engine pass (greedy, ``max_tokens=1``): the prompt is prefilled,
one token is sampled and thrown away, and the capture buffers return the residual at the selected prompt positions.
The engine must have capture buffers at the requested places: build it with
``LLM(..., **DynsteerConfig(capture_sites=("post_block",)).engine_kwargs())``.

Example:
    >>> acts = collect(steerer, sentences, labels, layers=range(4, 30, 2))   # doctest: +SKIP
    >>> acts.X[10].shape                                                      # doctest: +SKIP
    (60, 576)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dynsteer.capture.spec import CaptureSpec, Positions
from dynsteer.spec import SITES, Site

GeneratedPositions = Literal["all_generated", "last_generated"]
#: ``labeller(prompt_index, token_ids, token_texts) -> labels``: one label per captured generated token (``-1`` or
#: ``None`` drops the row).
Labeller = Callable[[int, list[int], list[str]], Sequence[Any]]


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
        groups: for :func:`collect_generated`, the index of the prompt each row came from, ``[n_samples]``
            (cross-validation splits by it); ``None`` for one row per prompt.
        token_ids: for :func:`collect_generated`, each row's token (the generated token fed back at that position).
        token_positions: for :func:`collect_generated`, each row's absolute position in its request.
        tokens: for :func:`collect_generated`, each row's token as text.
        prompts: for :func:`collect_generated`, the prompt each prompt index was sent as (the rendered chat
            template, when one was applied), by prompt index.
        outputs: for :func:`collect_generated`, the generated text, by prompt index.
    """

    X: dict[int, np.ndarray]
    y: np.ndarray | None
    site: Site
    model_id: str
    hidden_size: int
    positions: Positions | GeneratedPositions = "last_prompt"
    n_positions: np.ndarray | None = None
    groups: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    token_positions: np.ndarray | None = None
    tokens: list[str] | None = None
    prompts: list[str] | None = None
    outputs: list[str] | None = None

    @property
    def layers(self) -> list[int]:
        return sorted(self.X)

    def __len__(self) -> int:
        return len(next(iter(self.X.values()))) if self.X else 0

    def subset(self, idx: np.ndarray | Sequence[int]) -> "Activations":
        """The same activations restricted to samples ``idx`` (e.g. a train or test split)."""
        idx = np.asarray(idx, dtype=np.int64)

        def rows(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[idx]

        return Activations(X={k: v[idx] for k, v in self.X.items()}, y=rows(self.y), site=self.site,
                           model_id=self.model_id, hidden_size=self.hidden_size, positions=self.positions,
                           n_positions=rows(self.n_positions), groups=rows(self.groups),
                           token_ids=rows(self.token_ids), token_positions=rows(self.token_positions),
                           tokens=None if self.tokens is None else [self.tokens[i] for i in idx],
                           prompts=self.prompts, outputs=self.outputs)


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


def collect(steerer: Any, prompts: Sequence[Any], labels: Sequence[Any] | np.ndarray | None = None, *,
            layers: Iterable[int], site: Site = "post_block", positions: Positions = "last_prompt",
            batch_size: int = 32, progress: bool = True, chat: bool = False, last_k: int | None = None
            ) -> Activations:
    """Run ``prompts`` through the engine and return their residuals at ``layers`` × ``site``.

    Args:
        steerer: ``dynsteer.attach(llm)`` of an engine with capture buffers at ``(layers, site)``.
        prompts: input texts (or engine prompts such as ``{"prompt_token_ids": [...]}``, sent as they are without
            ``chat``).
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
        last_k: with a multi-position selector (``all_prompt``), average only the last ``last_k`` selected positions
            of each prompt (all of them when the prompt is shorter).

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
    if last_k is not None and (positions == "last_prompt" or last_k < 1):
        raise ValueError(f"last_k: {last_k}; give a count >= 1 with a multi-position selector such as 'all_prompt'")
    spec = CaptureSpec(layers=layers, sites=(site,), positions=positions)
    spec.check(steerer.shape, steerer.capture_places)  # fail before the first batch, naming the config fix
    inputs: list[Any] = chat_prompts(steerer.llm, prompts) if chat else prompts
    keep = slice(-last_k if last_k is not None else None, None)  # positions are ascending: the last k rows
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
            counts.append(len(cap.positions[keep]))
            for layer in layers:
                # float64 accumulation for the mean; stored as float32 like the capture itself
                rows[layer].append(cap[(layer, site)][keep].astype(np.float64).mean(0).astype(np.float32))
    X = {layer: np.stack(r) if r else np.zeros((0, steerer.hidden_size), np.float32) for layer, r in rows.items()}
    return Activations(X=X, y=y, site=site, model_id=steerer.shape.model_id, hidden_size=steerer.hidden_size,
                       positions=positions, n_positions=np.asarray(counts, dtype=np.int64))


def _render(tok: Any, prompts: Sequence[Any], chat: bool) -> tuple[list[Any], list[str]]:
    """Engine inputs and the text each stands for. With ``chat``, a string is one user message and a list of
    ``{"role", "content"}`` dicts a whole conversation, rendered with the generation prompt appended and sent as
    token ids (the rendered template already holds its special tokens)."""
    inputs: list[Any] = []
    texts: list[str] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            messages = [{"role": "user", "content": p}]
        elif isinstance(p, Sequence) and p and all(isinstance(m, dict) and "role" in m for m in p):
            if not chat:
                raise ValueError(f"prompts[{i}]: a conversation needs chat_template=True")
            messages = list(p)
        else:
            raise ValueError(f"prompts[{i}]: expected a string or a list of {{'role', 'content'}} messages, "
                             f"got {type(p).__name__}")
        if chat:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs.append({"prompt_token_ids": list(tok.encode(text, add_special_tokens=False))})
        else:
            text = p
            inputs.append(p)
        texts.append(text)
    return inputs, texts


def _dropped(label: Any) -> bool:
    return label is None or (isinstance(label, (int, float, np.integer, np.floating)) and label == -1)


def collect_generated(llm_or_steerer: Any, prompts: Sequence[Any], labels: Sequence[Any] | np.ndarray | None = None,
                      *, layers: Iterable[int], site: Site = "post_block", chat_template: bool = True,
                      max_tokens: int = 32, sampling_params: Any = None, labeller: Labeller | None = None,
                      positions: GeneratedPositions = "all_generated", batch_size: int = 32,
                      progress: bool = True) -> Activations:
    """Generate a reply to each prompt and return the residuals of its generated tokens at ``layers`` × ``site``:
    the activations a per-token monitor reads, one row per generated token.

    Each batch is one engine pass that generates and captures (``all_generated``) in the same run. A generated
    token's residual exists once the token is fed back, so a reply of ``G`` tokens gives ``G - 1`` rows (the last
    token is sampled, never read); row ``i`` of a reply is the residual at its absolute position ``P + i`` (``P`` the
    prompt's length), whose input token is the reply's ``i``-th token, the monitor's reading at that decode step.

    Args:
        llm_or_steerer: ``dynsteer.attach(llm)``, or the ``vllm.LLM`` itself, with capture buffers at
            ``(layers, site)``.
        prompts: strings (with ``chat_template``, each one user message) or conversations (lists of
            ``{"role", "content"}`` messages; chat template only).
        labels: one label per prompt, given to every token of its reply (``y``); ``None`` with no ``labeller``:
            unlabelled.
        layers: decoder layers to read.
        site: residual site (``pre_attn``, ``post_attn``, ``post_block``).
        chat_template: render prompts with the tokenizer's chat template (generation prompt appended), as a chat
            model is served; ``False`` sends them as raw text.
        max_tokens: reply length when ``sampling_params`` is not given (greedy decoding).
        sampling_params: a ``vllm.SamplingParams`` (``n == 1``) instead of greedy ``max_tokens``.
        labeller: ``labeller(prompt_index, token_ids, token_texts) -> labels``, one label per captured token
            (``token_ids``/``token_texts``: that reply's rows, in order); ``-1`` or ``None`` drops a row. Replaces
            ``labels``.
        positions: ``all_generated`` (every read token) or ``last_generated`` (one row per reply: its last read
            token).
        batch_size: prompts per engine pass.
        progress: show a tqdm progress bar over batches.

    Returns:
        :class:`Activations` with ``groups`` (prompt index per row), ``token_ids``, ``tokens``,
        ``token_positions``, and the rendered ``prompts`` and generated ``outputs`` by prompt index.

    Raises:
        ValueError: no prompts, a label count that differs from the prompt count, both ``labels`` and ``labeller``,
            a labeller answer of the wrong length, an unknown site or position selector, a layer out of range or
            without a capture buffer, replies too short to read (``max_tokens < 2``), or no token captured at all.

    Example:
        >>> acts = collect_generated(steerer, sentences, labels, layers=range(4, 30, 2))     # doctest: +SKIP
        >>> sweep = layer_sweep(acts, LogisticProbe)   # folds split by prompt (acts.groups) # doctest: +SKIP
    """
    from tqdm.auto import tqdm
    from vllm import SamplingParams

    from dynsteer.api import attach

    steerer = llm_or_steerer if hasattr(llm_or_steerer, "capture_places") else attach(llm_or_steerer)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts: empty; give at least one prompt")
    layers = tuple(int(layer) for layer in layers)
    if not layers:
        raise ValueError("layers: empty; give at least one layer")
    if site not in SITES:
        raise ValueError(f"site: unknown site {site!r}; one of {', '.join(SITES)}")
    if positions not in ("all_generated", "last_generated"):
        raise ValueError(f"positions: {positions!r} is not a generated-position selector ('all_generated' or "
                         f"'last_generated'); use collect() for prompt positions")
    if labels is not None and labeller is not None:
        raise ValueError("labels and labeller: give one (the labeller labels every token itself)")
    prompt_y = None if labels is None else np.asarray(labels)
    if prompt_y is not None and len(prompt_y) != len(prompts):
        raise ValueError(f"labels: got {len(prompt_y)} labels for {len(prompts)} prompts")
    if sampling_params is None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    else:
        params = sampling_params
        if getattr(params, "n", 1) != 1:
            raise ValueError(f"sampling_params.n: {params.n}; one reply per prompt (repeat a prompt for more)")
    if params.max_tokens is not None and params.max_tokens < 2:
        raise ValueError(f"max_tokens: {params.max_tokens}; a reply's last token is never fed back, so at least 2 "
                         f"tokens are needed to read one")
    spec = CaptureSpec(layers=layers, sites=(site,), positions="all_generated")
    spec.check(steerer.shape, steerer.capture_places, field="collect_generated")  # fail before the first batch
    tok = steerer.llm.get_tokenizer()
    inputs, rendered = _render(tok, prompts, chat_template)

    rows: dict[int, list[np.ndarray]] = {layer: [] for layer in layers}
    ys: list[Any] = []
    groups: list[int] = []
    token_ids: list[int] = []
    token_pos: list[int] = []
    outputs: list[str] = []
    for start in tqdm(range(0, len(inputs), batch_size), desc="collect_generated", unit="batch",
                      disable=not progress):
        outs = steerer.generate(inputs[start:start + batch_size], params, capture=spec, use_tqdm=False)
        for i, out in enumerate(outs):
            k = start + i
            gen = list(out.outputs[0].token_ids)
            outputs.append(out.outputs[0].text)
            cap = out.capture
            if cap is None or cap.status == "error":
                why = "no capture" if cap is None else cap.errors
                raise ValueError(f"prompts[{k}]: nothing captured ({why})")
            P = len(out.prompt_token_ids)
            pos = np.asarray(cap.positions, np.int64)
            if len(pos) and (pos.min() < P or pos.max() >= P + len(gen) - 1):
                raise ValueError(f"prompts[{k}]: captured positions {pos.min()}..{pos.max()} outside the reply "
                                 f"({P}..{P + len(gen) - 2})")
            sel = np.arange(len(pos))
            if positions == "last_generated":
                sel = sel[-1:]
            ids = [gen[int(p) - P] for p in pos[sel]]
            if labeller is not None:
                texts = [tok.decode([t]) for t in ids]
                lab = list(labeller(k, list(ids), texts))
                if len(lab) != len(ids):
                    raise ValueError(f"labeller: returned {len(lab)} labels for the {len(ids)} captured tokens of "
                                     f"prompts[{k}]")
            else:
                lab = [None if prompt_y is None else prompt_y[k]] * len(ids)
            keep = [j for j, label in enumerate(lab) if labeller is None or not _dropped(label)]
            if not keep:
                continue
            for layer in layers:
                rows[layer].append(np.asarray(cap[(layer, site)], np.float32)[sel[keep]])
            ys += [lab[j] for j in keep]
            groups += [k] * len(keep)
            token_ids += [ids[j] for j in keep]
            token_pos += [int(pos[sel[j]]) for j in keep]
    if not groups:
        raise ValueError("collect_generated: no generated token was captured (every reply ended after one token, "
                         "or the labeller dropped every row); raise max_tokens or check the labeller")
    X = {layer: np.concatenate(r) for layer, r in rows.items()}
    y = None if labels is None and labeller is None else np.asarray(ys)
    return Activations(X=X, y=y, site=site, model_id=steerer.shape.model_id, hidden_size=steerer.hidden_size,
                       positions=positions, n_positions=np.ones(len(groups), np.int64),
                       groups=np.asarray(groups, np.int64), token_ids=np.asarray(token_ids, np.int64),
                       token_positions=np.asarray(token_pos, np.int64), tokens=[tok.decode([t]) for t in token_ids],
                       prompts=rendered, outputs=outputs)


def align(capture: Any, trace: Any, place: tuple[int, str]) -> tuple[np.ndarray, np.ndarray]:
    """Line a request's captured rows up with its dynamic trace: ``(X, at)`` where ``X[i]`` is the residual
    captured at ``place`` for the position ``trace.position[at[i]]``, for every position both hold, in position
    order (a trace covers generated tokens fed back; a capture may cover more, or fewer when it was partial).
    ``probe.predict_proba(X)`` then lines up with ``trace.gates()[at]``."""
    cpos = np.asarray(capture.positions, np.int64)
    tpos = np.asarray(trace.position, np.int64)
    _, ci, ti = np.intersect1d(cpos, tpos, assume_unique=True, return_indices=True)
    return np.asarray(capture[place], np.float64)[ci], ti


__all__ = ["Activations", "GeneratedPositions", "Labeller", "align", "chat_prompts", "collect",
           "collect_generated"]
