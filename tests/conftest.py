"""Suite-wide test settings: the hypothesis profiles, a marker per test directory, and the check
that every FAILED result a test sees has a root cause.

GELASTIC_HYPOTHESIS_PROFILE picks one (`make test` sets ci, `make fuzz` sets fuzz); unset, it is
ci when $CI is set and dev otherwise.

- ci: derandomized, so a CI run is reproducible and a red build is red again on rerun; no example
  database (a CI checkout is thrown away) and the failing example's blob is printed instead.
- dev: random, remembering failures in .hypothesis/ so the next local run tries them first.
- fuzz: random and ten times the examples, for a long hunt (`make fuzz`).

Property tests that need more than the profile's budget ask for a multiple of it
(`max_examples=15 * settings().max_examples`), so the profiles scale every test alike.
GELASTIC_HYPOTHESIS_MAX_EXAMPLES overrides the base budget of any profile (a short fuzz pass).

Every test carries the marker of the directory it lives in (`DIRECTORY_MARKERS`), so
`pytest -m e2e` or `-m "not e2e"` picks a tier without a hand-written `pytestmark` per file.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

import client._client
import client.wire
from client.model import RunResult
from tests._etcd import EtcdServer
from tests.gpu import GPU_TESTS_ENV, nvidia_gpu_present

PROFILE_ENV = "GELASTIC_HYPOTHESIS_PROFILE"
MAX_EXAMPLES_ENV = "GELASTIC_HYPOTHESIS_MAX_EXAMPLES"

# Timing is measured in bench/, not by tests: a loaded shared machine must not fail a property.
settings.register_profile(
    "ci", derandomize=True, database=None, print_blob=True, deadline=None, max_examples=100
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.register_profile("fuzz", deadline=None, print_blob=True, max_examples=1000)


def _profile_name() -> str:
    name = os.environ.get(PROFILE_ENV) or ("ci" if os.environ.get("CI") else "dev")
    if name not in ("ci", "dev", "fuzz"):
        raise ValueError(f"{PROFILE_ENV}={name!r}: expected ci, dev or fuzz")
    return name


def _load_profile() -> None:
    name = _profile_name()
    override = os.environ.get(MAX_EXAMPLES_ENV)
    if override:
        try:
            base = int(override)
        except ValueError:
            raise ValueError(f"{MAX_EXAMPLES_ENV}={override!r}: expected a whole number") from None
        if base < 1:
            raise ValueError(f"{MAX_EXAMPLES_ENV}={override!r}: expected at least 1")
        settings.register_profile(f"{name}-{base}", settings.get_profile(name), max_examples=base)
        name = f"{name}-{base}"
    settings.load_profile(name)


_load_profile()


_TESTS_DIR = Path(__file__).resolve().parent
_GPU_DIR = _TESTS_DIR / "gpu"

DIRECTORY_MARKERS = {
    "unit": "unit",
    "service": "service",
    "security": "security",
    "e2e": "e2e",
    "browser": "browser",
    "gpu": "gpu",
}
"""tests/<directory> -> the marker its tests get (declared in pyproject.toml). tests/workloads
holds the programs workers run, no tests."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/gpu is not collected on a host without an NVIDIA GPU (a skip there would fail CI),
    unless GELASTIC_GPU_TESTS=1 asks for it (`make test-gpu`, where it skips saying why)."""
    path = collection_path.resolve()
    if path != _GPU_DIR and _GPU_DIR not in path.parents:
        return None
    if os.environ.get(GPU_TESTS_ENV) == "1" or nvidia_gpu_present():
        return None
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its directory's marker (tests/e2e/... gets `e2e`)."""
    for item in items:
        try:
            parts = item.path.resolve().relative_to(_TESTS_DIR).parts
        except ValueError:
            continue  # collected from outside tests/
        if len(parts) < 2:
            continue
        marker = DIRECTORY_MARKERS.get(parts[0])
        if marker is None:
            raise pytest.UsageError(
                f"{item.nodeid}: tests/{parts[0]} has no marker; add it to DIRECTORY_MARKERS "
                "in tests/conftest.py and to the markers in pyproject.toml"
            )
        item.add_marker(marker)


def pytest_report_header() -> str:
    return (
        f"hypothesis profile: {settings.get_current_profile_name()} "
        f"(max_examples={settings().max_examples}, "
        f"derandomize={settings().derandomize})"
    )


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session (tests keep apart by key prefix); see tests/_etcd.py."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_url(etcd_server: EtcdServer) -> str:
    """An etcd store URL with a prefix of this test's own."""
    return etcd_server.url(f"t/{uuid.uuid4().hex}")


# ---- every FAILED result has a root cause --------------------------------------------------------

_ROOTLESS: list[str] = []
"""Jobs whose FAILED RunResult had no failure (so no root cause), as this process decoded or
encoded them since the current test began."""


def _rootless(result: RunResult, job_id: str) -> None:
    if result.is_failed() and result.root_cause is None:
        _ROOTLESS.append(job_id or result.job_id or "(no job id)")


def _checked_decode(decode: Callable[..., RunResult]) -> Callable[..., RunResult]:
    @functools.wraps(decode)
    def result_from_pb(m: Any, job_id: str = "", name: str = "") -> RunResult:
        result = decode(m, job_id, name)
        _rootless(result, job_id)
        return result

    return result_from_pb


def _checked_encode(encode: Callable[[RunResult], Any]) -> Callable[[RunResult], Any]:
    @functools.wraps(encode)
    def result_to_pb(r: RunResult) -> Any:
        _rootless(r, r.job_id)
        return encode(r)

    return result_to_pb


# The one place a client turns a job message into a RunResult (client.wire.result_from_pb, which
# client._client holds by name), and the one place a coordinator in this process puts a result
# into one (client.wire.result_to_pb, which job_to_pb looks up at each call). Results that other
# processes decode (a `gelastic` CLI or `gelastic run` a test starts) are out of reach here.
client.wire.result_from_pb = _checked_decode(client.wire.result_from_pb)
client._client.result_from_pb = client.wire.result_from_pb  # type: ignore[attr-defined]
client.wire.result_to_pb = _checked_encode(client.wire.result_to_pb)


@pytest.fixture(autouse=True)
def _every_failed_result_has_a_root_cause() -> Iterator[None]:
    """Fail a test (at teardown) in which a FAILED RunResult had no failure, so no root cause:
    a job that fails without a worker's failure carries its own at key -1."""
    start = len(_ROOTLESS)
    yield
    found = _ROOTLESS[start:]
    del _ROOTLESS[start:]
    if found:
        jobs = ", ".join(sorted(set(found))[:10])
        pytest.fail(
            f"a FAILED RunResult without a root cause (its failures are empty) for job {jobs}: "
            "every failed job must name one (see coordinator/_cluster_failures.JOB_FAILURE_RANK)",
            pytrace=False,
        )
