"""The dashboard in a real browser: login, the cluster, a job that crashes once, the jobs list.

One LocalCluster (two nodes) and one Chromium for the module; each test opens few pages. Each
page's screenshot is saved in the test's output dir (and copied to docs/img/ with
GELASTIC_UPDATE_SCREENSHOTS=1).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client import JobSpec, JobState
from gelastic.local import LocalCluster, poll_until
from tests.browser.conftest import DOCS_IMG, SCRIPTS

WAIT_MS = 30_000
SESSION_KEY = "gelastic.session"
"""Where the pages keep the session (coordinator/dashboard_static/app.js)."""
HOSTILE = "bad <img src=x onerror=window.__pwned=1> & </pre><script>window.__pwned=2</script>"


def _token(cluster: LocalCluster) -> str:
    return Path(cluster.token_file).read_text().strip()


@pytest.fixture(scope="module")
def requested(browser: Any) -> list[str]:
    """Every URL any page of this module asked for."""
    return []


@pytest.fixture(scope="module")
def script_errors(browser: Any) -> list[str]:
    """Uncaught errors of the pages' script: each test ends with none."""
    return []


def _exactly(text: str) -> re.Pattern[str]:
    """`has_text` for `text` as it is written (a plain string would match any case)."""
    return re.compile(re.escape(text))


def _watch(ctx: Any, requested: list[str], script_errors: list[str]) -> None:
    ctx.on("request", lambda r: requested.append(r.url))
    ctx.on("weberror", lambda e: script_errors.append(str(e.error)))


@pytest.fixture(scope="module")
def session(
    browser: Any, cluster: LocalCluster, requested: list[str], script_errors: list[str]
) -> Iterator[Any]:
    """A browser context logged in through the login form."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    _watch(ctx, requested, script_errors)
    page = ctx.new_page()
    page.goto(cluster.dashboard_url)
    page.fill("#token", _token(cluster))
    page.click("button[type=submit]")
    page.wait_for_url(cluster.dashboard_url)
    page.close()
    yield ctx
    ctx.close()


def _shot(page: Any, shots: Path, name: str, docs: str = "") -> None:
    path = shots / f"{name}.png"
    page.set_viewport_size({"width": 1280, "height": 400})  # full_page grows it to fit
    page.screenshot(path=str(path), full_page=True)
    if docs and os.environ.get("GELASTIC_UPDATE_SCREENSHOTS") == "1":
        # `GELASTIC_UPDATE_SCREENSHOTS=1 make test PYTEST_ARGS=tests/browser` refreshes the docs'.
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS_IMG / docs)


def test_without_the_token_there_is_only_the_login_page(
    browser: Any, cluster: LocalCluster, requested: list[str], script_errors: list[str], shots: Path
) -> None:
    ctx = browser.new_context(viewport={"width": 1280, "height": 720})
    _watch(ctx, requested, script_errors)
    try:
        page = ctx.new_page()
        page.goto(cluster.dashboard_url + "jobs")
        page.wait_for_url(cluster.dashboard_url + "login")
        assert page.locator("#login-form").is_visible()
        text = page.inner_text("body")
        assert "node-0" not in text and "node-1" not in text
        _shot(page, shots, "login")
        for path in ("api/overview", "api/stream/overview", "api/jobs/x", "api/stream/logs/x/0"):
            resp = ctx.request.get(cluster.dashboard_url + path)
            assert resp.status == 401, path
            assert "node-0" not in resp.text()
        # A wrong token: the login page again, with its notice, and still no data.
        page.fill("#token", "not-the-token")
        page.click("button[type=submit]")
        page.locator("#login-failed").wait_for(timeout=WAIT_MS)
        assert page.input_value("#token") == "", "a refused token is not left in the form"
        assert ctx.request.get(cluster.dashboard_url + "api/overview").status == 401
        # The right one: the cluster page, listing both nodes.
        page.fill("#token", _token(cluster))
        page.click("button[type=submit]")
        page.wait_for_url(cluster.dashboard_url)
        for node in ("node-0", "node-1"):
            page.wait_for_selector(f'tr[data-node="{node}"]', timeout=WAIT_MS)
        assert "live" in page.inner_text('tr[data-node="node-1"]')
        # No cookie (a browser would send it to every port of this host): the session is in
        # the dashboard origin's storage, and the browser alone sends nothing that reads data.
        assert ctx.cookies() == []
        sid = page.evaluate(f"localStorage.getItem({SESSION_KEY!r})")
        assert sid and _token(cluster) not in sid
        assert ctx.request.get(cluster.dashboard_url + "api/overview").status == 401
        with_session = {"Authorization": f"Session {sid}"}
        assert ctx.request.get(cluster.dashboard_url + "api/overview", headers=with_session).ok
        # Logging out ends the session, here and on the server.
        page.click("#logout-form button")
        page.wait_for_url(cluster.dashboard_url + "login")
        assert page.evaluate(f"localStorage.getItem({SESSION_KEY!r})") is None
        assert (
            ctx.request.get(cluster.dashboard_url + "api/overview", headers=with_session).status
            == 401
        )
    finally:
        ctx.close()
    _no_token_in(requested, cluster)
    assert not script_errors, script_errors


def test_a_job_that_crashes_once(
    session: Any,
    cluster: LocalCluster,
    requested: list[str],
    script_errors: list[str],
    shots: Path,
    tmp_path: Path,
) -> None:
    """The log tail follows a running rank; the timeline shows both attempts with the failing
    rank marked; the root cause shows its traceback, markup in it as text."""
    gate = tmp_path / "gate"
    gate.mkdir()
    job = cluster.client.submit(
        JobSpec(
            entrypoint=[sys.executable, str(SCRIPTS / "dash_worker.py")],
            name="crash-once",
            min_nodes=2,
            max_nodes=2,
            nproc_per_node=1,
            max_restarts=1,
            last_call_timeout=0,
            stop_grace=5,
            env={"GATE_DIR": str(gate), "CRASH_RANK": "1", "CRASH_MESSAGE": HOSTILE},
        )
    )
    poll_until(
        lambda: len([w for w in job.status().workers if w.pid]) == 2, 60, what="2 workers running"
    )
    page = session.new_page()
    page.goto(f"{cluster.dashboard_url}jobs/{job.job_id}")
    log = page.locator("#log")
    log.wait_for(timeout=WAIT_MS)
    # A locator, not a string predicate: the dashboard's CSP forbids eval, and playwright
    # evaluates a string predicate with eval once it has to poll (a line that comes late).
    page.locator("#log", has_text=_exactly("rank 0 attempt 0 says hello")).wait_for(timeout=WAIT_MS)
    # Still running: the line came while the rank waits on its gate, not from a finished log.
    assert job.status().state == JobState.RUNNING and not (gate / "go0").exists()
    assert "<b id=bold>in markup</b>" in log.inner_text() and page.locator("#bold").count() == 0

    overview = session.new_page()
    overview.goto(cluster.dashboard_url)
    overview.wait_for_selector(
        f'tr[data-node="node-1"] a:has-text("{job.job_id}")', timeout=WAIT_MS
    )
    _shot(overview, shots, "cluster", "dashboard-cluster.png")
    overview.close()

    (gate / "go0").touch()
    poll_until(lambda: job.status().attempt == 1, 60, what="the restart")
    (gate / "go1").touch()
    assert job.wait(60).state.name == "SUCCEEDED"
    # The job's own badge: a rank of attempt 0 that exited 0 has a SUCCEEDED badge of its own.
    page.wait_for_selector("h1 .badge.s-succeeded", timeout=WAIT_MS)
    for attempt in (0, 1):
        bars = page.locator(f'g.attempt[data-attempt="{attempt}"]')
        assert bars.count() == 2, f"attempt {attempt}: one bar per node"
    marks = page.locator('g.attempt[data-attempt="0"] .failmark')
    assert marks.count() == 1 and marks.get_attribute("data-rank") == "1"
    assert page.locator('g.attempt[data-attempt="1"] .failmark').count() == 0
    assert page.locator("line.mark-restart").count() >= 1
    cause = page.locator("#root-cause")
    text = cause.inner_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError" in text
    assert HOSTILE in text, "the failure's markup shows as text"
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img").count() == 0 and page.locator("main script").count() == 0
    _shot(page, shots, "job", "dashboard-job.png")
    page.close()
    _no_token_in(requested, cluster)
    assert not script_errors, script_errors


def test_the_jobs_page_lists_finished_jobs_with_their_root_cause(
    session: Any,
    cluster: LocalCluster,
    requested: list[str],
    script_errors: list[str],
    shots: Path,
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "go0").touch()
    failed = cluster.client.submit(
        JobSpec(
            entrypoint=[sys.executable, str(SCRIPTS / "dash_worker.py")],
            name="fails",
            nproc_per_node=2,
            stop_grace=5,
            env={"GATE_DIR": str(gate), "CRASH_RANK": "1", "CRASH_MESSAGE": "out of patience"},
        )
    )
    assert failed.wait(60).state.name == "FAILED"
    held = tmp_path / "held"
    held.mkdir()
    running = cluster.client.submit(
        JobSpec(
            entrypoint=[sys.executable, str(SCRIPTS / "dash_worker.py")],
            name="waits",
            stop_grace=5,
            env={"GATE_DIR": str(held)},
        )
    )
    page = session.new_page()
    page.goto(cluster.dashboard_url + "jobs")
    row = page.locator(f'tr[data-job="{failed.job_id}"]')
    row.wait_for(timeout=WAIT_MS)
    assert "FAILED" in row.inner_text()
    row.locator("td.cause", has_text=_exactly("RuntimeError: out of patience")).wait_for(
        timeout=WAIT_MS
    )
    assert page.locator("tr[data-job]").count() >= 2, "the job of the test before is listed too"
    page.wait_for_selector(f'tr[data-job="{running.job_id}"] .badge.s-running', timeout=WAIT_MS)
    _shot(page, shots, "jobs", "dashboard-jobs.png")
    page.close()
    (held / "go0").touch()
    assert running.wait(60).state.name == "SUCCEEDED"
    _no_token_in(requested, cluster)
    assert not script_errors, script_errors


def _no_token_in(requested: list[str], cluster: LocalCluster) -> None:
    token = _token(cluster)
    assert requested, "no request was recorded"
    leaked = [u for u in requested if token in u]
    assert not leaked, f"the token appeared in a URL: {len(leaked)} requests"


def test_the_cluster_page_shows_a_drained_node_and_why(
    session: Any, cluster: LocalCluster, script_errors: list[str], shots: Path
) -> None:
    assert cluster.client.drain_node("node-1", reason="kernel upgrade") == "drained"
    page = session.new_page()
    try:
        page.goto(cluster.dashboard_url)
        row = 'tr[data-node="node-1"]'
        page.wait_for_selector(f"{row} .s-drained", timeout=WAIT_MS)
        title = page.get_attribute(f"{row} td:nth-child(2)", "title") or ""
        assert "drained: kernel upgrade" in title
        _shot(page, shots, "cluster-drained")
    finally:
        page.close()
        cluster.client.undrain_node("node-1")
    assert not script_errors, script_errors


def test_the_stacks_button_shows_every_rank_grouped_the_odd_one_first(
    session: Any,
    cluster: LocalCluster,
    requested: list[str],
    script_errors: list[str],
    shots: Path,
    tmp_path: Path,
) -> None:
    spots = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "stack_spots.py"
    job = cluster.client.submit(
        JobSpec(
            entrypoint=[sys.executable, str(spots)],
            name="stacks",
            min_nodes=2,
            max_nodes=2,
            nproc_per_node=2,
            last_call_timeout=0,
            env={"OUT_DIR": str(tmp_path), "ODD_RANK": "2"},
        )
    )
    poll_until(
        lambda: all((tmp_path / f"ready-{r}").exists() for r in range(4)),
        60,
        what="every rank at its spot",
    )
    page = session.new_page()
    page.goto(f"{cluster.dashboard_url}jobs/{job.job_id}")
    page.click("#stacks-button", timeout=WAIT_MS)
    heads = page.locator("#stacks .stack-ranks")
    heads.nth(1).wait_for(timeout=WAIT_MS)
    assert heads.count() == 2
    first, second = heads.nth(0).inner_text(), heads.nth(1).inner_text()
    assert first.startswith("rank 2 (") and second.startswith("ranks 0,1,3 (")
    stacks = page.locator("#stacks pre.stack")
    assert "gelastic_stack_odd_one_out" in stacks.nth(0).inner_text()
    assert "gelastic_stack_probe_wait" in stacks.nth(1).inner_text()
    captured = page.inner_text("#stacks-capture")
    _shot(page, shots, "stacks", "dashboard-stacks.png")
    page.close()
    # Kept with the job: a page opened after its end shows the same capture.
    job.cancel()
    poll_until(lambda: job.status().state.is_terminal(), 60, what="the job to end")
    again = session.new_page()
    again.goto(f"{cluster.dashboard_url}jobs/{job.job_id}")
    again.wait_for_selector("#stacks-capture", timeout=WAIT_MS)
    assert again.inner_text("#stacks-capture") == captured
    again.close()


def test_a_jobs_page_shows_each_ranks_progress(
    session: Any, cluster: LocalCluster, requested: list[str], script_errors: list[str]
) -> None:
    """Four ranks that call client.progress: each row has its step, steps/s and metrics."""
    steps = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "progress_steps.py"
    job = cluster.client.submit(
        JobSpec(
            entrypoint=[sys.executable, str(steps)],
            name="progress",
            min_nodes=2,
            max_nodes=2,
            nproc_per_node=2,
            last_call_timeout=0,
            env={"RUN_S": "60"},
        )
    )
    poll_until(
        lambda: all(w.steps_per_s > 0 for w in job.status().workers), 60, what="4 ranks stepping"
    )
    page = session.new_page()
    page.goto(f"{cluster.dashboard_url}jobs/{job.job_id}")
    headers = page.locator("table.ranks th")
    headers.first.wait_for(timeout=WAIT_MS)
    names = headers.all_text_contents()
    step_col, rate_col = names.index("step"), names.index("steps/s")

    def stepping() -> bool:
        rows = page.locator("table.ranks tbody tr")
        if rows.count() != 4:
            return False
        for row in rows.all():
            cells = row.locator("td").all_inner_texts()
            try:
                if not (float(cells[step_col]) > 5 and float(cells[rate_col]) > 0):
                    return False
            except (ValueError, IndexError):
                return False
        return True

    # Polled from here: the page's CSP lets no string be evaluated as script.
    poll_until(stepping, WAIT_MS / 1000, interval=0.2, what="4 ranks' progress on the page")
    for row in page.locator("table.ranks tbody tr").all():
        cells = row.locator("td").all_inner_texts()
        assert float(cells[rate_col]) > 0 and "loss=" in " ".join(cells)
    page.close()
    job.cancel()
    job.wait(60)
    _no_token_in(requested, cluster)
    assert not script_errors, script_errors
