"""The reward-hacking benchmark's runs and results table: each planted loophole (loopholes.py) x seed, its clean twin
(the same task, model, seed and options on grpolab's default, strict reward) x seed, and a benign run x seed (one
whose format compliance grows for good reasons under the strict reward).

    python benchmarks/reward_hacking/run.py --seeds 0 1 2 --out runs/reward_hacking

Runs go two at a time (--jobs), each `grpolab train --threads 1 --log-rollouts`, evaluating every --eval-every steps
on --eval-questions held-out questions so that t_damage has resolution. A run whose metrics.jsonl already holds its
last step is skipped; an unfinished one starts again. Writes each run to OUT/NAME/ (its log OUT/NAME.log), and the
table (measure.py's definitions) to OUT/results.md and OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script from the checkout: its siblings import by name

import loopholes  # noqa: E402
import measure  # noqa: E402

REPO = HERE.parent.parent
GRPOLAB = [sys.executable, "-m", "grpolab", "train", "--nproc", "1"]  # one process: the runs measured in the docs
# Each loophole's options, the same for its runs and its clean twin's (the exploration in README.md chose them). A
# --steps here overrides the runner's --steps for that loophole's runs and its twin's.
SETTINGS = {
    "flood": ("--lr", "1e-4", "--steps", "150"),
    "substring": ("--lr", "5e-5"),
    "length": ("--lr", "1e-4", "--max-new-tokens", "96"),
}
# The benign run: the strict reward with a larger format weight, whose format compliance and accuracy rise together.
BENIGN = ("--lr", "5e-5", "--format-weight", "1.0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="runs/reward_hacking", help="output folder (default: runs/reward_hacking)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every run (default: 0 1 2)")
    p.add_argument("--loopholes", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), help="which loopholes")
    p.add_argument("--no-clean", action="store_true", help="skip the clean twins")
    p.add_argument("--no-benign", action="store_true", help="skip the benign runs")
    p.add_argument("--steps", type=int, default=120, help="GRPO steps of every run (default: 120)")
    p.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (default: 10)")
    p.add_argument("--eval-questions", type=int, default=200, help="held-out questions per evaluation (default: 200)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once, each on one thread (default: 2)")
    p.add_argument(
        "--extra", default="", help="more `grpolab train` options for every run, one string (e.g. '--group-size 16')"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--table-only", action="store_true", help="write the table from the runs already in --out")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> list[dict]:
    """Every run: its name, its kind (loophole, clean, benign), the loophole it belongs to and its train options."""
    extra = args.extra.split()
    path = (HERE / "loopholes.py").relative_to(REPO).as_posix()
    runs = []
    for seed in args.seeds:
        for name in args.loopholes:
            reward = ["--reward-fn", f"{path}:{loopholes.LOOPHOLES[name][0]}"]
            runs.append({"name": f"{name}-s{seed}", "kind": "loophole", "loophole": name, "seed": seed,
                         "options": [*SETTINGS[name], *reward, *extra]})  # fmt: skip
            if not args.no_clean:
                runs.append({"name": f"{name}-clean-s{seed}", "kind": "clean", "loophole": name, "seed": seed,
                             "options": [*SETTINGS[name], *extra]})  # fmt: skip
        if not args.no_benign:
            runs.append({"name": f"benign-s{seed}", "kind": "benign", "loophole": None, "seed": seed,
                         "options": [*BENIGN, *extra]})  # fmt: skip
    return runs


def steps_of(run: dict, args: argparse.Namespace) -> int:
    """``run``'s step count: its options' --steps, else the runner's."""
    options = run["options"]
    return int(options[options.index("--steps") + 1]) if "--steps" in options else args.steps


def command(run: dict, args: argparse.Namespace) -> list[str]:
    """The `grpolab train` command line of ``run``."""
    options = list(run["options"])
    if "--steps" in options:  # steps_of reads it; written once below
        del options[options.index("--steps") : options.index("--steps") + 2]
    common = ["--threads", "1", "--no-progress", "--log-rollouts", "--steps", str(steps_of(run, args))]
    common += ["--eval-every", str(args.eval_every), "--eval-questions", str(args.eval_questions)]
    return [*GRPOLAB, *common, "--seed", str(run["seed"]), *options, "--out", str(Path(args.out) / run["name"])]


def complete(run_dir: Path, steps: int) -> bool:
    """Whether ``run_dir``'s metrics.jsonl holds step ``steps``."""
    return measure.last_step(measure.read_jsonl(run_dir / "metrics.jsonl")) >= steps


def launch(runs: list[dict], args: argparse.Namespace) -> dict[str, float]:
    """Run every incomplete run, ``args.jobs`` at a time; returns each launched run's wall time in seconds."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [r for r in runs if not complete(out / r["name"], steps_of(r, args))]
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    walls: dict[str, float] = {}
    while todo or running:
        while todo and len(running) < args.jobs:
            run = todo.pop(0)
            shutil.rmtree(out / run["name"], ignore_errors=True)  # an unfinished run starts again
            log = open(out / f"{run['name']}.log", "w")
            running[run["name"]] = (subprocess.Popen(command(run, args), cwd=REPO, stdout=log, stderr=log), time.time())
            print(f"started {run['name']}: {' '.join(command(run, args))}", flush=True)
        time.sleep(2)
        for name, (proc, start) in list(running.items()):
            if proc.poll() is not None:
                walls[name] = time.time() - start
                print(f"finished {name} (exit {proc.returncode}, {walls[name]:.0f} s)", flush=True)
                del running[name]
    return walls


def rows(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """The results table's rows: each run under its loophole's labeller (a benign run: under every labeller, the one
    with the largest share shown)."""
    table = []
    for run in runs:
        metrics, rollouts = measure.read_run(Path(args.out) / run["name"])
        if not metrics:
            continue
        names = [run["loophole"]] if run["loophole"] else list(loopholes.LOOPHOLES)
        found = {name: measure.summary(metrics, rollouts, loopholes.LOOPHOLES[name][1]) for name in names}
        label = max(found, key=lambda name: found[name]["max_share"])
        table.append({"run": run["name"], "kind": run["kind"], "seed": run["seed"], "labeller": label, **found[label]})
    return table


COLUMNS = ("run", "kind", "labeller", "steps", "first_share", "max_share", "reached_20", "t_onset", "t_onset_excess", "t_damage",
           "t_damage_greedy", "first_sampled", "final_sampled", "final_greedy", "final_chars", "wall_s")  # fmt: skip


def markdown(table: list[dict]) -> str:
    """The results table in markdown, numbers to 3 places."""

    def cell(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row[c]) for c in COLUMNS) + " |" for row in table]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = plan(args)
    if args.dry_run:
        print("\n".join(" ".join(command(r, args)) for r in runs))
        return
    walls = {} if args.table_only else launch(runs, args)
    table = rows(runs, args)
    for row in table:
        row["wall_s"] = walls.get(row["run"])
    text = markdown(table)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
