"""vLLM's model-info cache filled from one process (what the suite's session start does on a fresh machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, sys
from dynsteer.engine.model_info import warm_model_info
from vllm.model_executor.models import registry
first = warm_model_info(["LlamaForCausalLM", "NoSuchForCausalLM"])
second = warm_model_info(["LlamaForCausalLM"])

def refuse(fn):
    raise AssertionError("vLLM inspected in a subprocess: the cache was not used")

registry._run_in_subprocess = refuse
info = registry.ModelRegistry.models["LlamaForCausalLM"].inspect_model_cls()
print("RESULT", json.dumps({"first": first, "second": second, "text": info.is_text_generation_model,
                            "pp": info.supports_pp}))
"""


def test_warmed_entries_are_read_by_vllms_own_inspection(tmp_path):
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    assert r["first"] == ["LlamaForCausalLM"]  # an unknown name is skipped
    assert r["second"] == []  # already cached: nothing computed
    assert r["text"] is True and r["pp"] is True  # Llama's real capabilities, read back from the file
    files = list((tmp_path / "modelinfos").glob("*LlamaForCausalLM.json"))
    assert len(files) == 1 and set(json.loads(files[0].read_text())) == {"hash", "modelinfo"}
