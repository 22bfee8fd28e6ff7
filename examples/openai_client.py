"""Steering through ``dynsteer serve`` with the official ``openai`` client.

Start a server (any vLLM serve options work; the API key guards the steering endpoints too):

    dynsteer serve MODEL --api-key secret --additional-config '{"dynsteer": {"max_gates": 2}}'

then:

    python examples/openai_client.py --base-url http://127.0.0.1:8000 --api-key secret

Per-request steering rides in ``extra_body={"vllm_xargs": {"dynsteer": <packed payload>}}``; named vectors and the
global policy are set over ``/v1/steering/...``.
"""

from __future__ import annotations

import argparse

import httpx
import numpy as np
import openai

import dynsteer
from dynsteer import Action, AddVector, DynamicSteeringPolicy, ProbeGate, Rule, SteeringSpec
from dynsteer.vectors import pack_vector


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="EMPTY")
    ap.add_argument("--prompt", default="Tell me about your day.")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key)
    steering = httpx.Client(base_url=f"{args.base_url}/v1/steering", timeout=60,
                            headers={"Authorization": f"Bearer {args.api_key}"})
    model = client.models.list().data[0].id
    caps = steering.get("/capabilities").raise_for_status().json()
    hidden, layer = caps["hidden_size"], caps["num_layers"] // 2
    print(f"{model}: {caps['num_layers']} layers, hidden {hidden}, sites {caps['sites']}")

    def complete(payload: str | None = None) -> str:
        extra = None if payload is None else {"vllm_xargs": {"dynsteer": payload}}
        out = client.completions.create(model=model, prompt=args.prompt, max_tokens=args.max_tokens, temperature=0,
                                        extra_body=extra)
        return out.choices[0].text.strip()

    # a named vector (here random; normally a contrastive direction or one loaded with dynsteer.load_vector)
    vector = (np.random.default_rng(0).standard_normal(hidden) * 8).astype(np.float32)
    steering.post("/vectors", json={"name": "demo", "vector": pack_vector(vector)}).raise_for_status()
    print("vectors:", [v["name"] for v in steering.get("/vectors").json()["vectors"]])

    print("unsteered :", complete())
    spec = SteeringSpec(vectors=[AddVector(layer=layer, vector="demo", scale=1.0)])
    print("steered   :", complete(dynsteer.encode_payload(spec)))

    # a dynamic policy: a monitor's gate (here always open) switches the vector on for generated tokens
    direction = np.eye(hidden, dtype=np.float32)[0]
    policy = DynamicSteeringPolicy(
        monitors=[ProbeGate(name="m", layer=layer, direction=direction, sharpness=4.0, threshold=-1e3)],
        rules=[Rule(monitor="m", actions=[Action(kind="add", layer=layer, vector="demo")])])
    if caps["dynamic"]:
        print("policy    :", complete(dynsteer.encode_payload(policy=policy)))
        # the same policy for every request without its own, then cleared
        steering.put("/policy", json={"policy": policy.model_dump(mode="json", exclude_none=True)}).raise_for_status()
        print("global    :", complete())
        steering.delete("/policy").raise_for_status()
    print("cleared   :", complete())

    bad = steering.post("/vectors", json={"name": "short", "vector": [1.0, 2.0]})
    print(f"a bad vector: HTTP {bad.status_code}: {bad.json()['error']['message']}")
    steering.delete("/vectors/demo").raise_for_status()


if __name__ == "__main__":
    main()
