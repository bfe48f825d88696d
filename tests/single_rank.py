"""One-rank distributed state for tests that build megatron models in the pytest process."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def single_rank(seed: int = 0):
    """Initialise a world of one rank (no launcher), yield its ``ParallelDims``, tear down."""
    from nemo_rlhf.distributed import ParallelConfig, destroy_distributed, initialize_distributed
    from nemo_rlhf.distributed.launch_env import LaunchEnv

    env = LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0,
                    launcher="single")
    try:
        yield initialize_distributed(ParallelConfig(), seed=seed, launch_env=env)
    finally:
        destroy_distributed()


def random_prompts(lengths, vocab: int, seed: int = 5) -> list[list[int]]:
    """Seeded prompts of the given lengths (tokens), ids in ``[1, vocab)`` (0 is kept for padding)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
