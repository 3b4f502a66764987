"""TRL's documented environment example, verbatim from TRL's GRPOTrainer documentation ("Agent Training" ->
"Environments", huggingface/trl docs/source/grpo_trainer.md, Apache-2.0), less its training lines: grpolab runs it
as it is.

    grpolab train --model smollm2-135m-instruct --env examples/trl_env/increment.py:IncrementEnv --steps 2

It samples its own task in reset (no --data); with a dataset whose rows carry a ``target`` column, use
``IncrementTargetEnv`` below (TRL's "Providing an external dataset" variant).
"""

import random


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
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


class IncrementTargetEnv(IncrementEnv):
    """TRL's dataset-backed variant ("Providing an external dataset"): the row's ``target`` column reaches ``reset``;
    its prompt is the row's (examples/trl_env/targets.jsonl)."""

    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target
