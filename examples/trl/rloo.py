"""TRL's RLOO: RLOOConfig and RLOOTrainer, the leave-one-out baseline, on the quickstart's task.

``beta=0.0``: TRL's RLOO default (0.05) puts a KL penalty in the reward, which grpolab refuses
(docs/coming-from-trl.md). Runs on grpolab as written; on TRL with the import line changed to
``from trl import RLOOConfig, RLOOTrainer`` (README.md). Prints the mean step time of the run.
"""

from task import arguments, last_letter, last_letter_dataset

from grpolab.trl import RLOOConfig, RLOOTrainer

cli = arguments(__doc__)
dataset = last_letter_dataset(plain=cli.plain)

training_args = RLOOConfig(
    output_dir=cli.output_dir,
    max_steps=cli.max_steps,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    beta=0.0,
    logging_steps=1,
    use_cpu=cli.use_cpu,
)
trainer = RLOOTrainer(
    model=cli.model,
    reward_funcs=last_letter,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
times = [e["step_time"] for e in trainer.state.log_history if "step_time" in e]
print(f"step_time: {sum(times) / len(times):.3f} s a step over {len(times)} steps")
