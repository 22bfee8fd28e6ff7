"""The OpenAI server's top-level ``steering`` field: moved into ``SamplingParams.extra_args`` with the request.

vLLM's OpenAI request models keep unknown body fields (``extra="allow"``) and ignore them; ``to_sampling_params``
of ``CompletionRequest`` and ``ChatCompletionRequest`` is where a request becomes ``SamplingParams``, so the patch
there carries ``steering`` on as the payload (``extra_args["dynsteer"]``, with :data:`~dynsteer.engine.keys.SOURCE_KEY`
naming its field for errors). Admission packs it (:mod:`dynsteer.engine.admission`, ``engine.frontend``): what leaves
the frontend is the packed form, exactly as for a request that sent it packed in ``vllm_xargs``.
"""

from __future__ import annotations

import functools
from typing import Any

from dynsteer.engine import patching
from dynsteer.engine.keys import PAYLOAD_KEY, SOURCE_KEY

FIELD = "steering"


def patch_request_model(cls: type) -> None:
    """Move a request's top-level ``steering`` object into its sampling parameters' ``extra_args``."""
    orig = cls.to_sampling_params

    @functools.wraps(orig)
    def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        steering = (self.model_extra or {}).get(FIELD)
        if steering is None:
            return orig(self, *args, **kwargs)
        if PAYLOAD_KEY in (self.vllm_xargs or {}):
            raise ValueError(f"{FIELD}, vllm_xargs.{PAYLOAD_KEY}: a request carries its steering in one of them, "
                             f"not both")
        params = orig(self, *args, **kwargs)
        params.extra_args = {**(params.extra_args or {}), PAYLOAD_KEY: steering, SOURCE_KEY: FIELD}
        return params

    patching.patch(cls, "to_sampling_params", to_sampling_params,
                   why="a request's top-level 'steering' object becomes its dynsteer payload")
