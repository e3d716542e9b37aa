"""What a node agent does at start loads none of what it needs only once a job runs.

A fresh interpreter imports `nodeagent.cli` (as `python -m nodeagent.cli` does) and then runs
the steps of the agent's start that look for optional things: the site plug-ins (here no
package declares any) and NVML (here its library cannot be loaded). It prints `sys.modules`;
none of the modules below may be there. tests/e2e/test_agent_footprint.py asks a real idle
agent the same.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

JOB_TIME = (
    # a round's worker group and what supervises it
    "nodeagent._workers",
    "nodeagent._group_supervisor",
    "nodeagent._group_health",
    "nodeagent._group_results",
    "nodeagent._health",
    "nodeagent._watchdog",
    "nodeagent._inotify",
    "nodeagent._errorfile",
    # preload jobs
    "nodeagent._zygote",
    "nodeagent._store_host",
    # worker samples and the pid file's start times
    "psutil",
    # entry points, read only where a package declares the agent's group
    "importlib.metadata",
    "email",
    "zipfile",
    # NVML, only where its library loads
    "pynvml",
    # metrics, only with --metrics-port
    "prometheus_client",
    "client.metrics_http",
    "aiohttp",
)

START = """
import nodeagent.cli
import nodeagent._plugins
from nodeagent._plugins import load_agent_plugins

# A group no installed package declares, as on a host without site plug-ins (whatever is
# installed where the test runs).
nodeagent._plugins.ENTRY_POINTS = "gelastic.test_no_such_group"
load_agent_plugins((), timeout=1.0)
"""
NVML = """
from nodeagent._gpus import discover_gpus, load_nvml

nvml = load_nvml("libgelastic-test-no-such-nvml.so.1")
devices, _, note = discover_gpus("auto", nvml, load=False)
assert devices == [] and "NVML Shared Library Not Found" in note, note
"""
LIST = """
import json, sys
print(json.dumps(sorted(k for k, v in sys.modules.items() if v is not None)))
"""


def _loaded_after(code: str) -> list[str]:
    """The modules of JOB_TIME a fresh interpreter holds once it has run `code`."""
    out = subprocess.run(
        [sys.executable, "-c", code + LIST], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    modules = set(json.loads(out.stdout))
    return sorted(m for m in modules if any(m == j or m.startswith(j + ".") for j in JOB_TIME))


def test_an_agents_start_loads_nothing_a_job_needs_first() -> None:
    assert _loaded_after(START) == []


def test_gpus_looked_for_where_nvmls_library_is_missing_load_no_pynvml() -> None:
    assert _loaded_after(START + NVML) == []


def test_without_nvmls_library_auto_and_a_list_read_as_pynvml_would_say() -> None:
    pynvml = pytest.importorskip("pynvml")
    from nodeagent._gpus import NVML_LIBRARY, discover_gpus, load_nvml

    missing = "libgelastic-test-no-such-nvml.so.1"
    stand_in = load_nvml(missing)
    assert stand_in is not None and stand_in is not pynvml
    assert discover_gpus("auto", stand_in, load=False)[2] == (
        "GPUs: none (NVML is not usable here: NVML Shared Library Not Found)"
    )
    with pytest.raises(ValueError, match="NVML is not usable here: NVML Shared Library Not Found"):
        discover_gpus((0,), stand_in, load=False)
    try:
        import ctypes

        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        # pynvml itself says the same where the library is missing (as here).
        assert (
            discover_gpus("auto", pynvml, load=False)[2]
            == discover_gpus("auto", stand_in, load=False)[2]
        )
