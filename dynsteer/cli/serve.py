"""``dynsteer serve MODEL [vLLM serve options]``: vLLM's own ``vllm serve``, in this process, with steering endpoints.

Everything but ``--steering-allow-remote`` is vLLM's: the arguments are parsed by vLLM's serve parser and the server is
vLLM's; dynsteer only adds its endpoint plugin first. The vLLM side lives in :mod:`dynsteer.engine.server`.
"""

from __future__ import annotations

from collections.abc import Sequence


def run_serve(argv: Sequence[str]) -> None:
    from dynsteer.engine.server import serve

    serve(argv)
