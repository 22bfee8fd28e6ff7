"""What the stream hub (server side, :mod:`dynsteer.streams`) and the monitor client (:mod:`dynsteer.monitor`) share:
the async tier's wire format (:mod:`.wire`) and the endpoint checks and CURVE helpers for its sockets
(:mod:`.security`)."""
