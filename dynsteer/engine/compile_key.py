"""dynsteer's share of vLLM's configuration hash.

vLLM keys its compiled-graph cache (``torch_aot_compile/<hash>``, the inductor cache) and its profiled start-up plans
by ``VllmConfig.compute_hash()``. dynsteer's hooked layers change the graph and the memory without changing any vLLM
config, so without a factor of its own a plain vLLM process and a dynsteer process of the same model share one
cache entry: plain vLLM then loads a graph that calls dynsteer's modules (and fails at start), and dynsteer could load
a graph without its sites (steering silently absent). The factor is dynsteer's version, the digest of its source
(a development edit recompiles too) and the engine config as resolved, defaults included.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from dynsteer._version import __version__
from dynsteer.config import DynsteerConfig
from dynsteer.engine.patching import patch


@functools.cache
def source_digest() -> str:
    """sha256 over every module of the dynsteer package (path and content), computed once per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def dynsteer_factor(additional_config: Any) -> str:
    """What dynsteer adds to the hash of a config whose ``additional_config`` is this."""
    try:
        resolved = DynsteerConfig.from_additional(additional_config).model_dump_json()
    except Exception:  # noqa: BLE001 - an invalid config fails where it is read; the hash must not
        resolved = json.dumps(additional_config, sort_keys=True, default=str)
    return hashlib.sha256(f"dynsteer {__version__} {source_digest()} {resolved}".encode()).hexdigest()


def patch_config_hash(vllm_config_cls: type) -> None:
    """Fold :func:`dynsteer_factor` into ``VllmConfig.compute_hash`` (same length, same alphabet)."""
    original = vllm_config_cls.compute_hash

    def compute_hash(self: Any) -> str:
        base = original(self)
        return hashlib.sha256(f"{base} {dynsteer_factor(self.additional_config)}".encode()).hexdigest()[:len(base)]

    patch(vllm_config_cls, "compute_hash", compute_hash,
          why="compiled graphs and start-up plans of a dynsteer engine are cached apart from plain vLLM's")
