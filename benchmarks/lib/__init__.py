"""The benchmarks' shared library (``benchmarks/`` is on ``sys.path`` when a script runs, so ``import lib``).

* :mod:`lib.engines`: engines in worker processes side by side (the engine farm), their start-up, pinning and CPU
  accounting, the Llama-3-8B shape they run, hotwire-vllm's install.
* :mod:`lib.serve`: a ``dynsteer serve`` of the tiny Llama on a free loopback port (the HTTP benchmarks).
* :mod:`lib.stream_reader`: a monitor in the benchmark's process reading every frame of a stream, counting them.
* :mod:`lib.stats`: quantiles, paired ratios over aligned repeats, paired differences.
* :mod:`lib.report`: the JSON report's name and write, table heads, the host and commit a report records.
* :mod:`lib.graphs`: CUDA-graph capture and replay timing, per-kernel times of a graph (the kernel benchmarks).
* :mod:`lib.traces`: torch-profiler chrome traces: reading them, per-step summaries.
* :mod:`lib.overhead`: ``overhead.py``'s own modes, workloads, run and report.
"""
