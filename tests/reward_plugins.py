"""A user reward loaded by import path in test_reward_registry.py."""


def length_reward(response: str, label: int) -> float:
    """1.0 when the response has exactly ``label`` characters."""
    return 1.0 if len(response) == label else 0.0


def crashing_reward(response: str, label: object) -> float:
    """Raises on every call: score_batch must turn that into 0.0."""
    raise RuntimeError("boom")


def parity_reward(response: str, label: str) -> float:
    """1.0 for an even-length response, except prompts labelled "never" (always 0: a
    zero-advantage group that dynamic sampling must drop)."""
    return 0.0 if label == "never" else float(len(response) % 2 == 0)
