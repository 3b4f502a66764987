"""``grpolab`` command line: one typed dataclass per command, parsed with tyro.

Every config field is a flag (``--group-size 8``); ``--config FILE.toml`` gives
defaults that flags override. Run ``grpolab COMMAND --help`` for the fields.
"""

from __future__ import annotations

import os
import sys

# Before torch is imported: OpenMP workers that spin while idle make every step
# several times slower when another process shares the 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

USAGE = """usage: grpolab COMMAND [--help] [options]

GRPO training and gradient diagnostics for causal language models.

commands:
  demo    SFT warm start (shipped or cached) + GRPO on the built-in arithmetic task, with a plot
  train   GRPO training of a policy on verifiable rewards (every option: grpolab train --help)
  sft     supervised warm start of the built-in tiny Llama on worked solutions
  plot    redraw a run directory's plot.png from its metrics.jsonl

Run `grpolab COMMAND --help` for a command's options.
"""


def _split_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    """Remove ``--config FILE`` (or ``--config=FILE``) from args."""
    rest, path = [], None
    it = iter(args)
    for a in it:
        if a == "--config":
            path = next(it, None)
            if path is None:
                raise SystemExit("error: --config needs a file")
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
    return path, rest


def _parse(cls, args: list[str], prog: str, description: str):
    import tyro

    from grpolab.config import load_toml

    path, rest = _split_config_flag(args)
    default = load_toml(path, cls) if path else cls()
    return tyro.cli(cls, default=default, args=rest, prog=prog, description=description + "\n\n--config FILE.toml sets defaults (keys are field names); flags override them.")


def cmd_train(args: list[str]) -> None:
    from grpolab.config import TrainConfig
    from grpolab.plotting import plot_run
    from grpolab.trainer import train

    cfg = _parse(TrainConfig, args, "grpolab train", "GRPO training of a causal LM on verifiable rewards.")
    out = train(cfg)
    print(f"run written to {out} (plot: {plot_run(out)})")


def cmd_sft(args: list[str]) -> None:
    from grpolab.sft import SFTConfig, run_sft

    cfg = _parse(SFTConfig, args, "grpolab sft", "Supervised warm start of the built-in tiny Llama on worked solutions.")
    metrics = run_sft(cfg)
    print(f"saved to {cfg.out}: held-out accuracy greedy {metrics['eval/accuracy_greedy']:.3f}, "
          f"sampled {metrics.get('eval/accuracy_sampled', float('nan')):.3f} ({metrics['time/sft_s']:.0f} s)")


def cmd_demo(args: list[str]) -> None:
    from grpolab.demo import DemoConfig, run_demo

    cfg = _parse(DemoConfig, args, "grpolab demo", "The main job: warm start + GRPO on the built-in task, before/after accuracy and a plot.")
    run_demo(cfg)


def cmd_plot(args: list[str]) -> None:
    from grpolab.plotting import plot_run

    if len(args) != 1 or args[0].startswith("-"):
        print("usage: grpolab plot RUN_DIR\n\nRedraw RUN_DIR/plot.png from RUN_DIR/metrics.jsonl.")
        raise SystemExit(0 if args and args[0] in ("-h", "--help") else 2)
    print(plot_run(args[0]))


COMMANDS = {"train": cmd_train, "sft": cmd_sft, "demo": cmd_demo, "plot": cmd_plot}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    from grpolab.config import ConfigError
    from grpolab.data.jsonl import DataError

    try:
        COMMANDS[cmd](rest)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted; resume with --resume from the last checkpoint", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
