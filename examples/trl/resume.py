"""Resuming: a run of ``--max-steps`` steps, then a second trainer on the same ``output_dir`` with more steps that
continues from its newest checkpoint (``trainer.train(resume_from_checkpoint=True)``).
"""

from task import arguments, last_letter, last_letter_dataset

from grpolab.trl import GRPOConfig, GRPOTrainer

cli = arguments(__doc__)
dataset = last_letter_dataset(plain=cli.plain)


def config(max_steps: int) -> GRPOConfig:
    return GRPOConfig(
        output_dir=cli.output_dir,
        max_steps=max_steps,
        save_steps=cli.max_steps,  # a checkpoint where the first run stops
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        use_cpu=cli.use_cpu,
    )


first = GRPOTrainer(model=cli.model, reward_funcs=last_letter, args=config(cli.max_steps), train_dataset=dataset)
first.train()

second = GRPOTrainer(model=cli.model, reward_funcs=last_letter, args=config(2 * cli.max_steps), train_dataset=dataset)
second.train(resume_from_checkpoint=True)
print(f"resumed at step {cli.max_steps}, stopped at step {second.state.global_step}")
