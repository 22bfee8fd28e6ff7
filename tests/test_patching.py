"""The one helper every override of a vLLM attribute goes through: applied once, recorded, undoable; the plugin's
patchers use it, so registering twice changes nothing; the worker RPC names are the keys' names."""

from __future__ import annotations

import functools
import sys
import types

import pytest

from dynsteer.engine import keys, patching


class Owner:
    """A stand-in for a vLLM class."""

    def method(self) -> str:
        return "vllm"


class Child(Owner):
    pass


def _set_by_patch() -> list[patching.Patch]:
    return [p for p in patching.applied() if (p.owner, p.name) == (f"{__name__}.Owner", "method")
            and p.kind in ("replaced", "added")]


def _wrap(orig):
    @functools.wraps(orig)
    def method(self) -> str:
        return "dynsteer+" + orig(self)

    return method


def test_patch_applies_once_records_and_restores():
    orig = Owner.method
    first = _wrap(orig)
    try:
        assert patching.patch(Owner, "method", first, why="test: wrap") is True
        assert Owner.method is first and Owner().method() == "dynsteer+vllm"
        assert patching.is_patched(Owner, "method")
        # a second patcher run (the plugin registered twice) leaves the first replacement alone
        assert patching.patch(Owner, "method", _wrap(Owner.method), why="test: again") is False
        assert Owner.method is first and Owner().method() == "dynsteer+vllm"
        entries = _set_by_patch()
        assert entries == [patching.Patch(f"{__name__}.Owner", "method", f"{__name__}._wrap.<locals>.method",
                                          "test: wrap", "replaced")]
        # the function recorded is dynsteer's, although functools.wraps copied vLLM's names onto it
        assert first.__qualname__ == "Owner.method" and entries[0].function.endswith("_wrap.<locals>.method")
    finally:
        assert patching.restore(Owner, "method") is True
    assert Owner.method is orig and Owner().method() == "vllm"
    assert not patching.is_patched(Owner, "method") and patching.restore(Owner, "method") is False
    assert not _set_by_patch()
    # after a restore, a patch applies again
    try:
        assert patching.patch(Owner, "method", first, why="test: wrap") is True and Owner.method is first
    finally:
        patching.restore(Owner, "method")


def test_a_subclass_is_an_owner_of_its_own_and_an_inherited_attribute_is_removed_on_restore():
    try:
        assert patching.patch(Owner, "method", _wrap(Owner.method), why="base")
        assert not patching.is_patched(Child, "method")  # inherits the patched method, is not patched itself
        assert patching.patch(Child, "method", _wrap(Child.method), why="child")
        assert Child().method() == "dynsteer+dynsteer+vllm" and "method" in vars(Child)
        patching.restore(Child, "method")
        assert "method" not in vars(Child) and Child().method() == "dynsteer+vllm"
    finally:
        patching.restore(Child, "method")
        patching.restore(Owner, "method")
    assert Child().method() == "vllm"


def test_added_attributes_and_module_functions():
    module = types.ModuleType("fake_vllm_module")
    module.hook = lambda: "vllm"
    sys.modules[module.__name__] = module
    try:
        assert patching.patch(module, "hook", lambda: "dynsteer", why="module function")
        assert patching.patch(Owner, "dynsteer_extra", lambda self: 1, why="added method")
        kinds = {(p.owner, p.name): p.kind for p in patching.applied()}
        assert kinds[("fake_vllm_module", "hook")] == "replaced" and module.hook() == "dynsteer"
        assert kinds[(f"{__name__}.Owner", "dynsteer_extra")] == "added" and Owner().dynsteer_extra() == 1
    finally:
        patching.restore(module, "hook")
        patching.restore(Owner, "dynsteer_extra")
        del sys.modules[module.__name__]
    assert module.hook() == "vllm" and not hasattr(Owner, "dynsteer_extra")


def test_switch_toggles_an_instance_attribute_and_is_recorded():
    obj = Owner()

    def hook() -> str:
        return "hook"

    switch = patching.Switch(obj, "method", hook, why="test: per-request hook")
    assert obj.method() == "vllm" and "method" not in vars(obj)
    switch.set(True)
    assert obj.method() == "hook"
    switch.set(True)  # no-op
    switch.set(False)
    assert "method" not in vars(obj) and obj.method() == "vllm"  # deleted, not set to a stale value
    obj.method = own = lambda: "someone else's"
    other = patching.Switch(obj, "method", hook, why="test: per-request hook")
    other.set(True)
    other.set(False)
    assert obj.method is own  # restored rather than deleted
    recorded = [p for p in patching.applied() if p.owner == f"{__name__}.Owner" and p.kind == "switched"]
    assert [(p.name, p.why) for p in recorded] == [("method", "test: per-request hook")]  # recorded once


def test_applied_json_crosses_rpc_as_plain_dicts():
    rows = patching.applied_json()
    assert all(isinstance(r, dict) and set(r) == {"owner", "name", "function", "why", "kind"} for r in rows)


def test_worker_rpc_methods_are_named_by_the_keys():
    from dynsteer.engine import worker_ext

    names = {getattr(keys, k) for k in dir(keys) if k.startswith("RPC_") and k != "RPC_PREFIX"}
    assert set(worker_ext.RPC_METHODS) == names
    assert all(fn.__name__ == name and name.startswith(keys.RPC_PREFIX) for name, fn in worker_ext.RPC_METHODS.items())


def test_plugin_patchers_are_idempotent_and_recorded():
    """What the plugin does when vLLM imports each module, twice: the second run changes nothing."""
    pytest.importorskip("vllm")
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.request import Request
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from dynsteer.engine import command_desk, frontend, json_steering, prefix_cache, scheduler, worker_ext

    patchers = [(frontend.patch_input_processor, InputProcessor, ("__init__", "process_inputs")),
                (json_steering.patch_request_model, CompletionRequest, ("to_sampling_params",)),
                (json_steering.patch_request_model, ChatCompletionRequest, ("to_sampling_params",)),
                (prefix_cache.patch_request, Request, ("__init__",)),
                (scheduler.patch_scheduler, Scheduler, ("__init__", "add_request", "schedule", "update_from_output",
                                                        "_free_request_blocks", "shutdown")),
                (command_desk.patch_engine_core, EngineCore, ("collective_rpc",)),
                (worker_ext.install, WorkerWrapperBase, tuple(worker_ext.RPC_METHODS))]
    for patcher, cls, names in patchers:
        patcher(cls)
        before = {n: vars(cls)[n] for n in names}
        patcher(cls)
        assert {n: vars(cls)[n] for n in names} == before, cls
        assert all(patching.is_patched(cls, n) for n in names), cls
    owners = {(p.owner, p.name) for p in patching.applied()}
    assert ("vllm.v1.core.sched.scheduler.Scheduler", "schedule") in owners
    assert ("vllm.v1.worker.worker_base.WorkerWrapperBase", keys.RPC_PATCHES) in owners
    assert ("vllm.v1.request.Request", "update_block_hashes") in owners  # the HeldBackRequest subclass
    assert Request.update_block_hashes.__module__ == "vllm.v1.request"  # vLLM's own for every other request
