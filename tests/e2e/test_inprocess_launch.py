"""`gelastic.launch.launch` against torch's own `elastic_launch`, for the same functions.

Real processes on both sides: an embedded coordinator and agent with two real workers, and
torch's LocalElasticAgent with its own two. The results, and the failure torch's
`ChildFailedError.get_first_failure()` names, must read the same.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.results import PickledReturnValue
from gelastic.launch import LaunchConfig, launch
from tests.workloads import launched

torch_api = pytest.importorskip("torch.distributed.launcher.api")
torch_errors = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The workers import `tests.workloads.launched` from the caller's working directory.
    monkeypatch.chdir(ROOT)
    yield


def _torch_config(nproc: int, max_restarts: int) -> Any:
    return torch_api.LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        max_restarts=max_restarts,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id=f"t{uuid.uuid4().hex[:8]}",
        monitor_interval=0.1,
    )


def test_launch_with_torchs_config_returns_every_ranks_value_as_torchs_launcher() -> None:
    config = _torch_config(nproc=2, max_restarts=1)
    ours = launch(config, launched.rank_and_value)(21)
    # A tuple comes back as a tuple: the caller is the only party of its embedded cluster.
    assert ours == {0: (0, 42, "default_role"), 1: (1, 42, "default_role")}
    theirs = torch_api.elastic_launch(config, launched.rank_and_value)(21)
    assert ours == theirs


def test_launch_without_trust_leaves_pickles_unloaded() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=0)
    (value,) = launch(config, launched.rank_and_value, trust_pickles=False)(1).values()
    assert isinstance(value, PickledReturnValue) and value.trusted_load()[1:] == (1, "default_role")
    assert launch(config, launched.fail_on_rank)(5, "unused") == {0: "ok"}


def test_a_program_entrypoint_returns_none_for_each_rank() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, max_restarts=0)
    assert launch(config, sys.executable)("-c", "import os; assert os.environ['RANK']") == {
        0: None,
        1: None,
    }


def _first_failure(config: Any, launcher: Any) -> tuple[Any, int, Any]:
    with pytest.raises(torch_errors.ChildFailedError) as info:
        launcher(config, launched.fail_on_rank)(1, "rank one fails")
    rank, failure = info.value.get_first_failure()
    return info.value, rank, failure


def test_a_failure_raises_torchs_child_failed_error_with_torchs_first_failure() -> None:
    config = _torch_config(nproc=2, max_restarts=0)
    ours, rank, mine = _first_failure(config, launch)
    theirs, torch_rank, torch_failure = _first_failure(config, torch_api.elastic_launch)
    assert type(ours) is type(theirs) and ours.name == theirs.name == "fail_on_rank"
    assert sorted(ours.failures) == sorted(theirs.failures) == [1]
    assert (rank, mine.local_rank, mine.exitcode) == (
        torch_rank,
        torch_failure.local_rank,
        torch_failure.exitcode,
    )
    assert type(mine) is type(torch_failure) and type(mine.timestamp) is int
    # The message is torch's: the error file's nested message, not a string of ours.
    assert isinstance(mine.message, dict) and isinstance(torch_failure.message, dict)
    assert mine.message["message"] == torch_failure.message["message"]
    assert mine.message["message"] == "ValueError: rank one fails"
    assert set(torch_failure.message["extraInfo"]) <= set(mine.message["extraInfo"])
    assert "raise ValueError(message)" in mine.message["extraInfo"]["py_callstack"]
    assert set(mine.error_file_data) == set(torch_failure.error_file_data)
    assert Path(mine.error_file).is_file() and mine.pid > 0
    assert "Root Cause (first observed failure):" in str(ours)


def test_a_death_by_signal_reads_as_torchs() -> None:
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, max_restarts=0)
    with pytest.raises(torch_errors.ChildFailedError) as info:
        launch(config, sys.executable)("-c", "import os, signal; os.kill(os.getpid(), 9)")
    rank, failure = info.value.get_first_failure()
    assert (rank, failure.exitcode, failure.error_file) == (0, -9, "<N/A>")
    assert failure.message == f"Signal 9 (SIGKILL) received by PID {failure.pid}"
