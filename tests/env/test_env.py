"""Environments and episodes: an environment written here drives multi-turn episodes through the collector and a
trainer step; the episode's tokens, masks and per-turn advantages against hand-computed values; an episode scored
as one sequence against its turns scored one by one; the limits; branching by replay; the errors a user meets."""

from __future__ import annotations

import json
import math

import pytest
import torch
from env_fixtures import Echo, EchoLast, Forever, TurnEngine
from helpers.paths import REPO, TESTS

from grpolab.common import streams
from grpolab.config.train import ConfigError, TrainConfig
from grpolab.env import EnvError, EnvSetup, EpisodeLimits, Renderer
from grpolab.env.credit import episode_credit
from grpolab.env.protocol import check_env_class, check_step, load_env_class
from grpolab.models.policy import Policy
from grpolab.rewards.rewarder import Rewarder
from grpolab.rollout.collect import Collector, CollectSettings
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.episodes import EpisodeRunner, turn_key
from grpolab.rollout.service import RolloutService
from grpolab.training.recipe import build_trainer

TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# rollout g's replies at turns 0 and 1: the four patterns of two turns (rewards (1,1), (1,0), (0,1), (0,0))
SCRIPT = {0: ("yes", "yes"), 1: ("yes", "no"), 2: ("no", "yes"), 3: ("no", "no")}


def script(g: int, h: int) -> str:
    return SCRIPT[g % 4][h % 2]


@pytest.fixture()
def chat_tokenizer(char_tokenizer):
    import copy

    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture()
def chat_policy(tiny_model, chat_tokenizer):
    return Policy(tiny_model, chat_tokenizer, "tiny", chat=True, system="")


class Records:
    def draw(self, step: int, n: int, round: int = 0) -> list[dict]:
        return [{"prompt": "go", "id": i} for i in range(n)]


def _collect(policy, env, advantage="grpo", G=4, B=1, limits=None, engine=None):
    limits = limits or EpisodeLimits(4, 0)
    engine = engine or TurnEngine(policy.tokenizer, script)
    service = RolloutService(engine, policy, Rewarder([]), EnvSetup(env, Renderer(policy), limits, "test"))
    settings = CollectSettings("fixed", B, G, seed=5, sampling=SamplingSettings(8, 1.0))
    collector = Collector(service, Records(), settings)
    return collector.collect(step=1), engine


@pytest.mark.parametrize(
    "advantage,expected",
    [
        # returns 2, 1, 1, 0 (mean 1): every turn gets R - mean [Foundations, Eq. 22]
        ("grpo", [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [-1.0, -1.0]]),
        # reward-to-go (2, 1), (1, 0), (1, 1), (0, 0) minus the group mean of returns
        ("rtg-group", [[1.0, 0.0], [0.0, -1.0], [0.0, 0.0], [-1.0, -1.0]]),
    ],
)
def test_an_environment_drives_two_turn_episodes_through_the_collector(chat_policy, advantage, expected):
    roll, engine = _collect(chat_policy, Echo, advantage)
    rows = roll.groups.rows
    tok = chat_policy.tokenizer
    # Two generation calls (one per turn), the second with each conversation so far as its prompt.
    assert len(engine.calls) == 2
    (p0, k0, _), (p1, k1, _) = engine.calls
    assert k0 == [(streams.ROLLOUT, 5, 1, 0, g) for g in range(4)]
    assert k1 == [turn_key((streams.ROLLOUT, 5, 1, 0, g), 1) for g in range(4)]
    assert tok.decode(p1[1]) == "user: go<eos>\nassistant: yes<eos>\nuser: again<eos>\nassistant: "
    # One token row per episode: the whole conversation, as the template renders it, the replies as sampled.
    assert rows.counts == [1, 1, 1, 1] and rows.batch.completion_ids.shape[0] == 4
    for g, e in enumerate(rows.episodes):
        assert [m["role"] for m in e.messages] == ["user", "assistant", "user", "assistant"]
        assert e.rewards == [float(r == "yes") for r in SCRIPT[g]] and e.done and not e.cut
        P, C = rows.batch.prompt_mask[g].bool(), rows.batch.completion_mask[g].bool()
        ids = rows.batch.prompt_ids[g][P].tolist() + rows.batch.completion_ids[g][C].tolist()
        full = tok.apply_chat_template(e.messages, tokenize=False)
        assert full == tok.decode(ids) + "\n"  # the template's text up to the last reply's end
    # The environment's tokens carry mask 0; the policy's replies (with their EOS) mask 1 and their turn.
    for g in range(4):
        C = rows.batch.completion_mask[g].bool()
        action, turn = rows.action[g][C].tolist(), rows.turn[g][C].tolist()
        n0 = len(SCRIPT[g][0]) + 1
        n_env = len(tok("\nuser: again<eos>\nassistant: ", add_special_tokens=False)["input_ids"])
        assert action == [1] * n0 + [0] * n_env + [1] * (len(SCRIPT[g][1]) + 1)
        assert turn == [0] * n0 + [-1] * n_env + [1] * (len(SCRIPT[g][1]) + 1)
    credit = episode_credit(rows, roll.groups.sizes, "grpo", advantage)
    assert [a.tolist() for a in credit.turns] == expected
    for g in range(4):  # each token carries its turn's advantage, the environment's none
        C = rows.batch.completion_mask[g].bool()
        tok_adv, turn = credit.token[g][C], rows.turn[g][C]
        want = torch.tensor([expected[g][t] if t >= 0 else 0.0 for t in turn.tolist()])
        assert torch.equal(tok_adv, want)
    assert roll.generated.episodes.turns == [2] * 4 and roll.rewards == [[2.0, 1.0, 1.0, 0.0]]


def test_rtg_group_with_std_normalisation_divides_by_the_reward_to_go_spread(chat_policy):
    roll, _ = _collect(chat_policy, Echo)
    credit = episode_credit(roll.groups.rows, roll.groups.sizes, "grpo_std", "rtg-group")
    rtg = torch.tensor([[2.0, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.float64)
    std = (rtg - rtg.mean()).pow(2).mean().sqrt()  # population std of every turn's reward-to-go
    want = (rtg - 1.0) / (std + 1e-4)
    assert torch.allclose(torch.stack(credit.turns).double(), want, atol=1e-6)


def test_an_environment_that_shows_only_the_last_turn_gives_a_row_per_turn(chat_policy):
    roll, engine = _collect(chat_policy, EchoLast)
    rows, tok = roll.groups.rows, chat_policy.tokenizer
    assert rows.counts == [2, 2, 2, 2] and rows.batch.completion_ids.shape[0] == 8
    assert tok.decode(engine.calls[1][0][0]) == "user: again<eos>\nassistant: "  # the new message alone
    second = rows.batch.prompt_ids[1][rows.batch.prompt_mask[1].bool()].tolist()
    assert tok.decode(second) == "user: again<eos>\nassistant: "
    assert rows.action[1][rows.batch.completion_mask[1].bool()].tolist() == [1] * 4  # "yes" + EOS, all the policy's
    credit = episode_credit(rows, roll.groups.sizes, "grpo", "rtg-group")
    assert credit.token[1][:4].tolist() == [0.0] * 4  # g = 0, turn 2: reward-to-go 1 - mean 1


def test_a_template_that_rewrites_history_starts_a_new_sequence(tiny_model, chat_tokenizer):
    # This template writes earlier replies as '...': the longer conversation's text does not extend the shorter's.
    chat_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}assistant: ...<eos>\n"
        "{% else %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    policy = Policy(tiny_model, chat_tokenizer, "tiny", chat=True, system="")
    roll, engine = _collect(policy, Echo)
    rows = roll.groups.rows
    assert rows.counts == [2, 2, 2, 2]
    assert (
        chat_tokenizer.decode(engine.calls[1][0][0])
        == "user: go<eos>\nassistant: ...<eos>\nuser: again<eos>\nassistant: "
    )


def test_max_turns_and_max_episode_tokens_cut_episodes_and_count_them(chat_policy):
    roll, engine = _collect(chat_policy, Forever, limits=EpisodeLimits(3, 0))
    assert (
        roll.generated.episodes.turns == [3] * 4 and roll.generated.truncated == [True] * 4 and len(engine.calls) == 3
    )
    # Replies 'yes' + EOS (4 tokens, rollouts 0 and 1) and 'no' + EOS (3 tokens, rollouts 2 and 3) at turn 1; the
    # environment's answer is n_env tokens. With a budget of 4 + n_env, a 'yes' episode has no room left for a
    # reply after the answer: cut after one turn. A 'no' episode has 1 token left: its second reply is cut to one
    # token, then nothing is left: cut after two turns.
    tok = chat_policy.tokenizer
    n_env = len(tok("\nuser: more<eos>\nassistant: ", add_special_tokens=False)["input_ids"])
    roll, engine = _collect(chat_policy, Forever, limits=EpisodeLimits(8, 4 + n_env))
    episodes = roll.groups.rows.episodes
    assert roll.generated.episodes.turns == [1, 1, 2, 2] and roll.generated.truncated == [True] * 4
    assert [e.used for e in episodes] == [4, 4, 4 + n_env, 4 + n_env]
    assert episodes[2].replies[1] == "y"
    assert [e.segments[0].turn.count(1) for e in episodes] == [0, 0, 1, 1]
    roll, _ = _collect(chat_policy, Forever, limits=EpisodeLimits(8, 4 + n_env))  # the same again: deterministic
    assert [e.used for e in roll.groups.rows.episodes] == [4, 4, 4 + n_env, 4 + n_env]


def _turn_batch(prompt: list[int], reply: list[int]):
    from grpolab.common.batch import Batch

    one = lambda n: torch.ones(1, n, dtype=torch.long)  # noqa: E731
    return Batch(torch.tensor([prompt]), one(len(prompt)), torch.tensor([reply]), one(len(reply)))


@pytest.fixture()
def gpt2_float64(char_tokenizer):
    """A random GPT-2 layout model in float64: every op in float64 (Llama's RMSNorm computes in float32 whatever the
    weights, which limits its agreement to float32's ~1e-8)."""
    from helpers.models import gpt2

    ids = dict(bos_token_id=char_tokenizer.bos_token_id, eos_token_id=char_tokenizer.eos_token_id)
    return gpt2(len(char_tokenizer), seed=0, **ids).double().eval()


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_an_episode_scores_like_its_turns_in_their_contexts(chat_policy, gpt2_float64, layout):
    """The log-probs, loss and gradient of an episode's one sequence equal those of its replies scored one by one,
    each with the conversation before it as its prompt: float64, 1e-10 (GPT-2), 1e-7 (Llama, float32 norms)."""
    from grpolab.algo.loss import policy_loss
    from grpolab.common.batch import Batch
    from grpolab.models.logprobs import completion_logprobs

    roll, _ = _collect(chat_policy, Echo)
    model = gpt2_float64 if layout == "gpt2" else chat_policy.model.double()
    tol = 1e-10 if layout == "gpt2" else 1e-7
    try:
        rows = roll.groups.rows
        credit = episode_credit(rows, roll.groups.sizes, "grpo", "rtg-group")
        for g in range(4):
            C = int(rows.batch.completion_mask[g].sum())
            b = Batch(rows.batch.prompt_ids[g : g + 1], rows.batch.prompt_mask[g : g + 1],
                      rows.batch.completion_ids[g : g + 1, :C], rows.batch.completion_mask[g : g + 1, :C])  # fmt: skip
            action, turn, adv = rows.action[g, :C], rows.turn[g, :C], credit.token[g, :C].double()
            prompt = b.prompt_ids[0][b.prompt_mask[0].bool()].tolist()
            ids = b.completion_ids[0].tolist()
            turns = []  # (prompt, reply, advantages) of each turn, its prompt the sequence before it
            for h in (0, 1):
                pos = (turn == h).nonzero().squeeze(1)
                first, last = int(pos[0]), int(pos[-1]) + 1
                turns.append((prompt + ids[:first], ids[first:last], adv[first:last]))
            for shared in (False, True):
                model.zero_grad()
                logp = completion_logprobs(model, b, shared_prefix=shared)[0]  # [C]
                loss, _ = policy_loss(
                    logp[None], logp.detach()[None], adv[None], action[None].double(), aggregation="token-mean"
                )
                loss.backward()
                g_episode = [p.grad.clone() for p in model.parameters()]
                model.zero_grad()
                total, n_tok = 0.0, int(action.sum())
                for h, (p_ids, reply, a) in enumerate(turns):
                    lp = completion_logprobs(model, _turn_batch(p_ids, reply), shared_prefix=shared)
                    torch.testing.assert_close(lp[0].detach(), logp[turn == h].detach(), atol=tol, rtol=0)
                    turn_loss, _ = policy_loss(
                        lp, lp.detach(), a[None], torch.ones_like(lp), aggregation="token-mean", num_tokens=n_tok
                    )
                    turn_loss.backward()
                    total = total + float(turn_loss.detach())
                assert float(loss.detach()) == pytest.approx(total, abs=tol)
                if adv.abs().sum() > 0:  # a gradient to compare (rollout 2's advantages are all 0)
                    assert any(float(p.grad.abs().max()) > 1e-3 for p in model.parameters())
                for ge, p in zip(g_episode, model.parameters()):
                    torch.testing.assert_close(ge, p.grad, atol=tol, rtol=0)
    finally:
        chat_policy.model.float()


def test_branching_replays_the_environment_and_continues_from_its_state(chat_policy):
    engine = TurnEngine(chat_policy.tokenizer, script)
    runner = EpisodeRunner(engine, chat_policy, Echo, Renderer(chat_policy), EpisodeLimits(4, 0))
    keys = [(streams.ROLLOUT, 0, 1, 0, g) for g in range(4)]
    episodes = runner.play([{"prompt": "go"}] * 4, keys, SamplingSettings(8, 1.0))
    again = runner.branch(episodes, 1, keys, SamplingSettings(8, 1.0))  # the same keys: the same second replies
    for e, b in zip(episodes, again):
        assert b.messages == e.messages and b.rewards == e.rewards and b.replies == e.replies
        assert [s.ids for s in b.segments] == [s.ids for s in e.segments] and b.done
    # other keys after turn 1: the first reply kept, the second the other rollouts'
    other = runner.branch(
        episodes, 1, [(streams.ROLLOUT, 0, 1, 0, (g + 1) % 4) for g in range(4)], SamplingSettings(8, 1.0)
    )
    assert [b.replies for b in other] == [[SCRIPT[g][0], SCRIPT[(g + 1) % 4][1]] for g in range(4)]


class Drifting(Echo):
    """Says something else each time it is played: branching must refuse it."""

    count = 0

    def step(self, text: str):
        Drifting.count += 1
        messages, reward, done = super().step(text)
        return [{"role": "user", "content": f"again {Drifting.count}"}] if messages else messages, reward, done


def test_branching_refuses_an_environment_that_does_not_replay(chat_policy):
    engine = TurnEngine(chat_policy.tokenizer, script)
    runner = EpisodeRunner(engine, chat_policy, Drifting, Renderer(chat_policy), EpisodeLimits(4, 0))
    keys = [(streams.ROLLOUT, 0, 1, 0, 0)]
    episodes = runner.play([{"prompt": "go"}], keys, SamplingSettings(8, 1.0))
    with pytest.raises(EnvError, match="replaying"):
        runner.branch(episodes, 1, keys, SamplingSettings(8, 1.0))


def test_the_environment_checks_name_what_is_wrong():
    import env_fixtures

    with pytest.raises(EnvError, match="has no reset method, so it fits neither shape"):
        check_env_class(env_fixtures.NoReset, "env_fixtures:NoReset")
    with pytest.raises(EnvError, match="needs the argument"):
        check_env_class(env_fixtures.NeedsArgs, "env_fixtures:NeedsArgs")
    with pytest.raises(EnvError, match="not a class"):
        check_env_class(env_fixtures.add, "env_fixtures:add")
    with pytest.raises(ConfigError, match="cannot load"):
        load_env_class("no_such_file.py:Env")
    with pytest.raises(ConfigError, match="cannot load"):
        load_env_class("env_fixtures:Nope")
    env = env_fixtures.BadStep()
    with pytest.raises(EnvError, match=r"BadStep.step returned .*expected a tuple \(messages, reward, done\)"):
        check_step(env.step("x"), env)
    env = env_fixtures.BadRole()
    with pytest.raises(EnvError, match="role 'assistant'"):
        check_step(env.step("x"), env)
    with pytest.raises(EnvError, match="expected a float"):
        check_step(([], "1", True), env)
    with pytest.raises(EnvError, match="must be finite"):
        check_step(([], math.nan, True), env)


def test_a_step_that_raises_ends_that_episode_and_is_counted(chat_policy):
    from env_fixtures import StepRaises

    roll, _ = _collect(chat_policy, StepRaises)
    assert roll.generated.episodes.env_errors == [1] * 4 and roll.generated.truncated == [True] * 4
    assert all("the game server went away" in e.error for e in roll.groups.rows.episodes)


def test_episode_config_is_validated():
    with pytest.raises(ConfigError, match="--env: needs --data"):
        TrainConfig(env="env_fixtures:Echo").validate()
    with pytest.raises(ConfigError, match="give one of"):
        TrainConfig(task="arith-multiturn", tools=("env_fixtures:add",)).validate()
    with pytest.raises(ConfigError, match="--max-turns"):
        TrainConfig(task="arith-multiturn", max_turns=0).validate()
    with pytest.raises(ConfigError, match="--overlong-buffer"):
        TrainConfig(task="arith-multiturn", overlong_buffer=4).validate()


# ---------------------------------------------------------------------- a trainer step on episodes
def _episode_data(tmp_path) -> tuple[str, str]:
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"go {i}", "id": i}) + "\n" for i in range(8)))
    test.write_text("".join(json.dumps({"prompt": f"go {100 + i}", "id": 100 + i}) + "\n" for i in range(2)))
    return str(train), str(test)


@pytest.mark.parametrize("advantage", ["grpo", "rtg-group", "rtg-mc"])
def test_a_trainer_step_updates_on_episodes(tmp_path, char_tokenizer, advantage):

    train, test = _episode_data(tmp_path)
    cfg = TrainConfig(
        out=str(tmp_path / "run"),
        env="env_fixtures:Echo",
        data=train,
        eval_data=test,
        advantage=advantage,
        branches=2,
        estimator="grpo",
        prompts_per_step=1,
        group_size=4,
        eval_questions=2,
        log_rollouts=True,
        log_token_credit=2,
        warmup_steps=0,
        lr=1e-3,
        max_new_tokens=8,
    )
    engine = TurnEngine(char_tokenizer, script)
    trainer = build_trainer(cfg, log=lambda *a: None, engine=engine)
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    out = trainer.step(1)
    m = out.metrics
    assert m["env/turns_mean"] == 2 and m["env/truncated"] == 0 and m["reward/stage1"] == 0.5
    assert m["reward/mean"] == 1.0 and m["reward/accuracy"] == 0.5  # return / max_return 2
    assert m["loss/active_frac"] > 0 and any(
        not torch.equal(a, b) for a, b in zip(before, trainer.policy.model.parameters())
    )
    assert [r["turn_rewards"] for r in out.rollouts] == [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]
    if advantage != "rtg-mc":  # rtg-mc's values come from branched continuations (the scripted ones: the same)
        first = [r["turn_advantages"] for r in out.rollouts]
        assert first == (
            [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [-1.0, -1.0]]
            if advantage == "grpo"
            else [[1.0, 0.0], [0.0, -1.0], [0.0, 0.0], [-1.0, -1.0]]
        )
    # the token records: the environment's tokens are context with no values; shares per turn
    for rec in out.token_credit:
        ctx = [i for i, s in enumerate(rec["segment"]) if s == "context"]
        assert ctx and all(rec["dlogp"][i] is None and rec["adv"][i] is None and rec["turn"][i] == -1 for i in ctx)
        assert "".join(rec["tokens"]) == rec["completion"]
    assert {"credit/turn1_share", "credit/turn2_share"} <= set(m)
    assert m["credit/turn1_share"] + m["credit/turn2_share"] == pytest.approx(1.0)
    # grpolab tokens --summary recomputes them from the records, one row per turn
    from grpolab.probes.token_credit import step_aggregates, summarise_credit
    from grpolab.report.token_view.terminal import summary_table

    (agg,) = step_aggregates([{"step": 1, **r} for r in out.token_credit])
    assert agg["turn1_share"] == pytest.approx(m["credit/turn1_share"])
    table = summary_table(summarise_credit([agg], 1))
    assert "turn 1: share of |dlogp|" in table and "turn 2: share of |dlogp|" in table
    trainer.close()


# ---------------------------------------------------------------------- what a user sees
@pytest.mark.slow
def test_the_cli_names_a_bad_environment_or_tool_in_one_line(tmp_path):
    from helpers.cli import run_cli

    train, test = _episode_data(tmp_path)
    base = ["train", "--data", train, "--eval-data", test, "--steps", "1", "--prompts-per-step", "1"]
    base += ["--group-size", "2", "--eval-questions", "1", "--max-new-tokens", "4", "--out"]
    fx = str(TESTS / "env_fixtures.py")  # by file: the CLI's process has no tests/ on its path
    cases = [
        (["--env", "missing.py:Env"], "--env: cannot load 'missing.py:Env': ImportError: no such file: missing.py"),
        (["--env", f"{fx}:NoReset"], f"--env {fx}:NoReset: NoReset has no reset method, so it fits neither shape"),
        (["--env", f"{fx}:BadStep"], "env_fixtures.BadStep.step returned ([], 1.0); expected a tuple"),
        (["--tools", f"{fx}:no_docstring"], f"--tools {fx}:no_docstring:"),
    ]
    for i, (args, words) in enumerate(cases):
        res = run_cli([*base, str(tmp_path / f"run{i}"), *args], tmp_path, timeout=300)
        err = res.stderr.strip().splitlines()
        assert res.returncode == 2 and err and err[-1].startswith("error: ") and words in err[-1], (args, res.stderr)
        assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_the_report_renders_an_episode_turn_by_turn(tmp_path):
    from grpolab.report.page import build_report

    conv = [
        {"role": "user", "content": "What is 2 * 3?"},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'},
        {"role": "tool", "name": "calculator", "content": "6 & <b>"},
        {"role": "assistant", "content": "2 * 3 = 6"},
    ]
    sample = {"kind": "eval", "question": "q", "completion": "2 * 3 = 6", "correct": True, "reward": 1.0}
    lines = [{"step": s, **sample, "conversation": conv, "opening": 1, "turn_rewards": [0.2, 0.0]} for s in (0, 5)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "config.json").write_text(json.dumps({"tools": ["calc.py:calculator"], "advantage": "rtg-group"}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy_greedy": 0.5}) + "\n")
    page = build_report(tmp_path).read_text()
    for part in (
        '<span class="role">user</span><pre>What is 2 * 3?</pre>',
        '<span class="role">turn 1 · reward 0.2</span>',
        '<span class="role">tool (calculator)</span><pre>6 &amp; &lt;b&gt;</pre>',  # escaped: a tool's text is data
        '<span class="role">turn 2 · reward 0</span><pre>2 * 3 = 6</pre>',
        "tools: calc.py:calculator",
        "rtg-group",
    ):
        assert part in page, part


def test_the_guessing_game_example_answers_each_guess(chat_policy):
    """examples/guess: the feedback follows the policy's guesses, the rewards their consistency, the game ends at the
    number or after four guesses; its accuracy reward reads the environment's last words."""
    from grpolab.common.loader import load_object

    root = REPO / "examples" / "guess"
    Guess = load_env_class(f"{root / 'env.py'}:Guess")
    found = load_object(f"{root / 'reward.py'}:found", "--reward-fn")
    guesses = {0: ["10", "15", "13"], 1: ["5", "I guess 3", "no idea", "20"]}
    engine = TurnEngine(chat_policy.tokenizer, lambda g, h: guesses[g][h])
    runner = EpisodeRunner(engine, chat_policy, Guess, Renderer(chat_policy), EpisodeLimits(8, 0))
    keys = [(streams.ROLLOUT, 0, 1, 0, g) for g in range(2)]
    a, b = runner.play([{"secret": 13}] * 2, keys, SamplingSettings(8, 1.0))
    assert a.rewards == [0.1, 0.1, 1.0] and a.done and not a.cut
    assert [m["content"] for m in a.messages[2::2]] == ["Higher. 3 guesses left.", "Lower. 2 guesses left.", "Correct!"]
    assert b.rewards == [0.1, 0.0, 0.0, 0.1] and b.done  # 3 is below what "higher" left; no number; 20 is in 6..20
    assert b.messages[-1]["content"] == "Lower. No guesses left: it was 13."
    assert found(None, [e.messages[e.opening :] for e in (a, b)]) == [1.0, 0.0]


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_episode_tokens_are_its_template_tokens():
    """On SmolLM2's byte-level BPE tokenizer and ChatML template (which adds a system prompt of its own): an episode's
    sequence (opening, each reply's own ids, the continuations) is exactly the tokenization of the template's
    rendering of the whole conversation, tools described in a system message; a tool result arrives as a tool turn."""
    from transformers import AutoTokenizer

    from grpolab.env.tools import load_tools
    from grpolab.models.loading import convert_gguf, resolve_gguf

    directory, name, _ = resolve_gguf("smollm2-135m-instruct", "")
    tok = AutoTokenizer.from_pretrained(convert_gguf(directory, name))  # as every SmolLM2 run loads it (load_gguf)
    policy = Policy(torch.nn.Linear(1, 1), tok, "smollm2", chat=True, system="")
    schemas = load_tools([f"{REPO / 'examples' / 'calculator' / 'tools.py'}:calculator"])
    renderer = Renderer(policy, schemas)
    assert not renderer.native_tools and renderer.tool_role == "tool"
    conversation = [{"role": "user", "content": "What is 347 * 582? Use the calculator tool."}]
    ids = renderer.opening(conversation)
    replies = ['<tool_call>{"name": "calculator", "arguments": {"expression": "347 * 582"}}</tool_call>', "201954."]
    answers = [[{"role": "tool", "content": "201954"}], [{"role": "user", "content": "Thanks! And 2+2?"}]]
    for reply, answer in zip(replies, answers):
        ids += tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as sampled: EOS last
        conversation.append({"role": "assistant", "content": reply})
        ids += renderer.continuation(conversation, True, answer)
        conversation += answer
    whole = tok.apply_chat_template(
        renderer.template_messages(conversation), tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(ids) == whole
    assert ids == tok(whole, add_special_tokens=False)["input_ids"]
    assert "<|im_start|>tool\n201954<|im_end|>" in whole and whole.count("You can use these tools:") == 1
