"""The names dynsteer's processes agree on: ``extra_args`` keys, attributes of vLLM's step objects, worker RPC methods,
prefix-cache key tags, and the attributes where dynsteer parks its state on vLLM's objects.

Everything here crosses a process boundary (frontend → engine core → workers and back, pickled or msgpack'd by
vLLM) or is read by another module than the one that writes it, so both ends import the name from this module;
each says who writes it and who reads it. Renaming one changes the protocol between dynsteer's own processes only
(they always run the same version): vLLM never reads these names.
"""

from __future__ import annotations

# additional_config["dynsteer"]: the user writes the engine config (dynsteer.config), every process reads it
from dynsteer.config import CONFIG_KEY  # noqa: F401
# extra_args["dynsteer"]: the user writes a request's payload (dynsteer.request.payload); admission and the workers read it
from dynsteer.request.payload import PAYLOAD_KEY  # noqa: F401

# ---- SamplingParams.extra_args (frontend → engine core → workers) ----------------------------------------------
ROWS_KEY = "dynsteer_rows"  # frontend admission writes "prefill,decode" row digests; the scheduler reads (rows wait)
DECODE_KEY = "dynsteer_decode_fp"  # admission writes the static decode fingerprint; the block hasher reads it
# the OpenAI server's request models write "steering" when the payload came from a request's top-level "steering"
# field (engine.json_steering); admission names that field in errors and drops the key (it never leaves the frontend)
SOURCE_KEY = "dynsteer_source"
DYNAMIC_KEY = "dynsteer_dynamic"  # admission writes when a dynamic policy steers decode; Request and scheduler read

# ---- SchedulerOutput (engine core → workers) --------------------------------------------------------------------
STEP_ATTR = "dynsteer_step"  # the scheduler writes its step number; runners read it (acks and stream frames name it)
COMMANDS_ATTR = "dynsteer_commands"  # the scheduler writes the commands the desk took; every worker applies them

# ---- ModelRunnerOutput (workers → engine core) ------------------------------------------------------------------
STOPS_ATTR = "dynsteer_stops"  # runners write {request id: reason} of requests stopped; the scheduler quarantines them
ABORTS_ATTR = "dynsteer_aborts"  # runners write {request id: reason} of fired abort rules; the scheduler finishes them
# runners write (request ids, upto, acted_at, signature) columns per read-back; the scheduler folds them into hashes
ACTS_ATTR = "dynsteer_acts"
# runners write {request id: report delta} (steering.dynamic.reports); the scheduler forwards them to the frontend
REPORTS_ATTR = "dynsteer_reports"

# ---- EngineCoreOutput (engine core → frontend) -------------------------------------------------------------------
# the scheduler nests a request's report values under this key of kv_transfer_params (beside what a KV connector put
# there); the frontend's OutputProcessor pops them before vLLM reads the params (engine.reports)
REPORT_PARAMS_KEY = "dynsteer_report"

# ---- block-hash extra keys and cache salts (frontend and engine core; must match across processes) ---------------
SALT_TAG = "dynsteer:"  # frontend admission and the engine core's re-salting prefix it to cache_salt fingerprints
ACTED_TAG = "dynsteer:acted:"  # the engine core's block hasher prefixes the fold of what acted

# ---- HTTP (dynsteer serve's API server; clients and the dev-route guard name it) ---------------------------------
HTTP_PREFIX = "/v1/steering"  # engine.server serves the steering routes under it; engine.dev_routes points there

# ---- worker RPC methods (collective_rpc: the user's process, the HTTP server and the engine core call them) ------
RPC_PREFIX = "dynsteer_"  # every dynsteer worker method; the engine core mirrors, the dev-route guard refuses them
RPC_DESCRIBE = "dynsteer_describe"
RPC_SET_GLOBAL = "dynsteer_set_global"
RPC_REGISTER_VECTOR = "dynsteer_register_vector"
RPC_UNREGISTER_VECTOR = "dynsteer_unregister_vector"
RPC_SET_CAPTURE = "dynsteer_set_capture"
RPC_TAKE_CAPTURES = "dynsteer_take_captures"
RPC_TAKE_TRACES = "dynsteer_take_traces"
# dynsteer doctor: {process: overrides} of a worker's process (PATCHES_WORKER), to which the engine core's patched
# collective_rpc adds its own process's (PATCHES_ENGINE_CORE)
RPC_PATCHES = "dynsteer_patches"
PATCHES_WORKER = "worker"
PATCHES_ENGINE_CORE = "engine core"

# ---- state parked on vLLM objects (one process; named here so the writer and every reader agree) -----------------
SCHEDULER_ATTR = "_dynsteer"  # on the Scheduler: engine.scheduler writes its SchedulerState; commands, tests read
ACTED_ATTR = "_dynsteer_acted"  # on a Request: prefix_cache / scheduler write its ActedState; the hasher reads it
BLOCK_SIZE_ATTR = "_dynsteer_block_size"  # on vLLM's request block hasher: prefix_cache caches its block size
FRONTEND_ATTR = "_dynsteer_frontend"  # on the InputProcessor: engine.frontend builds its FrontendState once
RUNTIME_ATTR = "_dynsteer_rt"  # on a model runner: engine.runner caches the model's SteeringRuntime (or None)
RUNNER_REQUESTS_ATTR = "_dynsteer_reqs"  # on a v2 runner: engine.runner records request id -> (payload, prompt len)
REPORT_STASH_ATTR = "_dynsteer_report"  # on a frontend RequestState: engine.reports keeps its report values there
# on a CompletionOutput: engine.reports writes the request's report (dynsteer.trace.report_json); serving reads it
REPORT_OUTPUT_ATTR = "dynsteer"
APP_STATE_ATTR = "dynsteer"  # on the FastAPI app.state: the endpoint plugin's engine client and API-key digests
# on a decoder layer: engine.adapters marks it hooked, and hangs the site hooks its patched forward runs
ATTACHED_ATTR = "_dynsteer_attached"
PRE_ATTN_HOOK = "dynsteer_pre_attn"
POST_BLOCK_HOOK = "dynsteer_post_block"
PREV_POST_BLOCK_HOOK = "dynsteer_prev_post_block"  # the previous layer's post_block, where this layer's norm cannot
POST_ATTN_HOOK = "dynsteer_post_attn"  # on the mid norm (a steered subclass): the post_attn hook
FUSED_FIRST_HOOK = "dynsteer_fused_first"  # on a fused add-norm: the sites it runs before normalising
FUSED_SECOND_HOOK = "dynsteer_fused_second"
NORM_BASE_ATTR = "_dynsteer_norm_base"  # on a steered norm subclass: vLLM's norm class it derives from
