"""The task stage: what a run learns from and is scored by, built from the run's resolved config.

It owns the reward (the training reward functions and reward models, weighted), the data (the training sampler and
the held-out records, --few-shot examples put into the policy's prompts), the environment of an episode task, the
held-out accuracy's reward, and the hacking signs' honeypots and audit (--honeypots, --audit-reward); each checked
against the data when the stage is built, not at the first step. It carries nothing across a resume: the data's order
follows from the seed and the step.
"""

from __future__ import annotations

from grpolab.common.errors import ConfigError
from grpolab.common.given import Given
from grpolab.config.train import TrainConfig
from grpolab.data.honeypots import arithmetic_twins, read_honeypots
from grpolab.data.task import few_shot_examples, task_data
from grpolab.env import environment
from grpolab.models.policy import Policy
from grpolab.rewards.forms import check_columns, load_reward_fn
from grpolab.rewards.rewarder import close_reward, eval_reward, rewarder_for, start_reward
from grpolab.rollout.placement import greedy_texts


class TaskStage:
    """The reward functions, the held-out set and the training sampler, the environment and the held-out accuracy's
    reward of a run on ``policy`` (whose prompts take the --few-shot examples). Of the run's resolved config it reads
    the sections ``reward``, ``code_sandbox``, ``dataset``, ``arithmetic``, ``episodes``, ``eval`` and ``prompt``, the
    completion budget (``generation.max_new_tokens``) and ``run.seed``."""

    def __init__(self, cfg: TrainConfig, policy: Policy, given: Given, log=print):
        self.reward = rewarder_for(
            cfg.reward,
            policy,
            episodes=cfg.multi_turn,
            max_new_tokens=cfg.generation.max_new_tokens,
            sandbox=cfg.code_sandbox,
            given=given,
            greedy=greedy_texts,
        )
        self.held_out, self.sampler = task_data(
            cfg.dataset, cfg.arithmetic, cfg.episodes, cfg.eval.eval_questions, cfg.run.seed, log, given
        )
        # an environment task: its environment, with one episode opened on a held-out record to check it now
        first = self.held_out[0] if self.held_out else None
        self.env = environment(cfg.episodes, cfg.arithmetic.max_operand, policy, first, given)
        fns = self.reward.reward_fns
        self.eval_reward_name, self.eval_reward = eval_reward(
            cfg.reward, cfg.eval.eval_reward_fn, cfg.dataset.format, cfg.multi_turn, policy.shown_prompt, policy.chat,
            fns, sandbox=cfg.code_sandbox, given=given,
        )  # fmt: skip
        self._check_columns(cfg)
        self.honeypots = honeypots_for(cfg, self.held_out)  # a bad file or name: one line, before anything starts
        self.audit = audit_for(cfg.hacking.audit_reward, given)
        # a code reward's sandbox, started now: a machine where programs cannot be isolated says so at once
        self.reward.start(log)
        start_reward([self.own_eval_reward], log)
        if cfg.prompt.few_shot and self.sampler is not None:  # solved examples from the training split
            policy.few_shot = few_shot_examples(self.sampler, cfg.prompt.few_shot)

    def _check_columns(self, cfg: TrainConfig) -> None:
        """A reward that needs a column the data lacks: one line now, not a zero reward every step."""
        if cfg.dataset.data:
            check_columns(self.reward.reward_fns, self.sampler.records, f"--data {cfg.dataset.data}")
        held = cfg.dataset.eval_data or self.held_out  # --eval-fraction 0 holds nothing out: nothing to check
        if (cfg.dataset.data or cfg.dataset.eval_data) and self.eval_reward is not None and held:
            where = f"--eval-data {cfg.dataset.eval_data}" if cfg.dataset.eval_data else "the held-out records"
            check_columns([(self.eval_reward_name, self.eval_reward, 1.0)], self.held_out, where)

    @property
    def reward_model_origins(self) -> list[dict]:
        """The Hub repositories of the reward models given by their Hub id (what config.json records of them)."""
        return [fn.origin for _, fn, _ in self.reward.reward_fns if getattr(fn, "origin", None)]

    @property
    def own_eval_reward(self):
        """The held-out accuracy's function when it is not one of the training reward's (the stage then owns it)."""
        return None if any(fn is self.eval_reward for _, fn, _ in self.reward.reward_fns) else self.eval_reward

    def close(self) -> None:
        """Stop what the stage started (the held-out reward's sandbox; the training reward's is the service's)."""
        close_reward([self.own_eval_reward])


def honeypots_for(cfg: TrainConfig, held_out: list[dict]) -> list[dict]:
    """The run's honeypots (--honeypots): a file's first --honeypot-count records; with 'auto', the built-in task's
    unanswerable twins of its held-out questions (none for other tasks); none for an environment's episodes."""
    where, n = cfg.hacking.honeypots, cfg.hacking.honeypot_count
    if where == "none":
        return []
    builtin = not cfg.dataset.data and not cfg.dataset.eval_data and not cfg.multi_turn
    if where == "auto":
        return arithmetic_twins(held_out, n) if builtin else []
    if cfg.multi_turn:
        raise ConfigError("--honeypots: the honeypots are prompts of a single-turn task, not an environment's episodes")
    return read_honeypots(where, n)


def audit_for(path: str, given: Given):
    """(name, function) of --audit-reward, loaded now (a bad name is one line before any step), or None."""
    if not path:
        return None
    try:
        return path, load_reward_fn(path, given)
    except ConfigError as e:
        raise ConfigError(f"--audit-reward: {e}") from None
