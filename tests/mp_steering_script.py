"""Run by tests/test_engine_modes.py in a fresh interpreter: vLLM's default multi-process engine, where the plugin
(not any monkeypatch of this process) must wire dynsteer into the spawned engine-core/worker process."""

import json
import os
import sys

import numpy as np


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from vllm import LLM, SamplingParams

    import dynsteer

    llm = LLM(model=sys.argv[1], **json.loads(sys.argv[2]))
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    prompts = ["the quick brown fox", "once upon a time there was"]
    ids = lambda outs: [list(o.outputs[0].token_ids) for o in outs]  # noqa: E731
    st = dynsteer.attach(llm)
    v = (np.random.default_rng(0).standard_normal(st.hidden_size) * 8).astype(np.float32)
    base = ids(llm.generate(prompts, sp))
    st.set_layer_vector(1, v)
    steered = ids(llm.generate(prompts, sp))
    st.clear_all()
    restored = ids(llm.generate(prompts, sp))
    st.register_vector("v", v)
    spec = dynsteer.SteeringSpec(vectors=[dynsteer.AddVector(layer=1, vector="v")])
    per_request = ids(st.generate(prompts, sp, steering=[spec, None]))
    bad = ""
    try:
        st.generate(prompts[:1], sp, steering=dynsteer.SteeringSpec(vectors=[dynsteer.AddVector(layer=99, vector=v)]))
    except ValueError as exc:
        bad = str(exc)
    # dynamic policies: a gate that is always open at the same place equals static decode-tier steering
    mon = dynsteer.ProbeGate(name="m", layer=1, direction=np.eye(st.hidden_size)[0], sharpness=1.0, threshold=-1e9)
    act = dynsteer.Action(kind="add", layer=1, vector=v)
    latch = dynsteer.SyncControllerSpec(kind="latch", on=-1e9, off=-1e9, scale=1.0)
    pol = dynsteer.DynamicSteeringPolicy(monitors=[mon], rules=[dynsteer.Rule(monitor="m", actions=[act])])
    pol_sync = pol.model_copy(update={"controller": latch})
    decode_only = ids(st.generate(prompts, sp, steering=dynsteer.SteeringSpec(
        vectors=[dynsteer.AddVector(layer=1, vector=v, tier="decode")])))
    dyn = st.generate(prompts, sp, policy=[pol, None])
    dyn_sync = st.generate(prompts, sp, policy=[pol_sync, pol])
    st.set_policy(pol)
    dyn_global = ids(llm.generate(prompts, sp))
    st.clear_policy()
    print("RESULT " + json.dumps({"base": base, "steered": steered, "restored": restored,
                                  "per_request": per_request, "bad": bad, "pid": os.getpid(),
                                  "describe": st.describe()[0]["stats"], "decode_only": decode_only,
                                  "dyn": ids(dyn), "dyn_traces": [o.trace and o.trace.applied for o in dyn],
                                  "dyn_sync": ids(dyn_sync), "sync_scale": dyn_sync[0].trace.scale,
                                  "dyn_global": dyn_global, "after": ids(llm.generate(prompts, sp))}), flush=True)


if __name__ == "__main__":
    main()
