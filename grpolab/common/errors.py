"""The error of a bad option or object, in its own module so that anything (the config, the loaders) can raise it
without importing the config. ``grpolab.config.train.ConfigError`` and ``grpolab.ConfigError`` are this class."""


class ConfigError(ValueError):
    """An invalid configuration; the message names the field, in one line::

    try:
        grpolab.train(group_size="eight")
    except grpolab.ConfigError as e:
        print(e)  # --group-size: expected an integer, got 'eight'
    """


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none intact could be found: the message says where and why.
    (Here, with no torch import, so that the command line can name it before it loads torch.)"""


class GeneratorError(RuntimeError):
    """The generator process (``--generator process``) died, hung past ``--generator-timeout`` or failed: the
    message says what it was doing and what happened to it."""


class RewardFunctionError(ConfigError):
    """A reward function broke its contract for a whole batch (it returned another number of rewards than
    completions): raised to stop the run in one line, not scored as one rollout's failure."""
