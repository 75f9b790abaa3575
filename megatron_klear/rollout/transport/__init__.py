"""Weight transport: trainer weights into rollout servers (update group, tensor handles, probe)."""
