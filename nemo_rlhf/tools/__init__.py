"""Offline tools: ``nemo-rlhf-ckpt`` (:mod:`.ckpt`, one module per command), the Hugging
Face mapping (:mod:`.hf_convert`), the SmolLM2 set-up (:mod:`.real_model`) and the
metrics plot of a run (:mod:`.plot_metrics`)."""
