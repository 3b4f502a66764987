"""A training run around the steps: ``setup()`` -> ``train()`` -> ``cleanup()``, and :func:`train`, which runs one.

Set-up, in named steps whose order matters:

1. the config, with the model's defaults filled in and validated once, and the process group (under torchrun);
2. the run directory: checked (a new run) or read (``--resume``: the saved config, the newest
   intact checkpoint), before rank 0 writes anything;
3. the config resolved once (precision, rollout dtype, engine correction: a resumed run's as it
   resolved them), then the trainer, with the checkpoint's weights and the run's original KL
   reference on resume;
4. the training state: on resume every stage's from the checkpoint (``grpolab.training.checkpoints``)
   and the truncated logs, otherwise ``config.json``, the resolved config as it is;
5. the metrics logger and the doctor's watcher (rank 0).

``train()`` then runs the steps with evaluations, logs and checkpoints; SIGTERM/SIGINT finish the
current step, save it and stop (:class:`TrainingInterrupted`).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from grpolab.common import distributed as dist_
from grpolab.common.distributed import SINGLE, World
from grpolab.common.given import NOTHING, Given, is_description
from grpolab.common.progress import progress_bar
from grpolab.config import fields
from grpolab.config.run import run_config_file
from grpolab.config.train import BEFORE_RECORDED, ConfigError, TrainConfig
from grpolab.doctor.examine import Watcher
from grpolab.models import checkpoint
from grpolab.models.policy import load_policy
from grpolab.rollout.worker_events import step_line
from grpolab.training import checkpoints
from grpolab.training.observers import observers_for
from grpolab.training.runlog import RunLogger, git_revision, read_metrics, truncate_jsonl
from grpolab.training.setup import checked_config, hub_sources, resolve_config, resolve_options, seed_process
from grpolab.training.trainer import GRPOTrainer

RUN_LOGS = (
    "metrics.jsonl",
    "samples.jsonl",
    "rollouts.jsonl",
    "token_credit.jsonl",
    "probe.jsonl",
    "generators.jsonl",
    "hacking.jsonl",
)
"""The run directory's logs by step, cut back to the checkpoint's step on --resume."""


class TrainingInterrupted(Exception):
    """SIGTERM or SIGINT stopped the run after a finished step, whose checkpoint was written."""

    def __init__(self, signum: int, step: int, path: Path):
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {path}")


class StopSignals:
    """While training: the first SIGTERM/SIGINT asks the loop to stop after the current step; a second one
    exits at once (the signal's default action). Handlers are only installed in the main thread."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = 0
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signum:  # the second signal: no more waiting
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        print(
            f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
            "(send it again to exit at once)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class StatusLine:
    """What the trainer says it is doing (``status(text)``), shown by ``show`` (the progress bar's status line
    while steps run; nothing before)."""

    def __init__(self):
        self.show = lambda text: None

    def __call__(self, text: str) -> None:
        self.show(text)


def build_trainer(cfg: TrainConfig, log=print, world: World = SINGLE, given: Given = NOTHING, **kwargs) -> GRPOTrainer:
    """A trainer as a run sets one up, from ``cfg`` as given: resolved once (:func:`resolve_config`), then
    :func:`start_trainer` (``kwargs`` go to the trainer)."""
    engine_given = kwargs.get("engine") is not None
    return start_trainer(resolve_config(cfg, world, given, engine_given), log, world, given, **kwargs)


def start_trainer(cfg: TrainConfig, log=print, world: World = SINGLE, given: Given = NOTHING, **kwargs) -> GRPOTrainer:
    """The trainer of a resolved ``cfg``: the process seeded and threaded by the run's --seed and --threads (before the
    trainer exists: LoRA's initial weights draw from it), then the trainer (``kwargs`` go to it), then the observers
    its config asks for (the rollout logs, the probes, the token-credit records)."""
    seed_process(cfg)
    trainer = GRPOTrainer(cfg, log=log, world=world, given=given, **kwargs)
    trainer.observers.extend(
        observers_for(cfg, trainer.update_stage, world, trainer.device, task=trainer.task_stage, log=log)
    )
    return trainer


class RunHooks:
    """What a caller around the run is told (``grpolab.trl``'s callbacks): each is a no-op here. Called on every
    rank, after the step's metrics are logged and its checkpoint written."""

    def begin(self, recipe: TrainRecipe) -> None:
        """Set-up is done; no step has run (``recipe.start`` is the step a resumed run continues after)."""

    def evaluated(self, step: int, metrics: dict) -> None:
        """The evaluation before the first step (step 0) finished."""

    def step_end(self, step: int, metrics: dict, saved: bool) -> bool:
        """Step ``step`` finished (``saved``: its checkpoint was written). True asks the run to stop after it."""
        return False

    def end(self, recipe: TrainRecipe) -> None:
        """The last step finished (not called when the run raised)."""


class TrainRecipe:
    """One training run. Under torchrun (``WORLD_SIZE`` > 1) this process trains its share; rank 0 alone
    logs, writes metrics, samples and checkpoints. ``hooks``: told of each step (:class:`RunHooks`)."""

    def __init__(self, cfg: TrainConfig, log=print, given: Given = NOTHING, hooks: RunHooks | None = None):
        self.requested, self.log, self.given = cfg, log, given
        self.hooks = hooks or RunHooks()
        self.hooked = hooks is not None  # only a caller's hooks can ask to stop: no collective per step without
        self.logger: RunLogger | None = None
        self.doctor: Watcher | None = None
        self.status = StatusLine()  # what the trainer is doing, on the progress bar once train() starts one

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        self._setup_world()
        self._setup_run_dir()
        dist_.barrier(self.world)  # every rank has checked the directory before rank 0 writes to it
        self._setup_trainer()
        self._setup_state()
        self._setup_logging()

    def _setup_world(self) -> None:
        """The config, with the model's defaults filled in (as recorded in config.json), validated once for the
        process count; then the process group."""
        self.cfg = checked_config(self.requested, dist_.env_world_size(), self.given)
        self.world = dist_.init(self.cfg.machine.device)
        if not self.world.is_main:
            self.log = _quiet

    def _setup_run_dir(self) -> None:
        """Check (and for a new run, create) the run directory; on --resume read its config and find the newest
        *intact* checkpoint (a damaged newer one is named in a warning and skipped).

        Only reads and ``mkdir``: every rank runs it before rank 0 writes anything.
        """
        cfg = self.cfg
        self.out, self.start, self.ckpt, self.saved = Path(cfg.run.out), 0, None, None
        if cfg.run.resume:
            self.saved, started = _read_resumable(self.out, cfg, self.given)
            self.cfg = cfg.continuing(started)
            try:
                self.start, self.ckpt = checkpoint.newest_intact(self.out, warn=self.log)
            except checkpoint.CheckpointError as e:
                raise ConfigError(f"--resume: {e}") from None
            return
        metrics = self.out / "metrics.jsonl"
        if metrics.exists() and metrics.stat().st_size > 0:
            raise ConfigError(
                f"--out {self.out}: already holds a run; pass --resume to continue it or choose another directory"
            )
        self.out.mkdir(parents=True, exist_ok=True)

    def _setup_trainer(self) -> None:
        """The config resolved once (a resumed run's options resolved at start are its own, taken in
        :meth:`_setup_run_dir`), then the trainer. On resume the weights come from the checkpoint (with LoRA: the base
        as configured, the adapter from the checkpoint), and the KL reference is the run's *starting* model, not the
        checkpoint."""
        self.cfg = cfg = resolve_options(self.cfg, self.world.local_rank, self.given)
        ckpt, adapter_from, reference, weights_from = self.ckpt, None, None, None
        live = self.given.lookup(cfg.policy.model, "--model")  # a model object given to the Python API
        fingerprint = self.saved.get("model_fingerprint") if self.saved else None
        if live is not None and ckpt is None:
            fingerprint = checkpoint.weights_fingerprint(live[0])  # its starting weights, for a resume to recognise
        if ckpt is not None and cfg.policy.lora_rank:
            adapter_from = ckpt
        elif ckpt is not None and live is not None:
            reference = _resume_object(live[0], ckpt, fingerprint, cfg.objective.beta, self.log)
        elif ckpt is not None:
            weights_from = ckpt
            if cfg.objective.beta > 0:
                reference = _starting_model(self.saved)
        self.trainer = start_trainer(
            cfg,
            log=self.log,
            world=self.world,
            given=self.given,
            status=self.status,
            adapter_from=adapter_from,
            weights_from=weights_from,
            reference=reference,
        )
        # What config.json records: the resolved config, with the run's own model (not a checkpoint it resumed from)
        # and the process count.
        model = self.saved["model"] if self.saved else cfg.policy.model
        self.config_dict = {**cfg.to_dict(), "model": model, "world_size": self.world.size}
        if fingerprint is not None:
            self.config_dict["model_fingerprint"] = fingerprint
        hub = hub_sources(
            cfg.dataset,
            self.trainer.policy.origin if ckpt is None else self.saved.get("hub", {}).get("model"),
            self.trainer.task_stage.reward_model_origins,
        )
        if hub:
            self.config_dict["hub"] = hub

    def _setup_state(self) -> None:
        """Resume: every stage's state from the checkpoint (``grpolab.training.checkpoints``), and the logs cut back to
        it. A new run: config.json."""
        out = self.out
        if self.ckpt is None:
            if self.world.is_main:
                (out / "config.json").write_text(
                    json.dumps({**self.config_dict, "code_version": git_revision()}, indent=2)
                )
            return
        self.start = checkpoints.restore(self.trainer, self.ckpt)["step"]
        if self.world.is_main:
            for name in RUN_LOGS:
                truncate_jsonl(out / name, self.start)
        where = f" on {self.world.size} processes" if self.world.distributed else ""
        self.log(f"resuming {out} from step {self.start}" + where)

    def _setup_logging(self) -> None:
        if self.world.is_main:
            cfg = self.cfg
            # a resumed run's rows so far (cut back to the checkpoint): the doctor checks the whole run
            rows = read_metrics(self.out / "metrics.jsonl") if self.ckpt is not None else []
            self.logger = RunLogger(
                self.out,
                config=self.config_dict,
                tensorboard=cfg.logging.tensorboard,
                wandb=cfg.logging.wandb,
                warn=self.log,
            )
            if cfg.diagnosis.doctor == "on":
                self.doctor = Watcher(
                    self.config_dict, cfg.diagnosis.doctor_every, rows, log=self.log, out=str(self.out)
                )

    # ------------------------------------------------------------------ train
    def train(self) -> Path:
        """The steps from the first not yet run to --steps (or --max-rollouts); returns the run directory."""
        cfg, trainer = self.cfg, self.trainer
        bar_on = cfg.logging.progress and self.world.is_main
        with (
            StopSignals() as stop,
            progress_bar(
                "step", cfg.run.steps, enabled=bar_on, start=self.start, every=cfg.logging.log_every, unit="step"
            ) as bar,
        ):
            done = [self.start]  # the last finished step: what the bar counts while a step or evaluation runs
            self.status.show = lambda text: bar.update(done[0], text)
            self.hooks.begin(self)
            if self.start == 0:
                self.hooks.evaluated(0, self._evaluate(0))
            spent = self._budget_spent()  # resuming a run that reached --max-rollouts
            for step in range(self.start + 1, (self.start if spent else cfg.run.steps) + 1):
                metrics, last, saved = self._run_step(step)
                done[0] = step
                bar.update(step, _status_line(metrics), force="eval/accuracy_sampled" in metrics)
                asked = self.hooks.step_end(step, metrics, saved)
                if self.hooked and dist_.all_max(int(asked), self.world) and not last:
                    if not saved:
                        self.trainer.save(self.out, step)
                    self.log(f"stopped after step {step}, as asked")
                    break
                if last:
                    if step < cfg.run.steps:
                        self.log(
                            f"--max-rollouts {cfg.run.max_rollouts}: {trainer.rollouts_total} rollouts generated "
                            f"by step {step}; stopping"
                        )
                    break
                self._stop_if_signalled(stop, step, saved)
        self.hooks.end(self)
        return self.out

    def _run_step(self, step: int) -> tuple[dict, bool, bool]:
        """One step, with its evaluation, logs and checkpoint when due. Returns (metrics, last step?, saved?)."""
        cfg = self.cfg
        out_step = self.trainer.step(step)
        metrics = out_step.metrics
        # --max-rollouts: this step reached the budget, so it is the last one (evaluated and saved).
        last = step == cfg.run.steps or self._budget_spent()
        if (cfg.eval.eval_every and step % cfg.eval.eval_every == 0) or last:
            metrics.update(self._evaluate(step, train_samples=out_step.samples, log_metrics=False))
        if self.doctor:
            metrics.update(self.doctor.check(step, metrics))
        if self.logger:
            self.logger.log(step, metrics)
            if out_step.rollouts is not None:
                self.logger.log_rollouts(step, out_step.rollouts)
            if out_step.token_credit is not None:
                self.logger.log_token_credit(step, out_step.token_credit)
            if out_step.probe is not None:
                self.logger.log_probe(step, out_step.probe)
            if out_step.engine_events:
                self.logger.log_generators(step, out_step.engine_events)
            if out_step.hacking:
                self.logger.log_hacking(step, out_step.hacking)
        due = step % cfg.logging.log_every == 0 or step == self.start + 1
        if due and out_step.engine_events is not None and self.world.is_main:
            line = step_line(out_step.engine_events)
            if line:
                self.log(f"step {step}: {line}")
        saved = bool((cfg.logging.save_every and step % cfg.logging.save_every == 0) or last)
        if saved:
            self.trainer.save(self.out, step)
        return metrics, last, saved

    def _evaluate(self, step: int, train_samples: list[dict] | None = None, log_metrics: bool = True) -> dict:
        """Held-out evaluation at ``step``; its samples (and the step's training samples) go to samples.jsonl."""
        metrics, examples = self.trainer.evaluate(step)
        if self.logger:
            if log_metrics:
                self.logger.log(step, metrics)
                if self.doctor:
                    self.doctor.add(step, metrics)
            if train_samples is not None:
                self.logger.log_samples(step, [{"kind": "train", **s} for s in train_samples])
            self.logger.log_samples(step, [{"kind": "eval", **e} for e in examples if e.get("kind") != "honeypot"])
            paid = [{k: v for k, v in e.items() if k != "kind"} for e in examples if e.get("kind") == "honeypot"]
            if paid:  # the honeypots' paid completions: the doctor's evidence
                self.logger.log_hacking(step, [{"sign": "honeypot", "rollouts": paid}])
        return metrics

    def _budget_spent(self) -> bool:
        cfg = self.cfg
        return bool(cfg.run.max_rollouts and self.trainer.rollouts_total >= cfg.run.max_rollouts)

    def _stop_if_signalled(self, stop: StopSignals, step: int, saved: bool) -> None:
        """After a step: if any rank got SIGTERM/SIGINT, every rank saves (unless just saved) and stops."""
        signum = dist_.all_max(stop.signum, self.world)  # every rank stops after the same step
        if not signum:
            return
        if not saved:
            self.trainer.save(self.out, step)
        path = self.out / "checkpoints" / f"step_{step}"
        self.log(
            f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {path}; continue with --resume"
        )
        raise TrainingInterrupted(signum, step, path)

    # ------------------------------------------------------------------ cleanup
    def cleanup(self) -> None:
        if getattr(self, "trainer", None) is not None:
            self.trainer.close()
        if self.logger:
            self.logger.close()


def run_training(cfg: TrainConfig, log=print, given: Given = NOTHING, hooks: RunHooks | None = None) -> TrainRecipe:
    """Run GRPO as configured; returns the finished recipe (its ``out`` directory, its ``trainer.policy``)."""
    recipe = TrainRecipe(cfg, log, given, hooks)
    recipe.setup()
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    return recipe


def train(cfg: TrainConfig, log=print) -> Path:
    """Run GRPO as configured; returns the run directory."""
    return run_training(cfg, log).out


def _status_line(metrics: dict) -> str:
    status = f"reward {metrics['reward/mean']:.3f}  acc {metrics['reward/accuracy']:.3f}"
    if "eval/accuracy_sampled" in metrics:
        status += f"  eval greedy {metrics['eval/accuracy_greedy']:.3f} sampled {metrics['eval/accuracy_sampled']:.3f}"
    return status


def saved_config(out: str | Path) -> TrainConfig:
    """The config of the run in ``out`` (its config.json), the defaults of ``--resume``: a resumed run takes its own
    options, and flags given beside ``--resume`` change only what may change (:meth:`TrainConfig.resume_conflicts`).
    """
    path = run_config_file(out)
    if not path.is_file():
        raise ConfigError(f"--resume: {out} holds no run (no config.json)")
    return TrainConfig.of_run(json.loads(path.read_text()))


def _saved_dict(path: Path) -> dict:
    """A run's config.json, with the options it predates given the values that run used."""
    return {**BEFORE_RECORDED, **json.loads(path.read_text())}


def _read_resumable(out: Path, cfg: TrainConfig, given: Given) -> tuple[dict, TrainConfig]:
    """The saved config.json of the run --resume continues, as written and as a config, after checking it can be
    continued with ``cfg``."""
    if not checkpoint.checkpoint_dirs(out):
        raise ConfigError(f"--resume: no complete checkpoint in {out / 'checkpoints'}")
    saved = _saved_dict(run_config_file(out))
    _check_objects(saved, cfg, given)
    started = TrainConfig.of_run(saved).folded()  # compared as this run's is: --dtype as the --precision it stands for
    for key in cfg.resume_conflicts(started):
        was, now = fields.get(started, key), fields.get(cfg, key)
        raise ConfigError(
            f"--resume: --{key.replace('_', '-')} is {now!r} but the run was started with {was!r}; "
            "continuing it with another value would not be the same run (start a new one with another --out)"
        )
    return saved, started


def _resume_object(model: torch.nn.Module, ckpt: Path, start: str | None, beta: float, log) -> torch.nn.Module | None:
    """Resume into a model object given to the Python API: the checkpoint's weights are loaded into it (it is what
    trains). Returns the KL reference (beta > 0): a frozen copy of the object as given, which must then hold the run's
    starting weights (their fingerprint in config.json), not trained ones."""
    reference = None
    if beta > 0:
        if checkpoint.weights_fingerprint(model) != start:
            raise ConfigError(
                "--resume: the KL reference (--beta) is the run's starting model, and the model object given holds "
                "other weights (trained ones?); pass the model as it was when the run started"
            )
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    checkpoint.load_weights(model, ckpt)
    log(f"loaded the weights of {ckpt} into the model object")
    return reference


def _check_objects(saved: dict, cfg: TrainConfig, given: Given) -> None:
    """A run started with Python objects (their descriptions in config.json) resumes only with objects described
    alike, given again in this call: one line naming the first that is missing or different."""
    for key in fields.object_options(TrainConfig):
        was, now = saved.get(key), fields.get(cfg, key)
        was = list(was) if isinstance(was, list | tuple) else [was]
        now = list(now) if isinstance(now, list | tuple) else [now]
        for i, w in enumerate(was):
            if is_description(w) and (i >= len(now) or now[i] != w or w not in given):
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"--resume: the run was started with {w}; {given.pass_again(flag)}")


def _starting_model(saved: dict) -> torch.nn.Module:
    """The run's starting model (from its config.json), frozen: the KL reference of a resumed run."""
    start = load_policy(saved["model"], gguf_file=saved.get("gguf_file", ""), revision=saved.get("revision", ""))
    return start.model.eval().requires_grad_(False)


def _quiet(*args, **kwargs) -> None:
    """The log of ranks other than 0."""
