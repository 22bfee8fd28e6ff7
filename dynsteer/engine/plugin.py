"""The ``vllm.general_plugins`` entry point: wires dynsteer into every vLLM process, once, and delegates.

vLLM calls :func:`register` in the frontend, the engine core and each worker before any model is built. Patches are
applied when their vLLM module is imported (a post-import hook), so a process that never builds a model never pays
for importing model code, and every decoder layer gets its hooks before torch.compile traces it. Every vLLM attribute
the patchers override goes through :mod:`dynsteer.engine.patching`, which records it (``dynsteer doctor`` lists them).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable

logger = logging.getLogger("dynsteer")

_lock = threading.Lock()
_callbacks: dict[str, list[Callable[[ModuleType], None]]] = {}
_registered = False


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a watched module has executed (before its importer continues)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        orig_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            orig_exec(module)
            _run_callbacks(fullname, module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _run_callbacks(name: str, module: ModuleType) -> None:
    for cb in _callbacks.pop(name, []):
        cb(module)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__spec__", None) is not None and name not in _callbacks:
            callback(module)
            return
        _callbacks.setdefault(name, []).append(callback)


def register() -> None:
    """Entry point. Idempotent; ``DYNSTEER_DISABLE=1`` turns dynsteer off in every process."""
    global _registered
    if _registered or os.environ.get("DYNSTEER_DISABLE") == "1":
        return
    _registered = True
    from dynsteer.engine import (adapters, admission, command_desk, compile_key, frontend, json_steering,
                                 prefix_cache, reports, runner, scheduler, worker_ext)

    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for adapter in adapters.ADAPTERS.values():
        when_imported(adapter.module, lambda m, a=adapter: adapters.patch_model_module(m, a))
    when_imported("vllm.model_executor.model_loader.base_loader",
                  lambda m: adapters.patch_model_loader(m.BaseModelLoader))
    when_imported("vllm.config.vllm", lambda m: compile_key.patch_config_hash(m.VllmConfig))
    when_imported("vllm.v1.worker.gpu_model_runner", lambda m: runner.patch_v1_runner(m.GPUModelRunner))
    when_imported("vllm.v1.worker.gpu.model_runner", lambda m: runner.patch_v2_runner(m.GPUModelRunner))
    when_imported("vllm.v1.worker.worker_base", lambda m: worker_ext.install(m.WorkerWrapperBase))
    when_imported("vllm.v1.engine.input_processor", lambda m: frontend.patch_input_processor(m.InputProcessor))
    when_imported("vllm.v1.engine.async_llm", lambda m: admission.patch_async_llm(m.AsyncLLM))
    for protocol, model in (("completion", "CompletionRequest"), ("chat_completion", "ChatCompletionRequest")):
        when_imported(f"vllm.entrypoints.openai.{protocol}.protocol",
                      lambda m, model=model: json_steering.patch_request_model(getattr(m, model)))
    when_imported("vllm.v1.engine.output_processor", reports.patch_output_processor)
    when_imported("vllm.v1.core.kv_cache_utils", prefix_cache.patch_block_hashing)
    when_imported("vllm.v1.request", lambda m: prefix_cache.patch_request(m.Request))
    when_imported("vllm.v1.core.sched.scheduler", lambda m: scheduler.patch_scheduler(m.Scheduler))
    when_imported("vllm.v1.engine.core", lambda m: command_desk.patch_engine_core(m.EngineCore))
    when_imported("vllm.entrypoints.serve", _guard_dev_routes)  # API servers only: keeps fastapi out of workers
    when_imported("vllm.entrypoints.openai.completion.serving", _report_serving("patch_completion_serving"))
    when_imported("vllm.entrypoints.openai.chat_completion.serving", _report_serving("patch_chat_serving"))


def _guard_dev_routes(module: ModuleType) -> None:
    from dynsteer.engine.dev_routes import patch_dev_routes

    patch_dev_routes(module)


def _report_serving(name: str) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        from dynsteer.engine import report_serving

        getattr(report_serving, name)(module)

    return patch
