"""Distributed checkpoints: atomic save, resume, resharding (:mod:`.io`); the folder layout,
and finding and reading a checkpoint (:mod:`.layout`)."""

from nemo_rlhf.checkpoint.io import (
    checkpoint_heads,
    load_checkpoint,
    load_model_weights,
    refuse_adapter_checkpoint_as_lora_base,
    save_checkpoint,
)
from nemo_rlhf.checkpoint.layout import (
    TOKENIZER_SUBDIR,
    CheckpointError,
    checkpoint_content_hash,
    checkpoint_tokenizer_dir,
    find_latest_checkpoint,
    is_complete,
    list_checkpoints,
    read_metadata,
    read_trainer_state,
    resolve_checkpoint,
    step_dir,
    verify_checkpoint,
)

__all__ = [
    "TOKENIZER_SUBDIR", "CheckpointError", "checkpoint_content_hash", "checkpoint_heads", "checkpoint_tokenizer_dir", "find_latest_checkpoint", "is_complete", "list_checkpoints",
    "load_checkpoint", "load_model_weights", "read_metadata",
    "read_trainer_state", "refuse_adapter_checkpoint_as_lora_base", "resolve_checkpoint", "save_checkpoint", "step_dir", "verify_checkpoint",
]
