"""TRL's on-policy distillation: DistillationConfig and DistillationTrainer, a student sampling its own completions
and trained towards a teacher's next-token distributions, on the quickstart's prompts.

``beta=1.0`` (TRL's default) is the reverse KL; 0.0 the forward KL; between them the JSD. Runs on grpolab as
written; on TRL with the import line changed to ``from trl import DistillationConfig, DistillationTrainer``
(README.md). ``--teacher DIR``: the teacher (default: the student itself, a divergence of 0). Prints the mean step
time of the run.
"""

import sys

from task import arguments, last_letter_dataset

from grpolab.trl import DistillationConfig, DistillationTrainer

teacher = sys.argv.pop(sys.argv.index("--teacher") + 1) if "--teacher" in sys.argv else None
sys.argv = [a for a in sys.argv if a != "--teacher"]
cli = arguments(__doc__)
dataset = last_letter_dataset(plain=cli.plain).select_columns(["prompt"])

training_args = DistillationConfig(
    output_dir=cli.output_dir,
    max_steps=cli.max_steps,
    per_device_train_batch_size=4,
    max_completion_length=8,
    beta=1.0,
    learning_rate=1e-5,
    logging_steps=1,
    use_cpu=cli.use_cpu,
)
trainer = DistillationTrainer(
    model=cli.model,
    teacher_model=teacher or cli.model,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
times = [e["step_time"] for e in trainer.state.log_history if "step_time" in e]
print(f"step_time: {sum(times) / len(times):.3f} s a step over {len(times)} steps")
