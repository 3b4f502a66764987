"""``grpolab`` command line: one typed dataclass per command, parsed with tyro.

Every config field is a flag (``--group-size 8``); ``--config FILE.toml`` gives
defaults that flags override. Run ``grpolab COMMAND --help`` for the fields.
"""

from __future__ import annotations

import os
import re
import sys

from grpolab.common import startup

# Before torch is imported: OpenMP workers that spin while idle make every step
# several times slower when another process shares the 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# transformers' GGUF loader draws its own tqdm bar per tensor, which HF's logging switch does not reach and
# which floods a log file; grpolab says what it loads itself.
os.environ.setdefault("TQDM_DISABLE", "1")

from grpolab.commands.probe_commands import cmd_groupsize, cmd_mse, cmd_multiturn, cmd_rank, cmd_sweep, cmd_theory
from grpolab.commands.run_commands import cmd_doctor, cmd_eval, cmd_merge, cmd_plot, cmd_report, cmd_tokens
from grpolab.commands.train_commands import cmd_code_task, cmd_demo, cmd_generator, cmd_sft, cmd_train, cmd_trl

USAGE = """usage: grpolab COMMAND [--help] [options]

GRPO training and gradient diagnostics for causal language models.

commands:
  demo    GRPO on the built-in task from the shipped warm start, or a preset real-model run (--model smollm2-135m-instruct):
          before/after accuracy with intervals, samples and a plot
  train   GRPO training of a policy on verifiable rewards, single-turn or over episodes of an environment
          (--env FILE.py:Class, --tools FILE.py:fn); every option: grpolab train --help
  eval    held-out greedy and sampled accuracy of a model or a run's checkpoint, per category, with 95% intervals
  sft     supervised warm start of the built-in tiny Llama on worked solutions
  code-task  write the generated code task (short functions to write, with tests) as train/test JSONL files
  plot    redraw a run directory's plot.png from its metrics.jsonl
  rank    spectrum of the per-rollout gradient matrix (effective rank, top-1 fraction) over checkpoints
  theory  Monte Carlo checks of the Foundations paper's closed forms: `theory hoeffding`, `theory advantages`
  mse     MSE of the vanilla/grpo/rloo/oracle gradient estimators against G [U-statistic], or the exact bandit check
  groupsize  the three MSE constants and the best group size under a fixed budget B*G [U-statistic, Thm 7]
  multiturn  per-stage bias of GRPO's advantage in multi-turn tasks (chain: exact; an environment's episodes on a
             policy: --env arith, --env FILE.py:Class, --tools FILE.py:fn)
  merge   fold a LoRA checkpoint's adapter into its base model and save a plain model directory
  doctor  why a run is not learning: each condition its metrics show, with the evidence and one change to make
  report  one self-contained HTML page for a run: accuracy before/after with intervals, plots, samples, probe outputs
  tokens  a run's recorded completions token by token, coloured by what the update did to each (--log-token-credit)
  sweep   budget-fixed GRPO runs over group sizes and seeds: accuracy per G [U-statistic, Table 2 / Figure 5]
  generator  a generator worker: join a trainer (train --generators N) over the network and draw its rollouts
  trl     TRL's own scripts on grpolab.trl: `grpolab trl grpo --config recipe.yaml` takes what `trl grpo` takes

Run `grpolab COMMAND --help` for a command's options.
"""


# The commands that load a model: torch and transformers are imported first, the collector paused (grpolab.common.
# startup). train and demo do so themselves, after deciding whether they relaunch under torchrun.
LOADS_A_MODEL = {"eval", "sft", "rank", "mse", "groupsize", "sweep", "multiturn", "merge", "generator", "trl"}

COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "sft": cmd_sft,
    "code-task": cmd_code_task,
    "demo": cmd_demo,
    "plot": cmd_plot,
    "rank": cmd_rank,
    "theory": cmd_theory,
    "mse": cmd_mse,
    "groupsize": cmd_groupsize,
    "sweep": cmd_sweep,
    "multiturn": cmd_multiturn,
    "merge": cmd_merge,
    "doctor": cmd_doctor,
    "report": cmd_report,
    "tokens": cmd_tokens,
    "generator": cmd_generator,
    "trl": cmd_trl,
}


def main(argv: list[str] | None = None) -> None:
    """``grpolab ARGV``; a torchrun worker then exits at once (below)."""
    run(sys.argv[1:] if argv is None else argv)
    if "WORLD_SIZE" in os.environ:
        # A torchrun worker whose command finished (results written, process group left, logs closed) exits
        # without the interpreter's finalization: with other torchrun jobs on the machine, a rank now and then
        # aborted there ("terminate called without an active exception", SIGABRT, after destroy_process_group),
        # failing a finished run. The cause inside torch/gloo is not found; this only skips that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _peer_gone(error: RuntimeError) -> str | None:
    """Under torchrun, a collective's error because another rank's process is gone (gloo: "Connection closed by
    peer"; NCCL: a DistBackendError): its gist; None for any other error."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    text = str(error)
    found = re.search(r"Connection (closed|reset) by peer( \[[^\]]*\]:\d+)?", text)
    if found:
        return found.group(0)
    import torch.distributed as dist

    return text.splitlines()[0][:200] if isinstance(error, dist.DistBackendError) else None


def run(argv: list[str]) -> None:
    """One command: its errors are one line and exit status 2, an interrupt 130."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    from grpolab.common.errors import CheckpointError, GeneratorError
    from grpolab.config.train import ConfigError
    from grpolab.data.jsonl import DataError
    from grpolab.sandbox import SandboxError

    # Our own bars say what is happening; Hugging Face's per-load bars are noise. Said through the environment, read
    # when transformers is imported (not here: a command relaunched under torchrun never needs it in this process).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    import warnings

    # peft (0.x) asks transformers 5 for a renamed attribute on every adapter load; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)

    if cmd in LOADS_A_MODEL and not any(a in ("-h", "--help") for a in rest):
        startup.import_libraries()
    try:
        COMMANDS[cmd](rest)
    except (ConfigError, DataError, FileNotFoundError, CheckpointError, SandboxError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except GeneratorError as e:  # a failure of the run, not of its options
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except RuntimeError as e:
        gone = _peer_gone(e)
        if gone is None:
            raise
        # a torchrun rank whose peer stopped first (that rank's error is its own line): one line, not a traceback
        print(
            f"error: rank {os.environ.get('RANK', '?')}: another rank of the job stopped first ({gone})",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("interrupted; resume with --resume from the last checkpoint", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
