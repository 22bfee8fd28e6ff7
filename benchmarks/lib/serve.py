"""``vllm serve`` and ``dynsteer serve`` on loopback and a free port, for the benchmarks that go over HTTP (admission
memory and latency, the soaks, the serving benchmark)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# CPU engines as the tests build them: the engine core in a process of its own, one thread, a small KV cache
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
# and the model options the CPU benchmarks run with
CPU_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]

# ``vllm serve`` as vLLM's CLI runs it (its console script asks for the distribution "vllm", which vllm-cpu is not);
# the argv after it starts with the model, as after "serve"
VLLM_SERVE = """
import sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser
cli_env_setup()
parser = FlexibleArgumentParser(prog="vllm")
command = ServeSubcommand()
command.subparser_init(parser.add_subparsers(required=True, dest="subparser")).set_defaults(dispatch_function=command.cmd)
args = parser.parse_args(["serve", *sys.argv[1:]])
command.validate(args)
args.dispatch_function(args)
"""


def http_json(url: str, method: str, path: str, body: dict | None = None, key: str | None = None,
              timeout: float = 300) -> tuple[int, Any]:
    """One JSON call: (status, decoded body); an HTTP error's body as ``{"error": text}``."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + path, None if body is None else json.dumps(body).encode(), headers,
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dynsteer_exe() -> Path:
    """The ``dynsteer`` console script beside this interpreter, else the one on ``PATH``."""
    here = Path(sys.executable).with_name("dynsteer")
    return here if here.exists() else Path(shutil.which("dynsteer") or here)


class Server:
    """``dynsteer serve <model>`` (``base`` options: the CPU ones unless given; seed 0; then ``args``), its stderr in
    ``log``; ``pythonpath`` runs dynsteer from another checkout, ``env`` adds variables (the CPU ones unless given).
    ``start`` returns the base URL once ``/health`` answers (or stops the server and raises ``RuntimeError`` with the
    end of its log)."""

    def __init__(self, model: str | Path, log: Path, args: list[str], pythonpath: Path | None = None,
                 base: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.model, self.log, self.args = str(model), log, args
        self.base = CPU_ARGS if base is None else base
        self.env = {**os.environ, **({"PYTHONPATH": str(pythonpath)} if pythonpath else {}),
                    **(CPU_ENV if env is None else env)}
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def command(self) -> list[str]:
        """What runs ``serve`` (the argv before the model)."""
        return [str(dynsteer_exe()), "serve"]

    def launch(self) -> None:
        """Start the process without waiting for it (``wait`` does)."""
        port = free_port()
        argv = [*self.command(), self.model, "--host", "127.0.0.1", "--port", str(port), *self.base,
                "--seed", "0", *self.args]
        self.proc = subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        self.url = f"http://127.0.0.1:{port}"

    def wait(self, timeout: float = 300) -> str:
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not come up:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return self.url
            except (urllib.error.URLError, ConnectionError):
                time.sleep(1)

    def start(self, timeout: float = 300) -> str:
        self.launch()
        return self.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VanillaServer(Server):
    """``vllm serve`` with the same arguments, dynsteer's plugin switched off in every process."""

    def __init__(self, model: str | Path, log: Path, args: list[str], base: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(model, log, args, base=base, env=env)
        self.env["DYNSTEER_DISABLE"] = "1"

    def command(self) -> list[str]:
        return [sys.executable, "-c", VLLM_SERVE]
