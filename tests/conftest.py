"""Shared fixtures: fast in-process CPU engines on tiny local models (nothing from a model hub)."""

from __future__ import annotations

import gc
import os

ON_GPU = os.environ.get("DYNSTEER_TEST_DEVICE") == "cuda"
# Fast, deterministic CPU engines in-process; on GPU each engine gets its own process (vLLM's default), because
# several CUDA-graph engines built and torn down in one process trip the caching allocator.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if ON_GPU else "0")
if ON_GPU:  # tests touch torch in this process (reference forwards); a forked engine must not inherit CUDA state
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not ON_GPU and "TORCH_COMPILE_DISABLE" not in os.environ:
    # vLLM's CPU sampler torch.compiles a helper at every engine's warm-up: about 12 s in each new process on the CI
    # box, inductor's cache warm or not. CPU engines here are eager, so that helper is all there is to compile:
    # engines in processes of their own (servers, CLI runs, multiprocess engines) run it eagerly. This process keeps
    # dynamo for the compiled-forward tests: torch reads TORCH_COMPILE_DISABLE once, when torch._dynamo.config is
    # imported, so it is imported here first and the variable set only for the children.
    import torch._dynamo.config  # noqa: F401

    os.environ["TORCH_COMPILE_DISABLE"] = "1"

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# Architectures the suite loads beyond the tiny checkpoints: the unsupported-architecture tests' GPT-2 and OPT.
FOREIGN_ARCHS = ("GPT2LMHeadModel", "OPTForCausalLM")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Fill vLLM's model-info cache for every architecture the suite loads, in one process. vLLM inspects each
    architecture the first time a machine loads it, in a subprocess of its own (about 12 s each on the 2-core CI
    box, some six minutes for the suite on a fresh machine); one process does them all in about 10 s. A stamp beside
    the cache skips this once done for this vLLM; a failure only costs time (vLLM then inspects as usual)."""
    import hashlib
    import importlib.util
    import subprocess
    import sys

    from dynsteer.testing.tiny_models import vllm_architectures

    archs = (*vllm_architectures(), *FOREIGN_ARCHS)
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return
    # vLLM's default cache root, spelled out here: importing vllm.envs to read it takes seconds
    cache = Path(os.environ.get("VLLM_CACHE_ROOT")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm") / "modelinfos"
    key = hashlib.sha256(repr((spec.origin, os.stat(spec.origin).st_mtime_ns, archs)).encode()).hexdigest()[:16]
    stamp = cache / f"dynsteer-tests-{key}.done"
    if stamp.exists():
        return
    code = "import sys; from dynsteer.engine.model_info import warm_model_info; warm_model_info(sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *archs], capture_output=True, text=True)
    if proc.returncode == 0:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
    else:
        sys.stderr.write(f"[conftest] vLLM's model-info cache was not warmed: {proc.stderr[-2000:]}\n")


# DYNSTEER_TEST_DEVICE=cuda runs the same integration tests on a GPU the way users run vLLM there: default (v2)
# runner, torch.compile and CUDA graphs on, bf16 (FlashAttention has no float32 path). DYNSTEER_TEST_GPU_UTIL lowers
# each engine's share of GPU memory and DYNSTEER_TEST_KV_BYTES fixes its KV cache (skipping vLLM's memory profiling,
# which fails while another process frees GPU memory), so several test processes can share one GPU.
ENGINE_DEFAULTS: dict[str, Any] = (
    dict(dtype="bfloat16", enforce_eager=False, max_model_len=256, max_num_seqs=8, seed=0,
         gpu_memory_utilization=float(os.environ.get("DYNSTEER_TEST_GPU_UTIL", "0.25")),
         **({"kv_cache_memory_bytes": int(os.environ["DYNSTEER_TEST_KV_BYTES"])}
            if os.environ.get("DYNSTEER_TEST_KV_BYTES") else {})) if ON_GPU else
    dict(dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0))
needs_eager_hooks = pytest.mark.skipif(ON_GPU, reason="reads residuals with eager forward hooks (CPU engines)")


@contextlib.contextmanager
def make_llm(model: str, **kwargs: Any) -> Iterator[Any]:
    """An in-process ``vllm.LLM`` that is torn down on exit (one engine alive at a time keeps memory flat)."""
    from vllm import LLM

    _release_memory()  # an earlier engine freed while this one profiles memory trips vLLM's check
    llm = LLM(model=str(model), **{**ENGINE_DEFAULTS, **kwargs})
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        _release_memory()


@contextlib.contextmanager
def env(**values: str | None) -> Iterator[None]:
    """Environment variables set (``None``: unset) for the block, restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cpu_tp_env(tp: int) -> contextlib.AbstractContextManager[None]:
    """Two CPU workers for TP=2 off GPU: one core each (one NUMA node here), spawned as the GPU suite starts workers.
    Nothing changes on GPU or for TP=1."""
    if tp == 2 and not ON_GPU:
        return env(VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    return env(VLLM_CPU_OMP_THREADS_BIND=None)


def with_inprocess_engine_core(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with vLLM's engine core in the calling process (a test that steps the engine or reads its
    scheduler). On GPU it runs in a spawned process of its own: a second in-process CUDA-graph engine after the first
    was torn down trips the caching allocator (the graph memory pool vLLM keeps per process: "use_count > 0 INTERNAL
    ASSERT" at the next capture). TP workers are that process's children. ``fn`` must be a module-level function;
    its assertion errors come back as raised there."""
    with env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):  # inherited by the child spawned at submit
        if not ON_GPU:
            return fn(*args)
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(fn, *args).result()


def _release_memory() -> None:
    gc.collect()


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def texts(outputs: list[Any]) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="session")
def tiny_llama_path():
    from dynsteer.testing.tiny_models import tiny_model

    return tiny_model("llama")


def console_script() -> Path:
    """The ``dynsteer`` script beside this interpreter (a venv), else the one on PATH (a system-wide install)."""
    import shutil
    import sys

    here = Path(sys.executable).with_name("dynsteer")
    return here if here.exists() else Path(shutil.which("dynsteer") or here)


def dynsteer_served(model: Any, log: Any, key: str, cfg: dict[str, Any],
                    max_num_seqs: int = 16) -> contextlib.AbstractContextManager[str]:
    """``dynsteer serve model`` (:func:`served`): loopback, a 256-token context, seed 0, ``--api-key key`` and
    ``cfg`` as the engine's dynsteer config."""
    import json

    exe = console_script()
    return served(lambda port, args: [str(exe), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                                      "--max-model-len", "256", "--max-num-seqs", str(max_num_seqs), "--api-key", key,
                                      "--seed", "0", "--additional-config", json.dumps({"dynsteer": cfg}), *args],
                  log)


def http_json(url: str, method: str, body: Any = None, key: str | None = None, timeout: float = 120,
              empty: Any = None) -> tuple[int, Any]:
    """One JSON call with urllib only (as any HTTP client makes it): ``(status, parsed reply)``, an HTTP error's
    status and body included. ``empty``: the reply of an empty 200 body (None: an empty body fails to parse)."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (empty if not raw and empty is not None else json.loads(raw))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@contextlib.contextmanager
def served(command: Callable[[int, list[str]], list[str]], log: Any, timeout_s: float = 300) -> Iterator[str]:
    """A server process on a free loopback port, torn down on exit; yields its base URL once ``/health`` answers.

    ``command(port, dtype_args)`` gives its argv (``dtype_args``: this device's dtype and eager flags)."""
    import socket
    import subprocess
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # on GPU a server takes the engines' share of memory (and their fixed KV cache, which skips the memory profiling
    # that fails while another process frees memory) too: a module's in-process engine may still hold its own
    args = (["--dtype", "bfloat16", "--gpu-memory-utilization", str(ENGINE_DEFAULTS["gpu_memory_utilization"]),
             *(["--kv-cache-memory-bytes", str(ENGINE_DEFAULTS["kv_cache_memory_bytes"])]
               if "kv_cache_memory_bytes" in ENGINE_DEFAULTS else [])]
            if ON_GPU else ["--dtype", "float32", "--enforce-eager"])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(command(port, args), env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited early:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)
        else:
            pytest.fail(f"server did not come up:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


@contextlib.contextmanager
def openai_server(model: str, log: Any, extra: list[str] = (), timeout_s: float = 300) -> Iterator[str]:
    """``vllm serve`` (dynsteer loaded) on a free loopback port, torn down on exit; yields its base URL."""
    import sys

    with served(lambda port, args: [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                                    "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", *args,
                                    *extra], log, timeout_s) as url:
        yield url


def run_interpreted(script: str, timeout: float) -> dict[str, Any]:
    """Run a test file as a script with ``TRITON_INTERPRET=1`` and return the JSON of its ``RESULTS `` line.

    Triton fixes interpreted-vs-compiled mode when a kernel module is imported, so kernel-vs-reference comparisons
    on CPU run in a fresh interpreter (the file's ``__main__`` worker); ``DYNSTEER_KERNEL`` is cleared for it."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DYNSTEER_KERNEL", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(Path(script).resolve())], env=env, cwd=root, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout}\n{proc.stderr}"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def unit(h: int, seed: int) -> np.ndarray:
    """A random unit vector (float32), the same for the same seed."""
    v = np.random.default_rng(seed).standard_normal(h)
    return (v / np.linalg.norm(v)).astype(np.float32)


def vec(h: int, seed: int, scale: float = 6.0) -> np.ndarray:
    """A random steering vector (float32, entries ~ N(0, scale²)), the same for the same seed."""
    return (np.random.default_rng(100 + seed).standard_normal(h) * scale).astype(np.float32)


def row_live(vec: Any, clamp_strength: Any, mon_mask: Any = None, dyn_mask: Any = None) -> Any:
    """int32 [R]: the ``row_live`` flags consistent with the other tables of one site (what
    ``SteeringTables.write_row`` stores): 1 a non-zero vector, 2 a non-zero clamp strength, 4 monitors, 8 dyn
    terms; row 0 (which holds nothing) carries the site's summary, here the OR over every row."""
    import torch

    live = (vec != 0).flatten(1).any(1).int() | ((clamp_strength != 0).flatten(1).any(1).int() << 1)
    if mon_mask is not None:
        live |= (mon_mask != 0).int() << 2
    if dyn_mask is not None:
        live |= (dyn_mask != 0).int() << 3
    live[0] = 0
    live[0] = int(np.bitwise_or.reduce(live.cpu().numpy()))
    return live.to(torch.int32)


def site_args(kw: dict[str, Any]) -> dict[str, Any]:
    """Flat keyword arguments in the site ops' order (``h``, ``r``, ``row_index``, one per table, ``stage``,
    ``stage_slot``; what ``torch.ops.dynsteer.steer_site(_dyn)`` takes) as the launchers and references take them:
    the tables packed into one ``SiteTables`` (the same tensors, so in-place writes show in ``kw``)."""
    from dynsteer.kernels.site_tables import SiteTables

    tables = SiteTables(**{k: v for k, v in kw.items() if k in SiteTables._fields})
    return {k: v for k, v in kw.items() if k not in SiteTables._fields} | {"tables": tables}
