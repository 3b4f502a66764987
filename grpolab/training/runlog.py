"""The run directory's logs: ``metrics.jsonl`` (one object per step), ``samples.jsonl``,
``rollouts.jsonl`` (with --log-rollouts), ``token_credit.jsonl`` (with --log-token-credit), ``probe.jsonl`` (with --probe-every), ``hacking.jsonl`` (the hacking signs' evidence) and optional TensorBoard / Weights & Biases sinks."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

IMAGES = "images"
"""The run's folder of the pictures its logs show (:meth:`RunLogger._stored`)."""


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; a null says "not a number" honestly
    return v


def truncate_jsonl(path: Path, max_step: int) -> int:
    """Drop rows with ``step > max_step`` (rows a resumed run will write again). Returns rows kept."""
    if not path.exists():
        return 0
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= max_step]
    path.write_text("".join(line + "\n" for line in kept))
    return len(kept)


class RunLogger:
    def __init__(self, run_dir: Path, *, config: dict, tensorboard: bool = False, wandb: bool = False, warn=print):
        self.run_dir = Path(run_dir)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")
        self._samples = open(self.run_dir / "samples.jsonl", "a")
        self._lazy: dict[str, object] = {}  # rollouts.jsonl, token_credit.jsonl, probe.jsonl: opened on first use
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError:
                warn(
                    "--tensorboard: the tensorboard package is not installed (pip install tensorboard); not logging to TensorBoard"
                )
        if wandb:
            try:
                import wandb as wb

                self._wandb = wb.init(mode="offline", dir=str(self.run_dir), config=config, project="grpolab")
            except ImportError:
                warn("--wandb: the wandb package is not installed (pip install wandb); not logging to Weights & Biases")

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        for s in samples:
            self._samples.write(json.dumps({"step": step, **s}, default=self._stored) + "\n")
        self._samples.flush()

    def _stored(self, value):
        """What JSON cannot hold, as the logs keep it: a picture (a row's image, or one an environment showed) saved
        once as ``images/<digest>.png`` under the run, its path relative to the run in its place (the report shows it
        as a thumbnail); raw bytes as their length; anything else as its text."""
        from PIL import Image

        if isinstance(value, Image.Image):
            digest = hashlib.sha256(value.tobytes() + repr((value.mode, value.size)).encode()).hexdigest()[:20]
            path = self.run_dir / IMAGES / f"{digest}.png"
            if not path.exists():
                path.parent.mkdir(exist_ok=True)
                value.save(path)
            return f"{IMAGES}/{path.name}"
        if isinstance(value, bytes):
            return f"<{len(value)} bytes>"
        return str(value)

    def _append(self, name: str, step: int, records: list[dict], **dumps) -> None:
        """One line per record, ``step`` first, to ``name`` (opened on its first records)."""
        if name not in self._lazy:
            self._lazy[name] = open(self.run_dir / name, "a")
        f = self._lazy[name]
        for r in records:
            f.write(json.dumps({"step": step, **r}, default=self._stored, **dumps) + "\n")
        f.flush()

    def log_rollouts(self, step: int, rollouts: list[dict]) -> None:
        self._append("rollouts.jsonl", step, rollouts)

    def log_token_credit(self, step: int, records: list[dict]) -> None:
        """One line per recorded rollout, its tokens' values as parallel lists (``grpolab.report.token_view`` reads them)."""
        self._append("token_credit.jsonl", step, records, allow_nan=False)

    def log_probe(self, step: int, records: list[dict]) -> None:
        """One line per group the spectrum probe measured (its rewards' spread and its spectrum)."""
        self._append("probe.jsonl", step, records)

    def log_hacking(self, step: int, records: list[dict]) -> None:
        """One line per hacking sign measured with evidence at the step: the rollouts that carry it (the gradient
        alignment's cluster, the honeypots' paid completions; ``grpolab.doctor.hacking`` shows them)."""
        self._append("hacking.jsonl", step, records)

    def log_generators(self, step: int, events: list[dict]) -> None:
        """One line per generator-worker event of the step (``grpolab.rollout.remote.pool.WorkerPool.pop_events``;
        the report's generator timeline reads them)."""
        self._append("generators.jsonl", step, events)

    def close(self) -> None:
        self._metrics.close()
        self._samples.close()
        for f in self._lazy.values():
            f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def git_revision() -> str | None:
    """The code version: the git commit of the package's checkout, if it is one."""
    import subprocess

    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
