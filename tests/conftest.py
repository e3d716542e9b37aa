"""Suite-wide test settings: the hypothesis profiles, and a marker per test directory.

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

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

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
