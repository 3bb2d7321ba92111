"""Benchmark scripts of megatron_dynbatch; run each as a module from the repository root, e.g.
``.venv/bin/python -m benchmarks.bench_planner`` (see ``benchmarks/README.md``)."""
