"""What the checks share: :class:`Check` (a check's name, how it runs, its run and its summary line), the
:class:`Context` they run in, :class:`Skip`, the random Qwen model over a padded character tokenizer, a run of it,
the hooks that keep a run's metrics, and the comparisons of two runs' metrics, rollouts and weights."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

# cuBLAS is deterministic only with a workspace set before CUDA starts (the checkpoint check asks for determinism)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # grpolab and benchmarks/ from this checkout

import torch  # noqa: E402

HOW = ("in-process", "background", "timed")
"""How a check runs: in this process, in order; in processes of its own, started before the first check and joined
before the first timed one (or at the end); in this process after those processes have ended, alone, as it times
things or fills the GPU."""
QWEN_CPU = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, vocab_size=1024)  # fmt: skip
"""--cpu: the Qwen model at these sizes (its layout kept; a vocabulary of 1,024, where 151,936 made each step 1.7 s)."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: the one place it is named. ``run`` returns its figures (the JSON's) and is where its pass rule
    (``passes``, in words) is enforced: it raises :class:`Skip` when the check cannot run here, and ``AssertionError`` (else any exception)
    saying what does not hold when it fails. An in-process or timed check's ``run`` takes the :class:`Context`; a
    background one's is a method of ``gpu_checks.processes.Background``, ``run(background, timeout)``, called once
    its processes have ended. ``summary`` puts the figures of a passed run in a few words for its line."""

    name: str
    how: str
    run: Callable[..., dict]
    summary: Callable[[dict], str]
    about: str
    """What it runs and compares, in a sentence or two, for ``--help``."""
    passes: str
    """Its pass rule in words, for ``--help`` and the docs: what ``run`` asserts (it raises when the rule fails)."""

    def __post_init__(self):
        if self.how not in HOW:
            raise ValueError(f"check {self.name}: how is one of {', '.join(HOW)}, not {self.how!r}")


class Skip(Exception):
    """A check (or part of one) that cannot run here; the message says why."""


@dataclasses.dataclass
class Context:
    device: torch.device
    cpu: bool
    work: Path

    @property
    def dev(self) -> str:
        return "cpu" if self.cpu else "cuda:0"

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None


def quiet(*args, **kwargs) -> None:
    """A ``log`` that says nothing: the check's line says what matters."""


def finite(x) -> bool:
    return x is not None and x == x and abs(x) != float("inf")


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:400]


def peak_text(x) -> str:
    """A summary's peak memory, or nothing where there is none (the CPU)."""
    return "" if x is None else f", peak {x:.2f} GiB"


def losses_text(xs) -> str:
    return ", ".join(f"{x:.3g}" for x in xs)


# ---------------------------------------------------------------- models, data and a reward


def qwen_shape(cpu: bool) -> dict:
    from benchmarks.decode_gpu import SHAPES

    return SHAPES["qwen2.5-0.5b"] | (QWEN_CPU if cpu else {})


_TOKENIZERS: dict[tuple, object] = {}


def padded_tokenizer(vocab: int, specials: tuple[str, ...] = ()):
    """The built-in character tokenizer with ``specials`` (matched whole) and filler tokens up to ``vocab`` entries,
    so every id the model can sample decodes (a filler decodes to ``<n>``)."""
    if (vocab, specials) not in _TOKENIZERS:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        from grpolab.models.builtin import CHARACTERS, SPECIAL_TOKENS

        tokens = list(SPECIAL_TOKENS + CHARACTERS + specials)
        tokens += [f"<{i}>" for i in range(vocab - len(tokens))]
        tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        _TOKENIZERS[vocab, specials] = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            pad_token="<pad>",
            bos_token="<bos>",
            eos_token="<eos>",
            unk_token="<unk>",
            additional_special_tokens=list(specials),
        )
    return _TOKENIZERS[vocab, specials]


def qwen(ctx: Context, seed: int = 0):
    """``(model, tokenizer)``: the Qwen2.5-0.5B-shaped model (--cpu: :data:`QWEN_CPU`), random, fp32, on the device."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = qwen_shape(ctx.cpu)
    tok = padded_tokenizer(shape["vocab_size"])
    config = Qwen2Config(**shape, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id)  # fmt: skip
    torch.manual_seed(seed)
    with ctx.device:  # initialised where it runs: seconds on a GPU for 0.5 B weights
        model = Qwen2ForCausalLM(config)
    return model, tok


ROWS = [{"prompt": f"Write some digits, {i}:"} for i in range(64)]
"""Prompts for the random models; :func:`digit_share` scores their completions."""


def digit_share(completions, **columns) -> list[float]:
    """The share of a completion's characters that are digits: random models' completions differ in it, so every
    group has reward variance and a gradient."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # chat runs: the messages
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def check_learning_signal(metrics: list[dict]) -> None:
    """Every step scored without a reward error and had rollouts with an advantage: else the check measured nothing."""
    errors = sum(m.get("reward/errors") or 0 for m in metrics)
    active = [m.get("loss/active_frac") or 0 for m in metrics]
    if errors or not all(active):
        raise AssertionError(f"the run had no learning signal: {errors} reward errors, active shares {active}")


def run_args(ctx: Context, out: Path, steps: int, *extra: str, precision: str = "32-true") -> list[str]:
    """``grpolab train`` of the built-in model for ``steps`` steps on the device in ``precision``, into ``out``."""
    return [
        "train", "--out", str(out), "--steps", str(steps), "--device", ctx.dev, "--prompts-per-step", "4",
        "--group-size", "4", "--max-new-tokens", "24", "--eval-questions", "8", "--eval-samples", "0",
        "--warmup-steps", "0", "--threads", "1", "--log-rollouts", "--no-progress", "--doctor", "off",
        "--precision", precision, *extra,
    ]  # fmt: skip


class Recorder:
    """Run hooks (``grpolab.training.recipe.RunHooks``) that keep the recipe and each step's metrics, and call
    ``on_begin(trainer)`` / ``on_step(trainer, step, metrics)``."""

    def __init__(self, on_begin: Callable | None = None, on_step: Callable | None = None):
        from grpolab.training.recipe import RunHooks

        recorder = self

        class Hooks(RunHooks):
            def begin(self, recipe):
                recorder.trainer = recipe.trainer
                if on_begin is not None:
                    on_begin(recipe.trainer)

            def step_end(self, step, metrics, saved):
                recorder.metrics.append(dict(metrics))
                if on_step is not None:
                    on_step(recorder.trainer, step, metrics)
                return False

        self.trainer = None
        self.metrics: list[dict] = []
        self.hooks = Hooks()


def train_qwen(ctx: Context, out: Path, model, tok, steps: int, hooks=None, **options):
    import grpolab

    fields = dict(train_dataset=ROWS, reward_funcs=[digit_share], eval_fraction=0, chat="off", prompts_per_step=4,
                  group_size=4, max_new_tokens=16 if ctx.cpu else 64, warmup_steps=0, progress=False, doctor="off",
                  device=ctx.dev, seed=0, save_every=0)  # fmt: skip
    return grpolab.train(model=model, tokenizer=tok, out=str(out), steps=steps, log=quiet, hooks=hooks,
                         **(fields | options))  # fmt: skip


# ---------------------------------------------------------------- comparing runs


def metric_rows(run: Path) -> list[dict]:
    from grpolab.training.runlog import read_metrics

    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(run / "metrics.jsonl")]


def train_rows(run: Path) -> list[dict]:
    """:func:`metric_rows` without the evaluations (and the honeypots drawn with them), but for the last step's."""
    rows = metric_rows(run)
    evaluation = ("eval/", "hacking/honeypot", "time/honeypot")
    return [{k: v for k, v in r.items() if not k.startswith(evaluation)} for r in rows[:-1]] + rows[-1:]


def rollouts(run: Path) -> list[dict]:
    path = run / "rollouts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def last_weights(run: Path) -> dict[str, torch.Tensor]:
    """The weights of ``run``'s newest checkpoint (verified against its manifest)."""
    from grpolab.models.checkpoint import load_tensors, newest_intact

    return load_tensors(newest_intact(run)[1], "model.safetensors")


def weight_difference(a: Path, b: Path) -> float:
    """The largest relative difference ``|wa - wb| / |wa|`` (norms per tensor) of two runs' last weights."""
    wa, wb = last_weights(a), last_weights(b)
    if wa.keys() != wb.keys():
        raise AssertionError(f"the checkpoints hold different tensors: {sorted(wa.keys() ^ wb.keys())[:3]}")
    return max(float((wa[k].float() - wb[k].float()).norm() / wa[k].float().norm().clamp_min(1e-30)) for k in wa)


def metric_difference(a: Path, b: Path) -> float:
    """The largest relative difference of two runs' logged metrics (times and the engine's float noise aside)."""
    worst = 0.0
    for x, y in zip(metric_rows(a), metric_rows(b), strict=True):
        for k, v in x.items():
            if k.startswith(("engine/", "credit/")) or not isinstance(v, int | float) or y.get(k) is None:
                continue
            worst = max(worst, abs(y[k] - v) / max(abs(v), 1e-6))
    return worst
