"""The TRL script the drop-in benchmark runs twice: as written (TRL) and with its import line changed (grpolab).

The last-letter task on SmolLM2-135M-Instruct: what a user sets is set (the model, the data, the reward, a short
completion, a learning rate, 20 steps, the CPU); everything else is TRL's default (loss_type dapo, beta 0, bf16,
gradient checkpointing, a linear schedule, seed 42, 8 completions per device, ...).

    python script.py MODEL_DIR DATA.jsonl OUTPUT_DIR [SEED]
"""

import json
import sys

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer


def last_letter(prompts, completions, target, **kwargs):
    """1.0 when the reply's last standalone letter is the word's last letter."""
    import re

    out = []
    for completion, want in zip(completions, target):
        letters = re.findall(r"(?<![A-Za-z])([A-Za-z])(?![A-Za-z])", completion[-1]["content"])
        out.append(1.0 if letters and letters[-1].lower() == want else 0.0)
    return out


model, data, output_dir = sys.argv[1:4]
seed = int(sys.argv[4]) if len(sys.argv) > 4 else 42  # TRL's default
dataset = Dataset.from_list([json.loads(line) for line in open(data)])
args = GRPOConfig(
    output_dir=output_dir,
    per_device_train_batch_size=32,  # 4 prompts x 8 completions a step
    max_completion_length=16,
    learning_rate=1e-5,
    max_steps=20,
    logging_steps=1,
    save_strategy="no",
    use_cpu=True,
    seed=seed,
)
trainer = GRPOTrainer(model=model, reward_funcs=last_letter, args=args, train_dataset=dataset)
trainer.train()
trainer.save_model(output_dir + "/final")
