"""The stages of ``benchmarks/bench_acceptance.py``, each run in the environment it needs."""
