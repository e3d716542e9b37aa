"""How a python worker ends under the bootstrap: stacks on SIGUSR1, and a cheap finalization.

Real processes (the real bootstrap, no agent, no torch): a worker asked with SIGUSR1 prints
every thread's stack to stderr and runs on; a worker whose target is done, by success or by a
recorded failure, leaves what it built out of the interpreter's last collections (they cost a
torch worker about a second of CPU after its work), while atexit handlers run and files it
never closed are still flushed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from gelastic.local import poll_until
from nodeagent._launch import BOOTSTRAP_PATH

# An atexit handler runs after the bootstrap's main() returned, as the interpreter ends; a file
# the script never closed is flushed when module teardown frees it, after that.
_END_PROBE = textwrap.dedent(
    """
    import atexit, gc, sys

    unclosed = open("unclosed.txt", "w")
    unclosed.write("buffered until the end\\n")
    atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
    if sys.argv[1:] == ["fail"]:
        raise ValueError("the probe fails")
    """
)


def _bootstrap(tmp_path: Path, script: str, *args: str) -> subprocess.Popen[str]:
    target = tmp_path / "target.py"
    target.write_text(script)
    argv = [sys.executable, str(BOOTSTRAP_PATH), "--error-file", str(tmp_path / "error.json")]
    argv += ["--script", str(target), "--", *args]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )


def test_a_worker_that_succeeded_skips_the_last_collections_and_still_flushes_its_files(
    tmp_path: Path,
) -> None:
    proc = _bootstrap(tmp_path, _END_PROBE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "frozen at exit: True" in out, out
    assert (tmp_path / "unclosed.txt").read_text() == "buffered until the end\n"
    assert not (tmp_path / "error.json").exists()


def test_a_worker_that_failed_records_its_error_then_ends_the_same_way(tmp_path: Path) -> None:
    proc = _bootstrap(tmp_path, _END_PROBE, "fail")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "ValueError: the probe fails" in err
    assert "the probe fails" in (tmp_path / "error.json").read_text()
    assert "frozen at exit: True" in out, out
    assert (tmp_path / "unclosed.txt").read_text() == "buffered until the end\n"


def test_sigusr1_prints_every_threads_stack_and_the_worker_runs_on(tmp_path: Path) -> None:
    ready, go = tmp_path / "ready", tmp_path / "go"
    script = textwrap.dedent(
        f"""
        import os, time

        def waiting_for_go():
            open({str(ready)!r}, "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
                time.sleep(0.05)

        waiting_for_go()
        print("ran on", flush=True)
        """
    )
    proc = _bootstrap(tmp_path, script)
    try:
        poll_until(ready.exists, 60, what="the worker to start")
        # faulthandler's handler writes the dump in the signal handler itself; without it the
        # signal's default action ends the worker.
        proc.send_signal(signal.SIGUSR1)
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "ran on" in out
    assert "Current thread" in err and "in waiting_for_go" in err, err
