"""The async tier's ZeroMQ transport, server side: a hub that publishes captured activations to monitor processes."""
