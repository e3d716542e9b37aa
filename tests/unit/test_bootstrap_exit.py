"""How a python worker ends under the bootstrap: stacks on SIGUSR1, and a cheap finalization.

Real processes (the real bootstrap, no agent): a worker asked with SIGUSR1 prints every
thread's stack to stderr and runs on; a worker whose target is done, by success or by a
recorded failure, leaves what it built out of the interpreter's last collections (they cost a
torch worker about a second of CPU after its work), while atexit handlers run and files it
never closed are still flushed. A worker that loaded (real) torch skips the interpreter's
teardown, where torch's native threads now and then abort a rank that did its work, and still
gets what python promises at exit; one without torch ends as python ends it.
"""

from __future__ import annotations

import gzip
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


# A worker that loaded torch, whose teardown would abort it (as torch's native threads now and
# then do while python tears the interpreter down), with what python promises at exit to check.
_TORCH_END_PROBE = textwrap.dedent(
    """
    import atexit, gzip, os, sys, threading, time, types
    import torch

    class AbortsInTeardown:
        def __del__(self, abort=os.abort):
            abort()

    holder = types.ModuleType("holder")  # its dict is cleared in teardown, frozen or not
    holder.kept_until_teardown = AbortsInTeardown()
    sys.modules["holder"] = holder
    zipped = gzip.open("zipped.txt.gz", "wt")
    zipped.write("through two wrappers\\n")
    plain = open("plain.txt", "w")
    plain.write("buffered until the end\\n")

    def late_writer():
        time.sleep(0.2)
        with open("thread.txt", "w") as f:
            f.write("joined\\n")

    threading.Thread(target=late_writer).start()
    atexit.register(lambda: print("atexit ran", flush=False))
    print("last line of the script")
    if sys.argv[1:] == ["exit3"]:
        sys.exit(3)
    if sys.argv[1:] == ["raise"]:
        raise ValueError("the probe fails")
    """
)


@pytest.mark.parametrize(("how", "code"), [("return", 0), ("exit3", 3), ("raise", 1)])
def test_a_torch_worker_ends_without_the_teardown_and_with_what_python_promises(
    tmp_path: Path, how: str, code: int
) -> None:
    proc = _bootstrap(tmp_path, _TORCH_END_PROBE, how)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert out.splitlines() == ["last line of the script", "atexit ran"], (out, err)
    assert (tmp_path / "thread.txt").read_text() == "joined\n"  # non-daemon threads joined
    assert (tmp_path / "plain.txt").read_text() == "buffered until the end\n"
    with gzip.open(tmp_path / "zipped.txt.gz", "rt") as f:
        assert f.read() == "through two wrappers\n"
    assert ("the probe fails" in err) == (how == "raise")
    assert (tmp_path / "error.json").exists() == (how == "raise")


def test_a_worker_without_torch_ends_as_python_ends_it(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, sys, types

        class SaysSoInTeardown:
            def __del__(self, write=os.write):
                write(1, b"teardown ran\\n")

        holder = types.ModuleType("holder")  # its dict is cleared in teardown, frozen or not
        holder.kept_until_teardown = SaysSoInTeardown()
        sys.modules["holder"] = holder
        """
    )
    proc = _bootstrap(tmp_path, script)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == "teardown ran\n"
