"""Dynamic steering on SmolLM2-135M-Instruct: the model's own activations decide when to steer.

Runs on CPU in several minutes:

    python examples/dynamic_sentiment.py

Part one, a **per-token monitor** on open requests (``examples/data/sentiment_requests.jsonl``: complaints and praise
about 35 topics in 6 phrasings; 20 topics to train on, 15 held out):

1. Train where the monitor reads: generate replies to the 240 training requests under the chat template, capture the
   residual of every generated token at layer 16 (``collect_generated``) and fit a logistic probe of "this reply
   answers a complaint" on those tokens.
2. Single tokens are noisy (complaints and praise open with the same boilerplate), so the decision aggregates over the
   reply on the device: a sync controller (EMA latch, ``alpha`` 0.05) averages the in-graph probe score token by
   token and switches steering on once the average crosses ``on``. ``on`` is calibrated on out-of-fold scores of the
   training replies (``dynsteer.probes.calibrate_ema_latch``), never on held-out data.
3. Rule: add the positive-minus-negative class mean of the training tokens' residuals at a relative dose of 0.1,
   scaled by the token's gate, once the latch is on.
4. On the 180 held-out requests, one continuous batch: it prints the share of complaints steered, the share of praise
   replies byte-identical to an unsteered run, and the largest difference between the in-graph gate and the probe
   file's ``predict_proba`` on the captured residuals.

Part two, a **prompt-level gate** (CAST-style) on held-out data: a probe trained on the 308-sentence training split of
``examples/data/sentiment.csv`` (sentences as user messages under the chat template, residual at the prompt's last
token: the training data is where this gate reads) becomes a monitor with ``reads="prompt_last"``. Inside the
forward pass it scores each request's last prompt token once and holds the decision for the whole reply; a rule
with ``gate_floor=0.5`` adds the positive-sentiment vector to every generated token of requests the probe calls
negative and leaves the others alone. On the 132 held-out sentences (66 per class, never trained on) it prints the
share of negative prompts steered and of positive prompts byte-identical to an unsteered run, and the largest
difference between the held gate and the probe file's ``predict_proba`` on the captured last-prompt residual.

``train_probe`` and ``sentiment_policy`` (a probe of 60 sentiment sentences at layer 20, read at every generated token,
with an EMA latch in score units) are what ``examples/sweeps/`` sweeps.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

import dynsteer
from dynsteer import (Action, CaptureSpec, DynamicSteeringPolicy, DynsteerConfig, ProbeGate, Rule,
                      SyncControllerSpec)
from dynsteer.probes import (LatchCalibration, LogisticProbe, align, calibrate_ema_latch, collect, collect_generated,
                             load_probe, save_probe)
from dynsteer.zoo import smollm2
from probe_training import NEGATIVE, POSITIVE

# Part one: the per-token monitor on open requests.
REQUESTS = Path(__file__).resolve().parent / "data" / "sentiment_requests.jsonl"
TOKEN_LAYER = 16  # of 30; on the training replies' out-of-fold scores layers 16 and 20 separate best, 12 worst
TOKEN_ALPHA = 0.05  # EMA weight of the newest token: the latch decides on about the last 20 tokens
TOKEN_DOSE = 0.1  # relative dose of the steering vector (dynsteer.dose): |v| = 0.1 · mean residual norm
REPLY_TOKENS = 40

# The sentence probe that examples/sweeps/ sweeps (train_probe, sentiment_policy).
LAYER = 20
TOPICS = ["the hotel room", "the restaurant", "the train service", "the weather"]
COMPLAINTS = [f"Write two sentences complaining angrily about {t}." for t in ["the airline", *TOPICS]]
PRAISE = [f"Write two sentences praising {t} enthusiastically." for t in ["the new phone", *TOPICS]]
# multiples of the probe's weight vector: a relative dose of 0.1, the strongest that `dynsteer dose recommend` keeps
# within 1.5x unsteered perplexity and 5 % repeated 4-grams on negative prompts (docs/guides/quality.md)
STEER_SCALE = 30.0
# Part two reads the layer probe_training.py's cross-validation on the same training split chooses.
PROMPT_LAYER = 22
# multiples of the class-mean difference: a relative dose of 0.15, the strongest that `dynsteer dose recommend` keeps
# within 1.5x unsteered perplexity and 5 % repeated 4-grams on negative prompts (docs/guides/quality.md)
PROMPT_STEER_SCALE = 1.35
PROMPT_READS = "prompt_last"
OPERATING_POINT: str | float = 0.05  # positive sentences let through, on the training split's CV scores


@dataclass
class DemoResult:
    prompts: list[str]
    targeted: list[bool]  # the request asks for a complaint
    baseline: list[list[int]]
    steered: list[list[int]]
    texts: list[tuple[str, str]]
    fired: list[int]  # tokens with dyn_scale > 0, per prompt
    gate_error: float  # max |in-graph gate − probe predict_proba| over every traced token
    calibration: LatchCalibration  # the EMA latch's threshold and its recall/specificity on the training replies
    probe_path: Path | None = None  # the probe file the run used
    scales: list[list[float]] | None = None  # the controller's scale at every traced token, per prompt

    @property
    def latched_targeted(self) -> float:
        """Share of complaint requests whose latch turned on (steering applied to at least one token)."""
        return float(np.mean([f > 0 for f, t in zip(self.fired, self.targeted) if t]))

    @property
    def steered_targeted(self) -> float:
        """Share of complaint requests whose reply changed."""
        return float(np.mean([b != s for b, s, t in zip(self.baseline, self.steered, self.targeted) if t]))

    @property
    def identical_others(self) -> float:
        """Share of praise requests whose reply is byte-identical to the unsteered one."""
        return float(np.mean([b == s for b, s, t in zip(self.baseline, self.steered, self.targeted) if not t]))


def load_requests(split: str) -> tuple[list[str], np.ndarray]:
    """``examples/data/sentiment_requests.jsonl``'s ``train`` or ``held_out`` requests and labels (0: asks for a
    complaint, 1: asks for praise)."""
    import json

    rows = [json.loads(line) for line in REQUESTS.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["split"] == split]
    return [r["prompt"] for r in rows], np.array([0 if r["label"] == "negative" else 1 for r in rows])


def _token_estimator() -> LogisticProbe:
    return LogisticProbe(Cs=[0.001, 0.01, 0.1], cv=3, max_iter=300)


def train_token_monitor(steerer: dynsteer.Steerer, path: Path) -> LatchCalibration:
    """Fit the per-token probe on the training replies, calibrate the EMA latch on its out-of-fold scores, and save
    the probe (``path``), the steering direction (``.vec.npy``) and the calibration (``.latch.json``)."""
    import json

    from sklearn.model_selection import GroupKFold

    prompts, labels = load_requests("train")
    acts = collect_generated(steerer, prompts, labels, layers=[TOKEN_LAYER], max_tokens=REPLY_TOKENS,
                             batch_size=64, progress=False)
    X, y, replies = acts.X[TOKEN_LAYER], acts.y, acts.groups
    logit_negative = np.zeros(len(y))  # out-of-fold: each reply scored by a probe that never saw it
    for fit, held in GroupKFold(5).split(X, y, replies):
        logit_negative[held] = -_token_estimator().fit(X[fit], y[fit]).decision_function(X[held])
    cal = calibrate_ema_latch(logit_negative, replies, y == 0, alpha=TOKEN_ALPHA)
    save_probe(path, _token_estimator().fit(X, y), model_id=steerer.shape.model_id, layer=TOKEN_LAYER,
               site="post_block", method=f"LogisticProbe, generated tokens of {len(prompts)} replies, chat template")
    np.save(path.with_suffix(".vec.npy"), X[y == 1].mean(0) - X[y == 0].mean(0))
    path.with_suffix(".latch.json").write_text(json.dumps(cal.__dict__))
    return cal


def token_policy(steerer: dynsteer.Steerer, probe_path: Path, cal: LatchCalibration) -> DynamicSteeringPolicy:
    """Steer towards praise once the EMA of the in-graph P(complaint) crosses the calibrated ``on``."""
    from dynsteer.dose import residual_norms

    monitor = ProbeGate.from_probe_file(probe_path, name="negative", target_class=0)
    direction = np.load(probe_path.with_suffix(".vec.npy")).astype(np.float32)
    mean_h = residual_norms(steerer, [(TOKEN_LAYER, "post_block")])[(TOKEN_LAYER, "post_block")]
    towards_positive = direction * np.float32(TOKEN_DOSE * mean_h / np.linalg.norm(direction))
    return DynamicSteeringPolicy(
        monitors=[monitor],
        rules=[Rule(monitor="negative", actions=[Action(kind="add", layer=TOKEN_LAYER, vector=towards_positive)])],
        controller=SyncControllerSpec(kind="ema_latch", alpha=TOKEN_ALPHA, on=cal.on, off=1e-6, scale=1.0,
                                      units="probability"))


def make_engine(model: Path, sync_tier: str = "device", layers: tuple[int, ...] = (LAYER,), max_num_seqs: int = 16):
    from vllm import LLM

    cfg = DynsteerConfig(capture_sites=("post_block",), capture_layers=layers, max_gates=2, sync_tier=sync_tier)
    return LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=max_num_seqs,
               seed=0, **cfg.engine_kwargs())


def train_probe(steerer: dynsteer.Steerer, path: Path) -> None:
    texts = POSITIVE + NEGATIVE
    labels = np.array([1] * len(POSITIVE) + [0] * len(NEGATIVE))
    acts = collect(steerer, texts, labels, layers=[LAYER], site="post_block", positions="last_prompt")
    probe = LogisticProbe().fit(acts.X[LAYER], labels)
    save_probe(path, probe, model_id=steerer.shape.model_id, layer=LAYER, site="post_block",
               method=f"LogisticProbe, {len(texts)} sentiment sentences, last prompt token")


def sentiment_policy(probe_path: Path) -> DynamicSteeringPolicy:
    monitor = ProbeGate.from_probe_file(probe_path, name="negative", target_class=0)
    towards_positive = -np.asarray(monitor.direction, np.float32) * STEER_SCALE
    return DynamicSteeringPolicy(
        monitors=[monitor],
        rules=[Rule(monitor="negative", actions=[Action(kind="add", layer=LAYER, vector=towards_positive)])],
        controller=SyncControllerSpec(kind="ema_latch", alpha=0.3, on=2.0, off=0.0, scale=1.0))


def run(max_tokens: int = REPLY_TOKENS, sync_tier: str = "device", probe_path: Path | None = None,
        limit: int | None = None, unsteered: bool = True) -> DemoResult:
    """Part one: train the per-token monitor (unless ``probe_path`` names one trained by :func:`train_token_monitor`)
    and compare gated steering with unsteered replies on the held-out requests (the first ``limit`` of them).
    ``sync_tier``: where the EMA-latch controller runs (``"device"``, the default, or ``"host"``); ``unsteered=False``
    skips the unsteered replies (the result's ``baseline`` is then empty)."""
    import json

    from vllm import SamplingParams

    llm = make_engine(smollm2(), sync_tier, layers=(TOKEN_LAYER,), max_num_seqs=64)
    try:
        steerer = dynsteer.attach(llm)
        if probe_path is None:
            probe_path = Path(tempfile.mkdtemp()) / f"sentiment-tokens-L{TOKEN_LAYER}.safetensors"
            train_token_monitor(steerer, probe_path)
        cal = LatchCalibration(**json.loads(probe_path.with_suffix(".latch.json").read_text()))
        policy = token_policy(steerer, probe_path, cal)

        prompts, labels = load_requests("held_out")
        prompts, labels = prompts[:limit], labels[:limit]
        convs = [[{"role": "user", "content": p}] for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        baseline = llm.chat(convs, params, use_tqdm=False) if unsteered else []
        steered = steerer.chat(convs, params, policy=policy, use_tqdm=False,
                               capture=CaptureSpec(sites=["post_block"], layers=[TOKEN_LAYER],
                                                   positions="all_generated"))
    finally:
        llm.llm_engine.engine_core.shutdown()

    probe = load_probe(probe_path)
    gate_error = 0.0
    for out in steered:
        x, at = align(out.capture, out.trace, (TOKEN_LAYER, "post_block"))  # the traced positions' residuals
        want = probe.predict_proba(x)[:, 0]  # P(negative): the negative class opens the gate
        gate_error = max(gate_error, float(np.abs(out.trace.gates("negative")[at] - want).max()))
    return DemoResult(
        prompts=prompts, targeted=[bool(v == 0) for v in labels],
        baseline=[list(o.outputs[0].token_ids) for o in baseline],
        steered=[list(o.outputs[0].token_ids) for o in steered],
        texts=[(b.outputs[0].text, s.outputs[0].text) for b, s in zip(baseline, steered)],
        fired=[int(np.count_nonzero(o.trace.scale)) for o in steered], gate_error=gate_error, calibration=cal,
        probe_path=probe_path, scales=[list(o.trace.scale) for o in steered])


@dataclass
class PromptGateResult:
    steered_negative: float  # share of held-out negative prompts whose reply changed
    identical_positive: float  # share of held-out positive prompts whose reply is byte-identical to unsteered
    n_negative: int
    n_positive: int
    gate_error: float  # max |held gate − probe predict_proba(last prompt residual)| where the gate is open
    opened_negative: float  # share of negative prompts whose held gate opened (the probe's recall)
    opened_positive: float  # share of positive prompts whose held gate opened (its false-positive rate)
    closed_ok: bool  # every prompt the probe puts below 0.5 has a held gate of exactly 0
    examples: list[tuple[str, str, str]]  # (prompt, unsteered, steered) of a few negative prompts


def held_out_split(seed: int = 0) -> tuple[list[str], np.ndarray, list[str], np.ndarray]:
    """The data set split as ``probe_training.py``'s ``layer_sweep`` splits it (stratified, 30 % held out)."""
    from sklearn.model_selection import train_test_split

    from probe_training import load_sentiment

    texts, labels = load_sentiment()
    tr, te = train_test_split(np.arange(len(texts)), test_size=0.3, random_state=seed, stratify=labels)
    return [texts[i] for i in tr], labels[tr], [texts[i] for i in te], labels[te]


def train_calibration(X: np.ndarray, y: np.ndarray, operating_point: str | float) -> Any:
    """The gate's operating point on 5-fold cross-validated decision values of the training split (never on held-out
    data): ``"balanced"``, where the smaller of the two classes' recalls is largest, or a target rate of positive
    sentences let through (a float), as ``probe_training.py`` calibrates at 5 %."""
    from sklearn.model_selection import cross_val_predict

    from dynsteer.probes import calibrate

    cv = cross_val_predict(LogisticProbe(), X, y, cv=5, method="decision_function")
    # the gate opens for P(negative): flip the labels so the class it opens for is "positive" in calibrate's terms
    s, flipped = -cv, 1 - y
    if operating_point == "balanced":
        hit, miss = s[flipped == 1], s[flipped == 0]
        cands = np.unique(s)
        worse = [min(np.mean(hit > t), np.mean(miss <= t)) for t in cands]
        t = cands[int(np.argmax(worse))]
        operating_point = float(np.mean(miss > t)) + 1e-9
    cal = calibrate(s, flipped, target_fpr=float(operating_point))
    return cal.model_copy(update={"threshold": -cal.threshold})  # back to the probe's decision: negative below it


def run_prompt_gate(max_tokens: int = 24, probe_path: Path | None = None, reads: str = PROMPT_READS,
                    operating_point: str | float = OPERATING_POINT) -> PromptGateResult:
    """Part two: train on the training split, gate at the prompt level, report on the held-out split. ``reads``:
    ``prompt_mean`` (the probe trained and gating on the mean residual over the prompt's tokens) or ``prompt_last``
    (on the last prompt token's)."""
    where = "all_prompt" if reads == "prompt_mean" else "last_prompt"  # collect's mean over the selected positions
    from vllm import SamplingParams

    train_x, train_y, test_x, test_y = held_out_split()
    llm = make_engine(smollm2(), layers=(PROMPT_LAYER,), max_num_seqs=48)
    try:
        steerer = dynsteer.attach(llm)
        if probe_path is None:
            probe_path = Path(tempfile.mkdtemp()) / f"sentiment-prompt-L{PROMPT_LAYER}.safetensors"
            acts = collect(steerer, train_x, train_y, layers=[PROMPT_LAYER], site="post_block",
                           positions=where, chat=True, progress=False)
            X = acts.X[PROMPT_LAYER]
            save_probe(probe_path, LogisticProbe().fit(X, train_y), model_id=steerer.shape.model_id,
                       layer=PROMPT_LAYER, site="post_block",
                       calibration=train_calibration(X, train_y, operating_point),
                       method=f"LogisticProbe, {len(train_x)} training sentences, chat template, last prompt token")
            # the steering vector: positive minus negative class mean of the same training residuals
            np.save(probe_path.with_suffix(".vec.npy"), (X[train_y == 1].mean(0) - X[train_y == 0].mean(0)))
        # calibrated: the gate is 0.5 at the training split's balanced operating point; the floor makes it the decision
        monitor = ProbeGate.from_probe_file(probe_path, name="negative", target_class=0, calibrated=True, reads=reads)
        towards_positive = np.load(probe_path.with_suffix(".vec.npy")).astype(np.float32) * PROMPT_STEER_SCALE
        policy = DynamicSteeringPolicy(monitors=[monitor], rules=[Rule(
            monitor="negative", gate_floor=0.5,
            actions=[Action(kind="add", layer=PROMPT_LAYER, vector=towards_positive)])])
        convs = [[{"role": "user", "content": t}] for t in test_x]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        baseline = llm.chat(convs, params, use_tqdm=False)
        steered = steerer.chat(convs, params, policy=policy, use_tqdm=False,
                               capture=CaptureSpec(sites=["post_block"], layers=[PROMPT_LAYER], positions=where))
    finally:
        llm.llm_engine.engine_core.shutdown()

    probe = load_probe(probe_path)
    cal = probe.meta.calibration.threshold if probe.meta.calibration is not None else 0.0
    changed = np.array([list(b.outputs[0].token_ids) != list(s.outputs[0].token_ids)
                        for b, s in zip(baseline, steered)])
    neg, pos = test_y == 0, test_y == 1
    gate_error, closed_ok, opened = 0.0, True, []
    for out in steered:
        # P(negative) relative to the calibrated threshold: the monitor's gate (calibrated=True, target_class=0)
        x = out.capture[(PROMPT_LAYER, "post_block")].astype(np.float64).mean(0, keepdims=True)
        p_neg = float(1.0 / (1.0 + np.exp(probe.decision_function(x)[0] - cal)))
        held = out.trace.applied_gates("negative")
        assert np.all(held == held[0]), "a prompt-level gate is one decision per request"
        opened.append(bool(held[0] > 0))
        if p_neg >= 0.5:
            gate_error = max(gate_error, abs(float(held[0]) - p_neg))
        else:
            closed_ok &= bool(held[0] == 0.0)
    examples = [(test_x[i], baseline[i].outputs[0].text, steered[i].outputs[0].text)
                for i in np.flatnonzero(neg & changed)[:3]]
    opened_arr = np.array(opened)
    return PromptGateResult(
        steered_negative=float(changed[neg].mean()), identical_positive=float((~changed[pos]).mean()),
        n_negative=int(neg.sum()), n_positive=int(pos.sum()), gate_error=gate_error,
        opened_negative=float(opened_arr[neg].mean()), opened_positive=float(opened_arr[pos].mean()),
        closed_ok=closed_ok, examples=examples)


def main() -> DemoResult:
    from rich.console import Console
    from rich.table import Table

    res = run()
    cal = res.calibration
    print(f"per-token monitor (layer {TOKEN_LAYER}, EMA latch alpha {cal.alpha}, on at P(complaint) {cal.on:.3f}; "
          f"on the training replies' out-of-fold scores: recall {cal.recall:.1%}, specificity {cal.specificity:.1%})")
    print(f"  held-out complaints steered:            {res.latched_targeted:.1%} of {sum(res.targeted)} "
          f"(replies changed: {res.steered_targeted:.1%})")
    n_praise = len(res.targeted) - sum(res.targeted)
    print(f"  held-out praise byte-identical:         {res.identical_others:.1%} of {n_praise}")
    print(f"  max |in-graph gate - probe predict_proba| = {res.gate_error:.2e}")
    table = Table(title="a few held-out requests", show_lines=True)
    for col in ("request", "steered tokens", "unsteered", "dynamic"):
        table.add_column(col, overflow="fold")
    shown = [i for i, t in enumerate(res.targeted) if t][:3] + [i for i, t in enumerate(res.targeted) if not t][:2]
    for i in shown:
        before, after = res.texts[i]
        table.add_row(res.prompts[i], str(res.fired[i]), before, after if after != before else "(identical)")
    Console().print(table)

    pg = run_prompt_gate()
    print(f"\nprompt-level gate (reads='prompt_last', layer {PROMPT_LAYER}) on {pg.n_negative + pg.n_positive} "
          f"held-out sentences:")
    print(f"  gate opened (probe says negative):     {pg.opened_negative:.1%} of negatives, "
          f"{pg.opened_positive:.1%} of positives")
    print(f"  negative prompts steered:              {pg.steered_negative:.1%} of {pg.n_negative}")
    print(f"  positive prompts byte-identical:       {pg.identical_positive:.1%} of {pg.n_positive}")
    print(f"  max |held gate - probe predict_proba|: {pg.gate_error:.2e} (closed gates exactly 0: {pg.closed_ok})")
    for prompt, before, after in pg.examples:
        print(f"  {prompt!r}\n    unsteered: {before!r}\n    steered:   {after!r}")
    return res


if __name__ == "__main__":
    main()
