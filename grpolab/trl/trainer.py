"""TRL's ``GRPOTrainer``, run by grpolab: TRL 1.16's constructor and surface over :func:`grpolab.train`.

The trainer owns no loop. ``train()`` translates the config (:mod:`grpolab.trl.config`), hands the objects and options
to grpolab's recipe, and turns what the recipe tells it after each step (:class:`grpolab.training.recipe.RunHooks`)
into TRL's ``state.log_history`` and callback calls. The run directory is grpolab's (``args.output_dir``), so
``grpolab doctor``, ``grpolab report`` and the probes read a run started this way.

One grpolab step is one generation and the optimizer steps taken on it (``num_iterations`` passes of
``steps_per_generation / gradient_accumulation_steps`` minibatches), so TRL's ``global_step`` (optimizer steps) is
``step`` times their number, and the callbacks' ``on_step_end`` is called once a generation.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers.trainer_pt_utils as _hf_trainer_utils

from grpolab.common.errors import RewardFunctionError
from grpolab.config.run import keep_run_config_aside
from grpolab.trl import arguments, objective
from grpolab.trl.accelerator import Accelerator
from grpolab.trl.callbacks import RunCallbacks, callback_handler, trainer_state
from grpolab.trl.checks import check_arguments, warn_as_trl
from grpolab.trl.config import GRPOConfig, asks_checkpoint_dtype, set_tf32, translate
from grpolab.trl.data import check_stream_steps, is_stream, read_stream
from grpolab.trl.evaluation import (
    eval_batch_prompts,
    eval_group_size,
    eval_parts,
    evaluation_metrics,
    prepares_models,
)
from grpolab.trl.logs import summary_entry

# LoraConfig's fields that grpolab's LoRA takes, and the rest at their defaults
_LORA_TAKEN = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type", "base_model_name_or_path",
               "inference_mode", "revision"}  # fmt: skip


class GRPOTrainer:
    """TRL's GRPOTrainer: ``GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=...).train()``.

    The constructor checks and keeps what it is given; :meth:`train` runs grpolab on it. ``optimizers``,
    ``quantization_config`` and ``rollout_func`` are refused: grpolab builds its own AdamW and rollouts.

    Args:
        model (str | transformers.PreTrainedModel | peft.PeftModel): a path, Hub id or grpolab name
            (``smollm2-135m-instruct``), a loaded causal LM (trained in place), or a PEFT model (its LoRA settings
            become grpolab's, its adapter merged into the weights it starts from).
        reward_funcs (Callable | str | list | None): one or a list of TRL's forms: functions
            ``fn(prompts, completions, **columns)`` returning one reward (or None) per completion, ``"module:function"``
            strings, reward models by directory, Hub id or object; each function is checked to return one reward per
            completion (:class:`grpolab.common.errors.RewardFunctionError`). None, as in TRL, only with an environment
            that pays a reward (``get_reward``, or grpolab's ``step`` shape). Their names, weights and tokenizers are
            ``reward_func_names``, ``reward_weights`` (a float32 tensor) and ``reward_processing_classes``, as TRL's.
        args (GRPOConfig | None): TRL's config, translated to grpolab's options at :meth:`train`
            (:mod:`grpolab.trl.fields`); ``num_generations`` is G. Default: ``GRPOConfig(output_dir="<model>-GRPO")``.
        train_dataset (datasets.Dataset | list[dict] | None): the prompts: a ``prompt`` column of text or chat
            messages; every other column is passed to the reward functions by name.
        eval_dataset (datasets.Dataset | list[dict] | dict | DatasetDict | IterableDataset | None): held-out rows
            in the same form (a dict of datasets: each evaluated by itself; a stream: read whole), evaluated as TRL
            evaluates, when ``eval_strategy`` says and by :meth:`evaluate`.
        processing_class (PreTrainedTokenizerBase | ProcessorMixin | None): the tokenizer (or processor) of a loaded
            ``model`` (None: loaded from its ``config._name_or_path``, as TRL does); a path's own is loaded with it.
            After :meth:`train`, the trained policy's.
        reward_processing_classes (list | PreTrainedTokenizerBase | None): one entry per ``reward_funcs`` entry (one
            tokenizer: a list of it): the tokenizer a reward model scores with, None for a function (None, or left
            out: a loaded model's is loaded from its path now, one named by a path or id's with it at :meth:`train`).
        callbacks (list[transformers.TrainerCallback] | None): told TRL's events: ``on_train_begin``, ``on_step_end``
            once a generation (a grpolab step), ``on_log``, ``on_evaluate``, ``on_save``, ``on_train_end``;
            ``control.should_training_stop`` stops the run after the step.
        optimizers (tuple): ``(None, None)`` only.
        quantization_config: None only.
        peft_config (peft.LoraConfig | None): grpolab's LoRA: ``r``, ``lora_alpha``, ``lora_dropout`` and
            ``target_modules`` (None: peft's default for the architecture); its other fields at their defaults.
        tools (list[Callable] | None): tool functions the policy calls in episodes (docs/environments.md).
        rollout_func: None only.
        environment_factory (type | dict[str, type] | None): an environment class (TRL's ``reset(**row)`` shape), or
            a dict of them routed by an ``environment`` column: episodes (docs/environments.md).

    Raises:
        ValueError: ``optimizers``, ``quantization_config`` or ``rollout_func`` given; a PEFT model together with
            ``peft_config``; a ``peft_config`` that is not a ``LoraConfig``, sets a field grpolab's LoRA does not take,
            or leaves ``target_modules`` None for an architecture peft has no default for; TRL's construction checks
            (:mod:`grpolab.trl.checks`: no reward source, no data, reward weights or tokenizers of another count ...).
        TypeError: a ``peft_config`` that is no ``peft.PeftConfig`` (TRL's).
    """

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        if optimizers is not None and any(o is not None for o in optimizers):
            raise ValueError("GRPOTrainer(optimizers=...): grpolab builds its own AdamW and schedule from the config")
        if quantization_config is not None:
            raise ValueError("GRPOTrainer(quantization_config=...): quantised (bitsandbytes) training is not built")
        if rollout_func is not None:
            raise ValueError(
                "GRPOTrainer(rollout_func=...): grpolab's engines draw the rollouts; give environment_factory or tools"
            )
        self.args = args if args is not None else GRPOConfig(output_dir=f"{model_name(model)}-GRPO")
        self.model_spec, self._model, self.lora = _model_and_lora(model, peft_config)
        funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
        funcs = [f for f in funcs if f is not None]  # None: none (TRL's [])
        check_arguments(self.args, funcs, reward_processing_classes, train_dataset, environment_factory)
        if is_stream(train_dataset):
            check_stream_steps(self.args.max_steps)
        warn_as_trl(self.args)
        if processing_class is None and self._model is not None:  # TRL loads it from the model's path
            processing_class = arguments.processing_class_for(self._model)
        self.processing_class = processing_class
        self.reward_func_names = arguments.reward_func_names(funcs)  # named before _check_reward_funcs wraps them
        self.reward_weights = arguments.reward_weights(self.args, len(funcs))  # [len(funcs)] float32
        self.reward_processing_classes = arguments.reward_processing_classes(funcs, reward_processing_classes)
        self.reward_funcs = funcs
        self.accelerator = Accelerator(self)  # what TRL's scripts call on trainer.accelerator; settable, as TRL's
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.tools, self.environment_factory = tools, environment_factory
        self.callback_handler = callback_handler(callbacks or [])
        self.state = trainer_state()
        self.control = None
        self.run = None
        self.model_preparation_time: float | None = None  # transformers': an evaluation's before training
        self.log = print
        self._check_reward_funcs()

    method = "GRPO"
    """The method's name, as TRL's model card and class names give it."""
    absent_log_names: tuple = ()
    """TRL's log names (grpolab.trl.logs.TRL_NAMES) this trainer's TRL counterpart never logs."""

    def translate(self, world_size: int, train_rows: int | None, **kwargs):
        """grpolab's options for ``self.args`` (:func:`grpolab.trl.config.translate`, whose arguments these are)."""
        return translate(self.args, world_size, train_rows, **kwargs)

    def _checkpoint_dtype(self) -> str | None:
        """The model's own dtype, which ``model_init_kwargs``' dtype "auto" (or None) asks for: a model object's, or
        the dtype its config names (None when it names none: float32, as transformers loads it)."""
        if not asks_checkpoint_dtype(self.args):
            return None
        if self._model is not None:
            return str(next(self._model.parameters()).dtype).removeprefix("torch.")
        from grpolab.models.policy import checkpoint_dtype

        return checkpoint_dtype(self.model_spec)

    # ------------------------------------------------------------------ TRL's surface
    @property
    def model(self):
        """The policy: the trained one after ``train()``; before, the model as given (a path is loaded once)."""
        if self.run is not None:
            return self.run.policy.model
        if self._model is None:
            from grpolab.models.policy import load_policy

            policy = load_policy(self.model_spec)
            self._model = policy.model
            self.processing_class = self.processing_class or policy.processor or policy.tokenizer
        return self._model

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def train(self, resume_from_checkpoint: bool | str | None = None, trial=None, **kwargs):
        """Train; returns transformers' ``TrainOutput(global_step, training_loss, metrics)``.

        Args:
            resume_from_checkpoint (bool | str | None): True (the newest checkpoint of ``output_dir``) or the path of
                ``output_dir`` or of its newest checkpoint: grpolab resumes exactly (weights, optimizer, schedule and
                random state). None or False: a fresh run.
            trial: None only (no hyperparameter search).
            **kwargs: none taken.

        Returns:
            TrainOutput: ``global_step`` (TRL's count: optimizer steps), ``training_loss`` (the mean of the steps'
                ``loss/total``) and ``metrics`` (``train_runtime``, ``train_samples_per_second``,
                ``train_steps_per_second``, ``train_loss``, ``epoch``); the run is at ``self.run``.

        Raises:
            ValueError: a ``trial`` or other keywords; a checkpoint that is not ``output_dir``'s newest; a GRPOConfig
                field grpolab does not take (one line naming it: docs/coming-from-trl.md).
        """
        from transformers.trainer_utils import TrainOutput

        from grpolab.commands import api

        if trial is not None or kwargs:
            raise ValueError("GRPOTrainer.train: hyperparameter search trials and other keywords are not taken")
        train_data, eval_data, plan = self._data_and_plan(bool(resume_from_checkpoint))
        options = dict(plan.options)
        options |= self.lora
        set_tf32(self.args)
        if resume_from_checkpoint:
            options["resume"] = _resumes(resume_from_checkpoint, Path(self.args.output_dir))
        for line in plan.notes:
            self.log(f"grpolab.trl: {line}")
        hooks = RunCallbacks(self, plan, self._eval_parts)
        started = time.perf_counter()
        self.run = api.train(
            self._model if self._model is not None else self.model_spec,
            train_data,
            [f for f in self.reward_funcs if f is not None] or None,
            eval_dataset=eval_data,
            env=self.environment_factory,
            tools=self.tools,
            tokenizer=self.processing_class if self._model is not None else None,
            reward_processing_classes=self.reward_processing_classes,
            log=self.log,
            hooks=hooks,
            **options,
        )
        self.processing_class = self.run.policy.processor or self.run.policy.tokenizer
        runtime = time.perf_counter() - started
        losses = [m["loss/total"] for m in self.run.metrics if m.get("loss/total") is not None]
        loss = sum(losses) / len(losses) if losses else 0.0
        steps = self.state.global_step
        metrics = {
            "train_runtime": runtime,
            "train_samples_per_second": plan.options["prompts_per_step"] * getattr(self.args, "num_generations", 1)
            * (steps / max(plan.optimizer_steps_per_step, 1)) / max(runtime, 1e-9),
            "train_steps_per_second": steps / max(runtime, 1e-9),
            "train_loss": loss,
            "epoch": self.state.epoch,
        }  # fmt: skip
        # total_flos: transformers counts 6 x params x input_ids of each batch; TRL's GRPO batches carry no input_ids,
        # so TRL logs 0.0, and so does the drop-in
        self.state.total_flos = 0.0
        self.state.log_history.append(
            summary_entry(
                [] if hooks.evaluated_last else hooks.window,
                steps,
                self.state.epoch,
                metrics | {"total_flos": 0.0},
                self.absent_log_names,
            )
        )
        if self.args.push_to_hub:
            self.push_to_hub()
        return TrainOutput(steps, loss, metrics)

    def _data_and_plan(self, resumes: bool):
        """(the training rows, the held-out rows, the config's translation): a stream (``IterableDataset``) read for
        the rows ``max_steps`` generations take, in its order (:mod:`grpolab.trl.data`); the eval datasets' rows
        (:func:`grpolab.trl.evaluation.eval_parts`: a dict's one after the other, a stream's whole), all held out."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        train, held_out = self.train_dataset, None
        self._eval_parts = eval_parts(self.eval_dataset) if self.eval_dataset is not None else []
        if self._eval_parts:
            held_out = [row for part in self._eval_parts for row in part.rows]
        kw = dict(has_eval=held_out is not None, checkpoint_dtype=self._checkpoint_dtype(), resumes=resumes)
        streamed = is_stream(train)
        if streamed:
            geometry = self.translate(world, None, **kw).options
            train = read_stream(train, geometry["steps"] * geometry["prompts_per_step"])
        plan = self.translate(world, len(train) if train is not None else None, **kw)
        if streamed:  # the stream's order, as TRL's dataloader reads a stream (it shuffles none)
            plan = plan._replace(options=plan.options | {"data_order": "sequential"})
        if held_out is not None:  # every row, as TRL evaluates every row
            plan = plan._replace(options=plan.options | {"eval_questions": len(held_out)})
        return train, held_out, plan

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """TRL's evaluation of the policy (the trained one after :meth:`train`; before, the model as given):
        ``num_generations_eval`` completions of each eval prompt (default ``num_generations``), in batches of
        ``per_device_eval_batch_size`` rows, scored with every reward function and model of the run, weighted
        (:mod:`grpolab.eval.groups`); each dataset's metrics appended to ``state.log_history`` (with ``epoch`` and
        ``step``) and told to the callbacks' ``on_log`` and ``on_evaluate``, as TRL's.

        Args:
            eval_dataset (Dataset | list[dict] | dict | DatasetDict | IterableDataset | str | None): the rows
                (default: the trainer's); a dict of datasets (or a ``DatasetDict``) is evaluated dataset by dataset,
                each under the prefix ``{metric_key_prefix}_<key>``; a stream is read whole; a string, the key of one
                dataset of the trainer's dict.
            ignore_keys: not read (TRL's GRPO predicts no logits to ignore).
            metric_key_prefix (str): the prefix of transformers' keys (``eval_loss``, ``eval_runtime``, ...).

        Returns:
            dict: TRL's keys (docs/coming-from-trl.md lists those not given): ``{prefix}_loss``,
                ``{prefix}_runtime``, ``{prefix}_samples_per_second``, ``{prefix}_steps_per_second``, ``eval_reward``,
                ``eval_reward_std``, ``eval_rewards/<fn>/mean`` and ``/std``, ``eval_completions/*``,
                ``eval_entropy`` ... and ``epoch``; for a dict, every dataset's merged (GRPO's ``eval_*`` keys the
                last one's, as TRL's).

        Raises:
            ValueError: no eval_dataset here nor given to the trainer.
        """
        from transformers import TrainerControl

        from grpolab.commands import api

        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(data, str) and isinstance(self.eval_dataset, dict):  # transformers': a key of the trainer's
            data = self.eval_dataset[data]
        if data is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        parts = eval_parts(data)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        started, model = time.perf_counter(), self.model  # a path is loaded once
        was_training = model.training
        evaluations = api.evaluate_groups(
            model,
            [row for part in parts for row in part.rows],
            [f for f in self.reward_funcs if f is not None] or None,
            parts=[len(part.rows) for part in parts],
            completions=eval_group_size(self.args),
            batch_prompts=eval_batch_prompts(self.args, world),
            env=self.environment_factory,
            tools=self.tools,
            tokenizer=self.processing_class,
            reward_processing_classes=self.reward_processing_classes,
            log=lambda line: None,  # its set-up lines: TRL's evaluate says nothing
            **self._evaluation_options(world, sum(len(part.rows) for part in parts)),
        )
        model.train(was_training)
        prepared = prepares_models(self.args, self.reward_funcs, bool(self.lora))  # transformers: then none
        if self.run is None and self.model_preparation_time is None and not prepared:  # the first evaluation's
            self.model_preparation_time = round(time.perf_counter() - started - sum(e.seconds for e in evaluations), 4)
        self.control = self.control or TrainerControl()
        out: dict = {}
        for part, evaluation in zip(parts, evaluations):
            prefix = metric_key_prefix if part.name is None else f"{metric_key_prefix}_{part.name}"
            metrics = evaluation_metrics(evaluation, part, prefix, self.args, world, self.state.num_input_tokens_seen,
                                         self.model_preparation_time)  # fmt: skip
            metrics["epoch"] = self.state.epoch if self.state.epoch is not None else 0
            self.state.log_history.append({**metrics, "step": self.state.global_step})
            for event, key in (("on_log", "logs"), ("on_evaluate", "metrics")):
                getattr(self.callback_handler, event)(self.args, self.state, self.control, **{key: metrics})
            out |= metrics
        return out

    def _evaluation_options(self, world: int, rows: int) -> dict:
        """grpolab's options of an evaluation: the run's (the objective, the sampling, the model's dtype), without
        LoRA (the model as it is), a resume or training data (their order), every row held out."""
        train = self.train_dataset
        length = len(train) if train is not None and not is_stream(train) else None
        plan = self.translate(world, length, has_eval=True, checkpoint_dtype=self._checkpoint_dtype())
        return {k: v for k, v in plan.options.items() if k != "data_order"} | {"eval_questions": rows}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face directory: the model's ``save_pretrained`` (a LoRA run: its adapter, as TRL saves one) and
        the tokenizer's."""
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        keep_run_config_aside(out)
        self.model.save_pretrained(out)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, **kwargs) -> str:
        """Upload ``output_dir`` to ``hub_model_id`` (default: its name). Where the Hub cannot be reached, one line
        saying so and where the run is."""
        from huggingface_hub import HfApi
        from huggingface_hub.utils import HfHubHTTPError

        repo = self.args.hub_model_id or Path(self.args.output_dir).name
        api = HfApi(token=self.args.hub_token)
        try:
            api.create_repo(repo, private=self.args.hub_private_repo, exist_ok=True)
            info = api.upload_folder(
                repo_id=repo, folder_path=self.args.output_dir, commit_message=commit_message,
                revision=self.args.hub_revision,
            )  # fmt: skip
        except (OSError, HfHubHTTPError, ValueError) as e:  # offline, no network, no token
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise RuntimeError(
                f"push_to_hub: the Hub cannot be reached from here ({reason}); the run is in {self.args.output_dir}"
            ) from None
        return str(info)

    # transformers' Trainer's own: "***** train metrics *****" and its lines; {split}_results.json, all_results.json
    # and trainer_state.json in its formats, written on the first process only (is_world_process_zero)
    log_metrics = _hf_trainer_utils.log_metrics
    metrics_format = _hf_trainer_utils.metrics_format
    save_metrics = _hf_trainer_utils.save_metrics
    save_state = _hf_trainer_utils.save_state

    # TRL's helpers of the objective, by its names and signatures, computed by grpolab's algo functions
    get_high_entropy_mask = objective.get_high_entropy_mask
    get_off_policy_mask = staticmethod(objective.get_off_policy_mask)
    get_gamma_weights = staticmethod(objective.get_gamma_weights)

    def is_world_process_zero(self) -> bool:
        """Whether this is the first process of all (the one that writes files and logs)."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the first process on its machine."""
        return self.accelerator.is_local_main_process

    def end(self) -> None:
        """Finish the run's trackers and leave the process group (transformers' ``Trainer.end``). grpolab's run has
        closed its own trackers when ``train()`` returned; the process group is left if grpolab joined one."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **kwargs):
        """A README.md model card in ``output_dir``: the base model, the data, the method and the run's settings."""
        if not self.is_world_process_zero():
            return
        out = Path(self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        base = self.model_spec if isinstance(self.model_spec, str) else type(self.model).__name__
        name = model_name or out.name
        tags = ["grpolab", self.method.lower(), *([tags] if isinstance(tags, str) else list(tags or []))]
        group = getattr(self.args, "num_generations", 1)  # TRL's distillation: one completion a prompt
        lines = ["---", f"base_model: {base}", *([f"datasets: [{dataset_name}]"] if dataset_name else []),
                 "tags:", *(f"- {t}" for t in tags), "---", "", f"# {name}", "",
                 f"{base} trained with {self.method} by grpolab (grpolab.trl, a drop-in for TRL's {self.method}Trainer)"
                 + (f" on {dataset_name}." if dataset_name else "."), "",
                 f"- learning rate {self.args.learning_rate}, {group} completions a prompt, "
                 f"loss {getattr(self.args, 'loss_type', self.method.lower())}, beta {self.args.beta}",
                 f"- optimizer steps: {self.state.global_step}"]  # fmt: skip
        (out / "README.md").write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------ checks
    def _check_reward_funcs(self) -> None:
        """A reward function that returns the wrong number of rewards is one line naming it: wrapped here so the
        check runs whatever form it takes."""
        self.reward_funcs = [_length_checked(f) if _is_plain_function(f) else f for f in self.reward_funcs]


def _is_module(obj) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module)


def _is_plain_function(f) -> bool:
    return callable(f) and not isinstance(f, str | type) and not _is_module(f)


def _length_checked(fn: Callable) -> Callable:
    """``fn`` with a check that it returns one reward per completion, raising :class:`RewardFunctionError` (TRL stops
    on a wrong length too, with a tensor shape error; grpolab alone would score each rollout by itself and count the
    failures). Its name, signature and async-ness are kept: TRL and grpolab read the signature to tell the forms
    apart."""
    import functools

    def check(out, completions):
        if out is not None and hasattr(out, "__len__") and len(out) != len(completions):
            name = getattr(fn, "__name__", repr(fn))
            raise RewardFunctionError(
                f"reward function {name} returned {len(out)} rewards for {len(completions)} completions"
            )
        return out

    names = list(inspect.signature(fn).parameters)  # read once, not at every call
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def checked_async(*args, **kwargs):
            return check(await fn(*args, **kwargs), _completions_of(names, args, kwargs))

        return checked_async

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        return check(fn(*args, **kwargs), _completions_of(names, args, kwargs))

    return checked


def _completions_of(names: list[str], args, kwargs):
    """The completions of a call ``fn(*args, **kwargs)``, ``names`` its parameters."""
    if "completions" in kwargs:
        return kwargs["completions"]
    return args[names.index("completions")] if "completions" in names[: len(args)] else args[0]


def model_name(model) -> str:
    """The last part of a model's path or Hub id (TRL's default output directory starts with it)."""
    if isinstance(model, str):
        return model.rstrip("/").split("/")[-1]
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or "model"
    return str(path).rstrip("/").split("/")[-1]


def _model_and_lora(model, peft_config) -> tuple[str, Any, dict]:
    """(the model's spec string, the model object or None, grpolab's LoRA options)."""
    lora: dict = {}
    obj = None if isinstance(model, str) else model
    if obj is not None and hasattr(obj, "peft_config"):  # a PeftModel: its settings, its adapter merged in
        if peft_config is not None:
            raise ValueError("GRPOTrainer: a PEFT model and peft_config: give one")
        peft_config = next(iter(obj.peft_config.values()))
        obj = obj.merge_and_unload()
    if peft_config is not None:
        lora = _lora_options(peft_config, obj if obj is not None else model)
    return (model if isinstance(model, str) else ""), obj, lora


def _lora_options(cfg, model) -> dict:
    """A peft ``LoraConfig`` as grpolab's --lora-* options; its other fields at their defaults."""
    from peft import LoraConfig, PeftConfig

    if not isinstance(cfg, PeftConfig):  # TRL's TypeError
        raise TypeError(
            f"peft_config must be a peft.PeftConfig instance (e.g. peft.LoraConfig), got {type(cfg).__name__}"
        )
    if not isinstance(cfg, LoraConfig):
        raise ValueError(f"peft_config: {type(cfg).__name__}: grpolab trains LoRA adapters (peft.LoraConfig)")
    default = LoraConfig()
    for name in vars(default):
        if name in _LORA_TAKEN or name.startswith("_"):
            continue
        if getattr(cfg, name) != getattr(default, name):
            raise ValueError(f"peft_config.{name}={getattr(cfg, name)!r}: grpolab's LoRA takes r, lora_alpha, "
                             "lora_dropout and target_modules")  # fmt: skip
    targets = cfg.target_modules
    if targets is None:
        targets = _default_targets(model)
    targets = targets if isinstance(targets, str) else ",".join(sorted(targets))
    return {"lora_rank": cfg.r, "lora_alpha": float(cfg.lora_alpha), "lora_dropout": float(cfg.lora_dropout),
            "lora_targets": targets}  # fmt: skip


def _default_targets(model) -> str:
    """peft's default target modules for the model's architecture (as ``LoraConfig(target_modules=None)`` takes)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind is None and isinstance(model, str) and (Path(model) / "config.json").is_file():
        import json

        kind = json.loads((Path(model) / "config.json").read_text()).get("model_type")
    if kind not in DEFAULTS:
        raise ValueError(f"peft_config.target_modules=None: peft has no default for {kind!r}; give target_modules")
    return ",".join(DEFAULTS[kind])


def _resumes(value, out: Path) -> bool:
    """``train(resume_from_checkpoint=...)``: True, output_dir, or its newest checkpoint (grpolab's
    ``checkpoints/step_N`` or its ``checkpoint-N`` link, which ``get_last_checkpoint`` finds)."""
    if value is True:
        return True
    path = Path(value)
    if path.resolve() == out.resolve():
        return True
    from grpolab.models.checkpoint import checkpoint_dirs

    dirs = checkpoint_dirs(out)
    if dirs and path.resolve() == dirs[-1][1].resolve():
        return True
    raise ValueError(
        f"resume_from_checkpoint={value!r}: grpolab resumes output_dir ({out}) from its newest checkpoint; give True"
    )
