"""Every code block of README.md and docs/ runs, as written, on a tiny model on CPU.

Blocks are found with ``mktestdocs.grab_code_blocks``. The python blocks of a page run in order in one namespace (a
reader's session), in a scratch directory, with the names of :func:`placeholders` bound: what the pages say a reader
brings (``model``, ``prompts``, ``vec`` ...). ``model`` is a 32-layer variant of the tiny Llama (layer numbers as in
real models); ``vllm.LLM`` is the real engine with this suite's CPU defaults (float32, eager, a 256-token context)
under the block's own arguments, one engine alive at a time. A monitor service's block runs in a thread beside a
``generate`` of ``prompts``; its ``frames()`` loop ends a few seconds after the engine's last step here (it waits
forever by default). Bash blocks run with ``bash -eu``: a ``dynsteer serve``
line is checked against the server's argument parser and stands for the one server of this module (the same model,
served as ``MODEL``), and the rest runs against it (``localhost:8000`` is its address, ``$KEY`` its key).
:data:`SKIP` lists the few blocks that cannot run here, each with its reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import mktestdocs
import numpy as np
import pytest

from tests.conftest import ENGINE_DEFAULTS, served


ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
KEY = "docs-key"
LAYERS = 32
# (page, the block's first line): why it does not run here. Keep it short: every other block runs.
SKIP = {
    ("README.md", "bash scripts/demo.sh"): "the set-up, the SmolLM2 demo and this very test suite (.ci/run runs it)",
    ("docs/development.md", "bash scripts/test.sh"): "this very test suite (.ci/run runs it)",
    ("docs/quickstart.md", "bash scripts/setup.sh"): "the set-up (.ci/run runs it) and the SmolLM2 demo "
                                                     "(tests/test_smollm2.py, tests/test_doctor.py)",
    ("docs/guides/sweeps.md",
     "dynsteer sweep examples/sweeps/policy-gated.yaml --prompts examples/sweeps/prompts.jsonl"):
        "the example's own command on SmolLM2, which tests/test_sweep.py runs (this block is that command: "
        "test_the_sweep_block_is_the_example_command)",
}


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, source) of the page's python and bash blocks, in page order."""
    text = page.read_text()
    found = [(lang, src) for lang in ("python", "bash") for src in mktestdocs.grab_code_blocks(text, lang=lang)]
    return sorted(found, key=lambda b: text.index(b[1].splitlines()[0]))


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def skipped(page: Path, src: str) -> str | None:
    return SKIP.get((rel(page), first_line(src)))


def first_line(src: str) -> str:
    """A block's first line without its comment or line continuation (how :data:`SKIP` names blocks)."""
    return src.strip().splitlines()[0].split("#")[0].strip().rstrip("\\").strip()


def test_the_skip_list_stays_small_and_names_existing_blocks():
    assert len(SKIP) <= 4, "every docs block runs; a skip needs a reason no server or tiny model can meet"
    firsts = {(rel(p), first_line(src)) for p in PAGES for _, src in blocks(p)}
    assert set(SKIP) <= firsts, set(SKIP) - firsts
    assert sum(len(blocks(p)) for p in PAGES) >= 20  # the collection finds the pages' blocks


def test_the_sweep_block_is_the_example_command():
    """The sweeps guide's command is the one in examples/sweeps/policy-gated.yaml's header (tests/test_sweep.py runs
    that), up to where it writes."""
    def words(text: str) -> list[str]:
        w = shlex.split(text.replace("\\\n", " "))
        return [x for i, x in enumerate(w) if x != "--out" and (i == 0 or w[i - 1] != "--out")]

    block = next(src for lang, src in blocks(ROOT / "docs" / "guides" / "sweeps.md") if lang == "bash")
    header = "\n".join(ln.lstrip("#").strip() for ln in
                       (ROOT / "examples" / "sweeps" / "policy-gated.yaml").read_text().splitlines()
                       if ln.startswith("#"))
    command = re.search(r"dynsteer sweep (?:.*\\\n)*.*", header).group(0)
    assert words(block) == words(command), (block, command)


# ---- what the pages assume a reader has ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def deep_model(tiny_llama_path, tmp_path_factory):
    """The tiny Llama's tokenizer and shape with 32 layers (random weights, seed 0)."""
    import shutil

    import torch
    import transformers

    out = tmp_path_factory.mktemp("docs-model") / "tiny-llama-32"
    config = transformers.AutoConfig.from_pretrained(tiny_llama_path)
    config.num_hidden_layers = LAYERS
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    for f in Path(tiny_llama_path).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, deep_model):
    """The reader's directory: a vector body for the shell blocks, ``examples/``."""
    d = tmp_path_factory.mktemp("docs-run")
    h = transformers_hidden(deep_model)
    (d / "joy.json").write_text(json.dumps({"name": "joy", "vector": unit(h, 1).tolist()}))
    (d / "examples").symlink_to(ROOT / "examples")
    sae_directory(d / "sae-layer6", h)
    return d


def sae_directory(d: Path, h: int, d_sae: int = 64) -> None:
    """A SAELens-layout SAE (``sae_weights.safetensors`` with ``W_dec`` [d_sae, d_model], ``cfg.json``) at layer 6."""
    from safetensors.numpy import save_file

    d.mkdir()
    w_dec = np.random.default_rng(6).standard_normal((d_sae, h)).astype(np.float32)
    save_file({"W_dec": w_dec / np.linalg.norm(w_dec, axis=1, keepdims=True)}, str(d / "sae_weights.safetensors"))
    (d / "cfg.json").write_text(json.dumps({"d_in": h, "d_sae": d_sae, "hook_name": "blocks.6.hook_resid_post"}))


def transformers_hidden(model: Path) -> int:
    return json.loads((model / "config.json").read_text())["hidden_size"]


def unit(h: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(h)
    return (v / np.linalg.norm(v)).astype(np.float32)


def placeholders(model: Path) -> dict[str, Any]:
    """The names the pages use without defining them (docs/index.md lists them)."""
    import csv

    from vllm import SamplingParams

    h = transformers_hidden(model)
    rows = list(csv.DictReader((ROOT / "examples" / "data" / "sentiment.csv").open()))
    return {"model": str(model), "prompts": ["The weather today is", "My order arrived", "Once upon a time"],
            "params": SamplingParams(max_tokens=8, temperature=0),
            # norm 32: a residual of this random model is large; smaller vectors leave its greedy tokens unchanged
            "vec": unit(h, 1) * 32, "positive": unit(h, 2) * 32,
            "direction": unit(h, 3), "refusal_dir": unit(h, 4), "w": unit(h, 5),
            # no row crosses: the monitor's loop reads every frame and sends nothing (a command sent after the
            # engine's last step would wait for an ack until its timeout; the command path has its own tests)
            "b": -1e6,
            "sentences": [r["text"] for r in rows], "labels": np.array([r["label"] for r in rows])}


class Engines:
    """``vllm.LLM`` for the blocks: the real engine, this suite's CPU defaults under the block's arguments, the
    previous engine shut down first (one alive at a time)."""

    def __init__(self) -> None:
        from vllm import LLM

        self.real, self.live = LLM, None

    def __call__(self, model: Any, **kwargs: Any) -> Any:
        self.close()
        self.live = self.real(model=str(model), **{**ENGINE_DEFAULTS, **kwargs})
        return self.live

    def close(self) -> None:
        import gc

        if self.live is not None:
            with contextlib.suppress(Exception):
                self.live.llm_engine.engine_core.shutdown()
            self.live = None
            gc.collect()


@pytest.fixture(scope="module")
def session(deep_model, workdir):
    """Runs pages (each once, in their own namespace, in ``workdir``); ``run(page)`` returns the namespace."""
    import vllm

    from dynsteer.monitor.client import MonitorClient

    engines, done = Engines(), {}
    frames = MonitorClient.frames
    mp = pytest.MonkeyPatch()
    mp.setattr(vllm, "LLM", engines)
    # a monitor's loop waits forever by default; here it ends 5 s after the engine's last frame (60 s for the first)
    mp.setattr(MonitorClient, "frames", lambda self, timeout_s=None, start_timeout_s=None: frames(
        self, 5.0 if timeout_s is None else timeout_s, 60.0 if start_timeout_s is None else start_timeout_s))
    mp.chdir(workdir)

    def run(page: Path) -> dict[str, Any]:
        if page not in done:
            ns = {"__name__": "__main__", **placeholders(deep_model)}
            for lang, src in blocks(page):
                if lang == "python" and not skipped(page, src):
                    run_python(src, ns, engines)
            done[page] = ns
        return done[page]

    try:
        yield run
    finally:
        engines.close()
        mp.undo()


def run_python(src: str, ns: dict[str, Any], engines: Engines) -> None:
    if "in another process" in src.splitlines()[0]:
        # a monitor service: its loop runs beside the engine, as it would in its own process
        errors: list[BaseException] = []

        def monitor() -> None:
            try:
                exec(compile(src, "<docs block>", "exec"), ns)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(exc)

        t = threading.Thread(target=monitor, daemon=True)
        t.start()
        from vllm import SamplingParams

        outs = engines.live.generate(ns["prompts"], SamplingParams(max_tokens=48, temperature=0))
        t.join(120)
        assert not t.is_alive(), "the monitor's loop did not end"
        if errors:
            raise errors[0]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)  # b: no row crosses, nothing is aborted
        return
    exec(compile(src, "<docs block>", "exec"), ns)


# ---- the shell blocks' server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(deep_model, workdir, tmp_path_factory):
    log = tmp_path_factory.mktemp("docs-serve") / "server.log"
    exe = Path(sys.executable).with_name("dynsteer")
    cfg = json.dumps({"dynsteer": {"max_gates": 2}})
    with served(lambda port, args: [str(exe), "serve", str(deep_model), "--served-model-name", "MODEL",
                                    "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
                                    "--api-key", KEY, "--seed", "0", "--additional-config", cfg, *args], log) as url:
        yield url


def run_bash(src: str, page: Path, url: str, workdir: Path, deep_model: Path) -> str:
    from dynsteer.engine.server import serve_parser

    lines, rest = src.replace("\\\n", " ").splitlines(), []
    for line in lines:
        if line.lstrip().startswith("dynsteer serve"):
            words = shlex.split(line, comments=True)
            parser, _ = serve_parser()
            parser.parse_args(["serve", *[str(deep_model) if w == "MODEL" else w for w in words[2:]]])
            continue
        rest.append(line)
    # ``--model MODEL`` names the reader's model directory (a served request's "MODEL" is the served name)
    rest = [re.sub(r"--model MODEL\b", f"--model {deep_model}", line) for line in rest]
    host = url.removeprefix("http://")
    script = "\n".join(rest).replace("http://127.0.0.1:8000", url).replace("localhost:8000", host)
    env = {**os.environ, "KEY": KEY, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(["bash", "-eu", "-o", "pipefail", "-c", script], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{rel(page)}:\n{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert '"error"' not in proc.stdout.replace(" ", ""), proc.stdout[-3000:]
    return proc.stdout


# ---- the tests -------------------------------------------------------------------------------------------------------
PYTHON_PAGES = [p for p in PAGES if any(lang == "python" and not skipped(p, s) for lang, s in blocks(p))]
BASH_BLOCKS = [(p, i, s) for p in PAGES for i, (lang, s) in enumerate(blocks(p)) if lang == "bash"]
# pages whose blocks read a file another page's blocks write (the probes guide trains sentiment.safetensors)
NEEDS = {"README.md": "docs/guides/probes.md", "docs/guides/dynamic.md": "docs/guides/probes.md",
         "docs/guides/vectors.md": "docs/guides/probes.md"}



def _steered_differs(ns: dict[str, Any]) -> None:
    steered, unsteered = (list(o.outputs[0].token_ids) for o in ns["outs"][:2])
    assert steered != unsteered  # the same prompt, steered and not, in one batch


def _report_as_shown(ns: dict[str, Any]) -> None:
    """The dynamic guide's report example has the keys of a real report (its values are illustrative)."""
    shown = eval(blocks(ROOT / "docs" / "guides" / "dynamic.md")[1][1], {})  # noqa: S307 - the page's own literal
    out = ns["steerer"].generate(ns["prompts"][:1], ns["params"], policy=ns["policy"], report="tokens")[0]
    real = out.outputs[0].dynsteer
    assert set(shown) == set(real), (shown, real)
    assert set(shown["summary"]) == set(real["summary"]), real["summary"]
    assert set(shown["summary"]["rules"][0]) == set(real["summary"]["rules"][0]), real["summary"]


def _reported(ns: dict[str, Any]) -> None:
    report = ns["outs"][0].outputs[0].dynsteer
    assert report["monitors"] == ["neg"] and len(report["gate"]) == len(ns["outs"][0].outputs[0].token_ids), report


# what a page's last results must show beyond running (the namespace after its blocks)
CHECKS = {"docs/quickstart.md": _steered_differs,
          "README.md": _reported,
          "docs/guides/dynamic.md": _report_as_shown,
          "docs/guides/probes.md": lambda ns: ns["best"] in range(4, 30, 2) or pytest.fail(f"best layer {ns['best']}"),
          "docs/guides/capture.md": lambda ns: ns["outs"][0].capture[(15, "post_block")].shape[1] == 128
          or pytest.fail("capture shape")}


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=rel)
def test_python_blocks_run(session, page):
    if rel(page) in NEEDS:
        session(ROOT / NEEDS[rel(page)])
    ns = session(page)
    if rel(page) in CHECKS:
        CHECKS[rel(page)](ns)


@pytest.mark.parametrize("page, index, src", BASH_BLOCKS, ids=[f"{rel(p)}-{i}" for p, i, _ in BASH_BLOCKS])
def test_bash_blocks_run(request, page, index, src, workdir, deep_model):
    reason = skipped(page, src)
    if reason:
        pytest.skip(reason)
    if rel(page) in NEEDS:
        request.getfixturevalue("session")(ROOT / NEEDS[rel(page)])
    url = request.getfixturevalue("server") if "dynsteer serve" in src or "localhost:8000" in src else ""
    out = run_bash(src, page, url, workdir, deep_model)
    if "/v1/completions" in src:  # curl prints the replies back to back
        replies, at, decoder = [], 0, json.JSONDecoder()
        while (at := out.find("{", at)) >= 0:
            reply, at = decoder.raw_decode(out, at)
            replies.append(reply)
        assert [r["choices"][0]["text"] for r in replies if r.get("object") == "text_completion"], out[-2000:]
