"""The vLLM plugin: the only room that imports vLLM internals (architecture §1, §9).

vLLM loads :func:`dynsteer.engine.plugin.register` (the ``vllm.general_plugins`` entry point) in every process; it
wires in the frontend's admission (``frontend``, ``admission``), the prefix cache's salts (``prefix_cache``), the
engine core's scheduler and command desk (``scheduler``, ``command_desk``), the worker (``build``, ``runner``,
``adapters``, ``families``, ``worker_ext``) and the OpenAI server's routes (``server``, ``dev_routes``). Every vLLM
override goes through ``patching``; every name that crosses processes is in ``keys``. Users reach all of it through
:mod:`dynsteer.api` and ``dynsteer serve``, so this face imports nothing (importing it must not import vLLM).
"""

__all__: list[str] = []
