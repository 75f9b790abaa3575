"""Rollout: orchestration (requests, pipeline, tools) <- weight transport <- embedded engine."""
