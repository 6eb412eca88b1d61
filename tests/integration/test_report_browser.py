"""`trainpod report`'s page in a real browser: Debian's chromium, headless, driven by Playwright, opens the file from
disk (nothing else to reach) and draws every figure without an error. The report is made from records and a
metrics.json written as the agents and rank 0 write them (fixtures.run_records), and from a real 2-rank job on this
host whose rank is killed once: its agent's own records and rank 0's metrics.json.

Playwright drives the system's chromium (`executable_path`): `playwright install` would download a browser, and CI
has no network for that. Without chromium or playwright these tests skip; under CI=true they fail instead, since a
skip would hide a CI machine that lacks them (.ci/provision.sh installs chromium, requirements-dev.txt playwright).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fixtures.docker_env import REPO
from fixtures.processes import host_env, trainpod_run, wait_logged
from fixtures.run_records import write_run
from trainpod.launcher.cli import main

pytestmark = pytest.mark.slow  # about 10 s a page on a busy machine: chromium parses 4.6 MB of plotly.js

LOAD_TIMEOUT_MS = 60_000  # with a margin for a CI machine under load
# Every plot has drawn its axes (svg.main-svg) and at least one trace.
DRAWN = """() => {
    const plots = [...document.querySelectorAll('.js-plotly-plot')];
    return plots.length > 0 && plots.every(p => p.querySelector('svg.main-svg')
        && p.querySelector('.scatterlayer .trace path, .scatterlayer .trace .point'));
}"""


def _unavailable(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}: the report's browser test must run in CI", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("no playwright (pip install -r requirements-dev.txt)")
    executable = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(executable, os.X_OK):
        _unavailable("no chromium (apt-get install -y chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def open_report(browser, path):
    """The page, once every plot is drawn, and the errors it logged on its way (console errors, uncaught ones)."""
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors = []
    page.on("console", lambda message: errors.append(f"console: {message.text}") if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    page.goto(path.resolve().as_uri())
    page.wait_for_function(DRAWN, timeout=LOAD_TIMEOUT_MS)
    return page, errors


def make_report(output, capsys, **which) -> str:
    write_run(output, **which)
    assert main(["report", str(output)]) == 0
    return capsys.readouterr().out.strip()


def test_the_run_is_drawn_in_one_figure_with_a_row_per_view_and_no_errors(tmp_path, capsys, chromium):
    path = make_report(tmp_path / "output", capsys)
    page, errors = open_report(chromium, tmp_path / "output" / "report.html")
    try:
        assert path == str(tmp_path / "output" / "report.html")
        assert page.locator(".js-plotly-plot").count() == 1
        # events, loss, throughput, step time, world size, checkpoints: one subplot each, on one time axis
        assert page.locator(".js-plotly-plot .cartesianlayer .subplot").count() == 6
        assert page.locator(".js-plotly-plot .scatterlayer .trace").count() >= 6
        assert page.locator("table tbody tr").count() > 10
        assert page.locator("td", has_text="<b>x</b>").count() == 1  # shown as text, not as markup
        assert errors == []
    finally:
        page.close()


def test_metrics_json_alone_is_drawn_as_the_loss_by_step(tmp_path, capsys, chromium):
    make_report(tmp_path / "output", capsys, records_too=False)
    page, errors = open_report(chromium, tmp_path / "output" / "report.html")
    try:
        assert page.locator(".js-plotly-plot").count() == 1
        assert page.locator("#trainpod-loss-by-step svg.main-svg").count() >= 1
        assert errors == []
    finally:
        page.close()


def test_a_real_jobs_report_draws_its_failure_recovery_and_checkpoints(tmp_path, capsys, chromium):
    # 200 steps: the agent looks at the ranks' progress once a second, and a rank's step time needs two looks in one
    # attempt; the attempt after the kill (steps 11 to 40 before) could end between two looks on an idle machine,
    # and the report then had no step-time row (seen once in four).
    out, log = tmp_path / "out", tmp_path / "log"
    with open(log, "w") as f:
        process = subprocess.Popen(
            [*trainpod_run("--nproc-per-node", "2", "--max-restarts", "2"), "--example", "cifar10-ddp", "--",
             "--epochs", "1", "--synthetic-samples", "4096", "--batch-size", "16", "--max-steps", "200",
             "--checkpoint-every", "10", "--workers", "0", "--output-dir", str(out), "--checkpoint-dir", str(tmp_path / "ckpt")],
            cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            env=host_env(OMP_NUM_THREADS="1", TRAINPOD_FAILPOINTS="checkpoint-write@20"))  # a SIGKILL mid-checkpoint
    output = wait_logged(process, log, timeout=300)
    assert process.returncode == 0, output[-3000:]
    assert main(["report", str(out)]) == 0
    path = Path(capsys.readouterr().out.strip())
    page, errors = open_report(chromium, path)
    try:
        assert path == out / "report.html" and errors == []
        events = page.locator("table tbody").inner_text()
        for kind in ("started", "failed", "recovered", "checkpoint"):
            assert kind in events, events
        # events, loss, throughput, step time, world size, checkpoints
        assert page.locator(".js-plotly-plot .cartesianlayer .subplot").count() == 6
    finally:
        page.close()


def test_the_demos_report_draws_every_plot(chromium):
    # CI runs `make demo` before the tests (.ci/run): its report (compose/demo.sh) is a 2-node job's, made by the agents
    # of both containers and drawn on the host.
    path = REPO / "build" / "demo" / "output" / "report.html"
    if not path.exists():
        _unavailable(f"no {path}: `make demo` writes it")
    page, errors = open_report(chromium, path)
    try:
        assert errors == []
        events = page.locator("table tbody").inner_text()
        assert "started" in events and "worker-0" in events and "worker-1" in events, events
        # events, loss, throughput, step time, world size, checkpoints
        assert page.locator(".js-plotly-plot .cartesianlayer .subplot").count() >= 5
    finally:
        page.close()
