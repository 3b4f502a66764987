"""grpolab: GRPO done right, and a look at what its gradient is doing.

From Python (objects in, a run out; :mod:`grpolab.commands.api`)::

    import grpolab

    run = grpolab.train(model="builtin", steps=20, out="runs/x")
    print(run.evaluations[-1]["eval/accuracy_greedy"])
    report = grpolab.evaluate(model=run.dir)

From the shell: ``grpolab train --help``.
"""

__version__ = "0.1.0"

__all__ = [
    "Run",
    "train",
    "evaluate",
    "diagnose",
    "rank",
    "mse",
    "groupsize",
    "multiturn_bias",
    "ConfigError",
    "TrainConfig",
]


def __getattr__(name: str):
    # Imported on first use: `import grpolab` (and the CLI, which sets OpenMP's environment before torch loads)
    # does not pull in torch and transformers.
    if name in ("Run", "train", "evaluate", "diagnose", "rank", "mse", "groupsize", "multiturn_bias"):
        from grpolab.commands import api

        return getattr(api, name)
    if name in ("ConfigError", "TrainConfig"):
        from grpolab import config

        return getattr(config, name)
    raise AttributeError(f"module 'grpolab' has no attribute {name!r}")
