"""``grpolab`` command line: one typed dataclass per command, parsed with tyro.

Every config field is a flag (``--group-size 8``); ``--config FILE.toml`` gives
defaults that flags override. Run ``grpolab COMMAND --help`` for the fields.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from grpolab.common import startup
from grpolab.training import launch

# Before torch is imported: OpenMP workers that spin while idle make every step
# several times slower when another process shares the 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# transformers' GGUF loader draws its own tqdm bar per tensor, which HF's logging switch does not reach and
# which floods a log file; grpolab says what it loads itself.
os.environ.setdefault("TQDM_DISABLE", "1")

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


_NUMBER_LIST = re.compile(r"^-?[0-9.eE+-]+(,-?[0-9.eE+-]+)+$")


def _split_number_lists(args: list[str]) -> list[str]:
    """Accept ``--group-sizes 2,4,8`` as well as tyro's ``--group-sizes 2 4 8``."""
    out: list[str] = []
    for a in args:
        out.extend(a.split(",") if _NUMBER_LIST.match(a) else [a])
    return out


def _merge_repeated(args: list[str], cls) -> list[str]:
    """``--policy a --policy b`` -> ``--policy a b`` for tuple-valued fields (tyro takes one occurrence), and
    ``--sampling fixed,filter`` -> ``--sampling fixed filter`` (comma lists of words, as of numbers)."""
    from grpolab.config import fields

    flags = {
        "--" + name.replace("_", "-") for name, o in fields.options(cls).items() if isinstance(o.field.default, tuple)
    }
    values: dict[str, list[str]] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in flags:
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            values.setdefault(a, []).extend(v for arg in args[i + 1 : j] for v in arg.split(",") if v)
            i = j
        else:
            rest.append(a)
            i += 1
    for flag, vals in values.items():
        rest += [flag, *vals]
    return rest


def _parse(cls, args: list[str], prog: str, description: str, base_of=None):
    """``args`` parsed into a ``cls`` config: its defaults, then a ``--config`` TOML file's options, then the flags.
    ``base_of(config)``: for a config as parsed, the config whose values replace the defaults, or None (``train
    --resume``: the run's own; the flags are then parsed again over it)."""
    import tyro

    from grpolab.config import fields, options
    from grpolab.config.toml import read_toml

    path, rest = _split_config_flag(args)
    rest = _merge_repeated(_split_number_lists(rest), cls)
    options.check_flags(cls, rest, prog.removeprefix("grpolab "))  # one line for a wrong flag, as the API's
    from_file = read_toml(path, cls) if path else {}
    description += "\n\n--config FILE.toml sets defaults (keys are option names); flags override them."

    # a section's options are flags of their own names: --group-size, not --groups.group-size; a config without
    # sections keeps tyro's names for what it nests (sft's --model.hidden-size)
    spec = tyro.conf.OmitArgPrefixes[cls] if fields.sections(cls) else cls

    def parse(base):
        default = fields.from_flat(cls, from_file, base=base)
        return tyro.cli(spec, default=default, args=rest, prog=prog, description=description)

    cfg = parse(None)
    base = base_of(cfg) if base_of is not None else None
    return cfg if base is None else parse(base)


def _run_defaults(cls, model_field: str):
    from grpolab.eval.runs import run_defaults_for  # imported late: the CLI sets OpenMP's environment first

    return run_defaults_for(cls, model_field)


def _saved_config(cfg):
    """The config of the run ``--resume`` continues (its own options are the defaults), else None."""
    if not cfg.run.resume:
        return None
    from grpolab.training.recipe import saved_config

    return saved_config(cfg.run.out)


def cmd_train(args: list[str]) -> None:
    # torch, transformers and matplotlib are imported after the relaunch: with --nproc P this process only checks
    # the config and becomes torchrun (seconds saved at every launch).
    from grpolab.config.train import TrainConfig
    from grpolab.training.setup import checked_config

    cfg = _parse(
        TrainConfig,
        args,
        "grpolab train",
        "GRPO training of a causal LM on verifiable rewards.\n\n"
        "On several processes: --nproc P (this machine), or launch it yourself with "
        "`torchrun --nproc-per-node P [--nnodes ...] -m grpolab train ...`.\n\n"
        "--resume continues the run in --out with its own options; flags given with it change only what may change "
        "(--steps, --max-rollouts, logging, evaluation frequency, the machine and process count).",
        base_of=_saved_config,
    )
    if launch.relaunches(cfg.run.nproc):  # refuse a bad config once, before starting P processes
        checked_config(cfg, cfg.run.nproc)
    with launch.processes(cfg.run.nproc, ["train", *args]) as main_rank:
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


def cmd_eval(args: list[str]) -> None:
    from grpolab.commands import api
    from grpolab.commands.eval import EvalConfig, format_eval

    cfg = _parse(
        EvalConfig, args, "grpolab eval", EvalConfig.__doc__.strip(), base_of=_run_defaults(EvalConfig, "model")
    )
    report = api.evaluate(config=cfg)
    print(format_eval(report, cfg.show))
    if cfg.json:
        print(f"wrote {cfg.json}")


def cmd_sft(args: list[str]) -> None:
    from grpolab.training.sft import SFTConfig, run_sft

    cfg = _parse(
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

    cfg = _parse(CodeTaskConfig, args, "grpolab code-task", CodeTaskConfig.__doc__.strip())
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
    from grpolab.commands.demo import DemoConfig, run_demo

    cfg = _parse(
        DemoConfig,
        args,
        "grpolab demo",
        "The main job: GRPO from the built-in warm start, or on a real instruct model with a preset task "
        "(--model smollm2-135m-instruct); held-out accuracy before/after with 95% intervals, samples and a plot.",
    )
    run_demo(cfg)


def cmd_plot(args: list[str]) -> None:
    import argparse

    from grpolab.report.plotting import plot_compare, plot_run

    parser = argparse.ArgumentParser(
        prog="grpolab plot",
        description="Redraw RUN_DIR/plot.png from RUN_DIR/metrics.jsonl; with --compare, draw "
        "the given metrics of several runs in one figure (runs named NAME-seedN are averaged per NAME).",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--compare", metavar="OUT.png", help="write a comparison figure of all RUN_DIRs here")
    parser.add_argument(
        "--keys", default="eval/accuracy_sampled,eval/accuracy_greedy", help="comma-separated metric keys for --compare"
    )
    ns = parser.parse_args(args)
    if ns.compare:
        print(plot_compare(ns.run_dirs, ns.keys.split(","), ns.compare))
        return
    for d in ns.run_dirs:
        print(plot_run(d))


def cmd_rank(args: list[str]) -> None:
    from grpolab.analysis.rank import RankConfig, table1, table_by_step
    from grpolab.commands import api

    cfg = _parse(
        RankConfig,
        args,
        "grpolab rank",
        "Effective rank and top-1 energy of GRPO's per-rollout gradient matrix [Foundations, Sec. 7].",
        _run_defaults(RankConfig, "checkpoint"),
    )
    with launch.processes(cfg.nproc, ["rank", *args]) as main_rank:
        report = api.rank(config=cfg)
    if not main_rank:
        return
    print(table_by_step(report["results"]))
    print("\nOver steps (the Foundations paper's Table 1 shape):")
    print(table1(report["results"]))
    if cfg.verify:
        for r in report["results"]:
            print(
                f"step {r['step']} R={r['R']}: gram_max_rel_err {r['gram_max_rel_err']:.2e}, "
                f"gram_time_ratio {r['gram_time_ratio']:.2f}, reference_time_ratio {r['reference_time_ratio']:.2f}"
            )
    print(f"wrote {cfg.out}/rank.json and plots")


def cmd_mse(args: list[str]) -> None:
    from grpolab.analysis.mse_cmd import MseConfig, format_bandit, format_mse, run_bandit, run_sampling_bias
    from grpolab.analysis.sampling_bias import format_sampling_bias
    from grpolab.commands import api

    cfg = _parse(
        MseConfig, args, "grpolab mse", MseConfig.__doc__.strip().split("\n\n")[0], _run_defaults(MseConfig, "policy")
    )
    cfg.validate()
    if cfg.env == "bandit" and cfg.bandit.sampling:
        records = run_sampling_bias(cfg)
        for G in cfg.group_sizes:
            print(
                f"\nB = {cfg.bandit.prompts_per_step}, G = {G} ({cfg.bandit.estimator}; {cfg.bandit.trials} steps per mode; "
                f"c: E[g] = c grad J on each prompt, 1 = unbiased)"
            )
            print(format_sampling_bias([r for r in records if r["G"] == G]))
        if cfg.bandit.json:
            print(f"wrote {cfg.bandit.json}")
        return
    if cfg.env == "bandit":
        print(format_bandit(run_bandit(cfg)))
        if cfg.bandit.json:
            print(f"wrote {cfg.bandit.json}")
        return
    with launch.processes(cfg.nproc, ["mse", *args]) as main_rank:
        report = api.mse(config=cfg)
    if not main_rank:
        return
    print(format_mse(report))
    print(f"wrote {cfg.out}/mse.json and mse.png")


def cmd_groupsize(args: list[str]) -> None:
    from grpolab.analysis.mse_cmd import GroupsizeConfig, format_groupsize
    from grpolab.commands import api

    doc = GroupsizeConfig.__doc__.strip().split("\n\n")[0]
    cfg = _parse(GroupsizeConfig, args, "grpolab groupsize", doc, _run_defaults(GroupsizeConfig, "policy"))
    cfg.validate()
    with launch.processes(cfg.nproc, ["groupsize", *args]) as main_rank:
        report = api.groupsize(config=cfg)
    if main_rank:
        print(format_groupsize(report))
        print(f"wrote {cfg.out}/groupsize.json and groupsize.png")


def cmd_sweep(args: list[str]) -> None:
    from grpolab.analysis.sweep import SweepConfig, format_sweep, run_sweep

    cfg = _parse(SweepConfig, args, "grpolab sweep", SweepConfig.__doc__.strip().split("\n\n")[0])
    cfg.validate()
    print(format_sweep(run_sweep(cfg)))
    print(f"wrote {cfg.out}/sweep.json and sweep.png")


def cmd_multiturn(args: list[str]) -> None:
    from grpolab.analysis.multiturn import MultiturnConfig, format_multiturn
    from grpolab.commands import api

    cfg = _parse(
        MultiturnConfig,
        args,
        "grpolab multiturn",
        MultiturnConfig.__doc__.strip(),
        _run_defaults(MultiturnConfig, "policy"),
    )
    cfg.validate()
    print(format_multiturn(api.multiturn_bias(config=cfg)))
    print(f"wrote {cfg.out}/multiturn.json and multiturn.png" + (f" and {cfg.json}" if cfg.json else ""))


def cmd_merge(args: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="grpolab merge",
        description="Merge a LoRA checkpoint's adapter into its "
        "base model (the run's --model) and write a plain Hugging Face model directory.",
    )
    parser.add_argument(
        "--checkpoint", required=True, help="a checkpoint directory of a --lora-rank run (runs/X/checkpoints/step_N)"
    )
    parser.add_argument("--out", required=True, help="directory for the merged model")
    parser.add_argument("--model", default="", help="base model spec; default: the run's config.json")
    parser.add_argument("--gguf-file", default="", help="GGUF file of the base, when --model is a directory")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the dtype the merged model is saved in (the merge itself runs in fp32); auto: the base model's own, "
        "as its config.json records it (float32 for a GGUF base)",
    )
    ns = parser.parse_args(args)
    from grpolab.commands.merge import merge_checkpoint

    base = merge_checkpoint(ns.checkpoint, ns.out, ns.model, ns.gguf_file, ns.dtype)
    print(f"merged {Path(ns.checkpoint)} into {base}: {ns.out} ({ns.dtype})")


def cmd_doctor(args: list[str]) -> None:
    import argparse

    from grpolab.doctor.conditions import NAMES

    parser = argparse.ArgumentParser(
        prog="grpolab doctor",
        description="Read a run directory (metrics.jsonl, samples.jsonl, rollouts.jsonl when logged, config.json) and "
        "print, most serious first, each condition that keeps it from learning: " + ", ".join(NAMES) + ". Each "
        "comes with its evidence (metric, steps, threshold), one change to make and, where the run's samples show "
        "it, an example. The checks are replayed at the steps training checks (every --doctor-every steps): a "
        "finding says the step it was first found at and whether the last check still found it. A healthy run "
        "gets 'no problems found' and the figures that say so. Exit status 0 either way.",
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory (grpolab train/demo --out), finished or not"
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")
    parser.add_argument(
        "--every", type=int, default=0, metavar="N", help="check every N steps (default: the run's --doctor-every)"
    )
    ns = parser.parse_args(args)
    if ns.every < 0:
        parser.error("--every must be >= 0")
    import json

    from grpolab.doctor.examine import as_json, check_every, examine, format_findings

    run, findings = examine(ns.run_dir, ns.every or None)
    every = check_every(run, ns.every or None)
    print(json.dumps(as_json(run, findings, every), indent=2) if ns.json else format_findings(run, findings, every))


def cmd_report(args: list[str]) -> None:
    import argparse

    from grpolab.report.token_view import QUANTITIES

    parser = argparse.ArgumentParser(
        prog="grpolab report",
        description="Write one self-contained HTML page for a run: the before/after held-out "
        "accuracy (overall and per category, 95%% intervals), the metric plots, sample completions before and after, "
        "every probe output (rank, mse, groupsize, multiturn, sweep) found in the run directory or given with --probe, "
        "where the update's credit landed token by token (runs trained with --log-token-credit K), "
        "and the configuration. Images are embedded; the page loads nothing from outside itself.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (grpolab train/demo --out)")
    parser.add_argument(
        "--out", default="", metavar="FILE.html", help="where to write the page (default: RUN_DIR/report.html)"
    )
    parser.add_argument(
        "--probe",
        action="append",
        default=[],
        metavar="DIR",
        help="a probe output directory (or its .json) to include as well; repeatable",
    )
    parser.add_argument(
        "--quantity",
        default="dlogp",
        choices=list(QUANTITIES),
        help="what colours the tokens of the 'Where the credit lands' section (runs with --log-token-credit)",
    )
    ns = parser.parse_args(args)
    from grpolab.report.page import build_report

    print(f"report: {build_report(ns.run_dir, ns.probe, ns.out or None, quantity=ns.quantity)}")


def _prompt_rollout(text: str) -> tuple[int, int]:
    import argparse

    try:
        prompt, rollout = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROMPT:ROLLOUT (two integers, e.g. 0:2), got {text!r}") from None
    return prompt, rollout


def _tokens_parser():
    import argparse

    from grpolab.report.token_view import QUANTITIES

    quantities = "\n".join(f"  {name:<13} {q.meaning}" for name, q in QUANTITIES.items())
    parser = argparse.ArgumentParser(
        prog="grpolab tokens",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Show a run's recorded rollouts token by token (RUN/token_credit.jsonl, written by\n"
        "`grpolab train --log-token-credit K`), each token's background coloured by one quantity\n"
        "on one scale shared by the rollouts shown (diverging ones: blue above the centre, red below).\n"
        "When stdout is not a terminal (or with --plain), plain text is printed instead:\n"
        "one line per token with its values.\n\nquantities (--quantity):\n" + quantities,
    )
    parser.add_argument("run_dir", metavar="RUN", help="a run directory trained with --log-token-credit K")
    parser.add_argument(
        "--step", type=int, default=None, help="the optimizer step to show (default: the last recorded)"
    )
    parser.add_argument("--quantity", default="dlogp", choices=list(QUANTITIES), help="what colours the tokens")
    parser.add_argument(
        "--rollout", type=_prompt_rollout, default=None, metavar="PROMPT:ROLLOUT", help="show this rollout only"
    )
    parser.add_argument("--plain", action="store_true", help="plain text with the values, even on a terminal")
    parser.add_argument(
        "--png",
        default="",
        metavar="FILE",
        help="draw the step's rollouts (2 with a positive, 2 with a negative advantage) as a picture instead; with "
        "--summary, the aggregates against step",
    )
    parser.add_argument(
        "--summary",
        type=int,
        default=0,
        metavar="PARTS",
        help="instead: the credit aggregates (shares of the change on answer, reasoning, format and unsure tokens, "
        "its concentration, its correlation with the advantage's sign) in PARTS spans of the run's steps, each a mean "
        "over its steps with a 95%% interval",
    )
    return parser


def cmd_tokens(args: list[str]) -> None:
    from grpolab.report.token_view import read_token_credit, render_terminal

    ns = _tokens_parser().parse_args(args)
    records = read_token_credit(ns.run_dir, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    try:
        if ns.summary:
            from grpolab.probes.token_credit import step_aggregates, summarise_credit
            from grpolab.report.token_view.terminal import summary_table

            per_step = step_aggregates(records)
            print(summary_table(summarise_credit(per_step, ns.summary)))
            if ns.png:  # the aggregates against step, recomputed from the records as the table is
                from grpolab.report.token_view.page import credit_figure

                rows = [
                    {"step": r["step"], **{f"credit/{k}": v for k, v in r.items() if k != "step"}} for r in per_step
                ]
                Path(ns.png).write_bytes(credit_figure(rows) or b"")
                print(f"aggregates: {ns.png}")
            return
        if ns.png:
            from grpolab.report.token_view.figure import tokens_figure

            Path(ns.png).write_bytes(tokens_figure(records, ns.step, ns.quantity))
            print(f"tokens: {ns.png}")
            return
        render_terminal(records, ns.step, ns.quantity, plain=True if ns.plain else None, rollout=ns.rollout)
    except ValueError as e:  # an unknown step or rollout: say which were recorded
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_theory(args: list[str]) -> None:
    import json

    from grpolab.analysis.theory import (
        AdvantagesConfig,
        HoeffdingConfig,
        advantages_check,
        format_advantages,
        format_hoeffding,
        hoeffding_rows,
    )

    usage = "usage: grpolab theory {hoeffding,advantages} [--help] [options]"
    if not args or args[0] not in ("hoeffding", "advantages"):
        print(usage)
        raise SystemExit(0 if args and args[0] in ("-h", "--help") else 2)
    if args[0] == "hoeffding":
        cfg = _parse(
            HoeffdingConfig,
            args[1:],
            "grpolab theory hoeffding",
            "[Foundations, App. A.2]: the Hoeffding bound on the group-mean baseline's error, next to Monte Carlo.",
        )
        rows = hoeffding_rows(cfg)
        print(json.dumps(rows, indent=2) if cfg.json else format_hoeffding(rows, cfg))
        return
    cfg = _parse(
        AdvantagesConfig,
        args[1:],
        "grpolab theory advantages",
        "[Foundations, Thm 4.1]: zero-sum advantage statistics for Bernoulli(p) rewards, Monte Carlo vs theory.",
    )
    res = advantages_check(cfg)
    print(json.dumps(res, indent=2) if cfg.json else format_advantages(res, cfg))


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


# The commands that load a model: torch and transformers are imported first, the collector paused (grpolab.common.
# startup). train does so itself, after deciding whether it relaunches under torchrun.
LOADS_A_MODEL = {"eval", "sft", "demo", "rank", "mse", "groupsize", "sweep", "multiturn", "merge", "generator", "trl"}

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
