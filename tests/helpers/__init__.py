"""What the tests share, by concern; test files import from these modules, never from each other.

- ``paths``: the repository, tests/ and its data files.
- ``cli``: ``grpolab ARGS`` in this process or a subprocess, and commands on one torchrun launch.
- ``runs``: configs and runs in the tests' small shape, the multi-process comparisons' flags, comparing runs.
- ``models``: small random models of each layout, a model with a seeded batch, a reward model.
- ``vlm``: tiny random vision-language models and pictures.
- ``engines``: a scripted rollout engine.
- ``processes``: waits with a deadline, free ports, generator workers, two gloo ranks spawned.
- ``hub``: a Hugging Face Hub cache laid out offline.
- ``pages``: the token view's HTML cards and the names a docs page lists.
- ``marks``: the sandbox's bubblewrap, a test run as each kind of CPU.
- ``trl_scoring``: TRL's trainer scoring in float64.
"""
