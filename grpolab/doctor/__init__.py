"""Why is a run not learning? The doctor reads a run's metric rows through the instruments and names each condition
it finds, with its evidence and one change to make.

- :mod:`grpolab.doctor.conditions`: one pure function per condition over the metric rows, each with its thresholds
  as named constants; :func:`~grpolab.doctor.conditions.diagnose` runs them all;
- :mod:`grpolab.doctor.examine`: a run directory (metrics, samples, rollouts, config) read and checked at every
  check step, with examples from the run's own samples; the text and JSON views; the watcher a training run calls
  every ``--doctor-every`` steps.
"""
