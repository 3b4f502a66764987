"""Environments: ``environment_factory=IncrementEnv``, TRL's documented shape. Each rollout gets its own instance;
``reset`` starts an episode and returns the text added to the prompt, the public methods are the tools, and
``get_reward`` scores the finished episode (TRL 1.16: the environment owns the reward, no ``reward_funcs``).
"""

import random

from datasets import Dataset
from task import arguments

from grpolab.trl import GRPOConfig, GRPOTrainer


class IncrementEnv:
    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:  # the environment scores itself: no reward_funcs needed
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


cli = arguments(__doc__)
prompt = "Use the increment tool." if cli.plain else [{"role": "user", "content": "Use the increment tool."}]
dataset = Dataset.from_dict({"prompt": [prompt] * 64})

training_args = GRPOConfig(
    output_dir=cli.output_dir,
    max_steps=cli.max_steps,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=32,
    use_cpu=cli.use_cpu,
)
trainer = GRPOTrainer(
    model=cli.model,
    args=training_args,
    train_dataset=dataset,
    environment_factory=IncrementEnv,
)
trainer.train()
