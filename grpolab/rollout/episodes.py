"""Episodes: the policy and an environment taking turns, played through a rollout engine.

``EpisodeRunner.play`` plays a batch of episodes turn by turn. Each turn:

1. every episode still running gives its context, the token ids of its conversation so far (one sequence, so a
   vLLM engine's prefix cache serves the earlier turns);
2. one ``engine.generate`` call samples every reply of the turn, row n keyed by ``turn_key(keys[n], turn)``: turn 0
   by the rollout's own key, so a one-turn episode samples exactly what a single-turn rollout does;
3. each reply (cut to what is left of ``max_episode_tokens``) goes to its environment's ``step``; its messages are
   rendered (``grpolab.env.render``) and appended, and the episode ends when the environment says so, or is cut at
   ``max_turns`` or ``max_episode_tokens`` (counted as truncated).

Without an environment (``env_factory=None``) every episode is a single-turn rollout: the record's own prompt,
one reply, no step. An environment whose ``history`` is False shows each turn only its latest messages: each turn
then starts a new sequence (a :class:`Segment`), as does a turn whose chat template rewrites the conversation.

``EpisodeRunner.branch`` continues episodes from the state before a later turn (the environment replayed through
the same replies, the same tokens), for Monte Carlo values of visited states (``--advantage rtg-mc``,
``grpolab multiturn``): it needs an environment whose messages depend only on the record and the replies.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from grpolab.common import streams
from grpolab.common.batch import Batch, left_pad
from grpolab.env.protocol import EnvError, EpisodeLimits, check_reset, check_step, env_name
from grpolab.env.render import Renderer
from grpolab.rollout.sampler import Sampled, SamplingSettings


def turn_key(key: tuple, turn: int) -> tuple:
    """The random-stream key of a rollout's reply at ``turn``: the rollout's own key at turn 0."""
    return tuple(key) if turn == 0 else (streams.TURN, *key, turn)


@dataclasses.dataclass
class Segment:
    """One token sequence of an episode: a prompt, then replies and what the environment said between them."""

    prompt: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    """Everything after the prompt: the policy's replies and, between them, the environment's tokens."""
    action: list[int] = dataclasses.field(default_factory=list)
    """1 on the policy's own tokens, 0 on the environment's."""
    turn: list[int] = dataclasses.field(default_factory=list)
    """The turn of each of the policy's tokens; -1 on the environment's."""
    logprobs: list[float] = dataclasses.field(default_factory=list)
    """The sampler's log-prob of each of the policy's tokens (0 on the environment's)."""
    entropy: list[float] | None = dataclasses.field(default_factory=list)
    """The sampler's entropy there (None when the engine gives none)."""
    media: Any = None
    """The sequence's images as the model takes them (a :class:`grpolab.vision.media.Media`; None: none)."""

    def context(self) -> list[int]:
        return self.prompt + self.ids

    def add(self, ids: list[int], turn: int, logprobs=None, entropy=None) -> None:
        """Append the policy's reply (``turn`` >= 0, with the sampler's values) or the environment's tokens."""
        n = len(ids)
        self.ids += ids
        self.action += [int(turn >= 0)] * n
        self.turn += [turn] * n
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * n
        if self.entropy is None:
            return
        if turn < 0:
            self.entropy += [0.0] * n
        else:  # an engine that gives no entropies (vLLM) leaves the segment without them
            self.entropy = None if entropy is None else self.entropy + list(entropy)


@dataclasses.dataclass
class Episode:
    """One rollout: a record, its environment and what happened."""

    record: dict
    key: tuple
    env: Any
    messages: list[dict]
    """The conversation: the opening (``opening`` messages), then each reply and the environment's answer (its last
    words too, which no reply follows and no token sequence holds)."""
    opening: int
    segments: list[Segment]
    rewards: list[float] = dataclasses.field(default_factory=list)
    """The environment's reward at each turn."""
    replies: list[str] = dataclasses.field(default_factory=list)
    ended: list[bool] = dataclasses.field(default_factory=list)
    """Whether each reply ended with the end-of-sequence token."""
    starts: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    """The state before each turn: (segment, its length, tokens used, messages), for :meth:`EpisodeRunner.branch`."""
    used: int = 0
    """Tokens after the opening prompt: replies and the environment's messages."""
    finished: bool = False
    done: bool = False
    """The environment ended it."""
    cut: bool = False
    """A limit (turns, tokens) or an exception in ``step`` ended it."""
    error: str = ""
    final_reward: float = 0.0
    """The reward functions' weighted sum on the final conversation (set when the episode is scored)."""

    @property
    def turns(self) -> int:
        return len(self.replies)

    @property
    def text(self) -> str:
        """The last reply: what reward functions score as the completion."""
        return self.replies[-1] if self.replies else ""

    def counter(self, name: str) -> int:
        """A count the environment kept (``tool_calls``, ``tool_errors``), 0 when it keeps none."""
        return int(getattr(self.env, name, 0) or 0)


class EpisodeRunner:
    """Plays episodes of ``env_factory``'s environment (None: single-turn rollouts) with ``engine`` for ``policy``.

    ``renderer``: turns messages into ids (default: a :class:`Renderer` of the policy without tools).
    """

    def __init__(
        self,
        engine,
        policy,
        env_factory: Callable[[], Any] | None = None,
        renderer: Renderer | None = None,
        limits: EpisodeLimits | None = None,
    ):
        self.engine, self.policy, self.env_factory = engine, policy, env_factory
        self.renderer = renderer if renderer is not None or env_factory is None else Renderer(policy)
        self.limits = (limits or EpisodeLimits()) if env_factory is not None else EpisodeLimits(1, 0)
        self.time_env = 0.0
        """Seconds spent in the environments' reset and step (tool calls included), summed over calls."""
        self._renderers: dict[tuple, Renderer] = {}

    @property
    def multi_turn(self) -> bool:
        return self.env_factory is not None

    def pop_env_time(self) -> float:
        """Seconds spent in the environments since the last call."""
        t, self.time_env = self.time_env, 0.0
        return t

    # ------------------------------------------------------------------ playing
    def play(self, records: list[dict], keys: list[tuple], settings: SamplingSettings) -> list[Episode]:
        """One episode per record, ``keys[n]`` seeding episode n's replies."""
        episodes = self._starts(records, keys)
        self._play_from(episodes, 0, settings)
        return episodes

    def first_turn(self, records: list[dict], keys: list[tuple], settings: SamplingSettings):
        """The ``engine.generate`` arguments of :meth:`play`'s first call for single-turn ``records``: what an engine
        may draw ahead of it."""
        return self._request(self._starts(records, keys), 0, settings)

    def _request(self, live: list[Episode], h: int, settings: SamplingSettings):
        """``engine.generate``'s arguments for turn ``h`` of ``live``: contexts, keys, settings (the longest room)."""
        rooms = [self._room(e, settings.max_new_tokens) for e in live]
        media = [e.segments[-1].media for e in live]
        return (
            [e.segments[-1].context() for e in live],
            [turn_key(e.key, h) for e in live],
            dataclasses.replace(settings, max_new_tokens=max(rooms)),
            None if all(m is None for m in media) else media,
        )

    def _starts(self, records: list[dict], keys: list[tuple]) -> list[Episode]:
        """The episodes of ``records`` before their first turn. A record repeated (a group's G rollouts) is encoded
        once: its rows share one prompt and one bundle of images, so the vision tower runs once for them."""
        encoded: dict[int, tuple] = {}
        return [self._start(rec, key, encoded) for rec, key in zip(records, keys)]

    def _start(self, record: dict, key: tuple, encoded: dict | None = None) -> Episode:
        if self.env_factory is None:
            encoded = {} if encoded is None else encoded
            if id(record) not in encoded:
                encoded[id(record)] = self.policy.prompt_inputs(record)
            ids, media = encoded[id(record)]
            return Episode(record, tuple(key), None, [], 0, [Segment(list(ids), media=media)])
        t0 = time.perf_counter()
        env = self.env_factory()
        messages = check_reset(env.reset(record), env)
        self.time_env += time.perf_counter() - t0
        opening, media = self.renderer_of(env).opening_inputs(messages)
        return Episode(record, tuple(key), env, messages, len(messages), [Segment(opening, media=media)])

    def renderer_of(self, env) -> Renderer:
        """The renderer of ``env``'s episode: the run's, or one showing the episode's own tools (``own_tools``: a
        TRL-shape environment of a dict of classes shows its class's only)."""
        tools = getattr(env, "own_tools", None)
        if tools is None or tools == self.renderer.tools:
            return self.renderer
        key = tuple(s["function"]["name"] for s in tools)
        if key not in self._renderers:
            self._renderers[key] = Renderer(self.policy, tools)
        return self._renderers[key]

    def _play_from(self, episodes: list[Episode], turn: int, settings: SamplingSettings) -> None:
        for h in range(turn, self.limits.max_turns):
            live = [e for e in episodes if not e.finished]
            if not live:
                return
            self._turn(live, h, settings)

    def _room(self, episode: Episode, max_new_tokens: int) -> int:
        budget = self.limits.max_episode_tokens
        return max_new_tokens if not budget else min(max_new_tokens, budget - episode.used)

    def _turn(self, live: list[Episode], h: int, settings: SamplingSettings) -> None:
        """Turn ``h`` of every live episode: one generation call for all, then each environment's step."""
        rooms = [self._room(e, settings.max_new_tokens) for e in live]
        for e in live:
            e.starts.append((len(e.segments) - 1, len(e.segments[-1].ids), e.used, len(e.messages)))
        out = self.engine.generate(*self._request(live, h, settings))
        replies = _replies(out, rooms, self.policy.eos_id)
        texts = self.policy.decode(*_padded([ids for ids, *_ in replies], self.policy.pad_id))
        for e, (ids, logp, ent, ended), text in zip(live, replies, texts):
            e.segments[-1].add(ids, h, logp, ent)
            e.used += len(ids)
            e.replies.append(text)
            e.ended.append(ended)
            e.messages.append({"role": "assistant", "content": text})
            if e.env is None:
                e.finished = e.done = True
            else:
                self._step(e, text, h)

    def _step(self, e: Episode, text: str, h: int) -> None:
        """The environment's answer to reply ``h``: the episode ends, is cut, or continues with its messages."""
        t0 = time.perf_counter()
        try:
            result = e.env.step(text)
        except EnvError:
            raise
        except Exception as ex:  # noqa: BLE001 - an environment that fails on one episode costs that episode
            self.time_env += time.perf_counter() - t0
            e.rewards.append(0.0)
            e.finished = e.cut = True
            e.error = f"{env_name(e.env)}.step raised {type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}"
            return
        self.time_env += time.perf_counter() - t0
        messages, reward, done = check_step(result, e.env)
        e.rewards.append(reward)
        if done or h + 1 >= self.limits.max_turns:  # its last words join the conversation (reward functions read
            e.messages += messages  # it), not the token sequence: no reply follows them
            e.finished, e.done, e.cut = True, done, not done
            return
        self._continue(e, messages)

    def _continue(self, e: Episode, messages: list[dict]) -> None:
        """Append the environment's ``messages`` and what leads to the next reply (a new segment when the
        environment shows only its latest messages or the template does not extend the sequence)."""
        history = getattr(e.env, "history", True)
        renderer = self.renderer_of(e.env)
        got = renderer.continuation_inputs(e.messages, e.ended[-1], messages) if history else None
        new_segment = got is None
        if new_segment:
            shown = e.messages + messages if history else _system(e.messages[: e.opening]) + messages
            got = renderer.opening_inputs(shown)
        ids, media = got
        budget = self.limits.max_episode_tokens
        e.messages += messages
        if budget and e.used + len(ids) >= budget:  # no room for the next reply: cut before it
            e.finished = e.cut = True
            return
        e.used += len(ids)
        if new_segment:
            e.segments.append(Segment(ids, entropy=[] if e.segments[-1].entropy is not None else None, media=media))
        else:
            seg = e.segments[-1]
            if media is not None:  # the environment showed a picture: its placeholders start where its tokens do
                media = media.shifted(len(seg.context()))
                seg.media = media if seg.media is None else seg.media.then(media)
            seg.add(ids, -1)

    # ------------------------------------------------------------------ branching
    def branch(
        self, episodes: list[Episode], turn: int, keys: list[tuple], settings: SamplingSettings
    ) -> list[Episode]:
        """One continuation per ``(episodes[m], keys[m])`` from the state before ``turn`` (>= 1): a fresh
        environment replayed through the episode's first ``turn`` replies (their messages must come out as they did),
        the episode's tokens up to there, then turns ``turn``.. played anew. Episodes that ended before ``turn`` are
        returned as they are (nothing is left to play)."""
        out = [self._replayed(e, turn, key) for e, key in zip(episodes, keys)]
        self._play_from([e for e in out if not e.finished], turn, settings)
        return out

    def _replayed(self, e: Episode, turn: int, key: tuple) -> Episode:
        if turn >= len(e.starts):  # it ended before this turn
            return dataclasses.replace(e, finished=True)
        seg, length, used, n_msgs = e.starts[turn]
        env = self.env_factory()
        opening = check_reset(env.reset(e.record), env)
        for h in range(turn):
            result = env.step(e.replies[h])
            messages, _, _ = check_step(result, env)
            start = e.starts[h][3] + 1  # after reply h
            stop = e.starts[h + 1][3] if h + 1 < len(e.starts) else len(e.messages)
            if messages != e.messages[start:stop]:
                raise EnvError(
                    f"{env_name(env)}: replaying an episode gave other messages than it had; branching from a state "
                    "(--advantage rtg-mc, grpolab multiturn) needs step to depend only on the record and the replies"
                )
        if opening != e.messages[: e.opening]:
            raise EnvError(f"{env_name(env)}.reset gave another opening for the same record; branching needs the same")
        segments = [copy.deepcopy(s) for s in e.segments[:seg]] + [_cut(e.segments[seg], length)]
        return Episode(
            e.record,
            tuple(key),
            env,
            copy.deepcopy(e.messages[:n_msgs]),
            e.opening,
            segments,
            rewards=list(e.rewards[:turn]),
            replies=list(e.replies[:turn]),
            ended=list(e.ended[:turn]),
            starts=list(e.starts[:turn]),
            used=used,
        )


def _cut(segment: Segment, length: int) -> Segment:
    """A copy of ``segment`` with its first ``length`` tokens after the prompt."""
    return Segment(
        list(segment.prompt),
        segment.ids[:length],
        segment.action[:length],
        segment.turn[:length],
        segment.logprobs[:length],
        None if segment.entropy is None else segment.entropy[:length],
    )


def _system(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["role"] == "system"]


def _replies(out: Sampled, rooms: list[int], eos_id: int) -> list[tuple[list[int], list[float], list | None, bool]]:
    """Each row's reply as ``(ids, log-probs, entropies or None, ended with EOS)``, cut to its room."""
    lengths = out.batch.completion_mask.sum(1).tolist()
    ids = out.batch.completion_ids.cpu()
    logp = out.logprobs.cpu() if out.logprobs is not None else None
    ent = out.entropy.cpu() if out.entropy is not None else None
    rows = []
    for i, (n, room) in enumerate(zip(lengths, rooms)):
        n = min(int(n), room)
        row = ids[i, :n].tolist()
        rows.append(
            (
                row,
                logp[i, :n].tolist() if logp is not None else [0.0] * n,
                ent[i, :n].tolist() if ent is not None else None,
                bool(row) and row[-1] == eos_id,
            )
        )
    return rows


def _padded(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, T]`` right-padded ids and their mask."""
    T = max([1, *map(len, seqs)])
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


# ---------------------------------------------------------------------- episodes as the update's rows
@dataclasses.dataclass
class EpisodeRows:
    """Episodes laid out as token rows: one row per segment, an episode's rows contiguous, in episode order."""

    batch: Batch
    """``[m, ...]``: prompts left-padded, the rest (replies and environment tokens) right-padded."""
    action: torch.Tensor
    """``[m, T]`` 1 on the policy's tokens."""
    turn: torch.Tensor
    """``[m, T]`` the turn of each policy token, -1 elsewhere."""
    logprobs: torch.Tensor
    """``[m, T]`` the sampler's log-probs (0 off the policy's tokens)."""
    entropy: torch.Tensor | None
    rows: list[int]
    """``[n]`` rows of each episode."""


def episode_rows(episodes: list[Episode], pad_id: int, device=None) -> EpisodeRows:
    """The token rows of ``episodes`` (:class:`EpisodeRows`)."""
    segs = [s for e in episodes for s in e.segments]
    prompt_ids, prompt_mask = left_pad([s.prompt for s in segs], pad_id)
    ids, mask = _padded([s.ids for s in segs], pad_id)
    T = ids.shape[1]

    def table(values: list[list], dtype) -> torch.Tensor:
        out = torch.zeros((len(segs), T), dtype=dtype)
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.tensor(v, dtype=dtype)
        return out

    action = table([s.action for s in segs], torch.long)
    turn = torch.full((len(segs), T), -1, dtype=torch.long)
    for i, s in enumerate(segs):
        turn[i, : len(s.turn)] = torch.tensor(s.turn, dtype=torch.long)
    entropy = None if any(s.entropy is None for s in segs) else table([s.entropy for s in segs], torch.float32)
    media = [s.media for s in segs]
    batch = Batch(prompt_ids, prompt_mask, ids, mask, None if all(m is None for m in media) else tuple(media))
    if device is not None:
        batch = batch.to(device)
    return EpisodeRows(
        batch,
        action,
        turn,
        table([s.logprobs for s in segs], torch.float32),
        entropy,
        [len(e.segments) for e in episodes],
    )


# ---------------------------------------------------------------------- facts of played episodes
def policy_tokens(episode) -> int:
    """The policy's tokens over the episode (its replies)."""
    return sum(sum(s.action) for s in episode.segments)


@dataclasses.dataclass
class EpisodeFacts:
    """Per-episode facts for the ``env/*`` metrics, one entry per episode."""

    turns: list[int]
    turn_rewards: list[list[float]]
    """The environment's reward at each turn."""
    tool_calls: list[int]
    """Tool calls, tool errors and cut tool results, as the environment counted them."""
    tool_errors: list[int]
    tool_truncated: list[int]
    env_errors: list[int]
    """1 where ``step`` raised."""

    @classmethod
    def of(cls, episodes: list) -> EpisodeFacts:
        return cls(
            [e.turns for e in episodes],
            [list(e.rewards) for e in episodes],
            [e.counter("tool_calls") for e in episodes],
            [e.counter("tool_errors") for e in episodes],
            [e.counter("tool_truncated") for e in episodes],
            [int(bool(e.error)) for e in episodes],
        )

    @classmethod
    def merge(cls, parts: list[EpisodeFacts]) -> EpisodeFacts:
        """The facts of several calls' (or ranks') episodes, in order."""
        return cls(*([x for p in parts for x in getattr(p, f.name)] for f in dataclasses.fields(cls)))


def max_return(env) -> float:
    """The largest return of an environment's episode: its ``max_return`` (default 1)."""
    value = getattr(env, "max_return", None)
    return float(value) if value else 1.0
