"""Configuration: every command's options as typed dataclasses, the checks on them, and config files."""

from grpolab.common.errors import ConfigError
from grpolab.config.train import TrainConfig

__all__ = ["ConfigError", "TrainConfig"]
