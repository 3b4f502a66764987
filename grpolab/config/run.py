"""The run's own options: where it writes and how long it runs, the machine, evaluation, the in-training probes and logging."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from grpolab.config.fields import bad, check_counts, takes_object

RUN_CONFIG = "config.json"
"""A run directory's record of its options (every option by its flat name, and the facts the run resolved)."""
RUN_CONFIG_ASIDE = "grpolab.json"
"""The same record, copied here before a Hugging Face model is saved into the run directory itself (``grpolab.trl``'s
``save_model(output_dir)``, as TRL's scripts call it), where the model's own config.json takes its place."""


def run_config_file(run_dir: str | Path) -> Path:
    """The file holding the options of the run in ``run_dir``: its config.json, or the copy kept aside where a model
    was saved over it."""
    aside = Path(run_dir) / RUN_CONFIG_ASIDE
    return aside if aside.is_file() else Path(run_dir) / RUN_CONFIG


def keep_run_config_aside(run_dir: str | Path) -> None:
    """Before a Hugging Face model is saved into ``run_dir``: if it is a run directory, its config.json copied to
    grpolab.json (once, whole or not at all), which :func:`run_config_file` then reads."""
    run_dir = Path(run_dir)
    record, aside = run_dir / RUN_CONFIG, run_dir / RUN_CONFIG_ASIDE
    is_run = (run_dir / "metrics.jsonl").is_file() or (run_dir / "checkpoints").is_dir()
    if aside.is_file() or not record.is_file() or not is_run:
        return
    partial = aside.with_suffix(".json.partial")
    partial.write_bytes(record.read_bytes())
    partial.replace(aside)


@dataclasses.dataclass(frozen=True)
class RunSection:
    """The run: where it writes, how long it runs, its seed and process count."""

    out: str = "runs/train"
    """Run directory: config.json, metrics.jsonl, samples.jsonl, checkpoints/, plot.png."""
    resume: bool = False
    """Continue from the last complete checkpoint in --out."""
    seed: int = 0
    """Drives weight init, question draws and every rollout's random stream."""
    steps: int = 500
    """GRPO steps (each: sample, score, mu updates)."""
    max_rollouts: int = 0
    """Stop after the step at which the run has generated this many rollouts (sampling/rollouts_total); 0 = run
    --steps steps. For comparing sampling modes at an equal budget."""
    nproc: int = 0
    """Processes on this machine: > 1 relaunches this command under torchrun (data-parallel, one node).
    --prompts-per-step must be a multiple of it. 0 = as many as pay: one per core for the built-in model on a CPU
    (one thread each, 50 steps or more, rollouts drawn in the trainer's processes), else one; from Python, one.
    Ignored inside a torchrun launch, which sets the number itself."""

    def validate(self) -> None:
        check_counts(self, positive=("steps",), non_negative=("max_rollouts", "nproc"))


DTYPE_ALIAS = {
    "auto": ("auto", "kahan"),
    "float32": ("32-true", "kahan"),
    "float64": ("64-true", "kahan"),
    "bfloat16": ("bf16-true", "none"),
}
"""``--dtype`` (before ``--precision``) -> (precision, compensation): what each value trained as. ``bfloat16`` held the
weights in bf16 and stepped on them with plain AdamW, so it is ``bf16-true`` without compensation."""


@dataclasses.dataclass(frozen=True)
class MachineSection:
    """Where the model runs: device, precision and CPU threads."""

    device: str = "auto"
    """Where the model runs: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N. Under torchrun
    on CUDA each process takes cuda:LOCAL_RANK."""
    precision: Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true", "64-true"] = "auto"
    """What the weights are held in and the forward computes in (grpolab.common.precision; docs/precision.md):
    32-true (fp32), bf16-mixed (fp32 master weights and optimizer state, forward and backward under bf16 autocast,
    gradients reduced in fp32), 16-mixed (the same in fp16 with a gradient scaler; CUDA only), bf16-true (bf16 weights,
    AdamW with Kahan summation: see --compensation), 64-true (fp64, for exactness checks). auto: bf16-mixed on a
    CUDA device with bf16, 32-true on the CPU and for the built-in model. A precision the device cannot run is refused.
    The rollout engine samples in its compute dtype (--rollout-dtype auto)."""
    compensation: Literal["kahan", "none"] = "kahan"
    """bf16-true's optimizer: kahan (torch-optimi's AdamW with Kahan summation: each update's rounded-off part is kept
    in a bf16 buffer and added back) or none (plain AdamW on bf16 weights, as --dtype bfloat16 trained: a change under
    half a bf16 spacing is lost, so at GRPO's learning rates most of the update is; kept for comparison)."""
    fp32_head: bool = False
    """The LM head's product in fp32 under a bf16 or fp16 precision (ScaleRL; MiniMax-M1), in the trainer and in
    grpolab's sampler: fp32 weights and inputs, outside autocast (vLLM computes its head in its own dtype)."""
    dtype: Literal["", "auto", "float32", "bfloat16", "float64"] = ""
    """Alias of --precision kept for older commands and configs: float32 = 32-true, float64 = 64-true, bfloat16 =
    bf16-true with --compensation none (what it trained as), auto = auto. Folded into --precision when a run starts."""
    threads: int | None = None
    """Torch intra-op threads; 0 = torch's default (every core). Default: 1 for builtin (fastest for the 0.5 M model on
    a shared CPU), 0 for other models."""

    def folded(self) -> MachineSection:
        """This section with a --dtype alias turned into the --precision (and --compensation) it stands for."""
        if self.dtype in ("", "auto"):  # auto: whatever --precision says
            return dataclasses.replace(self, dtype="") if self.dtype else self
        precision, compensation = DTYPE_ALIAS[self.dtype]
        if self.precision not in ("auto", precision):
            raise bad(
                "dtype",
                f"{self.dtype} is --precision {precision}, but --precision {self.precision} is given too; give one",
            )
        return dataclasses.replace(self, precision=precision, compensation=compensation, dtype="")

    def validate(self) -> None:
        check_counts(self, non_negative=("threads",))
        self.folded()
        if self.device in ("cpu", "auto"):  # valid on any machine; checked without importing torch
            return
        from grpolab.common.devices import DeviceError, resolve_device

        try:
            resolve_device(self.device)  # malformed, or a GPU this machine does not have
        except DeviceError as e:
            raise bad("device", str(e)) from None


def check_pass_k(pass_k: tuple[int, ...], samples: int | None, flag: str) -> None:
    """--pass-k: each k at least 1 and at most the samples drawn per question (``samples``: None, not known yet)."""
    if any(k < 1 for k in pass_k):
        raise bad("pass_k", f"each k must be >= 1, got {','.join(map(str, pass_k))}")
    if samples is not None and pass_k and max(pass_k) > samples:
        raise bad("pass_k", f"pass@{max(pass_k)} needs {flag} >= {max(pass_k)} (samples per question), got {samples}")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation during training."""

    eval_every: int = 50
    """Evaluate on held-out questions every N steps (and at steps 0 and last); 0 = only at the ends."""
    eval_questions: int | None = None
    """Held-out questions per evaluation. Default: 500 for builtin, 50 for other models (see MODEL_DEFAULTS)."""
    eval_samples: int | None = None
    """k: samples per question at --temperature (the pass rate the groups see) for eval/accuracy_sampled. Default: 4 for builtin, 2 for other models."""
    eval_batch: int | None = None
    """Completions an evaluation draws at once (a batch's decode steps cost much the same at any size on a small
    model; the same completions at any size). Default: 1024 for builtin, 256 for other models (their caches are
    larger)."""
    eval_reward_fn: str = dataclasses.field(default="", metadata=takes_object("reward function", "eval_reward_func"))
    """The reward whose mean is the held-out accuracy ('module:function' or 'file.py:function', either form);
    default: the first --reward-fn for prompt data, the built-in answer check otherwise."""

    pass_k: tuple[int, ...] = ()
    """k of pass@k (eval/pass@k: the chance that one of k samples is right, by the unbiased estimator over the
    --eval-samples samples of each question, 95% intervals over questions), e.g. 1,4,8; each at most
    --eval-samples. Default: 1, 2, 4, ... up to --eval-samples."""

    def validate(self) -> None:
        check_counts(self, positive=("eval_questions", "eval_batch"), non_negative=("eval_every", "eval_samples"))
        check_pass_k(self.pass_k, self.eval_samples, "--eval-samples")


@dataclasses.dataclass(frozen=True)
class ProbeSection:
    """The probes that run during training [Foundations]."""

    probe_every: int = 0
    """Every N steps, measure the spectrum of the per-rollout gradient matrix on this step's groups
    (probe/eff_rank, probe/top1_frac, probe/num_rank); 0 = never. Advantage statistics (probe/adv_*) are logged every step."""
    probe_groups: int = 4
    """Groups (with reward variance) of the step's batch the spectrum probe measures."""
    probe_g_star: bool = True
    """With --probe-every: also estimate G*, the group size that minimises the gradient's error at the step's
    rollout budget, on the step's first --probe-groups groups (probe/g_star) [U-statistic, Thm 7]. It costs each
    measured group a Gram pass of plain scores (none when the loss weights every token alike) and one backward: about
    twice the spectrum's time."""
    probe_eps: float = 0.2
    """Threshold of an epsilon-effective rollout, |A_i| > eps [Foundations, Eq. 20]."""
    log_token_credit: int = 0
    """Every step, record K rollouts (group by group, one with a positive and one with a negative advantage) token by
    token in token_credit.jsonl: each token's advantage in the loss, importance ratio and clipping, entropy, sampler
    and trainer log-probs, and the change of its log-prob that the step's update caused (one extra forward over the K
    rollouts after the update); their aggregates as credit/* (shares of the change on the answer, reasoning and
    format tokens, its correlation with the advantage's sign, its concentration). `grpolab tokens RUN` and
    `grpolab report` show them. 0 = off. Rank 0 records its own rollouts."""

    def validate(self) -> None:
        check_counts(self, non_negative=("probe_every", "probe_groups", "log_token_credit"))


@dataclasses.dataclass(frozen=True)
class HackingSection:
    """Early signs of reward hacking (hacking/*; docs/reward-hacking.md): the doctor's reward_hacking check reads them.
    All off: --hacking-every 0 --honeypots none."""

    hacking_every: int = 5
    """Every N steps, how much the gradients of the step's top-advantage rollouts (one a prompt) share one direction
    across prompts (hacking/align: the top eigenvalue's share of their score vectors' cosine matrix, from one Gram
    pass over --hacking-groups rollouts); every step, how alike those completions are (hacking/trick_sim: character
    4-gram Jaccard, digits folded). 0 = neither."""
    hacking_groups: int = 16
    """Top-advantage rollouts (one a prompt, of this rank's groups) in the gradient-alignment sign's Gram pass: fewer
    make hacking/align noisier from step to step, more cost more."""
    honeypots: str = "auto"
    """Prompts with no correct answer, sampled at each evaluation with the training reward (hacking/honeypot_paid:
    the share its first component pays; any is a loophole): a JSONL file of records in the data's format (the columns
    the reward reads, e.g. a ground_truth no answer matches); 'auto': the built-in task's unanswerable twins of its
    questions (none for other tasks); 'none': off."""
    honeypot_count: int = 32
    """Honeypots sampled at each evaluation (the first N of the file), --eval-samples completions each."""
    audit_reward: str = ""
    """A stricter check that is never part of the reward ('module:function' or 'file.py:function', a reward
    function's form), run every step on --audit-sample of the step's rollouts: hacking/audit_paid_failed is the share
    it fails of those the reward's first component pays; an audit that raises is counted (hacking/audit_errors)."""
    audit_sample: int = 32
    """Rollouts a step the audit checks (evenly spaced over the step's)."""

    @property
    def signs_on(self) -> bool:
        """Whether any sign runs during training (the honeypots run at evaluations)."""
        return bool(self.hacking_every or self.audit_reward)

    def validate(self) -> None:
        check_counts(
            self, positive=("hacking_groups", "honeypot_count", "audit_sample"), non_negative=("hacking_every",)
        )
        if self.hacking_groups < 2:
            raise bad(
                "hacking_groups",
                f"the alignment of gradients across prompts needs 2 or more, got {self.hacking_groups}",
            )


@dataclasses.dataclass(frozen=True)
class DoctorSection:
    """The doctor's checks while training (`grpolab doctor RUN` reads a run afterwards)."""

    doctor: Literal["on", "off"] = "on"
    """Check the run every --doctor-every steps for conditions that keep it from learning (no signal, truncation, a
    reward that never sees an answer, too big a step, entropy collapse, sampler mismatch, saturation, reward hacking
    signs): a condition found for the first time is one line in the log, every check is logged as doctor/* metrics;
    warnings never stop the run. 'off' = no checks."""
    doctor_every: int = 5
    """Steps between two checks (each at a multiple of it; `grpolab doctor RUN` also checks the last step)."""

    def validate(self) -> None:
        check_counts(self, positive=("doctor_every",))


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """What the run writes, and how often."""

    save_every: int = 100
    """Checkpoint every N steps; the last step is always saved."""
    keep_checkpoints: int = 0
    """Keep only the newest N checkpoints; 0 keeps all."""
    log_samples: int = 4
    """Prompts (with their completions) written to samples.jsonl at each evaluation."""
    log_rollouts: bool = False
    """Write every rollout of every step (prompt index, question, completion, reward, advantage) to rollouts.jsonl."""
    tensorboard: bool = False
    """Also log to TensorBoard (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases, offline (needs the wandb package)."""
    progress: bool = True
    """Show progress: a bar on a terminal, plain lines otherwise."""
    log_every: int = 10
    """When stdout is not a terminal (a log file, a batch job): a plain progress line every N steps, and at each evaluation."""

    def validate(self) -> None:
        check_counts(self, positive=("log_every",), non_negative=("save_every", "keep_checkpoints", "log_samples"))
