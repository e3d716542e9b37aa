"""`make demo` tells the story it promises: a killed worker, then a killed node, and the job
resumes from its checkpoint each time, then finishes; nothing it started outlives it.

Runs `examples/demo.py --steps 10` (the same code path as `make demo`, fewer training steps) as
a subprocess with a marker in its environment, which every process it starts inherits. The
dashboard URL it prints is opened while it runs. Most of its minute of CPU is torch imports
(about 4 s per worker process: torch, and the torch._dynamo that DDP's constructor imports).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from gelastic.local import poll_until

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240
MARK = "GELASTIC_DEMO_TEST"


def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _read(proc: subprocess.Popen[bytes], lines: list[str], served: list[int]) -> None:
    """Collect the demo's output; open the dashboard's URL as soon as it is printed."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        lines.append(line)
        m = re.match(r"dashboard: (http://127\.0\.0\.1:\d+/) ", line)
        if m:
            try:
                # No token: the dashboard answers with its login page, which is enough here.
                with urllib.request.urlopen(m.group(1), timeout=10) as resp:
                    served.append(resp.status)
            except OSError as e:
                lines.append(f"[test] the dashboard did not answer: {e}\n")


def _step(pattern: str, text: str) -> int:
    m = re.search(pattern, text, re.MULTILINE)
    assert m, f"no line matching {pattern!r} in the demo's output:\n{text[-4000:]}"
    return int(m.group(1))


@pytest.mark.timeout(TIMEOUT + 60)
def test_demo_resumes_from_its_checkpoint_after_a_dead_worker_and_a_dead_node(
    tmp_path: Path,
) -> None:
    mark = uuid.uuid4().hex
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--steps", "10"],
        cwd=ROOT,
        env={**os.environ, MARK: mark, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []
    served: list[int] = []
    reader = threading.Thread(target=_read, args=(proc, lines, served), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        for p in _marked(mark):
            p.kill()
        proc.wait(timeout=30)
        reader.join(30)
        if proc.stdout is not None:
            proc.stdout.close()
        pytest.fail(f"the demo ran over {TIMEOUT} s:\n{''.join(lines)[-4000:]}")
    reader.join(30)
    assert proc.stdout is not None
    proc.stdout.close()
    out = "".join(lines)

    # Nothing it started may survive it: looked for before anything is killed.
    try:
        poll_until(lambda: not _marked(mark), 15, what="the demo's processes to exit")
    except TimeoutError:
        left = [(p.pid, p.name(), " ".join(p.cmdline())[:120]) for p in _marked(mark)]
        for p in _marked(mark):
            p.kill()
        raise AssertionError(f"the demo left processes behind: {left}\n{out[-4000:]}") from None

    assert proc.returncode == 0, out[-16000:]  # a hang's stacks are in it
    killed_at = _step(
        r"act 1 +checkpoint at step (\d+): SIGKILL rank 3 \(pid \d+\) on node-1$", out
    )
    failed_at = _step(r"attempt 0 +failed at step (\d+): rank \d on node-", out)
    resumed = _step(r"attempt 1 +resumed from step (\d+) on node-0, node-1 \(world size 4\)$", out)
    assert 0 < killed_at <= failed_at == resumed, out
    lost_at = _step(r"act 2 +checkpoint at step (\d+): SIGKILL node agent node-1 \(pid \d+\)$", out)
    stopped_at = _step(r"attempt 1 +stopped at step (\d+): node node-1 lost \(.*\)", out)
    reformed = _step(r"attempt 1 +resumed from step (\d+) on node-0 \(world size 2\)$", out)
    assert resumed < lost_at <= stopped_at == reformed, out
    assert _step(r"attempt 1 +finished at step (\d+): all workers succeeded$", out) == 10
    assert re.search(r"^RunResult: state=SUCCEEDED attempts=2 rounds=3", out, re.MULTILINE), out
    assert "processes left behind: 0" in out
    # The dashboard is served while it runs; the token stays in its file.
    dashboard = re.search(
        r"^dashboard: (http://127\.0\.0\.1:\d+/) +\(log in with the token in ", out, re.M
    )
    assert dashboard, out
    assert served == [200], out
    assert re.search(r"^ +[\d.]+ s +act 2: kill to resumed", out, re.MULTILINE), out
    assert re.search(r"^CPU: [\d.]+ s \([\d.]+ s the demo, [\d.]+ s its cluster\)$", out, re.M), out
    assert list(tmp.iterdir()) == [], "the demo left files in its temp dir"
