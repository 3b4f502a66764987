"""grpolab: GRPO done right, and a look at what its gradient is doing."""

__version__ = "0.1.0"
