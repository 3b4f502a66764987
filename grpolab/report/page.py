"""One self-contained HTML page for a run: what was trained, how it did, what the probes saw.

The page is a single file with no external references (images are embedded as base64
PNG, the style sheet is inline, there is no script), so it opens offline and can be sent
to a colleague as it is. Sections, in order:

0. the doctor's findings (:mod:`grpolab.doctor`), most serious first, each linked to the plot that shows it;
1. the run (:mod:`grpolab.report.header`: the model and a VLM's family, the data or built-in task it trained on, its
   rewards, steps, estimator) and the before/after evaluation table, overall and per category, with the 95%
   intervals the evaluation logged;
2. the metric plots (the run's plot.png, redrawn if missing, and a second figure of the
   optimisation metrics);
2b. for a run drawn on generator workers, their timeline (``grpolab.report.generators``);
3. sample completions on held-out questions at the first and last evaluation;
4. for a run trained with ``--log-token-credit K``, where the credit lands: recorded rollouts
   token by token, coloured by what the update did to each (``grpolab.report.token_view``);
5. every probe output found under the run directory or given with ``--probe``
   (rank, mse, groupsize, multiturn, sweep: a summary table and their plots);
6. the full configuration.

Written by hand because no library renders these run files; ``html.escape`` guards
every value taken from the run.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable
from pathlib import Path

from grpolab.config.run import run_config_file
from grpolab.report.findings import CSS as FINDINGS_CSS
from grpolab.report.findings import doctor_section, pass_k_html
from grpolab.report.generators import generators_section
from grpolab.report.header import facts_html
from grpolab.report.markup import escape as _e
from grpolab.report.markup import png_img as _img_bytes
from grpolab.report.markup import table as _table
from grpolab.report.markup import thumbnails
from grpolab.report.token_view.page import TOKEN_CSS, credit_section
from grpolab.training.runlog import read_metrics

PROBE_FILES = ("rank.json", "mse.json", "groupsize.json", "multiturn.json", "sweep.json")

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1100px;
       padding: 1.5em 2em 4em; color: #1b1f24; background: #fff; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
h3 { margin-top: 1.4em; } .sub { color: #57606a; margin-top: 0; }
table { border-collapse: collapse; margin: .6em 0 1em; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #d0d7de; padding: .3em .7em; text-align: right; vertical-align: top; }
th { background: #f6f8fa; } td.l, th.l { text-align: left; }
.up { color: #1a7f37; } .down { color: #cf222e; } .ci { color: #57606a; font-size: .88em; }
img { max-width: 100%; border: 1px solid #eee; margin: .4em 0; }
pre { background: #f6f8fa; padding: .5em .7em; white-space: pre-wrap; word-break: break-word; margin: 0; font-size: .9em; }
.ok { color: #1a7f37; font-weight: 600; } .no { color: #cf222e; font-weight: 600; }
details summary { cursor: pointer; color: #0969da; } .grid { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }
.nav a { margin-right: 1em; } .imgs { display: flex; flex-wrap: wrap; gap: .5em; align-items: flex-start; }
.imgs img { max-width: calc(50% - .5em); } .imgs img:only-child { max-width: 100%; }
.episode .msg { margin: 0 0 .3em; } .episode .role { font-size: .78em; color: #57606a; font-weight: 600; }
.episode .msg-assistant pre { background: #ddf4ff; } .episode .msg-tool pre { background: #fff8c5; }
.thumbs img.thumb { border: 1px solid #d0d7de; margin: 0 .3em .3em 0; image-rendering: pixelated; min-width: 48px; }
"""


def _num(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}g}" if abs(x) >= 1000 or (x != 0 and abs(x) < 1e-3) else f"{x:.{digits}f}"


def _png(path: Path) -> str:
    return _img_bytes(path.read_bytes(), path.name)


# ---------------------------------------------------------------- evaluation


def _interval(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None:
        return "–"
    lo, hi = row.get(key + "_lo"), row.get(key + "_hi")
    ci = f' <span class="ci">[{lo:.3f}, {hi:.3f}]</span>' if lo is not None and hi is not None else ""
    return f"{v:.3f}{ci}"


def _change(before: dict, after: dict, key: str) -> str:
    if before.get(key) is None or after.get(key) is None:
        return "–"
    d = after[key] - before[key]
    lo_b, hi_b, lo_a, hi_a = (r.get(key + s) for r in (before, after) for s in ("_lo", "_hi"))
    # coloured only when the two 95% intervals do not overlap: a clear change, not noise
    clear = None not in (lo_b, hi_b, lo_a, hi_a) and (lo_a > hi_b or hi_a < lo_b)
    return f'<span class="{("up" if d > 0 else "down") if clear else ""}">{d:+.3f}</span>'


def evaluation_table(rows: list[dict]) -> str:
    """Before (first evaluation) and after (last), overall and per category."""
    evals = [r for r in rows if r.get("eval/accuracy_greedy") is not None]
    if not evals:
        return "<p>No evaluation was logged in this run.</p>"
    before, after = evals[0], evals[-1]
    cats = sorted(
        {k[len("eval/greedy_") :] for k in after if k.startswith("eval/greedy_") and not k.endswith(("_lo", "_hi"))}
    )
    lines = [("overall", "eval/accuracy_greedy", "eval/accuracy_sampled")]
    if len(cats) > 1:  # a single category holds every question: its row would repeat the overall one
        lines += [(c, f"eval/greedy_{c}", f"eval/sampled_{c}") for c in cats]
    body = [
        [
            _e(name),
            _interval(before, g),
            _interval(after, g),
            _change(before, after, g),
            _interval(before, s),
            _interval(after, s),
            _change(before, after, s),
        ]
        for name, g, s in lines
    ]
    header = [
        "questions",
        f"greedy, step {before['step']}",
        f"greedy, step {after['step']}",
        "change",
        f"sampled, step {before['step']}",
        f"sampled, step {after['step']}",
        "change",
    ]
    note = (
        '<p class="sub">Greedy: one greedy completion per held-out question (Wilson 95% interval). '
        "Sampled: k completions per question at the run's temperature, the pass rate GRPO's groups see "
        "(95% interval clustered over questions). A change is coloured when the two intervals do not overlap.</p>"
    )
    return _table(header, body) + note


def _all_evaluations(rows: list[dict]) -> str:
    evals = [r for r in rows if r.get("eval/accuracy_greedy") is not None]
    if len(evals) <= 2:
        return ""
    body = [
        [str(r["step"]), _interval(r, "eval/accuracy_greedy"), _interval(r, "eval/accuracy_sampled")] for r in evals
    ]
    return "<details><summary>every evaluation</summary>" + _table(["step", "greedy", "sampled"], body) + "</details>"


# ---------------------------------------------------------------- plots


def _detail_figure(rows: list[dict]) -> bytes | None:
    """Optimisation metrics against step, as PNG bytes: whatever of them the run logged."""
    from grpolab.report.plotting import figure_png, plt

    keys = [
        ("grad/norm", "gradient norm"),
        ("loss/policy", "policy loss"),
        ("loss/kl", "KL to the reference"),
        ("loss/clip_frac", "clipped fraction"),
        ("completion/len_mean", "completion length (tokens)"),
        ("policy/entropy", "token entropy"),
        ("time/step_s", "seconds per step"),
    ]
    keys = [(k, t) for k, t in keys if any(r.get(k) is not None for r in rows)]
    if not keys:
        return None
    cols = 3
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(15, 3.2 * nrows), squeeze=False)
    for ax, (k, title) in zip(axes.flat, keys):
        pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", lw=1)
        ax.set_title(f"{title} ({k})", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    return figure_png(fig, dpi=90)


def signal_panel(rows: list[dict]) -> str:
    """The run's signals over training (effective rank at G and G/2, sigma_r, frac_zero_std), its saturation step
    marked, and a one-line reading of each; empty for a run without ``--probe-every``."""
    from grpolab.probes import signals
    from grpolab.report.plotting import figure_png, plt

    if not signals.series(rows, "probe/eff_rank"):
        return ""
    sat = signals.saturation_step(signals.series(rows, "eval/accuracy_greedy"))
    fig, axes = plt.subplots(1, len(signals.SIGNALS), figsize=(15, 3.2), squeeze=False)
    for ax, (key, title) in zip(axes.flat, signals.SIGNALS.items()):
        lines = [(key, "at G")] + ([("probe/eff_rank_half", "at G/2")] if key == "probe/eff_rank" else [])
        for k, label in lines:
            pts = signals.series(rows, k)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1, label=label)
        if sat is not None:
            ax.axvline(sat, color="tab:red", ls=":", lw=1, label=f"saturation (step {sat})")
        ax.set_title(f"{title} ({key})", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    png = figure_png(fig, dpi=90)
    items = "".join(f"<li>{_e(line)}</li>" for line in signals.readings(rows))
    return f"{_img_bytes(png, 'signals over training')}<ul>{items}</ul>"


def _plots(run_dir: Path, rows: list[dict]) -> str:
    from grpolab.report.plotting import plot_run

    parts = []
    plot = run_dir / "plot.png"
    if plot.is_file():
        parts.append(_png(plot))
    elif rows:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:  # a read-only run directory stays untouched
            parts.append(_png(plot_run(run_dir, Path(tmp) / "plot.png")))
    detail = _detail_figure(rows)
    if detail:
        parts.append(_img_bytes(detail, "optimisation metrics"))
    return "".join(parts) or "<p>No metrics were logged.</p>"


# ---------------------------------------------------------------- samples


def _samples(run_dir: Path, limit: int = 4) -> str:
    path = run_dir / "samples.jsonl"
    if not path.is_file():
        return "<p>No samples.jsonl in this run.</p>"
    evals = []
    for line in path.read_text().splitlines():
        try:
            s = json.loads(line)
        except json.JSONDecodeError:
            continue
        if s.get("kind") == "eval":
            evals.append(s)
    if not evals:
        return "<p>No held-out samples were logged.</p>"
    first, last = min(s["step"] for s in evals), max(s["step"] for s in evals)

    def cell(s: dict | None) -> str:
        if s is None:
            return ""
        mark = '<span class="ok">correct</span>' if s.get("correct") else '<span class="no">wrong</span>'
        if "reward" in s:  # scored by a reward function (prompt data)
            mark += f" · reward {s['reward']:g}"
        extra = f" · sampled pass rate {s['sampled_correct']:.2f}" if s.get("sampled_correct") is not None else ""
        if "conversation" in s:  # an episode: turn by turn
            turns = s["conversation"][s.get("opening", 1) :]
            return episode_html(turns, s.get("turn_rewards"), run_dir) + mark + extra
        return f"<pre>{_e(s.get('completion', ''))}</pre>{mark}{extra}"

    def question(s: dict) -> str:
        pictures = thumbnails(s.get("images") or [], run_dir)
        if "conversation" in s:
            return pictures + episode_html(s["conversation"][: s.get("opening", 1)], run_dir=run_dir)
        return f"{pictures}<pre>{_e(s.get('question', ''))}</pre>"

    before = [s for s in evals if s["step"] == first][:limit]
    after = {s.get("question"): s for s in evals if s["step"] == last}
    body = [
        [
            question(s) + (f"answer: {_e(s['ground_truth'])}" if s.get("ground_truth") is not None else ""),
            cell(s),
            cell(after.get(s.get("question"))),
        ]
        for s in before
    ]
    return _table(["held-out question", f"greedy at step {first}", f"greedy at step {last}"], body, left=3)


def _content_html(content, run_dir: Path | None) -> str:
    """A message's content: its text, and the pictures among its parts as thumbnails."""
    if isinstance(content, str) or run_dir is None:
        return f"<pre>{_e(content if isinstance(content, str) else json.dumps(content))}</pre>"
    pictures = [p["image"] for p in content if p.get("type") == "image" and isinstance(p.get("image"), str)]
    text = "".join(str(p.get("text", "")) for p in content if p.get("type") == "text")
    return thumbnails(pictures, run_dir) + f"<pre>{_e(text)}</pre>"


def episode_html(messages: list[dict], turn_rewards: list[float] | None = None, run_dir: Path | None = None) -> str:
    """An episode's messages turn by turn: each with its role, the policy's replies numbered with their turn's
    reward from the environment; pictures in a message (``run_dir``: where their paths are) as thumbnails."""
    parts, turn = [], 0
    for m in messages:
        role = m.get("role", "?")
        label = role
        if role == "assistant":
            turn += 1
            label = f"turn {turn}"
            if turn_rewards is not None and turn <= len(turn_rewards):
                label += f" · reward {turn_rewards[turn - 1]:g}"
        name = f" ({_e(m['name'])})" if m.get("name") else ""
        parts.append(
            f'<div class="msg msg-{_e(role)}"><span class="role">{_e(label)}{name}</span>'
            f"{_content_html(m.get('content', ''), run_dir)}</div>"
        )
    return f'<div class="episode">{"".join(parts)}</div>'


# ---------------------------------------------------------------- probes


def find_probe_outputs(run_dir: Path, extra: Iterable[str | Path] = ()) -> list[Path]:
    """Probe result files under ``run_dir`` (checkpoints skipped) and in the ``extra`` directories."""
    found: list[Path] = []
    roots = [Path(run_dir), *(Path(p) for p in extra)]
    for root in roots:
        if root.is_file() and root.name in PROBE_FILES:
            found.append(root)
            continue
        for name in PROBE_FILES:
            found += [p for p in sorted(root.rglob(name)) if "checkpoints" not in p.relative_to(root).parts]
    unique: dict[Path, None] = {}
    for p in found:
        unique.setdefault(p.resolve(), None)
    return list(unique)


def _ci(lo, hi) -> str:
    return f' <span class="ci">[{_num(lo)}, {_num(hi)}]</span>' if lo is not None and hi is not None else ""


def _rank_summary(d: dict) -> str:
    body = []
    for r in d.get("results", []):
        er, t1 = r.get("effective_rank", {}), r.get("top1_fraction", {})
        body.append(
            [
                str(r.get("step", "")),
                str(r.get("R", "")),
                _num(er.get("mean")) + _ci(er.get("lo"), er.get("hi")),
                _num(t1.get("mean")) + _ci(t1.get("lo"), t1.get("hi")),
                str(r.get("max_possible_rank", "–")),
                _num(r.get("frac_zero_var")),
            ]
        )
    return _table(
        ["step", "R", "effective rank", "top-1 fraction", "largest possible rank", "zero-variance groups"], body, left=0
    )


def _mse_summary(d: dict) -> str:
    out = []
    for pol in d.get("policies", []):
        res = pol.get("results", [])
        gs = sorted({r["G"] for r in res})
        ests = list(dict.fromkeys(r["estimator"] for r in res))
        by = {(r["estimator"], r["G"]): r for r in res}
        body = [
            [_e(e)]
            + [
                _num(by[(e, g)]["mse"]) + _ci(by[(e, g)].get("ci_low"), by[(e, g)].get("ci_high"))
                if (e, g) in by
                else "–"
                for g in gs
            ]
            for e in ests
        ]
        out.append(
            f"<p>policy <code>{_e(pol.get('policy'))}</code>, mean reward {_num(pol.get('reward_mean'))}</p>"
            + _table(["estimator"] + [f"G = {g}" for g in gs], body)
        )
    return "".join(out)


def _groupsize_summary(d: dict) -> str:
    if "g_star" not in d:
        return ""
    ci = d.get("g_star_ci") or [None, None]
    rows = [
        ["G* (best group size at the budget)", _num(d["g_star"]) + _ci(ci[0], ci[-1])],
        ["best divisor of the budget", _e(d.get("best_divisor_g", "–"))],
    ]
    for name, c in d.get("constants", {}).items():
        cci = c.get("ci") or [None, None]
        rows.append([_e(name), _num(c.get("value")) + _ci(cci[0], cci[-1])])
    return _table(["quantity", "value"], rows)


def _multiturn_summary(d: dict) -> str:
    recs = d.get("records", [])
    if not recs:
        return ""
    ests = list(dict.fromkeys(r["estimator"] for r in recs))
    stages = sorted({r["stage"] for r in recs})
    by = {(r["estimator"], r["stage"]): r for r in recs}
    body = [
        [_e(e)]
        + [
            _num(by[(e, h)]["bias_mean"]) + _ci(by[(e, h)].get("ci_low"), by[(e, h)].get("ci_high"))
            if (e, h) in by
            else "–"
            for h in stages
        ]
        for e in ests
    ]
    return "<p>Mean bias of each estimator's advantage per stage.</p>" + _table(
        ["estimator"] + [f"stage {h}" for h in stages], body
    )


_SUMMARIES = {
    "rank.json": ("Gradient spectrum (grpolab rank)", _rank_summary),
    "mse.json": ("Estimator MSE (grpolab mse)", _mse_summary),
    "groupsize.json": ("Best group size (grpolab groupsize)", _groupsize_summary),
    "multiturn.json": ("Multi-turn bias (grpolab multiturn)", _multiturn_summary),
    "sweep.json": ("Budget-fixed sweep (grpolab sweep)", lambda d: ""),
}


def _probe_section(path: Path, run_dir: Path) -> str:
    title, summarise = _SUMMARIES[path.name]
    try:
        data = json.loads(path.read_text())
        summary = summarise(data) if isinstance(data, dict) else ""
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        summary = f"<p>Could not read {_e(path.name)}: {_e(e)}</p>"
    where = path.parent
    try:
        shown = where.relative_to(run_dir.resolve())
    except ValueError:
        shown = where
    stem = path.stem
    images = "".join(_png(p) for p in sorted(where.glob("*.png")) if p.name.startswith(stem))
    return f'<h3>{_e(title)}</h3><p class="sub">{_e(shown)}</p>{summary}<div class="imgs">{images}</div>'


# ---------------------------------------------------------------- the page


def _config_table(config: dict) -> str:
    body = [[_e(k), f"<code>{_e(json.dumps(v))}</code>"] for k, v in config.items()]
    return "<details><summary>every setting</summary>" + _table(["setting", "value"], body, left=2) + "</details>"


def build_report(
    run_dir: str | Path, probes: Iterable[str | Path] = (), out: str | Path | None = None, quantity: str = "dlogp"
) -> Path:
    """Write the run's report page (default ``RUN_DIR/report.html``) and return its path; ``quantity`` colours the
    tokens of the credit section (:data:`grpolab.report.token_view.QUANTITIES`)."""
    run_dir = Path(run_dir)
    config_file = run_config_file(run_dir)
    if not config_file.is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir}: not a run directory (no config.json or metrics.jsonl)")
    for p in probes:
        if not Path(p).exists():
            raise FileNotFoundError(f"--probe {p}: no such file or directory")
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    fact_table = facts_html(config, rows, run_dir)
    probe_files = find_probe_outputs(run_dir, probes)
    probe_html = "".join(_probe_section(p, run_dir) for p in probe_files) or (
        "<p>No probe outputs found. Run <code>grpolab rank --checkpoint RUN_DIR --out RUN_DIR/probes/rank</code> "
        "(or mse, groupsize, multiturn) and write the report again, or pass <code>--probe DIR</code>.</p>"
    )
    signal = signal_panel(rows)
    if signal:
        signal = f'<h2 id="signal">Signal: has GRPO run out of it?</h2>\n{signal}'
    credit = credit_section(run_dir, rows, quantity)
    if credit:
        credit = f'<h2 id="credit">Where the credit lands</h2>\n{credit}'
    generators = generators_section(run_dir)
    doctor = f'<h2 id="doctor">Doctor: is the run learning?</h2>\n{doctor_section(run_dir)}' if rows else ""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>grpolab report: {_e(run_dir.name)}</title><style>{_CSS}{TOKEN_CSS}{FINDINGS_CSS}</style></head>
<body>
<h1>grpolab run <code>{_e(run_dir.name)}</code></h1>
<p class="sub">{_e(run_dir.resolve())} · report written {now}</p>
<p class="nav">{'<a href="#doctor">doctor</a>' if doctor else ""}<a href="#eval">evaluation</a><a href="#plots">plots</a>{'<a href="#signal">signal</a>' if signal else ""}{'<a href="#generators">generators</a>' if generators else ""}<a href="#samples">samples</a>
{'<a href="#credit">where the credit lands</a>' if credit else ""}<a href="#probes">probes</a><a href="#config">configuration</a></p>
{fact_table}
{doctor}
<h2 id="eval">Held-out accuracy, before and after</h2>
{evaluation_table(rows)}{_all_evaluations(rows)}{pass_k_html(rows)}
<h2 id="plots">Metrics</h2>
{_plots(run_dir, rows)}
{signal}
{generators}
<h2 id="samples">Sample completions</h2>
{_samples(run_dir)}
{credit}
<h2 id="probes">Gradient probes</h2>
{probe_html}
<h2 id="config">Configuration</h2>
{_config_table(config)}
</body></html>
"""
    out = Path(out) if out else run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)  # never a half-written page
    return out
