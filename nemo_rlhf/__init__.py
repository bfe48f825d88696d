"""nemo_rlhf: PPO-RLHF on megatron-core (actor + critic on one backbone, offloaded
reference, served reward model), tensor-, pipeline- and data-parallel.

Layers, top to bottom (:data:`LAYERS`). A module imports only from its own package and
from packages of the layers below its own; packages of one layer do not import each
other; nothing imports upwards and there are no import cycles. Imports of ``nemo_rlhf``
modules sit at the top of the file. ``tests/unit/project/test_layers.py`` checks all of it.

==================  =====================================================================
entry points        ``train_ppo``, ``rollout_worker``, ``train_sft``, ``train_rm``,
                    ``serve_rm``, ``evaluate`` (Hydra jobs) and ``tools``
                    (``nemo-rlhf-ckpt``, HF conversion, model set-up)
tasks               the demo tasks (each task's data and checker in one module); configs
                    name a checker by ``module:function`` or a short name of
                    ``reward.functions.BUILTIN_REWARD_FUNCTIONS`` (nothing registers at import)
trainers            the loops: SFT, RM and PPO, their configs, optimizers, run skeleton
rollout, reward     engines and services the trainers compose: generation; reward
                    functions, RM scoring, the RM server and its client
envs                environments of multi-turn rollouts: the interface, tools, tool-call
                    parsing (below the engines, which will drive them)
checkpoint, data    distributed checkpoints and resume; datasets, tokenizer, templates
models              GPT + heads, model plumbing (DDP, forward/backward through megatron's
                    schedules, masks), log-probs, KV-cache decode layers
foundations         ``algorithms`` (pure PPO math), ``distributed`` (process groups,
                    device), ``metrics`` (sinks, FLOPs)
config plumbing     ``config`` (schema plumbing: ``to_typed``, ``check_choice``, renamed
                    keys), below the foundations so that their schemas check closed
                    choices through it
==================  =====================================================================

Outside the package and above it: ``launchers/`` (local and SLURM), ``benchmarks/``,
``tests/``; the package never imports them.
"""

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry points", ("train_ppo", "rollout_worker", "train_sft", "train_rm", "serve_rm", "evaluate", "tools")),
    ("tasks", ("tasks",)),
    ("trainers", ("trainers",)),
    ("engines and services", ("rollout", "reward")),
    ("environments", ("envs",)),
    ("state and data", ("checkpoint", "data")),
    ("models", ("models",)),
    ("foundations", ("algorithms", "distributed", "metrics")),
    ("config plumbing", ("config",)),
)
"""``(layer, top-level names under nemo_rlhf)``, top to bottom."""
