"""Build-once cache directories: many processes may ask at once, exactly one builds, nobody sees a half build."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import Any



def default_cache_root() -> pathlib.Path:
    """``$DYNSTEER_CACHE`` or ``~/.cache/dynsteer``."""
    env = os.environ.get("DYNSTEER_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "dynsteer"


def is_complete(path: pathlib.Path, marker: str) -> bool:
    return (path / marker).is_file()


def build_once(final: pathlib.Path, build: Callable[[pathlib.Path], dict[str, Any]], marker: str) -> pathlib.Path:
    """Return ``final``, building it first if needed.

    ``build(out)`` fills the empty directory ``out`` and returns metadata for the completion ``marker`` file,
    written last (its presence means complete). It runs under
    a file lock in a temporary sibling directory that is renamed into place, so concurrent callers wait and then
    reuse the result, and an interrupted build leaves nothing that looks complete.
    """
    if is_complete(final, marker):
        return final
    from filelock import FileLock

    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(parent / f".{final.name}.lock")):
        if is_complete(final, marker):  # built by another process while we waited
            return final
        work = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
        try:
            out = work / "out"
            out.mkdir()
            meta = build(out)
            (out / marker).write_text(json.dumps(meta) + "\n")
            _make_world_readable(out)  # mkdtemp and safetensors create owner-only modes
            if final.exists():  # an unmarked (incomplete) directory from an earlier, interrupted build
                shutil.rmtree(final)
            os.replace(out, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _make_world_readable(path: pathlib.Path) -> None:
    path.chmod(0o755)
    for child in path.iterdir():
        child.chmod(0o644)
