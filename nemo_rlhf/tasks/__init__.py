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
  task, and the shared writers (character tokenizer, atomic JSONL) the others use; its
  ``TASK`` is the same task in the recipe's interface;
* :mod:`~nemo_rlhf.tasks.digit_sum`: the digit sum of a four-digit number, a task written
  from docs/tasks.md alone (issue 53's untuned tasks).

A config names a checker by its path (``nemo_rlhf.tasks.addition:two_digit_addition``) or
by one of the short names of the fixed table
:data:`nemo_rlhf.reward.functions.BUILTIN_REWARD_FUNCTIONS`: ``arithmetic_exact_match``
(the response starts with the row's integer ``answer``), ``two_digit_addition`` (a chat
answer states the sum asked for) and ``just_the_number`` (the whole response is one
integer). Importing this package registers nothing: the checker's module is imported when
the name is resolved.
"""
