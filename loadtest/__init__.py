"""Benchmarks and load tests; run each as `python -m loadtest.<name>` from the repository root."""
