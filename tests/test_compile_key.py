"""A dynsteer engine's compiled graphs are cached apart from plain vLLM's: dynsteer folds a factor of its own into
``VllmConfig.compute_hash``, the key of vLLM's compile cache and start-up plans."""

from __future__ import annotations

import os
import subprocess
import sys

from dynsteer.engine import compile_key
from dynsteer.engine.patching import is_patched, restore


class FakeConfig:
    def __init__(self, additional_config: dict) -> None:
        self.additional_config = additional_config

    def compute_hash(self) -> str:
        return "0123456789"


def test_the_factor_changes_the_hash_with_the_resolved_config():
    compile_key.patch_config_hash(FakeConfig)
    try:
        default = FakeConfig({}).compute_hash()
        assert default != "0123456789" and len(default) == 10 and int(default, 16) >= 0
        assert FakeConfig({}).compute_hash() == default  # stable
        # the resolved config: written-out defaults are the same graph, another layout is not
        given = FakeConfig({"dynsteer": {}}).compute_hash()
        assert FakeConfig({"dynsteer": {"max_gates": 2}}).compute_hash() == given
        assert FakeConfig({"dynsteer": {"max_gates": 3}}).compute_hash() != given
        assert FakeConfig({"dynsteer": {"layers": [1]}}).compute_hash() != given
        # an invalid config still hashes (it fails where the engine reads it)
        assert len(FakeConfig({"dynsteer": {"max_gates": "many"}}).compute_hash()) == 10
    finally:
        restore(FakeConfig, "compute_hash")


def test_the_factor_names_dynsteer_version_and_source():
    a = compile_key.dynsteer_factor({})
    assert a == compile_key.dynsteer_factor({}) and len(compile_key.source_digest()) == 64
    compile_key.source_digest.cache_clear()
    try:
        original = compile_key.source_digest()
        compile_key.source_digest.cache_clear()
        compile_key.__version__, saved = "0.0.0-other", compile_key.__version__
        try:
            assert compile_key.dynsteer_factor({}) != a
        finally:
            compile_key.__version__ = saved
        assert compile_key.source_digest() == original
    finally:
        compile_key.source_digest.cache_clear()


HASH = ("import dynsteer.engine.plugin as p; p.register(); from vllm.config import VllmConfig; "
        "print('HASH', VllmConfig().compute_hash())")


def _hash(disable: bool) -> str:
    env = {**os.environ, "DYNSTEER_DISABLE": "1" if disable else "0"}
    out = subprocess.run([sys.executable, "-c", HASH], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("HASH"))


def test_plain_vllm_and_dynsteer_key_different_compile_caches():
    """The regression: both hashed alike, so ``vllm serve`` after ``dynsteer serve`` of one model loaded dynsteer's
    compiled graph and failed at start (``KeyError: 'dynsteer_pre_attn'``), and the other way round a dynsteer
    engine could load a graph without its sites."""
    with_plugin, plain = _hash(False), _hash(True)
    assert with_plugin != plain
    assert _hash(False) == with_plugin  # and stable across processes, so a restart reads its own cache
    from vllm.config import VllmConfig

    import dynsteer.engine.plugin as plugin

    plugin.register()
    if os.environ.get("DYNSTEER_DISABLE") != "1":
        assert is_patched(VllmConfig, "compute_hash")
