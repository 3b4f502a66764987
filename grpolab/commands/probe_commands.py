"""The commands that measure GRPO's gradient: ``rank``, ``theory``, ``mse``, ``groupsize``, ``sweep``, ``multiturn``.
Each parses its own options (:func:`grpolab.commands.parsing.parse_config`) and calls the library."""

from __future__ import annotations

from grpolab.commands.parsing import parse_config, run_defaults
from grpolab.training import launch


def cmd_rank(args: list[str]) -> None:
    from grpolab.analysis.rank import RankConfig, table1, table_by_step
    from grpolab.commands import api

    cfg = parse_config(
        RankConfig,
        args,
        "grpolab rank",
        "Effective rank and top-1 energy of GRPO's per-rollout gradient matrix [Foundations, Sec. 7].",
        run_defaults(RankConfig, "checkpoint"),
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
        cfg = parse_config(
            HoeffdingConfig,
            args[1:],
            "grpolab theory hoeffding",
            "[Foundations, App. A.2]: the Hoeffding bound on the group-mean baseline's error, next to Monte Carlo.",
        )
        rows = hoeffding_rows(cfg)
        print(json.dumps(rows, indent=2) if cfg.json else format_hoeffding(rows, cfg))
        return
    cfg = parse_config(
        AdvantagesConfig,
        args[1:],
        "grpolab theory advantages",
        "[Foundations, Thm 4.1]: zero-sum advantage statistics for Bernoulli(p) rewards, Monte Carlo vs theory.",
    )
    res = advantages_check(cfg)
    print(json.dumps(res, indent=2) if cfg.json else format_advantages(res, cfg))


def cmd_mse(args: list[str]) -> None:
    from grpolab.analysis.mse_cmd import MseConfig, format_bandit, format_mse, run_bandit, run_sampling_bias
    from grpolab.analysis.sampling_bias import format_sampling_bias
    from grpolab.commands import api

    cfg = parse_config(
        MseConfig, args, "grpolab mse", MseConfig.__doc__.strip().split("\n\n")[0], run_defaults(MseConfig, "policy")
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
    cfg = parse_config(GroupsizeConfig, args, "grpolab groupsize", doc, run_defaults(GroupsizeConfig, "policy"))
    cfg.validate()
    with launch.processes(cfg.nproc, ["groupsize", *args]) as main_rank:
        report = api.groupsize(config=cfg)
    if main_rank:
        print(format_groupsize(report))
        print(f"wrote {cfg.out}/groupsize.json and groupsize.png")


def cmd_sweep(args: list[str]) -> None:
    from grpolab.analysis.sweep import SweepConfig, format_sweep, run_sweep

    cfg = parse_config(SweepConfig, args, "grpolab sweep", SweepConfig.__doc__.strip().split("\n\n")[0])
    cfg.validate()
    print(format_sweep(run_sweep(cfg)))
    print(f"wrote {cfg.out}/sweep.json and sweep.png")


def cmd_multiturn(args: list[str]) -> None:
    from grpolab.analysis.multiturn import MultiturnConfig, format_multiturn
    from grpolab.commands import api

    cfg = parse_config(
        MultiturnConfig,
        args,
        "grpolab multiturn",
        MultiturnConfig.__doc__.strip(),
        run_defaults(MultiturnConfig, "policy"),
    )
    cfg.validate()
    print(format_multiturn(api.multiturn_bias(config=cfg)))
    print(f"wrote {cfg.out}/multiturn.json and multiturn.png" + (f" and {cfg.json}" if cfg.json else ""))
