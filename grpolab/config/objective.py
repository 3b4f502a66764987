"""The objective and the update: advantages, the loss, how its passes run, and the optimiser."""

from __future__ import annotations

import dataclasses
from typing import Literal

from grpolab.algo.names import (
    AGGREGATIONS,
    CORRECTION_CHOICES,
    CREDITS,
    ESTIMATORS,
    IMPORTANCE_SAMPLING,
    KL_ESTIMATORS,
    LOSS_TYPES,
    NORMALISATIONS,
    SCALES,
)
from grpolab.config.fields import bad, check_counts

GROUP_BASELINES = ("grpo", "grpo_std", "rloo")
# Every TRL loss_type and the aggregation TRL gives it, as grpolab's --aggregation: the first four name an aggregation
# of the clipped term; the rest are policy terms of grpolab's --loss-type too.
TRL_LOSS_AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "dapo": "token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "sapo": "seq-mean-token-mean",
    "luspo": "seq-mean-token-mean",  # luspo sums each rollout's terms itself (grpolab.algo.loss.effective_aggregation)
}
# TRL's loss_type values that name an aggregation of the clipped term (not a --loss-type here)
TRL_AGGREGATION_LOSS_TYPES = {k: v for k, v in TRL_LOSS_AGGREGATION.items() if k in ("grpo", "dapo", "bnpo", "dr_grpo")}


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    """The objective: advantages, their credit over turns, the clipped surrogate, KL and corrections."""

    estimator: Literal["vanilla", "grpo", "grpo_std", "rloo", "oracle"] = "grpo_std"
    """Advantage estimator (grpolab.algo.advantages). 'oracle' is for probes only, not training."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """grpo_std: which standard deviation divides the group-centred advantages: each group's (group, the usual
    grpo_std), the whole step's rewards' (batch), or none (then grpo_std is grpo). Population std in both cases."""
    reward_std: Literal["population", "sample"] = "population"
    """grpo_std's standard deviation (each group's, or the step's with --scale-rewards batch): the population one
    (divides by n) or the sample one (by n - 1, as TRL divides). With G = 4, sample-std advantages are sqrt(3/4) =
    0.87 of the population ones."""
    reward_normalisation: Literal["sum-then-normalize", "normalize-then-sum"] = "sum-then-normalize"
    """With several reward functions: sum them (with --reward-weights) and then take --estimator's advantage of the
    sum (the usual; TRL's default), or normalize-then-sum (GDPO): standardise each function's rewards within each
    group, sum them with the weights, and divide by the step's std of that sum. normalize-then-sum is its own
    advantage: it takes the default --estimator grpo_std and --scale-rewards group, single-turn rollouts only."""
    advantage: Literal["grpo", "rtg-group", "rtg-mc"] = "grpo"
    """How an episode's turns share credit (one turn: all the same): 'grpo' (every turn gets the episode's advantage,
    [Foundations, Eq. 22]), 'rtg-group' (each turn's reward-to-go minus the --estimator's baseline of the initial
    state) or 'rtg-mc' (reward-to-go minus a Monte Carlo value of the turn's state from --branches continuations)."""
    branches: int = 4
    """rtg-mc: continuations branched from each visited state to estimate its value."""
    aggregation: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"] = (
        "seq-mean-token-mean"
    )
    """How per-token terms combine (grpolab.algo.loss.aggregate): seq-mean-token-mean is GRPO's (TRL's grpo), token-mean
    DAPO's (TRL's dapo/bnpo/cispo/vespo), seq-mean-token-sum-norm Dr. GRPO's, seq-mean-token-sum LUSPO's."""
    clip_low: float = 0.2
    """Ratio clip below: 1 - clip_low."""
    clip_high: float = 0.2
    """Ratio clip above: 1 + clip_high."""
    clip_delta: float = 0.0
    """Two-sided clipping: cap the unclipped ratio at D (> 1 + clip_high) so a negative-advantage token whose ratio
    ran away cannot dominate the loss. 0 = off."""
    beta: float = 0.0
    """KL coefficient to the reference (the starting weights). The RLVR essay reports 0.04; 0 skips the reference."""
    kl: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator [U-statistic, App. A]."""
    kl_ratio: bool = False
    """Multiply each token's KL estimate by its importance ratio (TRL's use_bias_correction_kl): the token's ratio,
    or the rollout's with --importance-sampling sequence, unclipped and with its gradient, so the penalty estimates
    KL(pi || pi_ref) from samples of the sampling-time policy. Changes nothing at ratio 1 but the gradient (the ratio's
    own, KL * grad log pi); off by default (TRL's default is on). Needs --beta > 0 to matter."""
    importance_sampling: Literal["token", "sequence", "sequence-sum"] = "token"
    """token: one ratio per token (GRPO). sequence: GSPO's ratio per rollout, exp(mean over its tokens of
    logp - old_logp), clipped per rollout (GSPO clips at 3e-4 / 4e-4: --clip-low 3e-4 --clip-high 4e-4).
    sequence-sum: the rollout's whole ratio, exp(sum over its tokens of logp - old_logp), clipped per rollout (TRL's
    RLOOTrainer; with seq-mean-token-mean each rollout's loss is its one clipped term)."""
    mask_truncated: bool = False
    """DAPO: completions cut at --max-new-tokens (no end-of-sequence token) carry no loss; they still count in the
    reward statistics and the advantages of their group."""
    top_entropy_quantile: float = 1.0
    """Only the highest-entropy q-fraction of the step's completion tokens (entropy of the sampling policy, the
    threshold over every token of the step) carries policy loss; 1 = every token."""
    mu: int = 1
    """Passes over the step's batch (PPO's epochs), each of --minibatches optimizer steps: mu x M optimizer steps a
    step. After the first optimizer step the sampling-time log-probs give the importance ratio."""
    engine_correction: Literal["auto", "none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"] = (
        "auto"
    )
    """Correct for the sampler computing other probabilities than the trainer (another kernel or precision): weight
    each token's policy term by r = pi_trainer / pi_sampler, truncated at --engine-correction-cap (token or whole
    sequence), or mask tokens (sequences) with r outside [1/cap, cap]. auto: none where the sampler computes what the
    trainer does (the hf engine in the trainer's dtype), else the mode docs/precision.md measured best
    (grpolab.algo.engine_correction.AUTO). The mismatch is logged either way (engine/*); with top-p, top-k, min-p or a
    repetition penalty both sides are the sampling distribution's, so those alone are no mismatch."""
    engine_correction_cap: float = 2.0
    """C > 1 of --engine-correction."""

    def validate(self) -> None:
        """The estimator, the loss's options and the engine correction (each alone; the checks that need other
        sections are :class:`grpolab.config.train.TrainConfig`'s)."""
        check_counts(self, positive=("mu",))
        if self.estimator not in ESTIMATORS:
            raise bad("estimator", f"unknown estimator {self.estimator!r}; choose from {ESTIMATORS}")
        if self.estimator == "oracle":
            raise bad(
                "estimator",
                "'oracle' needs the true value of each prompt, which training does not have; it is for the probes",
            )
        if self.advantage not in CREDITS:
            raise bad("advantage", f"must be one of {CREDITS}, got {self.advantage!r}")
        if self.advantage == "rtg-mc" and self.branches < 1:
            raise bad("branches", f"rtg-mc needs >= 1 branch, got {self.branches}")
        if self.aggregation not in AGGREGATIONS:
            raise bad("aggregation", f"unknown aggregation {self.aggregation!r}; choose from {AGGREGATIONS}")
        if self.reward_normalisation not in NORMALISATIONS:
            raise bad("reward_normalisation", f"must be one of {NORMALISATIONS}, got {self.reward_normalisation!r}")
        if self.reward_normalisation == "normalize-then-sum" and (
            self.estimator != "grpo_std" or self.scale_rewards != "group"
        ):
            raise bad(
                "reward_normalisation",
                "normalize-then-sum is GDPO's own advantage: leave out --estimator and --scale-rewards",
            )
        if self.reward_std not in ("population", "sample"):
            raise bad("reward_std", f"must be 'population' or 'sample', got {self.reward_std!r}")
        if self.scale_rewards not in SCALES:
            raise bad("scale_rewards", f"must be one of {SCALES}, got {self.scale_rewards!r}")
        if self.scale_rewards != "group" and self.estimator != "grpo_std":
            raise bad(
                "scale_rewards", f"chooses grpo_std's divisor; with --estimator {self.estimator} nothing is divided"
            )
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise bad("clip_low", f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.clip_delta and self.clip_delta <= 1 + self.clip_high:
            raise bad(
                "clip_delta", f"must be 0 (off) or > 1 + clip_high = {1 + self.clip_high:g}, got {self.clip_delta:g}"
            )
        if self.importance_sampling not in IMPORTANCE_SAMPLING:
            raise bad("importance_sampling", f"must be one of {IMPORTANCE_SAMPLING}, got {self.importance_sampling!r}")
        if not 0 < self.top_entropy_quantile <= 1:
            raise bad("top_entropy_quantile", f"must be in (0, 1], got {self.top_entropy_quantile:g}")
        if self.kl not in KL_ESTIMATORS:
            raise bad("kl", f"unknown KL estimator {self.kl!r}; choose from {KL_ESTIMATORS}")
        if self.beta < 0:
            raise bad("beta", f"must be >= 0, got {self.beta}")
        if self.engine_correction not in CORRECTION_CHOICES:
            raise bad("engine_correction", f"must be one of {CORRECTION_CHOICES}, got {self.engine_correction!r}")
        if not self.engine_correction_cap > 1:
            raise bad("engine_correction_cap", f"must be > 1, got {self.engine_correction_cap:g}")

    @property
    def sample_std(self) -> bool:
        """Whether grpo_std divides by the sample standard deviation (--reward-std sample)."""
        return self.reward_std == "sample"

    @property
    def group_baseline(self) -> bool:
        """Whether the estimator's baseline comes from the group (it then needs G >= 2, and a group whose rewards
        are all equal carries no gradient)."""
        return self.estimator in GROUP_BASELINES


@dataclasses.dataclass(frozen=True)
class TermSection:
    """The per-token policy term (--loss-type) and its constants; the clip's bounds and the aggregation are the
    objective's."""

    loss_type: Literal["clip", "cispo", "sapo", "luspo", "vespo"] = "clip"
    """The per-token policy term (grpolab.algo.loss.policy_term; docs/loss-variants.md): clip (PPO/GRPO's clipped
    ratio), cispo (the importance weight truncated at --cispo-cap and detached, times A log pi: MiniMax-M1), sapo
    (a smooth sigmoid gate in place of the clip: Qwen's SAPO), luspo (the clipped term summed over each rollout's
    tokens, i.e. --aggregation seq-mean-token-sum; the paper uses it with --importance-sampling sequence), vespo
    (a gamma-shaped weight of the rollout's importance weight, times A log pi). Their aggregation stays
    --aggregation's (TRL aggregates cispo and vespo as token-mean, sapo as seq-mean-token-mean)."""
    cispo_cap: float = 5.0
    """cispo: the importance weight's upper bound (TRL's epsilon_high under loss_type='cispo'; 5 as TRL's docs and
    ScaleRL recommend). No lower bound."""
    sapo_temperature_pos: float = 1.0
    """sapo: the gate's temperature for tokens with a positive advantage (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """sapo: the gate's temperature for the others (TRL's default)."""
    vespo_k_pos: float = 2.0
    """vespo: the power k of phi(w) = exp(lambda + k log w - lambda w) where A >= 0 (TRL's default)."""
    vespo_lambda_pos: float = 3.0
    """vespo: lambda of phi where A >= 0 (TRL's default)."""
    vespo_k_neg: float = 3.0
    """vespo: k of phi where A < 0 (TRL's default)."""
    vespo_lambda_neg: float = 2.0
    """vespo: lambda of phi where A < 0 (TRL's default)."""
    off_policy_mask_threshold: float = 0.0
    """DeepSeek-V3.2's off-policy sequence mask: a rollout with a negative advantage whose mean per-token
    log pi_sampling - log pi (the sampler's log-probs when the engine gives them, else the sampling-time ones)
    exceeds this carries no policy loss. 0 = off. Acts only once the weights have moved (mu > 1) or the sampler
    differs from the trainer."""

    entropy_coef: float = 0.0
    """c of an entropy bonus, loss - c * H, H the mean entropy of the policy over the step's loss-carrying tokens (the
    same for every aggregation, as TRL's entropy_coef). 0 = off. With --adaptive-entropy: the starting c."""
    adaptive_entropy: bool = False
    """Skywork-OR1's adaptive coefficient (TRL's use_adaptive_entropy): the bonus applies only while the last optimizer
    step's entropy is <= --entropy-target, and after each optimizer step c rises by --entropy-coef-delta when it was,
    falls by it when not, within [--entropy-coef-min, --entropy-coef-max]."""
    entropy_target: float = 0.2
    """--adaptive-entropy: the entropy (nats) at or below which the bonus applies (TRL's default; set it near the
    entropy early in training, logged as loss/entropy, for it to engage before the policy collapses)."""
    entropy_coef_delta: float = 0.005
    """--adaptive-entropy: c's step."""
    entropy_coef_min: float = 0.0
    """--adaptive-entropy: c's lower bound."""
    entropy_coef_max: float = 1.0
    """--adaptive-entropy: c's upper bound."""

    def term_params(self):
        """The constants the policy term's math takes (:class:`grpolab.algo.loss.TermParams`), from these options."""
        from grpolab.algo.loss import TermParams  # torch: not while the command line is only being read

        return TermParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TermParams)})

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss carries an entropy bonus (adaptive: even while c is 0, so that it can come back)."""
        return self.entropy_coef != 0.0 or self.adaptive_entropy

    def validate(self) -> None:
        """Each option alone; against the objective's options: :meth:`check_with`."""
        if self.loss_type in TRL_AGGREGATION_LOSS_TYPES:
            raise bad(
                "loss_type",
                f"TRL's loss_type={self.loss_type!r} is an aggregation here: --aggregation "
                f"{TRL_AGGREGATION_LOSS_TYPES[self.loss_type]} (the policy term stays --loss-type clip)",
            )
        if self.loss_type not in LOSS_TYPES:
            raise bad("loss_type", f"must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        positive = ("cispo_cap", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg")
        for name in positive:
            if not getattr(self, name) > 0:
                raise bad(name, f"must be > 0, got {getattr(self, name):g}")
        if not self.entropy_coef_min <= self.entropy_coef_max:
            raise bad("entropy_coef_min", f"must be <= --entropy-coef-max = {self.entropy_coef_max:g}")
        for name in ("vespo_k_pos", "vespo_k_neg", "off_policy_mask_threshold", "entropy_coef_delta"):
            if getattr(self, name) < 0:
                raise bad(name, f"must be >= 0, got {getattr(self, name):g}")

    def check_with(self, objective: ObjectiveSection) -> None:
        """The term against the objective's aggregation, clip and engine correction."""
        if self.loss_type == "luspo" and objective.aggregation not in ("seq-mean-token-mean", "seq-mean-token-sum"):
            raise bad("aggregation", "luspo sums each rollout's terms (seq-mean-token-sum); leave --aggregation out")
        if objective.clip_delta and self.loss_type not in ("clip", "luspo"):
            raise bad("clip_delta", f"caps the clipped ratio of --loss-type clip or luspo, not {self.loss_type}")
        if self.loss_type == "vespo" and objective.engine_correction not in ("none", "auto"):
            raise bad("engine_correction", "vespo would fold the correction into its sequence weight; not built")


@dataclasses.dataclass(frozen=True)
class UpdateSection:
    """How the update's forward and backward passes run (same gradient, other memory and time)."""

    micro_batch: int = 0
    """Rollouts per forward/backward; 0 = the whole batch. Must divide B*G."""
    minibatches: int = 1
    """M: optimizer steps in each of the --mu passes over the step's batch, each on an M-th of its rows (row i in
    minibatch i mod M, so each group is spread over them) with an M-th of the step's normalisers (PPO's minibatches;
    TRL's steps_per_generation / gradient_accumulation_steps). The sampling-time log-probs give the ratio from the
    second on. 1 = one optimizer step on the whole batch. Each process's rows must split into M equal parts; fixed
    --sampling, single-turn rollouts, no entropy bonus and no --log-token-credit."""
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
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (transformers' activation
    checkpointing): less memory, about one more forward of time."""
    keep_dropout: bool = False
    """Keep the model's dropout active in training. Off by default (as TRL's disable_dropout): the sampler runs without
    it, so with it the update sees a noisier distribution than the one that sampled (ratio off 1, a KL gradient at
    the reference)."""
    fsdp: bool = False
    """Under torchrun: shard parameters, gradients and optimizer state over the processes (FSDP2,
    fully_shard) instead of replicating the model (DDP). Same results; for models whose training state does not fit
    one device (generation still gathers the whole model on each process)."""

    def validate(self) -> None:
        check_counts(self, positive=("minibatches",), non_negative=("micro_batch", "micro_batch_tokens"))
        if self.micro_batch and self.micro_batch_tokens:
            raise bad("micro_batch_tokens", "plans the passes by tokens; give it or --micro-batch, not both")
        if self.shared_prefix not in ("on", "off"):
            raise bad("shared_prefix", f"must be 'on' or 'off', got {self.shared_prefix!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """AdamW and its schedule."""

    lr: float = 5e-5
    """AdamW learning rate. For the built-in 0.5 M model 1e-4 already degrades held-out accuracy; 3e-4 collapses it.
    0: a control run whose weights never change (what its evaluations show is their noise; the doctor says no_movement)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up."""
    warmup_steps: int = 10
    """Linear warm-up, in optimizer steps."""

    def validate(self) -> None:
        check_counts(self, non_negative=("warmup_steps",))
        if not self.lr >= 0:  # 0: a control run (the weights stay where they start)
            raise bad("lr", f"must be >= 0, got {self.lr}")
