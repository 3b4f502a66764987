"""Tools (``--tools``): their schemas and the text protocol, parsing calls, the worker that runs them (a right call,
a wrong name, bad arguments, a raising, a hanging and a huge tool), and the tool environment inside episodes and a
trainer step."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from env_fixtures import TurnEngine
from helpers.processes import within

from grpolab.common import streams
from grpolab.config.train import ConfigError
from grpolab.env import EpisodeLimits, Renderer
from grpolab.env.tool_env import ToolEnvironment
from grpolab.env.tools import ToolRunner, load_tools, parse_tool_calls, tool_instructions
from grpolab.models.policy import Policy
from grpolab.rollout.engine import SamplingSettings
from grpolab.rollout.episodes import EpisodeRunner
from grpolab.training.recipe import build_trainer

SPECS = ["env_fixtures:add", "env_fixtures:divide", "env_fixtures:sleepy", "env_fixtures:huge", "env_fixtures:shout"]


@pytest.fixture(scope="module")
def runner():
    r = ToolRunner(SPECS, timeout_s=2.0, max_chars=100)
    yield r
    r.close()


def test_schemas_come_from_hints_and_docstrings():
    (add,) = load_tools(["env_fixtures:add"])
    assert add["function"]["name"] == "add" and add["function"]["description"] == "Add two integers."
    assert add["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first"}
    with pytest.raises(ConfigError, match="no_docstring.*docstring"):
        load_tools(["env_fixtures:no_docstring"])
    with pytest.raises(ConfigError, match="cannot load"):
        load_tools(["no_such_tools.py:add"])
    with pytest.raises(ConfigError, match="share a name"):
        load_tools(["env_fixtures:add", "env_fixtures:add"])
    text = tool_instructions(load_tools(["env_fixtures:add"]))
    assert "- add(a: integer, b: integer): Add two integers." in text and "<tool_call>" in text


def test_an_async_tool_is_described_and_awaited():
    import env_fixtures

    from grpolab.env.tool_worker import answer

    (schema,) = load_tools(["env_fixtures:add_later"])
    assert schema["function"]["name"] == "add_later" and set(schema["function"]["parameters"]["properties"]) == {
        "a",
        "b",
    }
    reply = answer({"add_later": env_fixtures.add_later}, {"name": "add_later", "arguments": {"a": 2, "b": 40}}, 100)
    assert reply == {"text": "42", "error": "", "truncated": False}


def test_tool_calls_are_parsed_from_the_text_protocol():
    calls = parse_tool_calls(
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
        '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 0}"}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 3'
    )
    assert [(c.name, c.arguments, bool(c.error)) for c in calls] == [
        ("add", {"a": 1, "b": 2}, False),
        ("divide", {"a": 1, "b": 0}, False),  # arguments written as a JSON string
        ("", {}, True),  # cut off at the end of the reply: not JSON
    ]
    assert parse_tool_calls("no call here") == []
    (bad,) = parse_tool_calls('<tool_call>["add"]</tool_call>')
    assert "expected" in bad.error


@pytest.mark.slow
def test_each_kind_of_call_gets_its_tool_message(runner):
    ok = runner.call("add", {"a": 2, "b": 40})
    assert (ok.text, ok.error) == ("42", "")
    assert runner.call("shout", {"text": "hi"}).text == "HI"  # its print went elsewhere
    wrong = runner.call("subtract", {"a": 1})
    assert wrong.error == "unknown tool" and wrong.text.startswith("error: unknown tool 'subtract'")
    bad = runner.call("add", {"a": 1, "b": 2, "c": 3})
    assert bad.error == "bad arguments" and "unexpected keyword argument 'c'" in bad.text
    missing = runner.call("add", {"a": 1})
    assert missing.error == "bad arguments" and "missing a required argument: 'b'" in missing.text
    raised = runner.call("divide", {"a": 1, "b": 0})
    assert raised.error == "raised" and raised.text == "error: divide raised ZeroDivisionError: division by zero"
    t0 = time.monotonic()
    hung = runner.call("sleepy", {"seconds": 60})
    assert hung.error == "timeout" and hung.text == "error: sleepy did not return within 2 s"
    assert time.monotonic() - t0 < 10
    assert runner.call("add", {"a": 1, "b": 1}).text == "2"  # a new worker takes the next call


@pytest.mark.slow  # it stops a worker and starts another
def test_a_call_bigger_than_the_pipe_to_a_stopped_worker_is_a_timeout_and_the_next_call_gets_a_new_worker(runner):
    """The call's 200 KB of arguments are written against the call's deadline: a worker stopped (SIGSTOP) before it
    reads them is killed at the timeout (2 s), instead of the write waiting for ever on a full pipe."""
    import signal

    assert runner.call("add", {"a": 1, "b": 1}).text == "2"  # a worker is up
    stopped = runner._proc
    os.kill(stopped.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    got = within(30, lambda: runner.call("shout", {"text": "a" * 200_000}))
    assert got.error == "timeout" and "did not take the call to shout within 2 s" in got.text
    assert time.monotonic() - t0 < 10 and stopped.poll() is not None  # killed (SIGKILL needs no SIGCONT)
    assert runner.call("add", {"a": 2, "b": 2}).text == "4"


@pytest.mark.slow
def test_a_1gb_result_costs_one_turn_and_one_line():
    # Its own runner, with room for building a 1 GB string while another test loads the machine (the shared runner's
    # 2 s is for the timeout test); what is tested is the cut, not the speed.
    runner = ToolRunner(SPECS, timeout_s=30.0, max_chars=100)
    try:
        result = runner.call("huge", {"megabytes": 1024})
    finally:
        runner.close()
    assert result.truncated and not result.error
    first, note = result.text.split("\n")
    assert first == "x" * 100 and note == "[... truncated: 1,073,741,824 characters, the first 100 kept]"


@pytest.fixture()
def chat_policy(tiny_model, char_tokenizer):
    import copy

    tok = copy.deepcopy(char_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return Policy(tiny_model, tok, "tiny", chat=True, system="")


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
REPLIES = {
    0: [CALL, "5"],  # a right call, then the answer
    1: ['<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "6"],  # a wrong name
    2: ['<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>', "7"],  # bad arguments
    3: ["5"],  # no call: the answer at once
}


@pytest.mark.slow
def test_tool_episodes_run_calls_and_end_at_a_reply_without_one(chat_policy, runner):
    schemas = load_tools(SPECS)
    renderer = Renderer(chat_policy, schemas)
    assert not renderer.native_tools  # this template ignores tools=: they are described in a system message
    engine = TurnEngine(chat_policy.tokenizer, lambda g, h: REPLIES[g][h])
    play = EpisodeRunner(engine, chat_policy, lambda: ToolEnvironment(runner, schemas), renderer, EpisodeLimits(4, 0))
    keys = [(streams.ROLLOUT, 0, 1, 0, g) for g in range(4)]
    episodes = play.play([{"prompt": "2+3?"}] * 4, keys, SamplingSettings(80, 1.0))
    opening = chat_policy.tokenizer.decode(engine.calls[0][0][0])
    assert opening.startswith("system: You can use these tools:") and "- add(a: integer, b: integer)" in opening
    assert [e.turns for e in episodes] == [2, 2, 2, 1] and all(e.done for e in episodes)
    tool_messages = [[m["content"] for m in e.messages if m["role"] == "tool"] for e in episodes]
    assert tool_messages[0] == ["5"]
    assert tool_messages[1] == [f"error: unknown tool 'mul' (tools: {', '.join(s.split(':')[1] for s in SPECS)})"]
    assert tool_messages[2][0].startswith("error: add: bad arguments:")
    assert tool_messages[3] == []
    assert [(e.counter("tool_calls"), e.counter("tool_errors")) for e in episodes] == [(1, 0), (1, 1), (1, 1), (0, 0)]


def test_a_template_that_shows_tools_gets_them(chat_policy):
    tok = chat_policy.tokenizer
    tok.chat_template = (
        "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}<eos>\n"
        "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    renderer = Renderer(chat_policy, load_tools(["env_fixtures:add"]))
    assert renderer.native_tools
    assert tok.decode(renderer.opening([{"role": "user", "content": "hi"}])) == (
        "tools: add<eos>\nuser: hi<eos>\nassistant: "
    )


@pytest.mark.slow
def test_a_trainer_step_with_tools_counts_calls_and_errors(tmp_path, char_tokenizer):

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"2+3? ({i})", "answer": "5"}) + "\n" for i in range(8)))
    test.write_text(json.dumps({"prompt": "2+3? (test)", "answer": "5"}) + "\n")
    reward = tmp_path / "right.py"
    reward.write_text(
        "def right(prompts, completions, answer, **kw):\n"
        "    last = [c if isinstance(c, str) else c[-1]['content'] for c in completions]  # plain runs: the text\n"
        "    return [float(t.strip() == a) for t, a in zip(last, answer)]\n"
    )
    from grpolab.config.train import TrainConfig

    cfg = TrainConfig(
        out=str(tmp_path / "run"),
        tools=("env_fixtures:add",),
        data=str(train),
        eval_data=str(test),
        reward_fn=(f"{reward}:right",),
        chat="off",
        prompts_per_step=1,
        group_size=4,
        eval_questions=1,
        warmup_steps=0,
        max_new_tokens=80,
        estimator="grpo",
    )
    engine = TurnEngine(char_tokenizer, lambda g, h: REPLIES[g][h])
    trainer = build_trainer(cfg, log=lambda *a: None, engine=engine)
    m = trainer.step(1).metrics
    # evaluation plays the same episodes: the held-out question's greedy episode (scripted as rollout 0) calls the
    # tool once and answers 5
    ev, examples = trainer.evaluate(1)
    trainer.close()
    assert ev["eval/tool_call_frac_greedy"] == 1.0 and ev["eval/turns_greedy"] == 2.0
    assert ev["eval/accuracy_greedy"] == 1.0 and [m["role"] for m in examples[0]["conversation"]][-2:] == [
        "tool",
        "assistant",
    ]
    # rollouts 0 and 3 answer 5 (right), 1 and 2 answer 6 and 7; three calls, two of them errors
    assert m["env/tool_calls"] == 3 and m["env/tool_errors"] == 2 and m["env/tool_call_frac"] == 0.75
    assert m["reward/right"] == 0.5 and m["env/turns_mean"] == 1.75 and m["loss/active_frac"] == 1.0
    assert torch.isfinite(torch.tensor(m["grad/norm"]))
