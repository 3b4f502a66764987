"""GRPO on the multi-turn arithmetic dialogue, with a choice of per-stage advantage.

One step: B dialogues, G trajectories each, H turns played turn by turn. Each turn of each
trajectory is one *turn-row* of the update batch: the prompt the policy saw and the answer
it sampled (EOS included), with that stage's advantage on every token of the answer. This
is the dialogue's [N, T] token-level advantage laid out by turn: the tokens between turns
are the environment's (the next question), not the policy's, and a turn's EOS is an action
whose log-prob belongs to that turn's own context, so each turn is scored where it was sampled.

On P processes each rank plays a block of B/P dialogues with all their trajectories (the group
baselines stay on the rank), every random stream keyed by the trajectory's global index, and
the rewards are gathered for the metrics, as in the single-turn trainer.
"""

from __future__ import annotations

import time
import zlib

import torch

from grpolab import distributed as dist_
from grpolab import streams
from grpolab.multiturn.dialogue import (
    EVAL_DIALOGUE_SEED,
    DialogueSpec,
    branch_values,
    make_dialogues,
    play,
    rows_batch,
    stage_advantages,
)
from grpolab.trainer_base import StepOutput, TrainerBase

N_EVAL_DIALOGUES = 100


class MultiTurnTrainer(TrainerBase):
    def _data(self):
        cfg = self.cfg
        # Dialogue operands stay at most 50 (the single-turn default of 99 makes later turns' numbers
        # too large for the built-in model); a smaller --max-operand makes them smaller still.
        self.spec = DialogueSpec(cfg.stages, max_operand=min(cfg.max_operand, 50), context=cfg.dialogue_context)
        return make_dialogues(min(cfg.eval_questions, N_EVAL_DIALOGUES), EVAL_DIALOGUE_SEED, self.spec), None

    def _train_dialogues(self, step: int, n: int) -> list[dict]:
        seed = zlib.crc32(f"dialogues/{self.cfg.seed}/{step}".encode())  # keyed by (seed, step): resumable
        held = {str(d["steps"]) for d in self.held_out}
        return [d for d in make_dialogues(n * 2, seed, self.spec) if str(d["steps"]) not in held][:n]

    def step(self, step: int) -> StepOutput:
        cfg, policy = self.cfg, self.policy
        B, G = cfg.prompts_per_step, cfg.group_size
        mine = self.world.split(B)  # this rank's dialogues
        t0 = time.perf_counter()
        # 1-2. the dialogues played turn by turn, their per-turn rewards (and rtg-mc's state values)
        turns, rewards, v_mc = self._play(step, mine)  # rewards [Bl, G, H]
        t_gen = time.perf_counter()
        # 3. one advantage per turn of each trajectory, laid out as the update's turn-major rows
        adv = stage_advantages(rewards, cfg.advantage, v_mc)  # [Bl, G, H]
        batch = rows_batch(turns.batches, policy.pad_id)  # turn-major rows: [H * Bl * G]
        adv_rows = adv.permute(2, 0, 1).reshape(-1).float().to(self.device)
        # 4. the update
        update = self._update(batch, adv_rows)
        t_end = time.perf_counter()
        # 5. the books, over every rank's dialogues
        local = {
            "rewards": rewards,
            "lengths": batch.completion_mask.sum(1).float().cpu(),
            "samples": self._samples(turns, rewards, mine),
        }
        parts = dist_.gather(local, self.world)
        self.rollouts_total += B * G
        times = {"time/generate_s": t_gen - t0, "time/update_s": t_end - t_gen, "time/step_s": t_end - t0}
        metrics = _step_metrics(parts, B * G, self.rollouts_total, update, times)
        return StepOutput(metrics, [s for p in parts for s in p["samples"]])

    @torch.no_grad()
    def _play(self, step: int, mine: range):
        """This rank's dialogues of ``step``, G trajectories each: (turns, rewards ``[Bl, G, H]``, rtg-mc's Monte
        Carlo state values ``[Bl, G, H]`` or None)."""
        cfg, policy = self.cfg, self.policy
        G, H = cfg.group_size, cfg.stages
        b0, Bl = mine.start, len(mine)
        kw = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}
        rep = [d for d in self._train_dialogues(step, cfg.prompts_per_step)[b0 : b0 + Bl] for _ in range(G)]
        policy.model.eval()
        with self.train_module.full_weights():
            trajectories = range(b0 * G, (b0 + Bl) * G)  # global trajectory index: P-independent streams
            keys = [(streams.MULTITURN_ROLLOUT, cfg.seed, step, n) for n in trajectories]
            turns = play(policy, rep, [None] * (Bl * G), 0, keys, self.spec, **kw)
            rewards = turns.rewards.view(Bl, G, H)
            v_mc = None
            if cfg.advantage == "rtg-mc":
                total = rewards.sum(2)  # [Bl, G]
                v_mc = torch.zeros(Bl, G, H, dtype=torch.float64)
                v_mc[:, :, 0] = (total.sum(1, keepdim=True) - total) / max(G - 1, 1)  # s_1: the rest of the group
                for h in range(1, H):
                    answers = turns.answers[h - 1]
                    key = (cfg.seed, step, h)
                    v, _ = branch_values(
                        policy, rep, answers, h, cfg.branches, key, self.spec, first_index=b0 * G, **kw
                    )
                    v_mc[:, :, h] = v.view(Bl, G)
        policy.model.train()
        return turns, rewards, v_mc

    def _samples(self, turns, rewards: torch.Tensor, mine: range) -> list[dict]:
        """The first trajectory of each of this rank's dialogues among the first --log-samples."""
        cfg = self.cfg
        G, H = cfg.group_size, cfg.stages
        return [
            {
                "question": " | ".join(turns.questions[h][i] for h in range(H)),
                "answers": [turns.answers[h][i] for h in range(H)],
                "rewards": rewards.view(-1, H)[i].tolist(),
            }
            for i in range(0, len(mine) * G, G)
            if mine[i // G] < cfg.log_samples
        ]

    def evaluate(self, step: int) -> tuple[dict, list[dict]]:
        """Per-stage accuracy on the held-out dialogues, greedy and sampled (one sample each)."""
        t0 = time.perf_counter()
        policy, cfg = self.policy, self.cfg
        was_training = policy.model.training
        policy.model.eval()
        D, H = len(self.held_out), cfg.stages
        mine = self.world.split(D)  # each rank plays a block of the held-out dialogues
        own = self.held_out[mine.start : mine.stop]
        metrics = {}
        with torch.no_grad(), self.train_module.full_weights():
            for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
                t = play(
                    policy,
                    own,
                    [None] * len(own),
                    0,
                    [(streams.MULTITURN_EVAL, cfg.seed, i) for i in mine],
                    self.spec,
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=temp,
                )
                local = {
                    "rewards": t.rewards,
                    "examples": [
                        {
                            "questions": [t.questions[h][j] for h in range(H)],
                            "answers": [t.answers[h][j] for h in range(H)],
                            "truths": own[j]["truths"],
                        }
                        for j, i in enumerate(mine)
                        if i < cfg.log_samples
                    ],
                }
                parts = dist_.gather(local, self.world)
                acc = torch.cat([p["rewards"] for p in parts]).mean(0)  # [H] over all D dialogues
                metrics[f"eval/accuracy_{name}"] = float(acc.mean())
                for h in range(H):
                    metrics[f"eval/stage{h + 1}_{name}"] = float(acc[h])
                if name == "greedy":
                    examples = [e for p in parts for e in p["examples"]]
        policy.model.train(was_training)
        metrics["time/eval_s"] = time.perf_counter() - t0
        return metrics, examples


def _step_metrics(parts: list[dict], rollouts: int, rollouts_total: int, update: dict, times: dict) -> dict:
    """One step's metrics from every rank's rewards ``[Bl, G, H]`` and turn lengths."""
    rewards = torch.cat([p["rewards"] for p in parts])  # [B, G, H]
    lengths = torch.cat([p["lengths"] for p in parts])  # [H * B * G]
    total = rewards.sum(2)
    H = rewards.shape[2]
    return {
        "reward/mean": float(total.mean()),
        "reward/std": float(total.std(unbiased=False)),
        "reward/frac_zero_std": float((total.std(dim=1, unbiased=False) == 0).double().mean()),
        "reward/accuracy": float(rewards.mean()),
        **{f"reward/stage{h + 1}": float(rewards[:, :, h].mean()) for h in range(H)},
        "sampling/rollouts": rollouts,
        "sampling/rollouts_total": rollouts_total,
        **update,
        "completion/len_mean": float(lengths.mean()),
        **times,
    }
