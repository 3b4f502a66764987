"""grpolab.trl's ``evaluate()`` and its evaluations during training beside TRL 1.16's own GRPOTrainer, on the same
tiny model (the built-in model's weights, a chat template on its tokenizer) and rows: the keys TRL returns and logs,
every reward function and model of the run scoring the eval set, and the eval datasets TRL takes.

The values differ (each side samples with its own random numbers) except where they cannot: a constant reward.
"""

from __future__ import annotations

import pytest
from helpers.models import builtin_causal_lm, tiny_reward_model
from helpers.pages import docs_listed

COMMON = dict(num_generations=3, per_device_train_batch_size=6, per_device_eval_batch_size=6, max_completion_length=16,
              learning_rate=0.01, logging_steps=1, save_strategy="no", bf16=False, use_cpu=True, report_to="none",
              disable_tqdm=True, seed=0, max_steps=1)  # fmt: skip
# TRL's eval keys docs/coming-from-trl.md lists as not given (<fn>: a reward function's name)
# grpolab's own held-out accuracy beside TRL's keys (grpolab.trl.logs.accuracy_keys)
GRPOLAB_OWN = ("eval_accuracy_", "eval_greedy_", "eval_sampled_", "eval_pass@")
NOT_GIVEN = docs_listed("coming-from-trl.md", "An evaluation's entry", "keys the drop-in does not give:")


@pytest.fixture(autouse=True)
def _a_cpu_without_bf16_units(machine_kind):
    machine_kind(bf16=False)


def _rows(first: int, n: int):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": f"{a}+{a + 2}=", "answer": str(2 * a + 2)} for a in range(first, first + n)])


def _trainer(which: str, tmp_path, reward_funcs, eval_dataset=None, callbacks=(), tokenizers=None, **kw):
    """TRL's own trainer (``"trl"``) or the drop-in (``"grpolab"``) on the built-in model, trained on 6 rows
    (``tokenizers``: the reward processing classes)."""
    if which == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from grpolab.trl import GRPOConfig, GRPOTrainer
    model, tokenizer = builtin_causal_lm()
    args = GRPOConfig(output_dir=str(tmp_path / which), **COMMON | kw)
    return GRPOTrainer(model, reward_funcs, args=args, train_dataset=_rows(0, 6), eval_dataset=eval_dataset,
                       processing_class=tokenizer, callbacks=list(callbacks),
                       reward_processing_classes=tokenizers)  # fmt: skip


def _not_given(names: tuple[str, ...]) -> set[str]:
    return {key.replace("<fn>", fn) for key in NOT_GIVEN for fn in names}


def r1(completions, **kwargs):
    return [float(len(c)) for c in completions]


def r2(completions, **kwargs):
    return [float(c.count("1")) for c in completions]


def const(completions, **kwargs):
    return [2.0] * len(completions)


class Counted:
    """A reward of 1 that records how many completions each call scores."""

    __name__ = "counted"

    def __init__(self):
        self.calls: list[int] = []

    def __call__(self, completions, **kwargs):
        self.calls.append(len(completions))
        return [1.0] * len(completions)


def test_evaluate_returns_trl_s_keys_and_the_weighted_reward_of_every_function(tmp_path):
    """Before training, with two weighted reward functions: TRL's keys (but those the docs list), each function's
    mean and std, and eval_reward their weighted sum (every function applies to every completion); the dict is
    log_history's last entry, with the step."""
    got = {}
    for which in ("trl", "grpolab"):
        trainer = _trainer(which, tmp_path, [r1, r2], _rows(10, 4), reward_weights=[1.0, 0.5])
        got[which] = trainer.evaluate()
        assert trainer.state.log_history[-1] == {**got[which], "step": 0}
    trl, ours = got["trl"], got["grpolab"]
    assert set(ours) == set(trl) - _not_given(("r1", "r2"))
    for out in (trl, ours):
        weighted = out["eval_rewards/r1/mean"] + 0.5 * out["eval_rewards/r2/mean"]
        assert out["eval_reward"] == pytest.approx(weighted, rel=1e-6)
        assert out["eval_reward_std"] > 0 and out["epoch"] == 0


def test_a_constant_reward_gives_trl_s_values(tmp_path):
    """Where sampling cannot matter, the values are TRL's: a constant reward, its std 0, every group all-equal, no
    advantage (a loss of 0), nothing clipped."""
    trl = _trainer("trl", tmp_path, [const], _rows(10, 4)).evaluate()
    ours = _trainer("grpolab", tmp_path, [const], _rows(10, 4)).evaluate()
    for key in ("eval_reward", "eval_reward_std", "eval_rewards/const/mean", "eval_rewards/const/std",
                "eval_frac_reward_zero_std", "eval_loss", "eval_num_tokens", "eval_clip_ratio/low_mean",
                "eval_clip_ratio/high_mean", "eval_clip_ratio/region_mean", "eval_clip_ratio/low_min",
                "eval_clip_ratio/high_max", "epoch"):  # fmt: skip
        assert ours[key] == trl[key], key
    assert ours["eval_reward"] == 2.0 and ours["eval_frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize("batch", [3, 6])
def test_per_device_eval_batch_size_sets_the_batches_scored_together(tmp_path, batch):
    """The eval set is drawn and scored in batches of per_device_eval_batch_size rows (num_generations_eval of each
    prompt): the reward function is called once a batch, with as many completions as TRL's."""
    calls = {}
    for which in ("trl", "grpolab"):
        counted = Counted()
        _trainer(which, tmp_path, [counted], _rows(10, 4), per_device_eval_batch_size=batch).evaluate()
        calls[which] = counted.calls
    assert calls["grpolab"] == calls["trl"] == [batch] * (12 // batch)


@pytest.mark.parametrize("form", ["object", "directory"])
def test_a_reward_model_scores_the_eval_set(tmp_path, form):
    """A reward model as the run's only reward (a loaded one with its tokenizer, or its directory) scores the eval
    set (rows without an answer column) under both trainers, with the same keys."""
    rm, rm_tokenizer = tiny_reward_model(tmp_path / "tiny-rm")
    rm.config._name_or_path = str(tmp_path / "tiny-rm")  # as from_pretrained sets it: TRL names the reward by it
    funcs, tokenizers = ([rm], [rm_tokenizer]) if form == "object" else ([str(tmp_path / "tiny-rm")], None)
    from datasets import Dataset

    held_out = Dataset.from_list([{"prompt": f"{a}+{a + 2}="} for a in range(10, 14)])
    got = {}
    for which in ("trl", "grpolab"):
        got[which] = _trainer(which, tmp_path, funcs, held_out, tokenizers=tokenizers).evaluate()
    assert set(got["grpolab"]) == set(got["trl"]) - _not_given(("tiny-rm",))
    assert got["grpolab"]["eval_reward"] == pytest.approx(got["grpolab"]["eval_rewards/tiny-rm/mean"])


@pytest.mark.parametrize("form", ["dict", "DatasetDict", "IterableDataset"])
def test_the_eval_datasets_trl_takes(tmp_path, form):
    """A dict of datasets and a DatasetDict: each dataset evaluated, transformers' keys prefixed by its key
    (``eval_a_loss``, ``eval_b_runtime``) and GRPO's under ``eval_`` (the last dataset's in the dict returned), one
    log_history entry each; a stream, read whole: TRL's keys, its samples per second 0 (no length)."""
    from datasets import DatasetDict, IterableDataset

    a, b = _rows(10, 4), _rows(20, 2)

    def stream():
        yield from a

    data = {
        "dict": {"a": a, "b": b},
        "DatasetDict": DatasetDict({"a": a, "b": b}),
        "IterableDataset": IterableDataset.from_generator(stream),
    }[form]
    got, entries = {}, {}
    for which in ("trl", "grpolab"):
        trainer = _trainer(which, tmp_path, [r1])
        got[which] = trainer.evaluate(data)
        entries[which] = trainer.state.log_history
    assert set(got["grpolab"]) == set(got["trl"]) - _not_given(("r1",))
    assert [set(e) for e in entries["grpolab"]] == [set(e) - _not_given(("r1",)) for e in entries["trl"]]
    if form == "IterableDataset":
        assert got["grpolab"]["eval_samples_per_second"] == got["trl"]["eval_samples_per_second"] == 0
    else:
        assert {"eval_a_loss", "eval_b_loss", "eval_a_runtime", "eval_b_steps_per_second"} <= set(got["grpolab"])


def test_a_run_s_evaluation_entries_and_callbacks_are_trl_s(tmp_path):
    """Training with a dict of eval datasets evaluated at steps 1 and 2: log_history's evaluation entries are TRL's,
    dataset by dataset, with TRL's keys (grpolab's own accuracy beside them in each evaluation's last entry), and the
    callbacks are told of each as TRL's are (on_evaluate); evaluate() after train() gives TRL's keys too."""
    from transformers import TrainerCallback

    class Told(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            self.events.append((state.global_step, sorted(k for k in metrics if not k.startswith(GRPOLAB_OWN))))

    entries, told, after = {}, {}, {}
    for which in ("trl", "grpolab"):
        told[which] = Told()
        trainer = _trainer(which, tmp_path, [r1, r2], {"a": _rows(10, 2), "b": _rows(20, 2)}, [told[which]],
                           max_steps=2, eval_strategy="steps", eval_steps=1)  # fmt: skip
        trainer.train()
        entries[which] = [e for e in trainer.state.log_history if any(k.startswith("eval_") for k in e)]
        after[which] = trainer.evaluate(_rows(30, 2))  # the trained policy
    trl, ours = entries["trl"], entries["grpolab"]
    assert set(after["grpolab"]) == set(after["trl"]) - _not_given(("r1", "r2"))
    assert after["grpolab"]["epoch"] == after["trl"]["epoch"] > 0
    assert [e["step"] for e in ours] == [e["step"] for e in trl] == [1, 1, 2, 2]
    for theirs, mine in zip(trl, ours):
        own = {k for k in mine if k.startswith(GRPOLAB_OWN)}
        assert set(mine) - own == set(theirs) - _not_given(("r1", "r2"))
    assert all("eval_accuracy_greedy" in e for e in ours[1::2]) and not any(
        "eval_accuracy_greedy" in e for e in ours[::2]
    )
    assert told["grpolab"].events == [(s, [k for k in keys if k not in _not_given(("r1", "r2"))])
                                      for s, keys in told["trl"].events]  # fmt: skip
