"""Monitor processes' side of the async tier: the stream subscriber and the command client (the wire format they
share with the hub is :mod:`dynsteer.transport.wire`)."""
