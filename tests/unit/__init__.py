"""Unit tier: tests that start no processes (the fast tier, pytest -m "not slow")."""
