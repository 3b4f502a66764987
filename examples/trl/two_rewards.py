"""Two reward functions, weighted by ``reward_weights``: the right letter counts 1.0, a short reply 0.5.

Each function's mean is logged under its own name (``rewards/last_letter/mean``, ``rewards/short/mean``), their
weighted sum is the reward the advantages are computed from.
"""

from task import arguments, last_letter, last_letter_dataset, short

from grpolab.trl import GRPOConfig, GRPOTrainer

cli = arguments(__doc__)
dataset = last_letter_dataset(plain=cli.plain)

training_args = GRPOConfig(
    output_dir=cli.output_dir,
    max_steps=cli.max_steps,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    reward_weights=[1.0, 0.5],
    use_cpu=cli.use_cpu,
)
trainer = GRPOTrainer(
    model=cli.model,
    reward_funcs=[last_letter, short],
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
