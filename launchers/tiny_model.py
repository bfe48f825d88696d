"""The tiny model profile's initial policy (``--model tiny`` of :mod:`launchers.recipe`):
``conf/model/tiny.yaml`` with random weights and a printable-ASCII character tokenizer,
written by ``python -m launchers.recipe init-tiny FOLDER SEED``."""

from __future__ import annotations

import json
from pathlib import Path


def write_tiny_tokenizer(tok_dir: Path) -> Path:
    """The tiny profile's printable-ASCII character tokenizer (``<pad> <bos> <eos>``, then
    ``string.printable``, one token a character) written to ``tok_dir``; returns it."""
    import string

    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from nemo_rlhf.tasks.precedence import SPECIAL_TOKENS

    tok_dir.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS.values())}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    hf = HFTokenizer(models.WordLevel(vocab))
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(list(SPECIAL_TOKENS.values()))
    hf.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "special_tokens.json").write_text(json.dumps(SPECIAL_TOKENS, indent=2) + "\n")
    return tok_dir


def write_tiny_model(folder: Path, seed: int) -> Path:
    """A random ``conf/model/tiny.yaml`` model with a printable-ASCII character tokenizer
    (:func:`write_tiny_tokenizer`): ``folder/checkpoints/step_0``."""
    from dataclasses import asdict

    from nemo_rlhf.checkpoint import save_checkpoint
    from nemo_rlhf.data.tokenizer import Tokenizer
    from nemo_rlhf.distributed import ParallelConfig, destroy_distributed, initialize_distributed
    from nemo_rlhf.distributed.launch_env import LaunchEnv
    from nemo_rlhf.models.actor_critic import build_model
    from nemo_rlhf.models.config import load_model_preset

    tok_dir = write_tiny_tokenizer(folder / "tokenizer")
    cfg = load_model_preset("tiny", vocab_size=Tokenizer(tok_dir).vocab_size)
    config = {"model": asdict(cfg), "trainer": {"precision": "32", "seed": seed},
              "data": {"tokenizer_dir": str(tok_dir)}}
    env = LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                    launcher="single")
    dims = initialize_distributed(ParallelConfig(), seed=seed, launch_env=env)
    try:
        model = build_model(cfg, dims, "32", seed=seed)
        return save_checkpoint(folder / "checkpoints", 0, model, None, {"step": 0}, config, dims)
    finally:
        destroy_distributed()
