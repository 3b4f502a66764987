"""The commands that train or serve a policy: ``train``, ``sft``, ``code-task``, ``demo``, ``generator``, ``trl``.
Each parses its own options (:func:`grpolab.commands.parsing.parse_config`) and calls the library."""

from __future__ import annotations

import os
import sys
import time

from grpolab.commands.parsing import parse_config, saved_run_config
from grpolab.common import startup
from grpolab.models.names import BUILTIN
from grpolab.training import launch


def cmd_train(args: list[str]) -> None:
    # torch, transformers and matplotlib are imported after the relaunch: with --nproc P this process only checks
    # the config and becomes torchrun (seconds saved at every launch).
    from grpolab.config.train import TrainConfig
    from grpolab.training.setup import checked_config

    cfg = parse_config(
        TrainConfig,
        args,
        "grpolab train",
        "GRPO training of a causal LM on verifiable rewards.\n\n"
        "On several processes: --nproc P (this machine), or launch it yourself with "
        "`torchrun --nproc-per-node P [--nnodes ...] -m grpolab train ...`.\n\n"
        "--resume continues the run in --out with its own options; flags given with it change only what may change "
        "(--steps, --max-rollouts, logging, evaluation frequency, the machine and process count).",
        base_of=saved_run_config,
    )
    nproc, why = launch.auto_processes(cfg.resolved(), cfg.policy.model == BUILTIN)
    if launch.relaunches(nproc):  # refuse a bad config once, before starting P processes
        checked_config(cfg, nproc)
        said_processes(cfg.run.nproc, nproc, why)
    with launch.processes(nproc, ["train", *args]) as main_rank:
        startup.import_libraries()
        from grpolab.commands import api
        from grpolab.report.plotting import plot_run
        from grpolab.training.recipe import TrainingInterrupted

        try:
            out = api.train(config=cfg).dir
        except TrainingInterrupted as e:  # SIGTERM/SIGINT: the checkpoint is written; the conventional status
            status = 128 + e.signum
        else:
            status = 0
            if main_rank:
                print(f"run written to {out} (plot: {plot_run(out)})")
    if status:
        raise SystemExit(status)


def said_processes(given: int, nproc: int, why: str) -> None:
    """--nproc 0 says how many processes it chose, and why."""
    if given == 0:
        print(f"--nproc 0: {nproc} processes, {why} (--nproc 1 runs one)", file=sys.stderr, flush=True)


def cmd_sft(args: list[str]) -> None:
    from grpolab.training.sft import SFTConfig, run_sft

    cfg = parse_config(
        SFTConfig, args, "grpolab sft", "Supervised warm start of the built-in tiny Llama on worked solutions."
    )
    metrics = run_sft(cfg)
    print(
        f"saved to {cfg.out}: held-out accuracy greedy {metrics['eval/accuracy_greedy']:.3f}, "
        f"sampled {metrics.get('eval/accuracy_sampled', float('nan')):.3f} ({metrics['time/sft_s']:.0f} s)"
    )


def cmd_code_task(args: list[str]) -> None:
    import json
    from collections import Counter

    from grpolab.config.train import ConfigError
    from grpolab.data.code_task import CodeTaskConfig, CodeTaskSpec, write_task

    cfg = parse_config(CodeTaskConfig, args, "grpolab code-task", CodeTaskConfig.__doc__.strip())
    try:
        spec = CodeTaskSpec(tuple(cfg.families), cfg.tests_per_problem)
        paths = write_task(cfg.out, cfg.train, cfg.test, cfg.seed, spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for path in paths:
        counts = Counter(json.loads(line)["category"] for line in path.open())
        print(
            f"wrote {path}: {sum(counts.values())} problems ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})"
        )
    train, test = paths
    print(f"train on it: grpolab train --data {train} --eval-data {test} --reward-fn grpolab.rewards:code_reward")


def cmd_demo(args: list[str]) -> None:
    from grpolab.commands.demo import CHOSEN, STARTED, DemoConfig, demo_processes, run_demo

    if "WORLD_SIZE" not in os.environ:  # a torchrun child counts its start-up from the user's command
        os.environ[STARTED] = repr(time.time())
    cfg = parse_config(
        DemoConfig,
        args,
        "grpolab demo",
        "The main job: GRPO from the built-in warm start, or on a real instruct model with a preset task "
        "(--model smollm2-135m-instruct); held-out accuracy before/after with 95% intervals, samples and a plot. "
        "The built-in demo runs one process per core (--nproc 1: one).",
    )
    nproc, why = demo_processes(cfg)
    if launch.relaunches(nproc):
        os.environ[CHOSEN] = why  # the children take the reason along (they do not choose again)
        said_processes(cfg.nproc, nproc, why)
        if cfg.retrain_sft:  # trained (or found) once here, not by every process at once
            from rich.console import Console

            from grpolab.commands.demo import warm_start

            warm_start(True, Console())
    why = os.environ.get(CHOSEN, why)
    with launch.processes(nproc, ["demo", *args]):
        startup.import_libraries()
        run_demo(cfg, why)


def cmd_generator(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="grpolab generator",
        description="A generator worker: join the trainer at HOST:PORT (grpolab train --generators N "
        "--generator-listen HOST:PORT) and draw the rollouts it asks for, on this process's own device, engine, "
        "rollout dtype and threads. The trainer sends the model's config and each weight version (a torch.distributed "
        "broadcast: gloo on a CPU, NCCL on CUDA); nothing is loaded here. The worker exits when the trainer stops "
        "it, ends or dies. A trainer listening on a non-local address needs a shared token: $GRPOLAB_GENERATOR_TOKEN "
        "or --token-file, never a flag's value. Ports: the trainer's listening port, one more it picks for the "
        "weight broadcasts' rendezvous, and gloo's own connections: the trainer's host must be reachable from here "
        "on any TCP port (docs/distributed.md).",
    )
    parser.add_argument("--connect", required=True, metavar="HOST:PORT", help="the trainer's --generator-listen")
    parser.add_argument("--run", default=None, help="join only the run of this id (the trainer prints its own)")
    parser.add_argument("--device", default="cpu", help="where this worker samples (cpu, cuda, cuda:1)")
    parser.add_argument(
        "--rollout-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        help="auto: the trainer's rollout dtype (another one samples with other kernels: the rollouts then depend "
        "on which worker drew them)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="the rollout engine")
    parser.add_argument("--token-file", default="", help="a file holding the shared token")
    parser.add_argument(
        "--retry", type=float, default=60.0, help="seconds to keep trying to reach a trainer not yet listening"
    )
    ns = parser.parse_args(args)
    if ns.threads < 1:
        parser.error("--threads must be >= 1")
    from grpolab.rollout.remote.worker import WorkerOptions, run_worker

    options = WorkerOptions(
        ns.connect, ns.run, ns.device, ns.rollout_dtype, ns.threads, ns.engine, ns.token_file, ns.retry
    )
    raise SystemExit(run_worker(options))


def cmd_trl(args: list[str]) -> None:
    from grpolab.commands.trl_script import main as trl_main

    trl_main(args)
