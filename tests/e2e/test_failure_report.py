"""One failure report, in words a user reads, whichever command prints it.

Before: every failure line said `(recorded its error, still exiting)`, also for a worker long
gone; a rank that hit the same error on its own was labelled `collateral: failed after the root
cause`; and `submit --watch` showed `(ran PYTHON on node N)` inside the traceback field while
`gelastic run` had an `executable:` row.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import cli
from gelastic.local import LocalCluster, poll_until
from tests.e2e.conftest import PY, assert_no_leftovers

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 90

# Both ranks hit the same bad line: rank 0 once rank 1 ignores the stop, rank 1 once rank 0's
# error is on file, so that rank 1 fails on its own, after the root cause.
SAME_ERROR = textwrap.dedent(
    """
    import os, pathlib, signal, time
    rank = int(os.environ["RANK"])
    ready = pathlib.Path(os.environ["OUT"]) / "rank1-ignores-sigterm"
    mine = pathlib.Path(os.environ["TORCHELASTIC_ERROR_FILE"])
    deadline = time.monotonic() + 30
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        ready.touch()
        root = mine.parent.parent / "0" / mine.name
        while not root.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    raise ValueError("bad config: lr must be positive")
    """
)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(nodes=1, slots=2, workdir=tmp_path_factory.mktemp("report-cluster")) as c:
        yield c
    assert_no_leftovers(c)


def _cli(cluster: LocalCluster, *args: str) -> int:
    return cli.main(["--coordinator", cluster.address, "--token-file", cluster.token_file, *args])


def test_submit_watch_shows_the_executable_in_a_row_of_its_own(
    shared: LocalCluster, capfd: pytest.CaptureFixture[str]
) -> None:
    code = _cli(shared, "submit", "--watch", "--", PY, "-c", "import sys; sys.exit(3)")
    out, err = capfd.readouterr()
    assert code == cli.EXIT_FAILED, (out, err)
    lines = out.splitlines()
    assert f"  executable: {PY}" in lines, out
    (traceback,) = [line for line in lines if line.startswith("  traceback : ")]
    assert traceback.startswith("  traceback : Process exited with exit code 3 (pid "), traceback
    assert "(ran " not in out, out


def test_a_rank_with_the_same_error_also_failed(
    shared: LocalCluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = _cli(
        shared,
        "submit",
        "--nproc-per-node",
        "2",
        "--stop-grace",
        "20",
        "--env",
        f"OUT={tmp_path}",
        "--",
        PY,
        "-c",
        SAME_ERROR,
    )
    out, _ = capfd.readouterr()
    assert code == cli.EXIT_OK
    job = shared.client.job(out.split()[0])

    def both_in() -> bool:
        r = job.poll()
        return r is not None and len(r.failures) == 2 and all(f.pid for f in r.failures.values())

    poll_until(both_in, TIMEOUT, what="both ranks' failures")
    code = _cli(shared, "result", job.job_id)
    out, err = capfd.readouterr()
    assert code == cli.EXIT_FAILED, (out, err)
    root, others = out.split("Other Failures:")
    assert "  rank      : 0 (local_rank: 0)" in root
    (order,) = [line for line in others.splitlines() if line.startswith("  order     : ")]
    # Both times are the same host's; they may still be closer than their resolution.
    assert re.fullmatch(
        r"  order     : also failed, \d+\.\d{3} s after the root cause"
        r"(, within the uncertainty of the times \(\d+\.\d{3} s\))?, with the same error",
        order,
    ), order
    assert "collateral" not in out and "still exiting" not in out
    assert out.count(f"  executable: {PY}") == 2, out


def test_gelastic_run_says_what_happened_without_still_exiting(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text('raise ValueError("boom")\n')
    proc = subprocess.run(
        [PY, "-m", "gelastic", "run", "bad.py"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    failed = [line for line in proc.stderr.splitlines() if " rank 0 failed on " in line]
    assert failed and all("(recorded its error)" in line for line in failed), proc.stderr
    assert "still exiting" not in proc.stderr
    assert f"  executable: {PY}" in proc.stderr.splitlines(), proc.stderr
    assert "(ran " not in proc.stderr.split("Root Cause")[1]
