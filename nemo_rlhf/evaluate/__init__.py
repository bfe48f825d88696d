"""Held-out evaluation of actor checkpoints: greedy decoding + the task's checker, and
optionally a reward model's score and the KL to a reference policy.

One checkpoint (as before)::

    python -m nemo_rlhf.evaluate checkpoint=experiments/sft/checkpoints \\
        data=data/reversal/eval.jsonl out=experiments/sft/eval.json

Every step of a run, with the RM's score and the KL to the initial policy::

    python -m nemo_rlhf.evaluate checkpoint=exp/ppo/checkpoints all_steps=true \\
        reference=experiments/sft/checkpoints rm_checkpoint=experiments/rm/checkpoints \\
        data=data/reversal/eval.jsonl out=exp/ppo/eval_steps.json

``checkpoint`` is a checkpoint folder or a ``checkpoints`` root (its newest complete
checkpoint); with ``all_steps=true`` it must be a root and every complete ``step_<N>``
under it is evaluated, in step order. ``checkpoints=[a,b,...]`` names folders (or roots:
their newest) explicitly; with ``checkpoint`` too, both sets are evaluated (duplicates
once), sorted by step. The model architecture, the tokenizer and the prompt formatting
(chat template, system prompt) of each checkpoint are read from its ``config.yaml``, so
evaluation formats prompts exactly as training did. Prompts are split across DP ranks; any
TP/PP layout works (checkpoints are resharded on load). The checker is a reward function
(``package.module:function`` or a built-in short name, ``nemo_rlhf.reward.functions``) called with the raw prompts, the decoded
responses (EOS excluded) and the rows' extra fields (e.g. ``answer``).

Tool tasks (#51): with ``env.name`` (and the other ``env.*`` keys of the PPO config) each
prompt row is one episode with that environment, run by the PPO trainer's own episode path
(:func:`~nemo_rlhf.trainers.ppo.episode_source.run_episode_batch`: the KV cache kept across
turns, the observations tokenised alone and appended; ``max_new_tokens`` per policy turn),
and the checker scores each episode's final answer (its last policy turn), as PPO's reward
and held-out evaluation do. The result gains ``episode`` (``turns_mean``,
``tool_calls_mean``, ``tool_call_rate``, ``malformed_call_rate``), ``mean_response_length``
counts policy tokens, and each sample row (and example) gains ``episode`` (the text after
the prompt, the tool's output included), ``turns`` and ``messages`` (the conversation as
``{"role", "content"}`` messages, the prompt's user message first: what an RM's
conversation pairs are made of). With ``rm_checkpoint`` the RM reads each episode as PPO's
served RM does (``rm_input``: the whole conversation by default). Not with ``reference``
(refused).

One checkpoint writes one JSON: ``accuracy`` (mean checker score), ``mean_response_length``
(generated tokens, EOS included, as in ``RolloutBatch.response_lengths``), ``repetition``
(mean 3-gram repetition rate of the generated tokens, the PPO trainer's
``eval/repetition``), the fractions that ended with EOS or hit ``max_new_tokens``, counts,
timing and the first examples; with ``rm_checkpoint`` also ``rm_reward`` (mean raw RM
score), with ``reference`` also ``kl_to_reference`` (see :func:`sequence_kl`). More than one
checkpoint writes ``{"rows": [one such dict per checkpoint]}`` to ``out``, a markdown table
``<out without .json>.md`` and a PNG ``<out without .json>.png`` of each metric across
steps (:mod:`nemo_rlhf.metrics.steps_table`; needs matplotlib, checked before any work).

Raises (bad input, naming the config key): ``ValueError`` for bad values,
``FileNotFoundError`` for a checkpoint that is not there, ``ImportError`` without
matplotlib when more than one checkpoint is evaluated.

The parts: :mod:`~nemo_rlhf.evaluate.config` (:class:`EvalConfig`),
:mod:`~nemo_rlhf.evaluate.checkpoints` (which checkpoints, their configs, the reference and
the RM), :mod:`~nemo_rlhf.evaluate.measures` (repetition, KL to the reference, RM score),
:mod:`~nemo_rlhf.evaluate.job` (one checkpoint's result, the files), ``__main__`` (the
Hydra entry point).
"""

from nemo_rlhf.evaluate.checkpoints import checkpoint_paths
from nemo_rlhf.evaluate.config import EvalConfig, register_configs
from nemo_rlhf.evaluate.job import evaluate, evaluate_checkpoint, steps_report_paths
from nemo_rlhf.evaluate.measures import forward_response_logprobs, repetition_rates, rm_scores, sequence_kl

__all__ = ["EvalConfig", "checkpoint_paths", "evaluate", "evaluate_checkpoint", "forward_response_logprobs",
           "register_configs", "repetition_rates", "rm_scores", "sequence_kl", "steps_report_paths"]
