"""The rollout service: the one way any rollout is drawn and scored.

Training's collector (``grpolab.rollout.collect``), held-out evaluation (``grpolab.eval.accuracy``), the gradient
probes (``grpolab.analysis.pool``), ``grpolab multiturn`` and rtg-mc's branched state values
(``grpolab.env.credit``) all draw through a :class:`RolloutService`: one rollout engine
(``grpolab.rollout.placement.build_engine``), the task's environment if it has one (``grpolab.env.environment``), and
the run's :class:`grpolab.rewards.rewarder.Rewarder`. Each command builds one, from its sections, and closes it.

- :meth:`RolloutService.play` plays records (a single-turn completion each, or an episode of the environment);
- :meth:`RolloutService.branch` continues played episodes from a later turn;
- :meth:`RolloutService.sample` plays and scores: the rows the update, the probes and the books read;
- :meth:`RolloutService.final_rewards` scores episodes' final conversations (returned, never written onto them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from grpolab.rewards.rewarder import Rewarder, Scores
from grpolab.rollout.engine import RolloutEngine, SamplingSettings
from grpolab.rollout.episodes import Episode, EpisodeRunner, policy_tokens
from grpolab.rollout.rows import Rows, episode_rows_of


class RolloutService:
    """Draws rollouts of ``policy`` through ``engine`` (in the episodes of ``env``, an
    :class:`grpolab.env.EnvSetup`, when the task has one) and scores them with ``reward``.

    ``device``: where the rows' tensors go (default: the engine's, else the policy's). ``draws`` counts the rollouts
    drawn (plays and branches)."""

    def __init__(
        self,
        engine: RolloutEngine,
        policy,
        reward: Rewarder | None = None,
        env=None,
        device: torch.device | None = None,
    ):
        factory, renderer, limits = (env.factory, env.renderer, env.limits) if env is not None else (None, None, None)
        self.runner = EpisodeRunner(engine, policy, factory, renderer, limits)
        self.policy, self.reward, self.env = policy, reward, env
        self.device = device or getattr(engine, "device", None) or next(policy.model.parameters()).device
        self.draws = 0

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine every draw goes through (set another, and the service draws with it)."""
        return self.runner.engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        self.runner.engine = engine

    @property
    def multi_turn(self) -> bool:
        """Whether a rollout is an episode of an environment (else a single-turn completion)."""
        return self.runner.multi_turn

    # ------------------------------------------------------------------ drawing
    def play(self, records: list[dict], keys: list[tuple], settings: SamplingSettings) -> list[Episode]:
        """One rollout per record, ``keys[n]`` seeding rollout n (its turns' keys follow from it)."""
        self.draws += len(records)
        return self.runner.play(records, keys, settings)

    def branch(self, episodes: list[Episode], turn: int, keys: list[tuple], settings: SamplingSettings):
        """One continuation per ``(episodes[m], keys[m])`` from the state before ``turn``
        (:meth:`grpolab.rollout.episodes.EpisodeRunner.branch`)."""
        self.draws += len(episodes)
        return self.runner.branch(episodes, turn, keys, settings)

    def sample(self, records: list[dict], keys: list[tuple], settings: SamplingSettings) -> tuple[Rows, float, float]:
        """Rollouts of ``records`` (row n from ``keys[n]``), as rows with their scores, and the (generation,
        scoring) seconds."""
        if not records:
            empty = Rows(None, [], self.reward([], [], torch.zeros(0, dtype=torch.long)))
            if self.multi_turn:
                empty = dataclasses.replace(empty, episodes=[], row_counts=[], final=torch.zeros(0))
            return empty, 0, 0
        t0 = time.perf_counter()
        episodes = self.play(records, keys, settings)
        t1 = time.perf_counter()
        rows = episode_rows_of(episodes, self.multi_turn, self.policy.pad_id, self.device)
        rows.scores, rows.final = self._scores(rows, records)
        return rows, t1 - t0, time.perf_counter() - t1

    # ------------------------------------------------------------------ scoring
    def _scores(self, rows: Rows, records: list[dict]) -> tuple[Scores, torch.Tensor | None]:
        """The rollouts' rewards: the reward functions on each completion; an episode's also on its conversation
        (its final reward, returned beside), plus the environment's return (component ``env``)."""
        if rows.episodes is None:
            mask = rows.batch.completion_mask.bool().cpu()
            ids = [row[keep].tolist() for row, keep in zip(rows.batch.completion_ids.cpu(), mask)]  # TRL's form
            lengths = rows.batch.completion_mask.sum(1).cpu()
            return self.reward(rows.texts, records, lengths, completion_ids=ids), None
        final = self.final_rewards(rows.episodes, records)
        returns = torch.tensor([sum(e.rewards) for e in rows.episodes], dtype=torch.float32)
        scores = final._replace(total=final.total + returns, components={"env": returns, **final.components})
        return scores, final.total

    def final_rewards(self, episodes: list[Episode], records: list[dict] | None = None) -> Scores:
        """The reward functions on each episode's final conversation (its last reply the completion); ``.total``
        is each episode's final reward."""
        records = [e.record for e in episodes] if records is None else records
        lengths = torch.tensor([policy_tokens(e) for e in episodes])
        conversations = [(e.messages[: e.opening], e.messages[e.opening :], e.env) for e in episodes]
        return self.reward([e.text for e in episodes], records, lengths, conversations)

    # ------------------------------------------------------------------ the run around it
    def weights_changed(self) -> None:
        """The policy's weights were updated: the engine draws from the new ones from now on."""
        self.engine.weights_changed()

    def current_weights(self) -> contextlib.AbstractContextManager:
        """Inside the block, the engine draws with the policy's current weights (an engine that lags them,
        ``--max-staleness``, catches up for a held-out evaluation; every other engine already does)."""
        current = getattr(self.engine, "current_weights", None)
        return current() if current is not None else contextlib.nullcontext()

    def weights_version(self) -> int | None:
        """The number of the weight sync whose weights the engine draws with (0: the starting ones), for an engine
        that lags the policy's; None for one that draws with the current weights."""
        version = getattr(self.engine, "weights_version", None)
        return version() if version is not None else None

    def prefetch(self, records: list[dict], keys: list[tuple], settings: SamplingSettings) -> bool:
        """Ask an engine that draws ahead (a generator process under --max-staleness) to start on the rollouts a
        later :meth:`sample` of the same records, keys and settings will ask for; whether it started. Single-turn
        rollouts only: an episode's later turns depend on the environment's answers."""
        start = getattr(self.engine, "prefetch", None)
        if start is None or self.multi_turn or not records:
            return False
        return start(*self.runner.first_turn(records, keys, settings))

    def pop_env_time(self) -> float:
        """Seconds spent in the environments since the last call."""
        return self.runner.pop_env_time()

    def close(self) -> None:
        """Stop what the service owns: the environment's tool worker, the reward's sandbox and an engine's process
        (a generator process)."""
        stop = getattr(self.engine, "close", None)
        if stop is not None:
            stop()
        if self.env is not None:
            self.env.close()
        if self.reward is not None:
            self.reward.close()
