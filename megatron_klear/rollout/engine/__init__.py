"""The embedded rollout engine: an SGLang-API server that decodes Qwen3 on CPU (or one GPU)."""
