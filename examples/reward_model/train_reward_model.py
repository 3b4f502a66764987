"""Train a reward model for the last-letter task from SmolLM2-135M-Instruct, with nothing downloaded.

A Bradley-Terry reward model, as InstructGPT's (Ouyang et al. 2022, arXiv:2203.02155): SmolLM2's backbone with a
one-label sequence-classification head, trained by TRL's ``RewardTrainer`` on preference pairs (a "chosen" reply that
names the word's last letter, a "rejected" one that names another) made from the last-letter prompts. The verifier
labels every reply (``examples/last_letter/reward.py``: the reply's last standalone letter against the ``target``
column), so the reward model learns to imitate it. Three kinds of pairs, so that only the answer tells chosen from
rejected:

    sampled    two of SmolLM2's own replies to one prompt (temperature 0.7, as the GRPO run samples), one right and
               one wrong: the policy's own distribution, but the two differ in more than their answer;
    edited     one of SmolLM2's replies with its last standalone letter written as the right letter, and as a wrong
               one: the policy's wording, only the answer differs;
    templated  hand-written phrasings ("u", "The last letter is 'u'.", "'kelu' ends in U.", ...), the same phrasing
               or two phrasings drawn independently: the short, clean answers a trained policy gives.

Sampling costs time on a CPU (the 832 replies and all pairs took 99-162 s on one thread in three runs), so the pairs
are a mix: the replies of 160 training prompts (x 4) give the sampled and edited pairs, templates the rest.

A wrong letter is the word's first letter (a common mistake of the untrained policy) a quarter of the time, one of
its inner letters half of the time, any other letter a quarter of the time. The held-out pairs come from the test
file's words, made the same way; their accuracy is reported per kind and per wrong answer (first, inner, other).

    python examples/last_letter/make_data.py --out data/last_letter
    python examples/reward_model/train_reward_model.py --data data/last_letter --out runs/last_letter_rm

writes the model and its tokenizer (with its chat template) to ``--out``, loadable by ``grpolab train
--reward-model``, and ``--out/rm_eval.json``: the held-out pairwise accuracy (overall and per kind, scored through
grpolab's own reward-model path) and the times. See README.md beside this file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import string
import tempfile
import time
from pathlib import Path

import torch

LAST_LETTER = Path(__file__).resolve().parents[1] / "last_letter" / "reward.py"
STANDALONE = re.compile(r"(?<![A-Za-z])([A-Za-z])(?![A-Za-z])")  # the verifier's "standalone letter"
PHRASINGS = (
    "{L}",
    "{L}.",
    "'{L}'",
    "The last letter is '{L}'.",
    "The last letter of '{w}' is '{L}'.",
    'The last letter of "{w}" is "{L}".',
    "The answer is {L}",
    "{L} is the last letter.",
    "Last letter: {L}",
    "The word '{w}' ends with the letter '{L}'.",
    "'{w}' ends in {L}.",
    "The final letter of the word '{w}' is {L}.",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/last_letter", help="directory of make_data.py's train/test.parquet")
    p.add_argument("--out", default="runs/last_letter_rm", help="where the reward model and rm_eval.json go")
    p.add_argument("--pairs", type=int, default=400, help="training pairs, all kinds together")
    p.add_argument("--sample-prompts", type=int, default=160, help="training prompts SmolLM2 answers (x --group)")
    p.add_argument("--group", type=int, default=4, help="replies sampled per prompt")
    p.add_argument("--eval-pairs", type=int, default=200, help="held-out pairs, from the test file's words")
    p.add_argument("--eval-sample-prompts", type=int, default=48, help="test prompts SmolLM2 answers (x --group)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the training pairs")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (linear decay, 10%% warm-up)")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    p.add_argument("--seed", type=int, default=0, help="drives the pairs, the sampling and the head's init")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return p.parse_args()


def load_verifier():
    """examples/last_letter/reward.py:last_letter, the task's reward in TRL's form."""
    spec = importlib.util.spec_from_file_location("last_letter_reward", LAST_LETTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.last_letter


# ---------------------------------------------------------------- 1. SmolLM2's own replies


def sample_replies(model, tokenizer, rows: list[dict], group: int, seed: int) -> list[list[str]]:
    """``group`` replies of the policy to each row's prompt ``[B][G]``: grpolab's sampler (the hf rollout engine's),
    16 new tokens at temperature 0.7 as the GRPO run draws them, each rollout seeded by its key."""
    from grpolab.rollout.sampler import sample

    out: list[list[str]] = []
    for start in range(0, len(rows), 32):  # 32 prompts x G rollouts a call
        part = rows[start : start + 32]
        ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=True) for r in part]
        prompts = [list(x["input_ids"]) for x in ids for _ in range(group)]
        keys = [(seed, start + b, g) for b in range(len(part)) for g in range(group)]
        with torch.no_grad():
            batch = sample(model, prompts, keys, max_new_tokens=16, temperature=0.7, top_p=1.0,
                           eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)  # fmt: skip
        texts = [
            tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=True)
            for row, mask in zip(batch.completion_ids, batch.completion_mask)
        ]  # [B * G]
        out += [texts[b * group : (b + 1) * group] for b in range(len(part))]
    return out


# ---------------------------------------------------------------- 2. pairs


def wrong_letter(word: str, rng: random.Random) -> str:
    """A letter other than the word's last: its first letter a quarter of the time (a common mistake of the
    untrained policy), one of its inner letters half of the time (the hard case: a letter of the word, in the wrong
    place), any other letter a quarter of the time."""
    target, u = word[-1], rng.random()
    options = [word[0]] if u < 0.25 else list(word[1:-1]) if u < 0.75 else list(string.ascii_lowercase)
    options = [c for c in options if c != target] or [c for c in string.ascii_lowercase if c != target]
    return rng.choice(options)


def negative_kind(word: str, rejected: str) -> str:
    """What a rejected reply answers, by its last standalone letter (the verifier's reading): the word's ``first``
    letter, an ``inner`` one, an ``other`` letter, or ``none``."""
    found = STANDALONE.findall(rejected)
    if not found:
        return "none"
    letter = found[-1].lower()
    return "first" if letter == word[0] else "inner" if letter in word[1:-1] else "other"


def with_answer(reply: str, letter: str) -> str | None:
    """``reply`` with its last standalone letter replaced by ``letter`` (in the original's case); None when it has
    none."""
    found = list(STANDALONE.finditer(reply))
    if not found:
        return None
    m = found[-1]
    new = letter.upper() if m.group(1).isupper() else letter
    return reply[: m.start(1)] + new + reply[m.end(1) :]


def templated(word: str, letter: str, phrasing: str, rng: random.Random) -> str:
    return phrasing.format(w=word, L=letter.upper() if rng.random() < 0.3 else letter)


def pair(row: dict, chosen: str, rejected: str, kind: str) -> dict:
    return {"prompt": row["prompt"], "chosen": chosen, "rejected": rejected, "kind": kind, "target": row["target"],
            "negative": negative_kind(row["word"], rejected)}  # fmt: skip


def sampled_pairs(rows: list[dict], replies: list[list[str]], verifier, rng: random.Random) -> tuple[list, list]:
    """(sampled, edited) pairs of the rows SmolLM2 answered: a right and a wrong reply of a prompt that has both; one
    reply (with a standalone letter) written right and wrong."""
    sampled, edited = [], []
    for row, group in zip(rows, replies):
        scores = verifier(None, group, [row["target"]] * len(group))
        right = [r for r, s in zip(group, scores) if s == 1.0]
        wrong = [r for r, s in zip(group, scores) if s == 0.0]
        if right and wrong:
            sampled.append(pair(row, rng.choice(right), rng.choice(wrong), "sampled"))
        editable = [r for r in group if with_answer(r, "x") is not None]
        if editable:
            reply = rng.choice(editable)
            good, bad = with_answer(reply, row["target"]), with_answer(reply, wrong_letter(row["word"], rng))
            edited.append(pair(row, good, bad, "edited"))
    return sampled, edited


def templated_pairs(rows: list[dict], rng: random.Random) -> list[dict]:
    """One pair per row: a phrasing of the right letter and of a wrong one, the same phrasing half of the time."""
    out = []
    for row in rows:
        first = rng.choice(PHRASINGS)
        second = first if rng.random() < 0.5 else rng.choice(PHRASINGS)
        good = templated(row["word"], row["target"], first, rng)
        bad = templated(row["word"], wrong_letter(row["word"], rng), second, rng)
        out.append(pair(row, good, bad, "templated"))
    return out


def make_pairs(rows, n_pairs, n_sampled, group, policy, tokenizer, verifier, rng, seed) -> tuple[list[dict], dict]:
    """``n_pairs`` pairs from ``rows``: the sampled and edited pairs of the first ``n_sampled`` rows' replies (each
    kind at most a third of the pairs), the rest templated from the rows after them; and what was sampled."""
    asked = rows[:n_sampled]
    replies = sample_replies(policy, tokenizer, asked, group, seed)
    sampled, edited = sampled_pairs(asked, replies, verifier, rng)
    scores = [s for row, g in zip(asked, replies) for s in verifier(None, g, [row["target"]] * len(g))]
    sampled, edited = sampled[: n_pairs // 3], edited[: n_pairs // 3]
    rest = rows[n_sampled : n_sampled + n_pairs - len(sampled) - len(edited)]
    pairs = sampled + edited + templated_pairs(rest, rng)
    for p in pairs:  # every chosen reply is right by the verifier, every rejected one wrong
        assert verifier(None, [p["chosen"], p["rejected"]], [p["target"]] * 2) == [1.0, 0.0], p
    rng.shuffle(pairs)
    facts = {"replies": len(scores), "replies_right": sum(scores), "sample_prompts": len(asked)}
    return pairs, facts


# ---------------------------------------------------------------- 3. training


def train(model_dir: Path, pairs: list[dict], args: argparse.Namespace, work: str):
    """TRL's RewardTrainer on ``pairs`` (conversational: the prompt's messages, then the reply as the assistant's),
    from SmolLM2's weights with a new one-label head; returns the trainer."""
    import datasets
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    torch.manual_seed(args.seed)  # the new head's initial weights
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    # The input embedding (a fifth of SmolLM2's weights, tied to the LM head the classifier drops) stays as it is:
    # its dense gradient and AdamW state cost time on a CPU and a few hundred pairs cannot retrain it.
    model.get_input_embeddings().requires_grad_(False)
    rows = [
        {"prompt": p["prompt"], "chosen": [_assistant(p["chosen"])], "rejected": [_assistant(p["rejected"])]}
        for p in pairs
    ]
    config = RewardConfig(
        output_dir=work, num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="linear", warmup_steps=0.1, seed=args.seed,
        center_rewards_coefficient=0.01, logging_steps=5, save_strategy="no", report_to="none", use_cpu=True,
        dataloader_num_workers=0, max_length=None, disable_tqdm=True,
    )  # fmt: skip
    trainer = RewardTrainer(
        model=model, args=config, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    trainer.train()
    return trainer


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------- 4. held-out accuracy, through grpolab's path


def pairwise_accuracy(out: Path, pairs: list[dict]) -> dict:
    """The share of held-out pairs whose chosen reply the saved model scores above the rejected one, overall, per
    kind and per wrong answer, with Wilson 95% intervals (each pair's scores in ``out/heldout_scores.jsonl``);
    scored by grpolab's :class:`grpolab.rewards.model.RewardModel` as ``grpolab train --reward-model`` loads it
    (its chat template, its padding, the head's logit)."""
    from grpolab.common.stats import wilson_interval
    from grpolab.data.records import prompt_of
    from grpolab.rewards.model import RewardModelSettings, load_reward_model

    rm = load_reward_model(str(out), RewardModelSettings(), prompt_of, chat=True)
    records = [{"prompt": p["prompt"]} for p in pairs]
    chosen = rm([p["chosen"] for p in pairs], records)
    rejected = rm([p["rejected"] for p in pairs], records)
    wins = [c > r for c, r in zip(chosen, rejected)]
    with open(out / "heldout_scores.jsonl", "w") as f:
        for p, c, r in zip(pairs, chosen, rejected):
            f.write(json.dumps({**p, "score_chosen": c, "score_rejected": r}) + "\n")
    report = {}
    groups = [("all", "all")] + [("kind", k) for k in ("sampled", "edited", "templated")]
    groups += [("negative", k) for k in ("first", "inner", "other", "none")]
    for field, value in groups:
        w = [x for x, p in zip(wins, pairs) if value == "all" or p[field] == value]
        if w:
            low, high = wilson_interval(sum(w), len(w))
            report[value if field != "negative" else f"wrong={value}"] = {
                "accuracy": sum(w) / len(w),
                "ci95": [low, high],
                "pairs": len(w),
            }
    report["mean_score_chosen"] = sum(chosen) / len(chosen)
    report["mean_score_rejected"] = sum(rejected) / len(rejected)
    return report


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpolab.models.loading import SMOLLM2_FILE, convert_gguf, smollm2_path

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    model_dir = convert_gguf(smollm2_path().parent, SMOLLM2_FILE)  # a plain HF directory, cached on disk
    verifier, rng, out = load_verifier(), random.Random(args.seed), Path(args.out)
    train_rows = list(datasets.Dataset.from_parquet(str(Path(args.data) / "train.parquet")))
    test_rows = list(datasets.Dataset.from_parquet(str(Path(args.data) / "test.parquet")))
    rng.shuffle(train_rows)
    rng.shuffle(test_rows)

    # 1-2. SmolLM2's replies and the pairs made of them (train and held out), labelled by the verifier
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    train_pairs, train_facts = make_pairs(train_rows, args.pairs, args.sample_prompts, args.group, policy,
                                          tokenizer, verifier, rng, seed=args.seed)  # fmt: skip
    eval_pairs, eval_facts = make_pairs(test_rows, args.eval_pairs, args.eval_sample_prompts, args.group, policy,
                                        tokenizer, verifier, rng, seed=args.seed + 1)  # fmt: skip
    del policy
    t_pairs = time.perf_counter()
    print(f"pairs: {_kinds(train_pairs)} training, {_kinds(eval_pairs)} held out ({t_pairs - t0:.0f} s)")

    # 3. the reward model
    with tempfile.TemporaryDirectory() as work:
        trainer = train(model_dir, train_pairs, args, work)
    t_train = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    trainer.save_model(str(out))
    trainer.processing_class.save_pretrained(str(out))  # with SmolLM2's chat template

    # 4. held-out pairwise accuracy
    held_out = pairwise_accuracy(out, eval_pairs)
    t_end = time.perf_counter()
    facts = {
        "held_out": held_out,
        "train_pairs": _kinds(train_pairs),
        "eval_pairs": _kinds(eval_pairs),
        "sampling": {"train": train_facts, "held_out": eval_facts},
        "train_log": [e for e in trainer.state.log_history if "loss" in e or "train_runtime" in e],
        "time_s": {"pairs": t_pairs - t0, "train": t_train - t_pairs, "eval": t_end - t_train, "total": t_end - t0},
        "args": vars(args),
    }
    (out / "rm_eval.json").write_text(json.dumps(facts, indent=2) + "\n")
    a = held_out["all"]
    print(f"held-out pairwise accuracy {a['accuracy']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}] on {a['pairs']} "
          f"pairs; training {t_train - t_pairs:.0f} s, all {t_end - t0:.0f} s; wrote {out}")  # fmt: skip


def _kinds(pairs: list[dict]) -> dict[str, int]:
    return {k: sum(p["kind"] == k for p in pairs) for k in ("sampled", "edited", "templated")}


if __name__ == "__main__":
    main()
