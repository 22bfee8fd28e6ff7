"""Engines side by side on one device, each in a worker process of its own: the engine farm.

A worker is ``<script> --worker <config JSON>``: it builds one ``vllm.LLM``, answers ``READY {...}`` once up, then
one ``RESULT {...}`` (or ``ERROR {...}``) line per JSON command read on stdin. The farm starts its engines at once
(an engine that copies another, e.g. a second ``absent``, once that one is up: it reads its compile cache rather
than race to write it), pins their processes, reads the CPU time they use around a call, and closes them. Also
here: the model shapes they run with dummy weights (Llama-3-8B, Llama-3-70B) and their memory per tensor-parallel
rank, the GPUs' free memory, and hotwire-vllm's private install.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import psutil  # CPU accounting per call, --pin-cores

    HAVE_PSUTIL = True
except ImportError:
    HAVE_PSUTIL = False

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}

# Llama-3-70B's layer (what tensor parallelism splits); ``shape_config(..., layers=N)`` keeps it and drops layers
# where the compared engines would not fit otherwise.
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
SHAPES = {"llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}


def shape_config(shape: str, layers: int | None = None) -> dict:
    """The ``config.json`` of a named shape, with ``layers`` decoder layers if given."""
    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    return cfg


# ---- model memory ---------------------------------------------------------------------------------------------------
def kv_bytes_per_token(cfg: dict, dtype_bytes: int, tp: int = 1) -> int:
    """KV cache bytes per token on one of ``tp`` ranks (vLLM splits the KV heads, and replicates them where there
    are fewer heads than ranks)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = -(-cfg["num_key_value_heads"] // tp)
    return cfg["num_hidden_layers"] * 2 * heads * head_dim * dtype_bytes


def weight_bytes(cfg: dict, dtype_bytes: int, tp: int = 1) -> int:
    """Weight bytes on one of ``tp`` ranks (every matrix is split; the norms are small and counted whole)."""
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    embed = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return (-(-(n * per_layer + embed) // tp) + (2 * n + 1) * h) * dtype_bytes


def gpu_memory(count: int = 1) -> tuple[str, int, int] | None:
    """(name, total bytes, free bytes) of the engines' GPU, or of the least free of their first ``count`` GPUs
    (tensor parallelism: every rank holds the same share), from nvidia-smi, so the parent never opens a CUDA
    context. The GPUs are the first of ``CUDA_VISIBLE_DEVICES``, which nvidia-smi itself ignores. None without a
    GPU, or with fewer than ``count``."""
    visible = [i.strip() for i in (os.environ.get("CUDA_VISIBLE_DEVICES") or "").split(",") if i.strip()]
    indices = visible[:count] if visible else [str(i) for i in range(count)]
    if len(indices) < count:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,"
                              "nounits", "-i", ",".join(indices)], capture_output=True, text=True, timeout=30).stdout
        rows = [[x.strip() for x in line.split(",")] for line in out.strip().splitlines()]
        if len(rows) < count:
            return None
        name, total, free = min(rows, key=lambda r: int(r[2]))
        return name + (f" x{count}" if count > 1 else ""), int(total) << 20, int(free) << 20
    except Exception:  # noqa: BLE001 - no GPU, no nvidia-smi
        return None


# ---- plugins --------------------------------------------------------------------------------------------------------
def install_hotwire(wheel: Path, dest: Path) -> tuple[Path | None, str]:
    """``pip install --no-deps --target`` (unzip if pip cannot), so only the hotwire engine's path sees it."""
    target = dest / "hotwire-site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
           str(wheel)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        import zipfile

        try:
            zipfile.ZipFile(wheel).extractall(target)  # a wheel is a zip of the site-packages layout
        except Exception as exc:  # noqa: BLE001
            return None, f"pip failed ({proc.stderr.strip()[-300:]}) and unzip failed ({exc})"
    return target, "installed"


def find_wheel(arg: str | None, repo: Path) -> Path | None:
    """hotwire-vllm's wheel: ``arg``, ``$HOTWIRE_WHEEL``, ``<repo>/.gpu-carry/`` or ``/tmp/hw/``."""
    cands = [arg, os.environ.get("HOTWIRE_WHEEL")]
    for folder in (repo / ".gpu-carry", Path("/tmp/hw")):
        cands += [str(p) for p in sorted(folder.glob("hotwire_vllm-*.whl"))] if folder.is_dir() else []
    return next((Path(c) for c in cands if c and Path(c).is_file()), None)


def visible_plugins(env: dict) -> list[str]:
    """The ``vllm.general_plugins`` entry points a process with ``env`` would load."""
    code = ("from importlib.metadata import entry_points as e; import json; "
            "print(json.dumps(sorted(p.name for p in e(group='vllm.general_plugins'))))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else [f"? {proc.stderr.strip()[-200:]}"]


# ---- cores: pinning and CPU time ------------------------------------------------------------------------------------
def cpu_list(text: str) -> set[int]:
    """``"2-3,6"`` -> ``{2, 3, 6}``."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin_spec(text: str) -> tuple[list[int], list[int]]:
    """``--pin-cores FRONT:CORE`` (or one list for both), checked against the cpus this process may use."""
    front, _, core = text.partition(":")
    try:
        sets = cpu_list(front), cpu_list(core or front)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pin-cores: {text!r} is not FRONT:CORE cpu lists (e.g. 2-3:4-7)")
    allowed = os.sched_getaffinity(0)
    for cpus in sets:
        if not cpus or not cpus <= allowed:
            raise argparse.ArgumentTypeError(f"--pin-cores: {sorted(cpus)} is not within the usable cpus "
                                             f"{sorted(allowed)}")
    return sorted(sets[0]), sorted(sets[1])


def pin_engine(pid: int, front: list[int], core: list[int]) -> dict:
    """Pin every thread of worker ``pid`` to ``front`` and every thread of its descendants (the engine core) to
    ``core`` (threads started later inherit their creator's mask). Returns what was pinned."""
    proc = psutil.Process(pid)
    done = {"front": front, "core": core, "threads": 0, "processes": 0}
    for p, cpus in [(proc, front)] + [(c, core) for c in proc.children(recursive=True)]:
        try:
            for t in p.threads():
                os.sched_setaffinity(t.id, cpus)
                done["threads"] += 1
            done["processes"] += 1
        except (psutil.NoSuchProcess, ProcessLookupError):  # a helper process that exited meanwhile
            continue
    return done


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by worker ``pid`` (the frontend: ``LLM``) and by its descendants
    (vLLM's engine core, which runs the model runner, and any helper it started); read between calls."""
    def used(p: "psutil.Process") -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.NoSuchProcess:
            return 0.0

    proc = psutil.Process(pid)
    return used(proc), sum(used(c) for c in proc.children(recursive=True))


# ---- one engine -----------------------------------------------------------------------------------------------------
class EngineDied(RuntimeError):
    pass


class Engine:
    """A worker process holding one engine, driven over stdin / stdout (a reader thread, so waits can time out)."""

    def __init__(self, name: str, script: Path, cfg: dict, env: dict, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(script), "--worker", json.dumps(cfg)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.started = time.perf_counter()
        self.info: dict = {}

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(("READY ", "RESULT ", "ERROR ")):
                self.lines.put(line)
        self.lines.put(None)  # end of output: the process is gone

    def _next(self, timeout: float) -> tuple[str, dict]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise EngineDied(f"engine {self.name}: no answer within {timeout:.0f} s") from None
        if line is None:
            self.log.flush()
            raise EngineDied(f"engine {self.name} died; end of {self.log_path}:\n"
                             + self.log_path.read_text(errors="replace")[-4000:])
        tag, _, body = line.partition(" ")
        return tag, json.loads(body)

    def wait_ready(self, timeout: float) -> dict:
        tag, self.info = self._next(timeout)
        assert tag == "READY", tag
        return self.info

    def call(self, cmd: dict, timeout: float) -> dict:
        """Send one command; the reply (``{"error": ...}`` when the worker raised)."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        tag, body = self._next(timeout)
        return body if tag == "RESULT" else {"error": body.get("error", "?")}

    def close(self, timeout: float = 30) -> None:
        try:
            if not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except Exception:  # noqa: BLE001 - a stuck engine must not keep the report from being written
            self.proc.kill()
            self.proc.wait(timeout=30)


# ---- the farm -------------------------------------------------------------------------------------------------------
class EngineFarm:
    """The engines of one run, each a worker process of ``script``; ``live`` holds those up and not dead."""

    def __init__(self, script: Path, log_dir: Path) -> None:
        self.script, self.log_dir = script, log_dir
        self.live: dict[str, Engine] = {}

    def start(self, cfgs: dict[str, dict], envs: dict[str, dict], clones: dict[str, str], timeout: float,
              serial: bool = False, first: str | None = None) -> dict[str, str]:
        """Start the engines of ``cfgs`` (in its order) all at once, ``first`` waited for before the others start,
        and each engine of ``clones`` (clone -> origin) once its origin is up; or one after another with ``serial``.
        Returns ``{engine: why}`` for those that did not come up within ``timeout`` seconds (not in ``live``)."""
        failed: dict[str, str] = {}
        deadline = time.perf_counter() + timeout

        def start(e: str) -> None:
            self.live[e] = Engine(e, self.script, cfgs[e], envs[e], self.log_dir)

        def ready(e: str) -> None:
            try:
                self.live[e].wait_ready(max(deadline - time.perf_counter(), 1.0))
                print(f"{e}: engine up in {time.perf_counter() - self.live[e].started:.0f} s", flush=True)
            except EngineDied as exc:
                failed[e] = str(exc)
                print(f"{e}: FAILED to start\n{exc}", flush=True)
                self.live.pop(e).close(5)

        later = [e for e in cfgs if e in clones]
        for e in [e for e in cfgs if e not in clones]:
            start(e)
            if serial or e == first:
                ready(e)
        for origin in dict.fromkeys(clones[e] for e in later):  # the first is up; others may still be starting
            if origin in self.live and not self.live[origin].info:
                ready(origin)
            if origin not in self.live:
                failed.update({e: f"{origin}, the engine it copies, did not start" for e in later
                               if clones[e] == origin})
                continue
            for e in (e for e in later if clones[e] == origin):
                start(e)
                if serial:
                    ready(e)
        for e in [e for e in cfgs if e in self.live and not self.live[e].info]:
            ready(e)
        return failed

    def pin(self, front: list[int], core: list[int]) -> dict:
        """Every live engine's frontend to ``front`` and its engine core to ``core`` (:func:`pin_engine`)."""
        return {e: pin_engine(eng.proc.pid, front, core) for e, eng in self.live.items()}

    def call(self, name: str, cmd: dict, timeout: float) -> dict:
        """One command to engine ``name``; with psutil, the reply's ``cpu_busy`` says how busy its frontend and
        engine core were over the call (CPU seconds per wall second of the reply's ``s``; 1.0: a core flat out).
        An engine that dies is dropped from ``live`` and :class:`EngineDied` raised."""
        eng = self.live[name]
        try:
            before = cpu_seconds(eng.proc.pid) if HAVE_PSUTIL else None
            res = eng.call(cmd, timeout)
            after = cpu_seconds(eng.proc.pid) if HAVE_PSUTIL else None
        except EngineDied:
            self.live.pop(name).close(5)
            raise
        if before and after and res.get("s"):
            res["cpu_busy"] = {"front": round((after[0] - before[0]) / res["s"], 3),
                               "core": round((after[1] - before[1]) / res["s"], 3)}
        return res

    def close(self) -> None:
        """Closing stdin ends a worker; all at once, so their shutdowns overlap."""
        for eng in self.live.values():
            try:
                eng.proc.stdin.close()
            except OSError:
                pass
        for eng in self.live.values():
            eng.close(timeout=30)
