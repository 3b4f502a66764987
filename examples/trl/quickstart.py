"""TRL's GRPO quickstart: one reward function, a GRPOConfig that sets only the run's length and size.

SmolLM2 learns the last letter of a made-up word (task.py). Runs on grpolab as written; on TRL with the import line
changed to ``from trl import GRPOConfig, GRPOTrainer`` (README.md).
"""

from task import arguments, last_letter, last_letter_dataset

from grpolab.trl import GRPOConfig, GRPOTrainer

cli = arguments(__doc__)
dataset = last_letter_dataset(plain=cli.plain)

training_args = GRPOConfig(
    output_dir=cli.output_dir,
    max_steps=cli.max_steps,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    use_cpu=cli.use_cpu,
)
trainer = GRPOTrainer(
    model=cli.model,
    reward_funcs=last_letter,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
