#!/usr/bin/env bash
# Steer a `dynsteer serve` server with curl and JSON only (no Python client needed).
#
#   dynsteer serve MODEL --api-key "$KEY"
#   KEY=... examples/steer_with_curl.sh http://127.0.0.1:8000
#
# It registers a vector "joy" and a preset "joy" (PUT /v1/steering/presets/joy; a server's config can declare presets
# too: DynsteerConfig.presets), steers with them, and sets and clears a global spec. Every call prints its JSON reply.
# The vector is a placeholder and its scales show the mechanics; for a real vector, take the scale from
# `dynsteer dose recommend` (the strongest dose that keeps replies fluent; past it replies loop).
set -euo pipefail

URL="${1:?usage: $0 BASE_URL (e.g. http://127.0.0.1:8000); the API key in \$KEY if the server has one}"
AUTH=()
if [[ -n "${KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer ${KEY}"); fi

call() {  # METHOD PATH [JSON BODY]
  local method=$1 path=$2
  if [[ $# -ge 3 ]]; then
    curl -sS --fail-with-body -X "$method" "${AUTH[@]}" -H 'Content-Type: application/json' "$URL$path" -d "$3"
  else
    curl -sS --fail-with-body -X "$method" "${AUTH[@]}" "$URL$path"
  fi
  echo
}

MODEL=$(curl -sS "${AUTH[@]}" "$URL/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
HIDDEN=$(call GET /v1/steering/capabilities | python3 -c 'import json, sys; print(json.load(sys.stdin)["hidden_size"])')
# a vector as a JSON list of HIDDEN numbers (a real one comes from dynsteer's probes or your own analysis)
VECTOR=$(python3 -c "import json, math; print(json.dumps([round(math.sin(i), 4) for i in range($HIDDEN)]))")
PROMPT='"The weather today is"'

echo "== register the vector 'joy' from a list"
call POST /v1/steering/vectors "{\"name\": \"joy\", \"vector\": $VECTOR}"

echo "== unsteered"
call POST /v1/completions "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 16, \"temperature\": 0}"

echo "== one request steered by a top-level 'steering' object"
call POST /v1/completions "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 16, \"temperature\": 0,
  \"steering\": {\"spec\": {\"vectors\": [{\"layer\": 1, \"vector\": \"joy\", \"scale\": 8.0}]}}}"

echo "== a preset 'joy' ('\$scale' is its parameter), used with a scale override"
call PUT /v1/steering/presets/joy '{"spec": {"vectors": [{"layer": 1, "vector": "joy", "scale": "$scale"}]},
  "params": {"scale": {"default": 4.0, "min": 0, "max": 16}}}'
call POST /v1/completions "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 16, \"temperature\": 0,
  \"steering\": {\"preset\": \"joy\", \"params\": {\"scale\": 12}}}"

echo "== what a steering object resolves to, and its packed form"
call POST /v1/steering/validate '{"preset": "joy", "params": {"scale": 12}}'
call POST /v1/steering/encode '{"preset": "joy", "params": {"scale": 12}}'

echo "== a global spec steers every request; clearing it restores them"
call PUT /v1/steering/spec '{"spec": {"vectors": [{"layer": 1, "vector": "joy", "scale": 6.0}]}}'
call POST /v1/completions "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 16, \"temperature\": 0}"
call DELETE /v1/steering/spec
call POST /v1/completions "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 16, \"temperature\": 0}"

echo "== clean up"
call DELETE /v1/steering/presets/joy
call DELETE /v1/steering/vectors/joy
