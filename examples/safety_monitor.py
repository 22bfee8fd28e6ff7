"""A safety monitor service in ~20 lines: watch a stream with a probe file, steer or abort flagged requests.

Run an engine with a monitor channel, e.g. ``DynsteerConfig(capture_sites=("post_block",), capture_layers=(12,),
monitor=MonitorConfig.private(streams={"resid": StreamSpec(places=("12.post_block",))}))``, then:

    python examples/safety_monitor.py probe.safetensors STREAM_ENDPOINT COMMAND_ENDPOINT [--steer VECTOR_NAME]

It waits for the engine's first frame, stops after 30 s without one (or at Ctrl-C) and prints a summary: frames,
commands, and the requests it aborted or steered, by the ids vLLM's outputs show.
"""

import sys

from dynsteer.monitor.client import MonitorClient
from dynsteer.monitor.probe_monitor import ProbeMonitorStats, run_probe_monitor
from dynsteer.probefile import load_probe
from dynsteer.spec import AddVector, SteeringSpec

probe_file, stream_ep, command_ep = sys.argv[1:4]
steer = sys.argv[5] if len(sys.argv) > 5 and sys.argv[4] == "--steer" else None
probe = load_probe(probe_file)
spec = SteeringSpec(vectors=[AddVector(layer=probe.layer, vector=steer, scale=-1.0, tier="decode")]) if steer else None

stats = ProbeMonitorStats()
try:
    with MonitorClient(stream_ep, command_ep, name="safety", streams=["resid"], policy="drop") as monitor:
        run_probe_monitor(monitor, probe, action="steer" if steer else "abort", steer_spec=spec, timeout_s=30.0,
                          probe_name="safety-probe", stats=stats)
except KeyboardInterrupt:
    pass
print(stats.summary())
