"""An idle node agent imports only what it needs: no HTTP stack, no Prometheus client unless
`--metrics-port`, no NVML unless GPUs are asked for (or, with `--gpus auto`, where its library
is missing), no libcrypto (hashlib, hmac, ssl), and nothing that only a job needs (the worker
group's supervision, psutil, the zygote) or a declared site plug-in (importlib.metadata).

A real coordinator and a real `nodeagent` process. What the agent has imported is read from
inside it: a `sitecustomize` on the agent's PYTHONPATH (test-only, nothing in the agent knows
of it) writes `sys.modules` to a file when the agent gets SIGUSR1. The agent is asked once it
has registered.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import textwrap
from pathlib import Path

import pytest

from gelastic.local import LocalCluster, poll_until
from nodeagent._gpus import NVML_LIBRARY

TIMEOUT = 30.0
HOOK = """
import json, os, signal, sys

def _dump(signum, frame):
    path = os.environ["GELASTIC_TEST_MODULES_FILE"]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(sorted(k for k, v in sys.modules.items() if v is not None), f)
    os.replace(tmp, path)

signal.signal(signal.SIGUSR1, _dump)
"""
HEAVY = ("aiohttp", "prometheus_client", "pynvml", "_hashlib", "hashlib", "hmac", "_ssl", "ssl")
JOB_TIME = (
    "nodeagent._workers",
    "nodeagent._group_supervisor",
    "nodeagent._watchdog",
    "nodeagent._inotify",
    "nodeagent._zygote",
    "nodeagent._store_host",
    "client.metrics_http",
    "psutil",
    "ctypes",
    "importlib.metadata",
    "email",
    "zipfile",
)
"""Loaded with a job's first round, a preload job, a metrics port or a declared plug-in."""


def _idle_agent_modules(tmp_path: Path, agent_args: tuple[str, ...] = ()) -> set[str]:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(HOOK))
    out = tmp_path / "modules.json"
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    cluster = LocalCluster(nodes=0, workdir=tmp_path / "cluster", agent_args=agent_args)
    try:
        cluster.start()
        # Returns once the agent has registered: its session is up and heartbeating.
        cluster.start_agent(
            "node-0", env={"PYTHONPATH": path, "GELASTIC_TEST_MODULES_FILE": str(out)}
        )
        agent = cluster.agents["node-0"].popen
        agent.send_signal(signal.SIGUSR1)
        poll_until(out.exists, TIMEOUT, what="the agent to list its modules")
        modules = set(json.loads(out.read_text()))
    finally:
        cluster.stop()
    assert "nodeagent.session" in modules  # it is the agent that answered
    return modules


def test_an_idle_agent_imports_no_http_metrics_nvml_or_crypto(tmp_path: Path) -> None:
    modules = _idle_agent_modules(tmp_path)
    loaded = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert loaded == [], loaded


def test_an_idle_agent_imports_nothing_only_a_job_needs(tmp_path: Path) -> None:
    modules = _idle_agent_modules(tmp_path)
    loaded = sorted(m for m in modules if any(m == j or m.startswith(j + ".") for j in JOB_TIME))
    assert loaded == [], loaded


def test_gpus_auto_without_nvmls_library_imports_no_pynvml(tmp_path: Path) -> None:
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        pass
    else:
        pytest.skip(f"{NVML_LIBRARY} loads here: the agent rightly imports pynvml")
    modules = _idle_agent_modules(tmp_path, ("--gpus", "auto"))
    assert "nodeagent._gpus" in modules
    assert sorted(m for m in modules if m.split(".")[0] == "pynvml") == []
