"""TRL's vision-language GRPO form: a conversational prompt with an ``image`` column, a processor as the model's
processing class, and a reward that reads the dataset's ``solution`` column.

grpolab's built-in vision-language model (a tiny LLaVA) counts coloured shapes in pictures (grpolab.data.shapes).
Runs on grpolab as written; on TRL with the import line changed to ``from trl import GRPOConfig, GRPOTrainer``.
"""

import argparse

from datasets import Dataset
from transformers import AutoModelForImageTextToText, AutoProcessor

from grpolab.data.shapes import draw
from grpolab.models.policy import VLM_ASSET_DIR
from grpolab.trl import GRPOConfig, GRPOTrainer

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--max-steps", type=int, default=20)
parser.add_argument("--output-dir", default="shapes-vlm-GRPO")
parser.add_argument("--use-cpu", action="store_true", help="GRPOConfig(use_cpu=True): TRL's bf16 needs a GPU")
parser.add_argument("--batch-size", type=int, default=8, help="completions per step (8 for each picture)")
cli = parser.parse_args()

rows = draw(seed=0, step=0, n=256)  # {"question", "image" (a PIL picture), "answer"}
dataset = Dataset.from_list(
    [
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["question"]}]}],
            "image": r["image"],
            "solution": r["answer"],
        }
        for r in rows
    ]
)


def count_is_right(completions, solution, **kwargs) -> list[float]:
    """1.0 when the reply's final '#### <n>' is the number of shapes of the asked colour."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t.strip().endswith(f"#### {s}")) for t, s in zip(texts, solution)]


training_args = GRPOConfig(
    output_dir=cli.output_dir,
    max_steps=cli.max_steps,
    per_device_train_batch_size=cli.batch_size,
    num_generations=8,
    max_completion_length=8,
    learning_rate=2e-4,
    use_cpu=cli.use_cpu,
)
trainer = GRPOTrainer(
    model=AutoModelForImageTextToText.from_pretrained(VLM_ASSET_DIR),
    processing_class=AutoProcessor.from_pretrained(VLM_ASSET_DIR),
    reward_funcs=count_is_right,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
