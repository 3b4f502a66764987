"""`grpolab report`: one self-contained HTML page per run, written by `grpolab demo` too.

The run is a two-step demo (stdout to a file, as under a batch system), a rank probe inside
its directory and a multi-turn probe passed with --probe. The page's figures are checked
against the run's own files; a parser checks it references nothing outside itself; headless
Chromium (when installed) opens it, finds no console error and saves a screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers.cli import run_cli

from grpolab.training.runlog import read_metrics


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    # on two processes, as the built-in demo runs on a 2-core machine (its own choice needs 50 steps or more)
    res = run_cli(["demo", "--steps", "2", "--eval-questions", "60", "--out", "demo", "--nproc", "2"], tmp, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    (tmp / "demo.log").write_text(res.stdout)
    res = run_cli(
        ["rank", "--checkpoint", "demo", "--group-sizes", "2,4", "--prompts", "4", "--out", "demo/probes/rank"], tmp
    )
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli(["multiturn", "--env", "chain", "--stages", "3", "--groups", "2000", "--out", "mt"], tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    res = run_cli(["report", "demo", "--probe", "mt", "--out", "page/report.html"], tmp)
    assert res.returncode == 0, res.stderr[-2000:]
    return tmp


class _Refs(HTMLParser):
    """Every tag, and every attribute that can make a browser fetch something."""

    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.refs: list[tuple[str, str, str]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "srcset", "data", "action", "poster", "background") or name.startswith("on"):
                self.refs.append((tag, name, value or ""))

    def handle_data(self, data):
        self.text.append(data)


@pytest.mark.slow
def test_demo_writes_the_report_and_prints_its_path(run):
    log = (run / "demo.log").read_text()
    page = run / "demo" / "report.html"
    assert page.is_file()
    assert f"report: {Path('demo') / 'report.html'}" in log or f"report: {page}" in log
    # rank 0 alone logged, reported and summed up where the time went
    assert log.count("held-out accuracy, 95% intervals") == 1 and log.count("report: ") == 1
    assert [r["step"] for r in read_metrics(run / "demo" / "metrics.jsonl")] == [0, 1, 2]
    assert log.strip().splitlines()[-1].startswith("took ") and " on 2 processes (--nproc; --nproc 1 runs one)" in log
    clock = json.loads((run / "demo" / "summary.json").read_text())["time"]
    assert clock["processes"] == 2 and clock["steps"] == 2 and clock["evaluations"] == 2
    assert 0 < clock["startup_s"] < clock["wall_s"] and clock["eval_s"] + clock["steps_s"] < clock["wall_s"]


@pytest.mark.slow
def test_the_page_holds_the_runs_figures_samples_probes_and_config(run):
    text = (run / "page" / "report.html").read_text()
    rows = read_metrics(run / "demo" / "metrics.jsonl")
    before, after = rows[0], [r for r in rows if "eval/accuracy_greedy" in r][-1]
    assert before["step"] == 0 and after["step"] == 2
    for r in (before, after):  # overall and per category, with intervals, as logged
        for key in ("eval/accuracy_greedy", "eval/accuracy_sampled", "eval/greedy_mul", "eval/sampled_paren"):
            assert f'{r[key]:.3f} <span class="ci">[{r[key + "_lo"]:.3f}, {r[key + "_hi"]:.3f}]</span>' in text, key
    change = after["eval/accuracy_greedy"] - before["eval/accuracy_greedy"]
    assert f"{change:+.3f}" in text
    # samples: the same held-out questions at step 0 and step 2
    samples = [json.loads(line) for line in (run / "demo" / "samples.jsonl").read_text().splitlines()]
    first = next(s for s in samples if s["kind"] == "eval" and s["step"] == 0)
    later = next(s for s in samples if s["kind"] == "eval" and s["step"] == 2 and s["question"] == first["question"])
    import html

    assert html.escape(first["question"]) in text and html.escape(later["completion"]) in text
    # the rank probe found in the run directory, its numbers from rank.json, its plots embedded
    rank = json.loads((run / "demo" / "probes" / "rank" / "rank.json").read_text())
    assert "Gradient spectrum" in text
    for r in rank["results"]:
        assert f"{r['effective_rank']['mean']:.3f}" in text
    # the multi-turn probe given with --probe
    assert "Multi-turn bias" in text
    mt = json.loads((run / "mt" / "multiturn.json").read_text())
    assert len({(r["estimator"], r["stage"]) for r in mt["records"]}) > 1
    # configuration and the embedded images (run plot, details, 3 rank plots, multiturn plot)
    config = json.loads((run / "demo" / "config.json").read_text())
    assert f"<code>{html.escape(json.dumps(config['lr']))}</code>" in text
    assert text.count("data:image/png;base64,") >= 6
    # the doctor's section first (two steps: too few for a check, so nothing found) and pass@k against k
    assert text.index('id="doctor"') < text.index('id="eval"') and "No problems found" in text
    assert 'id="passk"' in text and "eval/pass@4" in json.dumps(after)
    # the header names the built-in task with the settings it ran, the rewards and the text model (no family)
    header = text.split('<h2 id="')[0]
    assert (
        "built-in arith: operands up to 99; products up to 9; categories add_sub_2, add_sub_3, mul, div, paren"
        in header
    )
    assert "the task&#x27;s answer check" in header and "vision-language" not in header and ">data<" not in header


@pytest.mark.slow
def test_the_page_references_nothing_outside_itself(run):
    text = (run / "page" / "report.html").read_text()
    p = _Refs()
    p.feed(text)
    assert not {"script", "link", "iframe", "object", "embed", "base"} & set(p.tags)
    assert "@import" not in text and "url(" not in text
    for tag, name, value in p.refs:
        if name == "src":
            assert tag == "img" and value.startswith("data:image/png;base64,"), value[:80]
            assert base64.b64decode(value.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
        elif name == "href":
            assert value.startswith("#"), value  # in-page anchors only
        else:
            pytest.fail(f"<{tag} {name}={value[:60]!r}>")
    ids = {a.split('"')[0] for a in text.split(' id="')[1:]}
    assert {v[1:] for t, n, v in p.refs if n == "href"} <= ids  # every anchor exists


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.slow
def test_the_page_opens_in_headless_chromium_without_console_errors(run):
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium); the page's content is checked above")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the test extras) is not installed")
    page_path = (run / "page" / "report.html").resolve()
    shot = Path(os.environ.get("GRPOLAB_SCREENSHOT_DIR", run)) / "report-screenshot.png"
    errors, requests = [], []
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=browser,
            args=[
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--no-first-run",
                "--disable-extensions",
            ],
        )
        try:
            page = b.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_path.as_uri(), wait_until="load")
            images = page.evaluate("[...document.images].map(i => i.complete && i.naturalWidth > 0)")
            headings = page.evaluate("[...document.querySelectorAll('h2')].map(h => h.textContent)")
            page.screenshot(path=str(shot), full_page=True)
        finally:
            b.close()
    assert errors == []
    assert [u for u in requests if not u.startswith("data:")] == [page_path.as_uri()]  # nothing fetched but the page
    assert len(images) >= 6 and all(images)
    assert headings[0].startswith("Doctor") and headings[1].startswith("Held-out accuracy")
    assert "Gradient probes" in headings
    from PIL import Image

    with Image.open(shot) as im:
        assert im.width == 1200 and im.height > 2000  # the whole page, not an empty viewport
        assert sum(1 for n in im.convert("L").histogram() if n) > 10  # not a blank page
