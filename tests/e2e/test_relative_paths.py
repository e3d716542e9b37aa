"""A relative script or program path of a job resolves against the worker's directory, which
without `--cwd` is the agent's, not the submitter's: the failure says so and says what to do.

Before, the report read only ``can't open file '<agent's dir>/ddp.py': [Errno 2] No such file
or directory``, and for a program ``no such file (No such file or directory)``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from client import cli
from gelastic.local import LocalCluster
from tests.e2e.conftest import PY, assert_no_leftovers


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("agent-dir").resolve()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, agent_dir: Path) -> Iterator[LocalCluster]:
    # The agent runs in a directory of its own, as one started elsewhere on a host does.
    here = os.getcwd()
    os.chdir(agent_dir)
    try:
        c = LocalCluster(nodes=1, slots=2, workdir=tmp_path_factory.mktemp("paths-cluster"))
        c.start()
    finally:
        os.chdir(here)
    try:
        yield c
    finally:
        c.stop()
    assert_no_leftovers(c)


@pytest.fixture
def submitter_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "ddp.py").write_text("print('trained')\n")
    prog = tmp_path / "train.sh"
    prog.write_text("#!/bin/sh\necho trained\n")
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _submit(cluster: LocalCluster, *args: str) -> int:
    return cli.main(
        [
            "--coordinator",
            cluster.address,
            "--token-file",
            cluster.token_file,
            "submit",
            "--watch",
            "--wait-timeout",
            "90",
            *args,
        ]
    )


def test_a_relative_script_names_the_directory_it_was_looked_for_in(
    shared: LocalCluster,
    agent_dir: Path,
    submitter_dir: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    code = _submit(shared, "--", PY, "ddp.py")
    out, err = capfd.readouterr()
    assert code == cli.EXIT_FAILED, (out, err)
    report = out + err
    assert f"can't open file '{agent_dir / 'ddp.py'}'" in report
    assert f"ddp.py was looked for in the worker's directory {agent_dir}" in report, report
    assert "gelastic submit --cwd DIR, cwd= in the API" in report
    # What it suggests works.
    code = _submit(shared, "--cwd", str(submitter_dir), "--", PY, "ddp.py")
    out, err = capfd.readouterr()
    assert code == cli.EXIT_OK, (out, err)


def test_a_relative_program_names_the_directory_it_was_looked_for_in(
    shared: LocalCluster,
    agent_dir: Path,
    submitter_dir: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    code = _submit(shared, "--", "./train.sh")
    out, err = capfd.readouterr()
    assert code == cli.EXIT_FAILED, (out, err)
    report = out + err
    assert f"no such file in the worker's directory '{agent_dir}'" in report, report
    assert "gelastic submit --cwd DIR, cwd= in the API" in report
    code = _submit(shared, "--cwd", str(submitter_dir), "--", "./train.sh")
    out, err = capfd.readouterr()
    assert code == cli.EXIT_OK, (out, err)
