"""Offline tools: ``nemo-rlhf-ckpt`` (:mod:`.ckpt_cli`) and the Hugging Face mapping
(:mod:`.hf_convert`)."""
