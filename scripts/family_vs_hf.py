"""Diagnose a family's disagreement with transformers without dynsteer in the way: the prompt logprobs of a vLLM
float32 engine (run it with DYNSTEER_DISABLE=1 for vLLM alone, without for dynsteer's default engine) against a
float32 transformers forward of the same tiny checkpoint.

    python3 scripts/family_vs_hf.py ARCH [ARCH ...]   -> one line per family: max |logprob difference|

GPU_UTIL sets the engine's share of GPU memory, EAGER=1 turns torch.compile and CUDA graphs off (quicker start).
"""

from __future__ import annotations

import os
import sys

import torch


def main(archs: list[str]) -> None:
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from dynsteer.testing.tiny_models import tiny_model

    prompt = "the quick brown fox jumps over the lazy dog once upon a time"
    for arch in archs:
        path = tiny_model(arch)
        llm = LLM(model=str(path), dtype="float32", max_model_len=128, max_num_seqs=2, seed=0,
                  gpu_memory_utilization=float(os.environ.get("GPU_UTIL", "0.2")),
                  enforce_eager=os.environ.get("EAGER") == "1")
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        ids = list(out.prompt_token_ids)
        got = [next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        want = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
        err = max(abs(a - b) for a, b in zip(got, want))
        print(f"FAMILY {arch} dynsteer={'off' if os.environ.get('DYNSTEER_DISABLE') else 'on'} "
              f"max|dlogprob|={err:.4f} over {len(want)} tokens", flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm


if __name__ == "__main__":
    main(sys.argv[1:])
