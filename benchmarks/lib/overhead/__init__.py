"""``overhead.py``'s own pieces: ``modes`` (the catalogue of modes, engines and targets), ``workload`` (the worker
side: one engine and its modes' calls), ``bench`` (the run: engines, warm-up and verification, timed repeats,
profiles, the report's JSON) and ``report`` (comparisons, tables, plot)."""
