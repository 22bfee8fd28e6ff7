"""A monitor service in its own process, for tests/test_async_tier.py: watches a stream, fires a command on the
first probe crossing, logs every frame it saw (JSON lines) to a file.

Usage: python monitor_script.py STREAM_EP COMMAND_EP PROBE.npy THRESHOLD steer|abort|none LOG [VECTOR.npy]
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from dynsteer.monitor.client import MonitorClient
from dynsteer.spec import AddVector, SteeringSpec


def main() -> None:
    stream_ep, command_ep, probe_file, threshold, action, log_file = sys.argv[1:7]
    probe, threshold = np.load(probe_file), float(threshold)
    vector = np.load(sys.argv[7]) if len(sys.argv) > 7 else None
    fired = False
    # MONITOR_RESUME: a restarted monitor's next sequence number; MONITOR_DELAY_S: seconds spent per frame
    resume = os.environ.get("MONITOR_RESUME")
    delay = float(os.environ.get("MONITOR_DELAY_S", "0"))
    name = os.environ.get("MONITOR_NAME", "probe-mon")
    with open(log_file, "w") as log, MonitorClient(stream_ep, command_ep, name=name,
                                                    streams=["resid"], policy="drop", max_pending=4096,
                                                    resume=None if resume is None else {"resid": int(resume)}) as mon:
        print("ready", flush=True)
        for frame in mon.frames(timeout_s=5.0):
            place = next(iter(frame.values))
            scores = frame.values[place] @ probe
            log.write(json.dumps({"step": frame.step, "seq": frame.seq, "req_ids": frame.req_ids,
                                  "request": frame.request.tolist(), "positions": frame.positions.tolist(),
                                  "scores": scores.tolist()}) + "\n")
            log.flush()
            time.sleep(delay)
            if fired or action == "none":
                continue
            hits = frame.requests_where(scores > threshold)
            if not hits:
                continue
            fired = True
            if action == "abort":
                ack = mon.abort(hits[0], reason="probe crossed")
            else:
                spec = SteeringSpec(vectors=[AddVector(layer=1, vector=vector, scale=1.0, tier="decode")])
                ack = mon.steer(hits[0], spec)
            log.write(json.dumps({"ack": ack.model_dump(), "request_id": hits[0], "at_seq": frame.seq}) + "\n")
            log.flush()


if __name__ == "__main__":
    main()
