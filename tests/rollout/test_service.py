"""Every rollout any command draws goes through one RolloutService, from an engine built by one function.

The engine factory (``build_engine``) is replaced, wherever it is bound, by one that returns a scripted engine;
the service's drawing methods are wrapped to note when a draw is under way. Training, ``grpolab eval``, the rank
probe and ``multiturn`` then run in this process: every generation the engine is asked for must happen inside a
draw of the service, each command must draw, and the evaluation, the probe and the measurement build no
``TrainConfig`` (they read a run's options through its sections)."""

from __future__ import annotations

import sys

import pytest
from helpers.engines import ScriptedEngine
from helpers.runs import quiet

import grpolab.rollout.placement as engine_module
from grpolab.config.train import TrainConfig
from grpolab.models.policy import load_policy
from grpolab.rollout.service import RolloutService


class Ledger:
    """What the scripted engines were asked for, and whether a service draw was open at the time."""

    def __init__(self):
        self.open_draws = 0
        self.inside = 0  # rows generated during a service draw
        self.outside = 0  # rows generated with no draw open: a rollout that bypassed the service
        self.engines_built = 0
        self.configs_built = 0


@pytest.fixture()
def ledger(monkeypatch):
    book = Ledger()
    original = engine_module.build_engine
    tokenizer = load_policy("builtin").tokenizer  # every run here is the built-in model's

    class Counted(ScriptedEngine):
        def generate(self, prompts, keys, settings, media=None):
            if book.open_draws:
                book.inside += len(keys)
            else:
                book.outside += len(keys)
            return super().generate(prompts, keys, settings)

    def scripted_build_engine(spec, model, say=None):
        book.engines_built += 1
        return Counted(tokenizer)

    for module in list(sys.modules.values()):  # every module that bound the factory by name
        if getattr(module, "__name__", "").startswith("grpolab") and getattr(module, "build_engine", None) is original:
            monkeypatch.setattr(module, "build_engine", scripted_build_engine)

    def drawing(method):
        def wrapped(self, *args, **kwargs):
            book.open_draws += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                book.open_draws -= 1

        return wrapped

    for name in ("play", "branch"):
        monkeypatch.setattr(RolloutService, name, drawing(getattr(RolloutService, name)))
    init = TrainConfig.__init__

    def counted_init(self, *args, **kwargs):
        book.configs_built += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(TrainConfig, "__init__", counted_init)
    return book


def _step(book: Ledger, run) -> tuple[int, int, int, int]:
    """Run ``run()``; the rows drawn inside and outside the service, engines and TrainConfigs built meanwhile."""
    before = (book.inside, book.outside, book.engines_built, book.configs_built)
    run()
    after = (book.inside, book.outside, book.engines_built, book.configs_built)
    return tuple(a - b for a, b in zip(after, before))


@pytest.mark.slow
def test_training_evaluation_a_probe_and_multiturn_draw_only_through_the_service(ledger, tmp_path):
    from grpolab.analysis.multiturn import MultiturnConfig, run_multiturn
    from grpolab.analysis.rank import RankConfig, run_rank
    from grpolab.commands.eval import EvalConfig, run_eval
    from grpolab.training.recipe import train

    run = tmp_path / "run"
    cfg = TrainConfig(
        steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_every=1, eval_questions=4,
        out=str(run), progress=False, threads=1,
    )  # fmt: skip
    trained = _step(ledger, lambda: train(cfg, log=quiet))
    evaluated = _step(
        ledger, lambda: run_eval(EvalConfig(model=str(run), questions=4, samples=2, progress=False), quiet)
    )
    rank = RankConfig(checkpoint=str(run), group_sizes=(2,), prompts=2, progress=False, out=str(tmp_path / "rank"))
    probed = _step(ledger, lambda: run_rank(rank, log=quiet))
    turns = MultiturnConfig(
        env="arith", stages=2, group_size=2, episodes=2, branches=2, bootstrap=10, max_new_tokens=8,
        out=str(tmp_path / "mt"),
    )  # fmt: skip
    measured = _step(ledger, lambda: run_multiturn(turns, log=quiet))

    # training: 2 steps x 2 prompts x 2 rollouts, plus its evaluations (4 questions, before and after each step)
    assert trained[0] >= 2 * 2 * 2 + 4 and trained[2] >= 1
    assert evaluated[0] == 4 * (1 + 2) and evaluated[2] == 1  # 4 questions: greedy and 2 samples, one engine
    assert probed[0] > 0 and probed[2] >= 1
    assert measured[0] > 0 and measured[2] >= 1  # episodes' turns and the rtg-mc branches
    assert [s[1] for s in (trained, evaluated, probed, measured)] == [0, 0, 0, 0]  # nothing bypassed the service
    assert [s[3] for s in (evaluated, probed, measured)] == [0, 0, 0]  # no TrainConfig outside training
