"""A step with no signal (every group's rewards equal, so every advantage is 0) is AdamW's step on zero gradients,
as in TRL 1.16's GRPOTrainer: it backpropagates zeros, so AdamW decays its moments, moves the weights by the
momentum of earlier steps and applies weight decay. grpolab runs no backward there (the update skips rows whose
advantage is 0) and must still step the same way.

TRL's side is ``trl.GRPOTrainer.train`` for two steps on the built-in model in float64 (scored in float64 by
``helpers.trl_scoring.trl_scores_in_float64``): a reward of the completion text at step 1, a constant one at step 2. grpolab's
side is the :class:`~grpolab.training.update.Updater` on the two batches TRL sampled, with TRL's advantages, the
drop-in's mapping of the same keywords and an AdamW of TRL's parameter groups (decay on all but biases and norms);
the third is plain ``torch.optim.AdamW`` on the loss's autograd gradient, then on zero gradients.
"""

from __future__ import annotations

import copy

import torch
from helpers.models import model_and_batch
from helpers.trl_scoring import trl_scores_in_float64

from grpolab.algo.loss import policy_loss
from grpolab.common.batch import Batch
from grpolab.common.distributed import SINGLE
from grpolab.config.train import TrainConfig
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.policy import load_policy
from grpolab.training.forward import TrainModule
from grpolab.training.update import Updater
from grpolab.training.update_options import UpdateSections, loss_options
from grpolab.trl import GRPOConfig as DropInConfig
from grpolab.trl.config import to_options

QUESTIONS = ("2+3", "7*8", "12+7-3")
G = 4
LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 1.0  # a large learning rate: the second step's move is far above 1e-6
TRL_ARGS = dict(
    per_device_train_batch_size=len(QUESTIONS) * G,
    num_generations=G,
    max_completion_length=8,
    max_steps=2,
    learning_rate=LR,
    weight_decay=WEIGHT_DECAY,
    max_grad_norm=MAX_NORM,
    lr_scheduler_type="constant",
    use_cpu=True,
    bf16=False,
    report_to="none",
    save_strategy="no",
    gradient_checkpointing=False,
)


def _reward_then_none():
    """A reward of the completion text at its first call (multiples of 1/4), 1 for every completion after."""
    calls = []

    def reward(completions, **kwargs) -> list[float]:
        calls.append(len(completions))
        if len(calls) > 1:
            return [1.0] * len(completions)
        return [0.25 * c.count("1") + 0.5 * (len(c) % 3) for c in completions]

    return reward


def _trl_run(model, tokenizer, prompts, tmp_path) -> list[dict]:
    """TRL's two steps on ``model`` (in place); the batches its ``_generate_and_score_completions`` gave."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward_then_none(),
        args=GRPOConfig(output_dir=str(tmp_path), **TRL_ARGS),
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tokenizer,
    )
    trl_scores_in_float64(trainer)
    batches, generate = [], trainer._generate_and_score_completions

    def recorded(inputs):
        out = generate(inputs)
        batches.append({k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)})
        return out

    trainer._generate_and_score_completions = recorded
    trainer.train()
    return batches


def _adamw(model) -> torch.optim.AdamW:
    """torch's AdamW with the parameter groups transformers' Trainer gives it: no decay on biases and norms."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))  # a method that reads nothing of the trainer
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": WEIGHT_DECAY},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR)


def _batch(out: dict) -> Batch:
    return Batch(out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"])


def _grpolab_run(model, batches, eos_id: int, cfg: TrainConfig) -> tuple[list[dict], list[torch.Tensor]]:
    """The Updater's two steps on TRL's batches (in place); its metrics and the weights after step 1."""
    from transformers import get_scheduler

    opt = _adamw(model)
    sections = UpdateSections.of(cfg.replace(max_grad_norm=MAX_NORM))
    upd = Updater(sections, TrainModule(model, 1.0), opt, get_scheduler("constant", opt), SINGLE, eos_id=eos_id)
    metrics, after_one = [upd(_batch(batches[0]), batches[0]["advantages"])], _weights(model)
    metrics.append(upd(_batch(batches[1]), batches[1]["advantages"]))
    return metrics, after_one


def _plain_adamw_run(model, batches, cfg: TrainConfig) -> None:
    """Plain AdamW (in place): step 1 on the autograd gradient of the loss, clipped; step 2 on zero gradients."""
    opt = _adamw(model)
    out = batches[0]
    batch, mask = _batch(out), out["completion_mask"]
    logp = completion_logprobs(model, batch)  # [N, T]
    options = loss_options(cfg.objective, cfg.terms, cfg.max_policy_tokens)
    loss, _ = policy_loss(
        logp, logp.detach(), out["advantages"], mask, num_seqs=mask.shape[0], num_tokens=float(mask.sum()), **options
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=False)  # zeros: what a backward of a loss with every advantage 0 gives
    opt.step()


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_a_step_with_no_signal_is_adamw_s_step_on_zero_gradients_as_in_trl(tmp_path):
    policy = load_policy("builtin")
    model = policy.model.double()
    start = copy.deepcopy(model)
    prompts = [policy.tokenizer.decode(policy.prompt_ids({"question": q})) for q in QUESTIONS]
    batches = _trl_run(model, policy.tokenizer, prompts, tmp_path / "trl")
    assert len(batches) == 2 and batches[0]["advantages"].abs().max() > 0
    assert torch.equal(batches[1]["advantages"], torch.zeros_like(batches[1]["advantages"]))  # no signal at step 2

    args = DropInConfig(output_dir=str(tmp_path / "grpolab"), **TRL_ARGS)
    cfg = TrainConfig().replace(**to_options(args, train_rows=len(QUESTIONS) * G))
    ours = copy.deepcopy(start)
    metrics, after_one = _grpolab_run(ours, batches, policy.eos_id, cfg)
    plain = copy.deepcopy(start)
    _plain_adamw_run(plain, batches, cfg)
    assert metrics[1]["loss/active_frac"] == 0.0 and metrics[1]["grad/norm"] == 0.0
    assert _max_diff(_weights(ours), after_one) > 1e-5  # step 2 moved the weights (momentum and weight decay)
    assert _max_diff(_weights(ours), _weights(model)) <= 1e-6  # TRL's
    assert _max_diff(_weights(ours), _weights(plain)) <= 1e-6  # plain AdamW's


def _updater_steps(model, batch, advantages, scaler=None) -> tuple[dict, float]:
    """Updater steps (AdamW with weight decay) on ``batch`` with each of ``advantages``; the last step's metrics and
    how far it moved the weights."""
    from transformers import get_scheduler

    cfg = TrainConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=WEIGHT_DECAY)
    sections = UpdateSections.of(cfg.replace(max_grad_norm=MAX_NORM))
    upd = Updater(
        sections, TrainModule(model, 1.0), opt, get_scheduler("constant", opt), SINGLE, eos_id=2, scaler=scaler
    )
    for adv in advantages[:-1]:
        upd(batch, adv)
    before = _weights(model)
    return upd(batch, advantages[-1]), _max_diff(_weights(model), before)


def test_fp16_s_scaler_steps_on_zeros_and_a_non_finite_loss_still_skips():
    """Under --precision 16-mixed's loss scaler a step with no signal steps as without it (before zeros, the scaler
    found no gradient to check and raised); a non-finite loss still skips the step."""
    model, batch = model_and_batch()
    signal, none = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0]), torch.zeros(6)
    plain, plain_moved = _updater_steps(copy.deepcopy(model), batch, [signal, none])
    scaled, scaled_moved = _updater_steps(copy.deepcopy(model), batch, [signal, none], torch.amp.GradScaler("cpu"))
    assert plain_moved > 1e-3 and scaled_moved == plain_moved
    assert scaled["grad/norm"] == 0.0 and scaled["precision/overflow_skips"] == 0
    nan = torch.tensor([float("nan"), 1.0, 0.0, 0.0, 0.0, 0.0])
    skipped, moved = _updater_steps(copy.deepcopy(model), batch, [signal, nan])
    assert skipped["loss/skipped_updates"] == 1 and moved == 0.0
