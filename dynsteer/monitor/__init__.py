"""Monitor processes' side of the async tier: the wire format shared with the hub, and the subscriber client."""
