"""vLLM options dynsteer refuses at engine start, with the reason, rather than steering or reporting wrongly.

Checked twice: in the frontend before the engine core starts (so the user's process sees the message, not only a
spawned engine core's log) and in each worker when the model is built. docs/reference/combinations.md lists every
combination and how it is tested.

Speculative decoding: the target model verifies ``1 + k`` tokens per request in one forward, some of them drafts
that it then rejects. Static steering is a function of a token's position and phase only, so each verified token is
steered as it would be without drafts, and rejection keeps only tokens the steered target would have produced:
allowed, with a drafter that runs no model (n-gram, suffix) or a separate draft model (``draft_model``; it drafts
unsteered or with the target's rows, which can only lower how many drafts are accepted). Refused:

- other drafters (EAGLE, MTP, Medusa, ...): they read the target's hidden states or run heads inside its forward,
  which dynsteer has not been verified with;
- the dynamic tier (``max_gates > 0``): rejected drafts would enter gates' traces and reports, latched scopes and
  sync controllers' state;
- capture (``capture_sites``) and the stream hub (``monitor``): rejected drafts' residuals would be recorded and
  published as if they were the request's tokens.
"""

from __future__ import annotations

from typing import Any

from dynsteer.config import DynsteerConfig
from dynsteer.engine.keys import CONFIG_KEY

#: speculative methods allowed with static steering: drafters that run no model (proposals from the request's own
#: tokens) and a separate draft model
ALLOWED_DRAFTERS = ("ngram", "ngram_gpu", "suffix", "draft_model")


class UnsupportedCombinationError(ValueError):
    """A vLLM option dynsteer cannot steer correctly together with the engine's dynsteer config."""


def check_combinations(vllm_config: Any, cfg: DynsteerConfig | None = None) -> None:
    """Raise :class:`UnsupportedCombinationError` naming the vLLM option and the dynsteer field that conflict."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return
    cfg = cfg if cfg is not None else DynsteerConfig.from_additional(vllm_config.additional_config)
    method = getattr(spec, "method", None)
    where = f"speculative_config (method {method!r})"
    if method not in ALLOWED_DRAFTERS:
        raise UnsupportedCombinationError(
            f"dynsteer: {where}: a drafter that reads the target's hidden states or runs inside its forward is not "
            f"verified with steering; speculative decoding works with the drafters {', '.join(ALLOWED_DRAFTERS)}")
    conflicts = []
    if cfg.max_gates > 0:
        conflicts.append(f"{CONFIG_KEY}.max_gates={cfg.max_gates} (the dynamic tier: draft tokens the target "
                         f"rejects would enter gates, traces, latched scopes and controller state; set max_gates=0)")
    if cfg.capture_sites:
        conflicts.append(f"{CONFIG_KEY}.capture_sites (capture: rejected draft tokens' residuals would be recorded)")
    if cfg.monitor is not None:
        conflicts.append(f"{CONFIG_KEY}.monitor (streams: rejected draft tokens would be published)")
    if conflicts:
        raise UnsupportedCombinationError(
            f"dynsteer: {where} cannot be combined with " + "; ".join(conflicts)
            + ". Static steering works with speculative decoding; or turn speculative decoding off")
