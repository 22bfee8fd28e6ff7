"""A safety monitor service in ~25 lines: watch a stream with a probe file, steer or abort flagged requests.

Run an engine with a monitor channel, e.g. ``DynsteerConfig(capture_sites=("post_block",), capture_layers=(12,),
monitor=MonitorConfig.private(streams={"resid": StreamSpec(places=("12.post_block",))}))``, then:

    python examples/safety_monitor.py probe.safetensors STREAM_ENDPOINT COMMAND_ENDPOINT [--steer VECTOR_NAME]

It waits for the engine's first frame, prints its counts every 10 s while frames come, stops after 30 s without one
(``--idle``) or at Ctrl-C, and prints a summary: frames, commands, and the requests it aborted or steered, by the
ids vLLM's outputs show.
"""

import argparse

from dynsteer.monitor.client import MonitorClient
from dynsteer.monitor.probe_monitor import ProbeMonitorStats, run_probe_monitor
from dynsteer.probefile import load_probe
from dynsteer.spec import AddVector, SteeringSpec

ap = argparse.ArgumentParser(description="steer or abort the requests a probe flags")
for name in ("probe", "stream_endpoint", "command_endpoint"):
    ap.add_argument(name)
ap.add_argument("--steer", metavar="VECTOR_NAME", help="steer flagged requests away along this registered vector")
ap.add_argument("--idle", type=float, default=30.0, help="stop after this many seconds without a frame")
args = ap.parse_args()

probe = load_probe(args.probe)
spec = SteeringSpec(vectors=[AddVector(layer=probe.layer, site=probe.site, vector=args.steer, scale=-1.0,
                                       tier="decode")]) if args.steer else None
stats = ProbeMonitorStats()
try:
    with MonitorClient(args.stream_endpoint, args.command_endpoint, name="safety", streams=["resid"],
                       policy="drop") as monitor:
        print("safety monitor: subscribed; waiting for the engine's first frame", flush=True)
        run_probe_monitor(monitor, probe, action="steer" if args.steer else "abort", steer_spec=spec,
                          timeout_s=args.idle, probe_name="safety-probe", stats=stats,
                          on_progress=lambda s: print(f"safety monitor: {s.frames} frames, {s.commands} commands",
                                                      flush=True))
except KeyboardInterrupt:
    pass
print(stats.summary())
