"""The trainer's side of a rollout: the request contract, client, pipeline stages, tools."""
