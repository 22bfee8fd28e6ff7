"""Diagnose steering on GPU: does the runner plan steps, and does steering change output eager vs compiled?"""
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import logging
logging.getLogger("dynsteer").setLevel(logging.INFO)
logging.getLogger("dynsteer").addHandler(logging.StreamHandler())
import numpy as np
from vllm import LLM, SamplingParams
import dynsteer
from dynsteer.testing.tiny_models import tiny_model

eager = sys.argv[1] == "eager"
extra = {"compilation_config": {"cudagraph_mode": "NONE"}} if sys.argv[1] == "nograph" else {}
llm = LLM(model=str(tiny_model("llama")), dtype="bfloat16", enforce_eager=eager, max_model_len=256, max_num_seqs=8,
          seed=0, gpu_memory_utilization=0.2, **extra)
st = dynsteer.attach(llm)
sp = SamplingParams(temperature=0, max_tokens=8)
P = ["the quick brown fox", "once upon a time"]
base = [list(o.outputs[0].token_ids) for o in llm.generate(P, sp)]
st.set_layer_vector(1, (np.random.default_rng(0).standard_normal(st.hidden_size) * 8).astype(np.float32))
out = [list(o.outputs[0].token_ids) for o in llm.generate(P, sp)]
d = st.describe()[0]
def probe(self):
    from dynsteer.engine.runner import runtime_of
    r = self.worker.model_runner
    rt = runtime_of(r)
    return {"rt": rt is not None, "cls": type(r).__module__ + "." + type(r).__name__,
            "row_index": rt.tables.row_index[:8].tolist() if rt else None,

            "model_cls": type(r.model).__name__,
            "hooks": sum(1 for m in r.model.modules() if type(m).__name__ == "SiteHook")}
print("DIAG", sys.argv[1], "changed:", out != base, json.dumps(d["stats"]), d["rows_in_use"], llm.collective_rpc(probe))
