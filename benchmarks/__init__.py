"""Benchmarks: measurements, not tests (timings, learning at a budget, the comparison harness, the
long fault loop). Each file runs as `python benchmarks/NAME.py`; tests/ checks the statistics and the
harness logic they rely on (tests/test_bench_*.py, test_memory_model.py, test_yardstick.py)."""
