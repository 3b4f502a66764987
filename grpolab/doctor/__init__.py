"""Why is a run not learning? The doctor reads a run's metric rows through the instruments and names each condition
it finds, with its evidence and one change to make.

- :mod:`grpolab.doctor.rows`: a finding, the run's options the checks read, the rows over a window of steps;
- the checks, one pure function per condition, each threshold a named constant with the reason for its value:
  :mod:`~grpolab.doctor.signal` (the reward's signal: no_signal, truncation, judge_failures, reward_blind, saturation),
  :mod:`~grpolab.doctor.optimisation` (the update: no_movement, big_step, entropy, sampler_mismatch),
  :mod:`~grpolab.doctor.task` (the reward against the task: reward_hacking, eval_drop);
- :mod:`grpolab.doctor.conditions`: every check in order, causes before what they explain; ``diagnose``;
- :mod:`grpolab.doctor.examine`: a run directory read and checked at every check step, with examples from the run's
  own samples; the text and JSON views; the watcher a training run calls every ``--doctor-every`` steps.
"""
