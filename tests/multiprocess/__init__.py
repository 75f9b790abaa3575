"""Multiprocess tier: files whose tests (most or all) start processes: gloo ranks, trainers,
converters, eval CLIs, embedded servers (marked ``multiprocess`` by tests/conftest.py)."""
