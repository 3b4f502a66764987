"""The task: the policy and its prompts, the records (data files or the built-in arithmetic) and episodes of environments or tools."""

from __future__ import annotations

import dataclasses
from typing import Literal

from grpolab.config.fields import bad, check_counts, takes_object

# The built-in task's question categories [U-statistic, Sec. 5.1] (grpolab.data.arithmetic generates them).
CATEGORIES = ("add_sub_2", "add_sub_3", "mul", "div", "paren")
# How data rows become records (grpolab.data.dataset); auto is resolved from the rows before a run.
DATA_FORMATS = ("auto", "prompt", "gsm8k", "math", "rows", "self")
# How a step's training records come from --data (grpolab.data.jsonl.ListSampler).
DATA_ORDERS = ("replacement", "shuffle", "sequential")


@dataclasses.dataclass(frozen=True)
class PolicySection:
    """The policy: which model, and whether LoRA adapters train instead of its weights."""

    model: str = dataclasses.field(default="builtin", metadata=takes_object("model", "model"))
    """'builtin' (the shipped SFT warm start of the tiny Llama), 'builtin-vlm' (the shipped tiny LLaVA that counts
    shapes), 'smollm2-135m-instruct', a local Hugging Face model directory (or a LoRA adapter's; a vision-language
    model's with its processor), a .gguf file, or a Hugging Face Hub id (org/name: downloaded, or read from the
    Hugging Face cache offline; a local path of that name wins)."""
    revision: str = ""
    """The branch, tag or commit of a Hub --model (default main); config.json records the commit it resolved to."""
    gguf_file: str = ""
    """A GGUF file inside the --model directory or Hub repository (only that file is fetched), or give --model
    PATH.gguf, or --model smollm2-135m-instruct."""
    lora_rank: int = 0
    """If > 0, train LoRA adapters of this rank (peft) on the --lora-targets layers instead of the full model;
    the KL reference is the same model with the adapter disabled; checkpoints hold the adapter."""
    lora_alpha: float = 0.0
    """LoRA scaling alpha; 0 = 2 x rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA adapters' input (peft's lora_dropout), in [0, 1). Training turns every dropout off,
    this one included, unless --keep-dropout."""
    train_vision_tower: bool = False
    """Vision-language models: train the vision tower too. By default it is frozen (its output is then computed once
    per prompt per step) and the language model and the projector train; LoRA adapts the language model only."""
    lora_targets: str = "all-linear"
    """The layers that get LoRA adapters: 'all-linear' (every linear layer but the output head) or a comma-separated
    list of module names (peft's target_modules), e.g. 'q_proj,v_proj'. A resumed or merged checkpoint uses the
    layers its adapter_config.json names."""

    @property
    def lora_modules(self) -> str | list[str]:
        """--lora-targets as peft's target_modules: 'all-linear', or the list of module names."""
        if self.lora_targets == "all-linear":
            return self.lora_targets
        return [name.strip() for name in self.lora_targets.split(",") if name.strip()]

    def validate(self) -> None:
        check_counts(self, non_negative=("lora_rank",))
        if not 0 <= self.lora_dropout < 1:
            raise bad("lora_dropout", f"must be in [0, 1), got {self.lora_dropout:g}")
        if not self.lora_modules:
            example = "'all-linear' or module names, e.g. 'q_proj,v_proj'"
            raise bad("lora_targets", f"must be {example}, got {self.lora_targets!r}")


@dataclasses.dataclass(frozen=True)
class PromptSection:
    """How a record becomes the policy's prompt."""

    chat: Literal["auto", "on", "off", "rows"] = "auto"
    """Prompt through the tokenizer's chat template (a system instruction on the answer format, the
    question as the user turn): auto = when the model has a template (instruct models), never for builtin; rows =
    each row by its prompt's form, as TRL's trainer does: a prompt of chat messages through the template, a text
    prompt tokenized as it is (no template, no system instruction), its completions given to reward functions as
    strings."""
    system_prompt: str = ""
    """The system instruction of chat prompts; empty = the default for --format (arithmetic/GSM8K: work step by
    step and end with '#### <answer>'; MATH: put the answer in \\boxed{})."""
    few_shot: int = 0
    """Solved examples from the training split put before each question."""

    def validate(self) -> None:
        check_counts(self, non_negative=("few_shot",))


@dataclasses.dataclass(frozen=True)
class Ref:
    """Which part of a Hub data set (or a directory of one) to read."""

    config: str = ""
    """Its configuration; empty = its default (the only one, or the one named ``default``)."""
    revision: str = ""
    """A Hub id's branch, tag or commit; empty = main."""
    default_split: str = "train"
    """The split read when none is given and the data set has several."""
    flag: str = "--data"
    """The option that named it, for errors."""


TRAIN_DATA = Ref()
"""--data's default configuration, revision and split."""


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The task's records: data files, their format and the held-out split."""

    format: Literal["auto", "prompt", "gsm8k", "math", "rows", "self"] = "auto"
    """How --data/--eval-data rows become records: prompt (the --prompt-column holds a string or a list of chat
    messages; every other column reaches the reward functions), gsm8k ({question, answer ending '#### n'}), math
    ({problem, solution with \\boxed{...}}, answers compared with math-verify), rows (every column as it is: an
    --env's records), self (no data: an --env in TRL's shape samples its own task from each group's task seed), or
    auto: rows with --env (self without --data, for a TRL-shape --env), else prompt when the rows have the prompt
    column, else the preset whose fields they have (recorded resolved in config.json)."""
    data: str = dataclasses.field(default="", metadata=takes_object("data", "train_dataset"))
    """Training data: a .jsonl, .json, .csv or .parquet file, a directory written by datasets' save_to_disk or holding
    a data set's files (a clone of a Hub data set), or a Hugging Face Hub data set id (org/name: downloaded, or read
    from the Hugging Face cache offline; a local path of that name wins); empty = generate arithmetic questions."""
    data_config: str = ""
    """The configuration (subset) of a Hub or directory data set given as --data, e.g. 'main' for openai/gsm8k
    (default: its default one)."""
    data_revision: str = ""
    """The branch, tag or commit of Hub data sets (--data and --eval-data; default main)."""
    data_split: str = ""
    """The split of --data when it has several (default: its only split, else 'train')."""
    eval_data: str = dataclasses.field(default="", metadata=takes_object("data", "eval_dataset"))
    """Held-out data, in the same forms as --data; empty = --eval-fraction of --data, or the built-in test set."""
    eval_config: str = ""
    """The configuration of --eval-data (default: --data-config when --eval-data is the same data set)."""
    eval_split: str = ""
    """The split of --eval-data when it has several (default: its only split, else 'test'; the same data set as
    --data: 'test')."""
    eval_fraction: float = 0.1
    """With --data and no --eval-data: hold out this fraction of --data's distinct prompts for evaluation (chosen by
    --seed; no training prompt is among them). 0 = no held-out evaluation (gsm8k data: the built-in test set)."""
    prompt_column: str = "prompt"
    """The column that holds each row's prompt (prompt-format data)."""
    data_order: Literal["replacement", "shuffle", "sequential"] = "replacement"
    """How each step's prompts come from --data's training records: replacement (drawn independently, with
    replacement, by --seed and step), shuffle (epochs: each a permutation of the records by --seed and epoch, taken
    a step's prompts at a time; TRL's shuffle_dataset) or sequential (epochs in the records' order). shuffle and
    sequential drop an epoch's last, incomplete chunk of prompts, as TRL does; rounds after the first of --sampling
    filter draw with replacement."""

    def source(self, held_out: bool = False):
        """Which configuration, revision and default split of --data (``held_out``: of --eval-data) to read."""
        if not held_out:
            return Ref(self.data_config, self.data_revision, "train", "--data")
        config = self.eval_config or (self.data_config if self.eval_data == self.data else "")
        return Ref(config, self.data_revision, "test", "--eval-data")

    @property
    def free_form(self) -> bool:
        """Prompt, rows or self-sampled records: no built-in answer check, no solved examples."""
        return self.format in ("prompt", "rows", "self")

    def validate(self) -> None:
        """Data files, their format, the held-out split."""
        if self.format not in DATA_FORMATS:
            raise bad("format", f"must be one of {DATA_FORMATS}, got {self.format!r}")
        if not 0 <= self.eval_fraction < 1:
            raise bad("eval_fraction", f"must be in [0, 1), got {self.eval_fraction:g}")
        if self.data_order not in DATA_ORDERS:
            raise bad("data_order", f"must be one of {DATA_ORDERS}, got {self.data_order!r}")
        if self.data_order != "replacement" and not self.data:
            raise bad("data_order", f"{self.data_order} needs --data (without it each step's questions are new)")
        if self.format == "auto":  # the checks below need the format, resolved from the data before a run
            return
        if self.format == "self" and (self.data or self.eval_data):
            raise bad("format", "self (an environment samples its own task) takes no --data or --eval-data")
        if self.free_form and self.format != "self" and not (self.data or self.eval_data):
            raise bad("format", f"{self.format} needs --data or --eval-data")
        if self.format == "math" and not self.data:
            raise bad("format", "math needs --data in MATH format (the built-in task is numeric)")


@dataclasses.dataclass(frozen=True)
class ArithmeticSection:
    """The built-in arithmetic task's question space [U-statistic, Sec. 5.1]."""

    max_operand: int = 99
    """Arithmetic: largest operand (two digits by default)."""
    mul_max: int = 9
    """Arithmetic: largest multiplier and divisor."""
    categories: tuple[str, ...] = CATEGORIES
    """Arithmetic: question categories sampled uniformly."""

    def validate(self) -> None:
        """The built-in task's question space."""
        unknown = set(self.categories) - set(CATEGORIES)
        if unknown or not self.categories:
            raise bad("categories", f"must be a non-empty subset of {CATEGORIES}, got {self.categories}")
        if self.max_operand < 10 or not 2 <= self.mul_max <= self.max_operand:
            raise bad(
                "max_operand",
                f"need max_operand >= 10 and 2 <= mul_max <= max_operand, got {self.max_operand}, {self.mul_max}",
            )


@dataclasses.dataclass(frozen=True)
class EpisodesSection:
    """Episodes: an environment, tools or the built-in dialogue, and their limits."""

    task: Literal["arith", "arith-multiturn"] = "arith"
    """'arith' (the built-in single-turn arithmetic, [U-statistic, Sec. 5.1]) or 'arith-multiturn' (the built-in
    H-turn dialogue with per-turn rewards, [Foundations, Sec. 6]: an environment, grpolab.env.arith)."""
    env: str = dataclasses.field(default="", metadata=takes_object("environment", "env"))
    """An environment to play episodes in: 'path/to/file.py:Class' or 'module:Class', constructed with no arguments
    for each episode, in grpolab's shape (reset(record) -> messages, step(text) -> (messages, reward, done)) or TRL's
    (reset(**row) -> str | None, optional get_reward(), public methods as tools); each row of --data is one episode's
    record; a TRL-shape class without --data samples its own task (docs/environments.md)."""
    tools: tuple[str, ...] = dataclasses.field(default=(), metadata=takes_object("tool", "tools"))
    """Tools the model may call: 'path/to/file.py:function' or 'module:function', repeatable; plain functions with
    type hints and a docstring. Each reply's tool calls run (in a worker process, --tool-timeout each) and their
    results come back as tool messages; a reply with no tool call ends the episode, which --reward-fn scores."""
    max_turns: int = 8
    """Environments: the most replies of an episode; one that reaches it unfinished is cut (env/truncated)."""
    max_episode_tokens: int = 1024
    """Environments: the most tokens an episode adds after its opening prompt (replies, environment and tool
    messages); one that runs out is cut (env/truncated). 0 = no bound."""
    tool_timeout: float = 10.0
    """--tools: wall-clock seconds a tool call may take; then its worker is killed and the call answers an error."""
    tool_max_chars: int = 2000
    """--tools: the longest tool result kept (characters); a longer one is cut and says so."""
    tool_reward: float = 0.0
    """--tools: the environment's reward at a turn whose tool calls all returned a result (a shaping reward for
    calling tools well; --reward-fn scores the final answer). 0 = none."""
    stages: int = 3
    """arith-multiturn: turns per dialogue."""
    dialogue_context: Literal["question", "dialogue"] = "question"
    """arith-multiturn: what the policy sees at a turn, 'question' or the whole 'dialogue'."""

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are episodes of an environment (--env, --tools, --task arith-multiturn)."""
        return bool(self.env or self.tools or self.task == "arith-multiturn")

    @property
    def max_replies(self) -> int:
        """The most replies of an episode: --stages for the built-in dialogue, else --max-turns."""
        return self.stages if self.task == "arith-multiturn" else self.max_turns

    def validate(self) -> None:
        """Environments, tools and their limits."""
        if self.task not in ("arith", "arith-multiturn"):
            raise bad("task", f"must be 'arith' or 'arith-multiturn', got {self.task!r}")
        if not self.multi_turn:
            return
        given = [
            f for f, on in (("task", self.task == "arith-multiturn"), ("env", self.env), ("tools", self.tools)) if on
        ]
        if len(given) > 1:
            raise bad(given[1], f"give one of --env, --tools and --task arith-multiturn, not {' and '.join(given)}")
        if self.task == "arith-multiturn":
            if self.stages < 1:
                raise bad("stages", f"must be >= 1, got {self.stages}")
            if self.dialogue_context not in ("question", "dialogue"):
                raise bad("dialogue_context", f"must be 'question' or 'dialogue', got {self.dialogue_context!r}")
        if self.max_turns < 1:
            raise bad("max_turns", f"must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 0:
            raise bad("max_episode_tokens", f"must be >= 0 (0: no bound), got {self.max_episode_tokens}")
        if not self.tool_timeout > 0:
            raise bad("tool_timeout", f"must be > 0 seconds, got {self.tool_timeout}")
        if self.tool_max_chars < 1:
            raise bad("tool_max_chars", f"must be >= 1, got {self.tool_max_chars}")


def validate_task(prompt: PromptSection, data: DataSection, episodes: EpisodesSection) -> None:
    """The checks between a task's sections: its data against the prompt format and the episodes."""
    if data.free_form and prompt.few_shot:
        raise bad("few_shot", "needs solved examples (question and answer): the built-in task or gsm8k/math data")
    if data.format in ("rows", "self") and not episodes.env:
        raise bad("format", f"{data.format} is for an --env, whose reset reads the record")
    if not episodes.multi_turn:
        return
    if episodes.task == "arith-multiturn" and (data.data or data.eval_data):
        raise bad("task", "arith-multiturn plays the built-in dialogues; --data is for --env and --tools")
    if episodes.task != "arith-multiturn" and not data.data and data.format != "self":
        raise bad("env" if episodes.env else "tools", "needs --data: each row is one episode's record (an --env in "
                  "TRL's shape, reset(**row) and no step, may sample its own task instead)")  # fmt: skip
