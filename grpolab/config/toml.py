"""``--config FILE.toml``: a command's options from a file, which the command line then overrides.

Keys are option names (``group_size = 8``), whatever section holds the option; a section's options may also sit
in a table named after it (``[groups]`` then ``group_size = 8``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from grpolab.common.errors import ConfigError
from grpolab.config import fields


def load_toml(path: str | Path, cls=None, base=None):
    """A ``cls`` config (default: :class:`grpolab.config.train.TrainConfig`) from a TOML file whose keys are option
    names, over ``base`` (default: the defaults)."""
    if cls is None:
        from grpolab.config.train import TrainConfig

        cls = TrainConfig
    return fields.from_flat(cls, read_toml(path, cls), base=base)


def read_toml(path: str | Path, cls) -> dict:
    """The options (flat names, checked against ``cls``) a TOML file sets."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: invalid TOML ({e})") from None
    options = fields.options(cls)
    flat: dict = {}
    for key, value in raw.items():
        tables = fields.sections(cls)
        if isinstance(value, dict) and key in tables:  # [section] table
            flat.update(value)
        else:
            flat[key] = value
    unknown = sorted(set(flat) - set(options))
    if unknown:
        raise ConfigError(f"--config {path}: unknown field(s) {unknown}")
    # one value for a tuple field (reward_fn = "mod:fn"): a tuple of one
    return {
        k: (v,) if isinstance(options[k].field.default, tuple) and isinstance(v, str | int | float) else v
        for k, v in flat.items()
    }
