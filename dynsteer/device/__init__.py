"""Device-side plumbing shared by the steering worker and capture: pinned staging and read-back rings for the
per-step host<->device copies, and kernel launches replayed from CUDA graphs. Knows nothing of requests or policies."""
