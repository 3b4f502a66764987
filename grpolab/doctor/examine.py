"""A run examined: its directory read, its checks replayed at every check step, examples from its own samples, the
findings as text or data, and the watcher a training run calls after each step.

Replaying the checks at the steps a training run checks (every ``--doctor-every`` steps and at the last) gives the
offline doctor the same findings the run printed, each with the step it was first found at and whether it still
held at the end; the rollouts (``rollouts.jsonl``, with ``--log-rollouts``) add the checks that need them (truncated
completions scoring lower, identical completions in a group), which training itself does not keep.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from grpolab.common.jsonlines import read_jsonl, step_record
from grpolab.common.stats import with_interval
from grpolab.config.run import DoctorSection, run_config_file
from grpolab.config.train import TrainConfig
from grpolab.data.answers import extract_final_number, last_boxed
from grpolab.doctor.conditions import LEVEL, NAMES, ONLY_WITH, Finding, RunFacts, diagnose, explained, order
from grpolab.doctor.hacking import KEYS, evidence
from grpolab.doctor.rows import ACCURACIES, WINDOW, mean, training_rows

DEFAULT_EVERY = DoctorSection.doctor_every
"""Steps between two checks: ``--doctor-every``'s default (see rows.WINDOW)."""


@dataclasses.dataclass
class RunData:
    """What a run directory holds that the doctor reads."""

    path: Path
    config: dict
    rows: list[dict]
    samples: list[dict]
    rollouts: list[dict]
    hacking: list[dict] = dataclasses.field(default_factory=list)
    """The hacking signs' evidence (hacking.jsonl): the rollouts that carry each sign, by step."""

    @property
    def options(self) -> TrainConfig:
        """The run's options, as its config.json records them (:meth:`TrainConfig.of_run`: an option the file does
        not hold has the value its run had)."""
        return TrainConfig.of_run(self.config)

    @classmethod
    def read(cls, run_dir: str | Path) -> RunData:
        path = Path(run_dir)
        if not (path / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{path}: not a run directory (no metrics.jsonl)")
        config_file = run_config_file(path)
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return cls(path, config, _rows(path / "metrics.jsonl"), _rows(path / "samples.jsonl"),
                   _rows(path / "rollouts.jsonl"), _rows(path / "hacking.jsonl"))  # fmt: skip


def _rows(path: Path) -> list[dict]:
    """The records of one of a run's JSON-lines files (none if it is missing); a line cut by a killed run is
    skipped."""
    return read_jsonl(path, step_record)[0] if path.is_file() else []


def check_steps(rows: Sequence[dict], every: int) -> list[int]:
    """The steps the doctor replays: every ``every``-th training step (those a run checks itself) and the last."""
    steps = [r["step"] for r in training_rows(rows)]
    if not steps:
        return []
    out = [s for s in steps if every and s % every == 0]
    return out + ([steps[-1]] if not out or out[-1] != steps[-1] else [])


def replay(rows: Sequence[dict], facts: RunFacts, rollouts: Sequence[dict] = (), every: int = DEFAULT_EVERY):
    """Every condition found at any check step: of each, the finding at its gravest (the latest of those), with the
    step it was first found at and whether the last check still found it; most serious first."""
    first: dict[str, int] = {}
    seen: dict[str, int] = {}
    latest: dict[str, Finding] = {}
    last_names: set[str] = set()
    for step in check_steps(rows, every):
        found = diagnose([r for r in rows if r["step"] <= step], facts, [r for r in rollouts if r["step"] <= step])
        for f in found:
            first.setdefault(f.name, step)
            seen[f.name] = step
            if f.name not in latest or LEVEL[f.severity] >= LEVEL[latest[f.name].severity]:
                latest[f.name] = f
        last_names = {f.name for f in found}
    return order([
        dataclasses.replace(f, first_step=first[n], last_step=seen[n], ongoing=n in last_names)
        for n, f in latest.items()
    ])  # fmt: skip


def check_every(run: RunData, every: int | None = None) -> int:
    """The steps between two checks: ``every`` if given, else the run's own --doctor-every."""
    return every or run.options.diagnosis.doctor_every or DEFAULT_EVERY  # (a null in an old config.json: the default)


def examine(run_dir: str | Path, every: int | None = None) -> tuple[RunData, list[Finding]]:
    """A run directory's findings, checked every :func:`check_every` steps, with examples from its samples and
    rollouts."""
    run = RunData.read(run_dir)
    facts = RunFacts.of(run.config)
    found = replay(run.rows, facts, run.rollouts, check_every(run, every))
    return run, [dataclasses.replace(f, example=example_for(f, run, facts)) for f in found]


# ---------------------------------------------------------------- examples


def example_for(finding: Finding, run: RunData, facts: RunFacts) -> dict | None:
    """A sample (or rollout) of the run that shows ``finding``: a truncated completion, a completion the answer check
    rejected with what it parsed, the highest-paid completion of a reward that drifts from the task."""
    if finding.name == "reward_hacking":
        shown = _hacking_example(finding, run)
        if shown is not None:
            return shown
    pool = [s for s in run.samples if s.get("kind") == "train"] + run.rollouts
    if not pool:
        return None
    if finding.name == "truncation":
        cut = [s for s in pool if s.get("truncated") or s.get("tokens", 0) >= facts.max_new_tokens]
        if not cut:
            return None
        s = min(reversed(cut), key=lambda s: s.get("reward", 0.0))  # the latest of the lowest scored
        return _shown(s, f"stopped at --max-new-tokens {facts.max_new_tokens}")
    if finding.name in ("reward_blind", "no_signal"):
        s = min(reversed(pool), key=lambda s: s.get("reward", 0.0))
        return _shown(s, parsed(s["completion"], facts.answer_check))
    if finding.name == "reward_hacking":
        s = max(reversed(pool), key=lambda s: s.get("reward", 0.0))
        return _shown(s, "the highest reward among the logged completions")
    return None


def _hacking_example(finding: Finding, run: RunData) -> dict | None:
    """The rollout that carries the first early sign of ``finding`` (hacking.jsonl): the gradient cluster's
    strongest member or the honeypots' best-paid completion, up to the step the finding was first made."""
    for key in finding.keys:
        sign = next((s for s, k in KEYS.items() if k == key), None)
        found = evidence(run.hacking, sign, finding.first_step or finding.steps[1]) if sign else None
        if found:
            note = {"align": f"the strongest of the aligned rollouts (loading {found.get('loading', 0):.2f}; "
                             f"{found['others']} more in hacking.jsonl)",
                    "honeypot": f"paid on a honeypot, a prompt with no correct answer ({found['others']} more in "
                                "hacking.jsonl)"}.get(sign, "")  # fmt: skip
            return _shown(found, note)
    return None


def parsed(completion: str, check: str) -> str:
    """What the built-in answer check reads in ``completion`` ('' for a reward function's own parsing)."""
    if check == "boxed":
        box = last_boxed(completion)
        return f"the answer check (\\boxed{{}}) found {box!r}" if box else "the answer check found no \\boxed{} answer"
    if check == "####":
        marked = "####" in completion
        number = extract_final_number(completion)
        where = "after '####'" if marked else "no '####' line; the last number"
        return f"the answer check read {number!r} ({where})"
    return "scored by the run's reward function"


def _shown(sample: dict, note: str) -> dict:
    keys = ("step", "question", "completion", "reward", "tokens")
    return {**{k: sample[k] for k in keys if k in sample}, "note": note}


# ---------------------------------------------------------------- views


def summary_figures(run: RunData) -> list[str]:
    """The few figures that say how a run went: training reward, held-out accuracy, the groups' signal, truncation."""
    t = training_rows(run.rows)
    if not t:
        return ["no training step logged yet"]
    out = [f"{len(t)} training steps (last: step {t[-1]['step']})"]
    head, tail = t[:WINDOW], t[-WINDOW:]
    for key, name in (("reward/mean", "training reward"), ("reward/frac_zero_std", "groups with equal rewards"),
                      ("completion/truncated_frac", "truncated completions"), ("policy/entropy", "token entropy")):  # fmt: skip
        a, b = mean(head, key), mean(tail, key)
        if a is not None and b is not None:
            out.append(f"{name} ({key}): {a:.3f} over the first {WINDOW} steps, {b:.3f} over the last {WINDOW}")
    for key in ACCURACIES:  # sampled, then greedy: each the checks read
        evals = [r for r in run.rows if r.get(key) is not None]
        if evals:
            e0, e1 = evals[0], evals[-1]
            name = key.removeprefix("eval/accuracy_")
            out.append(
                f"held-out {name} accuracy: {with_interval(e0, key)} at step {e0['step']}"
                + (f", {with_interval(e1, key)} at step {e1['step']}" if e1 is not e0 else "")
            )
    return out


def format_findings(run: RunData, findings: list[Finding], every: int) -> str:
    """The findings as text, most serious first; a healthy run's 'no problems found' and its figures."""
    lines = [f"grpolab doctor: {run.path} (checked every {every} steps)"]
    serious = [f for f in findings if f.severity != "info"]
    if not serious:
        lines.append("no problems found" + (" (notes below)" if findings else ""))
        lines += [f"  {s}" for s in summary_figures(run)]
    for f in findings:
        lines.append(f"\n{f.severity.upper():<7} {f.title}  [{'; '.join(filter(None, (f.name, f.when())))}]")
        effects = explained(f, findings)
        if effects:
            lines.append(f"  the likely cause of: {', '.join(effects)}")
        lines.append(f"  evidence: {f.evidence}")
        lines.append(f"  change:   {f.fix}")
        if f.example:
            ex = f.example
            text = ex.get("completion", "")
            text = text if len(text) <= 240 else text[:120] + " ... " + text[-100:]
            lines.append(
                f"  example:  step {ex.get('step', '?')}, {ex.get('question', '')!r} -> {text!r}"
                + (f" (reward {ex['reward']:g})" if isinstance(ex.get("reward"), int | float) else "")
            )
            lines.append(f"            {ex['note']}")
    return "\n".join(lines)


def as_json(run: RunData, findings: list[Finding], every: int) -> dict:
    """The same findings as data."""
    return {
        "run": str(run.path),
        "every": every,
        "healthy": not any(f.severity != "info" for f in findings),
        "summary": summary_figures(run),
        "findings": [{**f.as_dict(), "explains": explained(f, findings)} for f in findings],
    }


# ---------------------------------------------------------------- while training


class Watcher:
    """The checks of a training run: every ``every`` steps on the rows so far; a condition found for the first time
    is one line through ``log``; every check logs ``doctor/<name>`` (the severity's level, 0 when not found).
    Warnings never stop a run: a check that raises is reported once and the watcher stops checking."""

    def __init__(self, config: dict, every: int, rows: Sequence[dict] = (), log: Callable[[str], None] = print,
                 out: str = ""):  # fmt: skip
        self.facts, self.every, self.log, self.out = RunFacts.of(config), every, log, out
        self.rows = [_without_doctor(r) for r in rows]
        self.seen = {n for r in rows for n in NAMES if r.get(f"doctor/{n}")}  # found before a resume: said already
        self.broken = False

    def add(self, step: int, metrics: dict) -> None:
        """A row the run logged without a check (its step-0 evaluation)."""
        self.rows.append({"step": step, **_without_doctor(metrics)})

    def check(self, step: int, metrics: dict) -> dict:
        """Add the step's row; at a check step (a multiple of ``every``: the same steps whether or not the run was
        resumed in between), return ``doctor/*`` and say what is new."""
        self.add(step, metrics)
        if self.broken or step % self.every:
            return {}
        try:
            found = diagnose(self.rows, self.facts)
        except Exception as e:  # a doctor's fault must never stop training
            self.broken = True
            self.log(f"doctor: the checks failed ({type(e).__name__}: {e}); training goes on without them")
            return {}
        for f in found:
            if f.name not in self.seen:
                self.seen.add(f.name)
                self.log(f"doctor [{f.severity}] step {step}: {f.title}; change: {first_change(f.fix)}")
                if f.name == "reward_hacking":  # the sign and its figures now; `grpolab doctor RUN` shows the rollouts
                    self.log(f"  evidence: {f.evidence} (the rollouts: grpolab doctor {self.out or 'RUN'})")
        levels = {f.name: LEVEL[f.severity] for f in found}
        logged = [n for n in NAMES if n not in ONLY_WITH or ONLY_WITH[n] in metrics]
        return {f"doctor/{n}": levels.get(n, 0) for n in logged}


def first_change(fix: str) -> str:
    """The first change of a finding's ``fix``, without its reasons (the in-training line; ``grpolab doctor`` gives the
    whole of it with the evidence)."""
    return fix.split("; or ")[0].split(" (")[0]


def _without_doctor(row: dict) -> dict:
    """A row without the checks' own levels (the doctor's instruments, doctor/weight_change, stay)."""
    return {k: v for k, v in row.items() if k.removeprefix("doctor/") not in NAMES}
