"""vLLM's model-class info for many architectures, computed in one process.

The first time a machine loads an architecture, vLLM inspects its model class in a fresh Python subprocess (which
imports vLLM and the general plugins: about ten seconds on a small CPU box) and caches the answer under
``$VLLM_CACHE_ROOT/modelinfos``, keyed by the hash of the model's source file. Something that loads thirty
architectures on a fresh machine, such as this project's test suite, pays that thirty times. :func:`warm_model_info`
fills the same cache for a list of architectures from the current process instead, through vLLM's own inspection
and cache code, so every later load finds its entry.
"""

from __future__ import annotations

from collections.abc import Iterable

from dynsteer.engine import patching

__all__ = ["warm_model_info"]


def warm_model_info(architectures: Iterable[str]) -> list[str]:
    """Compute and cache vLLM's model info for each of ``architectures`` (vLLM's names, e.g. ``LlamaForCausalLM``)
    whose entry is missing or stale; returns the names it computed. Run it in a process that may import every one of
    those model modules (vLLM inspects in a subprocess so that its caller never initialises CUDA). Names vLLM does not
    register are skipped."""
    from vllm.model_executor.models import registry
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as vLLM's inspection subprocess does: plugins may register or wrap model classes
    computed: list[str] = []
    inspected: list[object] = []

    def inspect_here(fn):
        """The inspection vLLM would run in a subprocess, run in this process."""
        inspected.append(fn)
        return fn()

    patching.patch(registry, "_run_in_subprocess", inspect_here,
                   why="inspect model classes in this process to fill vLLM's model-info cache")
    try:
        for name in architectures:
            model = registry.ModelRegistry.models.get(name)
            if isinstance(model, registry._LazyRegisteredModel):
                before = len(inspected)
                model.inspect_model_cls()  # reads the cache, or inspects here and writes it
                if len(inspected) > before:
                    computed.append(name)
    finally:
        patching.restore(registry, "_run_in_subprocess")
    return computed
