"""megatron-klear: RL post-training for reasoning LLMs on megatron-core (Klear-Reasoner recipe)."""

__version__ = "0.1.0"
