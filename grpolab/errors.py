"""The error of a bad option or object, in its own module so that anything (the config, the loaders) can raise it
without importing the config. ``grpolab.config.ConfigError`` and ``grpolab.ConfigError`` are this class."""


class ConfigError(ValueError):
    """An invalid configuration; the message names the field."""
