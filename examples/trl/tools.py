"""Tools: ``tools=[multiply]``, a typed Python function whose docstring describes it to the model. The model may
call it between turns; the reward reads the final reply.
"""

from task import arguments, correct, multiplication_dataset

from grpolab.trl import GRPOConfig, GRPOTrainer


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


cli = arguments(__doc__)
dataset = multiplication_dataset(plain=cli.plain)

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
    reward_funcs=correct,
    args=training_args,
    train_dataset=dataset,
    tools=[multiply],
)
trainer.train()
