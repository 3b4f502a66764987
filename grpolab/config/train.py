"""``grpolab train``'s configuration: a run's options in sections, one frozen dataclass per concern.

Each section checks its own options (``validate``); :class:`TrainConfig` holds the sections and checks what needs
two of them (``--micro-batch`` must divide ``--prompts-per-step`` x ``--group-size``). The flags, the Python
keywords, ``--config`` TOML files and config.json all name an option by its own name, whatever section holds it
(:mod:`grpolab.config.fields`).
"""

from __future__ import annotations

import dataclasses

from grpolab.common.errors import ConfigError
from grpolab.config import fields
from grpolab.config.distill import DistillSection
from grpolab.config.fields import bad
from grpolab.config.objective import ObjectiveSection, OptimizerSection, TermSection, UpdateSection
from grpolab.config.rollout import EngineSection, GenerationSection, GroupsSection, RewardSection, SandboxSection
from grpolab.config.run import (
    DoctorSection,
    EvalSection,
    HackingSection,
    LoggingSection,
    MachineSection,
    ProbeSection,
    RunSection,
)
from grpolab.config.task import (
    ArithmeticSection,
    DataSection,
    EpisodesSection,
    PolicySection,
    PromptSection,
    validate_task,
)

__all__ = ["ConfigError", "TrainConfig"]

# Options whose default depends on the model. The built-in 0.5 M-parameter model takes a step of 16 x 8 rollouts
# in about a second and 2500 evaluation completions in seconds; a 135 M model on a 2-core CPU needs about a
# minute per 32 rollouts (sampling plus update) and about a minute per 100 evaluation completions, so a
# brought model gets a smaller step and a smaller evaluation (docs/real-model.md measures each).
MODEL_DEFAULTS = {
    "builtin": {
        "prompts_per_step": 16,
        "eval_questions": 500,
        "eval_samples": 4,
        "format_weight": 0.1,
        "threads": 1,
        "eval_batch": 1024,
    },
    "other": {
        "prompts_per_step": 4,
        "eval_questions": 50,
        "eval_samples": 2,
        "format_weight": 0.0,
        "threads": 0,
        "eval_batch": 256,
    },
}

# Options whose ``auto`` a run resolves when it starts (once the device and the policy are known); config.json
# records the resolved value, and a resumed run left on ``auto`` continues with it.
RESOLVED_AT_START = ("precision", "rollout_dtype", "engine_correction")
# What a run's config.json left out before an option existed: the value its runs had (it sampled with the policy
# itself, so in the trainer's dtype, and corrected nothing; its --dtype, folded into --precision, says the rest).
BEFORE_RECORDED = {
    "rollout_dtype": "auto",
    "engine_correction": "none",
    "precision": "auto",
    "hacking_every": 0,
    "honeypots": "none",
}


@fields.sectioned
class TrainConfig:
    """GRPO training of a causal LM on verifiable rewards.

    Every option is a ``grpolab train`` flag and a keyword of :func:`grpolab.train`, by its own name whatever
    section holds it; a whole config can be passed too::

        cfg = grpolab.TrainConfig(steps=50, group_size=8, out="runs/x")   # or sections: run=RunSection(...)
        cfg.groups.group_size, cfg.run.out
        run = grpolab.train(config=cfg)
    """

    run: RunSection = RunSection()
    machine: MachineSection = MachineSection()
    policy: PolicySection = PolicySection()
    prompt: PromptSection = PromptSection()
    dataset: DataSection = DataSection()
    arithmetic: ArithmeticSection = ArithmeticSection()
    episodes: EpisodesSection = EpisodesSection()
    generation: GenerationSection = GenerationSection()
    groups: GroupsSection = GroupsSection()
    engine: EngineSection = EngineSection()
    reward: RewardSection = RewardSection()
    code_sandbox: SandboxSection = SandboxSection()
    objective: ObjectiveSection = ObjectiveSection()
    terms: TermSection = TermSection()
    distill: DistillSection = DistillSection()
    update: UpdateSection = UpdateSection()
    optimizer: OptimizerSection = OptimizerSection()
    eval: EvalSection = EvalSection()
    probe: ProbeSection = ProbeSection()
    logging: LoggingSection = LoggingSection()
    diagnosis: DoctorSection = DoctorSection()
    hacking: HackingSection = HackingSection()

    # ------------------------------------------------------------------ derived
    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are episodes of an environment (--env, --tools, --task arith-multiturn)."""
        return self.episodes.multi_turn

    @property
    def max_policy_tokens(self) -> int:
        """The most tokens of the policy's in one rollout, the constant of Dr. GRPO's normaliser: --max-new-tokens,
        or for an environment task an episode's (--max-turns x --max-new-tokens, at most --max-episode-tokens)."""
        if not self.multi_turn:
            return self.generation.max_new_tokens
        bound = self.episodes.max_replies * self.generation.max_new_tokens
        cap = self.episodes.max_episode_tokens
        return min(bound, cap) if cap else bound

    @property
    def rollouts_per_step(self) -> int:
        return self.groups.rollouts_per_step

    def to_dict(self) -> dict:
        """Every option by its flat name: what config.json records."""
        return fields.to_flat(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """A config from config.json (or any flat dict of options); names it does not know are skipped (a run
        records facts beside its options, such as its process count)."""
        return fields.from_flat(cls, values)

    @classmethod
    def of_run(cls, values: dict) -> TrainConfig:
        """The config of a run from its config.json (``values``), whatever version wrote it: an option the file
        predates takes the value that run used (BEFORE_RECORDED), any other its default; names it does not know are
        skipped (:meth:`from_dict`). As recorded: nothing resolved (a --dtype alias stays, see
        :meth:`MachineSection.folded`), nothing checked."""
        return cls.from_dict({**BEFORE_RECORDED, **values})

    def replace(self, **values) -> TrainConfig:
        """This config with options (flat names) changed."""
        return fields.replace(self, **values)

    # ------------------------------------------------------------------ model defaults
    def resolved(self) -> TrainConfig:
        """This config with every unset (None) option given its default for ``--model`` (MODEL_DEFAULTS), and --dtype
        folded (:meth:`folded`). ``--format auto`` is resolved from the data's columns where the data is read
        (:func:`grpolab.data.task.resolve_format`)."""
        defaults = model_defaults(self.policy.model)
        fill = {k: v for k, v in defaults.items() if fields.get(self, k) is None}
        return (self.replace(**fill) if fill else self).folded()

    def folded(self) -> TrainConfig:
        """This config with --dtype, the alias, turned into the --precision it stands for
        (:meth:`grpolab.config.run.MachineSection.folded`)."""
        machine = self.machine.folded()
        return self if machine is self.machine else dataclasses.replace(self, machine=machine)

    def checked(self, world_size: int = 1) -> TrainConfig:
        """Resolved (model defaults filled in) and validated for ``world_size`` processes."""
        cfg = self.resolved()
        cfg.validate()
        cfg.validate_world(world_size)
        return cfg

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Refuse an inconsistent config with a :class:`ConfigError` naming the option (the first problem found):
        each section's own checks, then those that need two sections."""
        if any(fields.get(self, k) is None for k in MODEL_DEFAULTS["builtin"]):
            return self.resolved().validate()
        for name in fields.sections(type(self)):
            getattr(self, name).validate()
        self._validate_task()
        self._validate_objective()
        self._validate_generation()
        if self.groups.group_size_control == "rank" and not self.probe.probe_every:
            raise bad("group_size_control", "rank reads the spectrum probe's effective rank: give --probe-every N")

    def _validate_task(self) -> None:
        """The data against the prompt format and the episodes; credit over turns needs episodes."""
        validate_task(self.prompt, self.dataset, self.episodes)
        if not self.multi_turn and self.objective.advantage != "grpo":
            raise bad(
                "advantage",
                f"{self.objective.advantage} shares credit across an episode's turns; give --env, --tools or "
                "--task arith-multiturn (a single-turn rollout has one turn: its credit is grpo's)",
            )
        if self.multi_turn and self.objective.reward_normalisation == "normalize-then-sum":
            raise bad("reward_normalisation", "normalize-then-sum normalises each --reward-fn's rewards; not episodes")
        if self.multi_turn and self.reward.overlong_buffer:
            raise bad(
                "overlong_buffer", "punishes one completion's length; an episode is bounded by --max-episode-tokens"
            )

    def _validate_objective(self) -> None:
        """The estimator against the groups, the loss against the step's size."""
        obj, groups = self.objective, self.groups
        self.terms.check_with(obj)
        if obj.group_baseline and groups.group_size < 2:
            raise bad(
                "group_size",
                f"estimator {obj.estimator!r} uses a group baseline and needs G >= 2, got {groups.group_size}",
            )
        if groups.sampling != "fixed" and not obj.group_baseline:
            raise bad(
                "sampling",
                f"{groups.sampling!r} needs a group-baseline estimator (grpo, grpo_std, rloo): "
                f"with {obj.estimator!r} a group whose rewards are all equal still carries gradient",
            )
        max_new = self.generation.max_new_tokens
        if not self.reward.overlong_buffer < max_new:
            raise bad(
                "overlong_buffer", f"must be in [0, max_new_tokens = {max_new}), got {self.reward.overlong_buffer}"
            )
        self._validate_minibatches()
        if self.distill.on and groups.sampling != "fixed":
            raise bad(
                "sampling",
                f"{groups.sampling!r} drops groups whose rewards are all equal, which a --teacher's signal still "
                "trains on; leave --sampling fixed",
            )
        distill = self.distill
        if distill.full_vocabulary and (self.terms.entropy_bonus or self.generation.shaped):
            raise bad(
                "distill_loss",
                f"{distill.loss} scores the whole vocabulary in its own forward: not built with an entropy bonus, "
                "--top-p < 1, --top-k, --min-p or --repetition-penalty (rkl-reward takes them all)",
            )
        micro = self.update.micro_batch
        if micro and self.rollouts_per_step % micro:
            raise bad(
                "micro_batch",
                f"prompts_per_step * group_size = {self.rollouts_per_step} must be divisible by micro_batch = {micro}",
            )

    def _validate_minibatches(self) -> None:
        """--minibatches M > 1: equal minibatches of single-turn rollouts, and what M optimizer steps a pass support."""
        M = self.update.minibatches
        if M == 1:
            return
        if self.rollouts_per_step % M:
            raise bad(
                "minibatches", f"{self.rollouts_per_step} rollouts a step do not split into {M} equal minibatches"
            )
        unsupported = {
            "sampling": self.groups.sampling != "fixed",
            "env": self.multi_turn,
            "entropy_coef": self.terms.entropy_bonus,
            "log_token_credit": self.probe.log_token_credit > 0,
        }
        for name, conflict in unsupported.items():
            if conflict:
                raise bad("minibatches", f"{M} optimizer steps a pass with --{name.replace('_', '-')}: not built")

    def _validate_generation(self) -> None:
        """Sampling against the groups and the engine."""
        temperature = self.generation.temperature
        if temperature == 0 and self.groups.group_size > 1:
            raise bad("temperature", "0 (greedy) makes every rollout of a group identical; use > 0")
        if self.engine.rollout_engine != "vllm":
            return
        if self.objective.top_entropy_quantile < 1:
            raise bad("top_entropy_quantile", "needs the sampler's entropies, which vLLM does not return: use hf")
        if temperature > 2:
            raise bad("temperature", f"vLLM samples at temperatures up to 2, got {temperature:g}")

    def validate_world(self, world_size: int) -> None:
        """What a run on ``world_size`` processes needs on top of :meth:`validate`."""
        if self.groups.prompts_per_step is None:
            return self.resolved().validate_world(world_size)
        if self.run.nproc < 0:
            raise bad("nproc", f"must be >= 0 (0: as many as pay), got {self.run.nproc}")
        if world_size == 1:
            return
        if self.groups.prompts_per_step % world_size:
            raise bad(
                "prompts_per_step",
                f"{self.groups.prompts_per_step} prompts cannot be split over {world_size} processes "
                "(each takes whole groups): use a multiple of the process count",
            )
        if (self.rollouts_per_step // world_size) % self.update.minibatches:
            raise bad(
                "minibatches",
                f"each of {world_size} processes' {self.rollouts_per_step // world_size} rollouts must split into "
                f"{self.update.minibatches} equal minibatches",
            )
        if self.update.fsdp and self.policy.lora_rank:
            raise bad("fsdp", "LoRA adapters are small enough to replicate: drop --fsdp (DDP) for --lora-rank runs")
        if self.update.fsdp and self.probe.probe_every:
            raise bad(
                "fsdp",
                "the in-training spectrum probe needs whole parameters; use --probe-every 0 with --fsdp "
                "(grpolab rank measures saved checkpoints on any number of processes)",
            )

    # ------------------------------------------------------------------ resume
    def resume_conflicts(self, saved: TrainConfig) -> list[str]:
        """The options in which this config (a resumed run's, flags applied) differs from ``saved`` (the run's own)
        where continuing with the new value is not sound. Free to change: how long the run goes on (``--steps``,
        ``--max-rollouts``), where and on how many processes it runs, what it logs and how often it evaluates and
        saves."""
        free = {*fields.options_of(RunSection), *fields.options_of(MachineSection), *fields.options_of(LoggingSection)}
        free |= {*fields.options_of(DoctorSection), *fields.options_of(HackingSection)}  # they watch, never steer
        free |= {"eval_every", "eval_batch", "fsdp", "generator_timeout"}
        free |= {"generators", "generator_listen", "generator_wait", "generator_token_file"}  # any N draws alike
        free -= {"seed", "precision", "compensation", "fp32_head"}  # the weights' dtype and how the update rounds
        mine, theirs = self.to_dict(), saved.to_dict()
        kept = {k for k in RESOLVED_AT_START if mine[k] == "auto"}  # takes the run's own (:meth:`continuing`)
        return [k for k in mine if k not in free | kept and mine[k] != theirs[k]]

    def continuing(self, saved: TrainConfig) -> TrainConfig:
        """This config (a resumed run's) with the options resolved at start (RESOLVED_AT_START) that it leaves on
        ``auto`` taken as the run ``saved`` resolved them: the same run, whatever ``auto`` would pick today."""
        kept = {k: fields.get(saved, k) for k in RESOLVED_AT_START if fields.get(self, k) == "auto"}
        return self.replace(**kept) if kept else self


def model_defaults(model: str) -> dict:
    """The options whose default depends on the model (MODEL_DEFAULTS), for ``model``."""
    return MODEL_DEFAULTS["builtin" if model == "builtin" else "other"]
