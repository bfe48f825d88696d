"""The demo tasks: each task's data generator and its checker in one module, outside the
library (nothing below this layer imports it; the library's defaults name no task).

* :mod:`~nemo_rlhf.tasks.task`: the task interface the demo's recipe runs on
  (``python -m launchers.demo --task package.module:TASK``; docs/tasks.md); addition and
  reversal are tasks of it (their ``TASK``);

* :mod:`~nemo_rlhf.tasks.reversal`: number reversal, the tiny demo's task
  (``launchers.demo --task tiny``, ``conf/*_tiny.yaml``);
* :mod:`~nemo_rlhf.tasks.addition`: two-digit addition asked in chat form, the SmolLM2
  demo's task (``conf/ppo_smollm2.yaml``);
* :mod:`~nemo_rlhf.tasks.precedence`: operator precedence (``3+3*6=``), the tests' fixture
  task, and the shared writers (character tokenizer, atomic JSONL) the others use.

Importing this package registers the tasks' checkers as reward functions
(:func:`~nemo_rlhf.reward.functions.register_reward_function`), so a config can name them:
``arithmetic_exact_match`` (the response starts with the row's integer ``answer``),
``two_digit_addition`` (a chat answer states the sum asked for) and ``just_the_number``
(the whole response is one integer). The entry points ``train_ppo`` and ``evaluate`` import
it; a library user who wants these names imports it too,
or names a checker as ``package.module:function``.
"""

from nemo_rlhf.reward.functions import register_reward_function
from nemo_rlhf.tasks.addition import just_the_number, two_digit_addition
from nemo_rlhf.tasks.precedence import arithmetic_exact_match

TASK_CHECKERS = {
    "arithmetic_exact_match": arithmetic_exact_match,
    "two_digit_addition": two_digit_addition,
    "just_the_number": just_the_number,
}
"""Registered name -> checker ``fn(prompts, responses, extras) -> list[float]``."""

for _name, _fn in TASK_CHECKERS.items():
    register_reward_function(_name)(_fn)

__all__ = ["TASK_CHECKERS"]
