"""The commands that read a run or a model: ``eval``, ``merge``, ``plot``, ``doctor``, ``report``, ``tokens``.
Each parses its own options and calls the library."""

from __future__ import annotations

import sys
from pathlib import Path

from grpolab.commands.parsing import parse_config, run_defaults


def cmd_eval(args: list[str]) -> None:
    from grpolab.commands import api
    from grpolab.commands.eval import EvalConfig, format_eval

    cfg = parse_config(
        EvalConfig, args, "grpolab eval", EvalConfig.__doc__.strip(), base_of=run_defaults(EvalConfig, "model")
    )
    report = api.evaluate(config=cfg)
    print(format_eval(report, cfg.show))
    if cfg.json:
        print(f"wrote {cfg.json}")


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
