"""`grpolab tokens` and the report's "Where the credit lands": token_credit.jsonl painted token by token.

A synthetic run directory (no model): three recorded steps of three rollouts each (advantage > 0, < 0 and
= 0), with spans holding a newline, "<", "&", non-ASCII and double-width characters, a long word, and an
end-of-sequence token with the empty span; metrics.jsonl with the credit/* aggregates.
"""

from __future__ import annotations

import colorsys
import html
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers.pages import token_cards
from rich.cells import cell_len
from rich.console import Console

from grpolab.report import token_view as tv

COMPLETIONS = {
    (0, 0): ["The", " answer", " is", " ", "84", ""],
    (0, 1): ["Let", " me", " think", ":\n", "12", "*", "7", " <", " 90", " &", " é", "中", "\n", "answer", " 80", ""],
    (1, 0): ["x" * 50, " ", "y" * 45, " done", "\t", ""],
}
ADVANTAGE = {(0, 0): 0.87, (0, 1): -0.87, (1, 0): 0.0}


def _record(step: int, key: tuple[int, int]) -> dict:
    tokens = COMPLETIONS[key]
    n, adv = len(tokens), ADVANTAGE[key]
    # dlogp: the sign of the advantage, growing along the sequence; token 1 exactly 0; step scales it
    dlogp = [0.0 if i == 1 else math.copysign(0.01 * (i + 1) * step, adv or 1.0) for i in range(n)]
    return {
        "step": step,
        "prompt": key[0],
        "rollout": key[1],
        "question": "12*7 <b>&amp;</b>",
        "completion": "".join(tokens),
        "reward": 1.0 if adv > 0 else 0.0,
        "advantage": adv,
        "tokens": tokens,
        "ids": list(range(10, 10 + n)),
        "segment": ["answer" if t.strip().isdigit() else ("format" if t == "" else "reasoning") for t in tokens],
        "dlogp": dlogp,
        "logp": [-0.5 - 0.1 * i for i in range(n)],
        "logp_sampler": [-0.51 - 0.1 * i for i in range(n)],
        "entropy": None if key == (1, 0) else [0.2 * i for i in range(n)],
        "adv": [adv] * n,
        "ratio": [None if adv == 0 else 1.0 + 0.01 * i for i in range(n)],
        "clipped": [i == 2 for i in range(n)],
    }


STEPS = (1, 2, 3)


def _write_run(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(_record(s, k)) for s in STEPS for k in COMPLETIONS]
    (path / tv.CREDIT_FILE).write_text("\n".join(lines) + "\n")
    rows = []
    for s in STEPS:
        rows.append(
            {
                "step": s,
                "reward/mean": 0.5,
                "credit/answer_share": 0.2 + 0.1 * s,
                "credit/reasoning_share": 0.7 - 0.1 * s,
                "credit/format_share": 0.1,
                "credit/answer_token_frac": 0.2,
                "credit/reasoning_token_frac": 0.6,
                "credit/format_token_frac": 0.2,
                "credit/sign_corr": 0.5 + 0.1 * s,
                "credit/half_mass_frac": None if s == 1 else 0.3,
                "credit/abs_mean": 0.01 * s,
                "credit/dlogp_pos": 0.02,
                "credit/dlogp_neg": -0.02,
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def run(tmp_path) -> Path:
    return _write_run(tmp_path / "run")


@pytest.fixture
def records(run) -> list[dict]:
    return tv.read_token_credit(run)


# ---------------------------------------------------------------- reading


def test_reading_skips_malformed_lines_and_says_how_many(run):
    path = run / tv.CREDIT_FILE
    bad = {**_record(2, (0, 0)), "completion": "not the tokens"}
    path.write_text(path.read_text() + "{not json\n" + json.dumps(bad) + "\n")
    said: list[str] = []
    records = tv.read_token_credit(run, warn=said.append)
    assert len(records) == len(STEPS) * len(COMPLETIONS)
    assert len(said) == 1 and "skipped 2 malformed" in said[0] and "do not join" in said[0]
    with pytest.warns(UserWarning, match="skipped 2"):
        tv.read_token_credit(run)


def test_a_missing_file_says_how_to_record_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="--log-token-credit K"):
        tv.read_token_credit(tmp_path)


def test_steps_and_the_split_by_advantage(records):
    assert tv.recorded_steps(records) == [1, 2, 3]
    assert tv.resolve_step(records) == 3
    split = tv.split_by_advantage(records, 2)
    assert [(r["prompt"], r["rollout"]) for r in split.positive] == [(0, 0)]
    assert [(r["prompt"], r["rollout"]) for r in split.negative] == [(0, 1)]
    assert [(r["prompt"], r["rollout"]) for r in split.zero] == [(1, 0)]
    assert tv.select_rollout(records, 2, 0, 1)["advantage"] == -0.87


def test_an_unknown_step_or_rollout_names_what_was_recorded(records):
    with pytest.raises(ValueError, match=r"step 7 was not recorded; nearest recorded steps: 1, 2, 3"):
        tv.resolve_step(records, 7)
    with pytest.raises(ValueError, match=r"0:0, 0:1, 1:0"):
        tv.select_rollout(records, 2, 5, 5)


def test_prob_change_is_the_probability_after_minus_before(records):
    r = records[0]
    got = tv.token_values(r, "prob_change")
    want = [math.exp(lp + d) - math.exp(lp) for lp, d in zip(r["logp"], r["dlogp"])]
    assert got == pytest.approx(want)
    assert tv.token_values(tv.split_by_advantage(records, 1).zero[0], "entropy") == [None] * 6
    with pytest.raises(ValueError, match="choose from dlogp"):
        tv.token_values(r, "nope")


# ---------------------------------------------------------------- colour scale


def test_the_scale_is_symmetric_robust_to_one_outlier_and_clamps():
    values = [0.01 * (k % 10) * (-1) ** k for k in range(200)] + [5.0]
    scale = tv.colour_scale(values, "dlogp")
    assert 0.08 <= scale.span <= 0.09  # the 98th percentile of |v|, not the outlier
    assert scale.level(5.0) == 1.0 and scale.level(-5.0) == -1.0 and scale.level(0.0) == 0.0
    assert scale.level(scale.span / 2) == pytest.approx(0.5) and scale.level(None) is None
    ratio = tv.colour_scale([1.0] * 99 + [1.2], "ratio")  # percentile 0 -> the largest deviation
    assert ratio.span == pytest.approx(0.2) and ratio.level(1.0) == 0.0
    logp = tv.colour_scale([-0.1, -1.0, -2.0], "logp")  # sequential, below 0: darker for less likely
    assert logp.direction == -1.0 and logp.level(-2.0) > logp.level(-0.1) > 0
    assert tv.colour_scale([None, None], "entropy").span == 0.0


# ---------------------------------------------------------------- HTML


@pytest.mark.slow
def test_the_token_spans_join_to_each_completion_exactly(run, records):
    cards = token_cards(tv.token_credit_html(run)).cards
    assert cards
    by_key = {(r["step"], r["prompt"], r["rollout"]): r for r in records}
    for card in cards:
        rec = by_key[(card["step"], card["prompt"], card["rollout"])]
        assert "".join(t["text"] for t in card["tokens"] if not t["mark"]) == rec["completion"]
        marks = [t for t in card["tokens"] if t["mark"]]
        assert [t["text"] for t in marks] == ["eos"]  # the empty end-of-sequence token, shown but not text
        assert len(card["tokens"]) == len(rec["tokens"])


@pytest.mark.slow
def test_the_columns_hold_the_first_and_last_steps_positive_and_negative_rollouts(run):
    page = tv.token_credit_html(run)
    cards = token_cards(page).cards
    assert [(c["column"], c["step"], c["prompt"], c["rollout"]) for c in cards] == [
        ("pos", 1, 0, 0),
        ("neg", 1, 0, 1),
        ("pos", 3, 0, 0),
        ("neg", 3, 0, 1),
    ]
    assert "Step 1 (first recorded)" in page and "Step 3 (last recorded)" in page
    assert "1 recorded rollout(s) with advantage 0 not shown" in page
    assert "<script" not in page.lower() and "white-space: pre-wrap" in tv.TOKEN_CSS
    assert page.count("data:image/png;base64,") == 1  # the credit/* figure
    assert html.escape("12*7 <b>&amp;</b>") in page and "<b>&amp;" not in page  # the question, escaped


@pytest.mark.slow
def test_hover_titles_hold_the_tokens_values(run, records):
    card = token_cards(tv.token_credit_html(run)).cards[1]  # step 1, prompt 0, rollout 1
    rec = tv.select_rollout(records, 1, 0, 1)
    title = card["tokens"][3]["title"]  # ":\n"
    assert "':\\n'" in title and "token 3, id 13, reasoning" in title
    assert f"dlogp {rec['dlogp'][3]:+.4f}" in title and "adv -0.870" in title and "ratio 1.030" in title
    p0, p1 = math.exp(rec["logp"][3]), math.exp(rec["logp"][3] + rec["dlogp"][3])
    assert f"p {p0:.3f} -> {p1:.3f}" in title
    assert f"entropy {rec['entropy'][3]:.3f}" in title and f"sampler logp {rec['logp_sampler'][3]:.3f}" in title
    assert "clipped no" in title and "clipped yes" in card["tokens"][2]["title"]
    assert "(end of sequence)" in card["tokens"][-1]["title"]


def _rgba(style: str) -> tuple[tuple[int, int, int], float]:
    m = re.search(r"rgba\((\d+),(\d+),(\d+),([\d.]+)\)", style)
    return (tuple(int(m.group(k)) for k in (1, 2, 3)), float(m.group(4))) if m else ((0, 0, 0), 0.0)


@pytest.mark.slow
def test_positive_and_negative_changes_differ_in_hue_and_zero_is_uncoloured(run):
    cards = token_cards(tv.token_credit_html(run)).cards
    pos, neg = cards[0]["tokens"], cards[1]["tokens"]
    (rgb_pos, a_pos), (rgb_neg, a_neg) = _rgba(pos[4]["style"]), _rgba(neg[4]["style"])
    hue_pos = colorsys.rgb_to_hsv(*(c / 255 for c in rgb_pos))[0]
    hue_neg = colorsys.rgb_to_hsv(*(c / 255 for c in rgb_neg))[0]
    assert a_pos > 0.05 and a_neg > 0.05
    assert 0.5 < hue_pos < 0.75 and (hue_neg < 0.05 or hue_neg > 0.95)  # blue and red
    assert _rgba(pos[1]["style"])[1] < 0.02  # dlogp exactly 0: no colour
    legend = tv.token_credit_html(run)
    assert "blue: made more likely by the update; red: made less likely" in legend


@pytest.mark.slow
def test_a_report_of_the_run_has_the_section(run):
    from grpolab.report.page import build_report

    page = build_report(run, quantity="entropy").read_text()
    assert '<h2 id="credit">Where the credit lands</h2>' in page and 'href="#credit"' in page
    assert "sampler entropy" in page and ".tok-mark" in page
    (run / tv.CREDIT_FILE).unlink()
    page = build_report(run).read_text()
    assert "token_credit.jsonl is missing" in page
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    page = build_report(run).read_text()
    assert "Where the credit lands" not in page and 'href="#credit"' not in page


# ---------------------------------------------------------------- terminal


def test_wrapping_keeps_every_character():
    chars = [(c, "") for c in "aaaa bbbb  cc\n\ndddddddddd 中中"]
    lines = tv.wrap_cells(chars, 4)
    assert all(cell_len("".join(c for c, _ in line)) <= 4 for line in lines)
    assert "\n".join("".join(c for c, _ in line) for line in lines).replace("\n", "") == "aaaa bbbb  ccdddddddddd 中中"


def _unmarked(text: str) -> str:
    for mark in (tv.NEWLINE_MARK, *tv.TERMINAL_MARKS, "\n"):
        text = text.replace(mark, "")
    return text


@pytest.mark.parametrize("quantity", ["dlogp", "ratio", "logp"])
def test_the_coloured_terminal_view_fits_80_columns_and_shows_each_completion(records, quantity):
    console = Console(width=80, force_terminal=True, record=True, color_system="truecolor")
    tv.render_terminal(records, 2, quantity, console=console)
    ansi = console.export_text(styles=True, clear=False)
    assert "\x1b[" in ansi and "48;2;" in ansi  # backgrounds coloured
    text = console.export_text()
    assert max(cell_len(line) for line in text.splitlines()) <= 80
    flat = _unmarked(text)
    for key, tokens in COMPLETIONS.items():
        completion = "".join(tokens).replace("\n", "").replace("\t", "\u2409")  # a tab is drawn as its picture
        assert flat.count(completion) == 1, key
    assert "⟨eos⟩" in text and tv.QUANTITIES[quantity].meaning[:30] in _unmarked(text.replace("\n", " "))


def test_the_plain_view_has_one_line_per_token_with_its_values(records):
    console = Console(width=80, force_terminal=False, record=True)
    tv.render_terminal(records, 2, console=console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80 and max(cell_len(line) for line in lines) <= 80
    for r in (tv.select_rollout(records, 2, *key) for key in COMPLETIONS):
        for i, d in enumerate(r["dlogp"]):
            want = f"{i:>4}  {r['segment'][i]:<9}"
            assert sum(1 for line in lines if line.startswith(want) and f"dlogp={d:+.4f}" in line) >= 1
    token_lines = [line for line in lines if "dlogp=" in line]
    assert len(token_lines) == sum(len(t) for t in COMPLETIONS.values())
    assert any("adv=-0.870" in line and "ratio=1.020" in line for line in token_lines)
    one = Console(width=80, force_terminal=True, record=True)
    tv.render_terminal(records, None, "adv", console=one, plain=True, rollout=(0, 1))
    out = one.export_text()
    assert "step 3 · prompt 0 · rollout 1" in out and "adv=-0.870" in out and "\x1b[" not in out


# ---------------------------------------------------------------- the command


def test_grpolab_tokens_prints_a_step(run, capsys):
    from grpolab.commands.cli import main

    main(["tokens", str(run), "--step", "2"])
    out = capsys.readouterr().out
    assert "step 2 · prompt 0 · rollout 0" in out and "step 2 · prompt 1 · rollout 0" in out
    assert f"dlogp={0.01 * 3 * 2:+.4f}" in out
    main(["tokens", str(run), "--quantity", "prob_change", "--rollout", "0:1"])
    out = capsys.readouterr().out
    assert "step 3 · prompt 0 · rollout 1" in out and "prob_change=" in out and "rollout 0 ·" not in out


def test_grpolab_tokens_says_what_is_wrong(run, tmp_path, capsys):
    from grpolab.commands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["tokens", str(run), "--step", "5"])
    assert e.value.code == 2
    assert "error: step 5 was not recorded; nearest recorded steps: 1, 2, 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["tokens", str(tmp_path / "empty")])
    assert e.value.code == 2 and "--log-token-credit K" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["tokens", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert "not a terminal" in help_text and all(q in help_text for q in tv.QUANTITIES)


def test_grpolab_tokens_draws_a_picture_of_the_step(run, tmp_path, capsys):
    from PIL import Image

    from grpolab.commands.cli import main

    png = tmp_path / "tokens.png"
    main(["tokens", str(run), "--step", "2", "--png", str(png)])
    assert str(png) in capsys.readouterr().out
    with Image.open(png) as image:
        rgb = np.asarray(image.convert("RGB")).astype(int)  # [H, W, 3]
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    blue = int(((b > 150) & (r < 150)).sum())  # a positive change somewhere
    red = int(((r > 150) & (b < 150) & (g < 150)).sum())  # a negative one
    assert rgb.shape[1] > 800 and rgb.shape[0] > 200 and blue > 20 and red > 20


def test_grpolab_tokens_summarises_the_aggregates_over_spans_of_steps(run, capsys):
    from grpolab.commands.cli import main

    main(["tokens", str(run), "--summary", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert "steps 1-2" in lines[0] and "steps 3-3" in lines[0]  # the fixture records steps 1, 2 and 3
    shares = [line for line in lines if "share of |dlogp|" in line]
    assert len(shares) == 4 and all("[" in line for line in shares)


@pytest.mark.slow
def test_grpolab_tokens_draws_the_aggregates_against_step(run, tmp_path, capsys):
    from grpolab.commands.cli import main

    png = tmp_path / "aggregates.png"
    main(["tokens", str(run), "--summary", "3", "--png", str(png)])
    assert f"aggregates: {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
