"""Checkpoints: the HF <-> Megatron mapping (hf_bridge), training-state save/load (state)
and the HF <-> Megatron converters (convert)."""

from megatron_klear.checkpoint.state import (CheckpointError, CheckpointInfo,
                                             find_latest_checkpoint, load_checkpoint, read_meta,
                                             save_checkpoint)

__all__ = ["CheckpointError", "CheckpointInfo", "find_latest_checkpoint", "load_checkpoint",
           "read_meta", "save_checkpoint"]
