"""The worker's composition root: what a model's :class:`~dynsteer.steering.runtime.SteeringRuntime` is made of.

The first decoder layer :mod:`dynsteer.engine.adapters` hooks in a process asks :func:`runtime_for_current_model`
for the runtime of the model vLLM is building; it is built here from the engine's :class:`~dynsteer.config.
DynsteerConfig`: the model's shape (:func:`shape_from_vllm_config`, which frontend admission reads too), the
steering tables, registered probes and controllers, the capture store and consumers (per pipeline stage), the
async tier's stream hub (TP rank 0 of each stage) and the named vectors. Loading the operator's probe and vector
files (:func:`load_probes`, :func:`load_named_vector`) is shared with the frontend and the engine core, which
validate against the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dynsteer.capture.consumers import FilesystemConsumer, build_consumer, consumer_class
from dynsteer.capture.store import CaptureCollector
from dynsteer.config import DynsteerConfig
from dynsteer.controllers.registry import ControllerRegistry
from dynsteer.engine.combinations import check_combinations
from dynsteer.engine.families import absent_sites
from dynsteer.engine.keys import CONFIG_KEY
from dynsteer.engine.replicas import replica_count, replica_index
from dynsteer.policy import gate_param_problem
from dynsteer.spec import ModelShape, SteeringValidationError
from dynsteer.steering.runtime import SteeringRuntime
from dynsteer.steering.tables import SteeringTables
from dynsteer.vectors import load_vector


class UnsupportedArchitectureError(RuntimeError):
    """dynsteer has no adapter for the model's architecture."""


def shape_from_vllm_config(vllm_config: Any) -> ModelShape:
    """The model's shape and hooked places as every process sees them (frontend admission and workers alike)."""
    cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
    text = vllm_config.model_config.hf_config.get_text_config()
    num_layers = int(text.num_hidden_layers)
    layers = None if cfg.layers is None else tuple(l for l in cfg.layers if l < num_layers)
    architecture = (vllm_config.model_config.architectures or ["?"])[0]
    absent = absent_sites(architecture, text)  # e.g. post_attn of a parallel attention + MLP block
    return ModelShape(num_layers=num_layers, hidden_size=int(text.hidden_size),
                      model_id=str(vllm_config.model_config.model), architecture=architecture,
                      sites=tuple(s for s in cfg.sites if s not in absent), absent_sites=tuple(absent.items()),
                      layers=layers, max_clamps=cfg.max_clamps, max_gates=cfg.max_gates,
                      max_abs_value=cfg.limits.max_abs_value, max_dyn_scale=cfg.limits.max_dyn_scale,
                      max_clamp_strength=cfg.limits.max_clamp_strength)


# ---- runtime construction (first hooked layer of a model builds it) --------------------------------------------
_building: dict[int, SteeringRuntime] = {}


def runtime_for_current_model() -> SteeringRuntime:
    """The runtime of the model vLLM is building in this process (made by the first hooked layer, from the engine's
    config: tables, probes, controllers, capture store and consumers, stream hub, named vectors)."""
    from vllm.config import get_current_vllm_config

    vllm_config = get_current_vllm_config()
    key = id(vllm_config)
    rt = _building.get(key)
    if rt is None:
        _building.clear()  # a new model: runtimes of earlier models stay reachable from their own hooks
        cfg = DynsteerConfig.from_additional(vllm_config.additional_config)
        check_combinations(vllm_config, cfg)
        shape = shape_from_vllm_config(vllm_config)
        if not shape.sites:  # e.g. sites=("post_attn",) on a parallel attention + MLP block
            raise UnsupportedArchitectureError(
                f"dynsteer: DynsteerConfig.sites {list(cfg.sites)} names no site architecture "
                f"{shape.architecture!r} has: " + "; ".join(f"{s}: {r}" for s, r in shape.absent_sites))
        num_layers = shape.num_layers
        layers = tuple(range(num_layers)) if shape.layers is None else shape.layers
        sched = vllm_config.scheduler_config
        max_tokens = max(int(sched.max_num_batched_tokens),
                         int(getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", 0) or 0))
        tables = SteeringTables([(l, s) for l in layers for s in shape.sites], shape.hidden_size, cfg.max_rows,
                                cfg.max_clamps, max_tokens, max_gates=cfg.max_gates)
        rt = SteeringRuntime(shape, tables, cfg.limits, load_probes(cfg), ControllerRegistry(cfg.controllers),
                             # live and preempted sync-tier requests; none: every one in the host tier
                             sync_slots=4 * int(sched.max_num_seqs) + 8 if cfg.sync_tier == "device" else 0)
        rt.inline_forward = cfg.forward == "inline"
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
        rt.fuse_norms = cfg.forward == "fused" or (cfg.forward == "auto" and device == "cuda")
        if rt.dynamic is not None:  # where dynamic steering acted decides which generated blocks may be shared
            rt.dynamic.report_acts = bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))
        places = [p for p in cfg.capture_places(num_layers) if p[1] in shape.sites]
        if places:
            emit = _rank_and_size("tp")[0] == 0  # residuals are identical on every TP rank: one rank publishes
            pp_rank, pp_size = _rank_and_size("pp")
            start, end = _pp_layers(num_layers, pp_rank, pp_size)
            # Under pipeline parallelism each stage holds (and captures) its own layers; records of one request
            # from several stages are merged by the caller (Steerer.take_captures, CaptureReader).
            stages = {p: torch.zeros(max_tokens, shape.hidden_size, dtype=torch.get_default_dtype())
                      for p in places if start <= p[0] < end}
            consumers = ({name: build_consumer(name, _stage_options(opts, name, pp_rank, pp_size))
                          for name, opts in cfg.capture_consumers.items()} if emit else {})
            rt.attach_capture(CaptureCollector(stages, emit=emit, engine_places=set(places)), consumers)
            rt.consumer_names = frozenset(cfg.capture_consumers)
            if cfg.monitor is not None and emit:
                _attach_hub(rt, cfg, pp_rank, replica_index(vllm_config))
        for name, ref in cfg.vectors.items():
            rt.register_vector(name, load_named_vector(ref, shape.hidden_size))
        _building[key] = rt
    return rt


def stage_endpoint(endpoint: str, pp_rank: int) -> str:
    """Where pipeline stage ``pp_rank > 0`` publishes: ``<ipc path>.pp<k>``, or the tcp port plus ``k``."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + pp_rank}"
    return f"{endpoint}.pp{pp_rank}"


def hub_endpoints(vllm_config: Any) -> list[str]:
    """Every pipeline stage's stream endpoint of every data-parallel replica, for a process that asks the hubs for
    their stats (a frontend).

    Raises:
        SteeringValidationError: the engine has no ``MonitorConfig`` (``monitor``), or its hubs require CURVE
            (``monitor.curve``: only allowlisted monitor keys may connect; a monitor asks with
            :meth:`StreamSubscriber.stats`).
    """
    mon = DynsteerConfig.from_additional(vllm_config.additional_config).monitor
    if mon is None:
        raise SteeringValidationError("monitor: this engine has no stream hub (DynsteerConfig.monitor is not set)")
    if mon.curve is not None:
        raise SteeringValidationError("monitor.curve: the stream hub admits only allowlisted monitor keys; ask it "
                                      "from a monitor (StreamSubscriber.stats)")
    pp = int(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1) or 1)
    replicas = [mon.for_replica(r).endpoint for r in range(replica_count(vllm_config))]
    return [e for base in replicas for e in [base] + [stage_endpoint(base, k) for k in range(1, pp)]]


def _attach_hub(rt: SteeringRuntime, cfg: DynsteerConfig, pp_rank: int, replica: int) -> None:
    """TP rank 0 publishes the async tier's streams (each pipeline stage its own layers, at its own endpoint; each
    data-parallel replica at its own endpoints, naming itself in every frame's header)."""
    import weakref

    from dynsteer.streams.hub import StreamHub

    assert cfg.monitor is not None
    mon = cfg.monitor.for_replica(replica)
    endpoint = mon.endpoint if pp_rank == 0 else stage_endpoint(mon.endpoint, pp_rank)
    hub = StreamHub(endpoint, curve=mon.curve, replay_bytes=mon.replay_bytes, replay_messages=mon.replay_messages,
                    spill_dir=mon.spill_dir, spill_bytes=mon.spill_bytes, spill_total_bytes=mon.spill_total_bytes,
                    on_declare=rt.stream_validator(mon.allow_declare), allow_declare=mon.allow_declare,
                    max_declared_streams=mon.max_declared_streams, subscribers=mon.subscribers,
                    max_subscribers=mon.max_subscribers, subscriber_ttl_s=mon.subscriber_ttl_s,
                    block_subscribers=mon.block_subscribers, max_block_delay_ms=mon.max_block_delay_ms,
                    max_held_bytes=mon.max_held_bytes)
    rt.attach_hub(hub, mon.streams, header={"replica": replica})
    weakref.finalize(rt, hub.close)


def _rank_and_size(kind: str) -> tuple[int, int]:
    """This worker's (rank, world size) in vLLM's tensor- (``"tp"``) or pipeline-parallel (``"pp"``) group; (0, 1)
    where no distributed state exists (a model built outside an engine)."""
    try:
        from vllm.distributed import get_pp_group, get_tp_group

        group = get_tp_group() if kind == "tp" else get_pp_group()
        return group.rank_in_group, group.world_size
    except (AssertionError, ImportError, RuntimeError, AttributeError):
        return 0, 1


def _pp_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers ``[start, end)`` this pipeline stage builds (vLLM's own split)."""
    if pp_size == 1:
        return 0, num_layers
    from vllm.distributed.utils import get_pp_indices

    return get_pp_indices(num_layers, pp_rank, pp_size)


def _stage_options(opts: dict[str, Any], name: str, pp_rank: int, pp_size: int) -> dict[str, Any]:
    """Under pipeline parallelism a filesystem consumer writes under ``<root>/pp<rank>`` (stages publish the same
    tags concurrently; ``CaptureReader`` merges the stage directories)."""
    if pp_size == 1 or consumer_class(opts.get("kind", name)) is not FilesystemConsumer or "root" not in opts:
        return opts
    return {**opts, "root": str(Path(opts["root"]) / f"pp{pp_rank}")}


def load_probes(cfg: DynsteerConfig) -> dict[str, Any]:
    """The operator's registered probe files, loaded (a bad file fails start-up, naming its entry)."""
    from dynsteer.probefile.fileformat import load_probe  # scipy: when an engine starts, not when the plugin loads

    probes = {}
    for name, path in cfg.probes.items():
        try:
            probes[name] = load_probe(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable file: say which entry
            raise ValueError(f"{CONFIG_KEY}.probes[{name!r}]: cannot load probe file {path!r}: {exc}") from None
        for calibrated in (False, True):  # a request may use either centring: both must fit the float32 tables
            params = probes[name].gate_params(calibrated=calibrated)
            for what in ("sharpness", "threshold"):
                problem = gate_param_problem(what, float(getattr(params, what)))
                if problem is not None:
                    raise ValueError(f"{CONFIG_KEY}.probes[{name!r}]: probe file {path!r}: gate {what} {problem}")
    return probes


def load_named_vector(ref: str, hidden_size: int):
    """``path.safetensors[:layer]`` → one vector (a file with several layers needs the ``:layer`` suffix)."""
    path, _, layer = ref.rpartition(":") if ref.rsplit(":", 1)[-1].isdigit() else (ref, "", "")
    vectors, _meta = load_vector(path)
    if layer:
        return vectors[int(layer)]
    if len(vectors) != 1:
        raise ValueError(f"{ref}: file holds layers {sorted(vectors)}; name one as {path}:LAYER")
    return next(iter(vectors.values()))
