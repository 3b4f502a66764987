"""LoRA: ``peft_config=LoraConfig(...)`` trains low-rank adapters on every linear layer instead of the weights."""

from peft import LoraConfig
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
    learning_rate=1e-5,  # adapters take a larger step than full fine-tuning
    use_cpu=cli.use_cpu,
)
trainer = GRPOTrainer(
    model=cli.model,
    reward_funcs=last_letter,
    args=training_args,
    train_dataset=dataset,
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
)
trainer.train()
