"""What a python worker's bootstrap does before the target's first line: only what every worker
needs. The modules only a function's return value, a failure or a zip needs (hashlib and hmac,
pickle, json, traceback, zipfile, typing) are not imported before it; a zip still runs as one;
the bootstrap itself is compiled once, then read from its bytecode cache.

Real processes: the real bootstrap, no agent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipapp
from pathlib import Path

from nodeagent._launch import BOOTSTRAP_PATH

TIMEOUT = 60
DEFERRED = ("hashlib", "hmac", "_hashlib", "pickle", "json", "traceback", "zipfile", "typing")
# Written without json: the probe must not import what it looks for.
_PROBE = (
    "import sys\n"
    f"wanted = {DEFERRED!r}\n"
    "print(repr(sorted(m for m in wanted if m in sys.modules)))\n"
)


def _run(tmp_path: Path, target: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(BOOTSTRAP_PATH), "--error-file", str(tmp_path / "error.json")]
    argv += ["--script", str(target), "--"]
    # -I as a bare interpreter has it: no user site, no PYTHON* variables, so only what the
    # bootstrap itself imports is seen (an editable install's .pth hook may import more).
    # As under an agent (this process): the parent-death signal is armed first thing.
    env = {**os.environ, "GELASTIC_AGENT_PID": str(os.getpid())}
    return subprocess.run(
        [argv[0], "-I", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env=env,
    )


def test_a_script_starts_without_the_modules_only_some_workers_need(tmp_path: Path) -> None:
    target = tmp_path / "probe.py"
    target.write_text(_PROBE)
    proc = _run(tmp_path, target)
    assert proc.returncode == 0, proc.stderr
    imported = proc.stdout.strip()
    # site may import some of these itself (a .pth hook): compare with a bare interpreter.
    bare = subprocess.run(
        [sys.executable, "-I", str(target)], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert bare.returncode == 0, bare.stderr
    assert imported == bare.stdout.strip()


def test_a_zipapp_still_runs_as_a_zip(tmp_path: Path) -> None:
    src = tmp_path / "app"
    src.mkdir()
    (src / "__main__.py").write_text("import sys\nprint('zipapp ran', sys.argv[1:])\n")
    target = tmp_path / "app.pyz"
    zipapp.create_archive(src, target, interpreter=sys.executable)
    proc = _run(tmp_path, target)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "zipapp ran []"
    assert not (tmp_path / "error.json").exists()


def test_a_failure_still_writes_its_error_file(tmp_path: Path) -> None:
    target = tmp_path / "fails.py"
    target.write_text("raise ValueError('the probe fails')\n")
    proc = _run(tmp_path, target)
    assert proc.returncode == 1
    assert "ValueError: the probe fails" in proc.stderr
    error = json.loads((tmp_path / "error.json").read_text())
    assert error["message"]["message"] == "ValueError: the probe fails"
    assert "Traceback" in error["message"]["extraInfo"]["py_callstack"]


def test_the_bootstrap_is_compiled_once_and_read_from_its_cache(tmp_path: Path) -> None:
    target = tmp_path / "target.py"
    target.write_text("print('ran')\n")
    cache = tmp_path / "pycache"
    argv = [sys.executable, "-X", f"pycache_prefix={cache}", str(BOOTSTRAP_PATH)]
    argv += ["--error-file", str(tmp_path / "error.json"), "--script", str(target), "--"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    for _ in range(2):
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path, env=env
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "ran\n"
    # A script python is told to run is compiled at every start; an imported one is cached.
    assert [p.name for p in cache.rglob("_bootstrap.*.pyc")], sorted(cache.rglob("*"))
