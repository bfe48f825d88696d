"""Distributed checkpoints: atomic save, resume, resharding (see :mod:`.io`)."""

from nemo_rlhf.checkpoint.io import (
    TOKENIZER_SUBDIR,
    CheckpointError,
    checkpoint_content_hash,
    checkpoint_heads,
    checkpoint_tokenizer_dir,
    find_latest_checkpoint,
    is_complete,
    list_checkpoints,
    load_checkpoint,
    load_model_weights,
    read_metadata,
    read_trainer_state,
    refuse_adapter_checkpoint_as_lora_base,
    resolve_checkpoint,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)

__all__ = [
    "TOKENIZER_SUBDIR", "CheckpointError", "checkpoint_content_hash", "checkpoint_heads", "checkpoint_tokenizer_dir", "find_latest_checkpoint", "is_complete", "list_checkpoints",
    "load_checkpoint", "load_model_weights", "read_metadata",
    "read_trainer_state", "refuse_adapter_checkpoint_as_lora_base", "resolve_checkpoint", "save_checkpoint", "step_dir", "verify_checkpoint",
]
