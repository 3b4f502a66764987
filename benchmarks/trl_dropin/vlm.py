"""The TRL vision-language script run by TRL and by grpolab.trl: step time and peak memory, in one invocation.

    python benchmarks/trl_dropin/vlm.py [--steps 12] [--batch-size 64] [--out runs/trl-dropin-vlm]

``examples/trl/vlm.py`` (TRL's vision form: a conversational prompt with an ``image`` column, the model's processor as
its processing class; grpolab's built-in tiny LLaVA counting shapes) runs once as it is (``grpolab.trl``) and once
with its import line changed to TRL's, each in a process of its own with the same arguments, one after the other.
The wrapper of ``compare.py`` times each optimizer step with a callback and reads the process's peak resident memory.
The first step of each (start-up, warm-up) is left out of the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare import IMPORT_GRPOLAB, IMPORT_TRL, WRAPPER, step_times  # noqa: E402

SCRIPT = HERE.parents[1] / "examples" / "trl" / "vlm.py"


def run(kind: str, script: Path, out: Path, steps: int, batch: int) -> dict:
    record = out / f"{kind}.json"
    module = "trl" if kind == "trl" else "grpolab.trl"
    argv = ["--max-steps", str(steps), "--output-dir", str(out / kind), "--use-cpu", "--batch-size", str(batch)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    with open(out / f"{kind}.log", "w") as log:
        subprocess.run([sys.executable, "-c", WRAPPER, str(script), module, str(record), *argv], check=True, env=env,
                       stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    return json.loads(record.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=64, help="completions per step: 8 pictures x 8")
    p.add_argument("--out", default="runs/trl-dropin-vlm")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    original = SCRIPT.read_text()
    trl_copy = original.replace(IMPORT_GRPOLAB, IMPORT_TRL)
    diff = [(a, b) for a, b in zip(original.splitlines(), trl_copy.splitlines()) if a != b]
    assert len(diff) == 1, "the two scripts must differ in the import line only"
    print("one line differs:", diff[0][0].strip(), "->", diff[0][1].strip())
    (out / "vlm_trl.py").write_text(trl_copy)
    records = {
        "grpolab": run("grpolab", SCRIPT, out, args.steps, args.batch_size),
        "trl": run("trl", out / "vlm_trl.py", out, args.steps, args.batch_size),
    }
    for kind, rec in records.items():
        rec["median_step_s"] = statistics.median(step_times(rec)[1:])
        last = rec["rewards"][-1][1] if rec["rewards"] else float("nan")
        print(f"{kind:8s} median step {rec['median_step_s']:.2f} s  wall {rec['wall_s']:.0f} s  peak RSS "
              f"{rec['peak_rss_mb']:.0f} MB  last logged reward {last:.3f}")  # fmt: skip
    t, g = records["trl"], records["grpolab"]
    print(f"step time TRL / grpolab {t['median_step_s'] / g['median_step_s']:.2f}x; peak memory grpolab / TRL "
          f"{g['peak_rss_mb'] / t['peak_rss_mb']:.2f}")  # fmt: skip
    (out / "summary.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
