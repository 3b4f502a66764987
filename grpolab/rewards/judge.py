"""LLM judges: a prompt template, a model and a parser from the model's answer to a score, as one reward component.

``--judge FILE`` names the judge (:func:`read_judge`): a TOML file, or any other file whose whole text is the
template. The template is Jinja2 (the language of chat templates), rendered with ``prompt`` (the question: a chat
prompt's last user message, else the prompt's text), ``completion`` and every column of the rollout's data record;
a rubric's template also gets ``criterion`` (its text). A TOML judge::

    template = '''Word: {{ word }}. Question: {{ prompt }}
    Reply: {{ completion }}
    Is the reply's answer the last letter of the word? Answer yes or no.'''
    system = "You grade answers."      # optional: the judge's system message
    answer = "yes-no"                  # or "number": the first number in the answer, on `range`, scaled to [0, 1]
    range = [0, 10]                    # "number" only
    max_tokens = 8                     # the longest answer read

    [[criteria]]                       # optional: a rubric, each criterion asked on its own
    name = "correct"
    text = "The reply names the last letter."
    weight = 2.0

A rubric's reward is the weighted mean of its criteria's scores, each logged as ``reward/<judge>/<criterion>``.

``--judge-model`` is where the answers come from (:func:`load_judge`):

- a local model (a directory, a Hub id, ``smollm2-135m-instruct``) through grpolab's own rollout engines
  (``--judge-engine hf`` or ``vllm``), greedy, with each request keyed by its content: the same request gets the
  same answer on every run;
- an OpenAI-compatible endpoint (``http://HOST:PORT/v1``) through the ``openai`` client library: at most
  ``--judge-concurrency`` requests in flight, each with ``--judge-timeout`` seconds and ``--judge-retries``
  retries (the client's exponential backoff), greedy (temperature 0).

Every answer is cached by the request's content (model, messages, answer length; :func:`request_key`), in memory
and, with ``--judge-cache FILE``, in a JSONL file kept across runs: a repeated request is answered without a call
(counted, ``reward/judge_cache_hits``). A request that fails (the endpoint down or slow past its retries:
``reward/judge_unanswered``, and a line in the run's log with the last error) or an answer the parser cannot read
scores ``--judge-failure-score``, is counted (``reward/judge_failed``, both kinds) and is the share
``reward/judge_failed_frac`` of the step's requests: never a crash, never silent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib.util
import json
import re
import sys
import threading
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from grpolab.common.errors import ConfigError

FLAG = "--judge"
ANSWERS = ("yes-no", "number")
FAILED_FRAC = "judge_failed_frac"
"""The per-rollout column (and ``reward/`` metric) of the share of a rollout's judge requests that failed."""


# ---------------------------------------------------------------- the judge's file


@dataclasses.dataclass(frozen=True)
class Criterion:
    name: str
    text: str
    weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
    """What a ``--judge`` file says (module docstring)."""

    template: str
    name: str = "judge"
    system: str = ""
    answer: Literal["yes-no", "number"] = "yes-no"
    low: float = 0.0
    high: float = 10.0
    max_tokens: int = 8
    criteria: tuple[Criterion, ...] = ()


def read_judge(path: str | Path) -> JudgeSpec:
    """The judge in ``path``: a TOML file (``.toml``) or a plain template (any other file; yes-no answers). Named by
    the file's stem. Anything malformed is one ConfigError naming the file and what is wrong."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{FLAG} {path}: no such file")
    text = path.read_text()
    if path.suffix != ".toml":
        spec = JudgeSpec(template=text, name=path.stem)
    else:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{FLAG} {path}: not valid TOML ({e})") from None
        known = {"template", "system", "answer", "range", "max_tokens", "criteria"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{FLAG} {path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if not isinstance(raw.get("template"), str):
            raise ConfigError(f"{FLAG} {path}: needs template = '...' (the judge's message)")
        bounds = raw.get("range", [0, 10])
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise ConfigError(f"{FLAG} {path}: range must be [low, high], got {bounds!r}")
        low, high = (_typed(b, float, "range", path) for b in bounds)
        criteria = []
        for i, c in enumerate(raw.get("criteria", [])):
            if not isinstance(c, dict) or not isinstance(c.get("text"), str):
                raise ConfigError(f"{FLAG} {path}: criteria[{i}] needs text = '...'")
            name = str(c.get("name", f"c{i + 1}"))
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ConfigError(f"{FLAG} {path}: criterion name {name!r}: letters, digits, '_', '.', '-' only")
            weight = _typed(c.get("weight", 1.0), float, f"criteria[{i}].weight", path)
            criteria.append(Criterion(name, c["text"], weight))
        if len({c.name for c in criteria}) != len(criteria):
            raise ConfigError(f"{FLAG} {path}: two criteria share a name")
        if criteria and not sum(c.weight for c in criteria) > 0:
            raise ConfigError(f"{FLAG} {path}: the criteria's weights must sum to more than 0")
        spec = JudgeSpec(
            template=raw["template"],
            name=path.stem,
            system=str(raw.get("system", "")),
            answer=raw.get("answer", "yes-no"),
            low=low,
            high=high,
            max_tokens=_typed(raw.get("max_tokens", 8), int, "max_tokens", path),
            criteria=tuple(criteria),
        )
    if spec.answer not in ANSWERS:
        raise ConfigError(f"{FLAG} {path}: answer must be one of {ANSWERS}, got {spec.answer!r}")
    if not spec.high > spec.low:
        raise ConfigError(f"{FLAG} {path}: range must be [low, high] with high > low")
    if spec.max_tokens < 1:
        raise ConfigError(f"{FLAG} {path}: max_tokens must be >= 1")
    variables = template_variables(spec.template)
    if spec.criteria and "criterion" not in variables:
        raise ConfigError(f"{FLAG} {path}: a rubric's template must use {{{{ criterion }}}}")
    if not spec.criteria and "criterion" in variables:
        raise ConfigError(f"{FLAG} {path}: the template uses {{{{ criterion }}}} but no [[criteria]] are given")
    return spec


def _typed(value, kind: type, what: str, path: Path):
    """``value`` as ``kind`` (int, or float from an int or a float); a ConfigError naming the file and the key for
    anything else (a string, a boolean, a table)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise ConfigError(f"{FLAG} {path}: {what} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _environment():
    import jinja2

    # StrictUndefined: a variable the record lacks is an error, not an empty string in the judge's prompt.
    return jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def template_variables(template: str) -> set[str]:
    """The variables ``template`` reads (a syntax error: ConfigError)."""
    import jinja2
    import jinja2.meta

    try:
        return set(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{FLAG}: the template does not parse: {e.message} (line {e.lineno})") from None


# ---------------------------------------------------------------- the math: prompts in, scores out


def question_text(prompt: str | list[dict]) -> str:
    """The question a judge is shown: a chat prompt's last user message, else the prompt's text."""
    if isinstance(prompt, list):
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        return users[-1] if users else ""
    return prompt


def judge_messages(spec: JudgeSpec, template, prompt: str, completion: str, record: dict, criterion: str | None):
    """The chat messages of one request: ``spec``'s system message (when it has one), then the rendered template."""
    text = template.render({**record, "prompt": prompt, "completion": completion, "criterion": criterion})
    return ([{"role": "system", "content": spec.system}] if spec.system else []) + [{"role": "user", "content": text}]


_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_answer(answer: str, spec: JudgeSpec) -> float | None:
    """The score in [0, 1] an answer gives, or None (a malformed answer, a counted failure).

    yes-no: the first standalone "yes" or "no" (any case): 1 or 0. number: the first number, which must lie in
    ``[low, high]``, as ``(x - low) / (high - low)``."""
    if spec.answer == "yes-no":
        m = _YES_NO.search(answer)
        return None if m is None else float(m.group(1).lower() == "yes")
    m = _NUMBER.search(answer)
    if m is None:
        return None
    x = float(m.group(0))
    if not spec.low <= x <= spec.high:
        return None
    return (x - spec.low) / (spec.high - spec.low)


def rubric_reward(scores: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """Each rollout's reward from its criteria's scores ``[N][K]``: the weighted mean ``sum_k w_k s_k / sum_k w_k``."""
    total = sum(weights)
    return [sum(w * s for w, s in zip(weights, row)) / total for row in scores]


def request_key(model: str, messages: list[dict], max_tokens: int) -> str:
    """The cache key of a request: a SHA-256 of its content (model, messages, answer length), so the same question
    to the same model is the same key on any machine and in any order."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def request_seed(key: str) -> tuple[int, ...]:
    """A rollout key for the local engine from a request's cache key: its answer depends on its content alone."""
    return (int(key[:8], 16), int(key[8:16], 16))


class JudgeCache:
    """Answers by request key, in memory and, with ``path``, appended to a JSONL file (one ``{"key", "answer"}`` a
    line) that a later run reads back. A torn last line (a run killed while writing) is skipped and counted."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path).expanduser() if path else None
        self.answers: dict[str, str] = {}
        self.torn = 0
        self._lock = threading.Lock()
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self.answers[row["key"]] = row["answer"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    self.torn += 1

    def get(self, key: str) -> str | None:
        return self.answers.get(key)

    def put(self, new: dict[str, str]) -> None:
        with self._lock:
            self.answers.update(new)
            if self.path is not None and new:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write("".join(json.dumps({"key": k, "answer": a}) + "\n" for k, a in new.items()))


# ---------------------------------------------------------------- where the answers come from


class LocalBackend:
    """A local model's greedy answers: ``generate(prompt_ids, keys, max_new_tokens) -> texts`` is grpolab's rollout
    engine over ``policy`` (a :class:`grpolab.models.policy.Policy`; :func:`grpolab.rollout.engine.greedy_texts`,
    given by the layer above: rewards sit below the rollout engines), called in batches of ``batch_size`` requests
    sorted by length."""

    is_async = False

    def __init__(self, policy, generate: Callable, batch_size: int = 16, name: str = ""):
        self.policy, self.generate, self.batch_size = policy, generate, batch_size
        self.name = name or policy.source

    def _ids(self, messages: list[dict]) -> list[int]:
        tok = self.policy.tokenizer
        if tok.chat_template:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        text = "\n\n".join(m["content"] for m in messages) + "\n"
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        return bos + tok(text, add_special_tokens=False)["input_ids"]

    def answer(self, requests: list[tuple[str, list[dict]]], max_tokens: int) -> list[str | None]:
        """Each request's ``(key, messages)`` answer text."""
        ids = [self._ids(m) for _, m in requests]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out: list[str | None] = [None] * len(ids)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            texts = self.generate([ids[i] for i in rows], [request_seed(requests[i][0]) for i in rows], max_tokens)
            for i, t in zip(rows, texts):
                out[i] = t
        return out

    def close(self) -> None:
        close = getattr(self.generate, "close", None)
        if callable(close):
            close()


class EndpointBackend:
    """An OpenAI-compatible server's answers (``/v1/chat/completions``) through the ``openai`` client: at most
    ``concurrency`` requests in flight, each given ``timeout`` seconds and ``retries`` retries with the client's
    exponential backoff; a request that still fails answers None (a counted failure)."""

    is_async = True

    def __init__(self, url: str, model: str, *, api_key: str = "", concurrency: int = 8, timeout: float = 60.0,
                 retries: int = 2):  # fmt: skip
        self.url, self.name, self.api_key = url, model, api_key or "EMPTY"
        self.concurrency, self.timeout, self.retries = concurrency, timeout, retries
        self.last_error = ""

    def _client(self):
        from openai import AsyncOpenAI  # load_judge checked it is installed

        return AsyncOpenAI(base_url=self.url, api_key=self.api_key, timeout=self.timeout, max_retries=self.retries)

    async def answer(self, requests: list[tuple[str, list[dict]]], max_tokens: int) -> list[str | None]:
        # One client a call: asyncio.run gives each step its own event loop, and an async client's connections
        # belong to the loop that opened them.
        client = self._client()
        gate = asyncio.Semaphore(self.concurrency)

        async def one(messages: list[dict]) -> str | None:
            async with gate:
                try:
                    got = await client.chat.completions.create(
                        model=self.name, messages=messages, max_tokens=max_tokens, temperature=0.0
                    )
                    return got.choices[0].message.content or ""
                except Exception as e:  # the client's own retries are spent: a counted failure
                    self.last_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    return None

        try:
            return list(await asyncio.gather(*(one(m) for _, m in requests)))
        finally:
            await client.close()

    def close(self) -> None:
        pass


def served_model(url: str, api_key: str = "", timeout: float = 30.0) -> str:
    """The first model an OpenAI-compatible server at ``url`` lists (``/v1/models``); a ConfigError when it cannot
    be reached or lists none."""
    from openai import OpenAI

    try:
        with OpenAI(base_url=url, api_key=api_key or "EMPTY", timeout=timeout, max_retries=1) as client:
            models = [m.id for m in client.models.list()]
    except Exception as e:
        raise ConfigError(f"--judge-model {url}: cannot list the server's models ({type(e).__name__}: {e})") from None
    if not models:
        raise ConfigError(f"--judge-model {url}: the server lists no model; name one with --judge-served-model")
    return models[0]


# ---------------------------------------------------------------- the reward function


class JudgeScores(list):
    """A judge's rewards (a list of floats, as any reward function returns) with per-rollout ``details``: name ->
    ``[N]`` values the rewarder logs beside the reward (each criterion's score; the share of failed requests)."""

    def __init__(self, values: Sequence[float], details: dict[str, list[float]]):
        super().__init__(values)
        self.details = details


class Judge:
    """An LLM judge as a reward function in grpolab's form ``(completions, records) -> scores`` (module docstring).
    ``prompt_of(record)``: the prompt as the policy saw it; an endpoint judge's call returns an awaitable (the
    rewarder awaits it beside other async reward functions)."""

    flag = FLAG

    def __init__(self, spec: JudgeSpec, backend, prompt_of: Callable[[dict], Any], *, failure_score: float = 0.0,
                 cache: JudgeCache | None = None, name: str = ""):  # fmt: skip
        self.spec, self.backend, self.prompt_of = spec, backend, prompt_of
        self.failure_score, self.cache = failure_score, cache or JudgeCache()
        self.__name__ = name or spec.name
        self.template = _environment().from_string(spec.template)
        self.columns = tuple(sorted(template_variables(spec.template) - {"prompt", "completion", "criterion"}))
        self._counts = {"judge_requests": 0.0, "judge_cache_hits": 0.0, "judge_failed": 0.0, "judge_unanswered": 0.0}

    @property
    def details(self) -> list[str]:
        """The names of the per-rollout values logged beside the reward (:class:`JudgeScores`)."""
        return [f"{self.__name__}/{c.name}" for c in self.spec.criteria] + [FAILED_FRAC]

    def _requests(self, completions: list[str], records: list[dict]) -> list[tuple[str, list[dict]]]:
        """``N x K`` requests ``(key, messages)``, rollout-major (K: the criteria, or 1)."""
        criteria = [c.text for c in self.spec.criteria] or [None]
        out = []
        for c, r in zip(completions, records):
            prompt = question_text(self.prompt_of(r))
            for text in criteria:
                messages = judge_messages(self.spec, self.template, prompt, c, r, text)
                out.append((request_key(self.backend.name, messages, self.spec.max_tokens), messages))
        return out

    def _split(self, requests) -> tuple[list[str | None], list[int]]:
        """Cached answers (None where a call is needed) and the indices of the requests to send (one per key)."""
        answers = [self.cache.get(k) for k, _ in requests]
        todo, seen = [], set()
        for i, ((k, _), a) in enumerate(zip(requests, answers)):
            if a is None and k not in seen:
                todo.append(i)
                seen.add(k)
        self._counts["judge_cache_hits"] += sum(a is not None for a in answers)
        return answers, todo

    def _finish(self, requests, answers: list[str | None], todo: list[int], got: list[str | None]) -> JudgeScores:
        fresh = {requests[i][0]: a for i, a in zip(todo, got) if a is not None}
        self.cache.put(fresh)
        answers = [a if a is not None else self.cache.get(k) for (k, _), a in zip(requests, answers)]
        unanswered = sum(a is None for a in answers)  # the endpoint's errors, per request (repeats included)
        self._counts["judge_unanswered"] += unanswered
        if unanswered:  # said in the run's log as well as counted
            last = getattr(self.backend, "last_error", "")
            print(f"judge {self.__name__}: {unanswered} of {len(answers)} requests failed ({last})", file=sys.stderr)
        K = max(len(self.spec.criteria), 1)
        parsed = [None if a is None else parse_answer(a, self.spec) for a in answers]
        failed = [p is None for p in parsed]
        self._counts["judge_requests"] += len(requests)
        self._counts["judge_failed"] += sum(failed)
        scores = [self.failure_score if p is None else p for p in parsed]
        rows = [scores[n * K : (n + 1) * K] for n in range(len(scores) // K)]  # [N][K]
        values = rubric_reward(rows, [c.weight for c in self.spec.criteria]) if self.spec.criteria else scores
        details = {f"{self.__name__}/{c.name}": [row[k] for row in rows] for k, c in enumerate(self.spec.criteria)}
        details[FAILED_FRAC] = [sum(failed[n * K : (n + 1) * K]) / K for n in range(len(rows))]
        return JudgeScores(values, details)

    def __call__(self, completions: list[str], records: list[dict]):
        requests = self._requests(completions, records)
        answers, todo = self._split(requests)
        if self.backend.is_async:
            return self._answer_async(requests, answers, todo)
        got = self.backend.answer([requests[i] for i in todo], self.spec.max_tokens) if todo else []
        return self._finish(requests, answers, todo, got)

    async def _answer_async(self, requests, answers, todo) -> JudgeScores:
        got = await self.backend.answer([requests[i] for i in todo], self.spec.max_tokens) if todo else []
        return self._finish(requests, answers, todo, got)

    def pop_counts(self) -> dict[str, float]:
        """Since the last pop: requests, cache hits, failures (unanswered or unparsed) and of those the unanswered
        (the endpoint's errors past their retries); logged as ``reward/judge_*``."""
        out, self._counts = self._counts, dict.fromkeys(self._counts, 0.0)
        return out

    def start(self) -> str:
        where = self.backend.url if isinstance(self.backend, EndpointBackend) else "this process"
        kept = f", {len(self.cache.answers)} answers cached from {self.cache.path}" if self.cache.path else ""
        rubric = f", a rubric of {len(self.spec.criteria)} criteria" if self.spec.criteria else ""
        return f"judge {self.__name__}: {self.backend.name} ({where}){rubric}{kept}"

    def close(self) -> None:
        self.backend.close()


# ---------------------------------------------------------------- loading


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
    """The ``--judge-*`` options, the device resolved."""

    model: str
    engine: str = "hf"
    served_model: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    failure_score: float = 0.0
    concurrency: int = 8
    timeout: float = 60.0
    retries: int = 2
    batch_size: int = 16
    cache: str = ""
    device: str = "cpu"
    seed: int = 0


def is_endpoint(model: str) -> bool:
    return model.startswith(("http://", "https://"))


def load_judge(path: str, settings: JudgeSettings, prompt_of: Callable[[dict], Any], name: str = "",
               greedy: Callable | None = None) -> Judge:  # fmt: skip
    """The judge ``path`` describes, answering from ``settings.model`` (module docstring), logged as ``name``
    (default: the file's stem). ``greedy``: :func:`grpolab.rollout.engine.greedy_texts`, what a local model answers
    through."""
    import os

    spec = read_judge(path)
    if is_endpoint(settings.model):
        if importlib.util.find_spec("openai") is None:
            raise ConfigError(f"--judge-model {settings.model}: an endpoint needs the openai client: pip install openai "
                              "(or grpolab[judge])")  # fmt: skip
        key = os.environ.get(settings.api_key_env, "") if settings.api_key_env else ""
        name = settings.served_model or served_model(settings.model, key)
        backend = EndpointBackend(settings.model, name, api_key=key, concurrency=settings.concurrency,
                                  timeout=settings.timeout, retries=settings.retries)  # fmt: skip
    else:
        backend = _local_backend(settings, greedy)
    cache = JudgeCache(settings.cache or None)
    return Judge(spec, backend, prompt_of, failure_score=settings.failure_score, cache=cache, name=name)


def _local_backend(settings: JudgeSettings, greedy: Callable | None) -> LocalBackend:
    from grpolab.models.policy import load_policy

    if greedy is None:  # the caller (training, a probe) owns the rollout engines this layer may not import
        raise ValueError("a local judge needs greedy_texts (grpolab.rollout.engine) from its caller")
    policy = load_policy(settings.model, device=settings.device)
    policy.model.eval().requires_grad_(False)
    return LocalBackend(policy, greedy(policy, settings.engine, settings.seed), settings.batch_size, settings.model)


__all__ = [
    "Criterion",
    "EndpointBackend",
    "Judge",
    "JudgeCache",
    "JudgeScores",
    "JudgeSettings",
    "JudgeSpec",
    "LocalBackend",
    "load_judge",
    "parse_answer",
    "read_judge",
    "request_key",
    "rubric_reward",
]
